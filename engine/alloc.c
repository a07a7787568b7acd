/*
 * alloc.c — per-device caching allocators with accounting (DESIGN.md §3).
 *
 * Blocks are rounded up to size classes (64-byte granules below 1 MiB, then quarter powers of two) and
 * kept in per-class free lists when released, so a training loop that allocates the same shapes every
 * step stops calling the system allocator after its first step. `current` counts bytes handed to live
 * storages (the requested sizes' classes), `cached` what sits in free lists, `peak` the max of current.
 * A limit turns allocations past it into an error the recipe can catch (and makes OOM testable).
 *
 * Kernel scratch (tide_scratch_alloc): the temporaries a kernel holds for the length of one call come from the
 * same pools, so they reuse cached blocks, count in current / peak, obey the limit and get the retry after
 * emptying the cache; their sizes are kept here because a kernel frees them by pointer alone.
 *
 * Guard mode (a test hook, ggml's test-backend-ops idea): every block gets GUARD sentinel bytes before and
 * after the bytes it hands out, written through the backend at each allocation and compared at each release,
 * so a kernel that writes outside its output is counted and named instead of silently corrupting a neighbour.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"

#define N_DEVICES 9          /* cpu + 8 cuda devices */
#define N_CLASSES 160

typedef struct free_block { void *p; struct free_block *next; } free_block;

typedef struct {
    tide_memory_stats st;
    free_block *lists[N_CLASSES];
    size_t class_size[N_CLASSES];
} device_pool;

static device_pool g_pool[N_DEVICES];
static int g_init;
/* free-list records not in use, kept for the next release: a cached block costs no malloc of its record */
static free_block *g_spare_records;

static free_block *record_get(void)
{
    free_block *fb = g_spare_records;
    if (fb) { g_spare_records = fb->next; return fb; }
    return malloc(sizeof *fb);
}

static void record_put(free_block *fb)
{
    fb->next = g_spare_records;
    g_spare_records = fb;
}

#define GUARD 64               /* bytes each side; a multiple of 64 keeps the data 64-byte aligned */
#define GUARD_BYTE 0xA5
static int g_guard;
static int64_t g_guard_violations;
static char g_guard_msg[256];

static void init_classes(void)
{
    for (int d = 0; d < N_DEVICES; d++) {
        size_t s = 64;
        for (int c = 0; c < N_CLASSES; c++) {
            g_pool[d].class_size[c] = s;
            if (s < (1u << 20)) s = s < 4096 ? s * 2 : s + 4096 * (s / 16384 + 1);
            else s = s + s / 4;
            s = (s + 63) & ~(size_t)63;
        }
    }
    g_init = 1;
}

static int size_class(device_pool *pool, size_t n)
{
    int lo = 0, hi = N_CLASSES - 1;
    if (n > pool->class_size[hi]) return -1;                /* huge: exact size, not cached */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (pool->class_size[mid] >= n) hi = mid; else lo = mid + 1;
    }
    return lo;
}

/* a block back to the device (no status to return: a table without free leaks rather than crashes) */
static void release_block(int device, void *p)
{
    if (!TIDE_KERNEL_MISSING(device, free, "free")) tide_backend_for(device)->free(p);
}

int tide_device_valid(int device) { return device >= 0 && device < N_DEVICES; }

int tide_alloc_guard_enable(void)
{
    for (int d = 0; d < N_DEVICES; d++)
        if (g_pool[d].st.n_alloc > 0)
            return tide_set_error("alloc guard: must be enabled before the first allocation (device %d has made %lld)", d,
                                  (long long)g_pool[d].st.n_alloc);
    g_guard = 1;
    return 0;
}

int64_t tide_alloc_guard_violations(const char **last)
{
    if (last) *last = g_guard_msg;
    return g_guard_violations;
}

static const unsigned char *guard_pattern(void)
{
    static unsigned char pat[GUARD];
    if (pat[0] != GUARD_BYTE) memset(pat, GUARD_BYTE, sizeof pat);
    return pat;
}

/* sentinels around the nbytes at base + GUARD */
static int guard_write(int device, unsigned char *base, size_t nbytes)
{
    const unsigned char *pat = guard_pattern();
    int rc = TIDE_DISPATCH(device, memcpy_h2d, "alloc guard", base, pat, GUARD);
    if (!rc) rc = TIDE_DISPATCH(device, memcpy_h2d, "alloc guard", base + GUARD + nbytes, pat, GUARD);
    return rc;
}

static void guard_check(int device, unsigned char *base, size_t nbytes)
{
    unsigned char before[GUARD], after[GUARD];
    const unsigned char *pat = guard_pattern();
    if (TIDE_DISPATCH(device, memcpy_d2h, "alloc guard", before, base, GUARD) ||
        TIDE_DISPATCH(device, memcpy_d2h, "alloc guard", after, base + GUARD + nbytes, GUARD)) {
        g_guard_violations++;
        snprintf(g_guard_msg, sizeof g_guard_msg, "alloc guard: could not read the guards of a %zu-byte block: %s",
                 nbytes, tide_last_error());
        return;
    }
    int lo = -1, hi = -1;
    for (int i = 0; i < GUARD; i++) if (before[i] != pat[i]) { lo = GUARD - i; break; }
    for (int i = GUARD - 1; i >= 0; i--) if (after[i] != pat[i]) { hi = i + 1; break; }
    if (lo < 0 && hi < 0) return;
    g_guard_violations++;
    char d[32];
    snprintf(g_guard_msg, sizeof g_guard_msg, "a %zu-byte block on %s was written outside its bounds: %d byte(s) before it, "
             "%d byte(s) past its end", nbytes, tide_device_str(device, d, sizeof d), lo < 0 ? 0 : lo, hi < 0 ? 0 : hi);
}

void *tide_alloc_block(int device, size_t nbytes, size_t *capacity)
{
    if (!g_init) init_classes();
    if (!tide_device_valid(device)) { tide_set_error("alloc: device %d out of range", device); return NULL; }
    if (TIDE_KERNEL_MISSING(device, malloc, "alloc")) return NULL;
    const tide_backend *bk = tide_backend_for(device);
    device_pool *pool = &g_pool[device];
    if (nbytes == 0) nbytes = 1;
    size_t need = g_guard ? nbytes + 2 * GUARD : nbytes;
    int c = size_class(pool, need);
    size_t cap = c >= 0 ? pool->class_size[c] : ((need + 63) & ~(size_t)63);
    if (pool->st.limit > 0 && pool->st.current + (int64_t)cap > pool->st.limit) {
        tide_set_error("out of memory on %s: allocating %zu bytes with %lld in use exceeds the limit of %lld bytes",
                       device == 0 ? "cpu" : "cuda", cap, (long long)pool->st.current,
                       (long long)pool->st.limit);
        return NULL;
    }
    void *p = NULL;
    if (c >= 0 && pool->lists[c]) {
        free_block *fb = pool->lists[c];
        pool->lists[c] = fb->next;
        p = fb->p;
        record_put(fb);
        pool->st.cached -= (int64_t)cap;
        pool->st.n_cache_hits++;
    } else {
        p = bk->malloc(cap);
        if (!p) {
            /* give cached blocks back to the system and try once more */
            tide_memory_empty_cache(device);
            p = bk->malloc(cap);
        }
        if (!p) {
            tide_set_error("out of memory on %s: could not allocate %zu bytes (%lld in use)",
                           device == 0 ? "cpu" : "cuda", cap, (long long)pool->st.current);
            return NULL;
        }
    }
    pool->st.current += (int64_t)cap;
    pool->st.n_alloc++;
    if (pool->st.current > pool->st.peak) pool->st.peak = pool->st.current;
    *capacity = cap;
    if (g_guard) {
        if (guard_write(device, p, nbytes)) { pool->st.current -= (int64_t)cap; release_block(device, p); return NULL; }
        p = (char *)p + GUARD;
    }
    return p;
}

void tide_free_block(int device, void *p, size_t capacity, size_t nbytes)
{
    if (!p) return;
    device_pool *pool = &g_pool[device];
    if (nbytes == 0) nbytes = 1;
    if (g_guard) {
        p = (char *)p - GUARD;
        guard_check(device, p, nbytes);
    }
    pool->st.current -= (int64_t)capacity;
    int c = size_class(pool, g_guard ? nbytes + 2 * GUARD : nbytes);
    free_block *fb = c >= 0 && pool->class_size[c] == capacity ? record_get() : NULL;
    if (!fb) { release_block(device, p); return; }
    fb->p = p;
    fb->next = pool->lists[c];
    pool->lists[c] = fb;
    pool->st.cached += (int64_t)capacity;
}

int tide_memory_stats_get(int device, tide_memory_stats *out)
{
    if (!tide_device_valid(device)) return tide_set_error("memory: device %d out of range", device);
    *out = g_pool[device].st;
    return 0;
}

void tide_memory_reset_peak(int device)
{
    if (tide_device_valid(device)) g_pool[device].st.peak = g_pool[device].st.current;
}

void tide_memory_empty_cache(int device)
{
    if (!tide_device_valid(device) || !g_init) return;
    device_pool *pool = &g_pool[device];
    for (int c = 0; c < N_CLASSES; c++) {
        while (pool->lists[c]) {
            free_block *fb = pool->lists[c];
            pool->lists[c] = fb->next;
            release_block(device, fb->p);
            free(fb);
        }
    }
    pool->st.cached = 0;
    while (g_spare_records) {
        free_block *fb = g_spare_records;
        g_spare_records = fb->next;
        free(fb);
    }
}

int tide_memory_set_limit(int device, int64_t bytes)
{
    if (!tide_device_valid(device)) return tide_set_error("memory: device %d out of range", device);
    if (bytes < 0) return tide_set_error("memory: limit must be >= 0, got %lld", (long long)bytes);
    g_pool[device].st.limit = bytes;
    return 0;
}

/* ---- kernel scratch ---------------------------------------------------------------------------- */

typedef struct scratch_rec { void *p; size_t cap, nbytes; int device; struct scratch_rec *next; } scratch_rec;
static scratch_rec *g_scratch;          /* live scratch blocks: a few per kernel call */

void *tide_scratch_alloc(int device, size_t nbytes)
{
    scratch_rec *r = malloc(sizeof *r);
    if (!r) { tide_set_error("scratch: out of host memory for the block record"); return NULL; }
    size_t cap = 0;
    void *p = tide_alloc_block(device, nbytes, &cap);
    if (!p) { free(r); return NULL; }
    r->p = p;
    r->cap = cap;
    r->nbytes = nbytes;
    r->device = device;
    r->next = g_scratch;
    g_scratch = r;
    return p;
}

void tide_scratch_free(int device, void *p)
{
    if (!p) return;
    for (scratch_rec **at = &g_scratch; *at; at = &(*at)->next) {
        scratch_rec *r = *at;
        if (r->p != p || r->device != device) continue;
        *at = r->next;
        tide_free_block(device, p, r->cap, r->nbytes);
        free(r);
        return;
    }
    /* not a live scratch block (a caller bug): leaking it is safer than freeing a block of unknown size */
}

int64_t tide_scratch_live(int device)
{
    int64_t n = 0;
    for (scratch_rec *r = g_scratch; r; r = r->next) n += r->device == device ? (int64_t)r->cap : 0;
    return n;
}

/*
 * safetensors.c — checkpoint files in the safetensors format (formats.md §1).
 *
 *   u64 LE N | N bytes of UTF-8 JSON header (space padded) | data buffer
 *
 * The reader treats the file as hostile: every rule of §1 is checked when the file is opened, before any
 * tensor byte is touched, and each violation is reported with the file name and the rule. Tensor bytes
 * are read on demand (pread from the file, or from a private copy for in-memory sources).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cjson/cJSON.h>
#include "internal.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tide's file formats assume a little-endian host"
#endif

#define ST_MAX_HEADER 100000000ull          /* 100 MB, the format's limit on N */
#define ST_MAX_INT 9007199254740992.0       /* 2^53: larger JSON numbers are not exact doubles */

/* every dtype of the format; `tide` is -1 for those tide has no dtype for */
static const struct { const char *name; int size; int tide; } st_dtypes[] = {
    { "BOOL", 1, -1 }, { "U8", 1, TIDE_U8 }, { "I8", 1, -1 }, { "I16", 2, -1 }, { "U16", 2, -1 },
    { "F16", 2, -1 }, { "BF16", 2, TIDE_BF16 }, { "I32", 4, TIDE_I32 }, { "U32", 4, -1 },
    { "F32", 4, TIDE_F32 }, { "F64", 8, TIDE_F64 }, { "I64", 8, TIDE_I64 }, { "U64", 8, -1 },
    { "F8_E4M3", 1, -1 }, { "F8_E5M2", 1, -1 },
};
enum { ST_NDTYPES = (int)(sizeof st_dtypes / sizeof st_dtypes[0]) };

/* tide dtype -> safetensors name */
static const char *const st_from_tide[] = {
    [TIDE_F32] = "F32", [TIDE_F64] = "F64", [TIDE_BF16] = "BF16", [TIDE_I32] = "I32", [TIDE_I64] = "I64",
    [TIDE_U8] = "U8",
};
_Static_assert(sizeof st_from_tide / sizeof st_from_tide[0] == TIDE_DTYPE_COUNT, "map every tide dtype to a safetensors dtype");

typedef struct {
    char *name;
    int dtype;                    /* index into st_dtypes */
    int ndim;                     /* may exceed TIDE_MAX_DIMS (then only the first 8 dims are kept) */
    int64_t shape[TIDE_MAX_DIMS];
    uint64_t begin, end;          /* relative to the data buffer */
} st_entry;

struct tide_safetensors {
    char *label;                  /* file name for messages */
    int n;
    st_entry *e;                  /* header order */
    int *by_name;                 /* indices sorted by name (lookup, duplicate detection) */
    char *metadata;               /* JSON text of __metadata__ */
    uint64_t data_start;          /* 8 + N */
    uint64_t data_size;
    int fd;                       /* file source, or -1 */
    unsigned char *mem;           /* memory source (a private copy of the whole file), or NULL */
};

/* ---- small helpers ---------------------------------------------------------------------------------- */
static uint64_t load_u64le(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* offset of the first byte that breaks UTF-8 (or is NUL), or n when the text is valid */
static size_t utf8_check(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c == 0) return i;
        if (c < 0x80) { i++; continue; }
        int k;
        unsigned min, cp;
        if ((c & 0xE0) == 0xC0) { k = 1; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { k = 2; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { k = 3; cp = c & 0x07; min = 0x10000; }
        else return i;
        if (n - i <= (size_t)k) return i;
        for (int j = 1; j <= k; j++) {
            unsigned d = s[i + (size_t)j];
            if ((d & 0xC0) != 0x80) return i;
            cp = (cp << 6) | (d & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
        i += (size_t)k + 1;
    }
    return n;
}

/* a JSON number that is a non-negative integer exactly representable (<= 2^53) */
static int json_uint(const cJSON *x, uint64_t *out)
{
    if (!cJSON_IsNumber(x)) return 0;
    double d = x->valuedouble;
    if (!(d >= 0.0) || d > ST_MAX_INT || d != (double)(uint64_t)d) return 0;
    *out = (uint64_t)d;
    return 1;
}

static int st_fail(const char *label, const char *rule)
{
    return tide_set_error("safetensors '%s': %s", label, rule);
}

/* qsort has no context argument: the handle being sorted, per thread */
static __thread const tide_safetensors *st_sort_h;

static int cmp_by_name(const void *a, const void *b)
{
    const st_entry *e = st_sort_h->e;
    return strcmp(e[*(const int *)a].name, e[*(const int *)b].name);
}

static int cmp_by_offset(const void *a, const void *b)
{
    const st_entry *e = st_sort_h->e;
    const st_entry *x = &e[*(const int *)a], *y = &e[*(const int *)b];
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

void tide_safetensors_close(tide_safetensors *h)
{
    if (!h) return;
    for (int i = 0; i < h->n; i++) free(h->e[i].name);
    free(h->e);
    free(h->by_name);
    free(h->metadata);
    free(h->label);
    free(h->mem);
    if (h->fd >= 0) close(h->fd);
    free(h);
}

static int cmp_cstr(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* *dup = a key that appears twice in object o, or NULL; sorting keeps hostile headers O(n log n).
   Returns -1 when out of memory. */
static int duplicate_key(const cJSON *o, const char **dup)
{
    size_t n = 0;
    *dup = NULL;
    for (const cJSON *c = o->child; c; c = c->next) n++;
    if (n < 2) return 0;
    const char **keys = malloc(n * sizeof *keys);
    if (!keys) return -1;
    n = 0;
    for (const cJSON *c = o->child; c; c = c->next) keys[n++] = c->string;
    qsort(keys, n, sizeof *keys, cmp_cstr);
    for (size_t i = 1; i < n && !*dup; i++)
        if (!strcmp(keys[i - 1], keys[i])) *dup = keys[i];
    free(keys);
    return 0;
}

/* ---- header validation ------------------------------------------------------------------------------ */
static int parse_metadata(tide_safetensors *h, const cJSON *m)
{
    const char *L = h->label;
    if (!cJSON_IsObject(m)) return st_fail(L, "__metadata__ must be an object of string values");
    for (const cJSON *c = m->child; c; c = c->next)
        if (!cJSON_IsString(c))
            return tide_set_error("safetensors '%s': __metadata__ value '%.120s' must be a string", L,
                                  c->string ? c->string : "");
    const char *dup = NULL;
    if (duplicate_key(m, &dup)) return st_fail(L, "out of memory");
    if (dup) return tide_set_error("safetensors '%s': duplicate key '%.120s' in __metadata__", L, dup);
    h->metadata = cJSON_PrintUnformatted(m);
    if (!h->metadata) return st_fail(L, "out of memory printing __metadata__");
    return 0;
}

static int parse_entry(tide_safetensors *h, const cJSON *t, st_entry *e)
{
    const char *L = h->label, *N = e->name;
    if (!cJSON_IsObject(t))
        return tide_set_error("safetensors '%s': tensor '%.120s' must be an object with dtype, shape and "
                              "data_offsets", L, N);
    const cJSON *dtype = NULL, *shape = NULL, *offs = NULL;
    for (const cJSON *c = t->child; c; c = c->next) {
        const cJSON **slot = !strcmp(c->string, "dtype") ? &dtype : !strcmp(c->string, "shape") ? &shape
                           : !strcmp(c->string, "data_offsets") ? &offs : NULL;
        if (!slot) continue;      /* unknown fields are ignored, as other readers do */
        if (*slot)
            return tide_set_error("safetensors '%s': tensor '%.120s' has a duplicate key '%s'", L, N, c->string);
        *slot = c;
    }
    if (!dtype || !shape || !offs)
        return tide_set_error("safetensors '%s': tensor '%.120s' lacks '%s'", L, N,
                              !dtype ? "dtype" : !shape ? "shape" : "data_offsets");
    if (!cJSON_IsString(dtype))
        return tide_set_error("safetensors '%s': tensor '%.120s' dtype must be a string", L, N);
    e->dtype = -1;
    for (int k = 0; k < ST_NDTYPES; k++)
        if (!strcmp(dtype->valuestring, st_dtypes[k].name)) e->dtype = k;
    if (e->dtype < 0)
        return tide_set_error("safetensors '%s': tensor '%.120s' has unknown dtype '%.40s'", L, N,
                              dtype->valuestring);

    if (!cJSON_IsArray(shape))
        return tide_set_error("safetensors '%s': tensor '%.120s' shape must be a list of non-negative "
                              "integers", L, N);
    uint64_t numel = 1;
    int overflow = 0, ndim = 0;
    for (const cJSON *c = shape->child; c; c = c->next, ndim++) {
        uint64_t d;
        if (!json_uint(c, &d))
            return tide_set_error("safetensors '%s': tensor '%.120s' shape must be a list of non-negative "
                                  "integers (entry %d is not)", L, N, ndim);
        if (ndim < TIDE_MAX_DIMS) e->shape[ndim] = (int64_t)d;
        if (__builtin_mul_overflow(numel, d, &numel)) overflow = 1;
    }
    e->ndim = ndim;
    uint64_t nbytes;
    /* the running product is checked as it goes, so a shape whose prefix overflows is rejected */
    if (overflow || numel > (uint64_t)INT64_MAX ||
        __builtin_mul_overflow(numel, (uint64_t)st_dtypes[e->dtype].size, &nbytes))
        return tide_set_error("safetensors '%s': tensor '%.120s' numel overflows 64 bits", L, N);

    uint64_t b, en;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || !json_uint(offs->child, &b) ||
        !json_uint(offs->child->next, &en))
        return tide_set_error("safetensors '%s': tensor '%.120s' data_offsets must be two non-negative "
                              "integers [begin, end]", L, N);
    if (en < b)
        return tide_set_error("safetensors '%s': tensor '%.120s' data_offsets [%llu, %llu] end before "
                              "begin", L, N, (unsigned long long)b, (unsigned long long)en);
    if (en - b != nbytes) {
        char sh[160];
        tide_shape_str(ndim < TIDE_MAX_DIMS ? ndim : TIDE_MAX_DIMS, e->shape, sh, sizeof sh);
        return tide_set_error("safetensors '%s': tensor '%.120s' data_offsets [%llu, %llu] hold %llu bytes "
                              "but %s %s%s needs %llu (numel x dtype size)", L, N, (unsigned long long)b,
                              (unsigned long long)en, (unsigned long long)(en - b),
                              st_dtypes[e->dtype].name, sh, ndim > TIDE_MAX_DIMS ? " (first 8 dims)" : "",
                              (unsigned long long)nbytes);
    }
    if (en > h->data_size)
        return tide_set_error("safetensors '%s': tensor '%.120s' data_offsets [%llu, %llu] point past the "
                              "end of the %llu-byte data buffer", L, N, (unsigned long long)b,
                              (unsigned long long)en, (unsigned long long)h->data_size);
    e->begin = b;
    e->end = en;
    return 0;
}

/* header: N bytes (NUL-terminated copy); h->label and h->data_size are set */
static int parse_header(tide_safetensors *h, char *header, uint64_t n)
{
    const char *L = h->label;
    if (n == 0 || header[0] != '{') return st_fail(L, "the header does not start with '{'");
    size_t bad = utf8_check((const unsigned char *)header, (size_t)n);
    if (bad < n)
        return tide_set_error("safetensors '%s': the header is not valid UTF-8 (byte %zu of the header%s)", L,
                              bad, header[bad] == 0 ? " is NUL" : "");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(header, (size_t)n, &end, 0);
    if (!root) {
        size_t at = end && end >= header && end <= header + n ? (size_t)(end - header) : 0;
        return tide_set_error("safetensors '%s': the header is not valid JSON (near byte %zu of the header)", L,
                              at);
    }
    for (const char *p = end; p < header + n; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return tide_set_error("safetensors '%s': the header has bytes after its JSON object (byte %zu of "
                                  "the header)", L, (size_t)(p - header));
        }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return st_fail(L, "the header is not a JSON object");
    }
    int count = 0, rc = 0;
    const cJSON *meta = NULL;
    for (const cJSON *c = root->child; c; c = c->next) {
        if (!strcmp(c->string, "__metadata__")) {
            if (meta) { rc = st_fail(L, "duplicate key '__metadata__'"); goto out; }
            meta = c;
        } else {
            count++;
        }
    }
    h->e = calloc((size_t)count + 1, sizeof *h->e);
    h->by_name = calloc((size_t)count + 1, sizeof *h->by_name);
    if (!h->e || !h->by_name) { rc = st_fail(L, "out of memory"); goto out; }
    for (const cJSON *c = root->child; c; c = c->next) {
        if (c == meta) continue;
        st_entry *e = &h->e[h->n];
        if (!(e->name = strdup(c->string))) { rc = st_fail(L, "out of memory"); goto out; }
        h->by_name[h->n] = h->n;
        h->n++;
        if ((rc = parse_entry(h, c, e)) != 0) goto out;
    }
    if (meta) rc = parse_metadata(h, meta);
    else if (!(h->metadata = strdup("{}"))) rc = st_fail(L, "out of memory");
    if (rc) goto out;

    /* duplicate names, then exact coverage of the data buffer (no holes, no overlaps) */
    st_sort_h = h;
    qsort(h->by_name, (size_t)h->n, sizeof(int), cmp_by_name);
    for (int i = 1; i < h->n; i++)
        if (!strcmp(h->e[h->by_name[i - 1]].name, h->e[h->by_name[i]].name)) {
            rc = tide_set_error("safetensors '%s': duplicate key '%.120s'", L, h->e[h->by_name[i]].name);
            goto out;
        }
    int *order = malloc(((size_t)h->n + 1) * sizeof *order);
    if (!order) { rc = st_fail(L, "out of memory"); goto out; }
    for (int i = 0; i < h->n; i++) order[i] = i;
    qsort(order, (size_t)h->n, sizeof(int), cmp_by_offset);
    uint64_t covered = 0;
    for (int i = 0; i < h->n && rc == 0; i++) {
        const st_entry *e = &h->e[order[i]];
        if (e->begin > covered)
            rc = tide_set_error("safetensors '%s': hole in the data buffer: bytes [%llu, %llu) belong to no "
                                "tensor", L, (unsigned long long)covered, (unsigned long long)e->begin);
        else if (e->begin < covered)
            rc = tide_set_error("safetensors '%s': tensor '%.120s' data_offsets [%llu, %llu] overlap tensor "
                                "'%.120s'", L, e->name, (unsigned long long)e->begin,
                                (unsigned long long)e->end, h->e[order[i - 1]].name);
        else
            covered = e->end;
    }
    if (rc == 0 && covered != h->data_size)
        rc = tide_set_error("safetensors '%s': hole in the data buffer: bytes [%llu, %llu) at its end belong "
                            "to no tensor", L, (unsigned long long)covered, (unsigned long long)h->data_size);
    free(order);
out:
    st_sort_h = NULL;
    cJSON_Delete(root);
    return rc;
}

/* checks on the first 8 bytes against the total size; *n_out = N */
static int check_prefix(const char *label, const unsigned char *first8, uint64_t total, uint64_t *n_out)
{
    if (total < 8)
        return tide_set_error("safetensors '%s': the file is %llu bytes, shorter than the 8-byte header "
                              "length", label, (unsigned long long)total);
    uint64_t n = load_u64le(first8);
    if (n > ST_MAX_HEADER)
        return tide_set_error("safetensors '%s': header length N = %llu exceeds the 100 MB limit", label,
                              (unsigned long long)n);
    if (n > total - 8)
        return tide_set_error("safetensors '%s': header length N = %llu exceeds the file size (%llu bytes)",
                              label, (unsigned long long)n, (unsigned long long)total);
    *n_out = n;
    return 0;
}

static tide_safetensors *st_new(const char *label)
{
    tide_safetensors *h = calloc(1, sizeof *h);
    if (!h || !(h->label = strdup(label ? label : "(memory)"))) {
        free(h);
        tide_set_error("safetensors '%s': out of memory", label ? label : "(memory)");
        return NULL;
    }
    h->fd = -1;
    return h;
}

tide_safetensors *tide_safetensors_open_memory(const void *bytes, size_t n, const char *label)
{
    if (!bytes && n) {
        tide_set_error("safetensors '%s': %zu bytes from a NULL pointer", label ? label : "(memory)", n);
        return NULL;
    }
    tide_safetensors *h = st_new(label);
    if (!h) return NULL;
    uint64_t hn = 0;
    unsigned char zero8[8] = { 0 };
    if (check_prefix(h->label, n >= 8 ? bytes : zero8, n, &hn) != 0) goto fail;
    h->mem = malloc(n + 1);
    if (!h->mem) { st_fail(h->label, "out of memory"); goto fail; }
    memcpy(h->mem, bytes, n);
    h->data_start = 8 + hn;
    h->data_size = n - h->data_start;
    char *header = malloc(hn + 1);
    if (!header) { st_fail(h->label, "out of memory"); goto fail; }
    memcpy(header, h->mem + 8, hn);
    header[hn] = 0;
    int rc = parse_header(h, header, hn);
    free(header);
    if (rc) goto fail;
    return h;
fail:
    tide_safetensors_close(h);
    return NULL;
}

static int pread_all(int fd, void *buf, size_t n, uint64_t off)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) { errno = EIO; return 1; }   /* file shorter than it was when opened */
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

tide_safetensors *tide_safetensors_open(const char *path)
{
    if (!path || !path[0]) {
        tide_set_error("safetensors_open: the path is %s", path ? "empty" : "NULL");
        return NULL;
    }
    tide_safetensors *h = st_new(path);
    if (!h) return NULL;
    int64_t size = 0;
    h->fd = tide_open_regular(path, "safetensors file", &size);
    if (h->fd < 0) goto fail;
    uint64_t total = (uint64_t)size, hn = 0;
    unsigned char first8[8] = { 0 };
    if (total >= 8 && pread_all(h->fd, first8, 8, 0) != 0) {
        tide_set_error("cannot read '%s': %s", path, strerror(errno));
        goto fail;
    }
    if (check_prefix(path, first8, total, &hn) != 0) goto fail;
    h->data_start = 8 + hn;
    h->data_size = total - h->data_start;
    char *header = malloc(hn + 1);
    if (!header) { st_fail(path, "out of memory"); goto fail; }
    if (pread_all(h->fd, header, hn, 8) != 0) {
        tide_set_error("cannot read '%s': %s", path, strerror(errno));
        free(header);
        goto fail;
    }
    header[hn] = 0;
    int rc = parse_header(h, header, hn);
    free(header);
    if (rc) goto fail;
    return h;
fail:
    tide_safetensors_close(h);
    return NULL;
}

/* ---- queries -------------------------------------------------------------------------------------------- */
static int check_index(const tide_safetensors *h, int i, const char *fn)
{
    if (!h) return tide_set_error("%s: the handle is NULL", fn);
    if (i < 0 || i >= h->n)
        return tide_set_error("%s: index %d out of range for '%s' (%d tensors)", fn, i, h->label, h->n);
    return 0;
}

int tide_safetensors_count(const tide_safetensors *h)
{
    if (!h) return tide_set_error("safetensors_count: the handle is NULL");
    return h->n;
}

const char *tide_safetensors_name(const tide_safetensors *h, int i)
{
    return check_index(h, i, "safetensors_name") ? NULL : h->e[i].name;
}

const char *tide_safetensors_dtype(const tide_safetensors *h, int i)
{
    return check_index(h, i, "safetensors_dtype") ? NULL : st_dtypes[h->e[i].dtype].name;
}

int tide_safetensors_shape(const tide_safetensors *h, int i, int64_t *shape)
{
    if (check_index(h, i, "safetensors_shape")) return -1;
    if (!shape) return tide_set_error("safetensors_shape: the shape buffer is NULL");
    const st_entry *e = &h->e[i];
    for (int d = 0; d < e->ndim && d < TIDE_MAX_DIMS; d++) shape[d] = e->shape[d];
    return e->ndim;
}

int tide_safetensors_find(const tide_safetensors *h, const char *name)
{
    if (!h || !name) return -1;
    int lo = 0, hi = h->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(h->e[h->by_name[mid]].name, name);
        if (c == 0) return h->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

const char *tide_safetensors_metadata(const tide_safetensors *h)
{
    if (!h) {
        tide_set_error("safetensors_metadata: the handle is NULL");
        return NULL;
    }
    return h->metadata;
}

/* prefixes the current error (from the tensor layer) with the file and tensor */
static void wrap_error(const tide_safetensors *h, const st_entry *e)
{
    char inner[512];
    snprintf(inner, sizeof inner, "%s", tide_last_error());
    tide_set_error("safetensors '%s': tensor '%.120s': %s", h->label, e->name, inner);
}

tide_tensor *tide_safetensors_get(const tide_safetensors *h, int i, int device)
{
    if (check_index(h, i, "safetensors_get")) return NULL;
    const st_entry *e = &h->e[i];
    int dt = st_dtypes[e->dtype].tide;
    if (dt < 0) {
        tide_set_error("safetensors '%s': tensor '%.120s' has dtype %s, which tide cannot hold (it has F32, "
                       "F64, BF16, I32, I64, U8)", h->label, e->name, st_dtypes[e->dtype].name);
        return NULL;
    }
    if (e->ndim > TIDE_MAX_DIMS) {
        tide_set_error("safetensors '%s': tensor '%.120s' has %d dimensions; tide holds at most %d", h->label,
                       e->name, e->ndim, TIDE_MAX_DIMS);
        return NULL;
    }
    uint64_t nbytes = e->end - e->begin;
    if (nbytes > SIZE_MAX - 1) {
        tide_set_error("safetensors '%s': tensor '%.120s' is too large for this machine", h->label, e->name);
        return NULL;
    }
    static const unsigned char none[1] = { 0 };
    if (h->mem) {
        tide_tensor *t = tide_from_bytes(dt, e->ndim, e->shape, device,
                                         nbytes ? h->mem + h->data_start + e->begin : none, (size_t)nbytes);
        if (!t) wrap_error(h, e);
        return t;
    }
    void *buf = malloc(nbytes ? (size_t)nbytes : 1);
    if (!buf) {
        tide_set_error("safetensors '%s': tensor '%.120s': out of memory for %llu bytes", h->label, e->name,
                       (unsigned long long)nbytes);
        return NULL;
    }
    if (pread_all(h->fd, buf, (size_t)nbytes, h->data_start + e->begin) != 0) {
        tide_set_error("safetensors '%s': tensor '%.120s': cannot read its bytes: %s", h->label, e->name,
                       strerror(errno));
        free(buf);
        return NULL;
    }
    tide_tensor *t = tide_from_bytes(dt, e->ndim, e->shape, device, buf, (size_t)nbytes);
    free(buf);
    if (!t) wrap_error(h, e);
    return t;
}

/* ---- writing ---------------------------------------------------------------------------------------- */

/* "[a,b,c]" for JSON; exact integers (no double rounding) */
static void int_list(char *buf, size_t cap, int n, const int64_t *v)
{
    size_t at = 0;
    buf[at++] = '[';
    for (int i = 0; i < n && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, i ? ",%lld" : "%lld", (long long)v[i]);
    if (at + 2 <= cap) { buf[at++] = ']'; buf[at] = 0; }
    else buf[cap - 1] = 0;
}

/* validates metadata_json and returns it as a cJSON object (NULL + error) */
static cJSON *metadata_object(const char *path, const char *json)
{
    size_t n = strlen(json);
    if (utf8_check((const unsigned char *)json, n) != n) {
        tide_set_error("safetensors_save '%s': metadata is not valid UTF-8", path);
        return NULL;
    }
    const char *end = NULL;
    cJSON *m = cJSON_ParseWithOpts(json, &end, 1);
    if (!m || !cJSON_IsObject(m)) {
        cJSON_Delete(m);
        tide_set_error("safetensors_save '%s': metadata must be a JSON object of string values, got '%.80s'",
                       path, json);
        return NULL;
    }
    for (const cJSON *c = m->child; c; c = c->next)
        if (!cJSON_IsString(c)) {
            tide_set_error("safetensors_save '%s': metadata key '%.120s' must have a string value", path,
                           c->string);
            cJSON_Delete(m);
            return NULL;
        }
    const char *dup = NULL;
    if (duplicate_key(m, &dup) || dup) {
        if (dup) tide_set_error("safetensors_save '%s': metadata key '%.120s' appears twice", path, dup);
        else tide_set_error("safetensors_save '%s': out of memory", path);
        cJSON_Delete(m);
        return NULL;
    }
    return m;
}

static int check_save_args(const char *path, int n, const char *const *names, tide_tensor *const *tensors)
{
    if (!path || !path[0]) return tide_set_error("safetensors_save: the path is %s", path ? "empty" : "NULL");
    if (n < 0) return tide_set_error("safetensors_save '%s': n = %d tensors", path, n);
    if (n > 0 && (!names || !tensors))
        return tide_set_error("safetensors_save '%s': names or tensors is NULL", path);
    for (int i = 0; i < n; i++) {
        if (!names[i]) return tide_set_error("safetensors_save '%s': name %d is NULL", path, i);
        size_t len = strlen(names[i]);
        if (utf8_check((const unsigned char *)names[i], len) != len)
            return tide_set_error("safetensors_save '%s': name %d is not valid UTF-8", path, i);
        if (!strcmp(names[i], "__metadata__"))
            return tide_set_error("safetensors_save '%s': '__metadata__' is not a tensor name", path);
        if (!tensors[i]) return tide_set_error("safetensors_save '%s': tensor '%.120s' is NULL", path, names[i]);
        int dt = tensors[i]->dtype;
        if (dt < 0 || dt >= TIDE_DTYPE_COUNT || !st_from_tide[dt])
            return tide_set_error("safetensors_save '%s': tensor '%.120s' has unknown dtype %d", path, names[i],
                                  dt);
    }
    if (n > 1) {
        const char **sorted = malloc((size_t)n * sizeof *sorted);
        if (!sorted) return tide_set_error("safetensors_save '%s': out of memory", path);
        memcpy(sorted, names, (size_t)n * sizeof *sorted);
        qsort(sorted, (size_t)n, sizeof *sorted, cmp_cstr);
        int rc = 0;
        for (int i = 1; i < n && rc == 0; i++)
            if (!strcmp(sorted[i - 1], sorted[i]))
                rc = tide_set_error("safetensors_save '%s': duplicate tensor name '%.120s'", path, sorted[i]);
        free(sorted);
        if (rc) return rc;
    }
    return 0;
}

int tide_safetensors_save(const char *path, int n, const char *const *names, tide_tensor *const *tensors,
                          const char *metadata_json)
{
    if (check_save_args(path, n, names, tensors)) return -1;
    cJSON *root = cJSON_CreateObject();
    if (!root) return tide_set_error("safetensors_save '%s': out of memory", path);
    int rc = 0;
    char *header = NULL;
    if (metadata_json) {
        cJSON *m = metadata_object(path, metadata_json);
        if (!m) { cJSON_Delete(root); return -1; }
        if (!cJSON_AddItemToObject(root, "__metadata__", m)) {
            cJSON_Delete(m);
            rc = tide_set_error("safetensors_save '%s': out of memory", path);
            goto out;
        }
    }
    uint64_t offset = 0, max_bytes = 0;
    for (int i = 0; i < n; i++) {
        const tide_tensor *t = tensors[i];
        uint64_t nb = (uint64_t)tide_tensor_nbytes(t);
        char shape[8 * 24 + 4], offs[2 * 24 + 4];
        int64_t ob[2] = { (int64_t)offset, (int64_t)(offset + nb) };
        int_list(shape, sizeof shape, t->ndim, t->shape);
        int_list(offs, sizeof offs, 2, ob);
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddStringToObject(o, "dtype", st_from_tide[t->dtype]) ||
            !cJSON_AddRawToObject(o, "shape", shape) || !cJSON_AddRawToObject(o, "data_offsets", offs) ||
            !cJSON_AddItemToObject(root, names[i], o)) {
            cJSON_Delete(o);
            rc = tide_set_error("safetensors_save '%s': out of memory", path);
            goto out;
        }
        offset += nb;
        if (nb > max_bytes) max_bytes = nb;
    }
    header = cJSON_PrintUnformatted(root);
    if (!header) { rc = tide_set_error("safetensors_save '%s': out of memory", path); goto out; }
    /* pad with spaces so that 8 + N is a multiple of 8 (the data buffer starts aligned) */
    size_t len = strlen(header), pad = (8 - (8 + len) % 8) % 8;
    uint64_t hn = len + pad;
    if (hn > ST_MAX_HEADER) {
        rc = tide_set_error("safetensors_save '%s': the header would be %llu bytes, over the 100 MB limit",
                            path, (unsigned long long)hn);
        goto out;
    }
    unsigned char prefix[8];
    for (int k = 0; k < 8; k++) prefix[k] = (unsigned char)(hn >> (8 * k));
    static const char spaces[8] = "        ";
    tide_atomic_file *f = tide_atomic_open(path);
    if (!f) { rc = -1; goto out; }
    void *buf = malloc(max_bytes ? (size_t)max_bytes : 1);
    if (!buf) rc = tide_set_error("safetensors_save '%s': out of memory for %llu bytes", path,
                                  (unsigned long long)max_bytes);
    if (!rc) rc = tide_atomic_write(f, prefix, 8);
    if (!rc) rc = tide_atomic_write(f, header, len);
    if (!rc) rc = tide_atomic_write(f, spaces, pad);
    for (int i = 0; i < n && !rc; i++) {
        size_t nb = (size_t)tide_tensor_nbytes(tensors[i]);
        if (nb == 0) continue;
        if (tide_read_bytes(tensors[i], buf, nb) != 0) {
            char inner[512];
            snprintf(inner, sizeof inner, "%s", tide_last_error());
            rc = tide_set_error("safetensors_save '%s': tensor '%.120s': %s", path, names[i], inner);
            break;
        }
        rc = tide_atomic_write(f, buf, nb);
    }
    free(buf);
    if (rc) tide_atomic_abort(f);
    else rc = tide_atomic_commit(f);
out:
    free(header);
    cJSON_Delete(root);
    return rc;
}

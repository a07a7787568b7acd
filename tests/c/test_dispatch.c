/*
 * test-dispatch — a backend that lacks a kernel is an error naming the op, the entry and the device, never a
 * jump through NULL (kernels/backend.h, TIDE_DISPATCH in engine/internal.h). The CPU device is routed to a copy
 * of the CPU table with one entry cleared, the op runs, and the message must be exactly the expected one;
 * with the table restored the same op succeeds again (the hook leaves nothing behind).
 *
 * Kernel scratch (backend.h tide_scratch_alloc, what the CUDA kernels' temporaries come from): with the CPU
 * table's malloc replaced by one over a fixed budget, a scratch request that only fits once the allocator's cache
 * is emptied succeeds through the retry, counts in the statistics, goes back to the cache when freed, and one
 * past the memory limit fails with the limit's message.
 */
#include <stdio.h>
#include <string.h>
#include "internal.h"

static int g_fail, g_pass;

static void expect_msg(int failed, const char *what, const char *want)
{
    const char *got = tide_last_error();
    if (failed && !strcmp(got, want)) { g_pass++; printf("ok    %s: %s\n", what, got); return; }
    g_fail++;
    printf("FAIL  %s: %s, message \"%s\", want \"%s\"\n", what, failed ? "failed" : "succeeded", got, want);
}

/* a device with a fixed budget: the system allocator under a cap on the bytes it has out */
static size_t g_budget, g_out;
static void *budget_malloc(size_t n)
{
    if (g_out + n > g_budget) { tide_set_error("budget malloc: %zu bytes over the budget", n); return NULL; }
    void *p = tide_cpu_backend.malloc(n);
    if (p) g_out += n;
    return p;
}
static void budget_free_sized(void *p, size_t n) { g_out -= n; tide_cpu_backend.free(p); }
/* the allocator frees by pointer: sizes of what budget_malloc handed out */
#define N_REC 64
static void *g_rec_p[N_REC];
static size_t g_rec_n[N_REC];
static void *rec_malloc(size_t n)
{
    void *p = budget_malloc(n);
    for (int i = 0; p && i < N_REC; i++)
        if (!g_rec_p[i]) { g_rec_p[i] = p; g_rec_n[i] = n; break; }
    return p;
}
static void rec_free(void *p)
{
    for (int i = 0; i < N_REC; i++)
        if (g_rec_p[i] == p) { g_rec_p[i] = NULL; budget_free_sized(p, g_rec_n[i]); return; }
    tide_cpu_backend.free(p);
}

static void expect(int ok, const char *what)
{
    if (ok) { g_pass++; printf("ok    %s\n", what); return; }
    g_fail++;
    printf("FAIL  %s (%s)\n", what, tide_last_error());
}

static void scratch_retry(void)
{
    tide_backend t = tide_cpu_backend;
    t.malloc = rec_malloc;
    t.free = rec_free;
    tide_memory_empty_cache(TIDE_CPU);
    tide_backend_override(TIDE_CPU, &t);
    g_out = 0;
    g_budget = (size_t)3 << 20;                       /* 3 MiB */
    /* fill the cache: two 1 MiB tensors, released */
    int64_t sh[1] = {(1 << 20) / 4};
    tide_tensor *a = tide_empty(TIDE_F32, 1, sh, TIDE_CPU), *b = tide_empty(TIDE_F32, 1, sh, TIDE_CPU);
    expect(a && b, "two 1 MiB tensors under a 3 MiB device budget");
    tide_tensor_release(a);
    tide_tensor_release(b);
    tide_memory_stats st0, st1, st2;
    tide_memory_stats_get(TIDE_CPU, &st0);
    expect(st0.cached >= (2 << 20), "their blocks sit in the cache");
    /* 2 MiB of scratch: not in any cached class, and only fits once the cache is given back */
    void *p = tide_scratch_alloc(TIDE_CPU, (size_t)2 << 20);
    tide_memory_stats_get(TIDE_CPU, &st1);
    expect(p != NULL, "a 2 MiB scratch block succeeds by emptying the cache and retrying");
    expect(st1.cached == 0 && st1.current >= st0.current + (2 << 20) && st1.peak >= st1.current,
           "the scratch block counts in current and peak; the cache was emptied");
    expect(tide_scratch_live(TIDE_CPU) >= (2 << 20), "it is a live scratch block");
    if (p) memset(p, 1, (size_t)2 << 20);
    tide_scratch_free(TIDE_CPU, p);
    tide_memory_stats_get(TIDE_CPU, &st2);
    expect(st2.current == st0.current && st2.cached >= (2 << 20) && tide_scratch_live(TIDE_CPU) == 0,
           "freed, it goes back to the cache, not to the device");
    /* the limit covers scratch too */
    tide_memory_set_limit(TIDE_CPU, st2.current + (1 << 20));
    void *q = tide_scratch_alloc(TIDE_CPU, (size_t)2 << 20);
    expect(q == NULL && strstr(tide_last_error(), "exceeds the limit"), "scratch past the memory limit fails naming the limit");
    tide_scratch_free(TIDE_CPU, q);
    tide_memory_set_limit(TIDE_CPU, 0);
    tide_memory_empty_cache(TIDE_CPU);
    tide_backend_override(TIDE_CPU, NULL);
    expect(g_out == 0, "every budgeted byte went back");
}

static tide_tensor *randn(int ndim, const int64_t *shape, int requires_grad)
{
    tide_tensor *t = tide_randn(TIDE_F64, ndim, shape, TIDE_CPU, 0.0, 1.0);
    if (t && requires_grad) tide_set_requires_grad(t, 1);
    return t;
}

int main(void)
{
    tide_manual_seed(7);
    int64_t s4[4] = {1, 3, 2, 4};
    tide_tensor *x = randn(4, s4, 1), *q = randn(4, s4, 1), *k = randn(4, s4, 1), *v = randn(4, s4, 1);
    if (!x || !q || !k || !v) { printf("setup: %s\n", tide_last_error()); return 1; }

    /* a forward kernel missing */
    tide_backend t = tide_cpu_backend;
    t.rope = NULL;
    tide_backend_override(TIDE_CPU, &t);
    tide_tensor *r = tide_rope(x, 10000.0, 0);
    expect_msg(r == NULL, "rope without a rope kernel", "rope: no rope kernel on the cpu backend (device cpu)");
    tide_tensor_release(r);

    /* a backward kernel missing: the forward runs, backward names the op and the backward entry */
    t = tide_cpu_backend;
    t.attention_backward = NULL;
    tide_backend_override(TIDE_CPU, &t);
    tide_tensor *o = tide_attention(q, k, v, 1, 0.5);
    tide_tensor *l = o ? tide_sum(o, 0, NULL, 0) : NULL;
    if (!l) { printf("FAIL  attention forward with the backward cleared: %s\n", tide_last_error()); g_fail++; }
    else expect_msg(tide_backward(l, NULL) != 0, "attention backward without its kernel",
                    "attention: no attention_backward kernel on the cpu backend (device cpu)");
    tide_tensor_release(l);
    tide_tensor_release(o);

    /* a memory-movement entry missing: creating a filled tensor reports the in-place op */
    t = tide_cpu_backend;
    t.fill = NULL;
    tide_backend_override(TIDE_CPU, &t);
    tide_tensor *z = tide_zeros(TIDE_F32, 4, s4, TIDE_CPU);
    expect_msg(z == NULL, "zeros without a fill kernel", "fill_: no fill kernel on the cpu backend (device cpu)");
    tide_tensor_release(z);

    /* a reduction: the node's op name, not the kernel's family, is in the message */
    t = tide_cpu_backend;
    t.reduce = NULL;
    tide_backend_override(TIDE_CPU, &t);
    tide_tensor *m = tide_mean(x, 0, NULL, 0);
    expect_msg(m == NULL, "mean without a reduce kernel", "mean: no reduce kernel on the cpu backend (device cpu)");
    tide_tensor_release(m);

    /* restored: the same ops run */
    tide_backend_override(TIDE_CPU, NULL);
    r = tide_rope(x, 10000.0, 0);
    m = tide_mean(x, 0, NULL, 0);
    if (r && m) g_pass++;
    else { g_fail++; printf("FAIL  rope/mean after restoring the table: %s\n", tide_last_error()); }
    tide_tensor_release(r);
    tide_tensor_release(m);

    scratch_retry();

    /* the hook refuses a device it cannot hold */
    expect_msg(tide_backend_override(99, &t) != 0, "override of device 99", "backend_override: device 99 is outside [0, 9)");

    tide_tensor_release(x); tide_tensor_release(q); tide_tensor_release(k); tide_tensor_release(v);
    if (tide_live_tensors() != 0) { printf("FAIL  %lld tensors leaked\n", (long long)tide_live_tensors()); g_fail++; }
    printf("\n%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

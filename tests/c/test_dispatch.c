/*
 * test-dispatch — a backend that lacks a kernel is an error naming the op, the entry and the device, never a
 * jump through NULL (kernels/backend.h, TIDE_DISPATCH in engine/internal.h). The CPU device is routed to a copy
 * of the CPU table with one entry cleared, the op runs, and the message must be exactly the expected one;
 * with the table restored the same op succeeds again (the hook leaves nothing behind).
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

    /* the hook refuses a device it cannot hold */
    expect_msg(tide_backend_override(99, &t) != 0, "override of device 99", "backend_override: device 99 is outside [0, 9)");

    tide_tensor_release(x); tide_tensor_release(q); tide_tensor_release(k); tide_tensor_release(v);
    if (tide_live_tensors() != 0) { printf("FAIL  %lld tensors leaked\n", (long long)tide_live_tensors()); g_fail++; }
    printf("\n%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

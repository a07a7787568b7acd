/*
 * test-autograd — the graph machinery (DESIGN.md §4): recompute regions give the same gradients with a
 * lower peak, gradients accumulate, a freed graph cannot be walked twice, no-grad scopes record nothing,
 * nothing leaks, memory stays flat over 1,000 steps, out-of-memory is an error, the RNG is reproducible
 * across thread counts, and errors name the op, the argument and the values.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tide.h"
#include "testutil.h"

static int g_pass, g_fail;
#define CHECK(cond, ...) do { if (cond) g_pass++; else { g_fail++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } while (0)
#define REL(t) tide_tensor_release(t)

/* a small residual MLP stack: h <- h + W2 silu(W1 rmsnorm(h)), `layers` times; loss = mean(h²) */
static tide_tensor *stack_loss(tide_tensor *x, tide_tensor **W1, tide_tensor **W2, tide_tensor *g, int layers, int recompute)
{
    tide_tensor *h = x;
    tide_tensor_retain(h);
    for (int l = 0; l < layers; l++) {
        if (recompute) tide_recompute_begin();
        tide_tensor *n = tide_rmsnorm(h, g, 1e-5), *a = tide_matmul(n, W1[l], 0, 1), *s = tide_silu(a);
        tide_tensor *b = tide_matmul(s, W2[l], 0, 1), *h2 = tide_add(h, b);
        if (recompute) tide_recompute_end();
        REL(n); REL(a); REL(s); REL(b); REL(h);
        h = h2;
    }
    tide_tensor *sq = tide_mul(h, h), *L = tide_mean(sq, 0, NULL, 0);
    REL(sq); REL(h);
    return L;
}

static void test_recompute(void)
{
    enum { LAYERS = 4, D = 64, F = 256, N = 512 };
    tide_manual_seed(7);
    tide_tensor *W1[LAYERS], *W2[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        W1[l] = tide_randn(TIDE_F64, 2, (int64_t[]){F, D}, 0, 0, 0.1);
        W2[l] = tide_randn(TIDE_F64, 2, (int64_t[]){D, F}, 0, 0, 0.1);
        tide_set_requires_grad(W1[l], 1);
        tide_set_requires_grad(W2[l], 1);
    }
    tide_tensor *g = tide_ones(TIDE_F64, 1, (int64_t[]){D}, 0);
    tide_set_requires_grad(g, 1);
    tide_tensor *x = tide_randn(TIDE_F64, 2, (int64_t[]){N, D}, 0, 0, 1);

    double *grads[2][LAYERS];
    int64_t peak[2];
    double loss[2];
    for (int rc = 0; rc < 2; rc++) {
        tide_memory_stats st;
        tide_memory_stats_get(0, &st);
        tide_memory_reset_peak(0);
        int64_t base = st.current;
        tide_tensor *L = stack_loss(x, W1, W2, g, LAYERS, rc);
        loss[rc] = tide_item(L);
        CHECK(tide_backward(L, NULL) == 0, "backward (recompute=%d): %s", rc, tide_last_error());
        REL(L);
        tide_memory_stats_get(0, &st);
        peak[rc] = st.peak - base;
        for (int l = 0; l < LAYERS; l++) {
            CHECK(W1[l]->grad != NULL, "W1[%d] has a gradient (recompute=%d)", l, rc);
            grads[rc][l] = W1[l]->grad ? host(W1[l]->grad) : calloc(F * D, sizeof(double));
            tide_zero_grad(W1[l]);
            tide_zero_grad(W2[l]);
        }
        tide_zero_grad(g);
    }
    CHECK(loss[0] == loss[1], "recompute changes the loss: %.17g vs %.17g", loss[0], loss[1]);
    int same = 1;
    for (int l = 0; l < LAYERS; l++) {
        for (int i = 0; i < F * D; i++) same &= grads[0][l][i] == grads[1][l][i];
        free(grads[0][l]); free(grads[1][l]);
    }
    CHECK(same, "recompute gives bitwise the same gradients");
    CHECK(peak[1] < peak[0] * 3 / 4, "recompute lowers the peak: %lld vs %lld bytes", (long long)peak[1], (long long)peak[0]);
    printf("recompute: peak %lld -> %lld bytes\n", (long long)peak[0], (long long)peak[1]);
    for (int l = 0; l < LAYERS; l++) { REL(W1[l]); REL(W2[l]); }
    REL(g); REL(x);
}

static void test_accumulate_and_errors(void)
{
    tide_tensor *w = tide_from_f64(TIDE_F64, 1, (int64_t[]){3}, 0, (double[]){1, 2, 3});
    tide_set_requires_grad(w, 1);
    for (int k = 0; k < 2; k++) {
        tide_tensor *y = tide_mul(w, w), *L = tide_sum(y, 0, NULL, 0);   /* dL/dw = 2w */
        tide_backward(L, NULL);
        if (k == 1) {
            CHECK(tide_backward(L, NULL) != 0 && strstr(tide_last_error(), "already freed"),
                  "a second backward through a freed graph is an error: '%s'", tide_last_error());
        }
        REL(y); REL(L);
    }
    double *gv = host(w->grad);
    CHECK(gv[0] == 4 && gv[1] == 8 && gv[2] == 12, "two backward calls accumulate: %g %g %g", gv[0], gv[1], gv[2]);
    free(gv);

    int prev = tide_set_grad_enabled(0);
    tide_tensor *y = tide_mul(w, w);
    CHECK(!y->requires_grad && !y->node, "no_grad records nothing");
    tide_set_grad_enabled(prev);
    CHECK(tide_set_requires_grad(y, 1) == 0, "a no-grad result is a leaf");
    REL(y);

    tide_tensor *z = tide_exp(w);
    CHECK(tide_set_requires_grad(z, 0) != 0 && strstr(tide_last_error(), "leaf"), "requires_grad_ on a non-leaf: '%s'", tide_last_error());
    CHECK(tide_backward(z, NULL) != 0 && strstr(tide_last_error(), "[3]"), "backward of a non-scalar names its shape: '%s'", tide_last_error());
    REL(z);

    tide_tensor *a = tide_zeros(TIDE_F32, 2, (int64_t[]){4, 64}, 0), *b = tide_zeros(TIDE_F32, 2, (int64_t[]){32, 16}, 0);
    CHECK(tide_matmul(a, b, 0, 0) == NULL, "matmul shape mismatch fails");
    CHECK(strstr(tide_last_error(), "matmul: a is [4, 64]") && strstr(tide_last_error(), "b is [32, 16]") &&
          strstr(tide_last_error(), "inner dimensions differ"), "matmul error names both shapes: '%s'", tide_last_error());
    tide_tensor *i32 = tide_zeros(TIDE_I32, 1, (int64_t[]){4}, 0);
    CHECK(tide_exp(i32) == NULL && strstr(tide_last_error(), "exp: x must be a float tensor"), "dtype error: '%s'", tide_last_error());
    CHECK(tide_reshape(a, 2, (int64_t[]){3, -1}) == NULL && strstr(tide_last_error(), "cannot reshape [4, 64]"), "reshape error: '%s'", tide_last_error());
    tide_tensor *ids = tide_from_f64(TIDE_I64, 1, (int64_t[]){2}, 0, (double[]){1, 7});
    tide_tensor *emb = tide_zeros(TIDE_F32, 2, (int64_t[]){5, 3}, 0);
    CHECK(tide_embedding(emb, ids) == NULL && strstr(tide_last_error(), "token id 7 is out of range for a vocabulary of 5"),
          "embedding range error: '%s'", tide_last_error());
    CHECK(tide_empty(TIDE_F32, 1, (int64_t[]){-3}, 0) == NULL && strstr(tide_last_error(), "negative"), "negative shape: '%s'", tide_last_error());
    CHECK(tide_empty(TIDE_F32, 1, (int64_t[]){3}, 1) == NULL && strstr(tide_last_error(), "cuda"), "no CUDA device: '%s'", tide_last_error());
    REL(a); REL(b); REL(i32); REL(ids); REL(emb); REL(w);
}

static void test_oom(void)
{
    tide_memory_stats st;
    tide_memory_stats_get(0, &st);
    tide_memory_set_limit(0, st.current + (1 << 20));
    tide_tensor *t = tide_empty(TIDE_F32, 1, (int64_t[]){1 << 20}, 0);   /* 4 MiB > 1 MiB headroom */
    CHECK(t == NULL && strstr(tide_last_error(), "out of memory"), "allocation past the limit is an error: '%s'", tide_last_error());
    tide_tensor *small = tide_empty(TIDE_F32, 1, (int64_t[]){1000}, 0);
    CHECK(small != NULL, "small allocations still work under the limit");
    REL(small);
    tide_memory_set_limit(0, 0);
}

static void test_flat_memory(void)
{
    tide_manual_seed(3);
    tide_tensor *W = tide_randn(TIDE_F32, 2, (int64_t[]){32, 16}, 0, 0, 0.1);
    tide_tensor *m = tide_zeros(TIDE_F32, 2, (int64_t[]){32, 16}, 0), *v = tide_zeros(TIDE_F32, 2, (int64_t[]){32, 16}, 0);
    tide_set_requires_grad(W, 1);
    int64_t at10 = 0, at1000 = 0, live10 = 0;
    for (int step = 1; step <= 1000; step++) {
        tide_tensor *x = tide_randn(TIDE_F32, 2, (int64_t[]){8, 16}, 0, 0, 1);
        tide_tensor *h = tide_matmul(x, W, 0, 1), *a = tide_tanh(h), *L = tide_mean(a, 0, NULL, 0);
        tide_backward(L, NULL);
        tide_adamw_step_(W, W->grad, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.1, step - 1);
        tide_zero_grad(W);
        REL(x); REL(h); REL(a); REL(L);
        tide_memory_stats st;
        tide_memory_stats_get(0, &st);
        if (step == 10) { at10 = st.current; live10 = tide_live_tensors(); }
        if (step == 1000) at1000 = st.current;
    }
    CHECK(at10 == at1000 && tide_live_tensors() == live10, "1,000 steps in flat memory: %lld -> %lld bytes, %lld -> %lld tensors",
          (long long)at10, (long long)at1000, (long long)live10, (long long)tide_live_tensors());
    REL(W); REL(m); REL(v);
}

static void test_rng(void)
{
    tide_manual_seed(42);
    tide_set_num_threads(1);
    tide_tensor *a = tide_randn(TIDE_F32, 1, (int64_t[]){100000}, 0, 0, 1);
    tide_manual_seed(42);
    tide_set_num_threads(2);
    tide_tensor *b = tide_randn(TIDE_F32, 1, (int64_t[]){100000}, 0, 0, 1);
    tide_tensor *c = tide_randn(TIDE_F32, 1, (int64_t[]){100000}, 0, 0, 1);
    double *av = host(a), *bv = host(b), *cv = host(c);
    int same = 1, differ = 0;
    for (int i = 0; i < 100000; i++) { same &= av[i] == bv[i]; differ += av[i] != cv[i]; }
    CHECK(same, "same seed, different thread counts: identical numbers");
    CHECK(differ > 99000, "consecutive draws differ");
    uint64_t seed, off;
    tide_rng_get(&seed, &off);
    CHECK(seed == 42 && off == 200000, "the offset advances by numel: %llu", (unsigned long long)off);
    free(av); free(bv); free(cv);
    REL(a); REL(b); REL(c);
}

/* gradient sums of a tensor with several readers (summed in place when nothing else holds the sum, else into a new
   tensor): a = 3x, read by a + a (whose backward hands the same gradient tensor to both inputs), by a·a and by a
   slice of a; every partial sum is exact for these values (halves and quarters of small integers), in f32 as in
   f64, so the gradient equals its formula exactly whichever sums ran in place */
static void test_gradient_sums(void)
{
    for (int dt = 0; dt < 2; dt++) {
        int dtype = dt ? TIDE_F64 : TIDE_F32;
        tide_tensor *x = tide_from_f64(dtype, 2, (int64_t[]){4, 5}, 0,
                                       (double[]){1, -2, 3, 0.5, -1, 2, 7, -3, 1, 4, 0.25, 5, -6, 2, 1, -1, 3, 2, -2, 6});
        tide_set_requires_grad(x, 1);
        tide_tensor *a = tide_mul_scalar(x, 3.0), *b = tide_add(a, a), *c = tide_mul(a, a), *d = tide_add(b, c);
        tide_tensor *e = tide_slice(a, 0, 1, 3, 1), *se = tide_sum(e, 0, NULL, 0), *sd = tide_sum(d, 0, NULL, 0);
        tide_tensor *L = tide_add(sd, se);
        CHECK(tide_backward(L, NULL) == 0, "gradient sums: backward: %s", tide_last_error());
        /* dL/da = 2 + 2a + [rows 1-2]; dL/dx = 3 dL/da */
        double *xv = host(x), *gv = host(x->grad);
        int bad = 0;
        for (int i = 0; i < 20; i++) {
            double want = 3 * (2 + 2 * (3 * xv[i]) + (i >= 5 && i < 15 ? 1 : 0));
            bad += gv[i] != want;
        }
        CHECK(bad == 0, "gradient sums (%s): %d of 20 gradients off the exact value", dt ? "f64" : "f32", bad);
        free(xv); free(gv);
        REL(a); REL(b); REL(c); REL(d); REL(e); REL(se); REL(sd); REL(L); REL(x);
    }
}

int main(void)
{
    test_recompute();
    test_accumulate_and_errors();
    test_gradient_sums();
    test_oom();
    test_flat_memory();
    test_rng();
    CHECK(tide_live_tensors() == 0 && tide_graph_live_nodes() == 0, "nothing leaked: %lld tensors, %lld nodes",
          (long long)tide_live_tensors(), (long long)tide_graph_live_nodes());
    printf("\n%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

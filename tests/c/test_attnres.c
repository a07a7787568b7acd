/*
 * test-attnres — the operator oracles of spec/attnres.md for the CPU kernel and the attnres op:
 *   1. w = 0 gives the arithmetic mean of the sources (f64 <= 1e-15 · max|v|, N = 3, 4, 17); one source is
 *      the identity, forward and backward, bitwise; the weights (the kernel's stats) are >= 0, sum to 1
 *      (<= 1e-15) and equal the softmax of the reference scores (<= 1e-14); with eps = 0, scaling a source
 *      by c > 0 leaves every weight unchanged (<= 1e-12 rel) and scales that source's term by c;
 *   2. f64 central differences (h = 1e-6) of dv_i, dw, dν: max error <= 1e-8, for N = 3 (random w), N = 3
 *      with one tensor passed twice, N = 1, N = 17 (Full AttnRes sizes), and w = 0 (init: dw != 0, §4);
 *   3. the f32 kernel vs the f64 kernel (<= 1e-5 of max|out|, gradients <= 1e-4 of their max);
 *   4. gw, gnu and every dv_i are bitwise identical with 1 and 3 threads; inside a recompute region the
 *      gradients equal the plain ones bitwise;
 *   5. bad arguments are errors naming the op, the argument and the values.
 * The online-softmax form (oracle 5) is the CUDA kernel's; tests/gpu/emu checks it against this one.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "../../kernels/cpu/cpu.h"
#include "testutil.h"

static int g_fail, g_pass;
#define CHECK(cond, ...) do { if (cond) g_pass++; else { g_fail++; printf("  FAIL "); printf(__VA_ARGS__); printf("\n"); } } while (0)

static uint64_t g_rng = 0x13198A2E03707344ull;
static double urand(void)
{
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}
static double nrand(void)
{
    double u = urand(), v = urand();
    return sqrt(-2 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

/* f64 CPU tensor of shape [rows, d] (or [d] when rows < 0) with N(0, sd²) values, or `fill` when sd = 0 */
static tide_tensor *mk(int64_t rows, int64_t d, double sd, double fill)
{
    int64_t n = rows < 0 ? d : rows * d, shape[2] = {rows, d};
    double *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = sd > 0 ? sd * nrand() : fill;
    tide_tensor *t = rows < 0 ? tide_from_f64(TIDE_F64, 1, &d, 0, v) : tide_from_f64(TIDE_F64, 2, shape, 0, v);
    free(v);
    tide_set_requires_grad(t, 1);
    return t;
}

/* the kernel's stats [2, n, rows] (p then r) of a forward through the backend table */
static double *kernel_stats(int n, tide_tensor **v, tide_tensor *w, tide_tensor *nu, double eps, double *out)
{
    int64_t d = w->shape[0], rows = v[0]->numel / d;
    double *stats = malloc((size_t)(2 * n * rows) * sizeof *stats);
    const void *src[32];
    for (int i = 0; i < n; i++) src[i] = tide_data(v[i]);
    if (tide_cpu_backend.attnres(TIDE_F64, out, stats, src, n, rows, d, tide_data(w), tide_data(nu), eps)) {
        printf("  kernel failed: %s\n", tide_last_error());
        exit(2);
    }
    return stats;
}

/* ---- 1. forward oracles ------------------------------------------------------------------------------ */
static void test_mean_at_w0(int n, int64_t rows, int64_t d)
{
    tide_tensor *v[32], *w = mk(-1, d, 0, 0.0), *nu = mk(-1, d, 1, 0);
    for (int i = 0; i < n; i++) v[i] = mk(rows, d, 1.5, 0);
    tide_tensor *o = tide_attnres(n, v, w, nu, 1e-5);
    double *ov = host(o), worst = 0, vmax = 0;
    double *vv[32];
    for (int i = 0; i < n; i++) { vv[i] = host(v[i]); vmax = fmax(vmax, max_abs(vv[i], rows * d)); }
    for (int64_t e = 0; e < rows * d; e++) {
        double s = 0;
        for (int i = 0; i < n; i++) s += vv[i][e];
        worst = fmax(worst, fabs(ov[e] - s / n));
    }
    /* p = 1/n rounded once, then a sum of n products: a few ulps of the largest source value */
    CHECK(worst <= 1e-15 * vmax, "w = 0, N = %d: output differs from the mean by %.3g (max|v| %.3g)", n, worst, vmax);
    printf("  w = 0, N = %2d: |out - mean| = %.2g (max|v| %.2g)\n", n, worst, vmax);
    for (int i = 0; i < n; i++) { free(vv[i]); tide_tensor_release(v[i]); }
    free(ov);
    tide_tensor_release(o); tide_tensor_release(w); tide_tensor_release(nu);
}

static void test_identity(int dtype)
{
    int64_t rows = 7, d = 12;
    tide_tensor *v0 = mk(rows, d, 2, 0), *w0 = mk(-1, d, 1, 0), *nu0 = mk(-1, d, 1, 0), *g0 = mk(rows, d, 1, 0);
    tide_tensor *v = tide_to_dtype(v0, dtype), *w = tide_to_dtype(w0, dtype), *nu = tide_to_dtype(nu0, dtype);
    tide_tensor *g = tide_to_dtype(g0, dtype);
    tide_tensor *vd = tide_detach(v), *wd = tide_detach(w), *nd = tide_detach(nu);
    tide_set_requires_grad(vd, 1); tide_set_requires_grad(wd, 1); tide_set_requires_grad(nd, 1);
    tide_tensor *o = tide_attnres(1, &vd, wd, nd, 1e-5);
    int same = o && memcmp(tide_data(o), tide_data(vd), (size_t)(rows * d) * tide_dtype_size(dtype)) == 0;
    CHECK(same, "one source (%s): the output is not the source bitwise", tide_dtype_name(dtype));
    int rc = o ? tide_backward(o, g) : -1;
    CHECK(!rc && vd->grad && memcmp(tide_data(vd->grad), tide_data(g), (size_t)(rows * d) * tide_dtype_size(dtype)) == 0,
          "one source (%s): dv is not dout bitwise", tide_dtype_name(dtype));
    double *gw = wd->grad ? host(wd->grad) : NULL, *gn = nd->grad ? host(nd->grad) : NULL;
    CHECK(gw && gn && max_abs(gw, d) == 0 && max_abs(gn, d) == 0, "one source (%s): dw, dnu must be 0", tide_dtype_name(dtype));
    free(gw); free(gn);
    tide_tensor *all[] = {v0, w0, nu0, g0, v, w, nu, g, vd, wd, nd, o};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
}

static void test_weights(void)
{
    enum { N = 5 };
    int64_t rows = 9, d = 16;
    tide_tensor *v[N], *w = mk(-1, d, 1, 0), *nu = mk(-1, d, 0.5, 0);
    for (int i = 0; i < N; i++) v[i] = mk(rows, d, 0.5 + i, 0);
    double *out = malloc((size_t)(rows * d) * sizeof *out), *st = kernel_stats(N, v, w, nu, 1e-5, out);
    double *wv = host(w), *nv = host(nu), *vv[N];
    for (int i = 0; i < N; i++) vv[i] = host(v[i]);
    double worst_sum = 0, worst_ref = 0, pmin = 1, pmax = 0;
    for (int64_t t = 0; t < rows; t++) {
        double s[N], m = -INFINITY, z = 0, sum = 0;
        for (int i = 0; i < N; i++) {
            double ss = 0, dot = 0;
            for (int64_t c = 0; c < d; c++) { ss += vv[i][t * d + c] * vv[i][t * d + c]; dot += wv[c] * nv[c] * vv[i][t * d + c]; }
            s[i] = dot / sqrt(ss / d + 1e-5);
            m = fmax(m, s[i]);
        }
        for (int i = 0; i < N; i++) z += exp(s[i] - m);
        for (int i = 0; i < N; i++) {
            double p = st[i * rows + t];
            sum += p;
            pmin = fmin(pmin, p);
            pmax = fmax(pmax, p);
            worst_ref = fmax(worst_ref, fabs(p - exp(s[i] - m) / z));
        }
        worst_sum = fmax(worst_sum, fabs(sum - 1));
    }
    CHECK(pmin >= 0 && worst_sum <= 1e-15, "weights: min %.3g, |sum - 1| %.3g (want >= 0, <= 1e-15)", pmin, worst_sum);
    CHECK(worst_ref <= 1e-14, "weights differ from the softmax of the reference scores by %.3g", worst_ref);
    CHECK(pmax - pmin > 0.5, "the test needs non-uniform weights, got [%.3g, %.3g]", pmin, pmax);
    printf("  weights in [%.3g, %.3g], |sum - 1| <= %.2g, vs reference %.2g\n", pmin, pmax, worst_sum, worst_ref);
    for (int i = 0; i < N; i++) { free(vv[i]); tide_tensor_release(v[i]); }
    free(wv); free(nv); free(out); free(st);
    tide_tensor_release(w); tide_tensor_release(nu);
}

/* eps = 0: r(c v) = r(v) / c, so s_i and hence every weight are unchanged; out gains (c − 1) p_i v_i */
static void test_scale_invariance(void)
{
    enum { N = 4 };
    int64_t rows = 6, d = 10;
    tide_tensor *v[N], *w = mk(-1, d, 1, 0), *nu = mk(-1, d, 1, 0);
    for (int i = 0; i < N; i++) v[i] = mk(rows, d, 1, 0);
    double *o1 = malloc((size_t)(rows * d) * sizeof *o1), *o2 = malloc((size_t)(rows * d) * sizeof *o2);
    double *st1 = kernel_stats(N, v, w, nu, 0.0, o1), worst_p = 0, worst_o = 0;
    const double cs[3] = {1e-3, 7.5, 1e4};
    for (int k = 0; k < 3; k++) {
        int j = k % N;
        tide_tensor *vs = tide_mul_scalar(v[j], cs[k]), *vj = v[j];
        v[j] = vs;
        double *st2 = kernel_stats(N, v, w, nu, 0.0, o2), *vv = host(vj);
        v[j] = vj;
        for (int64_t i = 0; i < N * rows; i++) worst_p = fmax(worst_p, fabs(st2[i] - st1[i]) / st1[i]);
        for (int64_t t = 0; t < rows; t++)
            for (int64_t c = 0; c < d; c++) {
                double want = o1[t * d + c] + (cs[k] - 1) * st1[j * rows + t] * vv[t * d + c];
                worst_o = fmax(worst_o, fabs(o2[t * d + c] - want) / (1 + fabs(want)));
            }
        free(st2); free(vv);
        tide_tensor_release(vs);
    }
    CHECK(worst_p <= 1e-12, "eps = 0: scaling a source changed the weights by %.3g rel (<= 1e-12)", worst_p);
    CHECK(worst_o <= 1e-12, "eps = 0: the scaled source's term is off by %.3g rel", worst_o);
    printf("  eps = 0, c in {1e-3, 7.5, 1e4}: weights change <= %.2g rel, output <= %.2g\n", worst_p, worst_o);
    for (int i = 0; i < N; i++) tide_tensor_release(v[i]);
    free(o1); free(o2); free(st1);
    tide_tensor_release(w); tide_tensor_release(nu);
}

/* ---- 2. gradients by central differences ------------------------------------------------------------ */
/* inputs: the distinct leaves; idx[i] says which leaf is source i; w, nu are the last two leaves */
static double gradcheck(const char *name, int n, tide_tensor **leaf, int n_leaf, const int *idx, double eps)
{
    tide_tensor *src[32], *w = leaf[n_leaf - 2], *nu = leaf[n_leaf - 1];
    for (int i = 0; i < n; i++) src[i] = leaf[idx[i]];
    tide_tensor *o = tide_attnres(n, src, w, nu, eps);
    if (!o) { printf("  %s: forward failed: %s\n", name, tide_last_error()); g_fail++; return INFINITY; }
    tide_tensor *R = tide_randn(TIDE_F64, o->ndim, o->shape, 0, 0, 1);
    double *rv = host(R);
    for (int k = 0; k < n_leaf; k++) tide_zero_grad(leaf[k]);
    tide_tensor *p = tide_mul(o, R), *L = tide_sum(p, 0, NULL, 0);
    if (tide_backward(L, NULL)) { printf("  %s: backward failed: %s\n", name, tide_last_error()); g_fail++; }
    tide_tensor_release(p); tide_tensor_release(L); tide_tensor_release(o);
    int prev = tide_set_grad_enabled(0);
    double worst = 0;
    for (int k = 0; k < n_leaf; k++) {
        tide_tensor *x = leaf[k];
        double *xv = host(x), *gv = host(x->grad);
        for (int64_t e = 0; e < x->numel; e++) {
            double f[2], orig = xv[e];
            for (int s = 0; s < 2; s++) {
                xv[e] = orig + (s ? -1e-6 : 1e-6);
                tide_write_bytes(x, xv, (size_t)x->numel * 8);
                tide_tensor *y = tide_attnres(n, src, w, nu, eps);
                double *yv = host(y), acc = 0;
                for (int64_t j = 0; j < y->numel; j++) acc += yv[j] * rv[j];
                f[s] = acc;
                free(yv);
                tide_tensor_release(y);
            }
            xv[e] = orig;
            tide_write_bytes(x, xv, (size_t)x->numel * 8);
            worst = fmax(worst, fabs((f[0] - f[1]) / 2e-6 - gv[e]));
        }
        free(xv); free(gv);
    }
    tide_set_grad_enabled(prev);
    free(rv);
    tide_tensor_release(R);
    CHECK(worst <= 1e-8, "%s: max |numeric - analytic| = %.3g (<= 1e-8)", name, worst);
    printf("  gradcheck %-36s max error %.2g\n", name, worst);
    return worst;
}

static void test_gradients(void)
{
    int64_t rows = 4, d = 6;
    int idx[17];
    for (int i = 0; i < 17; i++) idx[i] = i;
    {   /* N = 3, random w */
        tide_tensor *l[5] = {mk(rows, d, 1, 0), mk(rows, d, 1, 0), mk(rows, d, 2, 0), mk(-1, d, 1, 0), mk(-1, d, 1, 0)};
        gradcheck("N = 3, random w", 3, l, 5, idx, 1e-5);
        for (int k = 0; k < 5; k++) tide_tensor_release(l[k]);
    }
    {   /* one tensor as sources 0 and 2: its gradient is the sum of both */
        tide_tensor *l[4] = {mk(rows, d, 1, 0), mk(rows, d, 1, 0), mk(-1, d, 1, 0), mk(-1, d, 1, 0)};
        int twice[3] = {0, 1, 0};
        gradcheck("N = 3, source 0 passed twice", 3, l, 4, twice, 1e-5);
        for (int k = 0; k < 4; k++) tide_tensor_release(l[k]);
    }
    {   /* N = 1 */
        tide_tensor *l[3] = {mk(rows, d, 1, 0), mk(-1, d, 1, 0), mk(-1, d, 1, 0)};
        gradcheck("N = 1", 1, l, 3, idx, 1e-5);
        for (int k = 0; k < 3; k++) tide_tensor_release(l[k]);
    }
    {   /* N = 17: more saved tensors than a plain op keeps, eps = 0 */
        tide_tensor *l[19];
        for (int k = 0; k < 17; k++) l[k] = mk(2, 5, 0.5 + 0.1 * k, 0);
        l[17] = mk(-1, 5, 0.7, 0);
        l[18] = mk(-1, 5, 1, 0);
        gradcheck("N = 17 (Full AttnRes sizes), eps = 0", 17, l, 19, idx, 0.0);
        for (int k = 0; k < 19; k++) tide_tensor_release(l[k]);
    }
    {   /* w = 0 (the init): the weights are uniform but dw is not zero, so learning starts (§4) */
        tide_tensor *l[5] = {mk(rows, d, 1, 0), mk(rows, d, 1, 0), mk(rows, d, 1, 0), mk(-1, d, 0, 0.0), mk(-1, d, 1, 0)};
        gradcheck("N = 3, w = 0", 3, l, 5, idx, 1e-5);
        double *gw = host(l[3]->grad);
        CHECK(max_abs(gw, d) > 1e-3, "w = 0: dw must be non-zero, got max|dw| = %.3g", max_abs(gw, d));
        free(gw);
        for (int k = 0; k < 5; k++) tide_tensor_release(l[k]);
    }
}

/* ---- 3. f32 vs f64 ------------------------------------------------------------------------------------- */
static void test_f32(void)
{
    enum { N = 4 };
    int64_t rows = 33, d = 40;
    tide_tensor *l64[N + 2], *l32[N + 2];
    for (int i = 0; i < N; i++) l64[i] = mk(rows, d, 1 + i, 0);
    l64[N] = mk(-1, d, 0.5, 0);
    l64[N + 1] = mk(-1, d, 1, 0);
    for (int i = 0; i < N + 2; i++) {
        l32[i] = tide_to_dtype(l64[i], TIDE_F32);
        tide_tensor *t = tide_detach(l32[i]);
        tide_tensor_release(l32[i]);
        l32[i] = t;
        tide_set_requires_grad(l32[i], 1);
    }
    tide_tensor *o64 = tide_attnres(N, l64, l64[N], l64[N + 1], 1e-5), *o32 = tide_attnres(N, l32, l32[N], l32[N + 1], 1e-5);
    tide_tensor *g = tide_randn(TIDE_F64, 2, o64->shape, 0, 0, 1), *g32 = tide_to_dtype(g, TIDE_F32);
    tide_backward(o64, g);
    tide_backward(o32, g32);
    double *a = host(o64), *b = host(o32), m = max_abs(a, rows * d), worst = max_abs_diff(a, b, rows * d);
    CHECK(worst <= 1e-5 * m, "f32 vs f64 output: %.3g of max %.3g", worst, m);
    double gworst = 0;
    for (int i = 0; i < N + 2; i++) {
        double *x = host(l64[i]->grad), *y = host(l32[i]->grad), gm = max_abs(x, l64[i]->numel);
        double wi = max_abs_diff(x, y, l64[i]->numel);
        gworst = fmax(gworst, wi / gm);
        free(x); free(y);
    }
    CHECK(gworst <= 1e-4, "f32 vs f64 gradients: %.3g of their max (<= 1e-4)", gworst);
    printf("  f32 vs f64: output %.2g, gradients %.2g (relative to the max)\n", worst / m, gworst);
    free(a); free(b);
    for (int i = 0; i < N + 2; i++) { tide_tensor_release(l64[i]); tide_tensor_release(l32[i]); }
    tide_tensor_release(o64); tide_tensor_release(o32); tide_tensor_release(g); tide_tensor_release(g32);
}

/* ---- 4. determinism ------------------------------------------------------------------------------------ */
/* the gradients of every leaf, concatenated, after one forward + backward (optionally in a recompute region) */
static double *grads(int n, tide_tensor **l, const tide_tensor *gout, int recompute, int64_t *len)
{
    for (int i = 0; i < n + 2; i++) tide_zero_grad(l[i]);
    if (recompute) tide_recompute_begin();
    tide_tensor *o = tide_attnres(n, l, l[n], l[n + 1], 1e-5);
    if (recompute) tide_recompute_end();
    tide_backward(o, gout);
    tide_tensor_release(o);
    int64_t tot = 0;
    for (int i = 0; i < n + 2; i++) tot += l[i]->numel;
    double *all = malloc((size_t)tot * sizeof *all);
    int64_t at = 0;
    for (int i = 0; i < n + 2; i++) {
        double *g = host(l[i]->grad);
        memcpy(all + at, g, (size_t)l[i]->numel * sizeof *g);
        at += l[i]->numel;
        free(g);
    }
    *len = tot;
    return all;
}

static void test_determinism(void)
{
    enum { N = 3 };
    int64_t rows = 1500, d = 24;     /* rows·d·N well above the kernels' threading threshold */
    tide_tensor *l[N + 2];
    for (int i = 0; i < N; i++) l[i] = mk(rows, d, 1, 0);
    l[N] = mk(-1, d, 1, 0);
    l[N + 1] = mk(-1, d, 1, 0);
    tide_tensor *g = tide_randn(TIDE_F64, 2, l[0]->shape, 0, 0, 1);
    int prev = tide_num_threads();
    int64_t n1, n3, nr;
    tide_set_num_threads(1);
    double *a = grads(N, l, g, 0, &n1);
    tide_set_num_threads(3);
    double *b = grads(N, l, g, 0, &n3);
    double *c = grads(N, l, g, 1, &nr);
    tide_set_num_threads(prev);
    CHECK(n1 == n3 && memcmp(a, b, (size_t)n1 * sizeof *a) == 0, "gradients differ between 1 and 3 threads");
    CHECK(n1 == nr && memcmp(b, c, (size_t)n1 * sizeof *a) == 0, "gradients differ inside a recompute region");
    free(a); free(b); free(c);
    for (int i = 0; i < N + 2; i++) tide_tensor_release(l[i]);
    tide_tensor_release(g);
}

/* ---- 5. errors ----------------------------------------------------------------------------------------------- */
static void expect_error(tide_tensor *r, const char *what, const char *a, const char *b)
{
    const char *e = tide_last_error();
    CHECK(!r && strstr(e, "attnres") && strstr(e, a) && (!b || strstr(e, b)), "%s: expected an error naming '%s'%s%s, got '%s'",
          what, a, b ? " and " : "", b ? b : "", r ? "(no error)" : e);
    tide_tensor_release(r);
    tide_clear_error();
}

static void test_errors(void)
{
    tide_tensor *v[3] = {mk(4, 6, 1, 0), mk(4, 6, 1, 0), mk(3, 6, 1, 0)}, *w = mk(-1, 6, 1, 0), *nu = mk(-1, 6, 1, 0);
    tide_tensor *w5 = mk(-1, 5, 1, 0), *v32 = tide_to_dtype(v[1], TIDE_F32);
    expect_error(tide_attnres(0, v, w, nu, 1e-5), "n = 0", "at least one source", "n = 0");
    expect_error(tide_attnres(3, v, w, nu, 1e-5), "shape mismatch", "source 2 is [3, 6]", "[4, 6]");
    expect_error(tide_attnres(2, v, w5, nu, 1e-5), "w shape", "w is [5]", "[6]");
    expect_error(tide_attnres(2, v, w, nu, -1.0), "negative eps", "eps", "-1");
    tide_tensor *mixed[2] = {v[0], v32};
    expect_error(tide_attnres(2, mixed, w, nu, 1e-5), "dtype mismatch", "dtypes differ", "f32");
    tide_tensor *with_null[2] = {v[0], NULL};
    expect_error(tide_attnres(2, with_null, w, nu, 1e-5), "NULL source", "source 1", "NULL");
    for (int i = 0; i < 3; i++) tide_tensor_release(v[i]);
    tide_tensor_release(w); tide_tensor_release(nu); tide_tensor_release(w5); tide_tensor_release(v32);
}

int main(void)
{
    tide_manual_seed(7);
    printf("attnres forward oracles\n");
    test_mean_at_w0(3, 8, 16);
    test_mean_at_w0(4, 8, 16);
    test_mean_at_w0(17, 5, 12);
    test_identity(TIDE_F64);
    test_identity(TIDE_F32);
    test_weights();
    test_scale_invariance();
    printf("gradients (f64 central differences, h = 1e-6)\n");
    test_gradients();
    printf("f32, determinism, errors\n");
    test_f32();
    test_determinism();
    test_errors();
    if (tide_graph_live_nodes() != 0) { printf("  FAIL %lld graph nodes leaked\n", (long long)tide_graph_live_nodes()); g_fail++; }
    if (tide_live_tensors() != 0) { printf("  FAIL %lld tensors leaked\n", (long long)tide_live_tensors()); g_fail++; }
    printf("\n%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

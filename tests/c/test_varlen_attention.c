/*
 * test-varlen-attention — bidirectional attention over packed images (spec/vision.md §3, §5, oracles 3 and 8),
 * on the CPU through BLAS, full score rows per block of queries (kernels/cpu/varlen_impl.h):
 *   1. fp64 central differences (h = 1e-6): every element of dq, dk, dv on a small packed row, and directional
 *      derivatives on a row whose images span several 64-key tiles: |num - ana| / (|ana| + 1e-3) <= 1e-6
 *      (vision.md oracle 8; measured <= 1e-7);
 *   2. forward and backward against the definition (a loop over images, a dense softmax per image) for several
 *      image layouts: all length 1, one token next to images longer than a tile, boundaries on tile edges, an
 *      empty image (a repeated boundary), one image of 300: fp64 <= 1e-12, f32 <= 1e-5 of max|ref| (output) and
 *      <= 1e-4 of max(max|ref|, 1) (gradients: f32 sums over up to 300 keys);
 *   3. packing == separate: images A (77) and B (130) packed give what each gives alone, output and gradients
 *      (fp64 <= 1e-12); int32 and int64 boundaries give bitwise the same output;
 *   4. isolation: changing every input of image A leaves image B's output and gradients bitwise unchanged;
 *   5. memory: the engine's peak bytes for forward + backward grow linearly in T (T 2048 -> 4096: ratio <= 2.2) and
 *      stay far below one [T, T] f32 buffer;
 *   6. bad inputs fail with one line naming the op and the values; T = 0 gives an empty output.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "testutil.h"

static int g_fail, g_pass;
#define CHECK(cond, ...) do { if (cond) g_pass++; else { g_fail++; printf("  FAIL "); printf(__VA_ARGS__); printf("\n"); } } while (0)

static tide_tensor *randn(int dtype, int ndim, const int64_t *shape)
{
    tide_tensor *t = tide_randn(dtype, ndim, shape, 0, 0.0, 1.0);
    if (!t) { printf("randn failed: %s\n", tide_last_error()); exit(2); }
    return t;
}

static tide_tensor *cu_tensor(const int64_t *cu, int n_cu, int dtype)
{
    double v[64];
    for (int i = 0; i < n_cu; i++) v[i] = (double)cu[i];
    return tide_from_f64(dtype, 1, (int64_t[]){n_cu}, 0, v);
}

/* the definition in double: per image [cu_g, cu_{g+1}), per head, a dense softmax over the image's keys; with
   gout, the gradients too (vision.md §5: the MLA backward, mla.md §4, with the block-diagonal non-causal mask) */
static void reference(const double *q, const double *k, const double *v, const double *gout, const int64_t *cu,
                      int n_cu, int64_t H, int64_t D, double scale, double *o, double *gq, double *gk, double *gv)
{
    int64_t T = cu[n_cu - 1];
    if (gout)
        for (int64_t e = 0; e < T * H * D; e++) gq[e] = gk[e] = gv[e] = 0;
    double *p = malloc((size_t)(T > 0 ? T : 1) * sizeof *p);
    for (int g = 0; g + 1 < n_cu; g++) {
        int64_t s = cu[g], e = cu[g + 1];
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = s; i < e; i++) {
                const double *qi = q + (i * H + h) * D;
                double m = -INFINITY, sum = 0;
                for (int64_t j = s; j < e; j++) {
                    double d = 0;
                    for (int64_t c = 0; c < D; c++) d += qi[c] * k[(j * H + h) * D + c];
                    p[j] = d * scale;
                    m = fmax(m, p[j]);
                }
                for (int64_t j = s; j < e; j++) { p[j] = exp(p[j] - m); sum += p[j]; }
                for (int64_t j = s; j < e; j++) p[j] /= sum;
                double *oi = o + (i * H + h) * D;
                for (int64_t c = 0; c < D; c++) {
                    double acc = 0;
                    for (int64_t j = s; j < e; j++) acc += p[j] * v[(j * H + h) * D + c];
                    oi[c] = acc;
                }
                if (!gout) continue;
                const double *go = gout + (i * H + h) * D;
                double Di = 0;
                for (int64_t c = 0; c < D; c++) Di += go[c] * oi[c];
                for (int64_t j = s; j < e; j++) {
                    double dp = 0;
                    for (int64_t c = 0; c < D; c++) {
                        dp += go[c] * v[(j * H + h) * D + c];
                        gv[(j * H + h) * D + c] += p[j] * go[c];
                    }
                    double dz = p[j] * (dp - Di) * scale;
                    for (int64_t c = 0; c < D; c++) {
                        gq[(i * H + h) * D + c] += dz * k[(j * H + h) * D + c];
                        gk[(j * H + h) * D + c] += dz * qi[c];
                    }
                }
            }
    }
    free(p);
}

/* o = varlen_attention(in), then backward of sum(o ⊙ r); the gradients land in in[i]->grad */
static tide_tensor *run_with_grad(tide_tensor **in, tide_tensor *cu, double scale, tide_tensor *r)
{
    tide_tensor *o = tide_varlen_attention(in[0], in[1], in[2], cu, scale);
    if (!o) return NULL;
    tide_tensor *p = tide_mul(o, r), *L = tide_sum(p, 0, NULL, 0);
    int rc = tide_backward(L, NULL);
    tide_tensor_release(p); tide_tensor_release(L);
    if (rc) { tide_tensor_release(o); return NULL; }
    return o;
}

static double max_err_scaled(const double *a, const double *ref, int64_t n, double *mx)
{
    *mx = max_abs(ref, n);
    return max_abs_diff(a, ref, n);
}

/* 2: forward and backward vs the definition */
static void test_reference(const char *what, const int64_t *cu, int n_cu, int64_t H, int64_t D, int dtype)
{
    int64_t T = cu[n_cu - 1], shp[3] = {T, H, D}, n = T * H * D;
    double scale = 1 / sqrt((double)D);
    tide_tensor *x[3], *in[3];
    double *hx[3];
    for (int i = 0; i < 3; i++) {
        x[i] = randn(TIDE_F64, 3, shp);
        hx[i] = host(x[i]);
        in[i] = dtype == TIDE_F64 ? (tide_tensor_retain(x[i]), x[i]) : tide_to_dtype(x[i], dtype);
        tide_set_requires_grad(in[i], 1);
    }
    tide_tensor *r64 = randn(TIDE_F64, 3, shp), *r = dtype == TIDE_F64 ? (tide_tensor_retain(r64), r64) : tide_to_dtype(r64, dtype);
    double *hr = host(r64), *ro = malloc((size_t)n * 4 * sizeof *ro), *rg = ro + n;
    reference(hx[0], hx[1], hx[2], hr, cu, n_cu, H, D, scale, ro, rg, rg + n, rg + 2 * n);
    tide_tensor *tcu = cu_tensor(cu, n_cu, TIDE_I64), *o = run_with_grad(in, tcu, scale, r);
    CHECK(o != NULL, "%s %s: %s", what, tide_dtype_name(dtype), tide_last_error());
    if (o) {
        double *ho = host(o), mx, err = max_err_scaled(ho, ro, n, &mx);
        double tol = dtype == TIDE_F64 ? 1e-12 : 1e-5 * mx;
        CHECK(err <= tol, "%s %s: o vs definition %.3g (tol %.3g)", what, tide_dtype_name(dtype), err, tol);
        double gerr[3], gmx[3], worst = 0;
        const char *gn[3] = {"dq", "dk", "dv"};
        for (int i = 0; i < 3; i++) {
            double *hg = host(in[i]->grad);
            gerr[i] = max_err_scaled(hg, rg + i * n, n, &gmx[i]);
            /* a floor of 1 (the gradients' scale): with images of one token dq = dk = 0 exactly, and f32 rounds
               dP - D, two sums of one product each, to ~1e-7 instead */
            double gt = (dtype == TIDE_F64 ? 1e-12 : 1e-4) * fmax(1, gmx[i]);
            CHECK(gerr[i] <= gt, "%s %s: %s vs definition %.3g (tol %.3g)", what, tide_dtype_name(dtype), gn[i], gerr[i], gt);
            worst = fmax(worst, gerr[i] / fmax(gmx[i], 1));
            free(hg);
        }
        printf("  %-44s %s  o err %.2e (max|o| %.2f), grads err/max %.2e\n", what, tide_dtype_name(dtype), err, mx, worst);
        free(ho);
    }
    tide_tensor_release(o); tide_tensor_release(tcu); tide_tensor_release(r); tide_tensor_release(r64);
    for (int i = 0; i < 3; i++) { tide_tensor_release(x[i]); tide_tensor_release(in[i]); free(hx[i]); }
    free(hr); free(ro);
}

/* sum(o ⊙ r) for the current inputs */
static double loss_of(tide_tensor **in, tide_tensor *cu, double scale, const double *r)
{
    tide_tensor *o = tide_varlen_attention(in[0], in[1], in[2], cu, scale);
    double *ho = host(o), L = 0;
    for (int64_t i = 0; i < o->numel; i++) L += ho[i] * r[i];
    free(ho);
    tide_tensor_release(o);
    return L;
}

/* 1: fp64 central differences; elementwise (every entry) or along 3 random directions */
static void test_gradcheck(const char *what, const int64_t *cu, int n_cu, int64_t H, int64_t D, int elementwise)
{
    int64_t T = cu[n_cu - 1], shp[3] = {T, H, D};
    const char *names[3] = {"q", "k", "v"};
    tide_tensor *in[3];
    for (int i = 0; i < 3; i++) { in[i] = randn(TIDE_F64, 3, shp); tide_set_requires_grad(in[i], 1); }
    double scale = 0.7 / sqrt((double)D);
    tide_tensor *cu_t = cu_tensor(cu, n_cu, TIDE_I32), *r = randn(TIDE_F64, 3, shp);
    double *hr = host(r);
    tide_tensor *o = run_with_grad(in, cu_t, scale, r);
    CHECK(o != NULL, "%s: forward/backward failed: %s", what, tide_last_error());
    tide_tensor_release(o); tide_tensor_release(r);
    int prev = tide_set_grad_enabled(0);
    for (int i = 0; i < 3 && o; i++) {
        int64_t n = in[i]->numel;
        double *x = host(in[i]), *g = host(in[i]->grad), *xp = malloc((size_t)n * sizeof *xp), worst = 0;
        int trials = elementwise ? (int)n : 3;
        for (int t = 0; t < trials; t++) {
            double *d = NULL, ana = 0, f[2];
            if (elementwise) ana = g[t];
            else {
                tide_tensor *dt = randn(TIDE_F64, 3, shp);
                d = host(dt);
                tide_tensor_release(dt);
                for (int64_t e = 0; e < n; e++) ana += g[e] * d[e];
            }
            for (int sgn = 0; sgn < 2; sgn++) {
                double h = sgn ? -1e-6 : 1e-6;
                for (int64_t e = 0; e < n; e++) xp[e] = x[e] + (elementwise ? (e == t ? h : 0) : h * d[e]);
                tide_write_bytes(in[i], xp, (size_t)n * 8);
                f[sgn] = loss_of(in, cu_t, scale, hr);
            }
            tide_write_bytes(in[i], x, (size_t)n * 8);
            double num = (f[0] - f[1]) / 2e-6;
            worst = fmax(worst, fabs(num - ana) / (fabs(ana) + 1e-3));
            free(d);
        }
        CHECK(worst <= 1e-6, "%s: d/d%s by central differences: relative error %.3g", what, names[i], worst);
        printf("  %-44s d/d%s central differences (%s): rel err %.2e\n", what, names[i],
               elementwise ? "every element" : "3 directions", worst);
        free(x); free(g); free(xp);
    }
    tide_set_grad_enabled(prev);
    free(hr);
    tide_tensor_release(cu_t);
    for (int i = 0; i < 3; i++) tide_tensor_release(in[i]);
}

/* 3 and 4: packing == separate, isolation, int32 == int64 boundaries */
static void test_packing_isolation(void)
{
    int64_t LA = 77, LB = 130, T = LA + LB, H = 2, D = 24, shp[3] = {T, H, D}, n = T * H * D;
    double scale = 1 / sqrt((double)D);
    tide_tensor *in[3], *ra[3], *rb[3];
    for (int i = 0; i < 3; i++) { in[i] = randn(TIDE_F64, 3, shp); tide_set_requires_grad(in[i], 1); }
    tide_tensor *r = randn(TIDE_F64, 3, shp);
    tide_tensor *cu = cu_tensor((int64_t[]){0, LA, T}, 3, TIDE_I64), *cu32 = cu_tensor((int64_t[]){0, LA, T}, 3, TIDE_I32);
    tide_tensor *op = run_with_grad(in, cu, scale, r);
    /* each image alone, as its own packed row of one image */
    int64_t lens[2] = {LA, LB}, offs[2] = {0, LA};
    double worst_o = 0, worst_g = 0;
    double *hp = host(op), *hg[3];
    for (int i = 0; i < 3; i++) hg[i] = host(in[i]->grad);
    for (int img = 0; img < 2; img++) {
        tide_tensor *part[3];
        int prev = tide_set_grad_enabled(0);
        for (int i = 0; i < 3; i++) {
            tide_tensor *sl = tide_slice(in[i], 0, offs[img], offs[img] + lens[img], 1);
            part[i] = tide_contiguous(sl);
            tide_tensor_release(sl);
        }
        tide_tensor *rs = tide_slice(r, 0, offs[img], offs[img] + lens[img], 1), *rc = tide_contiguous(rs);
        tide_set_grad_enabled(prev);
        for (int i = 0; i < 3; i++) tide_set_requires_grad(part[i], 1);
        tide_tensor *cu1 = cu_tensor((int64_t[]){0, lens[img]}, 2, TIDE_I64);
        tide_tensor *o1 = run_with_grad(part, cu1, scale, rc);
        double *h1 = host(o1);
        worst_o = fmax(worst_o, max_abs_diff(h1, hp + offs[img] * H * D, o1->numel));
        for (int i = 0; i < 3; i++) {
            double *g1 = host(part[i]->grad);
            worst_g = fmax(worst_g, max_abs_diff(g1, hg[i] + offs[img] * H * D, part[i]->numel));
            free(g1);
            tide_tensor_release(part[i]);
        }
        free(h1);
        tide_tensor_release(o1); tide_tensor_release(cu1); tide_tensor_release(rs); tide_tensor_release(rc);
        (void)ra; (void)rb;
    }
    CHECK(worst_o <= 1e-12, "packing: packed [A 77 | B 130] vs each alone, output %.3g", worst_o);
    CHECK(worst_g <= 1e-12, "packing: packed vs each alone, gradients %.3g", worst_g);
    printf("  packing == separate (A 77, B 130, fp64): output %.2e, gradients %.2e\n", worst_o, worst_g);
    /* int32 boundaries: the same numbers bitwise */
    int prev = tide_set_grad_enabled(0);
    tide_tensor *o32 = tide_varlen_attention(in[0], in[1], in[2], cu32, scale);
    double *h32 = host(o32);
    CHECK(o32 && memcmp(h32, hp, (size_t)n * sizeof *h32) == 0, "int32 and int64 cu_seqlens give different outputs");
    free(h32);
    tide_tensor_release(o32);
    /* isolation: change every input of image A (f64 and f32); B's output and gradients stay bitwise equal */
    for (int dt = 0; dt < 2; dt++) {
        int dtype = dt ? TIDE_F32 : TIDE_F64;
        tide_tensor *x[3], *rr = tide_to_dtype(r, dtype);
        tide_set_grad_enabled(0);
        for (int i = 0; i < 3; i++) { x[i] = tide_to_dtype(in[i], dtype); tide_set_requires_grad(x[i], 1); }
        tide_set_grad_enabled(1);
        tide_tensor *o1 = run_with_grad(x, cu, scale, rr);
        double *a = host(o1), *ga[3];
        for (int i = 0; i < 3; i++) { ga[i] = host(x[i]->grad); tide_zero_grad(x[i]); }
        for (int i = 0; i < 3; i++) {
            double *hx = host(x[i]);
            for (int64_t e = 0; e < LA * H * D; e++) hx[e] = hx[e] * -3 + 1;
            if (dtype == TIDE_F32) {
                float *f = malloc((size_t)n * sizeof *f);
                for (int64_t e = 0; e < n; e++) f[e] = (float)hx[e];
                tide_write_bytes(x[i], f, (size_t)n * sizeof *f);
                free(f);
            } else tide_write_bytes(x[i], hx, (size_t)n * sizeof *hx);
            free(hx);
        }
        tide_tensor *o2 = run_with_grad(x, cu, scale, rr);
        double *b = host(o2);
        int64_t off = LA * H * D, nb = LB * H * D;
        int same = memcmp(a + off, b + off, (size_t)nb * sizeof *a) == 0, changedA = memcmp(a, b, (size_t)off * sizeof *a) != 0;
        for (int i = 0; i < 3; i++) {
            double *gb = host(x[i]->grad);
            same &= memcmp(ga[i] + off, gb + off, (size_t)nb * sizeof *gb) == 0;
            free(gb); free(ga[i]);
        }
        CHECK(same && changedA, "isolation %s: image B's output/gradients changed (%d) or A's did not change (%d)",
              tide_dtype_name(dtype), !same, !changedA);
        printf("  isolation %s: image A changed, image B's output and gradients bitwise equal: %s\n", tide_dtype_name(dtype),
               same && changedA ? "yes" : "NO");
        free(a); free(b);
        tide_tensor_release(o1); tide_tensor_release(o2); tide_tensor_release(rr);
        for (int i = 0; i < 3; i++) tide_tensor_release(x[i]);
    }
    tide_set_grad_enabled(prev);
    free(hp);
    for (int i = 0; i < 3; i++) { free(hg[i]); tide_tensor_release(in[i]); }
    tide_tensor_release(op); tide_tensor_release(r); tide_tensor_release(cu); tide_tensor_release(cu32);
}

/* 5: engine bytes at the peak of forward + backward, one image of T tokens */
static int64_t peak_bytes(int64_t T)
{
    int64_t H = 1, D = 16, shp[3] = {T, H, D};
    tide_tensor *in[3];
    for (int i = 0; i < 3; i++) { in[i] = randn(TIDE_F32, 3, shp); tide_set_requires_grad(in[i], 1); }
    tide_tensor *r = randn(TIDE_F32, 3, shp), *cu = cu_tensor((int64_t[]){0, T / 2, T}, 3, TIDE_I64);
    tide_memory_stats s0, s1;
    tide_memory_stats_get(TIDE_CPU, &s0);
    tide_memory_reset_peak(TIDE_CPU);
    tide_tensor *o = run_with_grad(in, cu, 0.25, r);
    tide_memory_stats_get(TIDE_CPU, &s1);
    CHECK(o != NULL, "memory T %lld: %s", (long long)T, tide_last_error());
    tide_tensor_release(o); tide_tensor_release(r); tide_tensor_release(cu);
    for (int i = 0; i < 3; i++) tide_tensor_release(in[i]);
    return s1.peak - s0.current;
}

static void test_memory(void)
{
    int64_t p2 = peak_bytes(2048), p4 = peak_bytes(4096);
    double ratio = (double)p4 / (double)p2, tt = 4096.0 * 4096.0 * 4;
    CHECK(ratio <= 2.2 && (double)p4 < tt / 16, "memory: peak %lld bytes at T 2048, %lld at 4096 (ratio %.2f; a [T, T] "
          "f32 buffer is %.0f)", (long long)p2, (long long)p4, ratio, tt);
    printf("  memory: engine peak %lld B at T 2048, %lld B at T 4096 (ratio %.2f; one [T, T] f32 buffer: %.0f B)\n",
           (long long)p2, (long long)p4, ratio, tt);
}

/* 6: bad inputs */
static void expect_error(const char *what, tide_tensor *y, const char *needle)
{
    const char *msg = tide_last_error();
    int ok = !y && strstr(msg, "varlen_attention") && strstr(msg, needle) && !strchr(msg, '\n');
    CHECK(ok, "bad input %s: got %s \"%s\" (want an error containing \"%s\")", what, y ? "a result" : "error", msg, needle);
    if (ok) printf("  bad input %-28s -> %s\n", what, msg);
    tide_tensor_release(y);
    tide_clear_error();
}

static void test_errors(void)
{
    int64_t shp[3] = {10, 2, 4};
    tide_tensor *q = randn(TIDE_F32, 3, shp), *k = randn(TIDE_F32, 3, shp), *v = randn(TIDE_F32, 3, shp);
    tide_tensor *k9 = randn(TIDE_F32, 3, (int64_t[]){9, 2, 4}), *q4 = randn(TIDE_F32, 4, (int64_t[]){1, 10, 2, 4});
    tide_tensor *k64 = tide_to_dtype(k, TIDE_F64), *ok = cu_tensor((int64_t[]){0, 4, 10}, 3, TIDE_I32);
    tide_tensor *dec = cu_tensor((int64_t[]){0, 6, 4, 10}, 4, TIDE_I64), *end = cu_tensor((int64_t[]){0, 4, 12}, 3, TIDE_I64);
    tide_tensor *start = cu_tensor((int64_t[]){1, 4, 10}, 3, TIDE_I64);
    tide_tensor *fl = tide_from_f64(TIDE_F32, 1, (int64_t[]){3}, 0, (double[]){0, 4, 10});
    tide_tensor *cu2 = tide_from_f64(TIDE_I64, 2, (int64_t[]){1, 3}, 0, (double[]){0, 4, 10});
    expect_error("decreasing cu_seqlens", tide_varlen_attention(q, k, v, dec, 0.5), "decreases at index 2 (6 then 4)");
    expect_error("cu_seqlens ending before T", tide_varlen_attention(q, k, v, end, 0.5), "needs 0 to T = 10");
    expect_error("cu_seqlens not starting at 0", tide_varlen_attention(q, k, v, start, 0.5), "runs from 1 to 10");
    expect_error("float cu_seqlens", tide_varlen_attention(q, k, v, fl, 0.5), "cu_seqlens must be an i32 or i64");
    expect_error("2-D cu_seqlens", tide_varlen_attention(q, k, v, cu2, 0.5), "cu_seqlens is [1, 3]");
    expect_error("NULL cu_seqlens", tide_varlen_attention(q, k, v, NULL, 0.5), "cu_seqlens is NULL");
    expect_error("k of another length", tide_varlen_attention(q, k9, v, ok, 0.5), "k [9, 2, 4]");
    expect_error("4-D q", tide_varlen_attention(q4, k, v, ok, 0.5), "q [1, 10, 2, 4]");
    expect_error("mixed dtypes", tide_varlen_attention(q, k64, v, ok, 0.5), "dtypes differ");
    expect_error("infinite scale", tide_varlen_attention(q, k, v, ok, INFINITY), "scale must be finite");
    expect_error("NaN scale", tide_varlen_attention(q, k, v, ok, NAN), "scale must be finite");
    expect_error("NULL q", tide_varlen_attention(NULL, k, v, ok, 0.5), "q is NULL");
    tide_tensor *all[] = {q, k, v, k9, q4, k64, ok, dec, end, start, fl, cu2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
}

/* T = 0 (no image, cu_seqlens [0]): an empty output, and backward runs */
static void test_empty(void)
{
    int64_t shp[3] = {0, 2, 4};
    tide_tensor *in[3];
    for (int i = 0; i < 3; i++) { in[i] = tide_zeros(TIDE_F32, 3, shp, TIDE_CPU); tide_set_requires_grad(in[i], 1); }
    tide_tensor *cu = cu_tensor((int64_t[]){0}, 1, TIDE_I32), *r = tide_zeros(TIDE_F32, 3, shp, TIDE_CPU);
    tide_tensor *o = run_with_grad(in, cu, 0.5, r);
    CHECK(o && o->numel == 0 && o->ndim == 3 && o->shape[1] == 2 && o->shape[2] == 4, "T 0: %s",
          o ? "wrong output shape" : tide_last_error());
    if (o) printf("  T 0 (cu_seqlens [0]): output [0, 2, 4], backward ran\n");
    tide_tensor_release(o); tide_tensor_release(cu); tide_tensor_release(r);
    for (int i = 0; i < 3; i++) tide_tensor_release(in[i]);
}

int main(void)
{
    tide_manual_seed(29);
    printf("gradient checks (fp64, central differences, h 1e-6)\n");
    test_gradcheck("T 9, images 4, 1, 4 (every element)", (int64_t[]){0, 4, 5, 9}, 4, 2, 3, 1);
    test_gradcheck("T 210, images 1, 140, 69", (int64_t[]){0, 1, 141, 210}, 4, 2, 5, 0);
    test_gradcheck("T 600, images 530, 70 (query blocks of 256: 3 in the first)", (int64_t[]){0, 530, 600}, 3, 1, 4, 0);
    printf("tiled == definition\n");
    static const int64_t ones[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    static const int64_t mixed[4] = {0, 1, 71, 200};                 /* 1, 70 and 129 tokens */
    static const int64_t edges[5] = {0, 256, 768, 769, 1025};        /* images of 1 and 2 query blocks (256), 1, 256 */
    static const int64_t empty[6] = {0, 10, 10, 75, 75, 90};         /* two empty images (repeated boundaries) */
    static const int64_t one[2] = {0, 300};
    for (int dt = 0; dt < 2; dt++) {
        int dtype = dt ? TIDE_F32 : TIDE_F64;
        test_reference("8 images of 1 token", ones, 9, 2, 8, dtype);
        test_reference("images 1, 70, 129 (D 72, MoonViT)", mixed, 4, 3, 72, dtype);
        test_reference("images 256, 512, 1, 256 (block edges)", edges, 5, 2, 16, dtype);
        test_reference("images 10, 0, 65, 0, 15 (empty ones)", empty, 6, 2, 12, dtype);
        test_reference("one image of 300", one, 2, 1, 16, dtype);
    }
    printf("packing, isolation\n");
    test_packing_isolation();
    printf("memory\n");
    test_memory();
    test_empty();
    printf("bad inputs\n");
    test_errors();
    if (tide_graph_live_nodes() != 0) { printf("FAIL %lld graph nodes leaked\n", (long long)tide_graph_live_nodes()); g_fail++; }
    if (tide_live_tensors() != 0) { printf("FAIL %lld tensors leaked\n", (long long)tide_live_tensors()); g_fail++; }
    printf("\n%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

/*
 * test-moe — the sparse MoE ops on the CPU (spec/moe.md):
 *   SiTU-GLU (oracle 6): |h| <= 100 on [-1e4, 1e4]² without NaN (f32, f64); k = 1e9 equals SwiGLU within 1e-9;
 *     the analytic derivatives match a 5-point stencil (h = 1e-3: truncation ~1e-12, rounding ~1e-11) within 1e-9;
 *   top-k: descending, ties to the lowest index (§2), == brute force; gradient lands on the selected positions;
 *   moe_experts (oracle 7, §8): n 8, k 2 with two experts idle and one receiving every token == a dense per-token
 *     loop (f64 <= 1e-12, f32 <= 1e-5, both relative to 1 + |u|); f64 central differences for x, p, w_gate_up,
 *     w_down (|num - ana| <= 1e-7 + 1e-6 |ana|); idle experts get exactly zero weight gradients; forward and
 *     backward bitwise equal at 1, 2 and 3 threads in f32 and f64 (sizes past the OpenMP thresholds; the
 *     backward's work by expert and by tile, and segments of one and of several row tiles); sizes past the
 *     kernel's 512-row tiles == the dense loop (f64 <= 1e-12) and directional central differences; the capacity factor drops exactly the assignments past ceil(cf·m·k/n) in (t, slot)
 *     order and reports their count; argument errors name op and values.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tide.h"
#include "testutil.h"

static int g_fail, g_pass;
#define CHECK(cond, ...) do { if (cond) g_pass++; else { g_fail++; printf("  FAIL "); printf(__VA_ARGS__); printf("\n"); } } while (0)

static tide_tensor *vals(int dtype, int ndim, const int64_t *shape, const double *v) { return tide_from_f64(dtype, ndim, shape, 0, v); }

/* ---- SiTU-GLU ------------------------------------------------------------------------------------------------- */
static double sig(double x) { return x >= 0 ? 1 / (1 + exp(-x)) : exp(x) / (1 + exp(x)); }

static void test_situ(void)
{
    /* bounded, no NaN, on a grid over [-1e4, 1e4]² including the extremes */
    int64_t N = 41 * 41;
    double *g = malloc(N * sizeof *g), *u = malloc(N * sizeof *u);
    for (int i = 0; i < 41; i++)
        for (int j = 0; j < 41; j++) {
            double a = -1e4 + 2e4 * i / 40.0, b = -1e4 + 2e4 * j / 40.0;
            g[i * 41 + j] = i == 20 ? 0.37 : (fabs(a) < 1e3 ? a / 1e3 : a);   /* dense near 0 and the far ends */
            u[i * 41 + j] = fabs(b) < 1e3 ? b / 1e2 : b;
        }
    for (int dt = 0; dt < 2; dt++) {
        int dtype = dt ? TIDE_F32 : TIDE_F64;
        tide_tensor *tg = vals(dtype, 1, &N, g), *tu = vals(dtype, 1, &N, u), *h = tide_situ_glu(tg, tu, 4, 25);
        double *hv = host(h), worst = 0;
        int bad = 0;
        for (int64_t i = 0; i < N; i++) { if (!isfinite(hv[i])) bad++; worst = fmax(worst, fabs(hv[i])); }
        CHECK(!bad && worst <= 100.0, "situ %s: %d non-finite, max |h| = %g (want <= 100)", tide_dtype_name(dtype), bad, worst);
        free(hv);
        tide_tensor_release(tg); tide_tensor_release(tu); tide_tensor_release(h);
    }
    free(g); free(u);

    /* k = 1e9 is SwiGLU; a 5-point stencil of the op's own forward checks the backward */
    int64_t n = 64;
    tide_tensor *tg = tide_rand(TIDE_F64, 1, &n, 0, -8, 8), *tu = tide_rand(TIDE_F64, 1, &n, 0, -8, 8);
    tide_tensor *hs = tide_situ_glu(tg, tu, 1e9, 1e9), *hw = tide_swiglu(tg, tu);
    double *a = host(hs), *b = host(hw), worst = max_abs_diff(a, b, n);
    CHECK(worst <= 1e-9, "situ k = 1e9 vs swiglu: max diff %.3g (want <= 1e-9)", worst);
    free(a); free(b);
    tide_tensor_release(hs); tide_tensor_release(hw);

    const double kg = 1.5, kl = 2.0;   /* small caps: both tanh factors bend over [-8, 8] */
    tide_set_requires_grad(tg, 1);
    tide_set_requires_grad(tu, 1);
    tide_tensor *h = tide_situ_glu(tg, tu, kg, kl), *L = tide_sum(h, 0, NULL, 0);
    CHECK(L && !tide_backward(L, NULL), "situ backward: %s", tide_last_error());
    double *gv = host(tg), *uv = host(tu), *dg = host(tg->grad), *du = host(tu->grad), wg = 0, wu = 0, wf = 0;
    const double st = 1e-3;
    for (int64_t i = 0; i < n; i++) {
        double G = gv[i], U = uv[i];
#define HF(x, y) (kg * tanh((x) / kg) * sig(x) * kl * tanh((y) / kl))
        double ng = (-HF(G + 2 * st, U) + 8 * HF(G + st, U) - 8 * HF(G - st, U) + HF(G - 2 * st, U)) / (12 * st);
        double nu = (-HF(G, U + 2 * st) + 8 * HF(G, U + st) - 8 * HF(G, U - st) + HF(G, U - 2 * st)) / (12 * st);
#undef HF
        wg = fmax(wg, fabs(ng - dg[i]) / fmax(1, fabs(ng)));
        wu = fmax(wu, fabs(nu - du[i]) / fmax(1, fabs(nu)));
    }
    /* the same stencil through the op itself (elementwise: one call per shifted tensor) */
    double sh[4] = {2 * st, st, -st, -2 * st}, w4[4] = {-1, 8, -8, 1}, *acc = calloc(n, sizeof *acc);
    for (int s = 0; s < 4; s++) {
        double *gs = malloc(n * sizeof *gs);
        for (int64_t i = 0; i < n; i++) gs[i] = gv[i] + sh[s];
        tide_tensor *tgs = vals(TIDE_F64, 1, &n, gs), *hh = tide_situ_glu(tgs, tu, kg, kl);
        double *hv = host(hh);
        for (int64_t i = 0; i < n; i++) acc[i] += w4[s] * hv[i] / (12 * st);
        free(hv); free(gs);
        tide_tensor_release(tgs); tide_tensor_release(hh);
    }
    for (int64_t i = 0; i < n; i++) wf = fmax(wf, fabs(acc[i] - dg[i]) / fmax(1, fabs(acc[i])));
    CHECK(wg <= 1e-9 && wu <= 1e-9 && wf <= 1e-9, "situ f64 derivatives vs stencil: dg %.3g, du %.3g, op-stencil %.3g (want <= 1e-9)",
          wg, wu, wf);
    free(acc); free(gv); free(uv); free(dg); free(du);
    tide_tensor_release(h); tide_tensor_release(L); tide_tensor_release(tg); tide_tensor_release(tu);

    tide_tensor *x = tide_zeros(TIDE_F64, 1, &n, 0), *y = tide_zeros(TIDE_F64, 1, (int64_t[]){3}, 0);
    CHECK(!tide_situ_glu(x, y, 4, 25) && strstr(tide_last_error(), "situ_glu"), "situ shape error: %s", tide_last_error());
    CHECK(!tide_situ_glu(x, x, 0, 25) && strstr(tide_last_error(), "k_gate = 0"), "situ k error: %s", tide_last_error());
    tide_tensor_release(x); tide_tensor_release(y);
}

/* ---- top-k ---------------------------------------------------------------------------------------------------- */
static void test_topk(void)
{
    double row[2 * 5] = {1, 3, 3, 2, 3, -1, -1, -1, -1, -1};
    tide_tensor *x = vals(TIDE_F64, 2, (int64_t[]){2, 5}, row), *v, *id;
    CHECK(!tide_topk(x, 4, &v, &id), "topk: %s", tide_last_error());
    double *vv = host(v), *iv = host(id);
    double want_v[8] = {3, 3, 3, 2, -1, -1, -1, -1}, want_i[8] = {1, 2, 4, 3, 0, 1, 2, 3};
    int ok = id->dtype == TIDE_I64;
    for (int i = 0; i < 8; i++) ok &= vv[i] == want_v[i] && iv[i] == want_i[i];
    CHECK(ok, "topk ties: got indices %g %g %g %g | %g %g %g %g", iv[0], iv[1], iv[2], iv[3], iv[4], iv[5], iv[6], iv[7]);
    free(vv); free(iv);
    tide_tensor_release(v); tide_tensor_release(id); tide_tensor_release(x);

    /* random rows vs brute force (repeated selection of the first maximum), and the gradient */
    int64_t R = 37, C = 11, k = 4;
    x = tide_randn(TIDE_F32, 2, (int64_t[]){R, C}, 0, 0, 1);
    tide_set_requires_grad(x, 1);
    CHECK(!tide_topk(x, (int)k, &v, &id), "topk: %s", tide_last_error());
    tide_tensor *L = tide_sum(v, 0, NULL, 0);
    CHECK(L && !tide_backward(L, NULL), "topk backward: %s", tide_last_error());
    double *xv = host(x);
    vv = host(v); iv = host(id);
    ok = 1;
    for (int64_t r = 0; r < R; r++) {
        int taken[11] = {0};
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t c = 0; c < C; c++) if (!taken[c] && (best < 0 || xv[r * C + c] > xv[r * C + best])) best = c;
            taken[best] = 1;
            ok &= iv[r * k + j] == (double)best && vv[r * k + j] == xv[r * C + best];
        }
    }
    CHECK(ok, "topk == brute force on [37, 11], k 4");
    double *gx = host(x->grad);
    ok = 1;
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) {
            int chosen = 0;
            for (int64_t j = 0; j < k; j++) chosen |= iv[r * k + j] == (double)c;
            ok &= gx[r * C + c] == (chosen ? 1.0 : 0.0);
        }
    CHECK(ok, "topk gradient: 1 at the selected positions, 0 elsewhere");
    free(gx); free(xv); free(vv); free(iv);
    tide_tensor_release(L);
    tide_tensor_release(v); tide_tensor_release(id); tide_tensor_release(x);

    x = tide_zeros(TIDE_F64, 2, (int64_t[]){2, 3}, 0);
    CHECK(tide_topk(x, 4, &v, &id) && strstr(tide_last_error(), "k = 4 must be in [1, 3]"), "topk k error: %s", tide_last_error());
    tide_tensor_release(x);
}

/* ---- routed experts --------------------------------------------------------------------------------------------- */
typedef struct { int64_t m, k, n, din, de, dout; } moe_dims;

/* dense per-token loop (§8 definition); keep[a] = 0 skips assignment a (capacity) */
static void moe_ref(const moe_dims *D, const double *x, const double *sel, const double *p, const double *wgu, const double *wd,
                    int act, double kg, double kl, const int *keep, double *out)
{
    double *h = malloc((size_t)D->de * sizeof *h);
    for (int64_t t = 0; t < D->m; t++) {
        for (int64_t c = 0; c < D->dout; c++) out[t * D->dout + c] = 0;
        for (int64_t s = 0; s < D->k; s++) {
            if (keep && !keep[t * D->k + s]) continue;
            int64_t e = (int64_t)sel[t * D->k + s];
            for (int64_t j = 0; j < D->de; j++) {
                double g = 0, u = 0;
                for (int64_t i = 0; i < D->din; i++) {
                    g += wgu[(e * 2 * D->de + j) * D->din + i] * x[t * D->din + i];
                    u += wgu[(e * 2 * D->de + D->de + j) * D->din + i] * x[t * D->din + i];
                }
                h[j] = act == TIDE_MOE_SITU ? kg * tanh(g / kg) * sig(g) * kl * tanh(u / kl) : g * sig(g) * u;
            }
            for (int64_t c = 0; c < D->dout; c++) {
                double y = 0;
                for (int64_t j = 0; j < D->de; j++) y += wd[(e * D->dout + c) * D->de + j] * h[j];
                out[t * D->dout + c] += p[t * D->k + s] * y;
            }
        }
    }
    free(h);
}

typedef struct { tide_tensor *x, *sel, *p, *wgu, *wd; } moe_in;

static moe_in make_inputs(const moe_dims *D, const double *sel, int dtype, uint64_t seed)
{
    tide_manual_seed(seed);
    moe_in I;
    I.x = tide_randn(dtype, 2, (int64_t[]){D->m, D->din}, 0, 0, 1);
    I.sel = vals(TIDE_I64, 2, (int64_t[]){D->m, D->k}, sel);
    I.p = tide_rand(dtype, 2, (int64_t[]){D->m, D->k}, 0, 0.1, 1.0);
    I.wgu = tide_randn(dtype, 3, (int64_t[]){D->n, 2 * D->de, D->din}, 0, 0, 0.5);
    I.wd = tide_randn(dtype, 3, (int64_t[]){D->n, D->dout, D->de}, 0, 0, 0.5);
    return I;
}
static moe_in convert(const moe_in *I, int dtype)
{
    moe_in O = {tide_to_dtype(I->x, dtype), I->sel, tide_to_dtype(I->p, dtype), tide_to_dtype(I->wgu, dtype), tide_to_dtype(I->wd, dtype)};
    tide_tensor_retain(I->sel);
    return O;
}
static void release_inputs(moe_in *I)
{
    tide_tensor_release(I->x); tide_tensor_release(I->sel); tide_tensor_release(I->p); tide_tensor_release(I->wgu);
    tide_tensor_release(I->wd);
}

/* sel for n 8, k 2: slot 0 is expert 3 for every token (one expert receives all), slot 1 cycles over the experts
   0, 1, 2, 4, 7 (experts 5 and 6 receive none) */
static double *sel_8x2(int64_t m)
{
    static const int cyc[5] = {7, 0, 4, 1, 2};
    double *s = malloc((size_t)(m * 2) * sizeof *s);
    for (int64_t t = 0; t < m; t++) { s[2 * t] = 3; s[2 * t + 1] = cyc[(t * 3) % 5]; }
    return s;
}

static void test_dispatch_vs_dense(void)
{
    moe_dims D = {13, 2, 8, 6, 5, 7};
    double *sel = sel_8x2(D.m);
    moe_in I = make_inputs(&D, sel, TIDE_F64, 11);
    for (int act = 0; act < 2; act++)
        for (int dt = 0; dt < 2; dt++) {
            moe_in J = dt ? convert(&I, TIDE_F32) : convert(&I, TIDE_F64);
            int64_t dropped = -1;
            tide_tensor *u = tide_moe_experts(J.x, J.sel, J.p, J.wgu, J.wd, act, 4, 25, 0, &dropped);
            if (!u) { CHECK(0, "moe_experts: %s", tide_last_error()); release_inputs(&J); continue; }
            /* the reference reads the inputs as the op saw them (f32-rounded for the f32 run) */
            double *x = host(J.x), *p = host(J.p), *wgu = host(J.wgu), *wd = host(J.wd), *uv = host(u);
            double *ref = malloc((size_t)(D.m * D.dout) * sizeof *ref);
            moe_ref(&D, x, sel, p, wgu, wd, act, 4, 25, NULL, ref);
            double w = max_rel_diff(uv, ref, D.m * D.dout), tol = dt ? 1e-5 : 1e-12;
            CHECK(w <= tol && dropped == 0, "moe_experts %s %s vs dense loop: %.3g (want <= %g), dropped %lld", act ? "swiglu" : "situ",
                  dt ? "f32" : "f64", w, tol, (long long)dropped);
            free(x); free(p); free(wgu); free(wd); free(uv); free(ref);
            tide_tensor_release(u);
            release_inputs(&J);
        }
    release_inputs(&I);
    free(sel);
}

/* f64 central differences of L = Σ u ⊙ r for every float input; idle experts' weight gradients exactly 0 */
static void test_gradients(void)
{
    moe_dims D = {9, 2, 8, 4, 3, 5};
    double *sel = sel_8x2(D.m);
    for (int act = 0; act < 2; act++) {
        moe_in I = make_inputs(&D, sel, TIDE_F64, 21 + act);
        tide_tensor *in[4] = {I.x, I.p, I.wgu, I.wd};
        const char *name[4] = {"x", "p", "w_gate_up", "w_down"};
        for (int i = 0; i < 4; i++) tide_set_requires_grad(in[i], 1);
        tide_tensor *r = tide_randn(TIDE_F64, 2, (int64_t[]){D.m, D.dout}, 0, 0, 1);
        double *rv = host(r);
        tide_tensor *u = tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, act, 1.5, 2.0, 0, NULL);
        tide_tensor *pr = tide_mul(u, r), *L = tide_sum(pr, 0, NULL, 0);
        CHECK(L && !tide_backward(L, NULL), "moe backward: %s", tide_last_error());
        tide_tensor_release(pr); tide_tensor_release(L); tide_tensor_release(u);
        int prev = tide_set_grad_enabled(0);
        for (int i = 0; i < 4; i++) {
            tide_tensor *t = in[i];
            double *v = host(t), *g = host(t->grad), worst = 0;
            for (int64_t e = 0; e < t->numel; e++) {
                double f[2], o = v[e];
                for (int s = 0; s < 2; s++) {
                    v[e] = o + (s ? -1e-6 : 1e-6);
                    tide_write_bytes(t, v, (size_t)t->numel * 8);
                    tide_tensor *uu = tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, act, 1.5, 2.0, 0, NULL);
                    double *uv = host(uu), acc = 0;
                    for (int64_t j = 0; j < uu->numel; j++) acc += uv[j] * rv[j];
                    f[s] = acc;
                    free(uv);
                    tide_tensor_release(uu);
                }
                v[e] = o;
                tide_write_bytes(t, v, (size_t)t->numel * 8);
                worst = fmax(worst, fabs((f[0] - f[1]) / 2e-6 - g[e]) - 1e-6 * fabs(g[e]));
            }
            CHECK(worst <= 1e-7, "moe %s d/d%s: worst |num - ana| - 1e-6|ana| = %.3g (want <= 1e-7)", act ? "swiglu" : "situ", name[i], worst);
            if (i >= 2) {   /* experts 5 and 6 received no token */
                int64_t per = t->numel / D.n;
                int zero = 1;
                for (int64_t e = 5 * per; e < 7 * per; e++) zero &= g[e] == 0.0;
                CHECK(zero, "moe d/d%s: idle experts 5, 6 must get exactly 0", name[i]);
            }
            free(v); free(g);
        }
        tide_set_grad_enabled(prev);
        free(rv);
        tide_tensor_release(r);
        release_inputs(&I);
    }
    free(sel);
}

/* forward + backward bytes at 1, 2 and 3 threads (sizes past the OpenMP thresholds). moe.c's backward works by
   expert when n >= 4 threads and threads x the largest segment <= all rows, else by tile, so the counts compare
   both forms: the balanced routing (~150 rows per expert, one 512-row tile each) runs by expert at 1 and 2
   threads and by tile at 3; the skewed one (expert 0: 1,250 of 2,400 rows, three tiles) by expert at 1 thread
   and by tile at 2 and 3 */
static void determinism_case(const moe_dims *Dp, int skewed)
{
    moe_dims D = *Dp;
    double *sel = malloc((size_t)(D.m * D.k) * sizeof *sel);
    for (int64_t a = 0; a < D.m * D.k; a++)
        sel[a] = skewed ? (a % 2 == 0 && a / 2 < 1250 ? 0.0 : (double)(1 + (a * 7 + a / 5) % 7))
                        : (double)((a * 7 + a / 5) % 8);
    int saved = tide_num_threads();
    for (int dt = 0; dt < 2; dt++) {
        int dtype = dt ? TIDE_F32 : TIDE_F64;
        double *ref[5] = {0};
        int64_t len[5] = {0};
        int same = 1;
        for (int th = 1; th <= 3; th++) {
            tide_set_num_threads(th);
            moe_in I = make_inputs(&D, sel, dtype, 31);
            tide_tensor *in[4] = {I.x, I.p, I.wgu, I.wd};
            for (int i = 0; i < 4; i++) tide_set_requires_grad(in[i], 1);
            tide_tensor *u = tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, TIDE_MOE_SITU, 4, 25, 0, NULL);
            tide_tensor *hu = tide_situ_glu(u, u, 4, 25), *L = tide_sum(hu, 0, NULL, 0);   /* a non-uniform upstream gradient */
            if (!L || tide_backward(L, NULL)) { CHECK(0, "determinism run: %s", tide_last_error()); same = 0; }
            tide_tensor *outs[5] = {u, I.x->grad, I.p->grad, I.wgu->grad, I.wd->grad};
            for (int o = 0; o < 5 && same; o++) {
                double *b = host(outs[o]);
                if (th == 1) { ref[o] = b; len[o] = outs[o]->numel; continue; }
                /* a threaded OpenBLAS product rounds differently per thread count (a plain tide_matmul shows it,
                   in f32 and f64); the kernel cuts every product into tiles fixed by the sizes, one single-threaded
                   BLAS call each, so both dtypes must match bit for bit */
                int eq = len[o] == outs[o]->numel && !memcmp(b, ref[o], (size_t)len[o] * sizeof *b);
                if (!eq) printf("  output %d differs at %d threads\n", o, th);
                same &= eq;
                free(b);
            }
            tide_tensor_release(L); tide_tensor_release(hu); tide_tensor_release(u);
            release_inputs(&I);
        }
        CHECK(same, "moe_experts %s (%s routing): forward and gradients bitwise equal at 1, 2, 3 threads",
              tide_dtype_name(dtype), skewed ? "skewed" : "balanced");
        for (int o = 0; o < 5; o++) free(ref[o]);
    }
    tide_set_num_threads(saved);
    free(sel);
}

static void test_determinism(void)
{
    determinism_case(&(moe_dims){600, 2, 8, 48, 40, 56}, 0);
    determinism_case(&(moe_dims){1200, 2, 8, 24, 40, 32}, 1);
}

/* sizes past the kernel's 512-row tiles (moe.c): experts 0-3 get 550 rows each (two row tiles), expert 4 none;
   dWd has 520 output rows and dWgu 528 (two output tiles each). f64 forward == the dense loop (<= 1e-12), and for
   every input the gradient's directional derivative along a random v matches central differences of
   L = Σ u ⊙ r: |num - ana| <= 1e-7 (1 + |ana|). Step 1e-5: truncation ε² L'''/6 ~ 1e-10 |L|, rounding
   ~1e-16 Σ|u ⊙ r| / ε ~ 1e-11 |L|-scale; a wrong tile offset moves ⟨g, v⟩ by a share of a whole tile, O(0.1 |ana|). */
static void test_tiles(void)
{
    moe_dims D = {1100, 2, 5, 24, 264, 520};
    double *sel = malloc((size_t)(D.m * D.k) * sizeof *sel);
    for (int64_t t = 0; t < D.m; t++) { sel[2 * t] = (double)(t % 4); sel[2 * t + 1] = (double)((t + 2) % 4); }
    moe_in I = make_inputs(&D, sel, TIDE_F64, 61);
    tide_tensor *in[4] = {I.x, I.p, I.wgu, I.wd};
    const char *name[4] = {"x", "p", "w_gate_up", "w_down"};
    for (int i = 0; i < 4; i++) tide_set_requires_grad(in[i], 1);
    tide_tensor *r = tide_randn(TIDE_F64, 2, (int64_t[]){D.m, D.dout}, 0, 0, 1);
    double *rv = host(r);
    tide_tensor *u = tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, TIDE_MOE_SITU, 4, 25, 0, NULL);
    double *x = host(I.x), *p = host(I.p), *wgu = host(I.wgu), *wd = host(I.wd), *uv = host(u);
    double *ref = malloc((size_t)(D.m * D.dout) * sizeof *ref);
    moe_ref(&D, x, sel, p, wgu, wd, TIDE_MOE_SITU, 4, 25, NULL, ref);
    double w = max_rel_diff(uv, ref, D.m * D.dout);
    CHECK(w <= 1e-12, "moe_experts f64 past the tiles vs dense loop: %.3g (want <= 1e-12)", w);
    tide_tensor *pr = tide_mul(u, r), *L = tide_sum(pr, 0, NULL, 0);
    CHECK(L && !tide_backward(L, NULL), "moe backward past the tiles: %s", tide_last_error());
    tide_tensor_release(pr); tide_tensor_release(L); tide_tensor_release(u);
    int prev = tide_set_grad_enabled(0);
    for (int i = 0; i < 4; i++) {
        tide_tensor *t = in[i], *dir = tide_randn(TIDE_F64, t->ndim, t->shape, 0, 0, 1);
        double *v = host(t), *g = host(t->grad), *dv = host(dir), *moved = malloc((size_t)t->numel * sizeof *moved);
        double f[2], ana = 0, eps = 1e-5;
        for (int64_t e = 0; e < t->numel; e++) ana += g[e] * dv[e];
        for (int s = 0; s < 2; s++) {
            for (int64_t e = 0; e < t->numel; e++) moved[e] = v[e] + (s ? -eps : eps) * dv[e];
            tide_write_bytes(t, moved, (size_t)t->numel * 8);
            tide_tensor *uu = tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, TIDE_MOE_SITU, 4, 25, 0, NULL);
            double *uuv = host(uu), acc = 0;
            for (int64_t j = 0; j < uu->numel; j++) acc += uuv[j] * rv[j];
            f[s] = acc;
            free(uuv);
            tide_tensor_release(uu);
        }
        tide_write_bytes(t, v, (size_t)t->numel * 8);
        double num = (f[0] - f[1]) / (2 * eps), err = fabs(num - ana) / (1 + fabs(ana));
        CHECK(err <= 1e-7, "moe past the tiles d/d%s along v: num %.12g, ana %.12g, rel %.3g (want <= 1e-7)", name[i], num,
              ana, err);
        if (i >= 2) {   /* expert 4 received no token */
            int64_t per = t->numel / D.n;
            int zero = 1;
            for (int64_t e = 4 * per; e < 5 * per; e++) zero &= g[e] == 0.0;
            CHECK(zero, "moe past the tiles d/d%s: idle expert 4 must get exactly 0", name[i]);
        }
        free(v); free(g); free(dv); free(moved);
        tide_tensor_release(dir);
    }
    tide_set_grad_enabled(prev);
    free(x); free(p); free(wgu); free(wd); free(uv); free(ref); free(rv); free(sel);
    tide_tensor_release(r);
    release_inputs(&I);
}

/* capacity: n 4, k 2, m 7, cf 1 -> cap = ceil(1·14/4) = 4 per expert, kept in (t, slot) order */
static void test_capacity(void)
{
    moe_dims D = {7, 2, 4, 3, 4, 3};
    double sel[14] = {0, 1, 0, 2, 1, 0, 0, 1, 0, 3, 2, 0, 1, 0};  /* expert 0 gets 7 (3 dropped), 1 gets 4, 2 gets 2, 3 gets 1 */
    int keep[14], cnt[4] = {0}, want_drop = 0;
    for (int a = 0; a < 14; a++) { int e = (int)sel[a]; keep[a] = cnt[e]++ < 4; want_drop += !keep[a]; }
    moe_in I = make_inputs(&D, sel, TIDE_F64, 41);
    tide_set_requires_grad(I.p, 1);
    int64_t dropped = -1;
    tide_tensor *u = tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, TIDE_MOE_SITU, 4, 25, 1.0, &dropped);
    double *x = host(I.x), *p = host(I.p), *wgu = host(I.wgu), *wd = host(I.wd), *uv = host(u);
    double ref[21];
    moe_ref(&D, x, sel, p, wgu, wd, TIDE_MOE_SITU, 4, 25, keep, ref);
    double w = max_rel_diff(uv, ref, 21);
    CHECK(dropped == want_drop && want_drop == 3 && w <= 1e-12, "capacity 1.0: dropped %lld (want %d), vs dense loop %.3g",
          (long long)dropped, want_drop, w);
    tide_tensor *L = tide_sum(u, 0, NULL, 0);
    tide_backward(L, NULL);
    double *dp = host(I.p->grad);
    int ok = 1;
    for (int a = 0; a < 14; a++) ok &= keep[a] ? dp[a] != 0.0 : dp[a] == 0.0;
    CHECK(ok, "capacity: dp is exactly 0 for the dropped assignments and only for them");
    /* cf 0.5: cap = ceil(1.75) = 2 -> 5 + 2 dropped; cf 1.5: cap = 6 -> 1; cf 2: cap = 7 -> none */
    tide_tensor *u2 = tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, TIDE_MOE_SITU, 4, 25, 0.5, &dropped);
    CHECK(u2 && dropped == 7, "capacity 0.5: dropped %lld (want 7)", (long long)dropped);
    tide_tensor_release(u2);
    u2 = tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, TIDE_MOE_SITU, 4, 25, 1.5, &dropped);
    CHECK(u2 && dropped == 1, "capacity 1.5: dropped %lld (want 1)", (long long)dropped);
    tide_tensor_release(u2);
    u2 = tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, TIDE_MOE_SITU, 4, 25, 2.0, &dropped);
    CHECK(u2 && dropped == 0, "capacity 2.0: dropped %lld (want 0)", (long long)dropped);
    free(x); free(p); free(wgu); free(wd); free(uv); free(dp);
    tide_tensor_release(u); tide_tensor_release(u2); tide_tensor_release(L);
    release_inputs(&I);
}

static void test_errors(void)
{
    moe_dims D = {3, 2, 4, 3, 2, 3};
    double sel[6] = {0, 1, 2, 4, 3, 3};
    moe_in I = make_inputs(&D, sel, TIDE_F64, 51);
    CHECK(!tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, 0, 4, 25, 0, NULL) && strstr(tide_last_error(), "expert id 4, outside [0, 4)"),
          "sel range error: %s", tide_last_error());
    CHECK(!tide_moe_experts(I.x, I.sel, I.p, I.wd, I.wd, 0, 4, 25, 0, NULL) && strstr(tide_last_error(), "moe_experts: x [3, 3]"),
          "shape error: %s", tide_last_error());
    CHECK(!tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, 2, 4, 25, 0, NULL) && strstr(tide_last_error(), "activation = 2"),
          "activation error: %s", tide_last_error());
    CHECK(!tide_moe_experts(I.x, I.sel, I.p, I.wgu, I.wd, 0, 4, 25, -1, NULL) && strstr(tide_last_error(), "capacity_factor = -1"),
          "capacity error: %s", tide_last_error());
    release_inputs(&I);
}

int main(void)
{
    test_situ();
    test_topk();
    test_dispatch_vs_dense();
    test_gradients();
    test_determinism();
    test_tiles();
    test_capacity();
    test_errors();
    if (tide_live_tensors() != 0) { printf("  FAIL %lld tensors leaked\n", (long long)tide_live_tensors()); g_fail++; }
    printf("test-moe: %d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

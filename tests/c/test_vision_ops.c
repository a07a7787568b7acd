/*
 * test-vision-ops — the ViT position ops and the exact GELU (spec/vision.md §4, §6), on the CPU:
 *   rope2d: float64 central-difference gradient check of x (|num − ana| / (1 + |ana|) <= 1e-6, eps 1e-6); the
 *           forward against the §4 formula written out here (f64 <= 1e-13); oracle 2 in fp32: norm preserved
 *           (rel <= 1e-6), q·k after rotation unchanged when both position sets shift by (3, 5) (<= 1e-5 of
 *           |q||k|), slot 0 rotates by col·θ⁰ and slot 1 by row·θ⁰ (<= 1e-6); i32 and i64 positions agree
 *           bitwise; bad head_dim, positions and shapes are one-line errors naming the op.
 *   pos_interp: the gradient check of the table for upsample, downsample, non-square, 1x1 and the native grid,
 *           alone and packed; oracle 6 (the native grid returns the table bitwise, f32 and f64, alone and inside
 *           a pack); a constant table stays constant (<= 1e-13); two backward passes agree bitwise.
 *   gelu_erf: against 0.5 x (1 + erf(x/√2)) in double (|Δ|/(1 + |y|) <= 1e-15), f32 (<= 1e-6), its
 *           gradient check, and its distance from the tanh form (vision.md §6: ~1e-3, not interchangeable).
 * PyTorch parity of pos_interp and gelu_erf: tests/lua/test_vision_ops.lua.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tide.h"
#include "testutil.h"

static int g_pass, g_fail;
static void report(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#include <stdarg.h>
static void report(int ok, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("%-5s ", ok ? "ok" : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    if (ok) g_pass++;
    else g_fail++;
}

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static double urand(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}
static double nrand(void)
{
    double u = urand(), v = urand();
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

static tide_tensor *tensor(int dtype, int ndim, const int64_t *shape, const double *v)
{
    tide_tensor *t = tide_from_f64(dtype, ndim, shape, 0, v);
    if (!t) { printf("tensor: %s\n", tide_last_error()); exit(2); }
    return t;
}
static tide_tensor *randn_tensor(int dtype, int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    double *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = nrand();
    tide_tensor *t = tensor(dtype, ndim, shape, v);
    free(v);
    return t;
}

/* ---- the float64 gradient check: L = Σ f(x) ⊙ r, every element of x perturbed by ±1e-6 ---------------------- */
typedef tide_tensor *(*fn1)(tide_tensor *x, void *ctx);

/* the worst |num − ana| / (1 + |ana|) (vision.md oracle 8: rel <= 1e-6) */
static double gradcheck(fn1 f, void *ctx, tide_tensor *x)
{
    tide_set_requires_grad(x, 1);
    tide_zero_grad(x);
    tide_tensor *y = f(x, ctx);
    if (!y) { printf("  forward failed: %s\n", tide_last_error()); return INFINITY; }
    tide_tensor *r = tide_randn(TIDE_F64, y->ndim, y->shape, 0, 0, 1);
    tide_tensor *p = tide_mul(y, r), *L = tide_sum(p, 0, NULL, 0);
    if (!L || tide_backward(L, NULL)) { printf("  backward failed: %s\n", tide_last_error()); return INFINITY; }
    double *rv = host(r), *xv = host(x), *gv = host(x->grad), worst = 0;
    int prev = tide_set_grad_enabled(0);
    for (int64_t e = 0; e < x->numel; e++) {
        double fs[2], orig = xv[e];
        for (int s = 0; s < 2; s++) {
            xv[e] = orig + (s ? -1e-6 : 1e-6);
            tide_write_bytes(x, xv, (size_t)x->numel * 8);
            tide_tensor *yy = f(x, ctx);
            double *yv = host(yy), acc = 0;
            for (int64_t j = 0; j < yy->numel; j++) acc += yv[j] * rv[j];
            fs[s] = acc;
            free(yv);
            tide_tensor_release(yy);
        }
        xv[e] = orig;
        tide_write_bytes(x, xv, (size_t)x->numel * 8);
        double num = (fs[0] - fs[1]) / 2e-6;
        worst = fmax(worst, fabs(num - gv[e]) / (1 + fabs(gv[e])));
    }
    tide_set_grad_enabled(prev);
    tide_set_requires_grad(x, 0);
    tide_zero_grad(x);
    free(rv); free(xv); free(gv);
    tide_tensor_release(y); tide_tensor_release(r); tide_tensor_release(p); tide_tensor_release(L);
    return worst;
}

/* ---- rope2d ------------------------------------------------------------------------------------------------------ */
typedef struct { tide_tensor *pos; double theta; } rope_ctx;
static tide_tensor *f_rope2d(tide_tensor *x, void *c)
{
    rope_ctx *r = c;
    return tide_rope2d(x, r->pos, r->theta);
}

/* positions [T, 2] in [0, hi) */
static tide_tensor *positions(int dtype, int64_t T, int64_t hi, int64_t drow, int64_t dcol, double *keep)
{
    double *v = malloc((size_t)(2 * T) * sizeof *v);
    for (int64_t t = 0; t < T; t++) {
        v[2 * t] = (double)(int64_t)(urand() * (double)hi) + (double)drow;
        v[2 * t + 1] = (double)(int64_t)(urand() * (double)hi) + (double)dcol;
    }
    if (keep) memcpy(keep, v, (size_t)(2 * T) * sizeof *v);
    tide_tensor *p = tensor(dtype, 2, (int64_t[]){T, 2}, v);
    free(v);
    return p;
}

/* vision.md §4 written out */
static void ref_rope2d(double *y, const double *x, const double *pos, int64_t T, int64_t H, int64_t hd, double theta)
{
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t j = 0; j < hd / 2; j++) {
                int64_t i = j / 2;
                double p = j % 2 == 0 ? pos[2 * t + 1] : pos[2 * t];
                double phi = p * pow(theta, -4.0 * (double)i / (double)hd);
                const double *a = x + (t * H + h) * hd + 2 * j;
                double *o = y + (t * H + h) * hd + 2 * j;
                o[0] = a[0] * cos(phi) - a[1] * sin(phi);
                o[1] = a[0] * sin(phi) + a[1] * cos(phi);
            }
}

static void test_rope2d(void)
{
    /* gradient check, i64 and i32 positions, theta 10000 and a small theta (large angles on every slot) */
    double th[2] = {10000.0, 3.0};
    for (int k = 0; k < 2; k++) {
        rope_ctx c = {positions(k ? TIDE_I32 : TIDE_I64, 6, 512, 0, 0, NULL), th[k]};
        tide_tensor *x = randn_tensor(TIDE_F64, 3, (int64_t[]){6, 2, 8});
        double w = gradcheck(f_rope2d, &c, x);
        report(w <= 1e-6, "rope2d gradient check [6,2,8] %s pos, theta %g: max |num - ana|/(1 + |ana|) = %.2e (tol 1e-6)",
               k ? "i32" : "i64", th[k], w);
        tide_tensor_release(x); tide_tensor_release(c.pos);
    }

    /* forward against the formula, f64; i32 and i64 positions give identical bits; head_dim 520 passes the kernel's
       256-slot angle cache */
    for (int big = 0; big < 2; big++) {
        int64_t T = 7, H = big ? 1 : 3, hd = big ? 520 : 72;
        double pv[14];
        tide_tensor *p64 = positions(TIDE_I64, T, 512, 0, 0, pv), *p32 = tensor(TIDE_I32, 2, (int64_t[]){T, 2}, pv);
        tide_tensor *x = randn_tensor(TIDE_F64, 3, (int64_t[]){T, H, hd});
        tide_tensor *y = tide_rope2d(x, p64, 10000.0), *y32 = tide_rope2d(x, p32, 10000.0);
        double *xv = host(x), *yv = host(y), *y32v = host(y32), *rv = malloc((size_t)(T * H * hd) * sizeof *rv);
        ref_rope2d(rv, xv, pv, T, H, hd, 10000.0);
        double e = max_abs_diff(yv, rv, T * H * hd);
        report(e <= 1e-13, "rope2d f64 [7,%lld,%lld] vs the vision.md §4 formula: max |diff| = %.2e (tol 1e-13)", (long long)H,
               (long long)hd, e);
        report(!memcmp(yv, y32v, (size_t)(T * H * hd) * sizeof *yv), "rope2d i32 and i64 positions agree bitwise");
        free(xv); free(yv); free(y32v); free(rv);
        tide_tensor_release(p64); tide_tensor_release(p32); tide_tensor_release(x); tide_tensor_release(y);
        tide_tensor_release(y32);
    }

    /* a grid's positions repeat: the kernel takes its angle table (one row per distinct value). The first 20 of the
       tokens alone (20 distinct values for 20 tokens) take the per-token path: both agree bitwise on those tokens,
       f32 and f64, and with the formula */
    {
        int64_t T = 300, T0 = 20, H = 2, hd = 72;
        double pv[2 * 300];
        for (int64_t t = 0; t < T; t++) { pv[2 * t] = (double)(t / 30); pv[2 * t + 1] = (double)(t % 30); }
        tide_tensor *pt = tensor(TIDE_I64, 2, (int64_t[]){T, 2}, pv), *p0 = tensor(TIDE_I64, 2, (int64_t[]){T0, 2}, pv);
        for (int f64 = 0; f64 < 2; f64++) {
            tide_tensor *x = randn_tensor(f64 ? TIDE_F64 : TIDE_F32, 3, (int64_t[]){T, H, hd});
            tide_tensor *x0 = tide_slice(x, 0, 0, T0, 1), *x0c = tide_contiguous(x0);
            tide_tensor *yt = tide_rope2d(x, pt, 10000.0), *y0 = tide_rope2d(x0c, p0, 10000.0);
            if (!yt || !y0) { printf("rope2d: %s\n", tide_last_error()); exit(2); }
            double *xv = host(x), *ytv = host(yt), *y0v = host(y0), *rv = malloc((size_t)(T * H * hd) * sizeof *rv);
            ref_rope2d(rv, xv, pv, T, H, hd, 10000.0);
            double e = max_abs_diff(ytv, rv, T * H * hd);
            report(!memcmp(ytv, y0v, (size_t)(T0 * H * hd) * sizeof *ytv) && e <= (f64 ? 1e-13 : 1e-5),
                   "rope2d %s [300,2,72] on a 10x30 grid: the angle table and the per-token path agree bitwise; "
                   "max |diff| from the formula %.2e", f64 ? "f64" : "f32", e);
            free(xv); free(ytv); free(y0v); free(rv);
            tide_tensor_release(x); tide_tensor_release(x0); tide_tensor_release(x0c); tide_tensor_release(yt);
            tide_tensor_release(y0);
        }
        tide_tensor_release(pt); tide_tensor_release(p0);
    }

    /* oracle 2, fp32, MoonViT's head_dim 72 */
    {
        int64_t T = 40, H = 2, hd = 72;
        double pv[80], sv[80];
        tide_tensor *pos = positions(TIDE_I64, T, 500, 0, 0, pv);
        for (int64_t t = 0; t < T; t++) { sv[2 * t] = pv[2 * t] + 3; sv[2 * t + 1] = pv[2 * t + 1] + 5; }
        tide_tensor *shifted = tensor(TIDE_I64, 2, (int64_t[]){T, 2}, sv);
        tide_tensor *q = randn_tensor(TIDE_F32, 3, (int64_t[]){T, H, hd}), *k = randn_tensor(TIDE_F32, 3, (int64_t[]){T, H, hd});
        tide_tensor *qr = tide_rope2d(q, pos, 10000.0), *kr = tide_rope2d(k, pos, 10000.0);
        tide_tensor *qs = tide_rope2d(q, shifted, 10000.0), *ks = tide_rope2d(k, shifted, 10000.0);
        double *qv = host(q), *kv = host(k), *qrv = host(qr), *krv = host(kr), *qsv = host(qs), *ksv = host(ks);
        double norm_err = 0, dot_err = 0;
        for (int64_t r = 0; r < T * H; r++) {
            double a = 0, b = 0;
            for (int64_t c = 0; c < hd; c++) { a += qv[r * hd + c] * qv[r * hd + c]; b += qrv[r * hd + c] * qrv[r * hd + c]; }
            norm_err = fmax(norm_err, fabs(sqrt(b) - sqrt(a)) / sqrt(a));
        }
        for (int64_t i = 0; i < T; i++)
            for (int64_t j = 0; j < T; j++)
                for (int64_t h = 0; h < H; h++) {
                    double d1 = 0, d2 = 0, nq = 0, nk = 0;
                    const double *a1 = qrv + (i * H + h) * hd, *b1 = krv + (j * H + h) * hd;
                    const double *a2 = qsv + (i * H + h) * hd, *b2 = ksv + (j * H + h) * hd;
                    for (int64_t c = 0; c < hd; c++) {
                        d1 += a1[c] * b1[c]; d2 += a2[c] * b2[c];
                        nq += qv[(i * H + h) * hd + c] * qv[(i * H + h) * hd + c];
                        nk += kv[(j * H + h) * hd + c] * kv[(j * H + h) * hd + c];
                    }
                    dot_err = fmax(dot_err, fabs(d1 - d2) / sqrt(nq * nk));
                }
        report(norm_err <= 1e-6, "rope2d oracle 2 fp32 [40,2,72]: norm preserved, max rel error %.2e (tol 1e-6)", norm_err);
        report(dot_err <= 1e-5, "rope2d oracle 2 fp32: q·k unchanged when both positions shift by (3, 5), max |Δ|/(|q||k|) "
               "%.2e (tol 1e-5)", dot_err);
        free(qv); free(kv); free(qrv); free(krv); free(qsv); free(ksv);
        tide_tensor *ts[8] = {pos, shifted, q, k, qr, kr, qs, ks};
        for (int i = 0; i < 8; i++) tide_tensor_release(ts[i]);
    }

    /* oracle 2: a vector only in slot 0 rotates by col·θ⁰, only in slot 1 by row·θ⁰ (fp32) */
    {
        int64_t T = 4, hd = 16;
        double pv[8] = {3, 100, 511, 7, 0, 255, 42, 0}, xv[4 * 16] = {0};
        for (int64_t t = 0; t < T; t++) {
            xv[t * hd + 0] = 0.6; xv[t * hd + 1] = -0.8;   /* slot 0 of token t */
        }
        double worst[2] = {0, 0};
        for (int slot = 0; slot < 2; slot++) {
            double in[4 * 16] = {0};
            for (int64_t t = 0; t < T; t++) { in[t * hd + 2 * slot] = xv[t * hd]; in[t * hd + 2 * slot + 1] = xv[t * hd + 1]; }
            tide_tensor *x = tensor(TIDE_F32, 3, (int64_t[]){T, 1, hd}, in), *pos = tensor(TIDE_I32, 2, (int64_t[]){T, 2}, pv);
            tide_tensor *y = tide_rope2d(x, pos, 10000.0);
            double *yv = host(y);
            for (int64_t t = 0; t < T; t++) {
                double phi = slot == 0 ? pv[2 * t + 1] : pv[2 * t];   /* col, then row; θ⁰ = 1 */
                for (int64_t c = 0; c < hd; c++) {
                    double want = 0;
                    if (c == 2 * slot) want = 0.6 * cos(phi) + 0.8 * sin(phi);
                    if (c == 2 * slot + 1) want = 0.6 * sin(phi) - 0.8 * cos(phi);
                    worst[slot] = fmax(worst[slot], fabs(yv[t * hd + c] - want));
                }
            }
            free(yv);
            tide_tensor_release(x); tide_tensor_release(pos); tide_tensor_release(y);
        }
        report(worst[0] <= 1e-6 && worst[1] <= 1e-6,
               "rope2d oracle 2 fp32: slot 0 rotates by col (max |diff| %.2e), slot 1 by row (%.2e) (tol 1e-6)", worst[0],
               worst[1]);
    }

    /* errors: one line naming the op */
    {
        tide_tensor *x6 = randn_tensor(TIDE_F32, 3, (int64_t[]){2, 1, 6}), *x8 = randn_tensor(TIDE_F32, 3, (int64_t[]){2, 1, 8});
        tide_tensor *ok = tensor(TIDE_I32, 2, (int64_t[]){2, 2}, (double[]){0, 1, 2, 3});
        tide_tensor *big = tensor(TIDE_I32, 2, (int64_t[]){2, 2}, (double[]){0, 1, 512, 3});
        tide_tensor *neg = tensor(TIDE_I64, 2, (int64_t[]){2, 2}, (double[]){0, -1, 2, 3});
        tide_tensor *flt = tensor(TIDE_F32, 2, (int64_t[]){2, 2}, (double[]){0, 1, 2, 3});
        tide_tensor *shp = tensor(TIDE_I32, 2, (int64_t[]){3, 2}, (double[]){0, 1, 2, 3, 4, 5});
        struct { tide_tensor *x, *pos; const char *want; } bad[] = {
            {x6, ok, "head_dim a multiple of 4"}, {x8, big, "position 512"}, {x8, neg, "position -1"},
            {x8, flt, "pos must be an i32 or i64"}, {x8, shp, "pos must be [T, 2]"},
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            tide_tensor *y = tide_rope2d(bad[i].x, bad[i].pos, 10000.0);
            const char *m = tide_last_error();
            report(!y && strstr(m, "rope2d") && strstr(m, bad[i].want) && !strchr(m, '\n'), "rope2d error: %s", m);
            tide_tensor_release(y);
            tide_clear_error();
        }
        report(!tide_rope2d(x8, ok, 0.0) && strstr(tide_last_error(), "theta"), "rope2d error: %s", tide_last_error());
        tide_tensor *ts[7] = {x6, x8, ok, big, neg, flt, shp};
        for (int i = 0; i < 7; i++) tide_tensor_release(ts[i]);
    }
}

/* ---- pos_interp ------------------------------------------------------------------------------------------------ */
typedef struct { tide_tensor *grids; } interp_ctx;
static tide_tensor *f_interp(tide_tensor *x, void *c) { return tide_pos_interp(x, ((interp_ctx *)c)->grids); }

static tide_tensor *grids_of(int n, const int *hw)
{
    double v[32];
    for (int i = 0; i < 2 * n; i++) v[i] = hw[i];
    return tensor(TIDE_I32, 2, (int64_t[]){n, 2}, v);
}

static void test_pos_interp(void)
{
    /* gradient checks on a [4, 4, 3] table */
    struct { const char *what; int n; int hw[10]; } cases[] = {
        {"upsample 4x4 -> 9x7", 1, {9, 7}},      {"downsample 4x4 -> 2x3", 1, {2, 3}},
        {"non-square 4x4 -> 3x6", 1, {3, 6}},    {"1x1", 1, {1, 1}},
        {"native grid 4x4 (copy)", 1, {4, 4}},   {"packed 9x7, 2x3, 1x1, 4x4, 5x2", 5, {9, 7, 2, 3, 1, 1, 4, 4, 5, 2}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        interp_ctx c = {grids_of(cases[i].n, cases[i].hw)};
        tide_tensor *t = randn_tensor(TIDE_F64, 3, (int64_t[]){4, 4, 3});
        double w = gradcheck(f_interp, &c, t);
        report(w <= 1e-6, "pos_interp gradient check, %s: max |num - ana|/(1 + |ana|) = %.2e (tol 1e-6)", cases[i].what, w);
        tide_tensor_release(t); tide_tensor_release(c.grids);
    }
    /* a non-square table (any [Gh, Gw, d]) */
    {
        interp_ctx c = {grids_of(2, (int[]){5, 2, 3, 5})};
        tide_tensor *t = randn_tensor(TIDE_F64, 3, (int64_t[]){3, 5, 2});
        double w = gradcheck(f_interp, &c, t);
        report(w <= 1e-6, "pos_interp gradient check, table [3,5,2] -> 5x2 and its own 3x5: max |num - ana|/(1 + |ana|) = %.2e (tol 1e-6)", w);
        tide_tensor_release(t); tide_tensor_release(c.grids);
    }

    /* oracle 6: the native grid returns the table bitwise, alone and as the second image of a pack */
    for (int dt = 0; dt < 2; dt++) {
        int dtype = dt ? TIDE_F64 : TIDE_F32;
        size_t es = dt ? 8 : 4;
        tide_tensor *t = randn_tensor(dtype, 3, (int64_t[]){8, 8, 16});
        tide_tensor *g1 = grids_of(1, (int[]){8, 8}), *g2 = grids_of(2, (int[]){3, 5, 8, 8});
        tide_tensor *y1 = tide_pos_interp(t, g1), *y2 = tide_pos_interp(t, g2);
        size_t nb = 8 * 8 * 16 * es;
        char *a = malloc(nb), *b = malloc(nb), *c = malloc((3 * 5 + 64) * 16 * es);
        tide_read_bytes(t, a, nb);
        tide_read_bytes(y1, b, nb);
        tide_read_bytes(y2, c, (3 * 5 + 64) * 16 * es);
        report(y1 && y2 && y1->shape[0] == 64 && y2->shape[0] == 79 && !memcmp(a, b, nb) && !memcmp(a, c + 15 * 16 * es, nb),
               "pos_interp oracle 6 (%s): (h, w) = (G, G) returns the table bitwise, alone and after a 3x5 image",
               dt ? "f64" : "f32");
        free(a); free(b); free(c);
        tide_tensor_release(t); tide_tensor_release(g1); tide_tensor_release(g2); tide_tensor_release(y1);
        tide_tensor_release(y2);
    }

    /* the weights of every output sum to 1: a constant table stays constant (f64) */
    {
        tide_tensor *t = tide_full(TIDE_F64, 3, (int64_t[]){8, 8, 4}, 0, 0.37);
        tide_tensor *g = grids_of(4, (int[]){64, 64, 3, 17, 1, 1, 5, 8});
        tide_tensor *y = tide_pos_interp(t, g);
        double *v = host(y), e = 0;
        for (int64_t i = 0; i < y->numel; i++) e = fmax(e, fabs(v[i] - 0.37));
        report(e <= 1e-13, "pos_interp: a constant table stays constant on 64x64, 3x17, 1x1, 5x8: max |diff| %.2e (tol 1e-13)", e);
        free(v);
        tide_tensor_release(t); tide_tensor_release(g); tide_tensor_release(y);
    }

    /* determinism: two backward passes give the same bits (no atomics) */
    {
        tide_tensor *t = randn_tensor(TIDE_F32, 3, (int64_t[]){8, 8, 32});
        tide_tensor *g = grids_of(3, (int[]){13, 21, 8, 8, 4, 6});
        tide_tensor *r = tide_randn(TIDE_F32, 2, (int64_t[]){13 * 21 + 64 + 24, 32}, 0, 0, 1);
        float *gr[2];
        for (int k = 0; k < 2; k++) {
            tide_set_requires_grad(t, 1);
            tide_zero_grad(t);
            tide_tensor *y = tide_pos_interp(t, g), *p = tide_mul(y, r), *L = tide_sum(p, 0, NULL, 0);
            tide_backward(L, NULL);
            gr[k] = malloc(8 * 8 * 32 * sizeof(float));
            tide_read_bytes(t->grad, gr[k], 8 * 8 * 32 * sizeof(float));
            tide_tensor_release(y); tide_tensor_release(p); tide_tensor_release(L);
        }
        report(!memcmp(gr[0], gr[1], 8 * 8 * 32 * sizeof(float)), "pos_interp: two backward passes agree bitwise (f32, 3 images)");
        free(gr[0]); free(gr[1]);
        tide_zero_grad(t);
        tide_tensor_release(t); tide_tensor_release(g); tide_tensor_release(r);
    }

    /* errors */
    {
        tide_tensor *t = randn_tensor(TIDE_F32, 3, (int64_t[]){4, 4, 2}), *t2 = randn_tensor(TIDE_F32, 2, (int64_t[]){4, 4});
        tide_tensor *zero = grids_of(2, (int[]){3, 3, 0, 2}), *shp = tensor(TIDE_I32, 2, (int64_t[]){1, 3}, (double[]){1, 2, 3});
        tide_tensor *ok = grids_of(1, (int[]){2, 2}), *flt = tensor(TIDE_F32, 2, (int64_t[]){1, 2}, (double[]){2, 2});
        struct { tide_tensor *t, *g; const char *want; } bad[] = {
            {t, zero, "image 1"}, {t, shp, "grids must be [n, 2]"}, {t2, ok, "table must be [G, G, d]"},
            {t, flt, "grids must be an i32 or i64"},
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            tide_tensor *y = tide_pos_interp(bad[i].t, bad[i].g);
            const char *m = tide_last_error();
            report(!y && strstr(m, "pos_interp") && strstr(m, bad[i].want) && !strchr(m, '\n'), "pos_interp error: %s", m);
            tide_tensor_release(y);
            tide_clear_error();
        }
        tide_tensor *ts[6] = {t, t2, zero, shp, ok, flt};
        for (int i = 0; i < 6; i++) tide_tensor_release(ts[i]);
    }
}

/* ---- gelu_erf ---------------------------------------------------------------------------------------------------- */
static tide_tensor *f_gelu_erf(tide_tensor *x, void *c) { (void)c; return tide_gelu_erf(x); }

static void test_gelu_erf(void)
{
    enum { N = 2001 };
    double *v = malloc(N * sizeof *v);
    for (int i = 0; i < N; i++) v[i] = -10.0 + 20.0 * i / (N - 1);
    v[0] = -38.0; v[N - 1] = 38.0; v[N / 2] = 0.0;
    tide_tensor *x = tensor(TIDE_F64, 1, (int64_t[]){N}, v), *x32 = tensor(TIDE_F32, 1, (int64_t[]){N}, v);
    tide_tensor *y = tide_gelu_erf(x), *y32 = tide_gelu_erf(x32), *yt = tide_gelu(x);
    double *yv = host(y), *y32v = host(y32), *ytv = host(yt), *x32v = host(x32), e = 0, e32 = 0, dt = 0;
    for (int i = 0; i < N; i++) {
        /* PyTorch's form (GeluKernel): x · 0.5 · (1 + erf(x · M_SQRT1_2)) */
        double want = 0.5 * v[i] * (1.0 + erf(v[i] * 0.70710678118654752440));
        e = fmax(e, fabs(yv[i] - want) / (1 + fabs(want)));
        double w32 = 0.5 * x32v[i] * (1.0 + erf(x32v[i] * 0.70710678118654752440));
        e32 = fmax(e32, fabs(y32v[i] - w32) / (1 + fabs(w32)));
        dt = fmax(dt, fabs(ytv[i] - yv[i]));
    }
    report(e <= 1e-15, "gelu_erf f64 on [-38, 38] vs 0.5 x (1 + erf(x/sqrt 2)) in double: max |diff|/(1 + |y|) %.2e "
           "(tol 1e-15)", e);
    report(e32 <= 1e-6, "gelu_erf f32 vs the same in double: max |diff|/(1 + |y|) %.2e (tol 1e-6)", e32);
    report(dt > 1e-4 && dt < 1e-2, "gelu (tanh) and gelu_erf differ by max %.2e on [-10, 10] (vision.md §6: ~1e-3)", dt);
    free(yv); free(y32v); free(ytv); free(x32v); free(v);
    tide_tensor_release(x); tide_tensor_release(x32); tide_tensor_release(y); tide_tensor_release(y32); tide_tensor_release(yt);

    tide_tensor *g = randn_tensor(TIDE_F64, 2, (int64_t[]){6, 7});
    double w = gradcheck(f_gelu_erf, NULL, g);
    report(w <= 1e-6, "gelu_erf gradient check [6,7]: max |num - ana|/(1 + |ana|) = %.2e (tol 1e-6)", w);
    tide_tensor_release(g);
}

int main(void)
{
    tide_manual_seed(7);
    test_rope2d();
    test_pos_interp();
    test_gelu_erf();
    if (tide_graph_live_nodes() != 0) report(0, "%lld graph nodes leaked", (long long)tide_graph_live_nodes());
    if (tide_live_tensors() != 0) report(0, "%lld tensors leaked", (long long)tide_live_tensors());
    printf("\n%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

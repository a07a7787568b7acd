/*
 * test_kernels_nn.c — the CPU neural-network kernels (norm.c, softmax.c, loss.c, rope.c, attention.c)
 * against slow references written here with naive loops, and every backward against central finite
 * differences in f64.
 *
 * Tolerances: kernel vs reference max |got − ref| / max(1, |ref|) ≤ 1e-12 in f64 and 1e-5 in f32 (the
 * f32 reference runs in double on the same f32-rounded inputs); finite differences (step 1e-5, f64)
 * max |fd − analytic| ≤ 1e-6 · max |analytic|. Every kernel output buffer carries guard elements
 * after its end that must survive the call. Sizes straddle the 16384-element OpenMP threshold.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cpu/cpu.h"

static int n_pass, n_fail;

static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char *fmt, ...)
{
    if (ok) { n_pass++; return; }
    n_fail++;
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

/* ---- data ------------------------------------------------------------------------------------------ */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double urand(void)   /* xorshift64*, uniform in [-1, 1) */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    uint64_t r = rng_state * 0x2545F4914F6CDD1Dull;
    return (double)(r >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static double *vec(int64_t n, double scale)
{
    double *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++) x[i] = scale * urand();
    return x;
}

static double *vec_fill(int64_t n, double v)
{
    double *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++) x[i] = v;
    return x;
}

/* inputs of an f32 run are rounded to f32 first so the reference sees the same values */
static void round_to(int dt, double *x, int64_t n)
{
    if (x && dt == TIDE_F32)
        for (int64_t i = 0; i < n; i++) x[i] = (double)(float)x[i];
}

static double tol_of(int dt) { return dt == TIDE_F32 ? 1e-5 : 1e-12; }
static const char *dt_name(int dt) { return dt == TIDE_F32 ? "f32" : "f64"; }

/* ---- kernel buffers with guard elements -------------------------------------------------------------- */

#define GUARD 8
#define GUARD_VAL 12345.0

static void *dev(int dt, const double *x, int64_t n)
{
    size_t es = dt == TIDE_F32 ? sizeof(float) : sizeof(double);
    void *p = calloc((size_t)(n + GUARD), es);
    for (int64_t i = 0; i < n + GUARD; i++) {
        double v = i < n ? (x ? x[i] : 0.0) : GUARD_VAL;
        if (dt == TIDE_F32) ((float *)p)[i] = (float)v;
        else ((double *)p)[i] = v;
    }
    return p;
}

/* device buffer of an optional input (NULL stays NULL) */
static void *dev_opt(int dt, const double *x, int64_t n) { return x ? dev(dt, x, n) : NULL; }

static void back(double *out, int dt, void *p, int64_t n, const char *what)
{
    int guard_ok = 1;
    for (int64_t i = 0; i < n + GUARD; i++) {
        double v = dt == TIDE_F32 ? (double)((float *)p)[i] : ((double *)p)[i];
        if (i < n) out[i] = v;
        else if (v != GUARD_VAL) guard_ok = 0;
    }
    if (!guard_ok) check(0, "%s: write past the end of the output", what);
    free(p);
}

/* ---- comparisons --------------------------------------------------------------------------------- */

static void expect_close(const char *what, const double *got, const double *ref, int64_t n, double tol)
{
    double worst = 0.0;
    int64_t at = -1;
    for (int64_t i = 0; i < n; i++) {
        double e;
        if (isinf(ref[i]) || isinf(got[i])) e = got[i] == ref[i] ? 0.0 : INFINITY;
        else e = fabs(got[i] - ref[i]) / fmax(1.0, fabs(ref[i]));
        if (!(e <= worst)) { worst = e; at = i; }
    }
    check(worst <= tol, "%s: max error %.3g at %lld (got %.17g, ref %.17g), tolerance %.1g", what, worst,
          (long long)at, at >= 0 ? got[at] : 0.0, at >= 0 ? ref[at] : 0.0, tol);
}

/* central differences of the scalar f over the n entries of p (f reads p) */
static void fd_grad(double (*f)(void *), void *ctx, double *p, int64_t n, double *g)
{
    const double h = 1e-5;
    for (int64_t i = 0; i < n; i++) {
        double keep = p[i];
        p[i] = keep + h;
        double fp = f(ctx);
        p[i] = keep - h;
        double fm = f(ctx);
        p[i] = keep;
        g[i] = (fp - fm) / (2 * h);
    }
}

static void expect_grad(const char *what, const double *an, const double *fd, int64_t n)
{
    double scale = 0.0, worst = 0.0;
    int64_t at = -1;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fmax(fabs(an[i]), fabs(fd[i])));
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(an[i] - fd[i]);
        if (!(e <= worst)) { worst = e; at = i; }
    }
    double rel = scale > 0 ? worst / scale : worst;
    check(rel <= 1e-6 && scale > 0, "%s: finite differences differ by %.3g (relative to max %.3g) at %lld "
          "(analytic %.12g, fd %.12g)", what, rel, scale, (long long)at, at >= 0 ? an[at] : 0.0,
          at >= 0 ? fd[at] : 0.0);
}

static double dot(const double *a, const double *b, int64_t n)
{
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ==== RMSNorm ========================================================================================== */

static int run_rmsnorm(int dt, double *out, double *rstd, const double *x, const double *w, int64_t N, int64_t C,
                       double eps)
{
    void *o = dev(dt, NULL, N * C), *r = dev(dt, NULL, N), *xd = dev(dt, x, N * C), *wd = dev(dt, w, C);
    int rc = tide_cpu_rmsnorm(dt, o, r, xd, wd, N, C, eps);
    back(out, dt, o, N * C, "rmsnorm out");
    back(rstd, dt, r, N, "rmsnorm rstd");
    free(xd); free(wd);
    return rc;
}

/* dw is read (initial value) and written (accumulated) */
static int run_rmsnorm_backward(int dt, double *dx, double *dw, const double *dout, const double *x,
                                const double *w, const double *rstd, int64_t N, int64_t C)
{
    void *dxd = dev(dt, NULL, N * C), *dwd = dev(dt, dw, C), *g = dev(dt, dout, N * C), *xd = dev(dt, x, N * C);
    void *wd = dev(dt, w, C), *rd = dev(dt, rstd, N);
    int rc = tide_cpu_rmsnorm_backward(dt, dxd, dwd, g, xd, wd, rd, N, C);
    back(dx, dt, dxd, N * C, "rmsnorm dx");
    back(dw, dt, dwd, C, "rmsnorm dw");
    free(g); free(xd); free(wd); free(rd);
    return rc;
}

static void ref_rmsnorm(double *out, double *rstd, const double *x, const double *w, int64_t N, int64_t C,
                        double eps)
{
    for (int64_t n = 0; n < N; n++) {
        double ms = 0.0;
        for (int64_t c = 0; c < C; c++) ms += x[n * C + c] * x[n * C + c] / C;
        rstd[n] = 1.0 / sqrt(ms + eps);
        for (int64_t c = 0; c < C; c++) out[n * C + c] = x[n * C + c] * rstd[n] * w[c];
    }
}

/* through the full Jacobian: d out_c / d x_j = w_c (r δ_cj − r³ x_c x_j / C) */
static void ref_rmsnorm_backward(double *dx, double *dw, const double *dout, const double *x, const double *w,
                                 int64_t N, int64_t C, double eps)
{
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x + n * C, *g = dout + n * C;
        double ms = 0.0;
        for (int64_t c = 0; c < C; c++) ms += xr[c] * xr[c] / C;
        double r = 1.0 / sqrt(ms + eps);
        for (int64_t j = 0; j < C; j++) {
            double s = 0.0;
            for (int64_t c = 0; c < C; c++) s += g[c] * w[c] * (r * (c == j) - r * r * r * xr[c] * xr[j] / C);
            dx[n * C + j] = s;
        }
        for (int64_t c = 0; c < C; c++) dw[c] += g[c] * xr[c] * r;
    }
}

static void test_rmsnorm_ref(int dt, int64_t N, int64_t C)
{
    double eps = 1e-5;
    double *x = vec(N * C, 1.5), *w = vec(C, 1.0), *g = vec(N * C, 1.0);
    round_to(dt, x, N * C); round_to(dt, w, C); round_to(dt, g, N * C);
    double *out = vec(N * C, 0), *rstd = vec(N, 0), *rout = vec(N * C, 0), *rrstd = vec(N, 0);
    char what[128];
    int rc = run_rmsnorm(dt, out, rstd, x, w, N, C, eps);
    check(rc == 0, "rmsnorm %s returned %d: %s", dt_name(dt), rc, tide_last_error());
    ref_rmsnorm(rout, rrstd, x, w, N, C, eps);
    snprintf(what, sizeof what, "rmsnorm %s N=%lld C=%lld out", dt_name(dt), (long long)N, (long long)C);
    expect_close(what, out, rout, N * C, tol_of(dt));
    snprintf(what, sizeof what, "rmsnorm %s N=%lld C=%lld rstd", dt_name(dt), (long long)N, (long long)C);
    expect_close(what, rstd, rrstd, N, tol_of(dt));

    double *dx = vec(N * C, 0), *dw = vec_fill(C, 0.5), *rdx = vec(N * C, 0), *rdw = vec_fill(C, 0.5);
    round_to(dt, rstd, N);
    rc = run_rmsnorm_backward(dt, dx, dw, g, x, w, rstd, N, C);
    check(rc == 0, "rmsnorm_backward %s returned %d: %s", dt_name(dt), rc, tide_last_error());
    ref_rmsnorm_backward(rdx, rdw, g, x, w, N, C, eps);
    snprintf(what, sizeof what, "rmsnorm_backward %s N=%lld C=%lld dx", dt_name(dt), (long long)N, (long long)C);
    expect_close(what, dx, rdx, N * C, tol_of(dt));
    snprintf(what, sizeof what, "rmsnorm_backward %s N=%lld C=%lld dw (accumulated onto 0.5)", dt_name(dt),
             (long long)N, (long long)C);
    expect_close(what, dw, rdw, C, tol_of(dt) * (dt == TIDE_F32 ? 10 : 1) /* sums of N terms */);
    free(x); free(w); free(g); free(out); free(rstd); free(rout); free(rrstd);
    free(dx); free(dw); free(rdx); free(rdw);
}

struct norm_ctx { double *x, *w, *b, *G; int64_t N, C; double eps; int layer; };

static double norm_loss(void *p)
{
    struct norm_ctx *c = p;
    int64_t N = c->N, C = c->C;
    double *out = vec(N * C, 0), *s1 = vec(N, 0), *s2 = vec(N, 0);
    if (c->layer) {
        void *o = dev(TIDE_F64, NULL, N * C), *m = dev(TIDE_F64, NULL, N), *r = dev(TIDE_F64, NULL, N);
        tide_cpu_layernorm(TIDE_F64, o, m, r, c->x, c->w, c->b, N, C, c->eps);
        back(out, TIDE_F64, o, N * C, "layernorm out");
        back(s1, TIDE_F64, m, N, "layernorm mean");
        back(s2, TIDE_F64, r, N, "layernorm rstd");
    } else {
        run_rmsnorm(TIDE_F64, out, s1, c->x, c->w, N, C, c->eps);
    }
    double L = dot(out, c->G, N * C);
    free(out); free(s1); free(s2);
    return L;
}

static void test_rmsnorm_fd(void)
{
    int64_t N = 3, C = 6;
    struct norm_ctx c = { vec(N * C, 1.0), vec(C, 1.0), NULL, vec(N * C, 1.0), N, C, 1e-5, 0 };
    double *out = vec(N * C, 0), *rstd = vec(N, 0), *dx = vec(N * C, 0), *dw = vec_fill(C, 0.25);
    double *fdx = vec(N * C, 0), *fdw = vec(C, 0);
    run_rmsnorm(TIDE_F64, out, rstd, c.x, c.w, N, C, c.eps);
    run_rmsnorm_backward(TIDE_F64, dx, dw, c.G, c.x, c.w, rstd, N, C);
    for (int64_t i = 0; i < C; i++) dw[i] -= 0.25;
    fd_grad(norm_loss, &c, c.x, N * C, fdx);
    fd_grad(norm_loss, &c, c.w, C, fdw);
    expect_grad("rmsnorm dx", dx, fdx, N * C);
    expect_grad("rmsnorm dw", dw, fdw, C);
    free(c.x); free(c.w); free(c.G); free(out); free(rstd); free(dx); free(dw); free(fdx); free(fdw);
}

/* ==== LayerNorm ======================================================================================== */

static int run_layernorm(int dt, double *out, double *mean, double *rstd, const double *x, const double *w,
                         const double *b, int64_t N, int64_t C, double eps)
{
    void *o = dev(dt, NULL, N * C), *m = dev(dt, NULL, N), *r = dev(dt, NULL, N), *xd = dev(dt, x, N * C);
    void *wd = dev(dt, w, C), *bd = dev_opt(dt, b, C);
    int rc = tide_cpu_layernorm(dt, o, m, r, xd, wd, bd, N, C, eps);
    back(out, dt, o, N * C, "layernorm out");
    back(mean, dt, m, N, "layernorm mean");
    back(rstd, dt, r, N, "layernorm rstd");
    free(xd); free(wd); free(bd);
    return rc;
}

/* dw, db (db may be NULL) are read and accumulated */
static int run_layernorm_backward(int dt, double *dx, double *dw, double *db, const double *dout, const double *x,
                                  const double *w, const double *mean, const double *rstd, int64_t N, int64_t C)
{
    void *dxd = dev(dt, NULL, N * C), *dwd = dev(dt, dw, C), *dbd = dev_opt(dt, db, C);
    void *g = dev(dt, dout, N * C), *xd = dev(dt, x, N * C), *wd = dev(dt, w, C);
    void *md = dev(dt, mean, N), *rd = dev(dt, rstd, N);
    int rc = tide_cpu_layernorm_backward(dt, dxd, dwd, dbd, g, xd, wd, md, rd, N, C);
    back(dx, dt, dxd, N * C, "layernorm dx");
    back(dw, dt, dwd, C, "layernorm dw");
    if (db) back(db, dt, dbd, C, "layernorm db");
    free(g); free(xd); free(wd); free(md); free(rd);
    return rc;
}

static void ref_layernorm(double *out, double *mean, double *rstd, const double *x, const double *w,
                          const double *b, int64_t N, int64_t C, double eps)
{
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x + n * C;
        double mu = 0.0, var = 0.0;
        for (int64_t c = 0; c < C; c++) mu += xr[c] / C;
        for (int64_t c = 0; c < C; c++) var += (xr[c] - mu) * (xr[c] - mu) / C;
        mean[n] = mu;
        rstd[n] = 1.0 / sqrt(var + eps);
        for (int64_t c = 0; c < C; c++) out[n * C + c] = (xr[c] - mu) * rstd[n] * w[c] + (b ? b[c] : 0.0);
    }
}

/* Jacobian: d out_c / d x_j = w_c r (δ_cj − 1/C − x̂_c x̂_j / C) */
static void ref_layernorm_backward(double *dx, double *dw, double *db, const double *dout, const double *x,
                                   const double *w, int64_t N, int64_t C, double eps)
{
    double *xh = vec(C, 0);
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x + n * C, *g = dout + n * C;
        double mu = 0.0, var = 0.0;
        for (int64_t c = 0; c < C; c++) mu += xr[c] / C;
        for (int64_t c = 0; c < C; c++) var += (xr[c] - mu) * (xr[c] - mu) / C;
        double r = 1.0 / sqrt(var + eps);
        for (int64_t c = 0; c < C; c++) xh[c] = (xr[c] - mu) * r;
        for (int64_t j = 0; j < C; j++) {
            double s = 0.0;
            for (int64_t c = 0; c < C; c++) s += g[c] * w[c] * r * ((c == j) - 1.0 / C - xh[c] * xh[j] / C);
            dx[n * C + j] = s;
        }
        for (int64_t c = 0; c < C; c++) {
            dw[c] += g[c] * xh[c];
            if (db) db[c] += g[c];
        }
    }
    free(xh);
}

static void test_layernorm_ref(int dt, int64_t N, int64_t C, int with_bias)
{
    double eps = 1e-5;
    double *x = vec(N * C, 2.0), *w = vec(C, 1.0), *b = with_bias ? vec(C, 1.0) : NULL, *g = vec(N * C, 1.0);
    for (int64_t i = 0; i < N * C; i++) x[i] += 0.75;   /* a non-zero row mean */
    round_to(dt, x, N * C); round_to(dt, w, C); round_to(dt, b, C); round_to(dt, g, N * C);
    double *out = vec(N * C, 0), *mean = vec(N, 0), *rstd = vec(N, 0);
    double *rout = vec(N * C, 0), *rmean = vec(N, 0), *rrstd = vec(N, 0);
    char what[160], tag[80];
    snprintf(tag, sizeof tag, "layernorm %s N=%lld C=%lld %s", dt_name(dt), (long long)N, (long long)C,
             with_bias ? "bias" : "no bias");
    int rc = run_layernorm(dt, out, mean, rstd, x, w, b, N, C, eps);
    check(rc == 0, "%s returned %d: %s", tag, rc, tide_last_error());
    ref_layernorm(rout, rmean, rrstd, x, w, b, N, C, eps);
    snprintf(what, sizeof what, "%s out", tag);
    expect_close(what, out, rout, N * C, tol_of(dt));
    snprintf(what, sizeof what, "%s mean", tag);
    expect_close(what, mean, rmean, N, tol_of(dt));
    snprintf(what, sizeof what, "%s rstd", tag);
    expect_close(what, rstd, rrstd, N, tol_of(dt));

    double *dx = vec(N * C, 0), *dw = vec_fill(C, -0.5), *db = with_bias ? vec_fill(C, 0.125) : NULL;
    double *rdx = vec(N * C, 0), *rdw = vec_fill(C, -0.5), *rdb = with_bias ? vec_fill(C, 0.125) : NULL;
    round_to(dt, mean, N); round_to(dt, rstd, N);
    rc = run_layernorm_backward(dt, dx, dw, db, g, x, w, mean, rstd, N, C);
    check(rc == 0, "%s backward returned %d: %s", tag, rc, tide_last_error());
    ref_layernorm_backward(rdx, rdw, rdb, g, x, w, N, C, eps);
    snprintf(what, sizeof what, "%s dx", tag);
    expect_close(what, dx, rdx, N * C, tol_of(dt));
    snprintf(what, sizeof what, "%s dw (accumulated)", tag);
    expect_close(what, dw, rdw, C, tol_of(dt) * (dt == TIDE_F32 ? 10 : 1));
    if (with_bias) {
        snprintf(what, sizeof what, "%s db (accumulated)", tag);
        expect_close(what, db, rdb, C, tol_of(dt) * (dt == TIDE_F32 ? 10 : 1));
    }
    free(x); free(w); free(b); free(g); free(out); free(mean); free(rstd); free(rout); free(rmean); free(rrstd);
    free(dx); free(dw); free(db); free(rdx); free(rdw); free(rdb);
}

static void test_layernorm_fd(int with_bias)
{
    int64_t N = 3, C = 7;
    struct norm_ctx c = { vec(N * C, 1.0), vec(C, 1.0), with_bias ? vec(C, 1.0) : NULL, vec(N * C, 1.0), N, C,
                          1e-5, 1 };
    double *out = vec(N * C, 0), *mean = vec(N, 0), *rstd = vec(N, 0), *dx = vec(N * C, 0);
    double *dw = vec_fill(C, 1.0), *db = with_bias ? vec_fill(C, -1.0) : NULL;
    double *fdx = vec(N * C, 0), *fdw = vec(C, 0), *fdb = vec(C, 0);
    run_layernorm(TIDE_F64, out, mean, rstd, c.x, c.w, c.b, N, C, c.eps);
    run_layernorm_backward(TIDE_F64, dx, dw, db, c.G, c.x, c.w, mean, rstd, N, C);
    for (int64_t i = 0; i < C; i++) {
        dw[i] -= 1.0;
        if (db) db[i] += 1.0;
    }
    fd_grad(norm_loss, &c, c.x, N * C, fdx);
    fd_grad(norm_loss, &c, c.w, C, fdw);
    expect_grad(with_bias ? "layernorm (bias) dx" : "layernorm (no bias) dx", dx, fdx, N * C);
    expect_grad(with_bias ? "layernorm (bias) dw" : "layernorm (no bias) dw", dw, fdw, C);
    if (with_bias) {
        fd_grad(norm_loss, &c, c.b, C, fdb);
        expect_grad("layernorm (bias) db", db, fdb, C);
    }
    free(c.x); free(c.w); free(c.b); free(c.G); free(out); free(mean); free(rstd); free(dx); free(dw); free(db);
    free(fdx); free(fdw); free(fdb);
}

/* ==== softmax / log_softmax ============================================================================ */

static int run_softmax(int dt, double *y, const double *x, int64_t N, int64_t C, int log_out)
{
    void *yd = dev(dt, NULL, N * C), *xd = dev(dt, x, N * C);
    int rc = tide_cpu_softmax(dt, yd, xd, N, C, log_out);
    back(y, dt, yd, N * C, "softmax y");
    free(xd);
    return rc;
}

static int run_softmax_backward(int dt, double *dx, const double *dy, const double *y, int64_t N, int64_t C,
                                int log_out)
{
    void *dxd = dev(dt, NULL, N * C), *g = dev(dt, dy, N * C), *yd = dev(dt, y, N * C);
    int rc = tide_cpu_softmax_backward(dt, dxd, g, yd, N, C, log_out);
    back(dx, dt, dxd, N * C, "softmax dx");
    free(g); free(yd);
    return rc;
}

/* inputs are moderate, so the plain exp(x) / Σ exp(x) is exact enough */
static void ref_softmax(double *y, const double *x, int64_t N, int64_t C, int log_out)
{
    for (int64_t n = 0; n < N; n++) {
        double s = 0.0;
        for (int64_t c = 0; c < C; c++) s += exp(x[n * C + c]);
        for (int64_t c = 0; c < C; c++)
            y[n * C + c] = log_out ? x[n * C + c] - log(s) : exp(x[n * C + c]) / s;
    }
}

/* Jacobian with p = softmax(x): softmax ∂y_c/∂x_j = p_c (δ_cj − p_j); log_softmax δ_cj − p_j */
static void ref_softmax_backward(double *dx, const double *dy, const double *x, int64_t N, int64_t C, int log_out)
{
    double *p = vec(N * C, 0);
    ref_softmax(p, x, N, C, 0);
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < C; j++) {
            double s = 0.0;
            for (int64_t c = 0; c < C; c++) {
                double jac = log_out ? (c == j) - p[n * C + j] : p[n * C + c] * ((c == j) - p[n * C + j]);
                s += dy[n * C + c] * jac;
            }
            dx[n * C + j] = s;
        }
    free(p);
}

static void test_softmax_ref(int dt, int64_t N, int64_t C, int log_out)
{
    double *x = vec(N * C, 3.0), *g = vec(N * C, 1.0), *y = vec(N * C, 0), *ry = vec(N * C, 0);
    double *dx = vec(N * C, 0), *rdx = vec(N * C, 0);
    round_to(dt, x, N * C); round_to(dt, g, N * C);
    char tag[96], what[128];
    snprintf(tag, sizeof tag, "%s %s N=%lld C=%lld", log_out ? "log_softmax" : "softmax", dt_name(dt),
             (long long)N, (long long)C);
    int rc = run_softmax(dt, y, x, N, C, log_out);
    check(rc == 0, "%s returned %d: %s", tag, rc, tide_last_error());
    ref_softmax(ry, x, N, C, log_out);
    snprintf(what, sizeof what, "%s y", tag);
    expect_close(what, y, ry, N * C, tol_of(dt));
    round_to(dt, y, N * C);
    rc = run_softmax_backward(dt, dx, g, y, N, C, log_out);
    check(rc == 0, "%s backward returned %d: %s", tag, rc, tide_last_error());
    ref_softmax_backward(rdx, g, x, N, C, log_out);
    snprintf(what, sizeof what, "%s dx", tag);
    expect_close(what, dx, rdx, N * C, tol_of(dt));
    free(x); free(g); free(y); free(ry); free(dx); free(rdx);
}

struct softmax_ctx { double *x, *G; int64_t N, C; int log_out; };

static double softmax_loss(void *p)
{
    struct softmax_ctx *c = p;
    double *y = vec(c->N * c->C, 0);
    run_softmax(TIDE_F64, y, c->x, c->N, c->C, c->log_out);
    double L = dot(y, c->G, c->N * c->C);
    free(y);
    return L;
}

static void test_softmax_fd(int log_out)
{
    int64_t N = 3, C = 5;
    struct softmax_ctx c = { vec(N * C, 2.0), vec(N * C, 1.0), N, C, log_out };
    double *y = vec(N * C, 0), *dx = vec(N * C, 0), *fdx = vec(N * C, 0);
    run_softmax(TIDE_F64, y, c.x, N, C, log_out);
    run_softmax_backward(TIDE_F64, dx, c.G, y, N, C, log_out);
    fd_grad(softmax_loss, &c, c.x, N * C, fdx);
    expect_grad(log_out ? "log_softmax dx" : "softmax dx", dx, fdx, N * C);
    free(c.x); free(c.G); free(y); free(dx); free(fdx);
}

/* large logits must not overflow: softmax(1000, 1001, 1002) = softmax(0, 1, 2) */
static void test_softmax_stable(int dt)
{
    double x[3] = { 1000, 1001, 1002 }, y[3], ly[3], want[3], lwant[3];
    double s = 1 + exp(1) + exp(2);
    for (int i = 0; i < 3; i++) { want[i] = exp(i) / s; lwant[i] = i - log(s); }
    run_softmax(dt, y, x, 1, 3, 0);
    run_softmax(dt, ly, x, 1, 3, 1);
    expect_close(dt == TIDE_F32 ? "softmax f32 of large logits" : "softmax f64 of large logits", y, want, 3,
                 tol_of(dt));
    expect_close(dt == TIDE_F32 ? "log_softmax f32 of large logits" : "log_softmax f64 of large logits", ly,
                 lwant, 3, dt == TIDE_F32 ? 1e-5 : 1e-12);
}

/* ==== cross-entropy ===================================================================================== */

/* targets are given as int64 and handed to the kernel as tdtype */
static void *targets_dev(const int64_t *t, int tdtype, int64_t N)
{
    void *p = calloc((size_t)(N > 0 ? N : 1), 8);
    for (int64_t n = 0; n < N; n++) {
        if (tdtype == TIDE_I32) ((int32_t *)p)[n] = (int32_t)t[n];
        else ((int64_t *)p)[n] = t[n];
    }
    return p;
}

static int run_ce(int dt, double *loss, double *valid, double *lse, const double *logits, const int64_t *t,
                  int tdtype, const double *weights, int64_t N, int64_t V, int64_t ignore)
{
    void *ld = dev(dt, loss, N), *vd = dev(dt, valid, N), *sd = dev(dt, lse, N), *xd = dev(dt, logits, N * V);
    void *td = targets_dev(t, tdtype, N), *wd = dev_opt(dt, weights, N);
    int rc = tide_cpu_cross_entropy(dt, ld, vd, sd, xd, td, tdtype, wd, N, V, ignore);
    back(loss, dt, ld, N, "cross_entropy loss");
    back(valid, dt, vd, N, "cross_entropy valid");
    back(lse, dt, sd, N, "cross_entropy lse");
    free(xd); free(td); free(wd);
    return rc;
}

static int run_ce_backward(int dt, double *dlogits, const double *dloss, const double *logits, const double *lse,
                           const int64_t *t, int tdtype, const double *weights, int64_t N, int64_t V,
                           int64_t ignore)
{
    void *dd = dev(dt, dlogits, N * V), *gd = dev(dt, dloss, N), *xd = dev(dt, logits, N * V);
    void *sd = dev(dt, lse, N), *td = targets_dev(t, tdtype, N), *wd = dev_opt(dt, weights, N);
    int rc = tide_cpu_cross_entropy_backward(dt, dd, gd, xd, sd, td, tdtype, wd, N, V, ignore);
    back(dlogits, dt, dd, N * V, "cross_entropy dlogits");
    free(gd); free(xd); free(sd); free(td); free(wd);
    return rc;
}

static void ref_ce(double *loss, double *valid, double *lse, const double *x, const int64_t *t,
                   const double *weights, int64_t N, int64_t V, int64_t ignore)
{
    for (int64_t n = 0; n < N; n++) {
        double s = 0.0;
        for (int64_t v = 0; v < V; v++) s += exp(x[n * V + v]);
        lse[n] = log(s);
        double w = weights ? weights[n] : 1.0;
        loss[n] = t[n] == ignore ? 0.0 : -w * log(exp(x[n * V + t[n]]) / s);
        valid[n] = t[n] == ignore ? 0.0 : w;
    }
}

static void ref_ce_backward(double *dx, const double *dloss, const double *x, const int64_t *t,
                            const double *weights, int64_t N, int64_t V, int64_t ignore)
{
    for (int64_t n = 0; n < N; n++) {
        double s = 0.0;
        for (int64_t v = 0; v < V; v++) s += exp(x[n * V + v]);
        double w = weights ? weights[n] : 1.0;
        for (int64_t v = 0; v < V; v++)
            dx[n * V + v] = t[n] == ignore ? 0.0 : dloss[n] * w * (exp(x[n * V + v]) / s - (v == t[n]));
    }
}

static void make_targets(int64_t *t, int64_t N, int64_t V, int64_t ignore)
{
    for (int64_t n = 0; n < N; n++) {
        t[n] = (int64_t)((urand() + 1.0) * 0.5 * V);
        if (t[n] >= V) t[n] = V - 1;
        if (n % 4 == 1) t[n] = ignore;
    }
}

static void test_ce_ref(int dt, int tdtype, int64_t N, int64_t V, int weighted)
{
    const int64_t ignore = -100;
    int64_t *t = malloc((size_t)N * sizeof(int64_t));
    make_targets(t, N, V, ignore);
    double *x = vec(N * V, 3.0), *w = NULL, *dloss = vec(N, 1.0);
    if (weighted) { w = vec(N, 1.0); for (int64_t n = 0; n < N; n++) w[n] += 1.5; }
    round_to(dt, x, N * V); round_to(dt, w, N); round_to(dt, dloss, N);
    double *loss = vec(N, 0), *valid = vec(N, 0), *lse = vec(N, 0), *rl = vec(N, 0), *rv = vec(N, 0);
    double *rs = vec(N, 0), *dx = vec(N * V, 0), *rdx = vec(N * V, 0);
    char tag[128], what[160];
    snprintf(tag, sizeof tag, "cross_entropy %s targets %s N=%lld V=%lld %s", dt_name(dt),
             tdtype == TIDE_I32 ? "i32" : "i64", (long long)N, (long long)V, weighted ? "weighted" : "unweighted");
    int rc = run_ce(dt, loss, valid, lse, x, t, tdtype, w, N, V, ignore);
    check(rc == 0, "%s returned %d: %s", tag, rc, tide_last_error());
    ref_ce(rl, rv, rs, x, t, w, N, V, ignore);
    snprintf(what, sizeof what, "%s loss", tag);
    expect_close(what, loss, rl, N, tol_of(dt));
    snprintf(what, sizeof what, "%s valid", tag);
    expect_close(what, valid, rv, N, tol_of(dt));
    snprintf(what, sizeof what, "%s lse", tag);
    expect_close(what, lse, rs, N, tol_of(dt));
    round_to(dt, lse, N);
    rc = run_ce_backward(dt, dx, dloss, x, lse, t, tdtype, w, N, V, ignore);
    check(rc == 0, "%s backward returned %d: %s", tag, rc, tide_last_error());
    ref_ce_backward(rdx, dloss, x, t, w, N, V, ignore);
    snprintf(what, sizeof what, "%s dlogits", tag);
    expect_close(what, dx, rdx, N * V, tol_of(dt));
    free(t); free(x); free(w); free(dloss); free(loss); free(valid); free(lse); free(rl); free(rv); free(rs);
    free(dx); free(rdx);
}

struct ce_ctx { double *x, *w, *dloss; int64_t *t; int64_t N, V, ignore; };

static double ce_loss(void *p)
{
    struct ce_ctx *c = p;
    double *loss = vec(c->N, 0), *valid = vec(c->N, 0), *lse = vec(c->N, 0);
    run_ce(TIDE_F64, loss, valid, lse, c->x, c->t, TIDE_I64, c->w, c->N, c->V, c->ignore);
    double L = dot(loss, c->dloss, c->N);
    free(loss); free(valid); free(lse);
    return L;
}

static void test_ce_fd(int weighted)
{
    int64_t N = 5, V = 7;
    struct ce_ctx c = { vec(N * V, 2.0), weighted ? vec(N, 1.0) : NULL, vec(N, 1.0), malloc(N * sizeof(int64_t)),
                        N, V, 3 /* an ignore index inside [0, V): rows with target 3 are skipped */ };
    make_targets(c.t, N, V, c.ignore);
    double *loss = vec(N, 0), *valid = vec(N, 0), *lse = vec(N, 0), *dx = vec(N * V, 0), *fdx = vec(N * V, 0);
    run_ce(TIDE_F64, loss, valid, lse, c.x, c.t, TIDE_I64, c.w, N, V, c.ignore);
    run_ce_backward(TIDE_F64, dx, c.dloss, c.x, lse, c.t, TIDE_I64, c.w, N, V, c.ignore);
    fd_grad(ce_loss, &c, c.x, N * V, fdx);
    expect_grad(weighted ? "cross_entropy (weighted, ignore) dlogits" : "cross_entropy (ignore) dlogits", dx, fdx,
                N * V);
    int zero = 1;
    for (int64_t n = 0; n < N; n++)
        for (int64_t v = 0; v < V; v++)
            if (c.t[n] == c.ignore && dx[n * V + v] != 0.0) zero = 0;
    check(zero, "cross_entropy_backward: ignored rows must get exactly zero gradient");
    free(c.x); free(c.w); free(c.dloss); free(c.t); free(loss); free(valid); free(lse); free(dx); free(fdx);
}

/* non-finite logits: a row holding a NaN, a row of −inf and a row with a +inf give a NaN lse and loss in both
   dtypes (the step's non-finite check sees them); the finite row beside them is unaffected (f32 rows take the
   lane path: V = 37 is two full lane blocks and a tail) */
static void test_ce_nonfinite(int dt)
{
    const int64_t N = 4, V = 37;
    double *x = vec(N * V, 2.0);
    int64_t t[4] = {1, 2, 3, 4};
    x[0 * V + 20] = NAN;
    for (int64_t v = 0; v < V; v++) x[1 * V + v] = -INFINITY;
    x[2 * V + 36] = INFINITY;
    round_to(dt, x, N * V);
    double loss[4], valid[4], lse[4], rl[4], rv[4], rs[4];
    int rc = run_ce(dt, loss, valid, lse, x, t, TIDE_I64, NULL, N, V, -100);
    check(rc == 0, "cross_entropy %s non-finite rows returned %d: %s", dt_name(dt), rc, tide_last_error());
    for (int n = 0; n < 3; n++)
        check(isnan(lse[n]) && isnan(loss[n]), "cross_entropy %s: row %d (non-finite logits) must give NaN lse and "
              "loss, got %g / %g", dt_name(dt), n, lse[n], loss[n]);
    ref_ce(rl, rv, rs, x + 3 * V, t + 3, NULL, 1, V, -100);
    check(fabs(loss[3] - rl[0]) <= tol_of(dt) * fabs(rl[0]), "cross_entropy %s: the finite row's loss %.9g, "
          "expected %.9g", dt_name(dt), loss[3], rl[0]);
    free(x);
}

static void test_ce_errors(void)
{
    int64_t N = 4, V = 5;
    double *x = vec(N * V, 1.0), *loss = vec_fill(N, 7.0), *valid = vec_fill(N, 7.0), *lse = vec_fill(N, 7.0);
    int64_t t[4] = { 0, 4, 5, -100 };        /* row 2 holds V: out of range */
    int rc = run_ce(TIDE_F64, loss, valid, lse, x, t, TIDE_I32, NULL, N, V, -100);
    const char *e = tide_last_error();
    check(rc != 0, "cross_entropy with target 5 >= V=5 must fail");
    check(strstr(e, "cross_entropy") && strstr(e, "row 2") && strstr(e, "5"),
          "cross_entropy error should name the op, row 2 and value 5, got \"%s\"", e);
    int untouched = 1;
    for (int64_t n = 0; n < N; n++) untouched &= loss[n] == 7.0 && valid[n] == 7.0 && lse[n] == 7.0;
    check(untouched, "cross_entropy must not write outputs when a target is bad");

    int64_t t2[4] = { 0, -1, 1, 2 };         /* negative and not the ignore index */
    rc = run_ce(TIDE_F32, loss, valid, lse, x, t2, TIDE_I64, NULL, N, V, -100);
    e = tide_last_error();
    check(rc != 0 && strstr(e, "cross_entropy") && strstr(e, "row 1") && strstr(e, "-1"),
          "cross_entropy with target -1 must fail naming row 1, got rc %d \"%s\"", rc, e);

    double *dx = vec(N * V, 0), *dl = vec(N, 1.0);
    rc = run_ce_backward(TIDE_F64, dx, dl, x, lse, t, TIDE_I64, NULL, N, V, -100);
    e = tide_last_error();
    check(rc != 0 && strstr(e, "cross_entropy"), "cross_entropy_backward with a bad target must fail, got \"%s\"",
          e);
    rc = run_ce(TIDE_F64, loss, valid, lse, x, t2, TIDE_F32, NULL, N, V, -100);
    e = tide_last_error();
    check(rc != 0 && strstr(e, "targets"), "cross_entropy with float targets must fail, got \"%s\"", e);
    free(x); free(loss); free(valid); free(lse); free(dx); free(dl);
}

/* ==== RoPE ================================================================================================ */

static int run_rope(int dt, double *out, const double *x, int64_t B, int64_t T, int64_t H, int64_t D, double theta,
                    int64_t pos0, int inverse)
{
    int64_t n = B * T * H * D;
    void *o = dev(dt, NULL, n), *xd = dev(dt, x, n);
    int rc = tide_cpu_rope(dt, o, xd, B, T, H, D, theta, pos0, inverse);
    back(out, dt, o, n, "rope out");
    free(xd);
    return rc;
}

static void ref_rope(double *out, const double *x, int64_t B, int64_t T, int64_t H, int64_t D, double theta,
                     int64_t pos0, int inverse)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < D / 2; i++) {
                    double a = (inverse ? -1.0 : 1.0) * (double)(pos0 + t) / pow(theta, 2.0 * i / D);
                    int64_t base = ((b * T + t) * H + h) * D;
                    double x1 = x[base + i], x2 = x[base + i + D / 2];
                    out[base + i] = x1 * cos(a) - x2 * sin(a);
                    out[base + i + D / 2] = x1 * sin(a) + x2 * cos(a);
                }
}

static void test_rope_ref(int dt, int64_t B, int64_t T, int64_t H, int64_t D, int64_t pos0)
{
    int64_t n = B * T * H * D;
    double theta = 10000.0;
    double *x = vec(n, 1.0), *y = vec(n, 0), *ry = vec(n, 0), *back_x = vec(n, 0), *yi = vec(n, 0), *ryi = vec(n, 0);
    round_to(dt, x, n);
    char tag[96], what[128];
    snprintf(tag, sizeof tag, "rope %s B=%lld T=%lld H=%lld D=%lld pos0=%lld", dt_name(dt), (long long)B,
             (long long)T, (long long)H, (long long)D, (long long)pos0);
    int rc = run_rope(dt, y, x, B, T, H, D, theta, pos0, 0);
    check(rc == 0, "%s returned %d: %s", tag, rc, tide_last_error());
    ref_rope(ry, x, B, T, H, D, theta, pos0, 0);
    snprintf(what, sizeof what, "%s out", tag);
    expect_close(what, y, ry, n, tol_of(dt));
    run_rope(dt, yi, x, B, T, H, D, theta, pos0, 1);
    ref_rope(ryi, x, B, T, H, D, theta, pos0, 1);
    snprintf(what, sizeof what, "%s inverse out", tag);
    expect_close(what, yi, ryi, n, tol_of(dt));
    round_to(dt, y, n);
    run_rope(dt, back_x, y, B, T, H, D, theta, pos0, 1);
    snprintf(what, sizeof what, "%s inverse(rope(x)) == x", tag);
    expect_close(what, back_x, x, n, tol_of(dt));

    /* in place (out aliases x) gives the out-of-place result */
    void *xd = dev(dt, x, n);
    rc = tide_cpu_rope(dt, xd, xd, B, T, H, D, theta, pos0, 0);
    double *yin = vec(n, 0);
    back(yin, dt, xd, n, "rope in place");
    snprintf(what, sizeof what, "%s in place", tag);
    expect_close(what, yin, y, n, 0.0);
    free(x); free(y); free(ry); free(back_x); free(yi); free(ryi); free(yin);
}

struct rope_ctx { double *x, *G; int64_t B, T, H, D, pos0; double theta; };

static double rope_loss(void *p)
{
    struct rope_ctx *c = p;
    int64_t n = c->B * c->T * c->H * c->D;
    double *y = vec(n, 0);
    run_rope(TIDE_F64, y, c->x, c->B, c->T, c->H, c->D, c->theta, c->pos0, 0);
    double L = dot(y, c->G, n);
    free(y);
    return L;
}

static void test_rope_fd(void)
{
    struct rope_ctx c = { NULL, NULL, 2, 3, 2, 6, 5, 500.0 };
    int64_t n = c.B * c.T * c.H * c.D;
    c.x = vec(n, 1.0); c.G = vec(n, 1.0);
    double *dx = vec(n, 0), *fdx = vec(n, 0);
    run_rope(TIDE_F64, dx, c.G, c.B, c.T, c.H, c.D, c.theta, c.pos0, 1);   /* the backward is the inverse */
    fd_grad(rope_loss, &c, c.x, n, fdx);
    expect_grad("rope dx (inverse rotation)", dx, fdx, n);
    free(c.x); free(c.G); free(dx); free(fdx);
}

static void test_rope_errors(void)
{
    double x[6] = { 0 }, y[6];
    int rc = run_rope(TIDE_F64, y, x, 1, 1, 2, 3, 10000.0, 0, 0);
    const char *e = tide_last_error();
    check(rc != 0 && strstr(e, "rope") && strstr(e, "D=3"), "rope with odd D must fail naming D=3, got \"%s\"", e);
}

/* ==== attention =========================================================================================== */

static int run_attention(int dt, double *out, double *lse, const double *q, const double *k, const double *v,
                         int64_t BH, int64_t Tq, int64_t Tk, int64_t D, int causal, double scale)
{
    void *o = dev(dt, NULL, BH * Tq * D), *l = dev(dt, NULL, BH * Tq), *qd = dev(dt, q, BH * Tq * D);
    void *kd = dev(dt, k, BH * Tk * D), *vd = dev(dt, v, BH * Tk * D);
    int rc = tide_cpu_attention(dt, o, l, qd, kd, vd, BH, Tq, Tk, D, causal, scale);
    back(out, dt, o, BH * Tq * D, "attention out");
    back(lse, dt, l, BH * Tq, "attention lse");
    free(qd); free(kd); free(vd);
    return rc;
}

static int run_attention_backward(int dt, double *dq, double *dk, double *dv, const double *dout, const double *q,
                                  const double *k, const double *v, const double *out, const double *lse,
                                  int64_t BH, int64_t Tq, int64_t Tk, int64_t D, int causal, double scale)
{
    void *dqd = dev(dt, NULL, BH * Tq * D), *dkd = dev(dt, NULL, BH * Tk * D), *dvd = dev(dt, NULL, BH * Tk * D);
    void *gd = dev(dt, dout, BH * Tq * D), *qd = dev(dt, q, BH * Tq * D), *kd = dev(dt, k, BH * Tk * D);
    void *vd = dev(dt, v, BH * Tk * D), *od = dev(dt, out, BH * Tq * D), *ld = dev(dt, lse, BH * Tq);
    int rc = tide_cpu_attention_backward(dt, dqd, dkd, dvd, gd, qd, kd, vd, od, ld, BH, Tq, Tk, D, causal, scale);
    back(dq, dt, dqd, BH * Tq * D, "attention dq");
    back(dk, dt, dkd, BH * Tk * D, "attention dk");
    back(dv, dt, dvd, BH * Tk * D, "attention dv");
    free(gd); free(qd); free(kd); free(vd); free(od); free(ld);
    return rc;
}

static int visible(int64_t i, int64_t j, int64_t Tq, int64_t Tk, int causal)
{
    return !causal || j <= i + (Tk - Tq);
}

/* naive: per query, the scores, their exp and weighted sum of values (scores are small: no max shift) */
static void ref_attention(double *out, double *lse, const double *q, const double *k, const double *v, int64_t BH,
                          int64_t Tq, int64_t Tk, int64_t D, int causal, double scale)
{
    for (int64_t h = 0; h < BH; h++)
        for (int64_t i = 0; i < Tq; i++) {
            double den = 0.0;
            double *o = out + (h * Tq + i) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0;
            for (int64_t j = 0; j < Tk; j++) {
                if (!visible(i, j, Tq, Tk, causal)) continue;
                double s = 0.0;
                for (int64_t d = 0; d < D; d++) s += q[(h * Tq + i) * D + d] * k[(h * Tk + j) * D + d];
                double e = exp(scale * s);
                den += e;
                for (int64_t d = 0; d < D; d++) o[d] += e * v[(h * Tk + j) * D + d];
            }
            for (int64_t d = 0; d < D; d++) o[d] = den > 0 ? o[d] / den : 0.0;
            lse[h * Tq + i] = log(den);    /* −inf for a query that sees no key */
        }
}

static void ref_attention_backward(double *dq, double *dk, double *dv, const double *dout, const double *q,
                                   const double *k, const double *v, int64_t BH, int64_t Tq, int64_t Tk, int64_t D,
                                   int causal, double scale)
{
    double *P = vec(Tq * Tk, 0), *dP = vec(Tq * Tk, 0), *O = vec(Tq * D, 0);
    memset(dq, 0, (size_t)(BH * Tq * D) * sizeof(double));
    memset(dk, 0, (size_t)(BH * Tk * D) * sizeof(double));
    memset(dv, 0, (size_t)(BH * Tk * D) * sizeof(double));
    for (int64_t h = 0; h < BH; h++) {
        const double *qh = q + h * Tq * D, *kh = k + h * Tk * D, *vh = v + h * Tk * D, *g = dout + h * Tq * D;
        for (int64_t i = 0; i < Tq; i++) {
            double den = 0.0;
            for (int64_t j = 0; j < Tk; j++) {
                double s = 0.0;
                for (int64_t d = 0; d < D; d++) s += qh[i * D + d] * kh[j * D + d];
                P[i * Tk + j] = visible(i, j, Tq, Tk, causal) ? exp(scale * s) : 0.0;
                den += P[i * Tk + j];
            }
            for (int64_t j = 0; j < Tk; j++) P[i * Tk + j] = den > 0 ? P[i * Tk + j] / den : 0.0;
            for (int64_t d = 0; d < D; d++) {
                O[i * D + d] = 0.0;
                for (int64_t j = 0; j < Tk; j++) O[i * D + d] += P[i * Tk + j] * vh[j * D + d];
            }
        }
        for (int64_t i = 0; i < Tq; i++) {
            double Di = 0.0;
            for (int64_t d = 0; d < D; d++) Di += g[i * D + d] * O[i * D + d];
            for (int64_t j = 0; j < Tk; j++) {
                double dp = 0.0;
                for (int64_t d = 0; d < D; d++) dp += g[i * D + d] * vh[j * D + d];
                dP[i * Tk + j] = P[i * Tk + j] * (dp - Di);   /* dS */
                for (int64_t d = 0; d < D; d++) dv[(h * Tk + j) * D + d] += P[i * Tk + j] * g[i * D + d];
            }
        }
        for (int64_t i = 0; i < Tq; i++)
            for (int64_t j = 0; j < Tk; j++)
                for (int64_t d = 0; d < D; d++) {
                    dq[(h * Tq + i) * D + d] += scale * dP[i * Tk + j] * kh[j * D + d];
                    dk[(h * Tk + j) * D + d] += scale * dP[i * Tk + j] * qh[i * D + d];
                }
    }
    free(P); free(dP); free(O);
}

static void test_attention_ref(int dt, int64_t BH, int64_t Tq, int64_t Tk, int64_t D, int causal)
{
    double scale = 1.0 / sqrt((double)D);
    int64_t nq = BH * Tq * D, nk = BH * Tk * D;
    double *q = vec(nq, 1.0), *k = vec(nk, 1.0), *v = vec(nk, 1.0), *g = vec(nq, 1.0);
    round_to(dt, q, nq); round_to(dt, k, nk); round_to(dt, v, nk); round_to(dt, g, nq);
    double *out = vec(nq, 0), *lse = vec(BH * Tq, 0), *rout = vec(nq, 0), *rlse = vec(BH * Tq, 0);
    double *dq = vec(nq, 0), *dk = vec(nk, 0), *dv = vec(nk, 0), *rdq = vec(nq, 0), *rdk = vec(nk, 0);
    double *rdv = vec(nk, 0);
    char tag[128], what[160];
    snprintf(tag, sizeof tag, "attention %s BH=%lld Tq=%lld Tk=%lld D=%lld %s", dt_name(dt), (long long)BH,
             (long long)Tq, (long long)Tk, (long long)D, causal ? "causal" : "full");
    int rc = run_attention(dt, out, lse, q, k, v, BH, Tq, Tk, D, causal, scale);
    check(rc == 0, "%s returned %d: %s", tag, rc, tide_last_error());
    ref_attention(rout, rlse, q, k, v, BH, Tq, Tk, D, causal, scale);
    snprintf(what, sizeof what, "%s out", tag);
    expect_close(what, out, rout, nq, tol_of(dt));
    snprintf(what, sizeof what, "%s lse", tag);
    expect_close(what, lse, rlse, BH * Tq, tol_of(dt));
    round_to(dt, out, nq); round_to(dt, lse, BH * Tq);
    rc = run_attention_backward(dt, dq, dk, dv, g, q, k, v, out, lse, BH, Tq, Tk, D, causal, scale);
    check(rc == 0, "%s backward returned %d: %s", tag, rc, tide_last_error());
    ref_attention_backward(rdq, rdk, rdv, g, q, k, v, BH, Tq, Tk, D, causal, scale);
    snprintf(what, sizeof what, "%s dq", tag);
    expect_close(what, dq, rdq, nq, tol_of(dt));
    snprintf(what, sizeof what, "%s dk", tag);
    expect_close(what, dk, rdk, nk, tol_of(dt));
    snprintf(what, sizeof what, "%s dv", tag);
    expect_close(what, dv, rdv, nk, tol_of(dt));
    free(q); free(k); free(v); free(g); free(out); free(lse); free(rout); free(rlse);
    free(dq); free(dk); free(dv); free(rdq); free(rdk); free(rdv);
}

struct attn_ctx { double *q, *k, *v, *G; int64_t BH, Tq, Tk, D; int causal; double scale; };

static double attn_loss(void *p)
{
    struct attn_ctx *c = p;
    double *out = vec(c->BH * c->Tq * c->D, 0), *lse = vec(c->BH * c->Tq, 0);
    run_attention(TIDE_F64, out, lse, c->q, c->k, c->v, c->BH, c->Tq, c->Tk, c->D, c->causal, c->scale);
    double L = dot(out, c->G, c->BH * c->Tq * c->D);
    free(out); free(lse);
    return L;
}

static void test_attention_fd(int64_t BH, int64_t Tq, int64_t Tk, int64_t D, int causal)
{
    struct attn_ctx c = { NULL, NULL, NULL, NULL, BH, Tq, Tk, D, causal, 0.7 };
    int64_t nq = BH * Tq * D, nk = BH * Tk * D;
    c.q = vec(nq, 1.5); c.k = vec(nk, 1.5); c.v = vec(nk, 1.0); c.G = vec(nq, 1.0);
    double *out = vec(nq, 0), *lse = vec(BH * Tq, 0), *dq = vec(nq, 0), *dk = vec(nk, 0), *dv = vec(nk, 0);
    double *fq = vec(nq, 0), *fk = vec(nk, 0), *fv = vec(nk, 0);
    run_attention(TIDE_F64, out, lse, c.q, c.k, c.v, BH, Tq, Tk, D, causal, c.scale);
    run_attention_backward(TIDE_F64, dq, dk, dv, c.G, c.q, c.k, c.v, out, lse, BH, Tq, Tk, D, causal, c.scale);
    fd_grad(attn_loss, &c, c.q, nq, fq);
    fd_grad(attn_loss, &c, c.k, nk, fk);
    fd_grad(attn_loss, &c, c.v, nk, fv);
    char what[128];
    const char *kind = causal ? "causal" : "full";
    snprintf(what, sizeof what, "attention %s Tq=%lld Tk=%lld dq", kind, (long long)Tq, (long long)Tk);
    expect_grad(what, dq, fq, nq);
    snprintf(what, sizeof what, "attention %s Tq=%lld Tk=%lld dk", kind, (long long)Tq, (long long)Tk);
    expect_grad(what, dk, fk, nk);
    snprintf(what, sizeof what, "attention %s Tq=%lld Tk=%lld dv", kind, (long long)Tq, (long long)Tk);
    expect_grad(what, dv, fv, nk);
    free(c.q); free(c.k); free(c.v); free(c.G); free(out); free(lse); free(dq); free(dk); free(dv);
    free(fq); free(fk); free(fv);
}

/* causal with Tq > Tk: the first Tq − Tk queries see no key: out 0, lse −inf, no gradient, nothing NaN */
static void test_attention_masked_rows(void)
{
    int64_t BH = 2, Tq = 5, Tk = 3, D = 4;
    double *q = vec(BH * Tq * D, 1.0), *k = vec(BH * Tk * D, 1.0), *v = vec(BH * Tk * D, 1.0);
    double *g = vec(BH * Tq * D, 1.0), *out = vec(BH * Tq * D, 0), *lse = vec(BH * Tq, 0);
    double *dq = vec(BH * Tq * D, 0), *dk = vec(BH * Tk * D, 0), *dv = vec(BH * Tk * D, 0);
    run_attention(TIDE_F64, out, lse, q, k, v, BH, Tq, Tk, D, 1, 0.5);
    run_attention_backward(TIDE_F64, dq, dk, dv, g, q, k, v, out, lse, BH, Tq, Tk, D, 1, 0.5);
    int ok = 1, finite = 1;
    for (int64_t h = 0; h < BH; h++)
        for (int64_t i = 0; i < Tq - Tk; i++) {
            ok &= lse[h * Tq + i] == -INFINITY;
            for (int64_t d = 0; d < D; d++) ok &= out[(h * Tq + i) * D + d] == 0.0 && dq[(h * Tq + i) * D + d] == 0.0;
        }
    for (int64_t i = 0; i < BH * Tq * D; i++) finite &= isfinite(out[i]) && isfinite(dq[i]);
    for (int64_t i = 0; i < BH * Tk * D; i++) finite &= isfinite(dk[i]) && isfinite(dv[i]);
    check(ok, "attention: queries that see no key must give out 0, lse -inf, dq 0");
    check(finite, "attention: fully masked queries must not produce NaN/inf in out or gradients");
    free(q); free(k); free(v); free(g); free(out); free(lse); free(dq); free(dk); free(dv);
}

/* ==== dtype errors ============================================================================================ */

static void test_dtype_errors(void)
{
    char buf[64] = { 0 };
    int rc = tide_cpu_rmsnorm(TIDE_BF16, buf, buf, buf, buf, 1, 1, 1e-5);
    check(rc != 0 && strstr(tide_last_error(), "rmsnorm") && strstr(tide_last_error(), "not supported"),
          "rmsnorm bf16 on cpu must fail, got \"%s\"", tide_last_error());
    rc = tide_cpu_layernorm_backward(TIDE_I32, buf, buf, NULL, buf, buf, buf, buf, buf, 1, 1);
    check(rc != 0 && strstr(tide_last_error(), "layernorm_backward"), "layernorm_backward i32 must fail, got \"%s\"",
          tide_last_error());
    rc = tide_cpu_softmax(TIDE_I64, buf, buf, 1, 1, 1);
    check(rc != 0 && strstr(tide_last_error(), "log_softmax"), "log_softmax i64 must fail, got \"%s\"",
          tide_last_error());
    rc = tide_cpu_cross_entropy(TIDE_U8, buf, buf, buf, buf, buf, TIDE_I64, NULL, 1, 1, -100);
    check(rc != 0 && strstr(tide_last_error(), "cross_entropy"), "cross_entropy u8 must fail, got \"%s\"",
          tide_last_error());
    rc = tide_cpu_rope(TIDE_BF16, buf, buf, 1, 1, 1, 2, 10000.0, 0, 0);
    check(rc != 0 && strstr(tide_last_error(), "rope"), "rope bf16 must fail, got \"%s\"", tide_last_error());
    rc = tide_cpu_attention_backward(TIDE_BF16, buf, buf, buf, buf, buf, buf, buf, buf, buf, 1, 1, 1, 1, 0, 1.0);
    check(rc != 0 && strstr(tide_last_error(), "attention_backward"), "attention_backward bf16 must fail, got \"%s\"",
          tide_last_error());
}

int main(void)
{
    static const int dts[2] = { TIDE_F64, TIDE_F32 };
    for (int i = 0; i < 2; i++) {
        int dt = dts[i];
        test_rmsnorm_ref(dt, 5, 7);
        test_rmsnorm_ref(dt, 64, 512);          /* parallel path */
        test_layernorm_ref(dt, 5, 9, 1);
        test_layernorm_ref(dt, 5, 9, 0);
        test_layernorm_ref(dt, 48, 400, 1);     /* parallel path */
        test_softmax_ref(dt, 4, 10, 0);
        test_softmax_ref(dt, 4, 10, 1);
        test_softmax_ref(dt, 40, 500, 0);
        test_softmax_ref(dt, 40, 500, 1);
        test_softmax_stable(dt);
        test_ce_ref(dt, TIDE_I32, 9, 13, 0);
        test_ce_ref(dt, TIDE_I64, 9, 13, 1);
        test_ce_ref(dt, TIDE_I64, 40, 1000, 1); /* parallel path */
        test_ce_ref(dt, TIDE_I64, 6, 50304, 0); /* a GPT-2 vocabulary: 3144 lane blocks summed */
        test_ce_nonfinite(dt);
        test_rope_ref(dt, 2, 5, 3, 8, 3);
        test_rope_ref(dt, 2, 64, 4, 64, 1000);  /* parallel path, long positions */
        test_attention_ref(dt, 3, 5, 5, 4, 1);
        test_attention_ref(dt, 2, 3, 7, 6, 1);
        test_attention_ref(dt, 2, 4, 6, 5, 0);
        test_attention_ref(dt, 2, 6, 4, 4, 1);  /* Tq > Tk: fully masked first rows */
        test_attention_ref(dt, 2, 160, 160, 32, 1);   /* parallel row loops */
        test_attention_ref(dt, 1, 130, 200, 16, 0);
    }
    test_rmsnorm_fd();
    test_layernorm_fd(1);
    test_layernorm_fd(0);
    test_softmax_fd(0);
    test_softmax_fd(1);
    test_ce_fd(0);
    test_ce_fd(1);
    test_ce_errors();
    test_rope_fd();
    test_rope_errors();
    test_attention_fd(2, 4, 4, 3, 1);
    test_attention_fd(2, 3, 6, 4, 1);
    test_attention_fd(2, 4, 5, 3, 0);
    test_attention_masked_rows();
    test_dtype_errors();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}

/*
 * attnres.c — the Attention Residuals mix on the CPU (kernels/backend.h: attnres; spec/attnres.md §1, §4).
 *
 *   a = w ⊙ ν,  r_i = (mean_c v_i² + eps)^-1/2,  s_i = r_i (a · v_i),  p = softmax(s),  out = Σ_i p_i v_i
 *
 * per row (token), over n sources given as separate buffers (no stacked copy). The direct form: every score
 * first, then the softmax, then the weighted sum; sums in double for both dtypes. Rows are independent and
 * split over threads. The backward's gw and gnu share one row sum U[c] = Σ_t Σ_i ds_i r_i v_i[t, c]
 * (dw = ν ⊙ U, dν = w ⊙ U, §4): each thread owns a range of columns and adds rows in order, so the result
 * does not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include "cpu.h"
#include "fastmath.h"

/* the source softmax's exponentials in double: f32 on exp_f64 (fastmath.h: libm's float results), f64 on libm */
static inline double ar_exp_f32(double x) { return exp_f64(x); }
static inline double ar_exp_f64(double x) { return exp(x); }

/* the forward's rows in blocks of AR_RB: a block's score sums (2 chains per row and source, each over c in order)
   are advanced together, so the chains of the block's rows overlap instead of waiting on each other */
#define AR_RB 4

#define DEFINE_ATTNRES(TT, SFX)                                                                               \
static void attnres_fwd_##SFX(TT *out, TT *P, TT *R, const TT *const *v, int64_t n, int64_t rows, int64_t d, \
                              const double *a, double eps, double *scratch)                                   \
{                                                                                                             \
    _Pragma("omp parallel for if(rows * d * n > TIDE_OMP_MIN)")                                                      \
    for (int64_t tb = 0; tb < rows; tb += AR_RB) {                                                            \
        int64_t nb = rows - tb < AR_RB ? rows - tb : AR_RB;                                                   \
        double *sb = scratch + (int64_t)omp_get_thread_num() * TIDE_CPU_PAD8(AR_RB * n + d), *o = sb + AR_RB * n; \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            double ss[AR_RB] = {0}, dot[AR_RB] = {0};                                                         \
            if (nb == AR_RB) {                                                                                \
                const TT *x0 = v[i] + tb * d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;                       \
                for (int64_t c = 0; c < d; c++) {                                                             \
                    ss[0] += (double)x0[c] * x0[c]; dot[0] += a[c] * x0[c];                                   \
                    ss[1] += (double)x1[c] * x1[c]; dot[1] += a[c] * x1[c];                                   \
                    ss[2] += (double)x2[c] * x2[c]; dot[2] += a[c] * x2[c];                                   \
                    ss[3] += (double)x3[c] * x3[c]; dot[3] += a[c] * x3[c];                                   \
                }                                                                                             \
            } else {                                                                                          \
                for (int64_t u = 0; u < nb; u++) {                                                            \
                    const TT *x = v[i] + (tb + u) * d;                                                        \
                    for (int64_t c = 0; c < d; c++) { ss[u] += (double)x[c] * x[c]; dot[u] += a[c] * x[c]; }  \
                }                                                                                             \
            }                                                                                                 \
            for (int64_t u = 0; u < nb; u++) {                                                                \
                double r = 1.0 / sqrt(ss[u] / (double)d + eps);                                               \
                sb[u * n + i] = r * dot[u];                                                                   \
                R[i * rows + tb + u] = (TT)r;                                                                 \
            }                                                                                                 \
        }                                                                                                     \
        for (int64_t u = 0; u < nb; u++) {                                                                    \
            int64_t t = tb + u;                                                                               \
            double *s = sb + u * n, m = -INFINITY, z = 0;                                                     \
            for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;                                          \
            for (int64_t i = 0; i < n; i++) { s[i] = ar_exp_##SFX(s[i] - m); z += s[i]; }                     \
            for (int64_t i = 0; i < n; i++) { s[i] /= z; P[i * rows + t] = (TT)s[i]; }                        \
            /* o[c] = Σ_i p_i v_i[t, c], the sources in order for every c (the channels at once) */          \
            for (int64_t c = 0; c < d; c++) o[c] = 0;                                                         \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                const TT *x = v[i] + t * d;                                                                   \
                double p = s[i];                                                                              \
                for (int64_t c = 0; c < d; c++) o[c] += p * x[c];                                             \
            }                                                                                                 \
            for (int64_t c = 0; c < d; c++) out[t * d + c] = (TT)o[c];                                        \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* coef[i, t] = ds_i r_i, the row weight of source i in U (NULL: not wanted) */                               \
static void attnres_bwd_##SFX(TT *const *gv, double *coef, const TT *gout, const TT *const *v, const TT *P,   \
                              const TT *R, int64_t n, int64_t rows, int64_t d, const double *a, double *scratch) \
{                                                                                                             \
    _Pragma("omp parallel for if(rows * d * n > TIDE_OMP_MIN)")                                                      \
    for (int64_t tb = 0; tb < rows; tb += AR_RB) {                                                            \
      int64_t nb = rows - tb < AR_RB ? rows - tb : AR_RB;                                                     \
      double *dpb = scratch + (int64_t)omp_get_thread_num() * 2 * AR_RB * n, *sbk = dpb + AR_RB * n;          \
      /* the block's dot products first, 2 chains per row and source advanced together over c (each chain's   \
         adds in order, as the forward's), so they overlap instead of waiting on each other */                \
      for (int64_t i = 0; i < n; i++) {                                                                       \
          double e[AR_RB] = {0}, dot[AR_RB] = {0};                                                            \
          if (nb == AR_RB) {                                                                                  \
              const TT *x0 = v[i] + tb * d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;                         \
              const TT *g0 = gout + tb * d, *g1 = g0 + d, *g2 = g1 + d, *g3 = g2 + d;                         \
              for (int64_t c = 0; c < d; c++) {                                                               \
                  e[0] += (double)g0[c] * x0[c]; dot[0] += a[c] * x0[c];                                      \
                  e[1] += (double)g1[c] * x1[c]; dot[1] += a[c] * x1[c];                                      \
                  e[2] += (double)g2[c] * x2[c]; dot[2] += a[c] * x2[c];                                      \
                  e[3] += (double)g3[c] * x3[c]; dot[3] += a[c] * x3[c];                                      \
              }                                                                                               \
          } else {                                                                                            \
              for (int64_t u = 0; u < nb; u++) {                                                              \
                  const TT *x = v[i] + (tb + u) * d, *go = gout + (tb + u) * d;                               \
                  for (int64_t c = 0; c < d; c++) { e[u] += (double)go[c] * x[c]; dot[u] += a[c] * x[c]; }    \
              }                                                                                               \
          }                                                                                                   \
          for (int64_t u = 0; u < nb; u++) { dpb[u * n + i] = e[u]; sbk[u * n + i] = dot[u]; }                \
      }                                                                                                       \
      for (int64_t u = 0; u < nb; u++) {                                                                      \
        int64_t t = tb + u;                                                                                   \
        double *dp = dpb + u * n, *s = sbk + u * n, G = 0;                                                    \
        const TT *go = gout + t * d;                                                                          \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            s[i] = (double)R[i * rows + t] * s[i];                                                            \
            G += (double)P[i * rows + t] * dp[i];                                                             \
        }                                                                                                     \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            double p = P[i * rows + t], r = R[i * rows + t], ds = p * (dp[i] - G);                            \
            if (coef) coef[i * rows + t] = ds * r;                                                            \
            if (!gv || !gv[i]) continue;                                                                      \
            const TT *x = v[i] + t * d;                                                                       \
            TT *g = gv[i] + t * d;                                                                            \
            double k = ds * s[i] * r * r / (double)d;                                                         \
            for (int64_t c = 0; c < d; c++) g[c] = (TT)(p * go[c] + ds * r * a[c] - k * x[c]);                \
        }                                                                                                     \
      }                                                                                                       \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* U[c] = Σ_t Σ_i coef[i, t] v_i[t, c], columns split over threads, rows added in order */                    \
static void attnres_rowsum_##SFX(double *U, const double *coef, const TT *const *v, int64_t n, int64_t rows,   \
                                 int64_t d)                                                                   \
{                                                                                                             \
    _Pragma("omp parallel if(rows * d * n > TIDE_OMP_MIN)")                                                          \
    {                                                                                                         \
        int64_t c0, c1;                       /* whole cache lines of U per thread */                          \
        tide_cpu_column_range(d, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);                     \
        for (int64_t c = c0; c < c1; c++) U[c] = 0;                                                           \
        for (int64_t t = 0; t < rows; t++)                                                                    \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                double k = coef[i * rows + t];                                                                \
                const TT *x = v[i] + t * d;                                                                   \
                for (int64_t c = c0; c < c1; c++) U[c] += k * x[c];                                           \
            }                                                                                                 \
    }                                                                                                         \
}

DEFINE_ATTNRES(float, f32)
DEFINE_ATTNRES(double, f64)

static double ld(int dtype, const void *p, int64_t i)
{
    return dtype == TIDE_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

static int check_args(const char *what, int dtype, int64_t n, int64_t rows, int64_t d)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s is not supported on the cpu backend (f32, f64)", what, tide_cpu_dtype_str(dtype));
    if (n < 1 || rows < 0 || d < 1)
        return tide_set_error("%s: bad sizes n %lld rows %lld d %lld (n, d >= 1)", what, (long long)n, (long long)rows,
                              (long long)d);
    return 0;
}

int tide_cpu_attnres(int dtype, void *out, void *stats, const void *const *srcs, int64_t n, int64_t rows, int64_t d,
                     const void *w, const void *nu, double eps)
{
    if (check_args("attnres", dtype, n, rows, d)) return -1;
    if (rows == 0) return 0;
    int nth = omp_get_max_threads();
    /* a [d], then each thread's scratch on its own cache lines (64-byte aligned, whole lines apart) */
    double *a = tide_cpu_malloc((size_t)(TIDE_CPU_PAD8(d) + (int64_t)nth * TIDE_CPU_PAD8(AR_RB * n + d)) * sizeof *a);
    if (!a) return tide_set_error("attnres: out of memory");
    for (int64_t c = 0; c < d; c++) a[c] = ld(dtype, w, c) * ld(dtype, nu, c);
    if (dtype == TIDE_F32)
        attnres_fwd_f32(out, stats, (float *)stats + n * rows, (const float *const *)srcs, n, rows, d, a, eps,
                        a + TIDE_CPU_PAD8(d));
    else
        attnres_fwd_f64(out, stats, (double *)stats + n * rows, (const double *const *)srcs, n, rows, d, a, eps,
                        a + TIDE_CPU_PAD8(d));
    tide_cpu_free(a);
    return 0;
}

int tide_cpu_attnres_backward(int dtype, void *const *gsrcs, void *gw, void *gnu, const void *gout, const void *const *srcs,
                              const void *stats, int64_t n, int64_t rows, int64_t d, const void *w, const void *nu)
{
    if (check_args("attnres backward", dtype, n, rows, d)) return -1;
    int want_u = gw || gnu, nth = omp_get_max_threads();
    /* a [d], per-thread scratch [2 AR_RB n], U [d], coef [n, rows]: 64-byte aligned, each part on lines of its own
       (2 AR_RB n doubles is whole lines) */
    int64_t dp = TIDE_CPU_PAD8(d), need = dp + (int64_t)nth * 2 * AR_RB * n + (want_u ? dp + n * rows : 0);
    double *a = tide_cpu_malloc((size_t)need * sizeof *a);
    if (!a) return tide_set_error("attnres backward: out of memory");
    double *scratch = a + dp, *U = want_u ? scratch + (int64_t)nth * 2 * AR_RB * n : NULL, *coef = want_u ? U + dp : NULL;
    for (int64_t c = 0; c < d; c++) a[c] = ld(dtype, w, c) * ld(dtype, nu, c);
    if (dtype == TIDE_F32) {
        const float *P = stats, *R = P + n * rows;
        attnres_bwd_f32((float *const *)gsrcs, coef, gout, (const float *const *)srcs, P, R, n, rows, d, a, scratch);
        if (want_u) attnres_rowsum_f32(U, coef, (const float *const *)srcs, n, rows, d);
    } else {
        const double *P = stats, *R = P + n * rows;
        attnres_bwd_f64((double *const *)gsrcs, coef, gout, (const double *const *)srcs, P, R, n, rows, d, a, scratch);
        if (want_u) attnres_rowsum_f64(U, coef, (const double *const *)srcs, n, rows, d);
    }
    for (int64_t c = 0; want_u && c < d; c++) {
        double gwc = ld(dtype, nu, c) * U[c], gnc = ld(dtype, w, c) * U[c];
        if (dtype == TIDE_F32) {
            if (gw) ((float *)gw)[c] = (float)gwc;
            if (gnu) ((float *)gnu)[c] = (float)gnc;
        } else {
            if (gw) ((double *)gw)[c] = gwc;
            if (gnu) ((double *)gnu)[c] = gnc;
        }
    }
    tide_cpu_free(a);
    return 0;
}

/*
 * attnres.c — the Attention Residuals mix on the CPU (kernels/backend.h: attnres; spec/attnres.md §1, §4).
 *
 *   a = w ⊙ ν,  r_i = (mean_c v_i² + eps)^-1/2,  s_i = r_i (a · v_i),  p = softmax(s),  out = Σ_i p_i v_i
 *
 * per row (token), over n sources given as separate buffers (no stacked copy). The direct form: every score
 * first, then the softmax, then the weighted sum; sums in double for both dtypes. Rows are independent and
 * split over threads (in parallel from 4 x TIDE_OMP_MIN_MATH elements over all sources: bench/omp_threshold.lua).
 * The backward's gw and gnu share one row sum U[c] = Σ_t Σ_i ds_i r_i v_i[t, c]
 * (dw = ν ⊙ U, dν = w ⊙ U, §4): each thread owns a range of columns and adds rows in order, so the result
 * does not depend on the thread count.
 */
/* 512-bit vectors under AVX-512 for the loops over the d channels (GCC prefers 256 by default; every lane does the
   same arithmetic, so the same bits in f32 and f64): the backward ~15% faster at 4,096 x 64 */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "cpu.h"
#include "fastmath.h"

/* the source softmax's exponentials in double: f32 on exp_f64 (fastmath.h: libm's float results), f64 on libm */
static inline double ar_exp_f32(double x) { return exp_f64(x); }
static inline double ar_exp_f64(double x) { return exp(x); }

/* rows in blocks of AR_RB: a block's row sums (2 chains per row and source, each over c in order) are advanced
   together, so the chains of the block's rows overlap instead of waiting on each other. The forward takes two such
   blocks at once (AR_RB_FWD: 4 chains in flight; with the backward's second operand they no longer fit the
   registers, and the backward ran slower) */
#define AR_RB 8
#define AR_RB_FWD 16

/* The two chains of rows x_u = x0 + u d, u < nb: p[u] = Σ_c y_u[c] x_u[c] (y_u = x_u when y0 is NULL, else
   y0 + u d) and q[u] = Σ_c a[c] x_u[c], each a fused multiply-add chain over c in order from 0, in double (a
   product of two floats is exact in double, so only q's fma rounds differently from a multiply and an add; the
   fma is explicit, never left to the compiler's contraction). f32 blocks of 8 rows under AVX-512: the rows in
   the 8 lanes of a double vector (each lane its row's chain), the floats transposed 8 x 8 on the way in */
#if defined(__FMA__) || defined(__AVX512F__)
#define AR_FMA(x, y, acc) fma(x, y, acc)
#else
#define AR_FMA(x, y, acc) ((acc) + (x) * (y))   /* no fused multiply-add in hardware: not libm's software fma */
#endif
#define DEFINE_AR_CHAINS(TT, SFX)                                                                             \
static void ar_chains_generic_##SFX(const TT *x0, const TT *y0, int64_t nb, int64_t d, const double *a,      \
                                    double *p, double *q)                                                     \
{                                                                                                             \
    int64_t u = 0;                                                                                            \
    for (; u + 4 <= nb; u += 4) {                                                                             \
        const TT *x_0 = x0 + u * d, *x_1 = x_0 + d, *x_2 = x_1 + d, *x_3 = x_2 + d;                           \
        const TT *y_0 = y0 ? y0 + u * d : x_0, *y_1 = y_0 + d, *y_2 = y_1 + d, *y_3 = y_2 + d;                \
        double p0 = 0, p1 = 0, p2 = 0, p3 = 0, q0 = 0, q1 = 0, q2 = 0, q3 = 0;                                \
        for (int64_t c = 0; c < d; c++) {                                                                     \
            p0 = AR_FMA((double)y_0[c], (double)x_0[c], p0);                                                  \
            q0 = AR_FMA(a[c], (double)x_0[c], q0);                                                            \
            p1 = AR_FMA((double)y_1[c], (double)x_1[c], p1);                                                  \
            q1 = AR_FMA(a[c], (double)x_1[c], q1);                                                            \
            p2 = AR_FMA((double)y_2[c], (double)x_2[c], p2);                                                  \
            q2 = AR_FMA(a[c], (double)x_2[c], q2);                                                            \
            p3 = AR_FMA((double)y_3[c], (double)x_3[c], p3);                                                  \
            q3 = AR_FMA(a[c], (double)x_3[c], q3);                                                            \
        }                                                                                                     \
        p[u] = p0, p[u + 1] = p1, p[u + 2] = p2, p[u + 3] = p3;                                               \
        q[u] = q0, q[u + 1] = q1, q[u + 2] = q2, q[u + 3] = q3;                                               \
    }                                                                                                         \
    for (; u < nb; u++) {                                                                                     \
        const TT *x = x0 + u * d, *y = y0 ? y0 + u * d : x;                                                   \
        double pu = 0, qu = 0;                                                                                \
        for (int64_t c = 0; c < d; c++) {                                                                     \
            pu = AR_FMA((double)y[c], (double)x[c], pu);                                                      \
            qu = AR_FMA(a[c], (double)x[c], qu);                                                              \
        }                                                                                                     \
        p[u] = pu, q[u] = qu;                                                                                 \
    }                                                                                                         \
}
DEFINE_AR_CHAINS(float, f32)
DEFINE_AR_CHAINS(double, f64)
#undef DEFINE_AR_CHAINS

#if defined(__AVX512F__)
#include <immintrin.h>
/* r[k] = column k of the 8 x 8 block whose rows are r[0..7] */
static inline void ar_transpose8(__m256 r[8])
{
    __m256 t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x20);
        r[k + 4] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x31);
    }
}

/* G groups of 8 rows (G = 1 or 2), the groups' chains interleaved: 2G independent chains of fused multiply-adds, so
   the adds of one wait on the latency of the others less (each chain's order is the same) */
#define AR_CHAINS_GROUPS(G)                                                                                   \
    {                                                                                                         \
        __m512d P[G], Q[G];                                                                                   \
        for (int g = 0; g < G; g++) P[g] = Q[g] = _mm512_setzero_pd();                                        \
        int64_t c = 0;                                                                                        \
        for (; c + 8 <= d; c += 8) {                                                                          \
            __m256 xr[G][8], yr[G][8];                                                                        \
            for (int g = 0; g < G; g++) {                                                                     \
                for (int u = 0; u < 8; u++) xr[g][u] = _mm256_loadu_ps(x0 + (g * 8 + u) * d + c);           \
                ar_transpose8(xr[g]);                                                                         \
                if (y0) {                                                                                     \
                    for (int u = 0; u < 8; u++) yr[g][u] = _mm256_loadu_ps(y0 + (g * 8 + u) * d + c);        \
                    ar_transpose8(yr[g]);                                                                     \
                }                                                                                             \
            }                                                                                                 \
            for (int k = 0; k < 8; k++) {                                                                     \
                __m512d av = _mm512_set1_pd(a[c + k]);                                                        \
                for (int g = 0; g < G; g++) {                                                                 \
                    __m512d xv = _mm512_cvtps_pd(xr[g][k]), yv = y0 ? _mm512_cvtps_pd(yr[g][k]) : xv;        \
                    P[g] = _mm512_fmadd_pd(yv, xv, P[g]);                                                     \
                    Q[g] = _mm512_fmadd_pd(av, xv, Q[g]);                                                     \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (; c < d; c++)                                                                                    \
            for (int g = 0; g < G; g++) {                                                                     \
                double xs[8], ys[8];                                                                          \
                for (int u = 0; u < 8; u++) {                                                                 \
                    xs[u] = x0[(g * 8 + u) * d + c];                                                          \
                    ys[u] = y0 ? y0[(g * 8 + u) * d + c] : xs[u];                                             \
                }                                                                                             \
                __m512d xv = _mm512_loadu_pd(xs), yv = _mm512_loadu_pd(ys);                                   \
                P[g] = _mm512_fmadd_pd(yv, xv, P[g]);                                                         \
                Q[g] = _mm512_fmadd_pd(_mm512_set1_pd(a[c]), xv, Q[g]);                                       \
            }                                                                                                 \
        for (int g = 0; g < G; g++) {                                                                         \
            _mm512_storeu_pd(p + 8 * g, P[g]);                                                                \
            _mm512_storeu_pd(q + 8 * g, Q[g]);                                                                \
        }                                                                                                     \
    }

/* 16 rows without a second operand (the forward's blocks): two groups; 8 rows: one; other counts: generic */
static void ar_chains16_f32(const float *x0, const double *a, int64_t d, double *p, double *q)
{
    const float *y0 = NULL;
    AR_CHAINS_GROUPS(2)
}

static void ar_chains8_f32(const float *x0, const float *y0, int64_t nb, int64_t d, const double *a, double *p,
                           double *q)
{
    (void)nb;
    __m512d P = _mm512_setzero_pd(), Q = _mm512_setzero_pd();
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
        __m256 xr[8], yr[8];
        for (int u = 0; u < 8; u++) xr[u] = _mm256_loadu_ps(x0 + u * d + c);
        ar_transpose8(xr);
        if (y0) {
            for (int u = 0; u < 8; u++) yr[u] = _mm256_loadu_ps(y0 + u * d + c);
            ar_transpose8(yr);
        }
        for (int k = 0; k < 8; k++) {
            __m512d xv = _mm512_cvtps_pd(xr[k]), yv = y0 ? _mm512_cvtps_pd(yr[k]) : xv;
            P = _mm512_fmadd_pd(yv, xv, P);
            Q = _mm512_fmadd_pd(_mm512_set1_pd(a[c + k]), xv, Q);
        }
    }
    for (; c < d; c++) {
        double xs[8], ys[8];
        for (int u = 0; u < 8; u++) {
            xs[u] = x0[u * d + c];
            ys[u] = y0 ? y0[u * d + c] : xs[u];
        }
        __m512d xv = _mm512_loadu_pd(xs), yv = _mm512_loadu_pd(ys);
        P = _mm512_fmadd_pd(yv, xv, P);
        Q = _mm512_fmadd_pd(_mm512_set1_pd(a[c]), xv, Q);
    }
    _mm512_storeu_pd(p, P);
    _mm512_storeu_pd(q, Q);
}
static void ar_chains_f32(const float *x0, const float *y0, int64_t nb, int64_t d, const double *a, double *p,
                          double *q)
{
    if (nb == 16 && !y0) ar_chains16_f32(x0, a, d, p, q);
    else if (nb == 8) ar_chains8_f32(x0, y0, nb, d, a, p, q);
    else ar_chains_generic_f32(x0, y0, nb, d, a, p, q);
}
#undef AR_CHAINS_GROUPS
#else
#define ar_chains_f32 ar_chains_generic_f32
#endif
#define ar_chains_f64 ar_chains_generic_f64

/* 8 channels as doubles: loaded from floats or doubles, stored back converted; acc + p·x as one fused multiply-add
   per lane (explicit where the target has FMA, as AR_FMA) */
typedef double ar_v8d __attribute__((vector_size(64)));
typedef float ar_v8f __attribute__((vector_size(32)));
static inline ar_v8d AR_LOAD8_f32(const float *p) { ar_v8f f; memcpy(&f, p, sizeof f); return __builtin_convertvector(f, ar_v8d); }
static inline ar_v8d AR_LOAD8_f64(const double *p) { ar_v8d f; memcpy(&f, p, sizeof f); return f; }
static inline void AR_STORE8_f32(float *p, ar_v8d v) { ar_v8f f = __builtin_convertvector(v, ar_v8f); memcpy(p, &f, sizeof f); }
static inline void AR_STORE8_f64(double *p, ar_v8d v) { memcpy(p, &v, sizeof v); }
#if defined(__AVX512F__)
static inline ar_v8d AR_VFMA(double p, ar_v8d x, ar_v8d acc)
{
    return (ar_v8d)_mm512_fmadd_pd(_mm512_set1_pd(p), (__m512d)x, (__m512d)acc);
}
#else
static inline ar_v8d AR_VFMA(double p, ar_v8d x, ar_v8d acc)
{
    for (int l = 0; l < 8; l++) acc[l] = AR_FMA(p, x[l], acc[l]);
    return acc;
}
#endif

#define DEFINE_ATTNRES(TT, SFX)                                                                               \
static void attnres_fwd_##SFX(TT *out, TT *P, TT *R, const TT *const *v, int64_t n, int64_t rows, int64_t d, \
                              const double *a, double eps, double *scratch)                                   \
{                                                                                                             \
    _Pragma("omp parallel for if(rows * d * n > 4 * TIDE_OMP_MIN_MATH)")                                                      \
    for (int64_t tb = 0; tb < rows; tb += AR_RB_FWD) {                                                            \
        int64_t nb = rows - tb < AR_RB_FWD ? rows - tb : AR_RB_FWD;                                                   \
        double *sb = scratch + (int64_t)omp_get_thread_num() * TIDE_CPU_PAD8(AR_RB_FWD * n + d);                    \
        /* the block's scores sb[i·AR_RB_FWD + u] (source i, row u), then its softmaxes with the rows in vector lanes   \
           (each row's arithmetic, in the order of its own loop, as before: the sources' maximum, exp and sum in  \
           order, one division each), then each row's sum over the sources channel by channel in registers */    \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            double ss[AR_RB_FWD], dot[AR_RB_FWD], rr[AR_RB_FWD];                                                          \
            ar_chains_##SFX(v[i] + tb * d, NULL, nb, d, a, ss, dot);                                          \
            _Pragma("omp simd")                                                                               \
            for (int64_t u = 0; u < nb; u++) {                                                                \
                rr[u] = 1.0 / sqrt(ss[u] / (double)d + eps);                                                  \
                sb[i * AR_RB_FWD + u] = rr[u] * dot[u];                                                           \
            }                                                                                                 \
            for (int64_t u = 0; u < nb; u++) R[i * rows + tb + u] = (TT)rr[u];                                \
            for (int64_t u = nb; u < AR_RB_FWD; u++) sb[i * AR_RB_FWD + u] = 0;   /* (lanes past a last block's rows) */ \
        }                                                                                                     \
        double m[AR_RB_FWD], z[AR_RB_FWD];                                                                            \
        for (int64_t u = 0; u < AR_RB_FWD; u++) { m[u] = -INFINITY; z[u] = 0; }                                   \
        for (int64_t i = 0; i < n; i++)                                                                       \
            _Pragma("omp simd")                                                                               \
            for (int64_t u = 0; u < AR_RB_FWD; u++) m[u] = sb[i * AR_RB_FWD + u] > m[u] ? sb[i * AR_RB_FWD + u] : m[u];  \
        for (int64_t i = 0; i < n; i++)                                                                       \
            _Pragma("omp simd")                                                                               \
            for (int64_t u = 0; u < AR_RB_FWD; u++) {                                                             \
                double e = ar_exp_##SFX(sb[i * AR_RB_FWD + u] - m[u]);                                            \
                sb[i * AR_RB_FWD + u] = e;                                                                        \
                z[u] += e;                                                                                    \
            }                                                                                                 \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            _Pragma("omp simd")                                                                               \
            for (int64_t u = 0; u < AR_RB_FWD; u++) sb[i * AR_RB_FWD + u] /= z[u];                                    \
            for (int64_t u = 0; u < nb; u++) P[i * rows + tb + u] = (TT)sb[i * AR_RB_FWD + u];                    \
        }                                                                                                     \
        for (int64_t u = 0; u < nb; u++) {                                                                    \
            int64_t t = tb + u;                                                                               \
            const double *pu = sb + u;                                                                        \
            TT *ot = out + t * d;                                                                             \
            /* out[t, c] = Σ_i p_i v_i[t, c], the sources in order for every c: 8 channels in a vector of      \
               doubles at a time, each lane its channel's chain of fused multiply-adds from 0 */               \
            int64_t c = 0;                                                                                    \
            for (; c + 8 <= d; c += 8) {                                                                      \
                ar_v8d acc = {0};                                                                             \
                for (int64_t i = 0; i < n; i++) {                                                             \
                    ar_v8d x = AR_LOAD8_##SFX(v[i] + t * d + c);                                              \
                    acc = AR_VFMA(pu[i * AR_RB_FWD], x, acc);                                                     \
                }                                                                                             \
                AR_STORE8_##SFX(ot + c, acc);                                                                 \
            }                                                                                                 \
            for (; c < d; c++) {                                                                              \
                double acc = 0;                                                                               \
                for (int64_t i = 0; i < n; i++) acc = AR_FMA(pu[i * AR_RB_FWD], (double)v[i][t * d + c], acc);   \
                ot[c] = (TT)acc;                                                                              \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* coef[i, t] = ds_i r_i, the row weight of source i in U (NULL: not wanted) */                               \
static void attnres_bwd_##SFX(TT *const *gv, double *coef, const TT *gout, const TT *const *v, const TT *P,   \
                              const TT *R, int64_t n, int64_t rows, int64_t d, const double *a, double *scratch) \
{                                                                                                             \
    _Pragma("omp parallel for if(rows * d * n > 4 * TIDE_OMP_MIN_MATH)")                                                      \
    for (int64_t tb = 0; tb < rows; tb += AR_RB) {                                                            \
      int64_t nb = rows - tb < AR_RB ? rows - tb : AR_RB;                                                     \
      double *dpb = scratch + (int64_t)omp_get_thread_num() * 2 * AR_RB * n, *sbk = dpb + AR_RB * n;          \
      /* the block's dot products first, 2 chains per row and source advanced together over c (each chain's   \
         adds in order, as the forward's), so they overlap instead of waiting on each other */                \
      for (int64_t i = 0; i < n; i++) {                                                                       \
          double e[AR_RB], dot[AR_RB];                                                                        \
          ar_chains_##SFX(v[i] + tb * d, gout + tb * d, nb, d, a, e, dot);                                    \
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
    _Pragma("omp parallel if(rows * d * n > 4 * TIDE_OMP_MIN_MATH)")                                                          \
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
    double *a = tide_cpu_malloc((size_t)(TIDE_CPU_PAD8(d) + (int64_t)nth * TIDE_CPU_PAD8(AR_RB_FWD * n + d)) * sizeof *a);
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

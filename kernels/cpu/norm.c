/*
 * norm.c — RMSNorm and LayerNorm over the last dim of x [N, C] (kernels/backend.h).
 *
 * RMSNorm(x) = x / sqrt(mean(x²) + eps) ⊙ w  (spec/README.md notation); LayerNorm subtracts the row
 * mean first and adds an optional bias. Row statistics and the reductions behind the gradients are
 * accumulated in double for both f32 and f64, the row sums as `omp simd` reductions (lane-wise partial sums, then
 * combined: a fixed order for a given build, and the loops vectorise; a sequential double sum was LayerNorm's
 * whole cost, 2-3x PyTorch's in bench/vision). rstd (and mean) are saved [N] in the dtype of x.
 *
 * Weight gradients accumulate (dw += ...). They are reduced over rows by splitting the COLUMNS among
 * threads: each thread owns a contiguous column range, walks all rows and writes only its own
 * columns, so there is no race and the sum order does not depend on the thread count.
 */
#include <math.h>
#include <stdlib.h>
#include "cpu.h"
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#define THREAD_COUNT() omp_get_num_threads()
#else
#define THREAD_ID() 0
#define THREAD_COUNT() 1
#endif

/* rows are processed in parallel when a call touches more than TIDE_OMP_MIN_ROW elements (cpu.h: the cost classes
   of the `if` clauses) */

/* column range [*c0, *c1) of thread `tid` out of `nth`, in whole cache lines of the (aligned) accumulators */
#define column_range tide_cpu_column_range

/* ---- RMSNorm ------------------------------------------------------------------------------------ */

#define RMS_ROWS 16    /* rows a thread takes at once */

#define DEFINE_RMSNORM(T, SFX)                                                                          \
static void rmsnorm_##SFX(T *out, T *rstd, const T *x, const T *w, int64_t N, int64_t C, double eps)  \
{                                                                                                       \
    _Pragma("omp parallel if(N * C > TIDE_OMP_MIN_ROW)")                                                    \
    {                                                                                                   \
        double rb[RMS_ROWS];                                                                            \
        _Pragma("omp for schedule(static)")                                                             \
        for (int64_t n0 = 0; n0 < N; n0 += RMS_ROWS) {                                                  \
            int64_t nr = N - n0 < RMS_ROWS ? N - n0 : RMS_ROWS;                                         \
            /* the rows' sums first, then their scales, then the outputs: each row's chain of dependent  \
               adds, divisions and square root overlaps the next rows' instead of stalling its own output */ \
            for (int64_t i = 0; i < nr; i++) {                                                          \
                const T *xr = x + (n0 + i) * C;                                                         \
                double ss = 0.0;                                                                        \
                _Pragma("omp simd reduction(+:ss)")                                                     \
                for (int64_t c = 0; c < C; c++) ss += (double)xr[c] * (double)xr[c];                    \
                rb[i] = ss;                                                                             \
            }                                                                                           \
            for (int64_t i = 0; i < nr; i++) {                                                          \
                rb[i] = 1.0 / sqrt((C > 0 ? rb[i] / (double)C : 0.0) + eps);                            \
                rstd[n0 + i] = (T)rb[i];                                                                \
            }                                                                                           \
            for (int64_t i = 0; i < nr; i++) {                                                          \
                const T *xr = x + (n0 + i) * C;                                                         \
                T *yr = out + (n0 + i) * C;                                                             \
                double r = rb[i];                                                                       \
                for (int64_t c = 0; c < C; c++)                                                         \
                    yr[c] = (T)((double)xr[c] * r * (w ? (double)w[c] : 1.0));                          \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
/* dx = r w⊙g − r³ x (Σ_j g_j w_j x_j) / C  with g = dout;   dw += Σ_n g x r */                        \
static void rmsnorm_backward_##SFX(T *dx, T *dw, double *dw_acc, const T *dout, const T *x,          \
                                   const T *w, const T *rstd, int64_t N, int64_t C)                   \
{                                                                                                       \
    if (dx) {                                                                                           \
        _Pragma("omp parallel if(N * C > TIDE_OMP_MIN_ROW)")                                                \
        {                                                                                               \
            double kb[RMS_ROWS];                                                                        \
            _Pragma("omp for schedule(static)")                                                         \
            for (int64_t n0 = 0; n0 < N; n0 += RMS_ROWS) {                                              \
                int64_t nr = N - n0 < RMS_ROWS ? N - n0 : RMS_ROWS;                                     \
                /* the rows' dot products first (their add chains overlap), then the outputs */         \
                for (int64_t i = 0; i < nr; i++) {                                                      \
                    const T *xr = x + (n0 + i) * C, *gr = dout + (n0 + i) * C;                          \
                    double r = (double)rstd[n0 + i], dot = 0.0;                                         \
                    _Pragma("omp simd reduction(+:dot)")                                                \
                    for (int64_t c = 0; c < C; c++)                                                     \
                        dot += (double)gr[c] * (w ? (double)w[c] : 1.0) * (double)xr[c];                \
                    kb[i] = C > 0 ? r * r * r * dot / (double)C : 0.0;                                  \
                }                                                                                       \
                for (int64_t i = 0; i < nr; i++) {                                                      \
                    const T *xr = x + (n0 + i) * C, *gr = dout + (n0 + i) * C;                          \
                    T *dr = dx + (n0 + i) * C;                                                          \
                    double r = (double)rstd[n0 + i], k = kb[i];                                         \
                    for (int64_t c = 0; c < C; c++)                                                     \
                        dr[c] = (T)(r * (double)gr[c] * (w ? (double)w[c] : 1.0) - k * (double)xr[c]);  \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    if (dw) {                                                                                           \
        _Pragma("omp parallel if(N * C > TIDE_OMP_MIN_ROW)")                                                \
        {                                                                                               \
            int64_t c0, c1;                                                                             \
            column_range(C, THREAD_ID(), THREAD_COUNT(), &c0, &c1);                                     \
            for (int64_t c = c0; c < c1; c++) dw_acc[c] = 0.0;                                          \
            for (int64_t n = 0; n < N; n++) {                                                           \
                const T *xr = x + n * C, *gr = dout + n * C;                                            \
                double r = (double)rstd[n];                                                             \
                for (int64_t c = c0; c < c1; c++) dw_acc[c] += (double)gr[c] * (double)xr[c] * r;       \
            }                                                                                           \
            for (int64_t c = c0; c < c1; c++) dw[c] = (T)((double)dw[c] + dw_acc[c]);                   \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_RMSNORM(float, f32)
DEFINE_RMSNORM(double, f64)

int tide_cpu_rmsnorm(int dtype, void *out, void *rstd, const void *x, const void *w, int64_t N, int64_t C,
                     double eps)
{
    if (N < 0 || C < 0) return tide_set_error("rmsnorm: negative size N=%lld C=%lld", (long long)N, (long long)C);
    switch (dtype) {
    case TIDE_F32: rmsnorm_f32(out, rstd, x, w, N, C, eps); return 0;
    case TIDE_F64: rmsnorm_f64(out, rstd, x, w, N, C, eps); return 0;
    default:
        return tide_set_error("rmsnorm: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    }
}

int tide_cpu_rmsnorm_backward(int dtype, void *dx, void *dw, const void *dout, const void *x, const void *w,
                              const void *rstd, int64_t N, int64_t C)
{
    if (N < 0 || C < 0)
        return tide_set_error("rmsnorm_backward: negative size N=%lld C=%lld", (long long)N, (long long)C);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("rmsnorm_backward: dtype %s not supported on cpu (expected f32 or f64)",
                              tide_cpu_dtype_str(dtype));
    double *acc = NULL;
    if (dw && C > 0) {
        acc = tide_cpu_malloc((size_t)C * sizeof(double));
        if (!acc)
            return tide_set_error("rmsnorm_backward: out of memory allocating %zu bytes",
                                  (size_t)C * sizeof(double));
    }
    if (dtype == TIDE_F32) rmsnorm_backward_f32(dx, dw, acc, dout, x, w, rstd, N, C);
    else rmsnorm_backward_f64(dx, dw, acc, dout, x, w, rstd, N, C);
    tide_cpu_free(acc);
    return 0;
}

/* ---- LayerNorm ---------------------------------------------------------------------------------- */

#define DEFINE_LAYERNORM(T, SFX)                                                                        \
static void layernorm_##SFX(T *out, T *mean, T *rstd, const T *x, const T *w, const T *b, int64_t N,   \
                            int64_t C, double eps)                                                      \
{                                                                                                       \
    _Pragma("omp parallel if(N * C > TIDE_OMP_MIN_ROW)")                                                \
    {                                                                                                   \
        double mb[RMS_ROWS], rb[RMS_ROWS];                                                              \
        _Pragma("omp for schedule(static)")                                                             \
        for (int64_t n0 = 0; n0 < N; n0 += RMS_ROWS) {                                                  \
            int64_t nr = N - n0 < RMS_ROWS ? N - n0 : RMS_ROWS;                                         \
            /* as RMSNorm's: the block's means, then its variances, then its scales, then the outputs, so \
               the rows' dependent chains overlap */                                                    \
            for (int64_t i = 0; i < nr; i++) {                                                          \
                const T *xr = x + (n0 + i) * C;                                                         \
                double s = 0.0;                                                                         \
                _Pragma("omp simd reduction(+:s)")                                                      \
                for (int64_t c = 0; c < C; c++) s += (double)xr[c];                                     \
                mb[i] = C > 0 ? s / (double)C : 0.0;                                                    \
            }                                                                                           \
            for (int64_t i = 0; i < nr; i++) {                                                          \
                const T *xr = x + (n0 + i) * C;                                                         \
                double mu = mb[i], v = 0.0;                                                             \
                /* two passes: the variance of (x − mean) does not cancel catastrophically */           \
                _Pragma("omp simd reduction(+:v)")                                                      \
                for (int64_t c = 0; c < C; c++) { double d = (double)xr[c] - mu; v += d * d; }          \
                rb[i] = v;                                                                              \
            }                                                                                           \
            for (int64_t i = 0; i < nr; i++) {                                                          \
                rb[i] = 1.0 / sqrt((C > 0 ? rb[i] / (double)C : 0.0) + eps);                            \
                mean[n0 + i] = (T)mb[i];                                                                \
                rstd[n0 + i] = (T)rb[i];                                                                \
            }                                                                                           \
            for (int64_t i = 0; i < nr; i++) {                                                          \
                const T *xr = x + (n0 + i) * C;                                                         \
                T *yr = out + (n0 + i) * C;                                                             \
                double mu = mb[i], r = rb[i];                                                           \
                for (int64_t c = 0; c < C; c++)                                                         \
                    yr[c] = (T)(((double)xr[c] - mu) * r * (w ? (double)w[c] : 1.0) + (b ? (double)b[c] : 0.0)); \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
/* x̂ = (x − μ) r, g = dout ⊙ w:  dx = r (g − mean(g) − x̂ mean(g x̂));  dw += Σ_n dout x̂;  db += Σ_n dout */\
static void layernorm_backward_##SFX(T *dx, T *dw, T *db, double *acc, const T *dout, const T *x,      \
                                     const T *w, const T *mean, const T *rstd, int64_t N, int64_t C)  \
{                                                                                                       \
    if (dx) {                                                                                           \
        _Pragma("omp parallel if(N * C > TIDE_OMP_MIN_ROW)")                                                \
        {                                                                                               \
            double gb[RMS_ROWS], gxb[RMS_ROWS];                                                         \
            _Pragma("omp for schedule(static)")                                                         \
            for (int64_t n0 = 0; n0 < N; n0 += RMS_ROWS) {                                              \
                int64_t nr = N - n0 < RMS_ROWS ? N - n0 : RMS_ROWS;                                     \
                /* the block's two sums per row first (their chains overlap), then the outputs */       \
                for (int64_t i = 0; i < nr; i++) {                                                      \
                    int64_t n = n0 + i;                                                                 \
                    const T *xr = x + n * C, *gr = dout + n * C;                                        \
                    double mu = (double)mean[n], r = (double)rstd[n], sg = 0.0, sgx = 0.0;              \
                    _Pragma("omp simd reduction(+:sg, sgx)")                                            \
                    for (int64_t c = 0; c < C; c++) {                                                   \
                        double g = (double)gr[c] * (w ? (double)w[c] : 1.0);                            \
                        sg += g;                                                                        \
                        sgx += g * ((double)xr[c] - mu) * r;                                            \
                    }                                                                                   \
                    gb[i] = C > 0 ? sg / (double)C : 0.0;                                               \
                    gxb[i] = C > 0 ? sgx / (double)C : 0.0;                                             \
                }                                                                                       \
                for (int64_t i = 0; i < nr; i++) {                                                      \
                    int64_t n = n0 + i;                                                                 \
                    const T *xr = x + n * C, *gr = dout + n * C;                                        \
                    T *dr = dx + n * C;                                                                 \
                    double mu = (double)mean[n], r = (double)rstd[n], mg = gb[i], mgx = gxb[i];         \
                    for (int64_t c = 0; c < C; c++) {                                                   \
                        double g = (double)gr[c] * (w ? (double)w[c] : 1.0);                            \
                        double xh = ((double)xr[c] - mu) * r;                                           \
                        dr[c] = (T)(r * (g - mg - xh * mgx));                                           \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    if (dw || db) {                                                                                     \
        double *aw = acc, *ab = acc + TIDE_CPU_PAD8(C);                                                                \
        _Pragma("omp parallel if(N * C > TIDE_OMP_MIN_ROW)")                                                \
        {                                                                                               \
            int64_t c0, c1;                                                                             \
            column_range(C, THREAD_ID(), THREAD_COUNT(), &c0, &c1);                                     \
            for (int64_t c = c0; c < c1; c++) aw[c] = ab[c] = 0.0;                                      \
            for (int64_t n = 0; n < N; n++) {                                                           \
                const T *xr = x + n * C, *gr = dout + n * C;                                            \
                double mu = (double)mean[n], r = (double)rstd[n];                                       \
                for (int64_t c = c0; c < c1; c++) {                                                     \
                    aw[c] += (double)gr[c] * ((double)xr[c] - mu) * r;                                  \
                    ab[c] += (double)gr[c];                                                             \
                }                                                                                       \
            }                                                                                           \
            for (int64_t c = c0; c < c1; c++) {                                                         \
                if (dw) dw[c] = (T)((double)dw[c] + aw[c]);                                             \
                if (db) db[c] = (T)((double)db[c] + ab[c]);                                             \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_LAYERNORM(float, f32)
DEFINE_LAYERNORM(double, f64)

int tide_cpu_layernorm(int dtype, void *out, void *mean, void *rstd, const void *x, const void *w, const void *b,
                       int64_t N, int64_t C, double eps)
{
    if (N < 0 || C < 0) return tide_set_error("layernorm: negative size N=%lld C=%lld", (long long)N, (long long)C);
    switch (dtype) {
    case TIDE_F32: layernorm_f32(out, mean, rstd, x, w, b, N, C, eps); return 0;
    case TIDE_F64: layernorm_f64(out, mean, rstd, x, w, b, N, C, eps); return 0;
    default:
        return tide_set_error("layernorm: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    }
}

int tide_cpu_layernorm_backward(int dtype, void *dx, void *dw, void *db, const void *dout, const void *x,
                                const void *w, const void *mean, const void *rstd, int64_t N, int64_t C)
{
    if (N < 0 || C < 0)
        return tide_set_error("layernorm_backward: negative size N=%lld C=%lld", (long long)N, (long long)C);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("layernorm_backward: dtype %s not supported on cpu (expected f32 or f64)",
                              tide_cpu_dtype_str(dtype));
    double *acc = NULL;
    if ((dw || db) && C > 0) {
        acc = tide_cpu_malloc(2 * (size_t)TIDE_CPU_PAD8(C) * sizeof(double));
        if (!acc)
            return tide_set_error("layernorm_backward: out of memory allocating %zu bytes",
                                  2 * (size_t)C * sizeof(double));
    }
    if (dtype == TIDE_F32) layernorm_backward_f32(dx, dw, db, acc, dout, x, w, mean, rstd, N, C);
    else layernorm_backward_f64(dx, dw, db, acc, dout, x, w, mean, rstd, N, C);
    tide_cpu_free(acc);
    return 0;
}

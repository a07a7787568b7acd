/*
 * softmax.c — softmax and log_softmax over the last dim of [N, C] (kernels/backend.h).
 *
 * Numerically stable: the row max is subtracted before exponentiating and the denominator is summed
 * in double. The backward is written from the forward output y, so nothing else is saved:
 *   softmax:      dx = y ⊙ (dy − Σ dy ⊙ y)
 *   log_softmax:  dx = dy − exp(y) Σ dy
 * Rows run in parallel when a call touches more than a quarter of TIDE_OMP_MIN_MATH elements (cpu.h): the sum
 * exponentiates one element after another (its order kept), about 10 ns an element.
 */
#include <math.h>
#include "cpu.h"
#include "fastmath.h"

/* the exponentials in double: f32 on exp_f64 (fastmath.h: within an ulp of libm's exp, so the float results are
   libm's but for a vanishing fraction; branch-free, so the row loops vectorise), f64 on libm */
#define SM_EXP_f32 exp_f64
#define SM_EXP_f64 exp

#define DEFINE_SOFTMAX(T, SFX)                                                                          \
static void softmax_##SFX(T *y, const T *x, int64_t N, int64_t C, int log_out)                         \
{                                                                                                       \
    _Pragma("omp parallel for if(N * C > TIDE_OMP_MIN_MATH / 4)")                                                       \
    for (int64_t n = 0; n < N; n++) {                                                                   \
        const T *xr = x + n * C;                                                                        \
        T *yr = y + n * C;                                                                              \
        double mx = (double)max_##SFX(xr, C, (T)-INFINITY);   /* fastmath.h: vector lanes, the same value */  \
        double sum = 0.0;                                                                               \
        for (int64_t c = 0; c < C; c++) sum += SM_EXP_##SFX((double)xr[c] - mx);                        \
        if (log_out) {                                                                                  \
            double lse = mx + log(sum);                                                                 \
            for (int64_t c = 0; c < C; c++) yr[c] = (T)((double)xr[c] - lse);                           \
        } else {                                                                                        \
            double inv = 1.0 / sum;                                                                     \
            for (int64_t c = 0; c < C; c++) yr[c] = (T)(SM_EXP_##SFX((double)xr[c] - mx) * inv);        \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
static void softmax_backward_##SFX(T *dx, const T *dy, const T *y, int64_t N, int64_t C, int log_out)  \
{                                                                                                       \
    _Pragma("omp parallel for if(N * C > TIDE_OMP_MIN_MATH / 4)")                                                       \
    for (int64_t n = 0; n < N; n++) {                                                                   \
        const T *gr = dy + n * C, *yr = y + n * C;                                                      \
        T *dr = dx + n * C;                                                                             \
        double s = 0.0;                                                                                 \
        if (log_out) {                                                                                  \
            for (int64_t c = 0; c < C; c++) s += (double)gr[c];                                         \
            for (int64_t c = 0; c < C; c++) dr[c] = (T)((double)gr[c] - SM_EXP_##SFX((double)yr[c]) * s); \
        } else {                                                                                        \
            for (int64_t c = 0; c < C; c++) s += (double)gr[c] * (double)yr[c];                         \
            for (int64_t c = 0; c < C; c++) dr[c] = (T)((double)yr[c] * ((double)gr[c] - s));           \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_SOFTMAX(float, f32)
DEFINE_SOFTMAX(double, f64)

int tide_cpu_softmax(int dtype, void *y, const void *x, int64_t N, int64_t C, int log)
{
    const char *op = log ? "log_softmax" : "softmax";
    if (N < 0 || C < 0) return tide_set_error("%s: negative size N=%lld C=%lld", op, (long long)N, (long long)C);
    switch (dtype) {
    case TIDE_F32: softmax_f32(y, x, N, C, log); return 0;
    case TIDE_F64: softmax_f64(y, x, N, C, log); return 0;
    default:
        return tide_set_error("%s: dtype %s not supported on cpu (expected f32 or f64)", op, tide_cpu_dtype_str(dtype));
    }
}

int tide_cpu_softmax_backward(int dtype, void *dx, const void *dy, const void *y, int64_t N, int64_t C, int log)
{
    const char *op = log ? "log_softmax_backward" : "softmax_backward";
    if (N < 0 || C < 0) return tide_set_error("%s: negative size N=%lld C=%lld", op, (long long)N, (long long)C);
    switch (dtype) {
    case TIDE_F32: softmax_backward_f32(dx, dy, y, N, C, log); return 0;
    case TIDE_F64: softmax_backward_f64(dx, dy, y, N, C, log); return 0;
    default:
        return tide_set_error("%s: dtype %s not supported on cpu (expected f32 or f64)", op, tide_cpu_dtype_str(dtype));
    }
}

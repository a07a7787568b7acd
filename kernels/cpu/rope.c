/*
 * rope.c — rotary position embedding on x [B, T, H, D] (kernels/backend.h).
 *
 * Pairs (i, i + D/2) for i < D/2 (the half-split layout) are rotated by the angle
 * (pos0 + t) · theta^(−2i/D):
 *   out[i]       = x[i] cos − x[i + D/2] sin
 *   out[i + D/2] = x[i] sin + x[i + D/2] cos
 * inverse = 1 rotates by the negative angle, which is the backward (a rotation's transpose).
 * Angles, cosines and sines are computed in double once per call into a [T, D/2] table; long
 * contexts need the double angle (pos ~ 1e5 times a frequency near 1 loses digits in float).
 * Each pair is read before either half is written, so out may alias x.
 */
#include <math.h>
#include <stdlib.h>
#include "cpu.h"

#define DEFINE_ROPE(T, SFX)                                                                             \
static void rope_##SFX(T *out, const T *x, const double *cs, int64_t B, int64_t T_, int64_t H,         \
                       int64_t D)                                                                       \
{                                                                                                       \
    int64_t half = D / 2, rows = B * T_ * H;                                                            \
    _Pragma("omp parallel for if(rows * D > TIDE_OMP_MIN_ROW)")                                                    \
    for (int64_t r = 0; r < rows; r++) {                                                                \
        int64_t t = (r / H) % T_;                                                                       \
        const double *cr = cs + t * 2 * half, *sr = cr + half;                                          \
        const T *xr = x + r * D;                                                                        \
        T *yr = out + r * D;                                                                            \
        for (int64_t i = 0; i < half; i++) {                                                            \
            double a = (double)xr[i], b = (double)xr[i + half];                                         \
            yr[i] = (T)(a * cr[i] - b * sr[i]);                                                         \
            yr[i + half] = (T)(a * sr[i] + b * cr[i]);                                                  \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_ROPE(float, f32)
DEFINE_ROPE(double, f64)

int tide_cpu_rope(int dtype, void *out, const void *x, int64_t B, int64_t T, int64_t H, int64_t D, double theta,
                  int64_t pos0, int inverse)
{
    if (B < 0 || T < 0 || H < 0 || D < 0)
        return tide_set_error("rope: negative size B=%lld T=%lld H=%lld D=%lld", (long long)B, (long long)T,
                              (long long)H, (long long)D);
    if (D % 2 != 0) return tide_set_error("rope: head dim D=%lld must be even", (long long)D);
    if (!(theta > 0.0)) return tide_set_error("rope: theta must be positive, got %g", theta);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("rope: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    int64_t half = D / 2;
    if (B * T * H * D == 0) return 0;

    /* table row t: cos[0..half) then sin[0..half) for position pos0 + t */
    size_t nbytes = (size_t)T * 2 * (size_t)half * sizeof(double);
    double *cs = malloc(nbytes);
    if (!cs) return tide_set_error("rope: out of memory allocating %zu bytes for the angle table", nbytes);
    double sign = inverse ? -1.0 : 1.0;
    for (int64_t i = 0; i < half; i++) {
        double freq = pow(theta, -2.0 * (double)i / (double)D);
        for (int64_t t = 0; t < T; t++) {
            double angle = sign * (double)(pos0 + t) * freq;
            cs[t * 2 * half + i] = cos(angle);
            cs[t * 2 * half + half + i] = sin(angle);
        }
    }
    if (dtype == TIDE_F32) rope_f32(out, x, cs, B, T, H, D);
    else rope_f64(out, x, cs, B, T, H, D);
    free(cs);
    return 0;
}

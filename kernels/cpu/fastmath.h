/*
 * fastmath.h — small inline float math for the CPU kernels, branch-free so that loops calling it vectorise:
 * exp_f32, sigmoid_f32, tanh_f32 (accuracy held by tests/c/test_fastmath.c).
 */
#ifndef TIDE_CPU_FASTMATH_H
#define TIDE_CPU_FASTMATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp for float, written so that loops calling it vectorise (libm's expf is a call per element: it was a
   seventh of the KDA chunk path's time): exp(x) = 2^n · e^r with n = round(x / ln 2), r = x − n ln 2 in
   [−ln2/2, ln2/2] (ln 2 split in two parts), e^r by its degree-6 Taylor polynomial (truncation
   r⁷/7! < 1.2e-7 relative: about one float ulp; tests/c/test_fastmath.c holds it to 3 ulp). 2^n is applied in
   two halves so that n = 128 (x up to ln FLT_MAX = 88.72) stays finite; above that the product overflows to +inf.
   x < −87 gives 0 (the true value is subnormal there: below 1.7e-38 absolute), NaN stays NaN. A loop of it
   vectorises under GCC only with -fno-trapping-math (see the pragma in the files that use it). */
static inline float exp_f32(float x)
{
    float xc = x < -87.0f ? -87.0f : x;
    xc = xc > 89.0f ? 89.0f : xc;
    float n = rintf(xc * 1.44269504f);
    float r = xc - n * 0.693145752f;
    r = r - n * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f + r * 0.00138888892f)))));
    int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
    int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    float y = p * s1 * s2;
    return x < -87.0f ? 0.0f : y;
}

/* sigmoid(x) from e = exp(−|x|) (never overflows): 1/(1 + e) for x >= 0, e/(1 + e) below; relative error a few
   float ulps everywhere; NaN stays NaN */
static inline float sigmoid_f32(float x)
{
    float e = exp_f32(-fabsf(x));
    float s = 1.0f / (1.0f + e);
    return x >= 0.0f ? s : e * s;
}

/* tanh: Cephes' tanhf, branch-free: below |x| = 0.625 its odd polynomial x + x³ P(x²) (no cancellation near 0),
   above 1 − 2/(e^{2|x|} + 1) with the sign of x (e^{2|x|} = inf gives ±1); ±0 stays ±0, NaN stays NaN */
static inline float tanh_f32(float x)
{
    float ax = fabsf(x), z = x * x;
    float small = x + x * z * ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                                1.33314422036e-1f) * z - 3.33332819422e-1f);
    float big = 1.0f - 2.0f / (exp_f32(2.0f * ax) + 1.0f);
    big = x < 0.0f ? -big : big;
    return ax < 0.625f ? small : big;
}

#endif

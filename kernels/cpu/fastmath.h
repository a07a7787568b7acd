/*
 * fastmath.h — small inline math for the fused CPU kernels.
 */
#ifndef TIDE_CPU_FASTMATH_H
#define TIDE_CPU_FASTMATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp for float, written so that loops calling it vectorise (libm's expf is a call per element; it was a
   seventh of the KDA chunk path's time): exp(x) = 2^n · e^r with n = round(x / ln 2), r = x − n ln 2 in
   [−ln2/2, ln2/2] (ln 2 split in two parts), e^r by its degree-6 Taylor polynomial (truncation
   r⁷/7! < 1.2e-7 relative: about one float ulp). x > 88.72 gives +inf, x < −87 gives 0 (the true value
   is subnormal there: below 1.7e-38 absolute), NaN stays NaN. */
static inline float exp_f32(float x)
{
    float xc = x < -87.0f ? -87.0f : x;
    xc = xc > 88.0f ? 88.0f : xc;
    float n = rintf(xc * 1.44269504f);
    float r = xc - n * 0.693145752f;
    r = r - n * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f + r * 0.00138888892f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    float y = p * two_n;
    y = x < -87.0f ? 0.0f : y;
    return x > 88.72f ? INFINITY : y;
}

#endif

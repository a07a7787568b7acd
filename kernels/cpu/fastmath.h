/*
 * fastmath.h — small inline math for the fused CPU kernels.
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

#endif

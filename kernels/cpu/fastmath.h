/*
 * fastmath.h — small inline float math for the CPU kernels, branch-free so that loops calling it vectorise:
 * exp_f32, sigmoid_f32, tanh_f32, softplus_f32, and exp_f64 for the double arithmetic of float kernels (accuracy
 * held by tests/c/test_fastmath.c); max_f32 / max_f64, the row maxima of the softmax-like kernels.
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
    /* NaN: n is NaN, and converting it to an integer is undefined; any n will do (p is NaN), so take 0 */
    int32_t ni = (int32_t)(n == n ? n : 0.0f), n1 = ni / 2, n2 = ni - n1;
    uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
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

/* log(1 + e) for e in [0, 1] (the softplus tail): u = 1 + e = m 2^k, m in [sqrt(1/2), sqrt(2)), log m =
   2 atanh(s) = 2 (s + s³/3 + ... + s⁹/9), s = (m − 1)/(m + 1), |s| <= 0.172 (truncation < 4e-10 relative); then
   Goldberg's correction log(u) · e/(u − 1) restores what rounding 1 + e lost (u = 1 returns e). NaN stays NaN. */
static inline float log1p_unit_f32(float e)
{
    float u = 1.0f + e;
    int32_t bits;
    memcpy(&bits, &u, sizeof bits);
    int32_t k = ((bits >> 23) & 0xff) - 127;
    int32_t mbits = (bits & 0x007fffff) | 0x3f800000;   /* m in [1, 2) */
    float m;
    memcpy(&m, &mbits, sizeof m);
    float big = m > 1.41421356f ? 1.0f : 0.0f;           /* fold m into [sqrt(1/2), sqrt(2)) */
    m = big > 0.0f ? 0.5f * m : m;
    float kf = (float)k + big;
    float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    float lm = 2.0f * s * (1.0f + s2 * (0.333333333f + s2 * (0.2f + s2 * (0.142857143f + s2 * 0.111111111f))));
    float lu = kf * 0.693147181f + lm;
    float d = u - 1.0f;
    return d == 0.0f ? e : lu * (e / d);
}

/* softplus(x) = max(x, 0) + log(1 + exp(−|x|)): never exponentiates a large positive number */
static inline float softplus_f32(float x)
{
    float t = log1p_unit_f32(exp_f32(-fabsf(x)));
    return (x > 0.0f ? x : 0.0f) + t;
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

/* exp for double, vectorising: exp(x) = 2^n · e^r with n = round(x / ln 2), r = x − n ln 2 in [−ln2/2, ln2/2]
   (ln 2 in two parts: n·ln2_hi is exact for |n| < 2^21), e^r by its degree-13 Taylor polynomial (truncation
   r^14/14! < 4e-18 relative), 2^n in two halves so n = 1024 stays finite. Within 1 ulp of libm's exp on
   [−708, 709.7] (tests/c/test_fastmath.c), so a float kernel that computes in double and rounds once to float
   gets libm's float result in all but a vanishing fraction of cases; it replaces the libm call per element
   that kept those loops scalar. x < −708 gives 0 (the true value is below 3.3e-308: subnormal), x > 709.78
   gives +inf, NaN stays NaN. Vectorises under GCC only with -fno-trapping-math (the files' pragma). */
static inline double exp_f64(double x)
{
    double xc = x < -708.0 ? -708.0 : x;
    xc = xc > 710.0 ? 710.0 : xc;
    double n = rint(xc * 1.4426950408889634074);
    double r = xc - n * 6.93147180369123816490e-01;
    r = r - n * 1.90821492927058770002e-10;
    double p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6 + r * (1.0 / 24 + r * (1.0 / 120 + r * (1.0 / 720 +
               r * (1.0 / 5040 + r * (1.0 / 40320 + r * (1.0 / 362880 + r * (1.0 / 3628800 + r * (1.0 / 39916800 +
               r * (1.0 / 479001600 + r * (1.0 / 6227020800.0)))))))))))));
    int64_t ni = (int64_t)(n == n ? n : 0.0), n1 = ni / 2, n2 = ni - n1;
    uint64_t b1 = (uint64_t)(n1 + 1023) << 52, b2 = (uint64_t)(n2 + 1023) << 52;
    double s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    double y = p * s1 * s2;
    return x < -708.0 ? 0.0 : y;
}

/* the logistic function in double on exp_f64 (never exponentiates a large positive number) */
static inline double sigmoid_f64x(double x)
{
    double e = exp_f64(-fabs(x)), s = 1.0 / (1.0 + e);
    return x >= 0.0 ? s : e * s;
}

/* max(m, x[0 .. n)) with the value the sequential "x > m ? x : m" finds (a NaN in x is never taken; a NaN m stays),
   as 64-byte vectors of lanes that are then folded pairwise (a tree of depth log2 N, not a chain of N dependent
   selects: a row of 64 scores had waited on the chain): max is associative over the values that compare, so the
   result is the same number (of two equal zeros the sign may differ, which no caller can see through x − m).
   GCC keeps the plain lane-array form of this loop scalar (16 dependent selects per 16 elements, most of the
   cross-entropy forward's time at V = 50K); the vector extension's compare-and-select compiles to one vector
   compare and blend per 64 bytes under GCC and clang alike. */
#define TIDE_MAX_VEC(T, I, N, SFX)                                                                            \
    static inline T max_##SFX(const T *x, int64_t n, T m)                                                     \
    {                                                                                                         \
        typedef T vT __attribute__((vector_size(64)));                                                        \
        typedef I vI __attribute__((vector_size(64)));                                                        \
        int64_t j = 0;                                                                                        \
        if (n >= N) {                                                                                         \
            vT lane = (vT){0} + m;                                                                            \
            for (; j + N <= n; j += N) {                                                                      \
                vT v;                                                                                         \
                memcpy(&v, x + j, sizeof v);                                                                  \
                vI c = v > lane;                                                                              \
                lane = (vT)((c & (vI)v) | (~c & (vI)lane));                                                   \
            }                                                                                                 \
            T l[N];                                                                                           \
            memcpy(l, &lane, sizeof l);                                                                       \
            for (int w = N / 2; w >= 1; w /= 2)                                                               \
                for (int i = 0; i < w; i++) l[i] = l[i + w] > l[i] ? l[i + w] : l[i];                         \
            m = l[0] > m ? l[0] : m;                                                                          \
        }                                                                                                     \
        for (; j < n; j++) m = x[j] > m ? x[j] : m;                                                           \
        return m;                                                                                             \
    }
TIDE_MAX_VEC(float, int32_t, 16, f32)
TIDE_MAX_VEC(double, int64_t, 8, f64)
#undef TIDE_MAX_VEC

#endif

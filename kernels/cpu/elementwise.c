/*
 * elementwise.c — CPU elementwise kernels: fill, strided copy with dtype conversion, Philox random
 * numbers, unary ops and their backward, broadcasting binary ops, SwiGLU and axpy (kernels/backend.h
 * documents each entry).
 *
 * Float kernels are written once over a type T (float or double) with <tgmath.h>, so exp(x) is expf
 * for float and exp for double; constants are cast to T so float code stays in float.
 */
/* GCC keeps a loop with a float compare-and-select scalar under -ftrapping-math (the default), so exp_f32 and the
   activations built on it would not vectorise; tide never reads the floating-point exception flags. 512-bit vectors
   where AVX-512 exists (GCC prefers 256; every loop here is element by element, so the same bits) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#if defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#endif
#include <string.h>
#include <tgmath.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "cpu.h"
#include "fastmath.h"
#include "../philox.h"

/* below these element counts a parallel region costs more than it saves */
#define PAR_CHEAP 32768     /* a few flops per element */
#define PAR_MATH 4096       /* transcendental functions, Philox */

/* for (i < n) body, threaded when n is large; the loop bound must be a variable named n */
#define EW_CHEAP(body)                                                                             \
    _Pragma("omp parallel for if(n > PAR_CHEAP) schedule(static)")                                 \
    for (int64_t i = 0; i < n; i++) { body; }
#define EW_MATH(body)                                                                              \
    _Pragma("omp parallel for if(n > PAR_MATH) schedule(static)")                                  \
    for (int64_t i = 0; i < n; i++) { body; }

static int is_float_dtype(int dtype)
{
    return dtype == TIDE_F32 || dtype == TIDE_F64;
}

/* ---- bf16: the upper half of an IEEE float32 ------------------------------------------------------ */

/* round to nearest, ties to even; NaN stays a (quiet) NaN instead of rounding into infinity */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- scalar conversions (float -> int rounds toward zero, saturating; NaN -> 0) -------------------- */

static inline int64_t f64_to_i64_sat(double v)
{
    if (v != v) return 0;
    if (v >= 9223372036854775807.0) return INT64_MAX;
    if (v <= -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v;
}

static inline int32_t f64_to_i32_sat(double v)
{
    if (v != v) return 0;
    if (v >= 2147483647.0) return INT32_MAX;
    if (v <= -2147483648.0) return INT32_MIN;
    return (int32_t)v;
}

static inline uint8_t f64_to_u8_sat(double v)
{
    if (v != v || v <= 0.0) return 0;
    if (v >= 255.0) return 255;
    return (uint8_t)v;
}

static inline double load_f64(const void *p, int dtype, int64_t i)
{
    switch (dtype) {
    case TIDE_F32: return ((const float *)p)[i];
    case TIDE_F64: return ((const double *)p)[i];
    case TIDE_BF16: return tide_cpu_bf16_to_f32(((const uint16_t *)p)[i]);
    case TIDE_I32: return ((const int32_t *)p)[i];
    case TIDE_I64: return (double)((const int64_t *)p)[i];
    default: return ((const uint8_t *)p)[i];
    }
}

static inline void store_f64(void *p, int dtype, int64_t i, double v)
{
    switch (dtype) {
    case TIDE_F32: ((float *)p)[i] = (float)v; break;
    case TIDE_F64: ((double *)p)[i] = v; break;
    case TIDE_BF16: ((uint16_t *)p)[i] = f32_to_bf16((float)v); break;
    case TIDE_I32: ((int32_t *)p)[i] = f64_to_i32_sat(v); break;
    case TIDE_I64: ((int64_t *)p)[i] = f64_to_i64_sat(v); break;
    default: ((uint8_t *)p)[i] = f64_to_u8_sat(v); break;
    }
}

/* integer to integer keeps exact 64-bit values (a double would round above 2^53); narrowing wraps */
static inline int64_t load_i64(const void *p, int dtype, int64_t i)
{
    switch (dtype) {
    case TIDE_I32: return ((const int32_t *)p)[i];
    case TIDE_I64: return ((const int64_t *)p)[i];
    default: return ((const uint8_t *)p)[i];
    }
}

static inline void store_i64(void *p, int dtype, int64_t i, int64_t v)
{
    switch (dtype) {
    case TIDE_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case TIDE_I64: ((int64_t *)p)[i] = v; break;
    default: ((uint8_t *)p)[i] = (uint8_t)v; break;
    }
}

static int is_int_dtype(int dtype)
{
    return dtype == TIDE_I32 || dtype == TIDE_I64 || dtype == TIDE_U8;
}

/* ---- fill ------------------------------------------------------------------------------------------ */

/* Zeroing a region larger than the caches with ordinary stores reads every line before it writes it (the read for
   ownership): 206 MB took 20.7 ms on 2 cores against 5.0 ms with non-temporal stores, which write whole lines
   without reading them. Below TIDE_CPU_ZERO_STREAM_MIN the lines are worth keeping in cache for the next reader,
   and memset serves. */
#define ZERO_STREAM_BLOCK ((size_t)256 << 10)

static void zero_stream(char *p, size_t n)
{
#if defined(__AVX512F__) || defined(__AVX2__)
    size_t head = (size_t)(-(uintptr_t)p & 63);
    if (head > n) head = n;
    memset(p, 0, head);
    p += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
#if defined(__AVX512F__)
        _mm512_stream_si512((void *)(p + i), _mm512_setzero_si512());
#else
        _mm256_stream_si256((__m256i *)(p + i), _mm256_setzero_si256());
        _mm256_stream_si256((__m256i *)(p + i) + 1, _mm256_setzero_si256());
#endif
    }
    memset(p + body, 0, n - body);
#else
    memset(p, 0, n);
#endif
}

/* the streamed lines are ordered before the region's end (a later reader on another thread sees zeros) */
static void zero_stream_fence(void)
{
#if defined(__AVX512F__) || defined(__AVX2__)
    _mm_sfence();
#endif
}

void tide_cpu_copy_stream(void *dst, const void *src, size_t n)
{
    char *d = dst;
    const char *s = src;
#if defined(__AVX512F__) || defined(__AVX2__)
    size_t head = (size_t)(-(uintptr_t)d & 63);
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) tide_cpu_stream_line(d + i, s + i);
    memcpy(d + body, s + body, n - body);
    _mm_sfence();
#else
    memcpy(d, s, n);
#endif
}

void tide_cpu_zero_rows(void *p, int64_t M, size_t row_bytes, size_t ld_bytes)
{
    char *c = p;
    size_t total = (size_t)M * row_bytes;
    if (M <= 0 || row_bytes == 0) return;
    int contiguous = ld_bytes == row_bytes;
    if (total < TIDE_CPU_ZERO_STREAM_MIN) {
        if (contiguous) memset(c, 0, total);
        else for (int64_t i = 0; i < M; i++) memset(c + (size_t)i * ld_bytes, 0, row_bytes);
        return;
    }
    /* the items: blocks of one contiguous region, else the rows */
    int64_t items = contiguous ? (int64_t)((total + ZERO_STREAM_BLOCK - 1) / ZERO_STREAM_BLOCK) : M;
    _Pragma("omp parallel")
    {
        _Pragma("omp for schedule(static)")
        for (int64_t it = 0; it < items; it++) {
            size_t off = contiguous ? (size_t)it * ZERO_STREAM_BLOCK : (size_t)it * ld_bytes;
            size_t len = !contiguous ? row_bytes : total - off < ZERO_STREAM_BLOCK ? total - off : ZERO_STREAM_BLOCK;
            zero_stream(c + off, len);
        }
        zero_stream_fence();
    }
}

int tide_cpu_fill(void *out, int dtype, int64_t n, double value)
{
    if (n < 0) return tide_set_error("fill: n = %lld must be >= 0", (long long)n);
    size_t bytes = (size_t)n * tide_dtype_size(dtype);
    if (value == 0.0 && !signbit(value) && bytes >= TIDE_CPU_ZERO_STREAM_MIN) {
        tide_cpu_zero_rows(out, 1, bytes, bytes);     /* every dtype's +0 is all zero bits */
        return 0;
    }
    switch (dtype) {
    case TIDE_F32: { float *o = out; float v = (float)value; EW_CHEAP(o[i] = v); break; }
    case TIDE_F64: { double *o = out; EW_CHEAP(o[i] = value); break; }
    case TIDE_BF16: { uint16_t *o = out; uint16_t v = f32_to_bf16((float)value); EW_CHEAP(o[i] = v); break; }
    case TIDE_I32: { int32_t *o = out; int32_t v = f64_to_i32_sat(value); EW_CHEAP(o[i] = v); break; }
    case TIDE_I64: { int64_t *o = out; int64_t v = f64_to_i64_sat(value); EW_CHEAP(o[i] = v); break; }
    case TIDE_U8: memset(out, f64_to_u8_sat(value), (size_t)n); break;
    default: return tide_set_error("fill: dtype %d is not a tide dtype", dtype);
    }
    return 0;
}

/* ---- copy ------------------------------------------------------------------------------------------ */

#define COPY_BLOCK 8192

/* one strided row of n elements: out[i*os] = convert(x[i*xs]) */
static void copy_row(void *out, int odt, int64_t os, const void *x, int xdt, int64_t xs, int64_t n)
{
    /* same dtype: move elements as raw words of their size */
#define MOVE_ROW(W)                                                                             \
    do {                                                                                        \
        W *o = out;                                                                             \
        const W *s = x;                                                                         \
        for (int64_t i = 0; i < n; i++) o[i * os] = s[i * xs];                                  \
    } while (0)
    if (odt == xdt) {
        switch (tide_dtype_size(odt)) {
        case 1: MOVE_ROW(uint8_t); return;
        case 2: MOVE_ROW(uint16_t); return;
        case 4: MOVE_ROW(uint32_t); return;
        default: MOVE_ROW(uint64_t); return;
        }
    }
#undef MOVE_ROW
    /* the conversions training actually does (mixed precision, checkpoints) get a direct loop */
    if (odt == TIDE_F32 && xdt == TIDE_BF16) {
        float *o = out; const uint16_t *s = x;
        for (int64_t i = 0; i < n; i++) o[i * os] = tide_cpu_bf16_to_f32(s[i * xs]);
    } else if (odt == TIDE_BF16 && xdt == TIDE_F32) {
        uint16_t *o = out; const float *s = x;
        for (int64_t i = 0; i < n; i++) o[i * os] = f32_to_bf16(s[i * xs]);
    } else if (odt == TIDE_F32 && xdt == TIDE_F64) {
        float *o = out; const double *s = x;
        for (int64_t i = 0; i < n; i++) o[i * os] = (float)s[i * xs];
    } else if (odt == TIDE_F64 && xdt == TIDE_F32) {
        double *o = out; const float *s = x;
        for (int64_t i = 0; i < n; i++) o[i * os] = s[i * xs];
    } else if (is_int_dtype(odt) && is_int_dtype(xdt)) {
        for (int64_t i = 0; i < n; i++) store_i64(out, odt, i * os, load_i64(x, xdt, i * xs));
    } else {
        for (int64_t i = 0; i < n; i++) store_f64(out, odt, i * os, load_f64(x, xdt, i * xs));
    }
}

int tide_cpu_copy(void *out, int odtype, const int64_t *ostride, const void *x, int xdtype,
                  const int64_t *xstride, int ndim, const int64_t *shape)
{
    if (odtype < 0 || odtype >= TIDE_DTYPE_COUNT || xdtype < 0 || xdtype >= TIDE_DTYPE_COUNT)
        return tide_set_error("copy: dtypes %d -> %d are not tide dtypes", xdtype, odtype);
    if (ndim < 0 || ndim > 8) return tide_set_error("copy: ndim = %d, expected 0..8", ndim);

    /* drop size-1 dims and merge dims that are contiguous in both buffers: fewer, longer rows */
    int64_t sh[8], os[8], xs[8];
    int d = 0;
    for (int k = 0; k < ndim; k++) {
        if (shape[k] < 0) return tide_set_error("copy: shape[%d] = %lld is negative", k, (long long)shape[k]);
        if (shape[k] == 0) return 0;
        if (shape[k] == 1) continue;
        if (d > 0 && os[d - 1] == ostride[k] * shape[k] && xs[d - 1] == xstride[k] * shape[k]) {
            sh[d - 1] *= shape[k];
            os[d - 1] = ostride[k];
            xs[d - 1] = xstride[k];
            continue;
        }
        sh[d] = shape[k]; os[d] = ostride[k]; xs[d] = xstride[k];
        d++;
    }
    if (d == 0) { sh[0] = 1; os[0] = 1; xs[0] = 1; d = 1; }

    int64_t inner = sh[d - 1], rows = 1;
    for (int k = 0; k < d - 1; k++) rows *= sh[k];

    if (d == 1 && os[0] == 1 && xs[0] == 1 && odtype == xdtype) {
        memcpy(out, x, (size_t)inner * tide_dtype_size(odtype));
        return 0;
    }

    /* work items are (row, block of the row), so one long row is shared by the threads too */
    int64_t nblk = (inner + COPY_BLOCK - 1) / COPY_BLOCK;
    int64_t osz = (int64_t)tide_dtype_size(odtype), xsz = (int64_t)tide_dtype_size(xdtype);
    #pragma omp parallel for if(rows * inner > PAR_CHEAP) schedule(static)
    for (int64_t w = 0; w < rows * nblk; w++) {
        int64_t r = w / nblk, i0 = (w % nblk) * COPY_BLOCK;
        int64_t len = inner - i0 < COPY_BLOCK ? inner - i0 : COPY_BLOCK;
        int64_t rem = r, ooff = i0 * os[d - 1], xoff = i0 * xs[d - 1];
        for (int k = d - 2; k >= 0; k--) {
            int64_t j = rem % sh[k];
            rem /= sh[k];
            ooff += j * os[k];
            xoff += j * xs[k];
        }
        copy_row((char *)out + ooff * osz, odtype, os[d - 1], (const char *)x + xoff * xsz, xdtype,
                 xs[d - 1], len);
    }
    return 0;
}

/* ---- random numbers (Philox, kernels/philox.h): element i uses counter offset + i ------------------ */

/* out[i] = value(i) for the three float dtypes; value is a double expression in i */
#define RANDOM_FILL(what, value)                                                                \
    switch (dtype) {                                                                            \
    case TIDE_F32: { float *o = out; EW_MATH(o[i] = (float)(value)); break; }                   \
    case TIDE_F64: { double *o = out; EW_MATH(o[i] = (value)); break; }                         \
    case TIDE_BF16: { uint16_t *o = out; EW_MATH(o[i] = f32_to_bf16((float)(value))); break; }  \
    default:                                                                                    \
        return tide_set_error(what ": dtype %s not supported on cpu (expected f32, f64 or bf16)", \
                              tide_cpu_dtype_str(dtype));                                                   \
    }

int tide_cpu_randn(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b)
{
    RANDOM_FILL("randn", a + b * tide_philox_normal_at(seed, offset + (uint64_t)i))
    return 0;
}

int tide_cpu_rand(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b)
{
    double w = b - a;
    RANDOM_FILL("rand", a + w * tide_philox_uniform_at(seed, offset + (uint64_t)i))
    return 0;
}

/* ---- scalar functions, once per type ---------------------------------------------------------------- */

/* The float activations the models run every step (GELU tanh and erf, tanh, sigmoid, hence SiLU and SwiGLU) are written
   branch-free on exp_f32 so that their loops vectorise (libm's expf/tanhf/erff are a call per element: GELU was
   3.5x and GELU-erf 8x PyTorch's time in bench/vision); tanh_f32 and sigmoid_f32 are in fastmath.h (the MoE
   SiTU-GLU uses them too); their accuracy is checked against double references in tests/c/test_fastmath.c.
   Double stays on libm (the float64 gradient checks of test-ops). */

/* GELU tanh as x·sigmoid(2u) (= 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x³)): no cancellation in
   1 + tanh u for negative x. Below x = −10.04 (where exp(−2u) would pass FLT_MAX) the value is under 4e-38 and
   returned as −0 (also for −inf, where the product would be −inf·0); above x = 10, sigmoid(2u) is 1 in float. */
#define GELU_K0 0.7978845608028654f
#define GELU_K1 0.044715f
static inline float gelu_fast_float(float x)
{
    float u = GELU_K0 * (x + GELU_K1 * x * x * x);
    float s = 1.0f / (1.0f + exp_f32(-2.0f * u));
    return x < -10.04f ? -0.0f : x * s;
}

/* d/dx x·s(2u) = s + 2 x u' s (1 − s), with 1 − s = e s (e = exp(−2u)); 0 below −10.04 (true value under 1e-35), 1
   above 10 (where x u' could overflow and meet 1 − s = 0) */
static inline float gelu_grad_fast_float(float x)
{
    float u = GELU_K0 * (x + GELU_K1 * x * x * x);
    float du = GELU_K0 * (1.0f + 3.0f * GELU_K1 * x * x);
    float e = exp_f32(-2.0f * u);
    float s = 1.0f / (1.0f + e);
    float g = s + 2.0f * x * du * (e * s) * s;
    g = x < -10.04f ? 0.0f : g;
    return x > 10.0f ? 1.0f : g;
}

/* Φ(x) = 0.5 erfc(−x/√2) through erfc(z) = t exp(−z²) exp(P(t)), t = 1/(1 + z/2), z = |x|/√2 >= 0 (the
   Chebyshev fit of Numerical Recipes' erfcc, relative error under 1.2e-7 for every z >= 0), so both tails keep
   their relative accuracy; exp(−z²) = exp(−x²/2) from x² split exactly in two floats by an fma (a rounded z²
   would cost ulp(z²) of relative accuracy: 60 ulp at x = −13). *phi = φ(x) = exp(−x²/2)/√(2π), for the
   gradient. */
static inline float normal_cdf_fast_float(float x, float *phi)
{
    float z = fabsf(x) * 0.70710678118654752f;
    float t = 1.0f / (1.0f + 0.5f * z);
    float p = -1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f + t * (-0.18628806f +
              t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f))))))));
    float x2 = x * x, x2_lo = fmaf(x, x, -x2);
    float g = exp_f32(-0.5f * x2) * (1.0f - 0.5f * x2_lo);
    g = x2 > 200.0f ? 0.0f : g;   /* x2_lo is ±inf once x² overflows */
    float half_erfc = (0.5f * t * exp_f32(p)) * g;   /* one rounding when the product is subnormal */
    *phi = 0.39894228040143267794f * g;
    return x >= 0.0f ? 1.0f - half_erfc : half_erfc;
}

/* −0 below x = −14 (Φ(−14) < 1e-44; −inf·0 would be NaN) */
static inline float gelu_erf_fast_float(float x)
{
    float phi;
    float y = x * normal_cdf_fast_float(x, &phi);
    return x < -14.0f ? -0.0f : y;
}

/* Φ(x) + x φ(x); x φ(x) is dropped past |x| = 16, where φ is 0 in float and x may be infinite */
static inline float gelu_erf_grad_fast_float(float x)
{
    float phi;
    float cdf = normal_cdf_fast_float(x, &phi);
    return cdf + (fabsf(x) > 16.0f ? 0.0f : x * phi);
}

/* double: libm */
static inline double sigmoid_double(double x)
{
    if (x >= 0.0) return 1.0 / (1.0 + exp(-x));   /* never exponentiates a large positive number */
    double z = exp(x);
    return z / (1.0 + z);
}
/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
static inline double gelu_double(double x)
{
    double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    return 0.5 * x * (1.0 + tanh(u));
}
static inline double gelu_grad_double(double x)
{
    double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    double t = tanh(u);
    double du = 0.7978845608028654 * (1.0 + 0.134145 * x * x);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
}
/* the exact GELU 0.5 x (1 + erf(x / sqrt 2)); its derivative Φ(x) + x φ(x) */
static inline double gelu_erf_double(double x) { return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440)); }
static inline double gelu_erf_grad_double(double x)
{
    double cdf = 0.5 * (1.0 + erf(x * 0.70710678118654752440));
    return cdf + x * 0.39894228040143267794 * exp(-0.5 * x * x);
}

/* float: the vectorising forms above; exp as the float of exp_f64 (fastmath.h): libm's expf result, vectorised */
static inline float exp_float(float x) { return (float)exp_f64((double)x); }
static inline double exp_double(double x) { return exp(x); }
static inline float tanh_float(float x) { return tanh_f32(x); }
static inline double tanh_double(double x) { return tanh(x); }
static inline float sigmoid_float(float x) { return sigmoid_f32(x); }
static inline float softplus_float(float x) { return softplus_f32(x); }
/* never exponentiates a large positive number, so no overflow to inf/inf */
static inline double softplus_double(double x) { return fmax(x, 0.0) + log1p(exp(-fabs(x))); }
static inline float gelu_float(float x) { return gelu_fast_float(x); }
static inline float gelu_grad_float(float x) { return gelu_grad_fast_float(x); }
static inline float gelu_erf_float(float x) { return gelu_erf_fast_float(x); }
static inline float gelu_erf_grad_float(float x) { return gelu_erf_grad_fast_float(x); }

#define SCALAR_FUNCS(T)                                                                            \
    /* silu'(x) = s (1 + x (1 - s)), s = sigmoid(x) */                                             \
    static inline T silu_grad_##T(T x)                                                             \
    {                                                                                              \
        T s = sigmoid_##T(x);                                                                      \
        return s * ((T)1 + x * ((T)1 - s));                                                        \
    }

SCALAR_FUNCS(float)
SCALAR_FUNCS(double)

/* ---- unary ------------------------------------------------------------------------------------------ */

#define UNARY_FORWARD(T)                                                                           \
    static void unary_##T(int op, T *y, const T *x, int64_t n, T p)                                \
    {                                                                                              \
        switch (op) {                                                                              \
        case TIDE_UN_NEG: EW_CHEAP(y[i] = -x[i]); break;                                           \
        case TIDE_UN_EXP: EW_MATH(y[i] = exp_##T(x[i])); break;                                    \
        case TIDE_UN_LOG: EW_MATH(y[i] = log(x[i])); break;                                        \
        case TIDE_UN_SQRT: EW_CHEAP(y[i] = sqrt(x[i])); break;                                     \
        case TIDE_UN_RSQRT: EW_CHEAP(y[i] = (T)1 / sqrt(x[i])); break;                             \
        case TIDE_UN_TANH: EW_MATH(y[i] = tanh_##T(x[i])); break;                                  \
        case TIDE_UN_SIGMOID: EW_MATH(y[i] = sigmoid_##T(x[i])); break;                            \
        case TIDE_UN_SILU: EW_MATH(y[i] = x[i] * sigmoid_##T(x[i])); break;                        \
        case TIDE_UN_GELU: EW_MATH(y[i] = gelu_##T(x[i])); break;                                  \
        case TIDE_UN_GELU_ERF: EW_MATH(y[i] = gelu_erf_##T(x[i])); break;                          \
        case TIDE_UN_SOFTPLUS: EW_MATH(y[i] = softplus_##T(x[i])); break;                          \
        case TIDE_UN_RELU: EW_CHEAP(y[i] = x[i] > (T)0 ? x[i] : (T)0); break;                      \
        case TIDE_UN_ABS: EW_CHEAP(y[i] = fabs(x[i])); break;                                      \
        case TIDE_UN_ADD_SCALAR: EW_CHEAP(y[i] = x[i] + p); break;                                 \
        case TIDE_UN_MUL_SCALAR: EW_CHEAP(y[i] = x[i] * p); break;                                 \
        case TIDE_UN_POW_SCALAR: EW_MATH(y[i] = pow(x[i], p)); break;                              \
        }                                                                                          \
    }

/* gx may alias gy: every element reads gy[i] before writing gx[i] */
#define UNARY_BACKWARD(T)                                                                          \
    static void unary_backward_##T(int op, T *gx, const T *gy, const T *x, const T *y,             \
                                   int64_t n, T p)                                                 \
    {                                                                                              \
        switch (op) {                                                                              \
        case TIDE_UN_NEG: EW_CHEAP(gx[i] = -gy[i]); break;                                         \
        case TIDE_UN_EXP: EW_CHEAP(gx[i] = gy[i] * y[i]); break;                                   \
        case TIDE_UN_LOG: EW_CHEAP(gx[i] = gy[i] / x[i]); break;                                   \
        case TIDE_UN_SQRT: EW_CHEAP(gx[i] = gy[i] * (T)0.5 / y[i]); break;                         \
        case TIDE_UN_RSQRT:                                                                        \
            EW_CHEAP(gx[i] = gy[i] * (T)-0.5 * y[i] * y[i] * y[i]); break;                         \
        case TIDE_UN_TANH: EW_CHEAP(gx[i] = gy[i] * ((T)1 - y[i] * y[i])); break;                  \
        case TIDE_UN_SIGMOID:                                                                      \
            EW_CHEAP(gx[i] = gy[i] * y[i] * ((T)1 - y[i])); break;                                 \
        case TIDE_UN_SILU: EW_MATH(gx[i] = gy[i] * silu_grad_##T(x[i])); break;                    \
        case TIDE_UN_GELU: EW_MATH(gx[i] = gy[i] * gelu_grad_##T(x[i])); break;                    \
        case TIDE_UN_GELU_ERF: EW_MATH(gx[i] = gy[i] * gelu_erf_grad_##T(x[i])); break;            \
        case TIDE_UN_SOFTPLUS: EW_MATH(gx[i] = gy[i] * sigmoid_##T(x[i])); break;                  \
        case TIDE_UN_RELU: EW_CHEAP(gx[i] = x[i] > (T)0 ? gy[i] : (T)0); break;                    \
        case TIDE_UN_ABS:                                                                          \
            EW_CHEAP(gx[i] = x[i] > (T)0 ? gy[i] : x[i] < (T)0 ? -gy[i] : (T)0);                   \
            break;                                                                                 \
        case TIDE_UN_ADD_SCALAR: EW_CHEAP(gx[i] = gy[i]); break;                                   \
        case TIDE_UN_MUL_SCALAR: EW_CHEAP(gx[i] = gy[i] * p); break;                               \
        case TIDE_UN_POW_SCALAR:                                                                   \
            EW_MATH(gx[i] = gy[i] * p * pow(x[i], p - (T)1)); break;                               \
        }                                                                                          \
    }

UNARY_FORWARD(float)
UNARY_FORWARD(double)
UNARY_BACKWARD(float)
UNARY_BACKWARD(double)

#define NAME_OF(ID, name) [TIDE_UN_##ID] = #name,
static const char *const unary_names[] = {TIDE_UNARY_OPS(NAME_OF)};
#undef NAME_OF
_Static_assert(sizeof unary_names / sizeof unary_names[0] == TIDE_UN_COUNT, "one name per unary op");

int tide_cpu_unary(int op, int dtype, void *y, const void *x, int64_t n, double p)
{
    if (op < 0 || op >= TIDE_UN_COUNT)
        return tide_set_error("unary: op %d out of range [0, %d)", op, TIDE_UN_COUNT);
    if (n < 0) return tide_set_error("unary %s: n = %lld must be >= 0", unary_names[op], (long long)n);
    switch (dtype) {
    case TIDE_F32: unary_float(op, y, x, n, (float)p); return 0;
    case TIDE_F64: unary_double(op, y, x, n, p); return 0;
    default:
        return tide_set_error("unary %s: dtype %s not supported on cpu (expected f32 or f64)", unary_names[op],
                              tide_cpu_dtype_str(dtype));
    }
}

/* ops whose derivative is cheapest from the output y = f(x) */
static int backward_uses_y(int op)
{
    return op == TIDE_UN_EXP || op == TIDE_UN_SQRT || op == TIDE_UN_RSQRT || op == TIDE_UN_TANH ||
           op == TIDE_UN_SIGMOID;
}

int tide_cpu_unary_backward(int op, int dtype, void *gx, const void *gy, const void *x, const void *y,
                            int64_t n, double p)
{
    if (op < 0 || op >= TIDE_UN_COUNT)
        return tide_set_error("unary_backward: op %d out of range [0, %d)", op, TIDE_UN_COUNT);
    if (n < 0) return tide_set_error("unary_backward %s: n = %lld must be >= 0", unary_names[op], (long long)n);
    int needs_y = backward_uses_y(op);
    int needs_x = !needs_y && op != TIDE_UN_NEG && op != TIDE_UN_ADD_SCALAR && op != TIDE_UN_MUL_SCALAR;
    if ((needs_y && !y) || (needs_x && !x))
        return tide_set_error("unary_backward %s: the saved %s is NULL", unary_names[op],
                              needs_y ? "output y" : "input x");
    switch (dtype) {
    case TIDE_F32: unary_backward_float(op, gx, gy, x, y, n, (float)p); return 0;
    case TIDE_F64: unary_backward_double(op, gx, gy, x, y, n, p); return 0;
    default:
        return tide_set_error("unary_backward %s: dtype %s not supported on cpu (expected f32 or f64)",
                              unary_names[op], tide_cpu_dtype_str(dtype));
    }
}

/* ---- binary (broadcasting by strides) ---------------------------------------------------------------- */

/* one row of n elements; the unit-stride and scalar cases are spelled out so they vectorise */
#define BIN_ROW_LOOPS(T, EXPR)                                                                     \
    if (as == 1 && bs == 1) {                                                                      \
        for (int64_t i = 0; i < n; i++) { T u = a[i], v = b[i]; o[i] = (EXPR); }                   \
    } else if (as == 1 && bs == 0) {                                                               \
        T v = b[0];                                                                                \
        for (int64_t i = 0; i < n; i++) { T u = a[i]; o[i] = (EXPR); }                             \
    } else if (as == 0 && bs == 1) {                                                               \
        T u = a[0];                                                                                \
        for (int64_t i = 0; i < n; i++) { T v = b[i]; o[i] = (EXPR); }                             \
    } else {                                                                                       \
        for (int64_t i = 0; i < n; i++) { T u = a[i * as], v = b[i * bs]; o[i] = (EXPR); }         \
    }

#define BINARY_ROW(T)                                                                              \
    static void binary_row_##T(int op, T *o, const T *a, int64_t as, const T *b, int64_t bs,       \
                               int64_t n)                                                          \
    {                                                                                              \
        switch (op) {                                                                              \
        case TIDE_BIN_ADD: BIN_ROW_LOOPS(T, u + v) break;                                          \
        case TIDE_BIN_SUB: BIN_ROW_LOOPS(T, u - v) break;                                          \
        case TIDE_BIN_MUL: BIN_ROW_LOOPS(T, u * v) break;                                          \
        case TIDE_BIN_DIV: BIN_ROW_LOOPS(T, u / v) break;                                          \
        }                                                                                          \
    }

BINARY_ROW(float)
BINARY_ROW(double)

static void binary_row(int op, int dtype, void *o, const void *a, int64_t as, const void *b, int64_t bs,
                       int64_t n)
{
    if (dtype == TIDE_F32) binary_row_float(op, o, a, as, b, bs, n);
    else binary_row_double(op, o, a, as, b, bs, n);
}

/* a flat range split into fixed blocks so that threads share it */
#define BIN_BLOCK 8192

int tide_cpu_binary(int op, int dtype, void *out, const void *a, const int64_t *sa, const void *b,
                    const int64_t *sb, int ndim, const int64_t *shape)
{
#define NAME_OF(ID, name) [TIDE_BIN_##ID] = #name,
    static const char *const names[] = {TIDE_BINARY_OPS(NAME_OF)};
#undef NAME_OF
    _Static_assert(sizeof names / sizeof names[0] == TIDE_BIN_COUNT, "one name per binary op");
    if (op < 0 || op >= TIDE_BIN_COUNT)
        return tide_set_error("binary: op %d out of range [0, %d)", op, TIDE_BIN_COUNT);
    if (!is_float_dtype(dtype))
        return tide_set_error("binary %s: dtype %s not supported on cpu (expected f32 or f64)", names[op],
                              tide_cpu_dtype_str(dtype));
    if (ndim < 0 || ndim > 8) return tide_set_error("binary %s: ndim = %d, expected 0..8", names[op], ndim);

    /* drop size-1 dims and merge dims contiguous in a and b (out is always contiguous) */
    int64_t sh[8], as[8], bs[8];
    int d = 0;
    for (int k = 0; k < ndim; k++) {
        if (shape[k] < 0)
            return tide_set_error("binary %s: shape[%d] = %lld is negative", names[op], k, (long long)shape[k]);
        if (shape[k] == 0) return 0;
        if (shape[k] == 1) continue;
        if (d > 0 && as[d - 1] == sa[k] * shape[k] && bs[d - 1] == sb[k] * shape[k]) {
            sh[d - 1] *= shape[k];
            as[d - 1] = sa[k];
            bs[d - 1] = sb[k];
            continue;
        }
        sh[d] = shape[k]; as[d] = sa[k]; bs[d] = sb[k];
        d++;
    }
    if (d == 0) { sh[0] = 1; as[0] = 1; bs[0] = 1; d = 1; }

    size_t esz = tide_dtype_size(dtype);
    const char *pa = a, *pb = b;
    char *po = out;

    if (d == 1) {
        /* same-shape contiguous, or one side a scalar: one flat row, cut into blocks for the threads */
        int64_t n = sh[0], nblk = (n + BIN_BLOCK - 1) / BIN_BLOCK;
        int64_t s_a = as[0], s_b = bs[0];
        #pragma omp parallel for if(n > PAR_CHEAP) schedule(static)
        for (int64_t k = 0; k < nblk; k++) {
            int64_t i0 = k * BIN_BLOCK, len = n - i0 < BIN_BLOCK ? n - i0 : BIN_BLOCK;
            binary_row(op, dtype, po + i0 * (int64_t)esz, pa + i0 * s_a * (int64_t)esz, s_a,
                       pb + i0 * s_b * (int64_t)esz, s_b, len);
        }
        return 0;
    }

    /* rows of the last dim: each thread takes a contiguous range of rows, finds the first one's offsets by
       division and steps the rest like an odometer (a division and a modulo per dim and row cost more than a
       short row's work: [2048, 16] + [16] took 40 us) */
    int64_t inner = sh[d - 1], rows = 1;
    for (int k = 0; k < d - 1; k++) rows *= sh[k];
    #pragma omp parallel if(rows * inner > PAR_CHEAP)
    {
        int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
        int64_t idx[8], rem = r0, aoff = 0, boff = 0;
        for (int k = d - 2; k >= 0; k--) {
            idx[k] = rem % sh[k];
            rem /= sh[k];
            aoff += idx[k] * as[k];
            boff += idx[k] * bs[k];
        }
        for (int64_t r = r0; r < r1; r++) {
            binary_row(op, dtype, po + r * inner * (int64_t)esz, pa + aoff * (int64_t)esz, as[d - 1],
                       pb + boff * (int64_t)esz, bs[d - 1], inner);
            for (int k = d - 2; k >= 0; k--) {
                aoff += as[k];
                boff += bs[k];
                if (++idx[k] < sh[k]) break;
                aoff -= as[k] * sh[k];
                boff -= bs[k] * sh[k];
                idx[k] = 0;
            }
        }
    }
    return 0;
}

/* ---- SwiGLU: out = silu(g) * u ------------------------------------------------------------------------ */

#define SWIGLU(T)                                                                                  \
    static void swiglu_##T(T *out, const T *g, const T *u, int64_t n)                              \
    {                                                                                              \
        EW_MATH(out[i] = g[i] * sigmoid_##T(g[i]) * u[i]);                                         \
    }                                                                                              \
    /* dg = dout u silu'(g), du = dout silu(g); dg/du may alias dout */                            \
    static void swiglu_backward_##T(T *dg, T *du, const T *dout, const T *g, const T *u,           \
                                    int64_t n)                                                     \
    {                                                                                              \
        _Pragma("omp parallel for if(n > PAR_MATH) schedule(static)")                              \
        for (int64_t i = 0; i < n; i++) {                                                          \
            T s = sigmoid_##T(g[i]), d = dout[i], gi = g[i], ui = u[i];                            \
            dg[i] = d * ui * s * ((T)1 + gi * ((T)1 - s));                                         \
            du[i] = d * gi * s;                                                                    \
        }                                                                                          \
    }

SWIGLU(float)
SWIGLU(double)

int tide_cpu_swiglu(int dtype, void *out, const void *g, const void *u, int64_t n)
{
    switch (dtype) {
    case TIDE_F32: swiglu_float(out, g, u, n); return 0;
    case TIDE_F64: swiglu_double(out, g, u, n); return 0;
    default: return tide_set_error("swiglu: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    }
}

int tide_cpu_swiglu_backward(int dtype, void *dg, void *du, const void *dout, const void *g,
                             const void *u, int64_t n)
{
    switch (dtype) {
    case TIDE_F32: swiglu_backward_float(dg, du, dout, g, u, n); return 0;
    case TIDE_F64: swiglu_backward_double(dg, du, dout, g, u, n); return 0;
    default: return tide_set_error("swiglu_backward: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    }
}

/* ---- axpy (sum of squares and finiteness are reductions: reduce.c) -------------------------------------------------------------------- */

int tide_cpu_axpy(int dtype, void *y, double a, const void *x, int64_t n)
{
    switch (dtype) {
    case TIDE_F32: {
        float *py = y, fa = (float)a;
        const float *px = x;
        EW_CHEAP(py[i] += fa * px[i]);
        return 0;
    }
    case TIDE_F64: { double *py = y; const double *px = x; EW_CHEAP(py[i] += a * px[i]); return 0; }
    default: return tide_set_error("axpy: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    }
}

/*
 * elementwise.cu — fill, strided copy with dtype conversion, Philox randn/rand, unary ops and their
 * gradients, broadcasting binary ops, swiglu and axpy (AdamW is in optim.cu, rotary embedding in rope.cu).
 *
 * Float storage is f32, f64 or bf16; arithmetic is fp32 for f32/bf16 and fp64 for f64. The op is a
 * run-time argument (a uniform branch) rather than a template parameter, which keeps the number of
 * kernel instantiations, and so CI compile time, small.
 */
#include "common.cuh"
#include "../philox.h"
#include <type_traits>
#include <string.h>
#include <math.h>

/* ---- dtype conversion ---------------------------------------------------------------------- */

/* conversions match the CPU backend (kernels/cpu/elementwise.c): integer -> integer keeps exact 64-bit
   values and narrowing wraps; everything else goes through double; float -> integer rounds toward zero
   and saturates (NaN -> 0); -> bf16 rounds the float32 value to nearest even */
__device__ __forceinline__ double tide_to_f64(float v) { return v; }
__device__ __forceinline__ double tide_to_f64(double v) { return v; }
__device__ __forceinline__ double tide_to_f64(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double tide_to_f64(int32_t v) { return v; }
__device__ __forceinline__ double tide_to_f64(int64_t v) { return (double)v; }
__device__ __forceinline__ double tide_to_f64(uint8_t v) { return v; }

/* ---- fill ----------------------------------------------------------------------------------- */

template <typename U> __global__ void fill_kernel(U *out, U bits, int64_t n)
{
    TIDE_GRID_LOOP(i, n) out[i] = bits;
}

template <typename U> static int fill_bits(void *out, U bits, int64_t n, cudaStream_t s)
{
    fill_kernel<U><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((U *)out, bits, n);
    TIDE_CU_LAUNCH("fill kernel");
    return 0;
}

int tide_cuda_fill(void *out, int dtype, int64_t n, double value)
{
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    size_t es = tide_dtype_size(dtype);
    if (es == 0) return tide_set_error("fill: unknown dtype %d", dtype);
    int is_float = dtype == TIDE_F32 || dtype == TIDE_F64 || dtype == TIDE_BF16;
    if (value == 0.0 && !(is_float && signbit(value))) {   /* all-zero bits (not -0.0) */
        TIDE_CU(cudaMemsetAsync(out, 0, (size_t)n * es, s), "fill (memset)");
        return 0;
    }
    /* the value is converted once on the host, as copy would convert it, and stored as raw bits */
    switch (dtype) {
    case TIDE_F32: { float v = tide_from_f64<float>(value); uint32_t b; memcpy(&b, &v, 4); return fill_bits<uint32_t>(out, b, n, s); }
    case TIDE_F64: { uint64_t b; memcpy(&b, &value, 8); return fill_bits<uint64_t>(out, b, n, s); }
    case TIDE_BF16: { __nv_bfloat16 v = tide_from_f64<__nv_bfloat16>(value); uint16_t b; memcpy(&b, &v, 2); return fill_bits<uint16_t>(out, b, n, s); }
    case TIDE_I32: { int32_t v = tide_from_f64<int32_t>(value); uint32_t b; memcpy(&b, &v, 4); return fill_bits<uint32_t>(out, b, n, s); }
    case TIDE_I64: { int64_t v = tide_from_f64<int64_t>(value); uint64_t b; memcpy(&b, &v, 8); return fill_bits<uint64_t>(out, b, n, s); }
    case TIDE_U8: return fill_bits<uint8_t>(out, tide_from_f64<uint8_t>(value), n, s);
    }
    return tide_set_error("fill: unknown dtype %d", dtype);
}

/* ---- copy with dtype conversion ---------------------------------------------------------------- */

template <typename D, typename S> __device__ __forceinline__ D tide_cvt(S v)
{
    if constexpr (std::is_same<S, D>::value) {
        return v;
    } else if constexpr (std::is_integral<S>::value && std::is_integral<D>::value) {
        return (D)(int64_t)v;
    } else if constexpr (std::is_same<S, __nv_bfloat16>::value && std::is_same<D, float>::value) {
        return __bfloat162float(v);
    } else if constexpr (std::is_same<S, float>::value && std::is_same<D, __nv_bfloat16>::value) {
        return __float2bfloat16(v);
    } else {
        return tide_from_f64<D>(tide_to_f64(v));
    }
}

struct copy_geom {
    int ndim;
    int64_t shape[TIDE_MAX_DIMS_CUDA];
    int64_t os[TIDE_MAX_DIMS_CUDA];
    int64_t xs[TIDE_MAX_DIMS_CUDA];
};

template <typename D, typename S> __global__ void copy_kernel(D *out, const S *x, copy_geom g, int64_t n)
{
    TIDE_GRID_LOOP(k, n) {
        int64_t rem = k, oo = 0, xo = 0;
        for (int d = g.ndim - 1; d >= 0; d--) {
            int64_t c = rem % g.shape[d];
            rem /= g.shape[d];
            oo += c * g.os[d];
            xo += c * g.xs[d];
        }
        out[oo] = tide_cvt<D, S>(x[xo]);
    }
}

template <typename D, typename S> static int copy_launch(void *out, const void *x, const copy_geom &g, int64_t n,
                                                         cudaStream_t s)
{
    copy_kernel<D, S><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((D *)out, (const S *)x, g, n);
    TIDE_CU_LAUNCH("copy kernel");
    return 0;
}

template <typename D> static int copy_from(int xdtype, void *out, const void *x, const copy_geom &g, int64_t n,
                                           cudaStream_t s)
{
    switch (xdtype) {
    case TIDE_F32: return copy_launch<D, float>(out, x, g, n, s);
    case TIDE_F64: return copy_launch<D, double>(out, x, g, n, s);
    case TIDE_BF16: return copy_launch<D, __nv_bfloat16>(out, x, g, n, s);
    case TIDE_I32: return copy_launch<D, int32_t>(out, x, g, n, s);
    case TIDE_I64: return copy_launch<D, int64_t>(out, x, g, n, s);
    case TIDE_U8: return copy_launch<D, uint8_t>(out, x, g, n, s);
    }
    return tide_set_error("copy: unknown source dtype %d", xdtype);
}

int tide_cuda_copy(void *out, int odtype, const int64_t *ostride, const void *x, int xdtype,
                   const int64_t *xstride, int ndim, const int64_t *shape)
{
    if (ndim < 0 || ndim > TIDE_MAX_DIMS_CUDA)
        return tide_set_error("copy: ndim %d out of range [0, %d]", ndim, TIDE_MAX_DIMS_CUDA);
    size_t oes = tide_dtype_size(odtype), xes = tide_dtype_size(xdtype);
    if (!oes || !xes) return tide_set_error("copy: unknown dtype (out %d, x %d)", odtype, xdtype);
    /* drop size-1 dims and merge dims that are contiguous in both out and x, so most copies run as
       one or two flat dims */
    copy_geom g;
    g.ndim = 0;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] <= 0) return 0;
        n *= shape[d];
        if (shape[d] == 1) continue;
        if (g.ndim > 0 && g.os[g.ndim - 1] == ostride[d] * shape[d] && g.xs[g.ndim - 1] == xstride[d] * shape[d]) {
            g.shape[g.ndim - 1] *= shape[d];
            g.os[g.ndim - 1] = ostride[d];
            g.xs[g.ndim - 1] = xstride[d];
            continue;
        }
        g.shape[g.ndim] = shape[d];
        g.os[g.ndim] = ostride[d];
        g.xs[g.ndim] = xstride[d];
        g.ndim++;
    }
    TIDE_STREAM(s);
    if (odtype == xdtype && (g.ndim == 0 || (g.ndim == 1 && g.os[0] == 1 && g.xs[0] == 1))) {
        if (out != x) TIDE_CU(cudaMemcpyAsync(out, x, (size_t)n * oes, cudaMemcpyDeviceToDevice, s), "copy (memcpy)");
        return 0;
    }
    switch (odtype) {
    case TIDE_F32: return copy_from<float>(xdtype, out, x, g, n, s);
    case TIDE_F64: return copy_from<double>(xdtype, out, x, g, n, s);
    case TIDE_BF16: return copy_from<__nv_bfloat16>(xdtype, out, x, g, n, s);
    case TIDE_I32: return copy_from<int32_t>(xdtype, out, x, g, n, s);
    case TIDE_I64: return copy_from<int64_t>(xdtype, out, x, g, n, s);
    case TIDE_U8: return copy_from<uint8_t>(xdtype, out, x, g, n, s);
    }
    return tide_set_error("copy: unknown output dtype %d", odtype);
}

/* ---- random numbers: element i uses Philox counter offset + i (kernels/philox.h) ----------------- */

template <typename T> __global__ void random_kernel(T *out, int64_t n, uint64_t seed, uint64_t offset, double a,
                                                    double b, int normal)
{
    TIDE_GRID_LOOP(i, n) {
        double v = normal ? a + b * tide_philox_normal_at(seed, offset + (uint64_t)i)
                          : a + (b - a) * tide_philox_uniform_at(seed, offset + (uint64_t)i);
        if constexpr (std::is_same<T, __nv_bfloat16>::value) out[i] = __float2bfloat16((float)v);
        else out[i] = (T)v;
    }
}

static int random_fill(const char *what, void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset,
                       double a, double b, int normal)
{
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, what, {
        random_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)out, n, seed, offset, a, b, normal);
        TIDE_CU_LAUNCH("random kernel");
    });
    return 0;
}

int tide_cuda_randn(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b)
{
    return random_fill("randn", out, dtype, n, seed, offset, a, b, 1);
}

int tide_cuda_rand(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b)
{
    return random_fill("rand", out, dtype, n, seed, offset, a, b, 0);
}

/* ---- unary ops ---------------------------------------------------------------------------------- */

/* never exponentiates a large positive number (same form as the CPU backend) */
template <typename A> __device__ __forceinline__ A tide_sigmoid(A x)
{
    if (x >= A(0)) return A(1) / (A(1) + exp(-x));
    A z = exp(x);
    return z / (A(1) + z);
}

/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
#define TIDE_GELU_C 0.7978845608028654
#define TIDE_GELU_K 0.044715
/* the exact (erf) GELU: 0.5 x (1 + erf(x / sqrt 2)) */
#define TIDE_SQRT1_2 0.70710678118654752440
#define TIDE_INV_SQRT_2PI 0.39894228040143267794

template <typename A> __device__ __forceinline__ A unary_f(int op, A x, A p)
{
    switch (op) {
    case TIDE_UN_NEG: return -x;
    case TIDE_UN_EXP: return exp(x);
    case TIDE_UN_LOG: return log(x);
    case TIDE_UN_SQRT: return sqrt(x);
    case TIDE_UN_RSQRT: return A(1) / sqrt(x);
    case TIDE_UN_TANH: return tanh(x);
    case TIDE_UN_SIGMOID: return tide_sigmoid(x);
    case TIDE_UN_SILU: return x * tide_sigmoid(x);
    case TIDE_UN_GELU: return A(0.5) * x * (A(1) + tanh(A(TIDE_GELU_C) * (x + A(TIDE_GELU_K) * x * x * x)));
    case TIDE_UN_GELU_ERF: return A(0.5) * x * (A(1) + erf(x * A(TIDE_SQRT1_2)));
    case TIDE_UN_SOFTPLUS: return (x > A(0) ? x : A(0)) + log1p(exp(-fabs(x)));   /* log(1 + e^x), stable */
    case TIDE_UN_RELU: return x > A(0) ? x : A(0);
    case TIDE_UN_ABS: return fabs(x);
    case TIDE_UN_ADD_SCALAR: return x + p;
    case TIDE_UN_MUL_SCALAR: return x * p;
    case TIDE_UN_POW_SCALAR: return pow(x, p);
    }
    return x;
}

/* d f(x) / dx times gy, with y = f(x) */
template <typename A> __device__ __forceinline__ A unary_grad(int op, A gy, A x, A y, A p)
{
    switch (op) {
    case TIDE_UN_NEG: return -gy;
    case TIDE_UN_EXP: return gy * y;
    case TIDE_UN_LOG: return gy / x;
    case TIDE_UN_SQRT: return gy * A(0.5) / y;
    case TIDE_UN_RSQRT: return gy * A(-0.5) * y * y * y;
    case TIDE_UN_TANH: return gy * (A(1) - y * y);
    case TIDE_UN_SIGMOID: return gy * y * (A(1) - y);
    case TIDE_UN_SILU: {
        A s = tide_sigmoid(x);
        return gy * s * (A(1) + x * (A(1) - s));
    }
    case TIDE_UN_GELU: {
        A u = A(TIDE_GELU_C) * (x + A(TIDE_GELU_K) * x * x * x);
        A t = tanh(u);
        A du = A(TIDE_GELU_C) * (A(1) + A(3 * TIDE_GELU_K) * x * x);
        return gy * (A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * du);
    }
    case TIDE_UN_GELU_ERF: {   /* Φ(x) + x φ(x) */
        A cdf = A(0.5) * (A(1) + erf(x * A(TIDE_SQRT1_2)));
        return gy * (cdf + x * A(TIDE_INV_SQRT_2PI) * exp(A(-0.5) * x * x));
    }
    case TIDE_UN_SOFTPLUS: return gy * tide_sigmoid(x);
    case TIDE_UN_RELU: return x > A(0) ? gy : A(0);
    case TIDE_UN_ABS: return x > A(0) ? gy : (x < A(0) ? -gy : A(0));
    case TIDE_UN_ADD_SCALAR: return gy;
    case TIDE_UN_MUL_SCALAR: return gy * p;
    case TIDE_UN_POW_SCALAR: return gy * p * pow(x, p - A(1));
    }
    return gy;
}

template <typename T> __global__ void unary_kernel(int op, T *y, const T *x, int64_t n, TIDE_ACC(T) p)
{
    TIDE_GRID_LOOP(i, n) tide_st(y, i, unary_f(op, tide_ld(x, i), p));
}

/* x or y may be NULL when the op's gradient does not read it (checked by the entry) */
template <typename T> __global__ void unary_backward_kernel(int op, T *gx, const T *gy, const T *x, const T *y,
                                                            int64_t n, TIDE_ACC(T) p)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(i, n) {
        A xv = x ? tide_ld(x, i) : A(0);
        A yv = y ? tide_ld(y, i) : A(0);
        tide_st(gx, i, unary_grad(op, tide_ld(gy, i), xv, yv, p));
    }
}

static int check_unary_op(int op, const char *what)
{
    if (op < 0 || op >= TIDE_UN_COUNT) return tide_set_error("%s: unknown unary op %d", what, op);
    return 0;
}

int tide_cuda_unary(int op, int dtype, void *y, const void *x, int64_t n, double p)
{
    if (check_unary_op(op, "unary")) return -1;
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "unary", {
        unary_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>(op, (T *)y, (const T *)x, n, (TIDE_ACC(T))p);
        TIDE_CU_LAUNCH("unary kernel");
    });
    return 0;
}

int tide_cuda_unary_backward(int op, int dtype, void *gx, const void *gy, const void *x, const void *y,
                             int64_t n, double p)
{
    if (check_unary_op(op, "unary backward")) return -1;
    if (n <= 0) return 0;
    /* the gradient is cheapest from y = f(x) for these; the others read x (or nothing) */
    int needs_y = op == TIDE_UN_EXP || op == TIDE_UN_SQRT || op == TIDE_UN_RSQRT || op == TIDE_UN_TANH ||
                  op == TIDE_UN_SIGMOID;
    int needs_x = !needs_y && op != TIDE_UN_NEG && op != TIDE_UN_ADD_SCALAR && op != TIDE_UN_MUL_SCALAR;
    if ((needs_y && !y) || (needs_x && !x))
        return tide_set_error("unary backward: op %d needs the saved %s, got NULL", op, needs_y ? "output y" : "input x");
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "unary backward", {
        unary_backward_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>(op, (T *)gx, (const T *)gy, (const T *)x,
                                                                         (const T *)y, n, (TIDE_ACC(T))p);
        TIDE_CU_LAUNCH("unary backward kernel");
    });
    return 0;
}

/* ---- binary ops with broadcasting ------------------------------------------------------------------ */

struct binary_geom {
    int ndim;
    int64_t shape[TIDE_MAX_DIMS_CUDA];
    int64_t sa[TIDE_MAX_DIMS_CUDA];
    int64_t sb[TIDE_MAX_DIMS_CUDA];
};

template <typename A> __device__ __forceinline__ A binary_f(int op, A a, A b)
{
    switch (op) {
    case TIDE_BIN_ADD: return a + b;
    case TIDE_BIN_SUB: return a - b;
    case TIDE_BIN_MUL: return a * b;
    default: return a / b;
    }
}

template <typename T> __global__ void binary_kernel(int op, T *out, const T *a, const T *b, binary_geom g, int64_t n)
{
    TIDE_GRID_LOOP(k, n) {
        int64_t rem = k, ao = 0, bo = 0;
        for (int d = g.ndim - 1; d >= 0; d--) {
            int64_t c = rem % g.shape[d];
            rem /= g.shape[d];
            ao += c * g.sa[d];
            bo += c * g.sb[d];
        }
        tide_st(out, k, binary_f(op, tide_ld(a, ao), tide_ld(b, bo)));
    }
}

/* the common same-shape contiguous case: no index arithmetic */
template <typename T> __global__ void binary_flat_kernel(int op, T *out, const T *a, const T *b, int64_t n)
{
    TIDE_GRID_LOOP(k, n) tide_st(out, k, binary_f(op, tide_ld(a, k), tide_ld(b, k)));
}

int tide_cuda_binary(int op, int dtype, void *out, const void *a, const int64_t *sa, const void *b,
                     const int64_t *sb, int ndim, const int64_t *shape)
{
    if (op < 0 || op >= TIDE_BIN_COUNT) return tide_set_error("binary: unknown op %d", op);
    if (ndim < 0 || ndim > TIDE_MAX_DIMS_CUDA)
        return tide_set_error("binary: ndim %d out of range [0, %d]", ndim, TIDE_MAX_DIMS_CUDA);
    /* merge dims that are contiguous for a, b and the (contiguous) output */
    binary_geom g;
    g.ndim = 0;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] <= 0) return 0;
        n *= shape[d];
        if (shape[d] == 1) continue;
        if (g.ndim > 0 && g.sa[g.ndim - 1] == sa[d] * shape[d] && g.sb[g.ndim - 1] == sb[d] * shape[d]) {
            g.shape[g.ndim - 1] *= shape[d];
            g.sa[g.ndim - 1] = sa[d];
            g.sb[g.ndim - 1] = sb[d];
            continue;
        }
        g.shape[g.ndim] = shape[d];
        g.sa[g.ndim] = sa[d];
        g.sb[g.ndim] = sb[d];
        g.ndim++;
    }
    TIDE_STREAM(s);
    int flat = g.ndim == 0 || (g.ndim == 1 && g.sa[0] == 1 && g.sb[0] == 1);
    TIDE_FLOAT_DISPATCH(dtype, "binary", {
        if (flat)
            binary_flat_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>(op, (T *)out, (const T *)a, (const T *)b, n);
        else
            binary_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>(op, (T *)out, (const T *)a, (const T *)b, g, n);
        TIDE_CU_LAUNCH("binary kernel");
    });
    return 0;
}

/* ---- swiglu: out = silu(g) * u ---------------------------------------------------------------------- */

template <typename T> __global__ void swiglu_kernel(T *out, const T *g, const T *u, int64_t n)
{
    TIDE_GRID_LOOP(i, n) {
        TIDE_ACC(T) x = tide_ld(g, i);
        tide_st(out, i, x * tide_sigmoid(x) * tide_ld(u, i));
    }
}

template <typename T> __global__ void swiglu_backward_kernel(T *dg, T *du, const T *dout, const T *g, const T *u,
                                                             int64_t n)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(i, n) {
        A x = tide_ld(g, i), uv = tide_ld(u, i), d = tide_ld(dout, i);
        A sg = tide_sigmoid(x);
        /* read everything before writing: dg or du may alias dout */
        A gg = d * uv * sg * (A(1) + x * (A(1) - sg));
        A gu = d * x * sg;
        if (dg) tide_st(dg, i, gg);
        if (du) tide_st(du, i, gu);
    }
}

int tide_cuda_swiglu(int dtype, void *out, const void *g, const void *u, int64_t n)
{
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "swiglu", {
        swiglu_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)out, (const T *)g, (const T *)u, n);
        TIDE_CU_LAUNCH("swiglu kernel");
    });
    return 0;
}

int tide_cuda_swiglu_backward(int dtype, void *dg, void *du, const void *dout, const void *g, const void *u,
                              int64_t n)
{
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "swiglu backward", {
        swiglu_backward_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)dg, (T *)du, (const T *)dout,
                                                                          (const T *)g, (const T *)u, n);
        TIDE_CU_LAUNCH("swiglu backward kernel");
    });
    return 0;
}

/* ---- axpy: y += a x --------------------------------------------------------------------------------- */

template <typename T> __global__ void axpy_kernel(T *y, TIDE_ACC(T) a, const T *x, int64_t n)
{
    TIDE_GRID_LOOP(i, n) tide_st(y, i, tide_ld(y, i) + a * tide_ld(x, i));
}

int tide_cuda_axpy(int dtype, void *y, double a, const void *x, int64_t n)
{
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "axpy", {
        axpy_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)y, (TIDE_ACC(T))a, (const T *)x, n);
        TIDE_CU_LAUNCH("axpy kernel");
    });
    return 0;
}

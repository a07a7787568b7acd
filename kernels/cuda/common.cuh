/*
 * common.cuh — what every CUDA kernel file shares: the process stream and cuBLAS handle, error
 * checks, dtype traits (bf16 storage with fp32 arithmetic), launch sizes and block reductions.
 *
 * The backend drives one device (cuda:0) through one stream created on first use; every kernel,
 * copy and cuBLAS call is issued on that stream, so stream order alone keeps them consistent.
 */
#ifndef TIDE_CUDA_COMMON_CUH
#define TIDE_CUDA_COMMON_CUH
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <stdint.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <type_traits>
#include "../backend.h"
#include "launch.h"

/* ---- process state (backend_cuda.cu) --------------------------------------------------------- */
/* the stream every entry uses; 0 on success, else the error is set */
int tide_cuda_get_stream(cudaStream_t *out);
int tide_cuda_get_cublas(cublasHandle_t *out);
/* a small host table (segment boundaries, pointer arrays, flags) to the device in stream order, through a pinned
   staging ring (backend_cuda.cu): the host copy may be freed or reused as soon as this returns, and the upload
   does not wait on the driver's pageable staging. Tables over the ring's slot size go pageable. */
cudaError_t tide_cuda_upload(void *dst, const void *src, size_t n, cudaStream_t s);
/* KDA's checkpoint spacing, TIDE_KDA_CUDA_CKPT_CHUNKS: launch.h */
/* a small device scratch area for reductions and error flags (TIDE_CUDA_SCRATCH_PARTIALS doubles,
   then flags); only valid in stream order between one entry's launches */
#define TIDE_CUDA_SCRATCH_PARTIALS 1024
struct tide_cuda_scratch {
    double partial[TIDE_CUDA_SCRATCH_PARTIALS];
    double result;
    unsigned long long first;     /* smallest offending position (atomicMin), ULLONG_MAX when none */
    int flag;
    /* the deferred record (below): persistent across entries, ULLONG_MAX when clean */
    unsigned long long defer_key;
    double defer_value;
};

/* ---- deferred checks ---------------------------------------------------------------------------
   A kernel that finds a bad input (an index or a target out of range, a KDA gate outside its bound) records it
   without the host waiting: atomicMin of key = (call << TIDE_DEFER_SHIFT) | position into the scratch area's
   defer_key, so the earliest call's first position wins, and a one-thread capture kernel behind the check stores
   the offending value. The host keeps what each call was (op, sizes) in a ring. The next entry that waits for the
   device anyway (a copy to the host, synchronize, a reduction the host reads) reports the record as that entry's
   error and clears it (tide_cuda_deferred_report): the message is the one the synchronous check gave, and says it
   was found on the device. The kernels that read the bad input stay memory-safe (an index out of range reads 0
   and writes nowhere; the KDA chunk path computes on, its result unused once the error is raised). */
#define TIDE_DEFER_SHIFT 40
#define TIDE_DEFER_RING 4096
enum { TIDE_DEFER_INDEX = 1, TIDE_DEFER_TARGET = 2, TIDE_DEFER_KDA = 3 };
struct tide_cuda_defer_ctx {
    int kind;
    char what[48];                /* the op */
    int64_t n;                    /* INDEX, TARGET: the range [0, n); KDA: T */
    int64_t ignore;               /* TARGET: the ignore index */
    int64_t H, dk;                /* KDA */
    double lb;                    /* KDA */
};
/* the base key of a new deferred check, its context kept; 0 with the error set when the scratch area is missing */
int tide_cuda_defer_begin(const tide_cuda_defer_ctx *ctx, unsigned long long *base);
/* 0 when the record is clean, else -1 with its message (and the record cleared); one synchronisation */
int tide_cuda_deferred_report(void);


int tide_cuda_get_scratch(tide_cuda_scratch **out);
/* device memory for an entry's temporary buffers, stream ordered: free it right after the last launch
   that uses it (the free is ordered after that work) */
cudaError_t tide_cuda_alloc(void **p, size_t nbytes, cudaStream_t s);
void tide_cuda_release(void *p, cudaStream_t s);
/* number of SMs of the device (for sizing grids) */
int tide_cuda_sm_count(void);

#define TIDE_MAX_DIMS_CUDA 8

/* ---- errors ---------------------------------------------------------------------------------- */
#define TIDE_CU(call, what)                                                                         \
    do {                                                                                            \
        cudaError_t e_ = (call);                                                                    \
        if (e_ != cudaSuccess) return tide_set_error("cuda %s: %s", (what), cudaGetErrorString(e_)); \
    } while (0)
/* after a kernel launch: configuration errors show here, faults at the next synchronising call */
#define TIDE_CU_LAUNCH(what) TIDE_CU(cudaGetLastError(), (what))
#define TIDE_CUBLAS(call, what)                                                                     \
    do {                                                                                            \
        cublasStatus_t s_ = (call);                                                                 \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                            \
            return tide_set_error("cuda %s: %s", (what), cublasGetStatusString(s_));                \
    } while (0)
#define TIDE_STREAM(s) \
    cudaStream_t s = 0; \
    do { if (tide_cuda_get_stream(&s)) return -1; } while (0)

static inline const char *tide_cuda_dtype_str(int dtype)
{
    const char *n = tide_dtype_name(dtype);
    return n ? n : "unknown";
}

/* ---- dtype traits: T is the storage type, A the arithmetic type ------------------------------ */
template <typename T> struct tide_tr;
template <> struct tide_tr<float> {
    typedef float A;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float a) { return a; }
};
template <> struct tide_tr<double> {
    typedef double A;
    static __device__ __forceinline__ double load(double v) { return v; }
    static __device__ __forceinline__ double store(double a) { return a; }
};
template <> struct tide_tr<__nv_bfloat16> {
    typedef float A;
    static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 store(float a) { return __float2bfloat16(a); }
};
#define TIDE_ACC(T) typename tide_tr<T>::A
template <typename T> __device__ __forceinline__ TIDE_ACC(T) tide_ld(const T *p, int64_t i)
{
    return tide_tr<T>::load(p[i]);
}
template <typename T> __device__ __forceinline__ void tide_st(T *p, int64_t i, TIDE_ACC(T) v)
{
    p[i] = tide_tr<T>::store(v);
}

/* behind a deferred check's kernel (one thread): the value at the recorded position, when the record's key is this
   call's. I: an index type (int32_t, int64_t) or a storage type (float, __nv_bfloat16) */
template <typename I> __device__ __forceinline__ double tide_defer_load(const I *v, unsigned long long k)
{
    if constexpr (std::is_integral<I>::value) return (double)v[k];
    else return (double)tide_tr<I>::load(v[k]);
}
template <typename I>
__global__ void __launch_bounds__(32) tide_defer_capture_kernel(tide_cuda_scratch *sc, unsigned long long base,
                                                                const I *vals)
{
    unsigned long long k = sc->defer_key;
    if (threadIdx.x == 0 && k != ~0ull && k >> TIDE_DEFER_SHIFT == base >> TIDE_DEFER_SHIFT)
        sc->defer_value = tide_defer_load(vals, k & ((1ull << TIDE_DEFER_SHIFT) - 1));
}

/* a double as storage type D (the CPU backend's conversions: float -> integer rounds toward zero and
   saturates, NaN -> 0; -> bf16 rounds the float32 value to nearest even) */
template <typename D> __host__ __device__ __forceinline__ D tide_from_f64(double v)
{
    if constexpr (std::is_same<D, float>::value) {
        return (float)v;
    } else if constexpr (std::is_same<D, double>::value) {
        return v;
    } else if constexpr (std::is_same<D, __nv_bfloat16>::value) {
        return __float2bfloat16((float)v);
    } else if constexpr (std::is_same<D, int32_t>::value) {
        if (v != v) return 0;
        if (v >= 2147483647.0) return INT32_MAX;
        if (v <= -2147483648.0) return INT32_MIN;
        return (int32_t)v;
    } else if constexpr (std::is_same<D, int64_t>::value) {
        if (v != v) return 0;
        if (v >= 9223372036854775807.0) return INT64_MAX;
        if (v <= -9223372036854775808.0) return INT64_MIN;
        return (int64_t)v;
    } else {
        if (v != v || v <= 0.0) return 0;
        if (v >= 255.0) return 255;
        return (uint8_t)v;
    }
}

/* index buffers are i32 or i64, chosen at run time (a uniform branch) */
__device__ __forceinline__ int64_t tide_ld_index(const void *idx, int is64, int64_t k)
{
    return is64 ? ((const int64_t *)idx)[k] : (int64_t)((const int32_t *)idx)[k];
}

/* runs BODY with T bound to the storage type of a float dtype, or returns an error naming `what` */
#define TIDE_FLOAT_DISPATCH(dtype, what, ...)                                                       \
    switch (dtype) {                                                                                \
    case TIDE_F32: { typedef float T; __VA_ARGS__; } break;                                         \
    case TIDE_F64: { typedef double T; __VA_ARGS__; } break;                                        \
    case TIDE_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; } break;                                \
    default:                                                                                        \
        return tide_set_error("%s: dtype %s is not supported on the cuda backend (f32, f64, bf16)", \
                              (what), tide_cuda_dtype_str(dtype));                                  \
    }

static inline int tide_cuda_check_index_dtype(int idx_dtype, const char *what)
{
    if (idx_dtype == TIDE_I32 || idx_dtype == TIDE_I64) return 0;
    return tide_set_error("%s: index dtype %s is not supported (i32, i64)", what, tide_cuda_dtype_str(idx_dtype));
}

/* ---- launch sizes (the shapes themselves: launch.h) ----------------------------------------- */
/* blocks for a grid-stride loop over n elements (at most a few waves; loops cover the rest) */
static inline unsigned tide_blocks(int64_t n) { return tide_grid_blocks(n, tide_cuda_sm_count()); }

#define TIDE_GRID_LOOP(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* ---- block reductions (blockDim.x a multiple of 32, at most 1024) ---------------------------- */
struct tide_sum_op {
    template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
struct tide_max_op {
    /* NaN wins, so a NaN row stays visible */
    template <typename A> __device__ __forceinline__ A operator()(A a, A b) const
    {
        return (a != a || a > b) ? a : b;
    }
};
template <typename A, typename F> __device__ __forceinline__ A tide_warp_reduce(A v, F f)
{
    for (int o = 16; o > 0; o >>= 1) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* every thread gets the result; sh must hold 32 values; safe to call repeatedly with the same sh */
template <typename A, typename F> __device__ __forceinline__ A tide_block_reduce(A v, F f, A identity, A *sh)
{
    v = tide_warp_reduce(v, f);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        A r = lane < nw ? sh[lane] : identity;
        r = tide_warp_reduce(r, f);
        if (lane == 0) sh[0] = r;
    }
    __syncthreads();
    return sh[0];
}

/* the block's (max, log-sum-exp) of a row: lse = m + log Σ exp(x - m) */
template <typename T> __device__ __forceinline__ TIDE_ACC(T) tide_row_lse(const T *xr, int64_t C, TIDE_ACC(T) *m_out,
                                                                      TIDE_ACC(T) *sh)
{
    typedef TIDE_ACC(T) A;
    A m = A(-INFINITY);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) m = tide_max_op()(m, tide_ld(xr, j));
    m = tide_block_reduce(m, tide_max_op(), A(-INFINITY), sh);
    /* an all -inf row would give exp(nan); shift by 0 instead so the sum is 0 and lse = -inf */
    A shift = (m == A(-INFINITY) || m == A(INFINITY)) ? A(0) : m;
    A sum = A(0);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) sum += exp(tide_ld(xr, j) - shift);
    sum = tide_block_reduce(sum, tide_sum_op(), A(0), sh);
    *m_out = shift;
    return shift + log(sum);
}

/* ---- entries (one per tide_backend field; backend_cuda.cu builds the table) ------------------ */
int tide_cuda_fill(void *out, int dtype, int64_t n, double value);
int tide_cuda_copy(void *out, int odtype, const int64_t *ostride, const void *x, int xdtype,
                   const int64_t *xstride, int ndim, const int64_t *shape);
int tide_cuda_randn(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b);
int tide_cuda_rand(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b);
int tide_cuda_unary(int op, int dtype, void *y, const void *x, int64_t n, double p);
int tide_cuda_unary_backward(int op, int dtype, void *gx, const void *gy, const void *x, const void *y,
                             int64_t n, double p);
int tide_cuda_binary(int op, int dtype, void *out, const void *a, const int64_t *sa, const void *b,
                     const int64_t *sb, int ndim, const int64_t *shape);
int tide_cuda_swiglu(int dtype, void *out, const void *g, const void *u, int64_t n);
int tide_cuda_swiglu_backward(int dtype, void *dg, void *du, const void *dout, const void *g, const void *u,
                              int64_t n);
int tide_cuda_axpy(int dtype, void *y, double a, const void *x, int64_t n);
int tide_cuda_adamw(int dtype, void *p, const void *g, void *m, void *v, int *nonfinite, int64_t n, double lr,
                    double beta1, double beta2, double eps, double wd, double bc1, double bc2);
int tide_cuda_rope(int dtype, void *out, const void *x, int64_t B, int64_t T, int64_t H, int64_t D,
                   double theta, int64_t pos0, int inverse);
/* the ViT position kernels (vision.cu) */
int tide_cuda_rope2d(int dtype, void *out, const void *x, const void *pos, int pos_dtype, int64_t T, int64_t H,
                     int64_t hd, double theta, int inverse);
int tide_cuda_pos_interp(int dtype, void *out, const void *table, const int64_t *grids, int64_t n, int64_t Gh,
                         int64_t Gw, int64_t d);
int tide_cuda_pos_interp_backward(int dtype, void *dtable, const void *dout, const int64_t *grids, int64_t n,
                                  int64_t Gh, int64_t Gw, int64_t d);

int tide_cuda_sum_squares(int dtype, const void *x, int64_t n, double *out);
int tide_cuda_all_finite(int dtype, const void *x, int64_t n, int *out);
int tide_cuda_first_nonfinite(int n, const int *dtypes, const void *const *ptrs, const int64_t *lens, int *first);
int tide_cuda_reduce(int op, int dtype, void *out, const void *x, int64_t outer, int64_t red, int64_t inner);
int tide_cuda_reduce_max_backward(int dtype, void *gx, const void *gy, const void *x, const void *y,
                                  int64_t outer, int64_t red, int64_t inner);
int tide_cuda_check_index(const char *what, const void *idx, int idx_dtype, int64_t count, int64_t n, int defer,
                          int64_t *bad, int *ok);

int tide_cuda_gemm(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A,
                   int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc);
int tide_cuda_gemm_batched(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                           const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                           double beta, void *C, int64_t ldc, int64_t sc, int64_t batch);
/* C (fp32) = alpha op(A) op(B) + beta C with f32 or bf16 operands: sums over calls stay fp32 */
int tide_cuda_gemm_f32out(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A,
                          int64_t lda, const void *B, int64_t ldb, double beta, float *C, int64_t ldc);

int tide_cuda_index_select(int dtype, void *out, const void *x, const void *idx, int idx_dtype, int64_t outer,
                           int64_t n_src, int64_t inner, int64_t n_idx);
int tide_cuda_index_add(int dtype, void *gx, const void *gy, const void *idx, int idx_dtype, int64_t outer,
                        int64_t n_dst, int64_t inner, int64_t n_idx);
int tide_cuda_gather(int dtype, void *out, const void *x, const void *idx, int idx_dtype, int64_t outer,
                     int64_t n_x, int64_t n_idx, int64_t inner);
int tide_cuda_scatter_add(int dtype, void *out, const void *src, const void *idx, int idx_dtype, int64_t outer,
                          int64_t n_out, int64_t n_idx, int64_t inner);

int tide_cuda_rmsnorm(int dtype, void *out, void *rstd, const void *x, const void *w, int64_t N, int64_t C,
                      double eps);
int tide_cuda_rmsnorm_backward(int dtype, void *dx, void *dw, const void *dout, const void *x, const void *w,
                               const void *rstd, int64_t N, int64_t C);
int tide_cuda_layernorm(int dtype, void *out, void *mean, void *rstd, const void *x, const void *w,
                        const void *b, int64_t N, int64_t C, double eps);
int tide_cuda_layernorm_backward(int dtype, void *dx, void *dw, void *db, const void *dout, const void *x,
                                 const void *w, const void *mean, const void *rstd, int64_t N, int64_t C);
int tide_cuda_softmax(int dtype, void *y, const void *x, int64_t N, int64_t C, int log);
int tide_cuda_softmax_backward(int dtype, void *dx, const void *dy, const void *y, int64_t N, int64_t C,
                               int log);
int tide_cuda_cross_entropy(int dtype, void *loss, void *valid, void *lse, const void *logits,
                            const void *targets, int tdtype, const void *weights, int64_t N, int64_t V,
                            int64_t ignore);
int tide_cuda_cross_entropy_backward(int dtype, void *dlogits, const void *dloss, const void *logits,
                                     const void *lse, const void *targets, int tdtype, const void *weights,
                                     int64_t N, int64_t V, int64_t ignore);
int tide_cuda_token_logprobs(int dtype, void *logp, void *entropy, void *lse, const void *logits,
                             const void *targets, int tdtype, int64_t N, int64_t V, int64_t ignore);
int tide_cuda_token_logprobs_backward(int dtype, void *dlogits, const void *dlogp, const void *dentropy,
                                      const void *logits, const void *lse, const void *entropy, const void *targets,
                                      int tdtype, int64_t N, int64_t V, int64_t ignore);

/* Kimi Delta Attention (kda.cu) and the causal conv (conv.cu) */
int tide_cuda_kda(int dtype, void *o, void *s_out, const void *q, const void *k, const void *v, const void *g,
                  const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T, int64_t H,
                  int64_t dk, int64_t dv, int path, int64_t chunk, double lb, void *ckpt);
int tide_cuda_kda_backward(int dtype, void *gq, void *gk, void *gv, void *gg, void *gbeta, void *gs0, const void *gout,
                           const void *gs_out, const void *q, const void *k, const void *v, const void *g,
                           const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T,
                           int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk, double lb, const void *ckpt);
/* the collectives for CUDA tensors over NCCL (nccl_comm.cu; backend.h dist_*): fills the table's entries when built
   with NCCL and MPI, leaves them NULL otherwise */
void tide_cuda_dist_entries(tide_backend *t);
/* one KDA decoding step of R rows over their own states (kda_decode.cu; backend.h) */
int tide_cuda_kda_decode_rows(int dtype, void *o, const void *q, const void *k, const void *v, const void *g,
                              const void *beta, void *const *states, int64_t R, int64_t H, int64_t dk, int64_t dv);
int tide_cuda_kda_gate(int dtype, void *g, const void *z, const void *A_log, const void *dt_bias, int64_t N, int64_t H,
                       int64_t D, double lb, int form);
int tide_cuda_kda_gate_backward(int dtype, void *gz, void *gA, void *gb, const void *gg, const void *z,
                                const void *A_log, const void *dt_bias, int64_t N, int64_t H, int64_t D, double lb,
                                int form);
int tide_cuda_causal_conv1d(int dtype, void *out, const void *x, const void *w, const void *cache, const int64_t *cu,
                            int64_t n_seg, int64_t B, int64_t T, int64_t C, int64_t K, int silu);
int tide_cuda_causal_conv1d_backward(int dtype, void *gx, void *gw, void *gcache, const void *gout, const void *x,
                                     const void *w, const void *cache, const int64_t *cu, int64_t n_seg, int64_t B,
                                     int64_t T, int64_t C, int64_t K, int silu);
int tide_cuda_conv_decode_rows(int dtype, void *out, const void *x, const void *w, void *const *caches, int64_t R,
                               int64_t C, int64_t K, int silu);

/* MLA attention (mla.cu) */
int tide_cuda_mla_attention(int dtype, void *out, void *lse, const void *q, const void *kn, const void *kr,
                            const void *v, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk,
                            int64_t H, int64_t dn, int64_t dr, int64_t dv, double scale);
int tide_cuda_mla_attention_backward(int dtype, void *gq, void *gkn, void *gkr, void *gv, const void *gout,
                                     const void *q, const void *kn, const void *kr, const void *v, const void *out,
                                     const void *lse, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq,
                                     int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, double scale);
/* the same read from the latent, keys and values expanded a chunk at a time (mla.cu; backend.h) */
int tide_cuda_mla_latent_attention(int dtype, void *out, void *lse, const void *q, const void *c, const void *kr,
                                   const void *w, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk,
                                   int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc, int64_t chunk,
                                   double scale);
int tide_cuda_mla_latent_attention_backward(int dtype, void *gq, void *gc, void *gkr, void *gw, const void *gout,
                                            const void *q, const void *c, const void *kr, const void *w,
                                            const void *out, const void *lse, const int64_t *cu, int64_t n_seg,
                                            int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr,
                                            int64_t dv, int64_t dc, int64_t chunk, double scale);
/* one absorbed MLA decoding step of R rows over their own latent caches (mla_decode.cu; backend.h) */
int tide_cuda_mla_decode_rows(int dtype, void *out, const void *qt, const void *qr, const void *c_new, const void *kr_new,
                              void *const *c_bufs, void *const *kr_bufs, const int64_t *lens, int64_t R, int64_t H,
                              int64_t dc, int64_t dr, double scale);
/* varlen attention (mla.cu: the MLA kernels, bidirectional inside each segment; backend.h) */
int tide_cuda_varlen_attention(int dtype, void *out, void *lse, const void *q, const void *k, const void *v,
                               const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale);
int tide_cuda_varlen_attention_backward(int dtype, void *gq, void *gk, void *gv, const void *gout, const void *q,
                                        const void *k, const void *v, const void *out, const void *lse,
                                        const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale);
/* mla.cu's flash kernels without documents or rope part, for attention.cu: q [B, Tq, H, D], k, v [B, Tk, H, D],
   out like q (NULL: lse only), lse [B, H, Tq] (fp32 when lse_f32, else the storage type); query i sees keys
   j <= i + off. B, H <= 65535; the backward reads an fp32 lse. */
int tide_cuda_flash_forward(const char *what, int dtype, void *out, void *lse, int lse_f32, const void *q,
                            const void *k, const void *v, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t D,
                            int64_t off, double scale);
int tide_cuda_flash_backward(const char *what, int dtype, void *dq, void *dk, void *dv, const void *dout,
                             const void *q, const void *k, const void *v, const void *out, const float *lse, int64_t B,
                             int64_t Tq, int64_t Tk, int64_t H, int64_t D, int64_t off, double scale);

/* causal softmax attention (attention.cu) */
int tide_cuda_attention(int dtype, void *out, void *lse, const void *q, const void *k, const void *v, int64_t BH,
                        int64_t Tq, int64_t Tk, int64_t D, int causal, double scale);
int tide_cuda_attention_backward(int dtype, void *dq, void *dk, void *dv, const void *dout, const void *q,
                                 const void *k, const void *v, const void *out, const void *lse, int64_t BH,
                                 int64_t Tq, int64_t Tk, int64_t D, int causal, double scale);

/* Attention Residuals (attnres.cu) */
int tide_cuda_attnres(int dtype, void *out, void *stats, const void *const *srcs, int64_t n, int64_t rows, int64_t d,
                      const void *w, const void *nu, double eps);
int tide_cuda_attnres_backward(int dtype, void *const *gsrcs, void *gw, void *gnu, const void *gout, const void *const *srcs,
                               const void *stats, int64_t n, int64_t rows, int64_t d, const void *w, const void *nu);

/* sparse MoE (moe.cu) */
int tide_cuda_situ_glu(int dtype, void *out, const void *g, const void *u, int64_t n, double k_gate, double k_lin);
int tide_cuda_situ_glu_backward(int dtype, void *dg, void *du, const void *dout, const void *g, const void *u, int64_t n,
                                double k_gate, double k_lin);
int tide_cuda_topk(int dtype, void *values, int64_t *indices, const void *x, int64_t rows, int64_t C, int64_t k);
int tide_cuda_moe_experts(int dtype, void *out, int64_t *route, void *pre, void *y, const void *x, const void *sel,
                          int sel_dtype, const void *p, const void *w_gate_up, const void *w_down, int64_t m, int64_t k,
                          int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate, double k_lin,
                          int64_t capacity, int64_t *dropped, int64_t *host_off);
int tide_cuda_moe_experts_backward(int dtype, void *dx, void *dp, void *dw_gate_up, void *dw_down, const void *du,
                                   const int64_t *route, const int64_t *host_off, const void *pre, const void *y,
                                   const void *x, const void *p, const void *w_gate_up, const void *w_down, int64_t m,
                                   int64_t k, int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act,
                                   double k_gate, double k_lin);
#endif

/*
 * attnres.cu — the Attention Residuals mix (spec/attnres.md §1, §4; kernels/backend.h: attnres), f32, bf16 and
 * f64 storage with the arithmetic in fp32 (f64 for f64).
 *
 * One block per row (token) of at most TIDE_AR_THREADS threads (launch.h: its __launch_bounds__ keep the registers
 * of a block within an SM's for every d up to 16,384); each thread holds VPT channels in registers. The forward is the online-softmax
 * form (§3, as vLLM mixes): ONE pass over the n sources, each source's score r_i (a·v_i) from one pair block
 * reduction, the running max and denominator rescaling the accumulator, so no source is read twice and no
 * [n, d] buffer exists. The backward reads each source twice (scores and dp_i first, because ds_i needs
 * Σ_j p_j dp_j; then dv_i). dw and dν share U[c] = Σ_t Σ_i ds_i r_i v_i[t, c] (dw = ν ⊙ U, dν = w ⊙ U): partial
 * sums over fixed row chunks, then the chunks in order — deterministic, no atomics.
 * The host arrays of source pointers are copied to the device for each call.
 */
#include "common.cuh"
#include <stdlib.h>

#define AR_MAX_SOURCES 2048  /* the backward keeps 2n scores in shared memory */

/* x, y summed over the block; every thread gets the same values (warps summed in a fixed order) */
template <typename A> __device__ __forceinline__ void ar_block_sum2(A &x, A &y, A *sh)
{
    for (int o = 16; o > 0; o >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, o);
        y += __shfl_xor_sync(0xffffffffu, y, o);
    }
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sh[wid] = x;
        sh[32 + wid] = y;
    }
    __syncthreads();
    x = A(0);
    y = A(0);
    for (int k = 0; k < nw; k++) {
        x += sh[k];
        y += sh[32 + k];
    }
}

/* P, R: the stats [n, rows] each (p and r) */
template <typename T, int VPT>
__global__ void __launch_bounds__(TIDE_AR_THREADS) attnres_fwd_kernel(T *out, TIDE_ACC(T) *P, TIDE_ACC(T) *R, const T *const *v, int64_t n, int64_t rows,
                                   int64_t d, const T *w, const T *nu, TIDE_ACC(T) eps)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[64];
    A a[VPT];
    for (int k = 0; k < VPT; k++) {
        int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
        a[k] = c < d ? tide_ld(w, c) * tide_ld(nu, c) : A(0);
    }
    for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
        A acc[VPT], m = -INFINITY, l = A(0);
        for (int k = 0; k < VPT; k++) acc[k] = A(0);
        for (int64_t i = 0; i < n; i++) {
            const T *x = v[i] + t * d;
            A xv[VPT], ss = A(0), dot = A(0);
            for (int k = 0; k < VPT; k++) {
                int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
                xv[k] = c < d ? tide_ld(x, c) : A(0);
                ss += xv[k] * xv[k];
                dot += a[k] * xv[k];
            }
            ar_block_sum2(ss, dot, sh);
            A r = A(1) / sqrt(ss / A(d) + eps), s = r * dot;
            A mn = s > m ? s : m, scale = exp(m - mn), e = exp(s - mn);
            for (int k = 0; k < VPT; k++) acc[k] = acc[k] * scale + e * xv[k];
            l = l * scale + e;
            m = mn;
            if (threadIdx.x == 0) {
                P[i * rows + t] = s;     /* the score for now: made a probability below */
                R[i * rows + t] = r;
            }
        }
        A inv = A(1) / l;
        for (int k = 0; k < VPT; k++) {
            int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
            if (c < d) tide_st(out, t * d + c, acc[k] * inv);
        }
        if (threadIdx.x == 0)
            for (int64_t i = 0; i < n; i++) P[i * rows + t] = exp(P[i * rows + t] - m) * inv;
    }
}

/* gv[i] (entries may be NULL) and coef[i, t] = ds_i r_i (NULL: not wanted); dynamic shared memory 2n of A */
template <typename T, int VPT>
__global__ void __launch_bounds__(TIDE_AR_THREADS) attnres_bwd_kernel(T *const *gv, TIDE_ACC(T) *coef, const T *gout, const T *const *v,
                                   const TIDE_ACC(T) *P, const TIDE_ACC(T) *R, int64_t n, int64_t rows, int64_t d,
                                   const T *w, const T *nu)
{
    typedef TIDE_ACC(T) A;
    extern __shared__ double ar_dyn[];
    __shared__ A sh[64];
    A *dps = (A *)ar_dyn, *scs = dps + n;
    A a[VPT], go[VPT];
    for (int k = 0; k < VPT; k++) {
        int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
        a[k] = c < d ? tide_ld(w, c) * tide_ld(nu, c) : A(0);
    }
    for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
        for (int k = 0; k < VPT; k++) {
            int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
            go[k] = c < d ? tide_ld(gout, t * d + c) : A(0);
        }
        A G = A(0);                                   /* Σ_j p_j dp_j */
        for (int64_t i = 0; i < n; i++) {
            const T *x = v[i] + t * d;
            A e = A(0), dot = A(0);
            for (int k = 0; k < VPT; k++) {
                int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
                A xv = c < d ? tide_ld(x, c) : A(0);
                e += go[k] * xv;
                dot += a[k] * xv;
            }
            ar_block_sum2(e, dot, sh);
            G += P[i * rows + t] * e;
            if (threadIdx.x == 0) {
                dps[i] = e;
                scs[i] = R[i * rows + t] * dot;
            }
        }
        __syncthreads();
        for (int64_t i = 0; i < n; i++) {
            A p = P[i * rows + t], r = R[i * rows + t], ds = p * (dps[i] - G);
            if (coef && threadIdx.x == 0) coef[i * rows + t] = ds * r;
            T *g = gv ? gv[i] : NULL;
            if (!g) continue;
            const T *x = v[i] + t * d;
            A kx = ds * scs[i] * r * r / A(d), ka = ds * r;
            for (int k = 0; k < VPT; k++) {
                int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
                if (c < d) tide_st(g, t * d + c, p * go[k] + ka * a[k] - kx * tide_ld(x, c));
            }
        }
        __syncthreads();                              /* dps, scs are rewritten by the next row */
    }
}

/* part[chunk, c] = Σ_{t in chunk} Σ_i coef[i, t] v_i[t, c]; block (32, 8): 32 columns x 8 row lanes */
template <typename T>
__global__ void attnres_rowsum_partial_kernel(TIDE_ACC(T) *part, const TIDE_ACC(T) *coef, const T *const *v, int64_t n,
                                              int64_t rows, int64_t d, int64_t rows_per)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[8][33];
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t c = (int64_t)blockIdx.x * 32 + tx;
    int64_t t0 = (int64_t)blockIdx.y * rows_per, t1 = t0 + rows_per < rows ? t0 + rows_per : rows;
    A acc = A(0);
    if (c < d)
        for (int64_t t = t0 + ty; t < t1; t += 8)
            for (int64_t i = 0; i < n; i++) acc += coef[i * rows + t] * tide_ld(v[i], t * d + c);
    sh[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && c < d) {
        for (int k = 1; k < 8; k++) acc += sh[k][tx];
        part[blockIdx.y * d + c] = acc;
    }
}

template <typename T>
__global__ void attnres_rowsum_final_kernel(T *gw, T *gnu, const TIDE_ACC(T) *part, const T *w, const T *nu, int64_t d,
                                            int nchunks)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(c, d) {
        A u = A(0);
        for (int k = 0; k < nchunks; k++) u += part[(int64_t)k * d + c];
        if (gw) tide_st(gw, c, tide_ld(nu, c) * u);
        if (gnu) tide_st(gnu, c, tide_ld(w, c) * u);
    }
}

/* ---- host side -------------------------------------------------------------------------------------- */

static int ar_check(const char *what, int dtype, int64_t n, int64_t rows, int64_t d)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("%s: dtype %s is not supported on the cuda backend (f32, f64, bf16)", what,
                              tide_cuda_dtype_str(dtype));
    if (n < 1 || rows < 0 || d < 1)
        return tide_set_error("%s: bad sizes n %lld rows %lld d %lld (n, d >= 1)", what, (long long)n, (long long)rows,
                              (long long)d);
    if (n > AR_MAX_SOURCES)
        return tide_set_error("%s: %lld sources, the cuda kernel takes at most %d", what, (long long)n, AR_MAX_SOURCES);
    unsigned th;
    if (!tide_attnres_shape(d, &th))
        return tide_set_error("%s: d = %lld is wider than the cuda kernel's %d channels", what, (long long)d,
                              TIDE_AR_MAX_VPT * TIDE_AR_THREADS);
    return 0;
}

/* a device copy of n host pointers (*dev released by the caller, also on failure) */
static int ar_upload_ptrs(const char *what, const void *const *h, int64_t n, void **dev, cudaStream_t s)
{
    *dev = NULL;
    cudaError_t e = tide_cuda_alloc(dev, (size_t)n * sizeof(void *), s);
    /* staged (tide_cuda_upload): the caller may free h */
    if (e == cudaSuccess) e = tide_cuda_upload(*dev, h, (size_t)n * sizeof(void *), s);
    if (e != cudaSuccess) return tide_set_error("cuda %s source pointers: %s", what, cudaGetErrorString(e));
    return 0;
}

template <typename T, int VPT>
static void ar_launch_fwd(unsigned threads, cudaStream_t s, T *out, TIDE_ACC(T) *P, TIDE_ACC(T) *R, const T *const *v,
                          int64_t n, int64_t rows, int64_t d, const T *w, const T *nu, TIDE_ACC(T) eps)
{
    attnres_fwd_kernel<T, VPT><<<tide_row_blocks(rows), threads, 0, s>>>(out, P, R, v, n, rows, d, w, nu, eps);
}

template <typename T>
static cudaError_t ar_forward_typed(T *out, void *stats, const T *const *v, int64_t n, int64_t rows, int64_t d, const T *w,
                                    const T *nu, double eps, cudaStream_t s)
{
    typedef TIDE_ACC(T) A;
    A *P = (A *)stats, *R = P + n * rows;
    unsigned th = 32;
    switch (tide_attnres_shape(d, &th)) {
    case 1: ar_launch_fwd<T, 1>(th, s, out, P, R, v, n, rows, d, w, nu, (A)eps); break;
    case 2: ar_launch_fwd<T, 2>(th, s, out, P, R, v, n, rows, d, w, nu, (A)eps); break;
    case 4: ar_launch_fwd<T, 4>(th, s, out, P, R, v, n, rows, d, w, nu, (A)eps); break;
    case 8: ar_launch_fwd<T, 8>(th, s, out, P, R, v, n, rows, d, w, nu, (A)eps); break;
    case 16: ar_launch_fwd<T, 16>(th, s, out, P, R, v, n, rows, d, w, nu, (A)eps); break;
    default: ar_launch_fwd<T, 32>(th, s, out, P, R, v, n, rows, d, w, nu, (A)eps); break;
    }
    return cudaGetLastError();
}

int tide_cuda_attnres(int dtype, void *out, void *stats, const void *const *srcs, int64_t n, int64_t rows, int64_t d,
                      const void *w, const void *nu, double eps)
{
    const char *what = "attnres";
    if (ar_check(what, dtype, n, rows, d)) return -1;
    if (rows == 0) return 0;
    TIDE_STREAM(s);
    void *vd = NULL;
    if (ar_upload_ptrs(what, srcs, n, &vd, s)) {
        tide_cuda_release(vd, s);
        return -1;
    }
    cudaError_t e = cudaSuccess;
    TIDE_FLOAT_DISPATCH(dtype, what, {
        e = ar_forward_typed<T>((T *)out, stats, (const T *const *)vd, n, rows, d, (const T *)w, (const T *)nu, eps, s);
    });
    tide_cuda_release(vd, s);
    if (e != cudaSuccess) return tide_set_error("cuda %s kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

template <typename T, int VPT>
static void ar_launch_bwd(unsigned threads, size_t smem, cudaStream_t s, T *const *gv, TIDE_ACC(T) *coef, const T *gout,
                          const T *const *v, const TIDE_ACC(T) *P, const TIDE_ACC(T) *R, int64_t n, int64_t rows,
                          int64_t d, const T *w, const T *nu)
{
    attnres_bwd_kernel<T, VPT><<<tide_row_blocks(rows), threads, smem, s>>>(gv, coef, gout, v, P, R, n, rows, d, w, nu);
}

template <typename T>
static cudaError_t ar_backward_typed(T *const *gv, T *gw, T *gnu, const T *gout, const T *const *v, const void *stats,
                                     int64_t n, int64_t rows, int64_t d, const T *w, const T *nu, cudaStream_t s)
{
    typedef TIDE_ACC(T) A;
    const A *P = (const A *)stats, *R = P + n * rows;
    A *coef = NULL, *part = NULL;
    int want_u = gw || gnu;
    cudaError_t e = want_u ? tide_cuda_alloc((void **)&coef, (size_t)(n * rows) * sizeof(A), s) : cudaSuccess;
    unsigned th = 32;
    size_t smem = (size_t)(2 * n) * sizeof(A);
    if (e == cudaSuccess) {
        switch (tide_attnres_shape(d, &th)) {
        case 1: ar_launch_bwd<T, 1>(th, smem, s, gv, coef, gout, v, P, R, n, rows, d, w, nu); break;
        case 2: ar_launch_bwd<T, 2>(th, smem, s, gv, coef, gout, v, P, R, n, rows, d, w, nu); break;
        case 4: ar_launch_bwd<T, 4>(th, smem, s, gv, coef, gout, v, P, R, n, rows, d, w, nu); break;
        case 8: ar_launch_bwd<T, 8>(th, smem, s, gv, coef, gout, v, P, R, n, rows, d, w, nu); break;
        case 16: ar_launch_bwd<T, 16>(th, smem, s, gv, coef, gout, v, P, R, n, rows, d, w, nu); break;
        default: ar_launch_bwd<T, 32>(th, smem, s, gv, coef, gout, v, P, R, n, rows, d, w, nu); break;
        }
        e = cudaGetLastError();
    }
    if (e == cudaSuccess && want_u) {
        int64_t colblocks = (d + 31) / 32, rows_per = 1;
        int64_t nchunks = tide_colsum_chunks(d, rows, tide_cuda_sm_count(), &rows_per);
        e = tide_cuda_alloc((void **)&part, (size_t)(nchunks * d) * sizeof(A), s);
        if (e == cudaSuccess) {
            attnres_rowsum_partial_kernel<T><<<dim3((unsigned)colblocks, (unsigned)nchunks), dim3(32, 8), 0, s>>>(
                part, coef, v, n, rows, d, rows_per);
            e = cudaGetLastError();
        }
        if (e == cudaSuccess) {
            attnres_rowsum_final_kernel<T><<<tide_blocks(d), TIDE_THREADS, 0, s>>>(gw, gnu, part, w, nu, d, (int)nchunks);
            e = cudaGetLastError();
        }
    }
    tide_cuda_release(part, s);
    tide_cuda_release(coef, s);
    return e;
}

int tide_cuda_attnres_backward(int dtype, void *const *gsrcs, void *gw, void *gnu, const void *gout, const void *const *srcs,
                               const void *stats, int64_t n, int64_t rows, int64_t d, const void *w, const void *nu)
{
    const char *what = "attnres backward";
    if (ar_check(what, dtype, n, rows, d)) return -1;
    TIDE_STREAM(s);
    if (rows == 0) {   /* no rows: the sums are empty */
        size_t es = tide_dtype_size(dtype);
        if (gw) TIDE_CU(cudaMemsetAsync(gw, 0, (size_t)d * es, s), what);
        if (gnu) TIDE_CU(cudaMemsetAsync(gnu, 0, (size_t)d * es, s), what);
        return 0;
    }
    void *vd = NULL, *gd = NULL;
    int rc = ar_upload_ptrs(what, srcs, n, &vd, s);
    if (!rc && gsrcs) rc = ar_upload_ptrs(what, (const void *const *)gsrcs, n, &gd, s);
    cudaError_t e = cudaSuccess;
    if (!rc) {
        TIDE_FLOAT_DISPATCH(dtype, what, {
            e = ar_backward_typed<T>((T *const *)gd, (T *)gw, (T *)gnu, (const T *)gout, (const T *const *)vd, stats, n,
                                     rows, d, (const T *)w, (const T *)nu, s);
        });
    }
    tide_cuda_release(gd, s);
    tide_cuda_release(vd, s);
    if (rc) return -1;
    if (e != cudaSuccess) return tide_set_error("cuda %s: %s", what, cudaGetErrorString(e));
    return 0;
}

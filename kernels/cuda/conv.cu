/*
 * conv.cu — depthwise causal convolution over time with the document resets of packed batches
 * (kda.md §1.2, §8), SiLU fused; forward and backward.
 *
 * x, out [B, T, C], w [C, K], cache [B, K-1, C]: out[b,t,c] = Σ_j w[c,j] x[b, t-K+1+j, c]. A position before
 * the start of t's segment reads 0, except in the first segment of a row, which reads the cache (the last
 * pre-conv inputs of the previous call: decode) before t = 0. The host boundaries cu are copied to the
 * device and each thread finds its segment by binary search.
 * Backward: gy = gout · silu'(a) with the pre-activation a recomputed, then gx (the transposed conv inside
 * the segment), gcache, and gw as per-column sums over tokens in a fixed order (deterministic, no atomics).
 */
#include "common.cuh"
#include <stdlib.h>

/* the segment of token n: the largest s < n_seg with cu[s] <= n (cu non-decreasing from 0) */
__device__ __forceinline__ int64_t conv_segment(const int64_t *cu, int64_t n_seg, int64_t n)
{
    int64_t lo = 0, hi = n_seg - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) >> 1;
        if (cu[mid] <= n) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* the input at flattened position p as seen from a token of the segment starting at ss in row b */
template <typename T>
__device__ __forceinline__ TIDE_ACC(T) conv_in(const T *x, const T *cache, int64_t p, int64_t ss, int64_t b, int64_t T_,
                                              int64_t C, int64_t K, int64_t c)
{
    if (p >= ss) return tide_ld(x, p * C + c);
    if (cache && ss == b * T_) return tide_ld(cache, (b * (K - 1) + (K - 1) + (p - ss)) * C + c);
    return TIDE_ACC(T)(0);
}

/* the pre-activation of token n, channel c */
template <typename T>
__device__ __forceinline__ TIDE_ACC(T) conv_at(const T *x, const T *w, const T *cache, const int64_t *cu, int64_t n_seg,
                                              int64_t n, int64_t c, int64_t T_, int64_t C, int64_t K)
{
    typedef TIDE_ACC(T) A;
    int64_t ss = cu[conv_segment(cu, n_seg, n)], b = n / T_;
    A acc = A(0);
    for (int64_t j = 0; j < K; j++) acc += tide_ld(w, c * K + j) * conv_in(x, cache, n - K + 1 + j, ss, b, T_, C, K, c);
    return acc;
}

template <typename T>
__global__ void conv_kernel(T *out, const T *x, const T *w, const T *cache, const int64_t *cu, int64_t n_seg, int64_t N,
                            int64_t T_, int64_t C, int64_t K, int silu)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(idx, N * C) {
        int64_t n = idx / C, c = idx - n * C;
        A a = conv_at(x, w, cache, cu, n_seg, n, c, T_, C, K);
        tide_st(out, idx, silu ? a / (A(1) + exp(-a)) : a);
    }
}

/* gy = gout · (σ(a) + a σ(a)(1 − σ(a))) under silu (kda.md §6), else gout */
template <typename T>
__global__ void conv_gy_kernel(TIDE_ACC(T) *gy, const T *gout, const T *x, const T *w, const T *cache, const int64_t *cu,
                               int64_t n_seg, int64_t N, int64_t T_, int64_t C, int64_t K, int silu)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(idx, N * C) {
        A go = tide_ld(gout, idx);
        if (silu) {
            int64_t n = idx / C, c = idx - n * C;
            A a = conv_at(x, w, cache, cu, n_seg, n, c, T_, C, K), s = A(1) / (A(1) + exp(-a));
            go *= s + a * s * (A(1) - s);
        }
        gy[idx] = go;
    }
}

/* gx[n, c] = Σ_j w[c, j] gy[n + K-1-j, c] over the outputs of n's own segment */
template <typename T>
__global__ void conv_gx_kernel(T *gx, const TIDE_ACC(T) *gy, const T *w, const int64_t *cu, int64_t n_seg, int64_t N,
                               int64_t C, int64_t K)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(idx, N * C) {
        int64_t n = idx / C, c = idx - n * C, se = cu[conv_segment(cu, n_seg, n) + 1];
        A acc = A(0);
        for (int64_t j = 0; j < K; j++) {
            int64_t t = n + K - 1 - j;
            if (t < se) acc += tide_ld(w, c * K + j) * gy[t * C + c];
        }
        tide_st(gx, idx, acc);
    }
}

/* cache slot m of row b is position m-(K-1) before t = 0: it feeds output t = m - j through tap j, for the
   outputs of the row's first segment */
template <typename T>
__global__ void conv_gcache_kernel(T *gcache, const TIDE_ACC(T) *gy, const T *w, const int64_t *cu, int64_t n_seg,
                                   int64_t B, int64_t T_, int64_t C, int64_t K)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(idx, B * (K - 1) * C) {
        int64_t c = idx % C, m = (idx / C) % (K - 1), b = idx / (C * (K - 1));
        int64_t se = cu[conv_segment(cu, n_seg, b * T_) + 1];
        A acc = A(0);
        for (int64_t j = 0; j <= m; j++) {
            int64_t t = b * T_ + m - j;
            if (t < se) acc += tide_ld(w, c * K + j) * gy[t * C + c];
        }
        tide_st(gcache, idx, acc);
    }
}

/* partial gw over a chunk of tokens: column col = j·C + c; block (32, 8) = 32 columns x 8 row lanes */
template <typename T>
__global__ void conv_gw_partial_kernel(TIDE_ACC(T) *part, const TIDE_ACC(T) *gy, const T *x, const T *cache,
                                       const int64_t *cu, int64_t n_seg, int64_t N, int64_t T_, int64_t C, int64_t K,
                                       int64_t rows_per)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[8][33];
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t col = (int64_t)blockIdx.x * 32 + tx;
    int64_t n0 = (int64_t)blockIdx.y * rows_per, n1 = n0 + rows_per < N ? n0 + rows_per : N;
    A acc = A(0);
    if (col < C * K) {
        int64_t j = col / C, c = col - j * C;
        for (int64_t n = n0 + ty; n < n1; n += 8) {
            int64_t ss = cu[conv_segment(cu, n_seg, n)];
            acc += gy[n * C + c] * conv_in(x, cache, n - K + 1 + j, ss, n / T_, T_, C, K, c);
        }
    }
    sh[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && col < C * K) {
        for (int k = 1; k < 8; k++) acc += sh[k][tx];
        part[blockIdx.y * C * K + col] = acc;
    }
}

template <typename T>
__global__ void conv_gw_final_kernel(T *gw, const TIDE_ACC(T) *part, int64_t C, int64_t K, int nchunks)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(e, C * K) {
        int64_t c = e / K, j = e - c * K;
        A s = A(0);
        for (int k = 0; k < nchunks; k++) s += part[(int64_t)k * C * K + j * C + c];
        tide_st(gw, e, s);
    }
}

/* ---- host side -------------------------------------------------------------------------------------- */

/* checked device copy of the boundaries (NULL cu: one segment per row); *d released by the caller */
static int conv_upload_cu(const char *what, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T_, int64_t **d,
                          int64_t *n_out, cudaStream_t s)
{
    *d = NULL;
    int64_t N = B * T_, n = cu ? n_seg : B;
    if (n < 1) return tide_set_error("%s: %lld segments, expected at least one", what, (long long)n);
    int64_t *h = (int64_t *)malloc((size_t)(n + 1) * sizeof *h);
    if (!h) return tide_set_error("%s: out of host memory for %lld segments", what, (long long)n);
    for (int64_t i = 0; i <= n; i++) h[i] = cu ? cu[i] : i * T_;
    const char *bad = NULL;
    if (h[0] != 0 || h[n] != N) bad = "must run from 0 to B·T";
    for (int64_t i = 0; !bad && i < n; i++) {
        if (h[i + 1] < h[i]) bad = "decreases";
        else if (h[i + 1] > h[i] && (h[i + 1] - 1) / T_ != h[i] / T_) bad = "has a segment crossing a row start";
    }
    if (bad) {
        int64_t first = h[0], last = h[n];
        free(h);
        return tide_set_error("%s: cu_seqlens [%lld .. %lld] (%lld segments, B·T = %lld) %s", what, (long long)first,
                              (long long)last, (long long)n, (long long)N, bad);
    }
    cudaError_t e = tide_cuda_alloc((void **)d, (size_t)(n + 1) * sizeof(int64_t), s);
    /* staged (tide_cuda_upload): h may be freed */
    if (e == cudaSuccess) e = tide_cuda_upload(*d, h, (size_t)(n + 1) * sizeof(int64_t), s);
    free(h);
    if (e != cudaSuccess) return tide_set_error("cuda %s boundaries: %s", what, cudaGetErrorString(e));
    *n_out = n;
    return 0;
}

static int conv_check(const char *what, int64_t B, int64_t T_, int64_t C, int64_t K)
{
    if (B < 0 || T_ < 0 || C < 0 || K < 1)
        return tide_set_error("%s: bad sizes B %lld T %lld C %lld K %lld (K >= 1)", what, (long long)B, (long long)T_,
                              (long long)C, (long long)K);
    return 0;
}

static int conv_dtype_ok(const char *what, int dtype)
{
    if (dtype == TIDE_F32 || dtype == TIDE_F64 || dtype == TIDE_BF16) return 0;
    return tide_set_error("%s: dtype %s is not supported on the cuda backend (f32, f64, bf16)", what,
                          tide_cuda_dtype_str(dtype));
}

int tide_cuda_causal_conv1d(int dtype, void *out, const void *x, const void *w, const void *cache, const int64_t *cu,
                            int64_t n_seg, int64_t B, int64_t T_, int64_t C, int64_t K, int silu)
{
    const char *what = "causal_conv1d";
    if (conv_check(what, B, T_, C, K) || conv_dtype_ok(what, dtype)) return -1;
    if (B * T_ * C == 0) return 0;
    TIDE_STREAM(s);
    int64_t *cu_d = NULL, ns = 0;
    if (conv_upload_cu(what, cu, n_seg, B, T_, &cu_d, &ns, s)) {
        tide_cuda_release(cu_d, s);
        return -1;
    }
    cudaError_t e = cudaSuccess;
    TIDE_FLOAT_DISPATCH(dtype, what, {
        conv_kernel<T><<<tide_blocks(B * T_ * C), TIDE_THREADS, 0, s>>>((T *)out, (const T *)x, (const T *)w,
                                                                       (const T *)cache, cu_d, ns, B * T_, T_, C, K,
                                                                       silu);
        e = cudaGetLastError();
    });
    tide_cuda_release(cu_d, s);
    if (e != cudaSuccess) return tide_set_error("cuda %s kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

template <typename T>
static int conv_backward_typed(T *gx, T *gw, T *gcache, const T *gout, const T *x, const T *w, const T *cache,
                               const int64_t *cu_d, int64_t ns, int64_t B, int64_t T_, int64_t C, int64_t K, int silu,
                               cudaStream_t s)
{
    typedef TIDE_ACC(T) A;
    const char *what = "causal_conv1d backward";
    const int64_t N = B * T_;
    A *gy = NULL, *part = NULL;
    TIDE_CU(tide_cuda_alloc((void **)&gy, (size_t)(N * C) * sizeof(A), s), "causal_conv1d backward scratch alloc");
    conv_gy_kernel<T><<<tide_blocks(N * C), TIDE_THREADS, 0, s>>>(gy, gout, x, w, cache, cu_d, ns, N, T_, C, K, silu);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess && gx) {
        conv_gx_kernel<T><<<tide_blocks(N * C), TIDE_THREADS, 0, s>>>(gx, gy, w, cu_d, ns, N, C, K);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess && gcache && K > 1) {
        conv_gcache_kernel<T><<<tide_blocks(B * (K - 1) * C), TIDE_THREADS, 0, s>>>(gcache, gy, w, cu_d, ns, B, T_, C, K);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess && gw) {
        int64_t colblocks = (C * K + 31) / 32;
        int64_t rows_per = 1, nchunks = tide_colsum_chunks(C * K, N, tide_cuda_sm_count(), &rows_per);
        if (colblocks > INT_MAX) e = cudaErrorInvalidValue;
        if (e == cudaSuccess) e = tide_cuda_alloc((void **)&part, (size_t)(nchunks * C * K) * sizeof(A), s);
        if (e == cudaSuccess) {
            conv_gw_partial_kernel<T><<<dim3((unsigned)colblocks, (unsigned)nchunks), dim3(32, 8), 0, s>>>(
                part, gy, x, cache, cu_d, ns, N, T_, C, K, rows_per);
            e = cudaGetLastError();
        }
        if (e == cudaSuccess) {
            conv_gw_final_kernel<T><<<tide_blocks(C * K), TIDE_THREADS, 0, s>>>(gw, part, C, K, (int)nchunks);
            e = cudaGetLastError();
        }
    }
    tide_cuda_release(part, s);
    tide_cuda_release(gy, s);
    if (e != cudaSuccess) return tide_set_error("cuda %s: %s", what, cudaGetErrorString(e));
    return 0;
}

int tide_cuda_causal_conv1d_backward(int dtype, void *gx, void *gw, void *gcache, const void *gout, const void *x,
                                     const void *w, const void *cache, const int64_t *cu, int64_t n_seg, int64_t B,
                                     int64_t T_, int64_t C, int64_t K, int silu)
{
    const char *what = "causal_conv1d backward";
    if (conv_check(what, B, T_, C, K) || conv_dtype_ok(what, dtype)) return -1;
    if (C == 0) return 0;
    TIDE_STREAM(s);
    size_t es = tide_dtype_size(dtype);
    if (B * T_ == 0) {   /* no tokens: the sums are empty */
        if (gw) TIDE_CU(cudaMemsetAsync(gw, 0, (size_t)(C * K) * es, s), what);
        if (gcache && K > 1) TIDE_CU(cudaMemsetAsync(gcache, 0, (size_t)(B * (K - 1) * C) * es, s), what);
        return 0;
    }
    int64_t *cu_d = NULL, ns = 0;
    if (conv_upload_cu(what, cu, n_seg, B, T_, &cu_d, &ns, s)) {
        tide_cuda_release(cu_d, s);
        return -1;
    }
    int rc = 0;
    TIDE_FLOAT_DISPATCH(dtype, what, {
        rc = conv_backward_typed<T>((T *)gx, (T *)gw, (T *)gcache, (const T *)gout, (const T *)x, (const T *)w,
                                    (const T *)cache, cu_d, ns, B, T_, C, K, silu, s);
    });
    tide_cuda_release(cu_d, s);
    return rc;
}

/* one decoding step of R rows over their own histories h_r [K-1, C] (kernels/backend.h: conv_decode_rows): thread
   (r, c) sums the taps of channel c over the row's history and its token, in tap order as conv_at does, writes the
   output, then shifts its own channel of the history by one token (it alone touches that column: no barrier) */
template <typename T>
__global__ void conv_rows_kernel(T *out, const T *x, const T *w, T *const *caches, int64_t R, int64_t C, int64_t K,
                                 int silu)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(idx, R * C) {
        int64_t r = idx / C, c = idx - r * C;
        T *h = caches[r];
        A acc = A(0);
        for (int64_t j = 0; j < K - 1; j++) acc += tide_ld(w, c * K + j) * tide_ld(h, j * C + c);
        acc += tide_ld(w, c * K + K - 1) * tide_ld(x, idx);
        tide_st(out, idx, silu ? acc / (A(1) + exp(-acc)) : acc);
        for (int64_t j = 0; j + 1 < K - 1; j++) h[j * C + c] = h[(j + 1) * C + c];
        if (K > 1) h[(K - 2) * C + c] = x[idx];
    }
}

int tide_cuda_conv_decode_rows(int dtype, void *out, const void *x, const void *w, void *const *caches, int64_t R,
                               int64_t C, int64_t K, int silu)
{
    const char *what = "conv_decode_rows";
    if (conv_check(what, R, 1, C, K) || conv_dtype_ok(what, dtype)) return -1;
    if (R * C == 0) return 0;
    if (!caches) return tide_set_error("%s: caches is NULL", what);
    for (int64_t r = 0; r < R; r++)
        if (!caches[r] && K > 1) return tide_set_error("%s: row %lld has a NULL history", what, (long long)r);
    TIDE_STREAM(s);
    /* one upload of the R history pointers (staged: tide_cuda_upload) */
    size_t n = (size_t)R * sizeof(void *);
    void *d = NULL;
    cudaError_t e = tide_cuda_alloc(&d, n, s);
    if (e == cudaSuccess) e = tide_cuda_upload(d, caches, n, s);
    if (e != cudaSuccess) {
        tide_cuda_release(d, s);
        return tide_set_error("cuda %s history upload (%zu bytes): %s", what, n, cudaGetErrorString(e));
    }
    TIDE_FLOAT_DISPATCH(dtype, what, {
        conv_rows_kernel<T><<<tide_blocks(R * C), TIDE_THREADS, 0, s>>>((T *)out, (const T *)x, (const T *)w,
                                                                       (T *const *)d, R, C, K, silu);
        e = cudaGetLastError();
    });
    tide_cuda_release(d, s);
    if (e != cudaSuccess) return tide_set_error("cuda %s kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

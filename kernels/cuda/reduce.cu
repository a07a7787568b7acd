/*
 * reduce.cu — reductions over the middle axis of [outer, red, inner] (sum, max, argmax, logsumexp),
 * the gradient of max, and the whole-buffer reductions that answer to the host (sum of squares,
 * all-finite; the index range check is in index.cu).
 *
 * Every reduction combines partial results in a fixed order, so a result depends only on the input
 * and its shape, never on scheduling: runs are reproducible bit for bit.
 */
#include "common.cuh"
#include <math.h>

/* ---- the reduction state: sum in v; max / argmax in (v, i); logsumexp as (max v, scaled sum s) ---- */

template <typename A> struct rstate {
    A v, s;
    long long i;
};

template <typename A> __device__ __forceinline__ rstate<A> rinit(int op)
{
    rstate<A> st;
    st.v = op == TIDE_RED_SUM ? A(0) : A(-INFINITY);
    st.s = A(0);
    st.i = LLONG_MAX;
    return st;
}

/* a beats b: larger value, NaN above everything, ties to the smaller index (the first maximum) */
template <typename A> __device__ __forceinline__ bool rbetter(A av, long long ai, A bv, long long bi)
{
    bool an = av != av, bn = bv != bv;
    if (an || bn) return an && bn ? ai < bi : an;
    if (av != bv) return av > bv;
    return ai < bi;
}

template <typename A> __device__ __forceinline__ rstate<A> rcombine(int op, rstate<A> a, rstate<A> b)
{
    if (op == TIDE_RED_SUM) {
        a.v += b.v;
        return a;
    }
    if (op != TIDE_RED_LOGSUMEXP) return rbetter(b.v, b.i, a.v, a.i) ? b : a;
    /* logsumexp: (m, s) stands for s * exp(m) */
    if (a.v != a.v || b.v != b.v) {
        a.v = A(NAN);
        a.s = A(1);
        return a;
    }
    if (b.v == A(-INFINITY)) return a;
    if (a.v == A(-INFINITY)) return b;
    if (a.v == A(INFINITY) || b.v == A(INFINITY)) {
        a.v = A(INFINITY);
        a.s = A(1);
        return a;
    }
    A m = a.v > b.v ? a.v : b.v;
    a.s = a.s * exp(a.v - m) + b.s * exp(b.v - m);
    a.v = m;
    return a;
}

template <typename A> __device__ __forceinline__ rstate<A> rpush(int op, rstate<A> st, A x, long long r)
{
    rstate<A> e;
    e.v = x;
    e.s = A(1);
    e.i = r;
    return rcombine(op, st, e);
}

template <typename T> __device__ __forceinline__ void rwrite(int op, void *out, int64_t k, rstate<TIDE_ACC(T)> st)
{
    typedef TIDE_ACC(T) A;
    if (op == TIDE_RED_ARGMAX) {
        ((int64_t *)out)[k] = (int64_t)st.i;
        return;
    }
    A v = st.v;
    if (op == TIDE_RED_LOGSUMEXP && v == v && v != A(-INFINITY) && v != A(INFINITY)) v += log(st.s);
    tide_st((T *)out, k, v);
}

/* block (bx, by), bx * by = 256, both powers of two: threads x walk inner, threads y stride over a
   chunk [z rchunk, (z+1) rchunk) of red. With one chunk the block writes the result; with several it
   writes a partial state that reduce_finalize_kernel combines in chunk order. */
template <typename T> __global__ void reduce_kernel(int op, void *out, const T *x, int64_t outer, int64_t red,
                                                    int64_t inner, int64_t rchunk, rstate<TIDE_ACC(T)> *partial)
{
    typedef TIDE_ACC(T) A;
    __shared__ rstate<A> sh[256];
    int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
    int64_t i = (int64_t)blockIdx.x * bx + tx;
    int64_t r0 = (int64_t)blockIdx.z * rchunk, r1 = r0 + rchunk < red ? r0 + rchunk : red;
    for (int64_t o = blockIdx.y; o < outer; o += gridDim.y) {
        rstate<A> st = rinit<A>(op);
        if (i < inner) {
            const T *xo = x + o * red * inner + i;
            for (int64_t r = r0 + ty; r < r1; r += by) st = rpush(op, st, tide_ld(xo, r * inner), (long long)r);
        }
        sh[ty * bx + tx] = st;
        __syncthreads();
        for (int h = by / 2; h > 0; h >>= 1) {
            if (ty < h) sh[ty * bx + tx] = rcombine(op, sh[ty * bx + tx], sh[(ty + h) * bx + tx]);
            __syncthreads();
        }
        if (ty == 0 && i < inner) {
            if (gridDim.z == 1) rwrite<T>(op, out, o * inner + i, sh[tx]);
            else partial[(o * gridDim.z + blockIdx.z) * inner + i] = sh[tx];
        }
        __syncthreads();
    }
}

template <typename T> __global__ void reduce_finalize_kernel(int op, void *out, const rstate<TIDE_ACC(T)> *partial,
                                                             int64_t outer, int64_t inner, int nchunks)
{
    TIDE_GRID_LOOP(k, outer * inner) {
        int64_t o = k / inner, i = k % inner;
        rstate<TIDE_ACC(T)> st = partial[o * nchunks * inner + i];
        for (int z = 1; z < nchunks; z++) st = rcombine(op, st, partial[(o * nchunks + z) * inner + i]);
        rwrite<T>(op, out, k, st);
    }
}

/* block shape for a given inner size: x over inner (up to a warp), y over the reduced axis (launch.h) */
static dim3 reduce_block(int64_t inner)
{
    unsigned bx, by;
    tide_reduce_block(inner, &bx, &by);
    return dim3(bx, by, 1);
}

template <typename T> static int reduce_launch(int op, void *out, const void *x, int64_t outer, int64_t red,
                                               int64_t inner, cudaStream_t s)
{
    typedef rstate<TIDE_ACC(T)> S;
    dim3 block = reduce_block(inner);
    /* too few blocks for the machine and a long reduced axis: the axis is split into chunks (launch.h) */
    int64_t gx, gy, nchunks, rchunk;
    tide_reduce_grid(outer, red, inner, tide_cuda_sm_count(), &gx, &gy, &nchunks, &rchunk);
    if (gx > INT_MAX) return tide_set_error("reduce: inner size %lld too large", (long long)inner);
    dim3 grid((unsigned)gx, (unsigned)gy, (unsigned)nchunks);
    if (nchunks == 1) {
        reduce_kernel<T><<<grid, block, 0, s>>>(op, out, (const T *)x, outer, red, inner, rchunk, (S *)NULL);
        TIDE_CU_LAUNCH("reduce kernel");
        return 0;
    }
    S *partial = NULL;
    TIDE_CU(tide_cuda_alloc((void **)&partial, (size_t)(outer * nchunks * inner) * sizeof(S), s), "reduce scratch alloc");
    reduce_kernel<T><<<grid, block, 0, s>>>(op, out, (const T *)x, outer, red, inner, rchunk, partial);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) {
        reduce_finalize_kernel<T><<<tide_blocks(outer * inner), TIDE_THREADS, 0, s>>>(op, out, partial, outer, inner,
                                                                                      (int)nchunks);
        e = cudaGetLastError();
    }
    tide_cuda_release(partial, s);
    if (e != cudaSuccess) return tide_set_error("cuda reduce kernel: %s", cudaGetErrorString(e));
    return 0;
}

int tide_cuda_reduce(int op, int dtype, void *out, const void *x, int64_t outer, int64_t red, int64_t inner)
{
    if (op < 0 || op >= TIDE_RED_COUNT) return tide_set_error("reduce: unknown op %d", op);
    if (outer <= 0 || inner <= 0) return 0;
    if (red < 0) return tide_set_error("reduce: negative reduced size %lld", (long long)red);
    if (red == 0 && (op == TIDE_RED_MAX || op == TIDE_RED_ARGMAX))
        return tide_set_error("reduce %s: the reduced axis is empty (red = 0)", op == TIDE_RED_MAX ? "max" : "argmax");
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "reduce", { return reduce_launch<T>(op, out, x, outer, red, inner, s); });
    return 0;
}

/* ---- gradient of max: gy goes to the first r where x equals the max y ------------------------------ */

template <typename T> __global__ void reduce_max_backward_kernel(T *gx, const T *gy, const T *x, const T *y,
                                                                 int64_t outer, int64_t red, int64_t inner)
{
    typedef TIDE_ACC(T) A;
    __shared__ long long sh[256];
    int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
    int64_t i = (int64_t)blockIdx.x * bx + tx;
    for (int64_t o = blockIdx.y; o < outer; o += gridDim.y) {
        long long first = LLONG_MAX;
        A yv = A(0), g = A(0);
        if (i < inner) {
            yv = tide_ld(y, o * inner + i);
            g = tide_ld(gy, o * inner + i);
            bool ynan = yv != yv;
            for (int64_t r = ty; r < red; r += by) {
                A xv = tide_ld(x, (o * red + r) * inner + i);
                if (xv == yv || (ynan && xv != xv)) {
                    first = r;
                    break;
                }
            }
        }
        sh[ty * bx + tx] = first;
        __syncthreads();
        for (int h = by / 2; h > 0; h >>= 1) {
            if (ty < h && sh[(ty + h) * bx + tx] < sh[ty * bx + tx]) sh[ty * bx + tx] = sh[(ty + h) * bx + tx];
            __syncthreads();
        }
        first = sh[tx];
        if (i < inner)
            for (int64_t r = ty; r < red; r += by) tide_st(gx, (o * red + r) * inner + i, r == first ? g : A(0));
        __syncthreads();
    }
}

int tide_cuda_reduce_max_backward(int dtype, void *gx, const void *gy, const void *x, const void *y,
                                  int64_t outer, int64_t red, int64_t inner)
{
    if (outer <= 0 || inner <= 0 || red <= 0) return 0;
    TIDE_STREAM(s);
    dim3 block = reduce_block(inner);
    int64_t gxn = (inner + block.x - 1) / block.x;
    if (gxn > INT_MAX) return tide_set_error("reduce max backward: inner size %lld too large", (long long)inner);
    dim3 grid((unsigned)gxn, (unsigned)(outer < 65535 ? outer : 65535), 1);
    TIDE_FLOAT_DISPATCH(dtype, "reduce max backward", {
        reduce_max_backward_kernel<T><<<grid, block, 0, s>>>((T *)gx, (const T *)gy, (const T *)x, (const T *)y,
                                                             outer, red, inner);
        TIDE_CU_LAUNCH("reduce max backward kernel");
    });
    return 0;
}

/* ---- sum of squares in double: per-block partials, then one block sums them in order ------------- */

template <typename T> __global__ void sum_squares_kernel(const T *x, int64_t n, double *partial)
{
    __shared__ double sh[32];
    double acc = 0.0;
    TIDE_GRID_LOOP(i, n) {
        double v = (double)tide_ld(x, i);
        acc += v * v;
    }
    acc = tide_block_reduce(acc, tide_sum_op(), 0.0, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(TIDE_SUM_PARTIALS_THREADS) sum_partials_kernel(const double *partial, int np, double *result)
{
    __shared__ double sh[32];
    double acc = 0.0;
    for (int k = threadIdx.x; k < np; k += blockDim.x) acc += partial[k];
    acc = tide_block_reduce(acc, tide_sum_op(), 0.0, sh);
    if (threadIdx.x == 0) *result = acc;
}

int tide_cuda_sum_squares(int dtype, const void *x, int64_t n, double *out)
{
    *out = 0.0;
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    tide_cuda_scratch *sc;
    if (tide_cuda_get_scratch(&sc)) return -1;
    unsigned nb = tide_blocks(n);
    if (nb > TIDE_CUDA_SCRATCH_PARTIALS) nb = TIDE_CUDA_SCRATCH_PARTIALS;
    TIDE_FLOAT_DISPATCH(dtype, "sum_squares", {
        sum_squares_kernel<T><<<nb, TIDE_THREADS, 0, s>>>((const T *)x, n, sc->partial);
        TIDE_CU_LAUNCH("sum_squares kernel");
    });
    sum_partials_kernel<<<1, TIDE_SUM_PARTIALS_THREADS, 0, s>>>(sc->partial, (int)nb, &sc->result);
    TIDE_CU_LAUNCH("sum_squares final kernel");
    TIDE_CU(cudaMemcpyAsync(out, &sc->result, sizeof(double), cudaMemcpyDeviceToHost, s), "sum_squares copy");
    TIDE_CU(cudaStreamSynchronize(s), "sum_squares (synchronize)");
    if (tide_cuda_deferred_report()) return -1;   /* a check the kernels before deferred (common.cuh) */
    return 0;
}

/* ---- all finite ---------------------------------------------------------------------------------- */

template <typename T> __global__ void all_finite_kernel(const T *x, int64_t n, int *flag)
{
    TIDE_GRID_LOOP(i, n) {
        TIDE_ACC(T) v = tide_ld(x, i);
        if (!isfinite(v)) *flag = 1;   /* every writer stores the same value */
    }
}

int tide_cuda_all_finite(int dtype, const void *x, int64_t n, int *out)
{
    *out = 1;
    if (dtype == TIDE_I32 || dtype == TIDE_I64 || dtype == TIDE_U8) return 0;
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    tide_cuda_scratch *sc;
    if (tide_cuda_get_scratch(&sc)) return -1;
    TIDE_CU(cudaMemsetAsync(&sc->flag, 0, sizeof(int), s), "all_finite (memset)");
    TIDE_FLOAT_DISPATCH(dtype, "all_finite", {
        all_finite_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((const T *)x, n, &sc->flag);
        TIDE_CU_LAUNCH("all_finite kernel");
    });
    int flag = 0;
    TIDE_CU(cudaMemcpyAsync(&flag, &sc->flag, sizeof(int), cudaMemcpyDeviceToHost, s), "all_finite copy");
    TIDE_CU(cudaStreamSynchronize(s), "all_finite (synchronize)");
    if (tide_cuda_deferred_report()) return -1;
    *out = flag ? 0 : 1;
    return 0;
}

/* ---- first non-finite buffer of many: one launch over a table of chunks ------------------------------
   The host cuts every buffer into chunks of FN_CHUNK elements; block b takes chunks b, b + gridDim.x, ...
   and the smallest failing buffer index is kept with atomicMin. The test is on the bits (all-ones exponent),
   so every NaN payload counts. */
#define FN_CHUNK 65536

struct fn_chunk {
    const void *p;
    long long off, len;
    int idx, dtype;
};

__global__ void first_nonfinite_kernel(const fn_chunk *chunks, long long nchunks, unsigned long long *first)
{
    for (long long c = blockIdx.x; c < nchunks; c += gridDim.x) {
        fn_chunk ch = chunks[c];
        if ((unsigned long long)ch.idx >= *first) continue;   /* an earlier buffer already failed */
        int bad = 0;
        for (long long i = ch.off + threadIdx.x; i < ch.off + ch.len; i += blockDim.x) {
            if (ch.dtype == TIDE_F32) {
                unsigned int u = ((const unsigned int *)ch.p)[i];
                bad |= (u & 0x7f800000u) == 0x7f800000u;
            } else if (ch.dtype == TIDE_F64) {
                unsigned long long u = ((const unsigned long long *)ch.p)[i];
                bad |= (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
            } else if (ch.dtype == TIDE_BF16) {
                unsigned short u = ((const unsigned short *)ch.p)[i];
                bad |= (u & 0x7f80u) == 0x7f80u;
            }
        }
        if (__syncthreads_or(bad) && threadIdx.x == 0) atomicMin(first, (unsigned long long)ch.idx);
    }
}

int tide_cuda_first_nonfinite(int n, const int *dtypes, const void *const *ptrs, const int64_t *lens, int *first)
{
    *first = n;
    if (n < 0) return tide_set_error("first_nonfinite: n = %d must be >= 0", n);
    long long nchunks = 0;
    for (int i = 0; i < n; i++) {
        if (lens[i] < 0) return tide_set_error("first_nonfinite: buffer %d has %lld elements", i, (long long)lens[i]);
        if (dtypes[i] == TIDE_F32 || dtypes[i] == TIDE_F64 || dtypes[i] == TIDE_BF16)
            nchunks += (lens[i] + FN_CHUNK - 1) / FN_CHUNK;
    }
    if (nchunks == 0) return 0;
    TIDE_STREAM(s);
    fn_chunk *host = (fn_chunk *)malloc((size_t)nchunks * sizeof *host);
    if (!host) return tide_set_error("first_nonfinite: out of memory for %lld chunks", nchunks);
    long long c = 0;
    for (int i = 0; i < n; i++) {
        if (dtypes[i] != TIDE_F32 && dtypes[i] != TIDE_F64 && dtypes[i] != TIDE_BF16) continue;
        for (long long o = 0; o < lens[i]; o += FN_CHUNK) {
            long long len = lens[i] - o < FN_CHUNK ? lens[i] - o : FN_CHUNK;
            host[c++] = fn_chunk{ptrs[i], o, len, i, dtypes[i]};
        }
    }
    tide_cuda_scratch *sc;
    fn_chunk *dev = NULL;
    unsigned long long found = ULLONG_MAX;
    int rc = -1;
    cudaError_t e = cudaSuccess;
    if (tide_cuda_get_scratch(&sc)) goto done;
    if ((e = tide_cuda_alloc((void **)&dev, (size_t)nchunks * sizeof *dev, s)) != cudaSuccess) {
        tide_set_error("first_nonfinite: cuda malloc of %lld chunk entries: %s", nchunks, cudaGetErrorString(e));
        goto done;
    }
    e = tide_cuda_upload(dev, host, (size_t)nchunks * sizeof *dev, s);
    if (e == cudaSuccess) e = tide_cuda_upload(&sc->first, &found, sizeof found, s);
    if (e == cudaSuccess) {
        long long blocks = nchunks < 4LL * tide_cuda_sm_count() ? nchunks : 4LL * tide_cuda_sm_count();
        first_nonfinite_kernel<<<(unsigned)blocks, TIDE_THREADS, 0, s>>>(dev, nchunks, &sc->first);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaMemcpyAsync(&found, &sc->first, sizeof found, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) {
        tide_set_error("first_nonfinite: %s", cudaGetErrorString(e));
        goto done;
    }
    if (found != ULLONG_MAX) *first = (int)found;
    rc = 0;
done:
    tide_cuda_release(dev, s);
    free(host);
    return rc;
}

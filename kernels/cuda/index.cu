/*
 * index.cu — index_select / index_add (embedding forward and backward), gather / scatter_add, and the
 * range check of index tensors.
 *
 * The op layer validates indices with check_index first; here an index outside its range reads as
 * zero and writes nowhere, so a bad index can never touch memory outside the buffers. The additive
 * kernels use atomics because indices may repeat (a token appearing twice in a batch).
 */
#include "common.cuh"

/* atomics for the storage types; bf16 atomicAdd needs sm_80, which is the oldest target */
__device__ __forceinline__ void tide_atomic_add(float *p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void tide_atomic_add(double *p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void tide_atomic_add(__nv_bfloat16 *p, float v) { atomicAdd(p, __float2bfloat16(v)); }

/* out [outer, n_idx, inner] = x [outer, n_src, inner] at rows idx; U is an unsigned type of the element
   size (selection moves bits, so every dtype works) */
template <typename U> __global__ void index_select_kernel(U *out, const U *x, const void *idx, int is64, int64_t outer,
                                                          int64_t n_src, int64_t inner, int64_t n_idx)
{
    TIDE_GRID_LOOP(k, outer * n_idx * inner) {
        int64_t i = k % inner, j = (k / inner) % n_idx, o = k / (inner * n_idx);
        int64_t r = tide_ld_index(idx, is64, j);
        out[k] = (r >= 0 && r < n_src) ? x[(o * n_src + r) * inner + i] : U(0);
    }
}

template <typename T> __global__ void index_add_kernel(T *gx, const T *gy, const void *idx, int is64, int64_t outer,
                                                       int64_t n_dst, int64_t inner, int64_t n_idx)
{
    TIDE_GRID_LOOP(k, outer * n_idx * inner) {
        int64_t i = k % inner, j = (k / inner) % n_idx, o = k / (inner * n_idx);
        int64_t r = tide_ld_index(idx, is64, j);
        if (r >= 0 && r < n_dst) tide_atomic_add(gx + (o * n_dst + r) * inner + i, tide_ld(gy, k));
    }
}

/* out[o, j, i] = x[o, idx[o, j, i], i] (bits of the element size, like index_select) */
template <typename U> __global__ void gather_kernel(U *out, const U *x, const void *idx, int is64, int64_t outer,
                                                    int64_t n_x, int64_t n_idx, int64_t inner)
{
    TIDE_GRID_LOOP(k, outer * n_idx * inner) {
        int64_t i = k % inner, o = k / (inner * n_idx);
        int64_t r = tide_ld_index(idx, is64, k);
        out[k] = (r >= 0 && r < n_x) ? x[(o * n_x + r) * inner + i] : U(0);
    }
}

/* runs BODY with U bound to the unsigned type of dtype's element size */
#define TIDE_BITS_DISPATCH(dtype, what, ...)                                                        \
    switch (tide_dtype_size(dtype)) {                                                               \
    case 1: { typedef uint8_t U; __VA_ARGS__; } break;                                              \
    case 2: { typedef uint16_t U; __VA_ARGS__; } break;                                             \
    case 4: { typedef uint32_t U; __VA_ARGS__; } break;                                             \
    case 8: { typedef uint64_t U; __VA_ARGS__; } break;                                             \
    default: return tide_set_error("%s: dtype %d is not a tide dtype", (what), (dtype));            \
    }

/* out[o, idx[o, j, i], i] += src[o, j, i] */
template <typename T> __global__ void scatter_add_kernel(T *out, const T *src, const void *idx, int is64,
                                                         int64_t outer, int64_t n_out, int64_t n_idx, int64_t inner)
{
    TIDE_GRID_LOOP(k, outer * n_idx * inner) {
        int64_t i = k % inner, o = k / (inner * n_idx);
        int64_t r = tide_ld_index(idx, is64, k);
        if (r >= 0 && r < n_out) tide_atomic_add(out + (o * n_out + r) * inner + i, tide_ld(src, k));
    }
}

int tide_cuda_index_select(int dtype, void *out, const void *x, const void *idx, int idx_dtype, int64_t outer,
                           int64_t n_src, int64_t inner, int64_t n_idx)
{
    if (tide_cuda_check_index_dtype(idx_dtype, "index_select")) return -1;
    int64_t n = outer * n_idx * inner;
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_BITS_DISPATCH(dtype, "index_select", {
        index_select_kernel<U><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((U *)out, (const U *)x, idx,
                                                                       idx_dtype == TIDE_I64, outer, n_src, inner,
                                                                       n_idx);
        TIDE_CU_LAUNCH("index_select kernel");
    });
    return 0;
}

int tide_cuda_index_add(int dtype, void *gx, const void *gy, const void *idx, int idx_dtype, int64_t outer,
                        int64_t n_dst, int64_t inner, int64_t n_idx)
{
    if (tide_cuda_check_index_dtype(idx_dtype, "index_add")) return -1;
    int64_t n = outer * n_idx * inner;
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "index_add", {
        index_add_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)gx, (const T *)gy, idx, idx_dtype == TIDE_I64,
                                                                    outer, n_dst, inner, n_idx);
        TIDE_CU_LAUNCH("index_add kernel");
    });
    return 0;
}

int tide_cuda_gather(int dtype, void *out, const void *x, const void *idx, int idx_dtype, int64_t outer,
                     int64_t n_x, int64_t n_idx, int64_t inner)
{
    if (tide_cuda_check_index_dtype(idx_dtype, "gather")) return -1;
    int64_t n = outer * n_idx * inner;
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_BITS_DISPATCH(dtype, "gather", {
        gather_kernel<U><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((U *)out, (const U *)x, idx, idx_dtype == TIDE_I64,
                                                                 outer, n_x, n_idx, inner);
        TIDE_CU_LAUNCH("gather kernel");
    });
    return 0;
}

int tide_cuda_scatter_add(int dtype, void *out, const void *src, const void *idx, int idx_dtype, int64_t outer,
                          int64_t n_out, int64_t n_idx, int64_t inner)
{
    if (tide_cuda_check_index_dtype(idx_dtype, "scatter_add")) return -1;
    int64_t n = outer * n_idx * inner;
    if (n <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "scatter_add", {
        scatter_add_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)out, (const T *)src, idx,
                                                                      idx_dtype == TIDE_I64, outer, n_out, n_idx,
                                                                      inner);
        TIDE_CU_LAUNCH("scatter_add kernel");
    });
    return 0;
}

/* ---- index range check: the first offending position wins (atomicMin) -------------------------------- */

__global__ void check_index_kernel(const void *idx, int is64, int64_t count, int64_t n, unsigned long long *first)
{
    TIDE_GRID_LOOP(k, count) {
        int64_t v = tide_ld_index(idx, is64, k);
        if (v < 0 || v >= n) atomicMin(first, (unsigned long long)k);
    }
}

int tide_cuda_check_index(const void *idx, int idx_dtype, int64_t count, int64_t n, int64_t *bad, int *ok)
{
    *ok = 1;
    if (tide_cuda_check_index_dtype(idx_dtype, "check_index")) return -1;
    if (count <= 0) return 0;
    TIDE_STREAM(s);
    tide_cuda_scratch *sc;
    if (tide_cuda_get_scratch(&sc)) return -1;
    TIDE_CU(cudaMemsetAsync(&sc->first, 0xff, sizeof(unsigned long long), s), "check_index (memset)");
    check_index_kernel<<<tide_blocks(count), TIDE_THREADS, 0, s>>>(idx, idx_dtype == TIDE_I64, count, n, &sc->first);
    TIDE_CU_LAUNCH("check_index kernel");
    unsigned long long first = 0;
    TIDE_CU(cudaMemcpyAsync(&first, &sc->first, sizeof first, cudaMemcpyDeviceToHost, s), "check_index copy");
    TIDE_CU(cudaStreamSynchronize(s), "check_index (synchronize)");
    if (first == ULLONG_MAX) return 0;
    *ok = 0;
    if (idx_dtype == TIDE_I64) {
        TIDE_CU(cudaMemcpyAsync(bad, (const int64_t *)idx + first, sizeof(int64_t), cudaMemcpyDeviceToHost, s),
                "check_index copy");
    } else {
        int32_t v = 0;
        TIDE_CU(cudaMemcpyAsync(&v, (const int32_t *)idx + first, sizeof v, cudaMemcpyDeviceToHost, s),
                "check_index copy");
        TIDE_CU(cudaStreamSynchronize(s), "check_index (synchronize)");
        *bad = v;
        return 0;
    }
    TIDE_CU(cudaStreamSynchronize(s), "check_index (synchronize)");
    return 0;
}

/*
 * index.cu — index_select / index_add (embedding forward and backward), gather / scatter_add, and the
 * range check of index tensors.
 *
 * The op layer validates indices with check_index first; here an index outside its range reads as
 * zero and writes nowhere, so a bad index can never touch memory outside the buffers.
 *
 * The additive kernels are deterministic and add in index order, as the CPU does, with no atomics (indices
 * repeat: a token twice in a batch). index_add sorts the positions by destination row (a bitonic sort of
 * (row << 32 | position) keys, so equal rows keep position order) and gives each row's sum to one block: in
 * f32 the result is the CPU's bit for bit; bf16 rows are summed in f32 and rounded once. scatter_add gives each
 * (outer, inner) column to one thread, which adds its positions in order (no two columns share an output);
 * bf16 columns add into an f32 copy.
 */
#include "common.cuh"

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

/* keys[p] = (row << 32) | p for positions with a row in range; the rest (and the padding to n_pad) all ones,
   which sorts last and adds nothing */
__global__ void index_add_keys_kernel(unsigned long long *keys, const void *idx, int is64, int64_t n_idx,
                                      int64_t n_pad, int64_t n_dst)
{
    TIDE_GRID_LOOP(p, n_pad) {
        int64_t r = p < n_idx ? tide_ld_index(idx, is64, p) : -1;
        keys[p] = r >= 0 && r < n_dst ? ((unsigned long long)r << 32) | (unsigned long long)p : ~0ull;
    }
}

/* one (k, j) step of the bitonic sort of n_pad (a power of two) keys into ascending order */
__global__ void bitonic_step_kernel(unsigned long long *keys, int64_t n_pad, int64_t k, int64_t j)
{
    TIDE_GRID_LOOP(i, n_pad) {
        int64_t l = i ^ j;
        if (l > i) {
            unsigned long long a = keys[i], b = keys[l];
            if ((i & k) == 0 ? a > b : a < b) {
                keys[i] = b;
                keys[l] = a;
            }
        }
    }
}

/* block p: if the sorted key at p starts a row's run, the row's sum over the run in position order, every
   (o, i) column of it (gx[o, r, i] += gy[o, j, i], the accumulator in TIDE_ACC(T)) */
template <typename T> __global__ void index_add_rows_kernel(T *gx, const T *gy, const unsigned long long *keys,
                                                            int64_t n_idx, int64_t outer, int64_t n_dst, int64_t inner)
{
    typedef TIDE_ACC(T) A;
    const int64_t p = blockIdx.x;
    const unsigned long long key = keys[p], row = key >> 32;
    if (key == ~0ull || (p > 0 && keys[p - 1] >> 32 == row)) return;
    for (int64_t c = threadIdx.x; c < outer * inner; c += blockDim.x) {
        int64_t o = c / inner, i = c - o * inner;
        T *dst = gx + (o * n_dst + (int64_t)row) * inner + i;
        A acc = tide_ld(dst, 0);
        for (int64_t q = p; q < n_idx; q++) {
            unsigned long long kq = keys[q];
            if (kq >> 32 != row) break;
            acc += tide_ld(gy, (o * n_idx + (int64_t)(kq & 0xffffffffull)) * inner + i);
        }
        tide_st(dst, 0, acc);
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

/* acc[o, idx[o, j, i], i] += src[o, j, i]: thread per (o, i) column, j in order; acc is out itself (f32, f64) or
   its f32 copy (bf16) */
template <typename T, typename A> __global__ void scatter_add_kernel(A *acc, const T *src, const void *idx, int is64,
                                                                     int64_t outer, int64_t n_out, int64_t n_idx,
                                                                     int64_t inner)
{
    TIDE_GRID_LOOP(c, outer * inner) {
        int64_t o = c / inner, i = c - o * inner;
        for (int64_t j = 0; j < n_idx; j++) {
            int64_t k = (o * n_idx + j) * inner + i, r = tide_ld_index(idx, is64, k);
            if (r >= 0 && r < n_out) acc[(o * n_out + r) * inner + i] += (A)tide_ld(src, k);
        }
    }
}

/* bf16 <-> its f32 accumulator */
__global__ void bf16_to_f32_kernel(float *d, const __nv_bfloat16 *s, int64_t n)
{
    TIDE_GRID_LOOP(i, n) d[i] = __bfloat162float(s[i]);
}
__global__ void f32_to_bf16_kernel(__nv_bfloat16 *d, const float *s, int64_t n)
{
    TIDE_GRID_LOOP(i, n) d[i] = __float2bfloat16(s[i]);
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
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("index_add: dtype %s is not supported on the cuda backend (f32, f64, bf16)",
                              tide_cuda_dtype_str(dtype));
    if (n_idx > INT_MAX)
        return tide_set_error("index_add: %lld indices; the cuda backend sorts at most %d", (long long)n_idx, INT_MAX);
    if (n_dst > 0x7fffffffll)
        return tide_set_error("index_add: %lld destination rows; the cuda backend takes at most 2^31 - 1",
                              (long long)n_dst);
    TIDE_STREAM(s);
    const int64_t n_pad = tide_index_sort_len(n_idx);
    unsigned long long *keys = NULL;
    TIDE_CU(tide_cuda_alloc((void **)&keys, (size_t)n_pad * sizeof *keys, s), "index_add (sort keys alloc)");
    index_add_keys_kernel<<<tide_blocks(n_pad), TIDE_THREADS, 0, s>>>(keys, idx, idx_dtype == TIDE_I64, n_idx, n_pad,
                                                                      n_dst);
    cudaError_t e = cudaGetLastError();
    for (int64_t k = 2; k <= n_pad && e == cudaSuccess; k <<= 1)
        for (int64_t j = k >> 1; j > 0 && e == cudaSuccess; j >>= 1) {
            bitonic_step_kernel<<<tide_blocks(n_pad), TIDE_THREADS, 0, s>>>(keys, n_pad, k, j);
            e = cudaGetLastError();
        }
    const unsigned threads = tide_index_rows_threads(outer * inner);
    if (e == cudaSuccess) {
        TIDE_FLOAT_DISPATCH(dtype, "index_add", {
            index_add_rows_kernel<T><<<(unsigned)n_idx, threads, 0, s>>>((T *)gx, (const T *)gy, keys, n_idx, outer,
                                                                        n_dst, inner);
        });
        e = cudaGetLastError();
    }
    tide_cuda_release(keys, s);
    TIDE_CU(e, "index_add kernel");
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
    const int is64 = idx_dtype == TIDE_I64;
    const unsigned blocks = tide_blocks(outer * inner);
    switch (dtype) {
    case TIDE_F32:
        scatter_add_kernel<float, float><<<blocks, TIDE_THREADS, 0, s>>>((float *)out, (const float *)src, idx, is64,
                                                                         outer, n_out, n_idx, inner);
        TIDE_CU_LAUNCH("scatter_add kernel");
        return 0;
    case TIDE_F64:
        scatter_add_kernel<double, double><<<blocks, TIDE_THREADS, 0, s>>>((double *)out, (const double *)src, idx,
                                                                           is64, outer, n_out, n_idx, inner);
        TIDE_CU_LAUNCH("scatter_add kernel");
        return 0;
    case TIDE_BF16: {
        int64_t m = outer * n_out * inner;
        float *acc = NULL;
        TIDE_CU(tide_cuda_alloc((void **)&acc, (size_t)(m ? m : 1) * sizeof(float), s), "scatter_add (f32 sums alloc)");
        bf16_to_f32_kernel<<<tide_blocks(m), TIDE_THREADS, 0, s>>>(acc, (const __nv_bfloat16 *)out, m);
        cudaError_t e = cudaGetLastError();
        if (e == cudaSuccess) {
            scatter_add_kernel<__nv_bfloat16, float><<<blocks, TIDE_THREADS, 0, s>>>(
                acc, (const __nv_bfloat16 *)src, idx, is64, outer, n_out, n_idx, inner);
            e = cudaGetLastError();
        }
        if (e == cudaSuccess) {
            f32_to_bf16_kernel<<<tide_blocks(m), TIDE_THREADS, 0, s>>>((__nv_bfloat16 *)out, acc, m);
            e = cudaGetLastError();
        }
        tide_cuda_release(acc, s);
        TIDE_CU(e, "scatter_add kernel");
        return 0;
    }
    default:
        return tide_set_error("scatter_add: dtype %s is not supported on the cuda backend (f32, f64, bf16)",
                              tide_cuda_dtype_str(dtype));
    }
}

/* ---- index range check: the first offending position wins (atomicMin), its key (base | k) ------------------- */

__global__ void check_index_kernel(const void *idx, int is64, int64_t count, int64_t n, unsigned long long *first,
                                   unsigned long long base)
{
    TIDE_GRID_LOOP(k, count) {
        int64_t v = tide_ld_index(idx, is64, k);
        if (v < 0 || v >= n) atomicMin(first, base | (unsigned long long)k);
    }
}

int tide_cuda_check_index(const char *what, const void *idx, int idx_dtype, int64_t count, int64_t n, int defer,
                          int64_t *bad, int *ok)
{
    *ok = 1;
    if (tide_cuda_check_index_dtype(idx_dtype, "check_index")) return -1;
    if (count <= 0) return 0;
    if (count >= (1ll << TIDE_DEFER_SHIFT))
        return tide_set_error("%s: %lld indices; the cuda check takes fewer than 2^%d", what, (long long)count,
                              TIDE_DEFER_SHIFT);
    TIDE_STREAM(s);
    tide_cuda_scratch *sc;
    if (tide_cuda_get_scratch(&sc)) return -1;
    const int is64 = idx_dtype == TIDE_I64;
    if (defer) {   /* recorded on the device, reported at the next synchronisation (common.cuh) */
        tide_cuda_defer_ctx c = {};
        c.kind = TIDE_DEFER_INDEX;
        snprintf(c.what, sizeof c.what, "%s", what ? what : "index");
        c.n = n;
        unsigned long long base = 0;
        if (tide_cuda_defer_begin(&c, &base)) return -1;
        check_index_kernel<<<tide_blocks(count), TIDE_THREADS, 0, s>>>(idx, is64, count, n, &sc->defer_key, base);
        TIDE_CU_LAUNCH("check_index kernel");
        if (is64) tide_defer_capture_kernel<int64_t><<<1, 32, 0, s>>>(sc, base, (const int64_t *)idx);
        else tide_defer_capture_kernel<int32_t><<<1, 32, 0, s>>>(sc, base, (const int32_t *)idx);
        TIDE_CU_LAUNCH("check_index capture kernel");
        return 0;
    }
    TIDE_CU(cudaMemsetAsync(&sc->first, 0xff, sizeof(unsigned long long), s), "check_index (memset)");
    check_index_kernel<<<tide_blocks(count), TIDE_THREADS, 0, s>>>(idx, is64, count, n, &sc->first, 0);
    TIDE_CU_LAUNCH("check_index kernel");
    unsigned long long first = 0;
    TIDE_CU(cudaMemcpyAsync(&first, &sc->first, sizeof first, cudaMemcpyDeviceToHost, s), "check_index copy");
    TIDE_CU(cudaStreamSynchronize(s), "check_index (synchronize)");
    if (first == ULLONG_MAX) return 0;
    *ok = 0;
    if (is64) {
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

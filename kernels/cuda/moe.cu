/*
 * moe.cu — the sparse MoE kernels on CUDA (spec/moe.md; the CPU twin is kernels/cpu/moe.c, same layouts):
 * SiTU-GLU (§6), top-k over the last dim (§2, ties to the lowest index), and the grouped experts (§8).
 *
 * moe_experts routes with a stable counting sort by (expert, t, slot) on the device, O(m·k + n) work: (1) the
 * assignments, in (t, slot) order, are cut into tiles; a block walks its tile in order, one warp of 32 at a time,
 * and gives each assignment its rank among the tile's earlier ones to the same expert, then writes the tile's
 * count per expert; (2) per expert an exclusive scan over its tile counts, over experts the capacity and an
 * exclusive scan of the kept counts (the segment offsets); (3) row = offset + earlier tiles' count + rank. Every
 * number is a count of the assignments before a given one, so no atomic and no thread schedule enters: the
 * permutation is the CPU's exactly.
 * The offsets come back to the host (the forward's one sync): cuBLAS's grouped GEMM takes the group sizes in host
 * arrays. The forward hands a copy to the op (host_off), which gives it back to the backward: no sync there. A forward
 * that needs no host offsets (no backward follows: the op passes none under no_grad), drops nothing and routes at most
 * TIDE_MOE_DEVICE_ROWS rows (decoding) runs without the sync: moe_rows_gemm_kernel reads the offsets on the device.
 * Each GEMM stage (gate/up; down; backward: dW_down with dh, then dW_gate_up with dX) is ONE
 * cublasGemmGroupedBatchedEx over the experts with rows, one group per expert (bf16 in, fp32 compute, as
 * tide_cuda_gemm). Gather, activation, combine and their backward are row kernels; the combine and dx sum each
 * token's slots in order in fp32: no atomics, bitwise reproducible.
 */
#include "common.cuh"

template <typename A> __device__ __forceinline__ A moe_sig(A x)
{
    if (x >= A(0)) return A(1) / (A(1) + exp(-x));
    A e = exp(x);
    return e / (A(1) + e);
}
template <typename A> __device__ __forceinline__ A moe_act(A g, A u, int act, A k1, A k2)
{
    if (act == TIDE_MOE_SWIGLU) return g * moe_sig(g) * u;
    return k1 * tanh(g / k1) * moe_sig(g) * (k2 * tanh(u / k2));
}
template <typename A> __device__ __forceinline__ void moe_act_grad(A d, A g, A u, int act, A k1, A k2, A *dg, A *du)
{
    A s = moe_sig(g);
    if (act == TIDE_MOE_SWIGLU) { *dg = d * u * s * (A(1) + g * (A(1) - s)); *du = d * g * s; return; }
    A tg = tanh(g / k1), tu = tanh(u / k2);
    *dg = d * (((A(1) - tg * tg) * s + k1 * tg * s * (A(1) - s)) * (k2 * tu));
    *du = d * (k1 * tg * s * (A(1) - tu * tu));
}

/* ---- SiTU-GLU ------------------------------------------------------------------------------------------------ */
template <typename T> __global__ void situ_kernel(T *out, const T *g, const T *u, int64_t n, double k1, double k2)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(i, n) tide_st(out, i, moe_act<A>(tide_ld(g, i), tide_ld(u, i), TIDE_MOE_SITU, (A)k1, (A)k2));
}
template <typename T>
__global__ void situ_backward_kernel(T *dg, T *du, const T *d, const T *g, const T *u, int64_t n, double k1, double k2)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(i, n) {
        A a, b;
        moe_act_grad<A>(tide_ld(d, i), tide_ld(g, i), tide_ld(u, i), TIDE_MOE_SITU, (A)k1, (A)k2, &a, &b);
        tide_st(dg, i, a);
        tide_st(du, i, b);
    }
}

int tide_cuda_situ_glu(int dtype, void *out, const void *g, const void *u, int64_t n, double k_gate, double k_lin)
{
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "situ_glu", {
        situ_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)out, (const T *)g, (const T *)u, n, k_gate, k_lin);
        TIDE_CU_LAUNCH("situ_glu kernel");
    });
    return 0;
}

int tide_cuda_situ_glu_backward(int dtype, void *dg, void *du, const void *dout, const void *g, const void *u, int64_t n,
                                double k_gate, double k_lin)
{
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "situ_glu backward", {
        situ_backward_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)dg, (T *)du, (const T *)dout, (const T *)g,
                                                                         (const T *)u, n, k_gate, k_lin);
        TIDE_CU_LAUNCH("situ_glu backward kernel");
    });
    return 0;
}

/* ---- top-k: one warp per row (coalesced loads), k rounds of a warp argmax -------------------------------------
   The order is the CPU insertion's: larger value first, the earlier index first among equal values; a NaN ranks
   below every number (the CPU's insertion keeps a NaN that arrives while its prefix is not yet full: rows with NaN
   may differ there). Round j takes the best element ranked after round j-1's pick; every lane ends the butterfly
   with the same winner (the order is total). */
template <typename A> __device__ __forceinline__ bool topk_better(A av, int64_t ai, A bv, int64_t bi)
{
    if (ai < 0) return false;
    if (bi < 0) return true;
    bool an = av != av, bn = bv != bv;
    if (an != bn) return bn;
    if (!an && av != bv) return av > bv;
    return ai < bi;
}

template <typename T>
__global__ void __launch_bounds__(TIDE_THREADS) topk_kernel(T *val, int64_t *ind, const T *x, int64_t rows, int64_t C,
                                                            int64_t k)
{
    typedef TIDE_ACC(T) A;
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        const T *xr = x + r * C;
        A pv = A(0);
        int64_t pi = -1;                  /* the previous round's pick; none yet */
        for (int64_t j = 0; j < k; j++) {
            A bv = A(0);
            int64_t bi = -1;
            for (int64_t c = lane; c < C; c += 32) {
                A xc = tide_ld(xr, c);
                if ((pi < 0 || topk_better(pv, pi, xc, c)) && topk_better(xc, c, bv, bi)) {
                    bv = xc;
                    bi = c;
                }
            }
            for (int o = 16; o > 0; o >>= 1) {
                A ov = __shfl_xor_sync(0xffffffffu, bv, o);
                int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (topk_better(ov, oi, bv, bi)) {
                    bv = ov;
                    bi = oi;
                }
            }
            if (lane == 0) {
                val[r * k + j] = xr[bi];
                ind[r * k + j] = bi;
            }
            pv = bv;
            pi = bi;
        }
    }
}

int tide_cuda_topk(int dtype, void *values, int64_t *indices, const void *x, int64_t rows, int64_t C, int64_t k)
{
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "topk", {
        topk_kernel<T><<<tide_blocks(rows * 32), TIDE_THREADS, 0, s>>>((T *)values, indices, (const T *)x, rows, C, k);
        TIDE_CU_LAUNCH("topk kernel");
    });
    return 0;
}

/* ---- routing (§8 step 1): the stable counting sort ------------------------------------------------------------- */
#define MOE_SORT_THREADS 256
/* the tile pass keeps one int count per expert in shared memory, within the default 48 KiB */
#define MOE_SORT_MAX_EXPERTS 12288

/* exclusive scan of one value per thread of the block (blockDim.x = MOE_SORT_THREADS), *total = the block's sum.
   Hillis-Steele in shared memory; integer sums, so the result does not depend on the order of the additions. */
__device__ int64_t moe_block_scan(int64_t v, int64_t *sh, int64_t *total)
{
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int o = 1; o < (int)blockDim.x; o <<= 1) {
        int64_t add = t >= o ? sh[t - o] : 0;
        __syncthreads();
        sh[t] += add;
        __syncthreads();
    }
    int64_t incl = sh[t];
    *total = sh[blockDim.x - 1];
    __syncthreads();   /* sh is reused by the next call */
    return incl - v;
}

/* pass 1, per tile b of ts assignments: rank[a] = the assignments before a in its tile that go to a's expert, and
   tile_count[e, b] (expert-major, [n, tiles]) = the tile's assignments to e. The block takes its tile 32 at a time,
   in order: lanes with the same expert find each other with __match_any_sync (inside the warp, a lane's rank = the
   equal lanes below it), then the warps take turns, one barrier each, reading and advancing hist[e], the tile's
   running count. Ids outside [0, n) stay unrouted (pos −1) rather than index out of bounds: the op checks them on
   the device and reports one at the next synchronisation (check_index, deferred), so every kernel here is safe with
   any id meanwhile. */
__global__ void __launch_bounds__(MOE_SORT_THREADS)
moe_rank_kernel(int32_t *rank, int64_t *tile_count, const void *sel, int is64, int64_t A, int64_t n, int64_t ts,
                int64_t tiles)
{
    extern __shared__ int moe_hist[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
    for (int64_t b = blockIdx.x; b < tiles; b += gridDim.x) {
        for (int64_t e = threadIdx.x; e < n; e += blockDim.x) moe_hist[e] = 0;
        __syncthreads();
        int64_t end = (b + 1) * ts < A ? (b + 1) * ts : A;
        for (int64_t a0 = b * ts; a0 < end; a0 += blockDim.x) {
            int64_t a = a0 + threadIdx.x, id = a < end ? tide_ld_index(sel, is64, a) : -1;
            int key = id >= 0 && id < n ? (int)id : -1;
            unsigned same = __match_any_sync(0xffffffffu, key);
            int below = __popc(same & ((1u << lane) - 1u));
            for (int w = 0; w < nwarp; w++) {
                if (warp == w) {
                    int base = key >= 0 ? moe_hist[key] : 0;
                    __syncwarp();   /* every equal lane has read before the last one advances the count */
                    if (key >= 0 && (same >> lane) == 1u) moe_hist[key] = base + __popc(same);
                    if (key >= 0) rank[a] = base + below;
                }
                __syncthreads();
            }
        }
        for (int64_t e = threadIdx.x; e < n; e += blockDim.x) tile_count[e * tiles + b] = moe_hist[e];
        __syncthreads();   /* before the next tile clears hist */
    }
}

/* pass 2a, a block per expert: tile_count[e, :] becomes its exclusive prefix (the assignments to e in earlier
   tiles) and count[e] the total */
__global__ void __launch_bounds__(MOE_SORT_THREADS)
moe_tile_scan_kernel(int64_t *tile_count, int64_t *count, int64_t n, int64_t tiles)
{
    __shared__ int64_t sh[MOE_SORT_THREADS];
    for (int64_t e = blockIdx.x; e < n; e += gridDim.x) {
        int64_t *row = tile_count + e * tiles, carry = 0, total;
        for (int64_t i0 = 0; i0 < tiles; i0 += blockDim.x) {
            int64_t i = i0 + threadIdx.x, v = i < tiles ? row[i] : 0;
            int64_t ex = moe_block_scan(v, sh, &total);
            if (i < tiles) row[i] = carry + ex;
            carry += total;
        }
        if (threadIdx.x == 0) count[e] = carry;
    }
}

/* pass 2b, one block: each expert keeps its first cap rows (cap < 0: all); off[e] = the exclusive prefix of the kept
   counts, off[n] = the rows kept, off[n + 1] = the assignments dropped */
__global__ void __launch_bounds__(MOE_SORT_THREADS)
moe_offsets_kernel(int64_t *off, const int64_t *count, int64_t n, int64_t cap)
{
    __shared__ int64_t sh[MOE_SORT_THREADS];
    int64_t kept_sum = 0, dropped = 0, total;
    for (int64_t e0 = 0; e0 < n; e0 += blockDim.x) {
        int64_t e = e0 + threadIdx.x, c = e < n ? count[e] : 0, kept = cap >= 0 && c > cap ? cap : c;
        int64_t ex = moe_block_scan(kept, sh, &total);
        if (e < n) off[e] = kept_sum + ex;
        kept_sum += total;
        moe_block_scan(c - kept, sh, &total);
        dropped += total;
    }
    if (threadIdx.x == 0) {
        off[n] = kept_sum;
        off[n + 1] = dropped;
    }
}

/* pass 3: a's place among all assignments to its expert e = the earlier tiles' count + its rank in its tile; kept
   when below the capacity, at row off[e] + place */
__global__ void moe_scatter_kernel(int64_t *perm, int64_t *pos, const void *sel, int is64, const int32_t *rank,
                                   const int64_t *tile_base, const int64_t *off, int64_t A, int64_t n, int64_t ts,
                                   int64_t tiles, int64_t cap)
{
    TIDE_GRID_LOOP(a, A) {
        int64_t e = tide_ld_index(sel, is64, a);
        int64_t r = e >= 0 && e < n ? tile_base[e * tiles + a / ts] + rank[a] : -1;
        if (r < 0 || (cap >= 0 && r >= cap)) {
            pos[a] = -1;
            continue;
        }
        perm[off[e] + r] = a;
        pos[a] = off[e] + r;
    }
}
/* rows past the kept ones: perm = -1 */
__global__ void moe_tail_kernel(int64_t *perm, const int64_t *off, int64_t n, int64_t A)
{
    int64_t R = off[n];
    TIDE_GRID_LOOP(r, A - R) perm[R + r] = -1;
}

/* blocks for a grid-stride loop over `items` block-sized items, at most per_sm per SM */
static unsigned moe_grid(int64_t items, int64_t per_sm)
{
    int64_t cap = (int64_t)tide_cuda_sm_count() * per_sm;
    int64_t b = items < cap ? items : cap;
    return (unsigned)(b < 1 ? 1 : b);
}

/* §8 step 1: route = [perm (A) | pos (A) | off (n + 1)] exactly as kernels/cpu/moe.c builds it, for the A = m·k
   assignments of sel; hoff [n + 2] gets off and the dropped count on the host (one sync), or with hoff NULL
   everything stays on the device (no sync) */
static int moe_sort(int64_t *route, int64_t *hoff, const void *sel, int is64, int64_t A, int64_t n, int64_t cap,
                    cudaStream_t s)
{
    if (n > MOE_SORT_MAX_EXPERTS)
        return tide_set_error("moe_experts: %lld experts exceed the cuda sort's limit of %d (a count per expert in "
                              "48 KiB of shared memory)", (long long)n, MOE_SORT_MAX_EXPERTS);
    /* tiles of at least n assignments: the per-tile counts (n per tile) then cost at most A + n */
    int64_t ipt = (n + MOE_SORT_THREADS - 1) / MOE_SORT_THREADS;
    if (ipt < 4) ipt = 4;
    int64_t ts = ipt * MOE_SORT_THREADS, tiles = (A + ts - 1) / ts;
    int64_t *perm = route, *pos = route + A, *off = route + 2 * A;
    /* scratch: tile counts [n, tiles], count [n], off and dropped [n + 2], then the ranks [A] (int32: < ts) */
    size_t n64 = (size_t)(n * tiles + n + n + 2);
    char *buf = NULL;
    TIDE_CU(tide_cuda_alloc((void **)&buf, n64 * sizeof(int64_t) + (size_t)A * sizeof(int32_t), s), "moe_experts sort alloc");
    int64_t *tile_count = (int64_t *)buf, *count = tile_count + n * tiles, *offx = count + n;
    int32_t *rank = (int32_t *)(offx + n + 2);
    if (tiles > 0)
        moe_rank_kernel<<<moe_grid(tiles, 16), MOE_SORT_THREADS, (size_t)n * sizeof(int), s>>>(rank, tile_count, sel,
                                                                                                 is64, A, n, ts, tiles);
    moe_tile_scan_kernel<<<moe_grid(n, 32), MOE_SORT_THREADS, 0, s>>>(tile_count, count, n, tiles);
    moe_offsets_kernel<<<1, MOE_SORT_THREADS, 0, s>>>(offx, count, n, cap);
    if (A > 0) {
        moe_scatter_kernel<<<tide_blocks(A), TIDE_THREADS, 0, s>>>(perm, pos, sel, is64, rank, tile_count, offx, A, n,
                                                                    ts, tiles, cap);
        moe_tail_kernel<<<tide_blocks(A), TIDE_THREADS, 0, s>>>(perm, offx, n, A);
    }
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemcpyAsync(off, offx, (size_t)(n + 1) * sizeof(int64_t), cudaMemcpyDeviceToDevice, s);
    if (e == cudaSuccess && hoff) e = cudaMemcpyAsync(hoff, offx, (size_t)(n + 2) * sizeof(int64_t), cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess && hoff) e = cudaStreamSynchronize(s);
    tide_cuda_release(buf, s);
    if (e != cudaSuccess) return tide_set_error("cuda moe_experts sort: %s", cudaGetErrorString(e));
    return 0;
}

/* ---- row kernels ---------------------------------------------------------------------------------------------------- */
/* rows past the kept ones (perm -1: an id outside [0, n), which the op's deferred check reports) read zeros */
template <typename T> __global__ void moe_gather_kernel(T *xg, const T *x, const int64_t *perm, int64_t R, int64_t k, int64_t d)
{
    TIDE_GRID_LOOP(i, R * d) {
        int64_t a = perm[i / d];
        if (a >= 0) xg[i] = x[(a / k) * d + i % d];
        else tide_st(xg, i, TIDE_ACC(T)(0));
    }
}
template <typename T>
__global__ void moe_act_kernel(T *h, const T *pre, int64_t R, int64_t de, int act, double k1, double k2)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(i, R * de) {
        int64_t r = i / de, j = i % de;
        tide_st(h, i, moe_act<A>(tide_ld(pre, r * 2 * de + j), tide_ld(pre, r * 2 * de + de + j), act, (A)k1, (A)k2));
    }
}
template <typename T>
__global__ void moe_act_backward_kernel(T *dpre, const T *dh, const T *pre, int64_t R, int64_t de, int act, double k1, double k2)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(i, R * de) {
        int64_t r = i / de, j = i % de;
        A a, b;
        moe_act_grad<A>(tide_ld(dh, i), tide_ld(pre, r * 2 * de + j), tide_ld(pre, r * 2 * de + de + j), act, (A)k1, (A)k2, &a, &b);
        tide_st(dpre, r * 2 * de + j, a);
        tide_st(dpre, r * 2 * de + de + j, b);
    }
}
/* out[t] = Σ_slot p y[pos], slots in order, fp32 (f64 for f64) accumulator */
template <typename T>
__global__ void moe_combine_kernel(T *out, const T *y, const T *p, const int64_t *pos, int64_t m, int64_t k, int64_t d)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(i, m * d) {
        int64_t t = i / d, c = i % d;
        A acc = 0;
        for (int64_t s = 0; s < k; s++) {
            int64_t r = pos[t * k + s];
            if (r >= 0) acc += tide_ld(p, t * k + s) * tide_ld(y, r * d + c);
        }
        tide_st(out, i, acc);
    }
}
template <typename T>
__global__ void moe_dy_kernel(T *dy, const T *du, const T *p, const int64_t *perm, int64_t R, int64_t k, int64_t d)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(i, R * d) {
        int64_t a = perm[i / d];
        tide_st(dy, i, (A)(tide_ld(p, a) * tide_ld(du, (a / k) * d + i % d)));
    }
}
/* dp[a] = du[a / k] · y[pos[a]]: one warp per assignment, its lanes over the d channels (coalesced rows), the
   lanes' partial sums combined by a fixed butterfly (every lane gets the same sum) */
template <typename T>
__global__ void __launch_bounds__(TIDE_THREADS) moe_dp_kernel(T *dp, const T *du, const T *y, const int64_t *pos,
                                                              int64_t A_, int64_t k, int64_t d)
{
    typedef TIDE_ACC(T) A;
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t a = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); a < A_; a += warps) {
        int64_t r = pos[a];
        A acc = 0;
        if (r >= 0)
            for (int64_t c = lane; c < d; c += 32) acc += tide_ld(du, (a / k) * d + c) * tide_ld(y, r * d + c);
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) tide_st(dp, a, acc);
    }
}
template <typename T> __global__ void moe_dx_kernel(T *dx, const T *dxg, const int64_t *pos, int64_t m, int64_t k, int64_t d)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(i, m * d) {
        int64_t t = i / d, c = i % d;
        A acc = 0;
        for (int64_t s = 0; s < k; s++) {
            int64_t r = pos[t * k + s];
            if (r >= 0) acc += tide_ld(dxg, r * d + c);
        }
        tide_st(dx, i, acc);
    }
}


/* C[r, j] = Σ_i A[r, i] W[e, j, i] over the rows r of expert e's segment [off[e], off[e + 1]) (W [n, N, K] row-major:
   a stage's weights, gate/up or down), with the segment bounds read on the device. A block per (expert, tile of
   TIDE_MOE_RG_TILE columns), grid-stride; a warp per TIDE_MOE_RG_COLS columns, its lanes over i (coalesced weight rows),
   TIDE_MOE_RG_ROWS rows per pass, so an active expert's weights are read once per pass and an idle expert's not at
   all; each sum in the accumulation type, lanes combined by a fixed butterfly (the order is fixed: reproducible). */
template <typename T>
__global__ void __launch_bounds__(TIDE_MOE_RG_THREADS)
moe_rows_gemm_kernel(T *C, const T *A_, const T *W, const int64_t *off, int64_t n, int64_t N, int64_t K, int64_t tiles)
{
    typedef TIDE_ACC(T) Acc;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t b = blockIdx.x; b < n * tiles; b += gridDim.x) {
        int64_t e = b / tiles, j0 = (b % tiles) * TIDE_MOE_RG_TILE + (int64_t)warp * TIDE_MOE_RG_COLS;
        int64_t r1 = off[e + 1];
        if (j0 >= N) continue;
        const T *We = W + e * N * K;
        for (int64_t rb = off[e]; rb < r1; rb += TIDE_MOE_RG_ROWS) {
            int nr = r1 - rb < TIDE_MOE_RG_ROWS ? (int)(r1 - rb) : TIDE_MOE_RG_ROWS;
            Acc acc[TIDE_MOE_RG_COLS][TIDE_MOE_RG_ROWS];
            for (int c = 0; c < TIDE_MOE_RG_COLS; c++)
                for (int r = 0; r < TIDE_MOE_RG_ROWS; r++) acc[c][r] = Acc(0);
            for (int64_t i = lane; i < K; i += 32) {
                Acc a[TIDE_MOE_RG_ROWS];
                for (int r = 0; r < TIDE_MOE_RG_ROWS; r++) a[r] = r < nr ? tide_ld(A_, (rb + r) * K + i) : Acc(0);
                for (int c = 0; c < TIDE_MOE_RG_COLS; c++) {
                    if (j0 + c >= N) break;
                    Acc w = tide_ld(We, (j0 + c) * K + i);
                    for (int r = 0; r < TIDE_MOE_RG_ROWS; r++) acc[c][r] += w * a[r];
                }
            }
            for (int c = 0; c < TIDE_MOE_RG_COLS; c++)
                for (int r = 0; r < TIDE_MOE_RG_ROWS; r++) {
                    Acc v = acc[c][r];
                    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (lane == 0 && r < nr && j0 + c < N) tide_st(C, (rb + r) * N + j0 + c, v);
                }
        }
    }
}

static size_t moe_esz(int dtype) { return dtype == TIDE_F64 ? 8 : dtype == TIDE_F32 ? 4 : 2; }
/* element i of a buffer of es-byte elements */
static char *moe_at(const void *base, int64_t i, size_t es) { return (char *)base + (size_t)i * es; }

/* ---- grouped expert GEMMs (§8 step 2) ------------------------------------------------------------------------------ */
/* one product of a stage in the engine's row-major terms, as tide_cuda_gemm: C [M, N] = op(A) op(B) (alpha 1, beta 0) */
struct moe_prod {
    int ta, tb;
    int64_t M, N, K;
    const void *A;
    int64_t lda;
    const void *B;
    int64_t ldb;
    void *C;
    int64_t ldc;
};

/* A stage's products as ONE cublasGemmGroupedBatchedEx, a group of one per product (the row counts differ per
   expert). Row-major to column-major as in gemm.cu: C^T = op(B)^T op(A)^T, so cuBLAS gets (B, A) and (N, M). Sizes,
   leading dimensions, scalars and group sizes are host arrays; the matrix pointer arrays must be in device memory:
   they go to dptr (3·np slots) by a stream-ordered copy whose host source may be freed once cudaMemcpyAsync
   returns (pageable memory is staged first). K = 0 products are zero fills and M or N = 0 ones empty: cuBLAS gets
   neither. bf16 grouped GEMMs need 16-byte aligned matrix pointers (a segment starts r0·ld elements in; with an ld
   that is not a multiple of 8 it may not be): then the stage runs as one tide_cuda_gemm per product instead. So it
   does when cuBLAS has no grouped GEMM: it came with cuBLAS 12.5, and the library loaded at run time may be older
   than the headers the backend was built with. */
#define MOE_GROUPED_CUBLAS 120500   /* cublasGetVersion's encoding of 12.5.0 */
static int moe_grouped_cublas(cublasHandle_t h)
{
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= MOE_GROUPED_CUBLAS
    int v = 0;
    return cublasGetVersion(h, &v) == CUBLAS_STATUS_SUCCESS && v >= MOE_GROUPED_CUBLAS;
#else
    return 0;
#endif
}

static int moe_gemm_grouped(int dtype, const moe_prod *pr, int64_t np, void **dptr, cudaStream_t s, const char *what)
{
    size_t es = moe_esz(dtype);
    int64_t g = 0;
    int aligned = 1;
    for (int64_t i = 0; i < np; i++) {
        const moe_prod *q = pr + i;
        if (q->M > INT_MAX || q->N > INT_MAX || q->K > INT_MAX || q->lda > INT_MAX || q->ldb > INT_MAX || q->ldc > INT_MAX)
            return tide_set_error("%s: a product of [%lld, %lld] x [%lld, %lld] exceeds cuBLAS's 32-bit sizes", what,
                                  (long long)q->M, (long long)q->K, (long long)q->K, (long long)q->N);
        if (q->M == 0 || q->N == 0) continue;
        if (q->K == 0) {
            TIDE_CU(cudaMemset2DAsync(q->C, (size_t)q->ldc * es, 0, (size_t)q->N * es, (size_t)q->M, s), what);
            continue;
        }
        if (dtype == TIDE_BF16 && (((uintptr_t)q->A | (uintptr_t)q->B | (uintptr_t)q->C) & 15)) aligned = 0;
        g++;
    }
    if (g == 0) return 0;
    cublasHandle_t h;
    if (tide_cuda_get_cublas(&h)) return -1;
    if (!aligned || !moe_grouped_cublas(h)) {
        for (int64_t i = 0; i < np; i++) {
            const moe_prod *q = pr + i;
            if (q->M && q->N && q->K &&
                tide_cuda_gemm(dtype, q->ta, q->tb, q->M, q->N, q->K, 1.0, q->A, q->lda, q->B, q->ldb, 0.0, q->C, q->ldc))
                return -1;
        }
        return 0;
    }
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= MOE_GROUPED_CUBLAS
    /* host arrays in one block: pointers [3g] (B, A, C: cuBLAS's order), scalars [2g] (alpha | beta; float or
       double, as the compute type), ops [2g], ints [7g] (m, n, k, lda, ldb, ldc, group size) */
    char *hb = (char *)malloc((size_t)g * (3 * sizeof(void *) + 2 * sizeof(double) + 2 * sizeof(cublasOperation_t) +
                                           7 * sizeof(int)));
    if (!hb) return tide_set_error("%s: out of host memory for %lld products", what, (long long)g);
    void **ptr = (void **)hb;
    double *sd = (double *)(ptr + 3 * g);
    float *sf = (float *)sd;
    cublasOperation_t *op = (cublasOperation_t *)(sd + 2 * g);
    int *iv = (int *)(op + 2 * g);
    int64_t j = 0;
    for (int64_t i = 0; i < np; i++) {
        const moe_prod *q = pr + i;
        if (!q->M || !q->N || !q->K) continue;
        op[j] = q->tb ? CUBLAS_OP_T : CUBLAS_OP_N;       /* first cuBLAS operand: B */
        op[g + j] = q->ta ? CUBLAS_OP_T : CUBLAS_OP_N;   /* second: A */
        iv[j] = (int)q->N;
        iv[g + j] = (int)q->M;
        iv[2 * g + j] = (int)q->K;
        iv[3 * g + j] = (int)q->ldb;
        iv[4 * g + j] = (int)q->lda;
        iv[5 * g + j] = (int)q->ldc;
        iv[6 * g + j] = 1;
        ptr[j] = (void *)q->B;
        ptr[g + j] = (void *)q->A;
        ptr[2 * g + j] = q->C;
        if (dtype == TIDE_F64) { sd[j] = 1.0; sd[g + j] = 0.0; }
        else { sf[j] = 1.0f; sf[g + j] = 0.0f; }
        j++;
    }
    cudaDataType_t type = dtype == TIDE_F64 ? CUDA_R_64F : dtype == TIDE_F32 ? CUDA_R_32F : CUDA_R_16BF;
    cublasComputeType_t compute = dtype == TIDE_F64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
    const void *alpha = dtype == TIDE_F64 ? (const void *)sd : (const void *)sf;
    const void *beta = dtype == TIDE_F64 ? (const void *)(sd + g) : (const void *)(sf + g);
    int rc = 0;
    cudaError_t ce = tide_cuda_upload(dptr, ptr, (size_t)(3 * g) * sizeof(void *), s);
    if (ce != cudaSuccess) rc = tide_set_error("cuda %s pointer arrays: %s", what, cudaGetErrorString(ce));
    else {
        cublasStatus_t st = cublasGemmGroupedBatchedEx(h, op, op + g, iv, iv + g, iv + 2 * g, alpha,
                                                       (const void *const *)dptr, type, iv + 3 * g,
                                                       (const void *const *)(dptr + g), type, iv + 4 * g, beta,
                                                       (void *const *)(dptr + 2 * g), type, iv + 5 * g, (int)g,
                                                       iv + 6 * g, compute);
        if (st != CUBLAS_STATUS_SUCCESS) rc = tide_set_error("cuda %s: %s", what, cublasGetStatusString(st));
    }
    free(hb);
    return rc;
#else
    return 0;   /* not reached: without the grouped GEMM every stage runs as the loop above */
#endif
}

/* one allocation for an entry's scratch: `rows_bytes` of row buffers, then 2 stages x 3·per_stage device pointers */
static int moe_scratch(char **buf, void ***dptr, size_t rows_bytes, int64_t per_stage, cudaStream_t s, const char *what)
{
    size_t head = (rows_bytes + 15) / 16 * 16;
    size_t bytes = head + (size_t)(6 * per_stage) * sizeof(void *);
    if (tide_cuda_alloc((void **)buf, bytes, s) != cudaSuccess)
        return tide_set_error("%s: out of device memory (%zu bytes of scratch)", what, bytes);
    *dptr = (void **)(*buf + head);
    return 0;
}

/* the forward of a decoding-sized batch without a host sync (launch.h: TIDE_MOE_DEVICE_ROWS): dropless, so the rows
   are exactly the m·k assignments and only their split over the experts is unknown on the host; the sort leaves the
   offsets on the device, where moe_rows_gemm_kernel reads them. Gather, activation and combine as below. */
static int moe_experts_device(int dtype, void *out, int64_t *route, void *pre, void *y, const void *x, const void *sel,
                              int sel_dtype, const void *p, const void *w_gate_up, const void *w_down, int64_t m, int64_t k,
                              int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate, double k_lin,
                              int64_t *dropped, cudaStream_t s)
{
    int64_t R = m * k, *perm = route, *pos = route + R, *off = route + 2 * R;
    if (moe_sort(route, NULL, sel, sel_dtype == TIDE_I64, R, n, -1, s)) return -1;
    if (dropped) *dropped = 0;
    if (R == 0 || (m * d_out == 0)) {
        if (m * d_out > 0) TIDE_CU(cudaMemsetAsync(out, 0, (size_t)(m * d_out) * moe_esz(dtype), s), "moe_experts");
        return 0;
    }
    size_t es = moe_esz(dtype);
    char *xg = NULL;
    if (tide_cuda_alloc((void **)&xg, (size_t)R * (size_t)(d_in + d_e) * es, s) != cudaSuccess)
        return tide_set_error("moe_experts: out of device memory (%lld rows of scratch)", (long long)R);
    char *h = moe_at(xg, R * d_in, es);
    int sms = tide_cuda_sm_count();
    int64_t t1 = tide_moe_rows_tiles(2 * d_e), t2 = tide_moe_rows_tiles(d_out);
    TIDE_FLOAT_DISPATCH(dtype, "moe_experts", {
        moe_gather_kernel<T><<<tide_blocks(R * d_in), TIDE_THREADS, 0, s>>>((T *)xg, (const T *)x, perm, R, k, d_in);
        moe_rows_gemm_kernel<T><<<tide_moe_rows_blocks(n, 2 * d_e, sms), TIDE_MOE_RG_THREADS, 0, s>>>(
            (T *)pre, (const T *)xg, (const T *)w_gate_up, off, n, 2 * d_e, d_in, t1);
        moe_act_kernel<T><<<tide_blocks(R * d_e), TIDE_THREADS, 0, s>>>((T *)h, (const T *)pre, R, d_e, act, k_gate, k_lin);
        moe_rows_gemm_kernel<T><<<tide_moe_rows_blocks(n, d_out, sms), TIDE_MOE_RG_THREADS, 0, s>>>(
            (T *)y, (const T *)h, (const T *)w_down, off, n, d_out, d_e, t2);
        moe_combine_kernel<T><<<tide_blocks(m * d_out), TIDE_THREADS, 0, s>>>((T *)out, (const T *)y, (const T *)p, pos, m, k,
                                                                              d_out);
    });
    tide_cuda_release(xg, s);
    TIDE_CU_LAUNCH("moe_experts kernels (no host sync)");
    return 0;
}

int tide_cuda_moe_experts(int dtype, void *out, int64_t *route, void *pre, void *y, const void *x, const void *sel,
                          int sel_dtype, const void *p, const void *w_gate_up, const void *w_down, int64_t m, int64_t k,
                          int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate, double k_lin,
                          int64_t capacity, int64_t *dropped, int64_t *host_off)
{
    if (tide_cuda_check_index_dtype(sel_dtype, "moe_experts")) return -1;
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("moe_experts: dtype %s is not supported on the cuda backend (f32, f64, bf16)",
                              tide_cuda_dtype_str(dtype));
    TIDE_STREAM(s);
    int64_t A_ = m * k, *perm = route, *pos = route + A_;
    if (!host_off && capacity < 0 && A_ <= TIDE_MOE_DEVICE_ROWS)
        return moe_experts_device(dtype, out, route, pre, y, x, sel, sel_dtype, p, w_gate_up, w_down, m, k, n, d_in, d_e,
                                  d_out, act, k_gate, k_lin, dropped, s);
    /* the offsets on the host: the grouped GEMMs take their group sizes from host arrays */
    int64_t *hoff = (int64_t *)malloc((size_t)(n + 2) * sizeof(int64_t));
    moe_prod *pr = (moe_prod *)malloc((size_t)(2 * n) * sizeof(moe_prod));
    if (!hoff || !pr || moe_sort(route, hoff, sel, sel_dtype == TIDE_I64, A_, n, capacity, s)) {
        int rc = !hoff || !pr ? tide_set_error("moe_experts: out of host memory (%lld experts)", (long long)n) : -1;
        free(hoff);
        free(pr);
        return rc;
    }
    if (dropped) *dropped = hoff[n + 1];
    if (host_off) memcpy(host_off, hoff, (size_t)(n + 1) * sizeof(int64_t));
    int64_t R = hoff[n], R1 = R > 0 ? R : 1;
    size_t es = moe_esz(dtype);
    char *xg = NULL, *h;
    void **dptr = NULL;
    if (moe_scratch(&xg, &dptr, (size_t)R1 * (size_t)(d_in + d_e) * es, n, s, "moe_experts")) {
        free(hoff);
        free(pr);
        return -1;
    }
    h = moe_at(xg, R1 * d_in, es);
    /* stage 1: pre_e = xg_e W_gu[e]^T; stage 2: y_e = h_e W_d[e]^T (experts with rows only) */
    int64_t g = 0;
    for (int64_t e = 0; e < n; e++) {
        int64_t r0 = hoff[e], cnt = hoff[e + 1] - hoff[e];
        if (!cnt) continue;
        pr[g] = moe_prod{0, 1, cnt, 2 * d_e, d_in, moe_at(xg, r0 * d_in, es), d_in, moe_at(w_gate_up, e * 2 * d_e * d_in, es),
                         d_in, moe_at(pre, r0 * 2 * d_e, es), 2 * d_e};
        pr[n + g] = moe_prod{0, 1, cnt, d_out, d_e, moe_at(h, r0 * d_e, es), d_e, moe_at(w_down, e * d_out * d_e, es), d_e,
                             moe_at(y, r0 * d_out, es), d_out};
        g++;
    }
    int rc = 0;
    TIDE_FLOAT_DISPATCH(dtype, "moe_experts", {
        if (R > 0)
            moe_gather_kernel<T><<<tide_blocks(R * d_in), TIDE_THREADS, 0, s>>>((T *)xg, (const T *)x, perm, R, k, d_in);
        rc = moe_gemm_grouped(dtype, pr, g, dptr, s, "moe_experts gate/up");
        if (!rc && R > 0)
            moe_act_kernel<T><<<tide_blocks(R * d_e), TIDE_THREADS, 0, s>>>((T *)h, (const T *)pre, R, d_e, act, k_gate,
                                                                             k_lin);
        if (!rc) rc = moe_gemm_grouped(dtype, pr + n, g, dptr + 3 * n, s, "moe_experts down");
        if (!rc && m * d_out > 0)
            moe_combine_kernel<T><<<tide_blocks(m * d_out), TIDE_THREADS, 0, s>>>((T *)out, (const T *)y, (const T *)p, pos, m,
                                                                                   k, d_out);
    });
    tide_cuda_release(xg, s);
    free(hoff);
    free(pr);
    if (rc) return rc;
    TIDE_CU_LAUNCH("moe_experts kernels");
    return 0;
}

int tide_cuda_moe_experts_backward(int dtype, void *dx, void *dp, void *dw_gate_up, void *dw_down, const void *du,
                                   const int64_t *route, const int64_t *host_off, const void *pre, const void *y,
                                   const void *x, const void *p, const void *w_gate_up, const void *w_down, int64_t m,
                                   int64_t k, int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act,
                                   double k_gate, double k_lin)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("moe_experts backward: dtype %s is not supported on the cuda backend (f32, f64, bf16)",
                              tide_cuda_dtype_str(dtype));
    TIDE_STREAM(s);
    int64_t A_ = m * k;
    const int64_t *perm = route, *pos = route + A_, *off = route + 2 * A_;
    /* the group sizes: the forward's host copy when the op kept it, else read back from the route (one sync) */
    int64_t *hoff = (int64_t *)malloc((size_t)(n + 1) * sizeof(int64_t));
    moe_prod *pr = (moe_prod *)malloc((size_t)(4 * n) * sizeof(moe_prod));
    cudaError_t e1 = cudaErrorMemoryAllocation;
    if (hoff && pr && host_off) {
        memcpy(hoff, host_off, (size_t)(n + 1) * sizeof(int64_t));
        e1 = cudaSuccess;
    } else if (hoff && pr) {
        e1 = cudaMemcpyAsync(hoff, off, (size_t)(n + 1) * sizeof(int64_t), cudaMemcpyDeviceToHost, s);
        if (e1 == cudaSuccess) e1 = cudaStreamSynchronize(s);
    }
    if (e1 != cudaSuccess) {
        int rc = !hoff || !pr ? tide_set_error("moe_experts backward: out of host memory (%lld experts)", (long long)n)
                              : tide_set_error("cuda moe_experts backward offsets: %s", cudaGetErrorString(e1));
        free(hoff);
        free(pr);
        return rc;
    }
    int64_t R = hoff[n], R1 = R > 0 ? R : 1;
    size_t es = moe_esz(dtype);
    /* scratch rows: gathered x, h (recomputed from pre), dY, dh, dpre, dX */
    char *buf = NULL;
    void **dptr = NULL;
    if (moe_scratch(&buf, &dptr, (size_t)R1 * (size_t)(2 * d_in + 4 * d_e + d_out) * es, 2 * n, s, "moe_experts backward")) {
        free(hoff);
        free(pr);
        return -1;
    }
    char *xg = buf, *h = moe_at(xg, R1 * d_in, es), *dy = moe_at(h, R1 * d_e, es), *dh = moe_at(dy, R1 * d_out, es);
    char *dpre = moe_at(dh, R1 * d_e, es), *dxg = moe_at(dpre, R1 * 2 * d_e, es);
    const int need_dh = dw_gate_up || dx;
    /* stage 1: dW_d[e] = dY_e^T h_e and dh_e = dY_e W_d[e]; stage 2: dW_gu[e] = dpre_e^T xg_e and dX_e = dpre_e W_gu[e] */
    int64_t g1 = 0, g2 = 0;
    for (int64_t e = 0; e < n; e++) {
        int64_t r0 = hoff[e], cnt = hoff[e + 1] - hoff[e];
        if (!cnt) continue;
        char *dye = moe_at(dy, r0 * d_out, es), *dpe = moe_at(dpre, r0 * 2 * d_e, es);
        if (dw_down)
            pr[g1++] = moe_prod{1, 0, d_out, d_e, cnt, dye, d_out, moe_at(h, r0 * d_e, es), d_e,
                                moe_at(dw_down, e * d_out * d_e, es), d_e};
        if (need_dh)
            pr[g1++] = moe_prod{0, 0, cnt, d_e, d_out, dye, d_out, moe_at(w_down, e * d_out * d_e, es), d_e,
                                moe_at(dh, r0 * d_e, es), d_e};
        if (dw_gate_up)
            pr[2 * n + g2++] = moe_prod{1, 0, 2 * d_e, d_in, cnt, dpe, 2 * d_e, moe_at(xg, r0 * d_in, es), d_in,
                                        moe_at(dw_gate_up, e * 2 * d_e * d_in, es), d_in};
        if (dx)
            pr[2 * n + g2++] = moe_prod{0, 0, cnt, d_in, 2 * d_e, dpe, 2 * d_e, moe_at(w_gate_up, e * 2 * d_e * d_in, es), d_in,
                                        moe_at(dxg, r0 * d_in, es), d_in};
    }
    int rc = 0;
    /* experts without rows get zero weight gradients: one memset per run of such experts */
    for (int64_t e = 0; e < n && !rc;) {
        int64_t e1 = e;
        while (e1 < n && hoff[e1 + 1] == hoff[e1]) e1++;
        if (e1 > e) {
            int64_t nd = d_out * d_e, ngu = 2 * d_e * d_in;
            cudaError_t ce = cudaSuccess;
            if (dw_down) ce = cudaMemsetAsync(moe_at(dw_down, e * nd, es), 0, (size_t)((e1 - e) * nd) * es, s);
            if (dw_gate_up && ce == cudaSuccess)
                ce = cudaMemsetAsync(moe_at(dw_gate_up, e * ngu, es), 0, (size_t)((e1 - e) * ngu) * es, s);
            if (ce != cudaSuccess)
                rc = tide_set_error("cuda moe_experts backward: zeroing the weight gradients of experts %lld..%lld: %s",
                                    (long long)e, (long long)e1 - 1, cudaGetErrorString(ce));
        }
        e = e1 + 1;
    }
    TIDE_FLOAT_DISPATCH(dtype, "moe_experts backward", {
        if (!rc && R > 0) {
            if (dw_gate_up)
                moe_gather_kernel<T><<<tide_blocks(R * d_in), TIDE_THREADS, 0, s>>>((T *)xg, (const T *)x, perm, R, k, d_in);
            if (dw_down)
                moe_act_kernel<T><<<tide_blocks(R * d_e), TIDE_THREADS, 0, s>>>((T *)h, (const T *)pre, R, d_e, act, k_gate,
                                                                                 k_lin);
            if (dw_down || need_dh)
                moe_dy_kernel<T><<<tide_blocks(R * d_out), TIDE_THREADS, 0, s>>>((T *)dy, (const T *)du, (const T *)p, perm, R,
                                                                                  k, d_out);
        }
        if (!rc && dp && A_ > 0)
            moe_dp_kernel<T><<<tide_blocks(A_ * 32), TIDE_THREADS, 0, s>>>((T *)dp, (const T *)du, (const T *)y, pos, A_, k,
                                                                       d_out);
        if (!rc) rc = moe_gemm_grouped(dtype, pr, g1, dptr, s, "moe_experts backward dw_down/dh");
        if (!rc && need_dh && R > 0)
            moe_act_backward_kernel<T><<<tide_blocks(R * d_e), TIDE_THREADS, 0, s>>>((T *)dpre, (const T *)dh, (const T *)pre, R,
                                                                                      d_e, act, k_gate, k_lin);
        if (!rc) rc = moe_gemm_grouped(dtype, pr + 2 * n, g2, dptr + 6 * n, s, "moe_experts backward dw_gate_up/dx");
        if (!rc && dx && m * d_in > 0)
            moe_dx_kernel<T><<<tide_blocks(m * d_in), TIDE_THREADS, 0, s>>>((T *)dx, (const T *)dxg, pos, m, k, d_in);
    });
    tide_cuda_release(buf, s);
    free(hoff);
    free(pr);
    if (rc) return rc;
    TIDE_CU_LAUNCH("moe_experts backward kernels");
    return 0;
}

/*
 * norm.cu — RMSNorm and LayerNorm over the last dim of [N, C], forward and backward.
 *
 * One block owns one row (grid-stride over rows). The weight (and bias) gradients sum over rows: a
 * first kernel writes per-chunk column sums, a second adds them into dw / db in chunk order, so the
 * result is deterministic (no float atomics). Statistics buffers (rstd, mean) have the tensor dtype.
 * RMSNorm(x) = x / sqrt(mean(x²) + eps) ⊙ w (spec/README.md notation).
 */
#include "common.cuh"

template <typename T> __device__ __forceinline__ TIDE_ACC(T) ld_or_one(const T *w, int64_t j)
{
    return w ? tide_ld(w, j) : TIDE_ACC(T)(1);
}

/* ---- RMSNorm --------------------------------------------------------------------------------- */

template <typename T> __global__ void rmsnorm_kernel(T *out, T *rstd, const T *x, const T *w, int64_t N, int64_t C,
                                                     TIDE_ACC(T) eps)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[32];
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        const T *xr = x + row * C;
        A ss = A(0);
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            A v = tide_ld(xr, j);
            ss += v * v;
        }
        ss = tide_block_reduce(ss, tide_sum_op(), A(0), sh);
        A r = A(1) / sqrt(ss / A(C) + eps);
        if (rstd && threadIdx.x == 0) tide_st(rstd, row, r);
        T *orow = out + row * C;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) tide_st(orow, j, tide_ld(xr, j) * r * ld_or_one(w, j));
    }
}

/* dx_j = r w_j g_j - r³ x_j (Σ_k w_k g_k x_k) / C */
template <typename T> __global__ void rmsnorm_backward_kernel(T *dx, const T *dout, const T *x, const T *w,
                                                              const T *rstd, int64_t N, int64_t C)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[32];
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        const T *xr = x + row * C, *gr = dout + row * C;
        A r = tide_ld(rstd, row);
        A dot = A(0);
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) dot += ld_or_one(w, j) * tide_ld(gr, j) * tide_ld(xr, j);
        dot = tide_block_reduce(dot, tide_sum_op(), A(0), sh);
        A c = r * r * r * dot / A(C);
        T *dr = dx + row * C;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
            tide_st(dr, j, r * ld_or_one(w, j) * tide_ld(gr, j) - c * tide_ld(xr, j));
    }
}

/* ---- LayerNorm -------------------------------------------------------------------------------- */

template <typename T> __global__ void layernorm_kernel(T *out, T *mean, T *rstd, const T *x, const T *w, const T *b,
                                                       int64_t N, int64_t C, TIDE_ACC(T) eps)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[32];
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        const T *xr = x + row * C;
        A sum = A(0);
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) sum += tide_ld(xr, j);
        A mu = tide_block_reduce(sum, tide_sum_op(), A(0), sh) / A(C);
        A sq = A(0);   /* two passes: no cancellation from E[x²] - E[x]² */
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            A d = tide_ld(xr, j) - mu;
            sq += d * d;
        }
        A r = A(1) / sqrt(tide_block_reduce(sq, tide_sum_op(), A(0), sh) / A(C) + eps);
        if (threadIdx.x == 0) {
            if (mean) tide_st(mean, row, mu);
            if (rstd) tide_st(rstd, row, r);
        }
        T *orow = out + row * C;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
            tide_st(orow, j, (tide_ld(xr, j) - mu) * r * ld_or_one(w, j) + (b ? tide_ld(b, j) : A(0)));
    }
}

/* xhat = (x - mu) r, gh = g w:  dx = r (gh - mean(gh) - xhat mean(gh xhat)) */
template <typename T> __global__ void layernorm_backward_kernel(T *dx, const T *dout, const T *x, const T *w,
                                                                const T *mean, const T *rstd, int64_t N, int64_t C)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[32];
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        const T *xr = x + row * C, *gr = dout + row * C;
        A mu = tide_ld(mean, row), r = tide_ld(rstd, row);
        A s1 = A(0), s2 = A(0);
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            A gh = tide_ld(gr, j) * ld_or_one(w, j);
            s1 += gh;
            s2 += gh * (tide_ld(xr, j) - mu) * r;
        }
        s1 = tide_block_reduce(s1, tide_sum_op(), A(0), sh) / A(C);
        s2 = tide_block_reduce(s2, tide_sum_op(), A(0), sh) / A(C);
        T *dr = dx + row * C;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            A xh = (tide_ld(xr, j) - mu) * r;
            tide_st(dr, j, r * (tide_ld(gr, j) * ld_or_one(w, j) - s1 - xh * s2));
        }
    }
}

/* ---- weight / bias gradients: dw_j += Σ_n g_nj (x_nj - mu_n) r_n, db_j += Σ_n g_nj --------------------
   mean NULL = RMSNorm (mu = 0). Block (32, 8) covers 32 columns of a chunk of rows. */

template <typename T> __global__ void norm_dw_partial_kernel(TIDE_ACC(T) *pw, TIDE_ACC(T) *pb, const T *dout,
                                                             const T *x, const T *mean, const T *rstd, int64_t N,
                                                             int64_t C, int64_t rows_per)
{
    typedef TIDE_ACC(T) A;
    __shared__ A shw[8][33], shb[8][33];
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t j = (int64_t)blockIdx.x * 32 + tx;
    int64_t n0 = (int64_t)blockIdx.y * rows_per, n1 = n0 + rows_per < N ? n0 + rows_per : N;
    A aw = A(0), ab = A(0);
    if (j < C) {
        for (int64_t n = n0 + ty; n < n1; n += 8) {
            A g = tide_ld(dout, n * C + j);
            A xh = (tide_ld(x, n * C + j) - (mean ? tide_ld(mean, n) : A(0))) * tide_ld(rstd, n);
            aw += g * xh;
            ab += g;
        }
    }
    shw[ty][tx] = aw;
    shb[ty][tx] = ab;
    __syncthreads();
    if (ty == 0 && j < C) {
        for (int k = 1; k < 8; k++) {
            aw += shw[k][tx];
            ab += shb[k][tx];
        }
        pw[blockIdx.y * C + j] = aw;
        if (pb) pb[blockIdx.y * C + j] = ab;
    }
}

template <typename T> __global__ void norm_dw_final_kernel(T *dw, T *db, const TIDE_ACC(T) *pw, const TIDE_ACC(T) *pb,
                                                           int64_t C, int nchunks)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(j, C) {
        A sw = A(0), sb = A(0);
        for (int s = 0; s < nchunks; s++) {
            sw += pw[(int64_t)s * C + j];
            if (pb) sb += pb[(int64_t)s * C + j];
        }
        if (dw) tide_st(dw, j, tide_ld(dw, j) + sw);
        if (db) tide_st(db, j, tide_ld(db, j) + sb);
    }
}

template <typename T> static int norm_dw(const char *what, T *dw, T *db, const T *dout, const T *x, const T *mean,
                                         const T *rstd, int64_t N, int64_t C, cudaStream_t s)
{
    typedef TIDE_ACC(T) A;
    if (!dw && !db) return 0;
    int64_t colblocks = (C + 31) / 32;
    if (colblocks > INT_MAX) return tide_set_error("%s: C %lld too large", what, (long long)C);
    int64_t rows_per = 1, nchunks = tide_colsum_chunks(C, N, tide_cuda_sm_count(), &rows_per);
    A *part = NULL;
    size_t per = (size_t)(nchunks * C);
    TIDE_CU(tide_cuda_alloc((void **)&part, per * (db ? 2 : 1) * sizeof(A), s), "norm backward scratch alloc");
    A *pw = part, *pb = db ? part + per : NULL;
    norm_dw_partial_kernel<T><<<dim3((unsigned)colblocks, (unsigned)nchunks), dim3(32, 8), 0, s>>>(
        pw, pb, dout, x, mean, rstd, N, C, rows_per);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) {
        norm_dw_final_kernel<T><<<tide_blocks(C), TIDE_THREADS, 0, s>>>(dw, db, pw, pb, C, (int)nchunks);
        e = cudaGetLastError();
    }
    tide_cuda_release(part, s);
    if (e != cudaSuccess) return tide_set_error("cuda %s weight gradient kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

/* ---- entries ------------------------------------------------------------------------------------ */

static int rows_ok(const char *what, int64_t N, int64_t C)
{
    if (N < 0 || C < 0) return tide_set_error("%s: negative size N %lld C %lld", what, (long long)N, (long long)C);
    return 0;
}

int tide_cuda_rmsnorm(int dtype, void *out, void *rstd, const void *x, const void *w, int64_t N, int64_t C,
                      double eps)
{
    if (rows_ok("rmsnorm", N, C)) return -1;
    if (N == 0 || C == 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "rmsnorm", {
        rmsnorm_kernel<T><<<tide_row_blocks(N), tide_row_threads(C), 0, s>>>((T *)out, (T *)rstd, (const T *)x,
                                                                             (const T *)w, N, C, (TIDE_ACC(T))eps);
        TIDE_CU_LAUNCH("rmsnorm kernel");
    });
    return 0;
}

int tide_cuda_rmsnorm_backward(int dtype, void *dx, void *dw, const void *dout, const void *x, const void *w,
                               const void *rstd, int64_t N, int64_t C)
{
    if (rows_ok("rmsnorm backward", N, C)) return -1;
    if (N == 0 || C == 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "rmsnorm backward", {
        /* weight gradient first: dx may alias dout */
        if (norm_dw<T>("rmsnorm backward", (T *)dw, (T *)NULL, (const T *)dout, (const T *)x, (const T *)NULL,
                       (const T *)rstd, N, C, s))
            return -1;
        if (dx) {
            rmsnorm_backward_kernel<T><<<tide_row_blocks(N), tide_row_threads(C), 0, s>>>(
                (T *)dx, (const T *)dout, (const T *)x, (const T *)w, (const T *)rstd, N, C);
            TIDE_CU_LAUNCH("rmsnorm backward kernel");
        }
    });
    return 0;
}

int tide_cuda_layernorm(int dtype, void *out, void *mean, void *rstd, const void *x, const void *w, const void *b,
                        int64_t N, int64_t C, double eps)
{
    if (rows_ok("layernorm", N, C)) return -1;
    if (N == 0 || C == 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "layernorm", {
        layernorm_kernel<T><<<tide_row_blocks(N), tide_row_threads(C), 0, s>>>(
            (T *)out, (T *)mean, (T *)rstd, (const T *)x, (const T *)w, (const T *)b, N, C, (TIDE_ACC(T))eps);
        TIDE_CU_LAUNCH("layernorm kernel");
    });
    return 0;
}

int tide_cuda_layernorm_backward(int dtype, void *dx, void *dw, void *db, const void *dout, const void *x,
                                 const void *w, const void *mean, const void *rstd, int64_t N, int64_t C)
{
    if (rows_ok("layernorm backward", N, C)) return -1;
    if (N == 0 || C == 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "layernorm backward", {
        if (norm_dw<T>("layernorm backward", (T *)dw, (T *)db, (const T *)dout, (const T *)x, (const T *)mean,
                       (const T *)rstd, N, C, s))
            return -1;
        if (dx) {
            layernorm_backward_kernel<T><<<tide_row_blocks(N), tide_row_threads(C), 0, s>>>(
                (T *)dx, (const T *)dout, (const T *)x, (const T *)w, (const T *)mean, (const T *)rstd, N, C);
            TIDE_CU_LAUNCH("layernorm backward kernel");
        }
    });
    return 0;
}

/*
 * loss.cu — the fused per-token cross-entropy and token_logprobs (log-prob of the given token, entropy) over
 * [N, V] logits, forward and backward. One block owns one row; arithmetic is fp32 for f32/bf16 (fp64 for f64).
 */
#include "common.cuh"

/* ---- cross-entropy: loss[n] = w_n (lse_n - logits[n, t_n]), valid[n] = w_n; 0 and 0 when ignored ----- */

template <typename T> __global__ void cross_entropy_kernel(T *loss, T *valid, T *lse, const T *logits,
                                                           const void *targets, int t64, const T *weights,
                                                           int64_t N, int64_t V, int64_t ignore,
                                                           unsigned long long *first_bad, unsigned long long base)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[32];
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        const T *xr = logits + row * V;
        A m;
        A l = tide_row_lse(xr, V, &m, sh);
        if (threadIdx.x == 0) {
            int64_t t = tide_ld_index(targets, t64, row);
            A w = weights ? tide_ld(weights, row) : A(1);
            A lv = A(0), vv = A(0);
            if (t == ignore) {
            } else if (t < 0 || t >= V) {
                atomicMin(first_bad, base | (unsigned long long)row);
            } else {
                lv = w * (l - tide_ld(xr, t));
                vv = w;
            }
            if (loss) tide_st(loss, row, lv);
            if (valid) tide_st(valid, row, vv);
            if (lse) tide_st(lse, row, l);
        }
    }
}

/* dlogits[n, j] = dloss[n] w_n (exp(logits[n, j] - lse_n) - [j == t_n]); 0 for ignored rows */
template <typename T> __global__ void cross_entropy_backward_kernel(T *dlogits, const T *dloss, const T *logits,
                                                                    const T *lse, const void *targets, int t64,
                                                                    const T *weights, int64_t N, int64_t V,
                                                                    int64_t ignore)
{
    typedef TIDE_ACC(T) A;
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        int64_t t = tide_ld_index(targets, t64, row);
        bool skip = t == ignore || t < 0 || t >= V;
        A c = skip ? A(0) : tide_ld(dloss, row) * (weights ? tide_ld(weights, row) : A(1));
        A l = tide_ld(lse, row);
        const T *xr = logits + row * V;
        T *dr = dlogits + row * V;
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
            A p = skip ? A(0) : exp(tide_ld(xr, j) - l);
            tide_st(dr, j, c * (p - (j == t ? A(1) : A(0))));
        }
    }
}

/* a target outside [0, V) is the caller's error: recorded on the device and reported, by row and value, at the next
   synchronisation (common.cuh, deferred checks); its row's loss is 0 meanwhile. The record's key for this call: */
static int loss_defer_begin(const char *what, int64_t N, int64_t V, int64_t ignore, unsigned long long *base)
{
    if (N >= (1ll << TIDE_DEFER_SHIFT))
        return tide_set_error("%s: %lld rows; the cuda kernel takes fewer than 2^%d", what, (long long)N,
                              TIDE_DEFER_SHIFT);
    tide_cuda_defer_ctx c = {};
    c.kind = TIDE_DEFER_TARGET;
    snprintf(c.what, sizeof c.what, "%s", what);
    c.n = V;
    c.ignore = ignore;
    return tide_cuda_defer_begin(&c, base);
}

/* behind the kernel: the offending target's value, when this call's key is the record's */
static int loss_defer_capture(tide_cuda_scratch *sc, unsigned long long base, const void *targets, int tdtype,
                              cudaStream_t s)
{
    if (tdtype == TIDE_I64) tide_defer_capture_kernel<int64_t><<<1, 32, 0, s>>>(sc, base, (const int64_t *)targets);
    else tide_defer_capture_kernel<int32_t><<<1, 32, 0, s>>>(sc, base, (const int32_t *)targets);
    TIDE_CU_LAUNCH("target check capture kernel");
    return 0;
}

int tide_cuda_cross_entropy(int dtype, void *loss, void *valid, void *lse, const void *logits, const void *targets,
                            int tdtype, const void *weights, int64_t N, int64_t V, int64_t ignore)
{
    if (tide_cuda_check_index_dtype(tdtype, "cross_entropy targets")) return -1;
    if (N <= 0) return 0;
    if (V <= 0) return tide_set_error("cross_entropy: vocabulary size must be positive, got %lld", (long long)V);
    TIDE_STREAM(s);
    tide_cuda_scratch *sc;
    if (tide_cuda_get_scratch(&sc)) return -1;
    /* a target outside [0, V): deferred (loss_defer_begin) */
    unsigned long long base = 0;
    if (loss_defer_begin("cross_entropy", N, V, ignore, &base)) return -1;
    TIDE_FLOAT_DISPATCH(dtype, "cross_entropy", {
        cross_entropy_kernel<T><<<tide_row_blocks(N), tide_row_threads(V), 0, s>>>(
            (T *)loss, (T *)valid, (T *)lse, (const T *)logits, targets, tdtype == TIDE_I64, (const T *)weights, N,
            V, ignore, &sc->defer_key, base);
        TIDE_CU_LAUNCH("cross_entropy kernel");
    });
    return loss_defer_capture(sc, base, targets, tdtype, s);
}

int tide_cuda_cross_entropy_backward(int dtype, void *dlogits, const void *dloss, const void *logits, const void *lse,
                                     const void *targets, int tdtype, const void *weights, int64_t N, int64_t V,
                                     int64_t ignore)
{
    if (tide_cuda_check_index_dtype(tdtype, "cross_entropy backward targets")) return -1;
    if (N <= 0 || V <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "cross_entropy backward", {
        cross_entropy_backward_kernel<T><<<tide_row_blocks(N), tide_row_threads(V), 0, s>>>(
            (T *)dlogits, (const T *)dloss, (const T *)logits, (const T *)lse, targets, tdtype == TIDE_I64,
            (const T *)weights, N, V, ignore);
        TIDE_CU_LAUNCH("cross_entropy backward kernel");
    });
    return 0;
}

/* ---- token_logprobs: logp[n] = logits[n, t_n] - lse_n, entropy[n] = log s - u / s (kernels/cpu/loss.c) ---------
   One block owns one row: the row max, then s = Σ exp(d), u = Σ exp(d) d with d = x - max, in A (fp32 for f32/bf16,
   fp64 for f64); logp, entropy and lse are stored as A (f32 for bf16 logits). */
template <typename T> __global__ void token_logprobs_kernel(TIDE_ACC(T) *logp, TIDE_ACC(T) *ent, TIDE_ACC(T) *lse,
                                                            const T *logits, const void *targets, int t64, int64_t N,
                                                            int64_t V, int64_t ignore, unsigned long long *first_bad,
                                                            unsigned long long base)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[32];
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        const T *xr = logits + row * V;
        A m = A(-INFINITY);
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = tide_max_op()(m, tide_ld(xr, j));
        m = tide_block_reduce(m, tide_max_op(), A(-INFINITY), sh);
        A shift = (m == A(-INFINITY) || m == A(INFINITY)) ? A(0) : m;   /* an all -inf row: lse -inf, not NaN */
        A s = A(0), u = A(0);
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
            A d = tide_ld(xr, j) - shift, e = exp(d);
            s += e;
            u += e > A(0) ? e * d : A(0);                              /* a -inf logit adds nothing */
        }
        s = tide_block_reduce(s, tide_sum_op(), A(0), sh);
        u = tide_block_reduce(u, tide_sum_op(), A(0), sh);
        if (threadIdx.x == 0) {
            int64_t t = tide_ld_index(targets, t64, row);
            A ls = log(s), l = shift + ls, lv = A(0), hv = A(0);
            if (t == ignore) {
            } else if (t < 0 || t >= V) {
                atomicMin(first_bad, base | (unsigned long long)row);
            } else {
                lv = tide_ld(xr, t) - l;
                hv = ls - u / s;
            }
            logp[row] = lv;
            ent[row] = hv;
            lse[row] = l;
        }
    }
}

/* dlogits[n, j] = dlogp[n] ([j == t_n] - p_j) - dentropy[n] p_j (log p_j + entropy[n]); 0 for ignored rows */
template <typename T> __global__ void token_logprobs_backward_kernel(T *dlogits, const TIDE_ACC(T) *dlogp,
                                                                     const TIDE_ACC(T) *dent, const T *logits,
                                                                     const TIDE_ACC(T) *lse, const TIDE_ACC(T) *ent,
                                                                     const void *targets, int t64, int64_t N, int64_t V,
                                                                     int64_t ignore)
{
    typedef TIDE_ACC(T) A;
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        int64_t t = tide_ld_index(targets, t64, row);
        bool skip = t == ignore || t < 0 || t >= V;
        A a = (skip || !dlogp) ? A(0) : dlogp[row], b = (skip || !dent) ? A(0) : dent[row];
        A l = lse[row], H = ent[row];
        const T *xr = logits + row * V;
        T *dr = dlogits + row * V;
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
            A lp = tide_ld(xr, j) - l, p = skip ? A(0) : exp(lp);
            A g = -a * p - b * (p > A(0) ? p * (lp + H) : A(0)) + (j == t ? a : A(0));
            tide_st(dr, j, g);
        }
    }
}

int tide_cuda_token_logprobs(int dtype, void *logp, void *entropy, void *lse, const void *logits, const void *targets,
                             int tdtype, int64_t N, int64_t V, int64_t ignore)
{
    if (tide_cuda_check_index_dtype(tdtype, "token_logprobs targets")) return -1;
    if (N <= 0) return 0;
    if (V <= 0) return tide_set_error("token_logprobs: vocabulary size must be positive, got %lld", (long long)V);
    TIDE_STREAM(s);
    tide_cuda_scratch *sc;
    if (tide_cuda_get_scratch(&sc)) return -1;
    /* a target outside [0, V): deferred like cross_entropy's */
    unsigned long long base = 0;
    if (loss_defer_begin("token_logprobs", N, V, ignore, &base)) return -1;
    TIDE_FLOAT_DISPATCH(dtype, "token_logprobs", {
        typedef TIDE_ACC(T) A;
        token_logprobs_kernel<T><<<tide_row_blocks(N), tide_row_threads(V), 0, s>>>(
            (A *)logp, (A *)entropy, (A *)lse, (const T *)logits, targets, tdtype == TIDE_I64, N, V, ignore,
            &sc->defer_key, base);
        TIDE_CU_LAUNCH("token_logprobs kernel");
    });
    return loss_defer_capture(sc, base, targets, tdtype, s);
}

int tide_cuda_token_logprobs_backward(int dtype, void *dlogits, const void *dlogp, const void *dentropy,
                                      const void *logits, const void *lse, const void *entropy, const void *targets,
                                      int tdtype, int64_t N, int64_t V, int64_t ignore)
{
    if (tide_cuda_check_index_dtype(tdtype, "token_logprobs backward targets")) return -1;
    if (N <= 0 || V <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "token_logprobs backward", {
        typedef TIDE_ACC(T) A;
        token_logprobs_backward_kernel<T><<<tide_row_blocks(N), tide_row_threads(V), 0, s>>>(
            (T *)dlogits, (const A *)dlogp, (const A *)dentropy, (const T *)logits, (const A *)lse,
            (const A *)entropy, targets, tdtype == TIDE_I64, N, V, ignore);
        TIDE_CU_LAUNCH("token_logprobs backward kernel");
    });
    return 0;
}

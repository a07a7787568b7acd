/*
 * moe.cu — the sparse MoE kernels on CUDA (spec/moe.md; the CPU twin is kernels/cpu/moe.c, same layouts):
 * SiTU-GLU (§6), top-k over the last dim (§2, ties to the lowest index), and the grouped experts (§8).
 *
 * moe_experts: the stable sort by expert is built on the device with one thread per expert scanning the
 * assignments in (t, slot) order (O(n·m·k) work, no atomics: simple and exactly the CPU order; a prefix-sum sort
 * is the upgrade when n·m·k gets large). The segment offsets come back to the host (one sync) to size one
 * cuBLAS product per expert segment (tide_cuda_gemm: bf16 in, fp32 compute). Gather, activation, combine and
 * their backward are row kernels; the combine and dx sum each token's slots in order in fp32: no atomics,
 * bitwise reproducible.
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

/* ---- top-k: one thread per row, insertion into the sorted prefix (strictly greater displaces) ------------------ */
template <typename T> __global__ void topk_kernel(T *val, int64_t *ind, const T *x, int64_t rows, int64_t C, int64_t k)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(r, rows) {
        T *v = val + r * k;
        int64_t *id = ind + r * k, have = 0;
        for (int64_t c = 0; c < C; c++) {
            A xc = tide_ld(x, r * C + c);
            if (have == k && !(xc > tide_ld(v, k - 1))) continue;
            int64_t j = have < k ? have++ : k - 1;
            while (j > 0 && xc > tide_ld(v, j - 1)) { v[j] = v[j - 1]; id[j] = id[j - 1]; j--; }
            v[j] = x[r * C + c];
            id[j] = c;
        }
    }
}

int tide_cuda_topk(int dtype, void *values, int64_t *indices, const void *x, int64_t rows, int64_t C, int64_t k)
{
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "topk", {
        topk_kernel<T><<<tide_blocks(rows), TIDE_THREADS, 0, s>>>((T *)values, indices, (const T *)x, rows, C, k);
        TIDE_CU_LAUNCH("topk kernel");
    });
    return 0;
}

/* ---- routing (§8 step 1) ------------------------------------------------------------------------------------------ */
__global__ void moe_count_kernel(int64_t *count, const void *sel, int is64, int64_t A, int64_t n)
{
    TIDE_GRID_LOOP(e, n) {
        int64_t c = 0;
        for (int64_t a = 0; a < A; a++) c += tide_ld_index(sel, is64, a) == e;
        count[e] = c;
    }
}
/* offsets with the capacity (one thread: n is small); dropped total into off[n + 1] */
__global__ void moe_offsets_kernel(int64_t *off, const int64_t *count, int64_t n, int64_t cap)
{
    if (blockIdx.x || threadIdx.x) return;
    int64_t acc = 0, dropped = 0;
    for (int64_t e = 0; e < n; e++) {
        int64_t kept = cap >= 0 && count[e] > cap ? cap : count[e];
        off[e] = acc;
        acc += kept;
        dropped += count[e] - kept;
    }
    off[n] = acc;
    off[n + 1] = dropped;
}
__global__ void moe_fill_kernel(int64_t *perm, int64_t *pos, const int64_t *off, const void *sel, int is64, int64_t A,
                                int64_t n)
{
    TIDE_GRID_LOOP(e, n) {
        int64_t r = off[e], end = off[e + 1];
        for (int64_t a = 0; a < A; a++)
            if (tide_ld_index(sel, is64, a) == e) {
                if (r < end) { perm[r] = a; pos[a] = r++; }
                else pos[a] = -1;
            }
    }
}
__global__ void moe_tail_kernel(int64_t *perm, const int64_t *off, int64_t n, int64_t A)
{
    int64_t R = off[n];
    TIDE_GRID_LOOP(r, A - R) perm[R + r] = -1;
}

/* ---- row kernels ---------------------------------------------------------------------------------------------------- */
template <typename T> __global__ void moe_gather_kernel(T *xg, const T *x, const int64_t *perm, int64_t R, int64_t k, int64_t d)
{
    TIDE_GRID_LOOP(i, R * d) xg[i] = x[(perm[i / d] / k) * d + i % d];
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
template <typename T>
__global__ void moe_dp_kernel(T *dp, const T *du, const T *y, const int64_t *pos, int64_t A_, int64_t k, int64_t d)
{
    typedef TIDE_ACC(T) A;
    TIDE_GRID_LOOP(a, A_) {
        int64_t r = pos[a];
        A acc = 0;
        if (r >= 0) for (int64_t c = 0; c < d; c++) acc += tide_ld(du, (a / k) * d + c) * tide_ld(y, r * d + c);
        tide_st(dp, a, acc);
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

static size_t moe_esz(int dtype) { return dtype == TIDE_F64 ? 8 : dtype == TIDE_F32 ? 4 : 2; }

int tide_cuda_moe_experts(int dtype, void *out, int64_t *route, void *pre, void *y, const void *x, const void *sel,
                          int sel_dtype, const void *p, const void *w_gate_up, const void *w_down, int64_t m, int64_t k,
                          int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate, double k_lin,
                          int64_t capacity, int64_t *dropped)
{
    if (tide_cuda_check_index_dtype(sel_dtype, "moe_experts")) return -1;
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("moe_experts: dtype %s is not supported on the cuda backend (f32, f64, bf16)", tide_cuda_dtype_str(dtype));
    TIDE_STREAM(s);
    int64_t A_ = m * k, *perm = route, *pos = route + A_, *off = route + 2 * A_;
    int is64 = sel_dtype == TIDE_I64;
    /* off has n + 1 entries in route; counts and the dropped total live in a scratch [n + 2] */
    int64_t *tmp = NULL;
    TIDE_CU(tide_cuda_alloc((void **)&tmp, (size_t)(2 * n + 2) * sizeof(int64_t), s), "moe_experts alloc");
    int64_t *count = tmp, *offx = tmp + n;
    moe_count_kernel<<<tide_blocks(n), TIDE_THREADS, 0, s>>>(count, sel, is64, A_, n);
    moe_offsets_kernel<<<1, 32, 0, s>>>(offx, count, n, capacity);
    moe_fill_kernel<<<tide_blocks(n), TIDE_THREADS, 0, s>>>(perm, pos, offx, sel, is64, A_, n);
    moe_tail_kernel<<<tide_blocks(A_ > 0 ? A_ : 1), TIDE_THREADS, 0, s>>>(perm, offx, n, A_);
    TIDE_CU_LAUNCH("moe_experts routing kernels");
    int64_t *hoff = (int64_t *)malloc((size_t)(n + 2) * sizeof(int64_t));
    if (!hoff) { tide_cuda_release(tmp, s); return tide_set_error("moe_experts: out of host memory"); }
    cudaError_t e1 = cudaMemcpyAsync(off, offx, (size_t)(n + 1) * sizeof(int64_t), cudaMemcpyDeviceToDevice, s);
    cudaError_t e2 = e1 == cudaSuccess ? cudaMemcpyAsync(hoff, offx, (size_t)(n + 2) * sizeof(int64_t), cudaMemcpyDeviceToHost, s) : e1;
    cudaError_t e3 = e2 == cudaSuccess ? cudaStreamSynchronize(s) : e2;
    tide_cuda_release(tmp, s);
    if (e3 != cudaSuccess) { free(hoff); return tide_set_error("cuda moe_experts offsets: %s", cudaGetErrorString(e3)); }
    if (dropped) *dropped = hoff[n + 1];
    int64_t R = hoff[n];
    size_t es = moe_esz(dtype);
    char *xg = NULL, *h = NULL;
    int rc = 0;
    if (tide_cuda_alloc((void **)&xg, (size_t)(R > 0 ? R : 1) * (size_t)(d_in + d_e) * es, s) != cudaSuccess) {
        free(hoff);
        return tide_set_error("moe_experts: out of device memory for %lld rows", (long long)R);
    }
    h = xg + (size_t)(R * d_in) * es;
    TIDE_FLOAT_DISPATCH(dtype, "moe_experts", {
        if (R > 0) moe_gather_kernel<T><<<tide_blocks(R * d_in), TIDE_THREADS, 0, s>>>((T *)xg, (const T *)x, perm, R, k, d_in);
        for (int64_t e = 0; e < n && !rc; e++) {
            int64_t r0 = hoff[e], cnt = hoff[e + 1] - hoff[e];
            if (!cnt) continue;
            T *pe = (T *)pre + r0 * 2 * d_e, *he = (T *)h + r0 * d_e;
            rc = tide_cuda_gemm(dtype, 0, 1, cnt, 2 * d_e, d_in, 1.0, (const T *)xg + r0 * d_in, d_in,
                                (const T *)w_gate_up + e * 2 * d_e * d_in, d_in, 0.0, pe, 2 * d_e);
            if (rc) break;
            moe_act_kernel<T><<<tide_blocks(cnt * d_e), TIDE_THREADS, 0, s>>>(he, pe, cnt, d_e, act, k_gate, k_lin);
            rc = tide_cuda_gemm(dtype, 0, 1, cnt, d_out, d_e, 1.0, he, d_e, (const T *)w_down + e * d_out * d_e, d_e, 0.0,
                                (T *)y + r0 * d_out, d_out);
        }
        if (!rc && m * d_out > 0)
            moe_combine_kernel<T><<<tide_blocks(m * d_out), TIDE_THREADS, 0, s>>>((T *)out, (const T *)y, (const T *)p, pos, m,
                                                                                   k, d_out);
    });
    tide_cuda_release(xg, s);
    free(hoff);
    if (rc) return rc;
    TIDE_CU_LAUNCH("moe_experts kernels");
    return 0;
}

int tide_cuda_moe_experts_backward(int dtype, void *dx, void *dp, void *dw_gate_up, void *dw_down, const void *du,
                                   const int64_t *route, const void *pre, const void *y, const void *x, const void *p,
                                   const void *w_gate_up, const void *w_down, int64_t m, int64_t k, int64_t n,
                                   int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate, double k_lin)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("moe_experts backward: dtype %s is not supported on the cuda backend (f32, f64, bf16)",
                              tide_cuda_dtype_str(dtype));
    TIDE_STREAM(s);
    int64_t A_ = m * k;
    const int64_t *perm = route, *pos = route + A_, *off = route + 2 * A_;
    int64_t *hoff = (int64_t *)malloc((size_t)(n + 1) * sizeof(int64_t));
    if (!hoff) return tide_set_error("moe_experts backward: out of host memory");
    cudaError_t e1 = cudaMemcpyAsync(hoff, off, (size_t)(n + 1) * sizeof(int64_t), cudaMemcpyDeviceToHost, s);
    if (e1 == cudaSuccess) e1 = cudaStreamSynchronize(s);
    if (e1 != cudaSuccess) { free(hoff); return tide_set_error("cuda moe_experts backward offsets: %s", cudaGetErrorString(e1)); }
    int64_t R = hoff[n], R1 = R > 0 ? R : 1;
    size_t es = moe_esz(dtype);
    char *buf = NULL;
    if (tide_cuda_alloc((void **)&buf, (size_t)R1 * (size_t)(2 * d_in + 4 * d_e + d_out) * es, s) != cudaSuccess) {
        free(hoff);
        return tide_set_error("moe_experts backward: out of device memory for %lld rows", (long long)R);
    }
    char *xg = buf, *h = xg + (size_t)(R1 * d_in) * es, *dy = h + (size_t)(R1 * d_e) * es;
    char *dh = dy + (size_t)(R1 * d_out) * es, *dpre = dh + (size_t)(R1 * d_e) * es, *dxg = dpre + (size_t)(R1 * 2 * d_e) * es;
    int rc = 0;
    TIDE_FLOAT_DISPATCH(dtype, "moe_experts backward", {
        if (R > 0) {
            moe_gather_kernel<T><<<tide_blocks(R * d_in), TIDE_THREADS, 0, s>>>((T *)xg, (const T *)x, perm, R, k, d_in);
            moe_act_kernel<T><<<tide_blocks(R * d_e), TIDE_THREADS, 0, s>>>((T *)h, (const T *)pre, R, d_e, act, k_gate, k_lin);
            moe_dy_kernel<T><<<tide_blocks(R * d_out), TIDE_THREADS, 0, s>>>((T *)dy, (const T *)du, (const T *)p, perm, R, k, d_out);
        }
        if (dp && A_ > 0)
            moe_dp_kernel<T><<<tide_blocks(A_), TIDE_THREADS, 0, s>>>((T *)dp, (const T *)du, (const T *)y, pos, A_, k, d_out);
        for (int64_t e = 0; e < n && !rc; e++) {
            int64_t r0 = hoff[e], cnt = hoff[e + 1] - hoff[e];
            T *dwd = dw_down ? (T *)dw_down + e * d_out * d_e : NULL, *dwgu = dw_gate_up ? (T *)dw_gate_up + e * 2 * d_e * d_in : NULL;
            if (!cnt) {   /* an expert without rows: zero weight gradients */
                if (dwd && cudaMemsetAsync(dwd, 0, (size_t)(d_out * d_e) * es, s) != cudaSuccess) rc = tide_set_error("cuda moe memset");
                if (dwgu && cudaMemsetAsync(dwgu, 0, (size_t)(2 * d_e * d_in) * es, s) != cudaSuccess) rc = tide_set_error("cuda moe memset");
                continue;
            }
            T *dye = (T *)dy + r0 * d_out, *dhe = (T *)dh + r0 * d_e, *dpe = (T *)dpre + r0 * 2 * d_e, *xe = (T *)xg + r0 * d_in;
            if (dwd) rc = tide_cuda_gemm(dtype, 1, 0, d_out, d_e, cnt, 1.0, dye, d_out, (T *)h + r0 * d_e, d_e, 0.0, dwd, d_e);
            if (!rc) rc = tide_cuda_gemm(dtype, 0, 0, cnt, d_e, d_out, 1.0, dye, d_out, (const T *)w_down + e * d_out * d_e, d_e,
                                         0.0, dhe, d_e);
            if (rc) break;
            moe_act_backward_kernel<T><<<tide_blocks(cnt * d_e), TIDE_THREADS, 0, s>>>(dpe, dhe, (const T *)pre + r0 * 2 * d_e, cnt,
                                                                                        d_e, act, k_gate, k_lin);
            if (dwgu) rc = tide_cuda_gemm(dtype, 1, 0, 2 * d_e, d_in, cnt, 1.0, dpe, 2 * d_e, xe, d_in, 0.0, dwgu, d_in);
            if (!rc && dx)
                rc = tide_cuda_gemm(dtype, 0, 0, cnt, d_in, 2 * d_e, 1.0, dpe, 2 * d_e, (const T *)w_gate_up + e * 2 * d_e * d_in,
                                    d_in, 0.0, (T *)dxg + r0 * d_in, d_in);
        }
        if (!rc && dx && m * d_in > 0)
            moe_dx_kernel<T><<<tide_blocks(m * d_in), TIDE_THREADS, 0, s>>>((T *)dx, (const T *)dxg, pos, m, k, d_in);
    });
    tide_cuda_release(buf, s);
    free(hoff);
    if (rc) return rc;
    TIDE_CU_LAUNCH("moe_experts backward kernels");
    return 0;
}

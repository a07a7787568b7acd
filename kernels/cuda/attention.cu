/*
 * attention.cu — softmax attention per (batch·head) on q [BH, Tq, D], k, v [BH, Tk, D] (kernels/backend.h): the
 * dense baseline's attention (nn.TransformerLM, recipes/dense.lua), computed as kernels/cpu/attention.c computes it.
 *
 * Forward, per head: S = scale Q Kᵀ, lse_i = log Σ_{j visible} exp(S_ij), O = exp(S − lse) V. causal: query i sees
 * key j iff j <= i + (Tk − Tq); a query that sees no key gets out 0 and lse −inf. Backward (spec/mla.md §4), P
 * recomputed from lse: dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)), dQ = scale dS K, dK = scale dSᵀ Q.
 *
 * It runs on the flash kernels of mla.cu (tiles of queries × keys, online softmax, fp32 accumulation, no [Tq, Tk]
 * buffer, bf16 products on tensor cores): [BH, T, D] is MLA's [B, T, H, D] with one head, so each (batch·head) is
 * an MLA batch row with H = 1 and no rope part, and "not causal" is the offset Tk (every key visible). Batch rows
 * go to the grid's z dimension, at most 65,535 per launch.
 *
 * lse has the dtype of q (the engine allocates it like q). In bf16 that is too coarse to recompute P from (a bf16
 * lse near 10 is off by up to 0.03, so P by up to 3%), so the bf16 backward first recomputes the fp32 lse with the
 * forward kernel minus its P V product (one more QKᵀ per tile); f32 uses the saved lse.
 */
#include "common.cuh"

/* batch rows per launch: gridDim.z's limit (the emulator, tests/gpu/emu, sets a small value to reach the split) */
#ifndef ATTN_ROWS_PER_LAUNCH
#define ATTN_ROWS_PER_LAUNCH 65535
#endif

static int attention_check(const char *what, int dtype, int64_t BH, int64_t Tq, int64_t Tk, int64_t D)
{
    if (dtype == TIDE_F64) return tide_set_error("%s: f64 is not implemented on the cuda backend (f32, bf16)", what);
    if (dtype != TIDE_F32 && dtype != TIDE_BF16)
        return tide_set_error("%s: dtype %s is not supported on the cuda backend (f32, bf16)", what,
                              tide_cuda_dtype_str(dtype));
    if (BH < 0 || Tq < 0 || Tk < 0 || D < 1 || Tq > INT_MAX / 4 || Tk > INT_MAX / 4 || D > 4096)
        return tide_set_error("%s: bad sizes BH %lld Tq %lld Tk %lld D %lld (expected BH, Tq, Tk >= 0, Tq, Tk <= %d, "
                              "1 <= D <= 4096)", what, (long long)BH, (long long)Tq, (long long)Tk, (long long)D,
                              INT_MAX / 4);
    return 0;
}

int tide_cuda_attention(int dtype, void *out, void *lse, const void *q, const void *k, const void *v, int64_t BH,
                        int64_t Tq, int64_t Tk, int64_t D, int causal, double scale)
{
    const char *what = "attention";
    if (attention_check(what, dtype, BH, Tq, Tk, D)) return -1;
    size_t es = dtype == TIDE_F32 ? 4 : 2;
    int64_t off = causal ? Tk - Tq : Tk;
    for (int64_t b0 = 0; b0 < BH; b0 += ATTN_ROWS_PER_LAUNCH) {
        int64_t nb = BH - b0 < ATTN_ROWS_PER_LAUNCH ? BH - b0 : ATTN_ROWS_PER_LAUNCH;
        size_t oq = (size_t)(b0 * Tq * D) * es, ok = (size_t)(b0 * Tk * D) * es, ol = (size_t)(b0 * Tq) * es;
        if (tide_cuda_flash_forward(what, dtype, (char *)out + oq, (char *)lse + ol, dtype == TIDE_F32,
                                    (const char *)q + oq, (const char *)k + ok, (const char *)v + ok, nb, Tq, Tk, 1, D,
                                    off, scale))
            return -1;
    }
    return 0;
}

int tide_cuda_attention_backward(int dtype, void *dq, void *dk, void *dv, const void *dout, const void *q,
                                 const void *k, const void *v, const void *out, const void *lse, int64_t BH,
                                 int64_t Tq, int64_t Tk, int64_t D, int causal, double scale)
{
    const char *what = "attention_backward";
    if (attention_check(what, dtype, BH, Tq, Tk, D)) return -1;
    TIDE_STREAM(s);
    size_t es = dtype == TIDE_F32 ? 4 : 2;
    int64_t off = causal ? Tk - Tq : Tk;
    for (int64_t b0 = 0; b0 < BH; b0 += ATTN_ROWS_PER_LAUNCH) {
        int64_t nb = BH - b0 < ATTN_ROWS_PER_LAUNCH ? BH - b0 : ATTN_ROWS_PER_LAUNCH;
        size_t oq = (size_t)(b0 * Tq * D) * es, ok = (size_t)(b0 * Tk * D) * es;
        const char *qc = (const char *)q + oq, *kc = (const char *)k + ok, *vc = (const char *)v + ok;
        float *lse32 = NULL;
        int rc = 0;
        if (dtype == TIDE_F32) {
            lse32 = (float *)lse + b0 * Tq;
        } else if (nb * Tq > 0) {
            cudaError_t e = tide_cuda_alloc((void **)&lse32, (size_t)(nb * Tq) * sizeof(float), s);
            if (e != cudaSuccess)
                return tide_set_error("cuda %s lse alloc (%lld floats): %s", what, (long long)(nb * Tq),
                                      cudaGetErrorString(e));
            rc = tide_cuda_flash_forward(what, dtype, NULL, lse32, 1, qc, kc, vc, nb, Tq, Tk, 1, D, off, scale);
        }
        if (!rc)
            rc = tide_cuda_flash_backward(what, dtype, (char *)dq + oq, (char *)dk + ok, (char *)dv + ok,
                                          (const char *)dout + oq, qc, kc, vc, (const char *)out + oq, lse32, nb, Tq,
                                          Tk, 1, D, off, scale);
        if (dtype != TIDE_F32) tide_cuda_release(lse32, s);
        if (rc) return -1;
    }
    return 0;
}

/*
 * kda.cu — Kimi Delta Attention on the GPU (spec/kda.md): the chunked forward and backward (§4–§6), the
 * token recurrence that decode uses (§3), and the decay gate (§2), over packed segments (§8).
 *
 * One block of KDA_NT threads owns one (segment, head) and walks its chunks in order, with the state S
 * (dk x dv, fp32) in shared memory. Where those blocks do not fill the device (K3's 96 heads of one long sequence
 * on 132 SMs), each is split over the columns of S (launch.h tide_kda_vsplit): a column of S evolves on its own
 * (S_c = diag(Γ_c) S₀ + K_rᵀ M diag(β)(V − K̂S₀) acts on each column alone), so nv blocks each own dv / nv
 * columns of S, V, O and redo the chunk's dk-side work (K̂Ǩᵀ, Q̂Ǩᵀ, the inverse). The forward's bits do not
 * change (a column's sums run in the same order in any block). In the backward dv and dS stay per column, while
 * dq, dk, dg and dβ sum over all columns: each split writes its partial sums, and kda_vsum_kernel adds them in
 * split order after each block of chunks (deterministic; in bf16 rounded once). The dependent chain stays
 * T / 16 chunks long; the split shortens each step (the column products are the bulk of a chunk's work) and
 * fills the SMs. TIDE_KDA_VSPLIT overrides the choice (1: never split). The state-free work also leaves that chain:
 * before each block of chunks a pre-pass (kda_intra_kernel, a block per chunk and head, all in parallel) forms every
 * chunk's Af, P and M (the K̂Ǩᵀ / Q̂Ǩᵀ products and the 16-step substitution), and the sequential kernel reads them;
 * the same functions on the same chunk give the same bits. The backward runs block by block anyway; the forward
 * runs in the same rounds (kda_forward_rounds), each block from its checkpoint (no checkpoints kept, under no_grad:
 * from one scratch slot per segment, rewritten each round), so the pre-pass buffer holds one block of chunks per segment group,
 * as the backward's state buffer does. A chunk is at most KDA_CT = 16 tokens (kda.md §5): a larger requested
 * chunk runs as chunks of 16, which is the same function (§4) with a smaller |G|. Rows of a ragged chunk
 * are zero (q = k = v = β = g = 0): they add nothing, and G of the last row stays G_c.
 *
 * TIDE_KDA_CHUNK factorises exp(G_r − G_j) = exp(G_r)·exp(−G_j), so K̂Ǩᵀ and Q̂Ǩᵀ are plain products; for
 * bf16 they and the two 16x16 · 16xdv products (M·βR, P·U) run on tensor cores (wmma, bf16 in, fp32
 * accumulate), each operand split into bf16 hi + lo so the result keeps fp32-like accuracy.
 * TIDE_KDA_CHUNK_SAFE forms exp(G_r − G_j) per pair (any g <= 0). U is formed as M diag(β)(V − K̂S₀)
 * (§4), one state product fewer than Ũ − W S₀. The state products (K̂S₀, Q̂S₀, K_rᵀU) are fp32 FMA.
 *
 * Backward (§6), checkpointed: the training forward writes the start state of every kbc-th chunk of each
 * segment (kbc from the engine's checkpoint count, backend.h kda_ckpt_chunks; TIDE_KDA_CUDA_CKPT_CHUNKS).
 * The backward walks each segment's blocks of kbc chunks from the last: one launch recomputes the block's
 * chunk start states from its checkpoint into a buffer of kbc states, the next walks those chunks in reverse
 * carrying dS (in shared memory; S₀ read from the buffer; dS handed from block to block through a carry
 * buffer). The recomputed states are the forward's own bits (the same kernel from the same checkpoint), so the
 * result equals a backward over every stored state bitwise, in kda_ckpt_chunks / KDA_CT times less memory: at
 * long T a few states per segment instead of one per 16 tokens. Segments are taken in groups whose state
 * buffers together hold no more states than the checkpoints do (a long segment: one group of its own).
 * The recurrent path's backward is the per-pair chunk backward: the same function, with checkpoints it
 * computes itself first.
 */
#include "common.cuh"
#include <mma.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#define KDA_CT 16                 /* rows of a chunk tile */
#define KDA_NT 256                /* threads per block */
#define KDA_NW (KDA_NT / 32)
#define KDA_RB 4                  /* rows per thread in the [CT, n] products */
#define KDA_RG (KDA_CT / KDA_RB)  /* row groups */
#define KDA_INTRA (3 * KDA_CT * KDA_CT)   /* a chunk's Af, P, M (kda_intra_kernel) */

typedef __nv_bfloat16 kda_bf16;

/* one non-empty segment of the packed batch; blocks are (segment, head) */
struct kda_seg {
    int64_t start, len;           /* first token (flattened b·T + t) and its token count */
    int64_t ck0, kbc;             /* its first checkpoint; chunks per checkpoint */
    int64_t buf0;                 /* its first slot in the backward's state buffer (within its group) */
    int64_t s0_row, sout_row;     /* row whose s0 it starts from / whose final state it is, else -1 */
};

/* ---- shared memory layout (float offsets, -1 = absent); the same function sizes it on the host ----- */
struct kda_smem {
    int S, lds;                                   /* S (forward) or dS (backward), row stride */
    int Qh, Kh, Kr, G, Kc, q, k;                  /* [CT, dk] */
    int R, U, O, dO, dU, dB;                      /* [CT, dv]; backward R, dU are [CT, max(dk, dv)] */
    int Af, P, M, dP, dA;                         /* [CT, CT] */
    int beta, dbr, eGc, rs;                       /* [CT], [CT], [dk], [dk] */
    int Qb, Kb, Cb, Mb, Pb, Rb, Ub;               /* bf16 hi/lo pairs for wmma (bf16 elements from sm; */
                                                  /* the lo half follows the hi half) */
    int total;                                    /* floats */
};

static int kda_take(int *cur, int n)
{
    int off = *cur;
    *cur += (n + 7) & ~7;         /* 32-byte aligned regions (wmma pointers) */
    return off;
}

/* intra: kda_intra_kernel's layout, a chunk's dk-side work only (no S, nothing of dv; G kept as the backward keeps
   it, with the bf16 halves the tensor-core products take) */
static kda_smem kda_layout(int dk, int dv, int safe, int wmma, int backward, int intra = 0)
{
    kda_smem L;
    memset(&L, 0xff, sizeof L);   /* every offset -1 */
    int cur = 0, ck = KDA_CT * dk, cv = KDA_CT * dv, cc = KDA_CT * KDA_CT;
    L.lds = backward ? dv + 1 : dv;   /* odd stride: the dK_r = U dSᵀ loop reads dS down columns */
    if (!intra) L.S = kda_take(&cur, dk * L.lds);
    L.Qh = kda_take(&cur, ck);
    L.Kh = kda_take(&cur, ck);
    L.Kr = kda_take(&cur, ck);
    if (safe || backward || intra) L.G = kda_take(&cur, ck);
    if (!safe) L.Kc = kda_take(&cur, ck);
    if (safe) {
        L.q = kda_take(&cur, ck);
        L.k = kda_take(&cur, ck);
    }
    if (intra) {
    } else if (backward) {
        int cm = KDA_CT * (dk > dv ? dk : dv);    /* R then dG, dU then dK_r⊙K_r */
        L.R = kda_take(&cur, cm);
        L.dU = kda_take(&cur, cm);
        L.dO = kda_take(&cur, cv);
        L.U = kda_take(&cur, cv);
        L.dB = kda_take(&cur, cv);
        L.dP = kda_take(&cur, cc);
        L.dA = kda_take(&cur, cc);
        L.dbr = kda_take(&cur, KDA_CT);
        L.rs = kda_take(&cur, dk);
    } else {
        if (!wmma) L.R = kda_take(&cur, cv);   /* wmma: V is read from global, βR goes to bf16 directly */
        L.U = kda_take(&cur, cv);
        L.O = kda_take(&cur, cv);
    }
    L.Af = kda_take(&cur, cc);
    L.P = kda_take(&cur, cc);
    L.M = kda_take(&cur, cc);
    L.beta = kda_take(&cur, KDA_CT);
    L.eGc = kda_take(&cur, dk);
    if (wmma) {
        int b = 2 * cur, *bp = &b;  /* bf16 elements; regions stay 32-byte aligned */
        L.Qb = kda_take(bp, 2 * ck);
        L.Kb = kda_take(bp, 2 * ck);
        L.Cb = kda_take(bp, 2 * ck);
        L.Mb = kda_take(bp, 2 * cc);
        L.Pb = kda_take(bp, 2 * cc);
        if (!intra) {
            L.Rb = kda_take(bp, 2 * cv);
            L.Ub = kda_take(bp, 2 * cv);
        }
        cur = (b + 1) / 2;
    }
    L.total = cur;
    return L;
}

struct kda_views {
    float *S, *Qh, *Kh, *Kr, *G, *Kc, *q, *k, *R, *U, *O, *dO, *dU, *dB, *Af, *P, *M, *dP, *dA;
    float *beta, *dbr, *eGc, *rs;
    kda_bf16 *Qb, *Kb, *Cb, *Mb, *Pb, *Rb, *Ub;
    int lds;
};

__device__ __forceinline__ float *kda_at(float *sm, int off) { return off >= 0 ? sm + off : nullptr; }
__device__ __forceinline__ kda_bf16 *kda_bat(float *sm, int off)
{
    return off >= 0 ? reinterpret_cast<kda_bf16 *>(sm) + off : nullptr;
}

__device__ __forceinline__ kda_views kda_make_views(float *sm, const kda_smem &L)
{
    kda_views w;
    w.S = kda_at(sm, L.S); w.lds = L.lds;
    w.Qh = kda_at(sm, L.Qh); w.Kh = kda_at(sm, L.Kh); w.Kr = kda_at(sm, L.Kr); w.G = kda_at(sm, L.G);
    w.Kc = kda_at(sm, L.Kc); w.q = kda_at(sm, L.q); w.k = kda_at(sm, L.k);
    w.R = kda_at(sm, L.R); w.U = kda_at(sm, L.U); w.O = kda_at(sm, L.O); w.dO = kda_at(sm, L.dO);
    w.dU = kda_at(sm, L.dU); w.dB = kda_at(sm, L.dB);
    w.Af = kda_at(sm, L.Af); w.P = kda_at(sm, L.P); w.M = kda_at(sm, L.M); w.dP = kda_at(sm, L.dP);
    w.dA = kda_at(sm, L.dA);
    w.beta = kda_at(sm, L.beta); w.dbr = kda_at(sm, L.dbr); w.eGc = kda_at(sm, L.eGc); w.rs = kda_at(sm, L.rs);
    w.Qb = kda_bat(sm, L.Qb); w.Kb = kda_bat(sm, L.Kb); w.Cb = kda_bat(sm, L.Cb); w.Mb = kda_bat(sm, L.Mb);
    w.Pb = kda_bat(sm, L.Pb); w.Rb = kda_bat(sm, L.Rb); w.Ub = kda_bat(sm, L.Ub);
    return w;
}

/* x = hi + lo with hi = bf16(x), lo = bf16(x − hi): hi·hi + lo·hi + hi·lo on tensor cores keeps ~2^-16 of x
   (kda.md oracle 4 allows about one bf16 ulp of the output, which single-bf16 operands already use up) */
__device__ __forceinline__ void kda_split(kda_bf16 *hi, int n, int o, float x)
{
    kda_bf16 h = __float2bfloat16(x);
    hi[o] = h;
    hi[n + o] = __float2bfloat16(x - __bfloat162float(h));
}

__device__ __forceinline__ float kda_warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* element idx of a block's dk x bv slice of a state, in the [dk, DV] state of its head (columns from v0) */
__device__ __forceinline__ int64_t kda_sidx(int idx, int bv, int DV, int v0)
{
    int i = idx / bv;
    return (int64_t)i * DV + v0 + (idx - i * bv);
}

/* ---- one chunk, shared by the forward and the backward -------------------------------------------- */

/* rows [0, rows) of the chunk from token tok0; the rest zero; v and dO: the block's dv columns from v0 of DV. q, k, g go where prep expects them raw:
   into q, k, G when kept (safe path, and G in the backward), else straight into Qh, Kh, Kc, which prep
   then transforms in place. v goes to R (R = V − K̂S₀ is formed in place). Flags g outside [lb, 0], the
   factorised path's precondition (kda.md §5); NaN passes, as on the cpu. */
template <typename T>
__device__ void kda_load(const kda_views &w, const T *q, const T *k, const T *v, const T *g, const T *beta,
                         const T *gout, int64_t tok0, int rows, int h, int H, int dk, int dv, int DV, int v0,
                         int check, double lb, unsigned long long *bad, unsigned long long base = 0)
{
    float *qd = w.q ? w.q : w.Qh, *kd = w.k ? w.k : w.Kh, *gd = w.G ? w.G : w.Kc;
    for (int idx = threadIdx.x; idx < KDA_CT * dk; idx += KDA_NT) {
        int r = idx / dk, i = idx - r * dk;
        float qv = 0.f, kv = 0.f, gv = 0.f;
        if (r < rows) {
            int64_t off = ((tok0 + r) * H + h) * (int64_t)dk + i;
            qv = tide_ld(q, off);
            kv = tide_ld(k, off);
            gv = tide_ld(g, off);
            if (check && ((double)gv < lb || gv > 0.f)) atomicMin(bad, base | (unsigned long long)off);
        }
        qd[idx] = qv;
        kd[idx] = kv;
        gd[idx] = gv;
    }
    for (int idx = threadIdx.x; idx < KDA_CT * dv; idx += KDA_NT) {
        int r = idx / dv, j = idx - r * dv;
        int64_t off = ((tok0 + r) * H + h) * (int64_t)DV + v0 + j;
        if (w.R) w.R[idx] = r < rows ? tide_ld(v, off) : 0.f;
        if (w.dO) w.dO[idx] = (gout && r < rows) ? tide_ld(gout, off) : 0.f;
    }
    if (threadIdx.x < KDA_CT) {
        int r = threadIdx.x;
        w.beta[r] = r < rows ? tide_ld(beta, (tok0 + r) * H + h) : 0.f;
    }
}

/* per channel: G = cumsum(g), Q̂ = Q⊙Γ, K̂ = K⊙Γ, K_r = K⊙exp(G_c − G), Ǩ = K⊙Γ⁻¹ (factorised path),
   Γ_c = exp(G_c) (kda.md §4). One thread owns a channel, so the in-place transforms are safe. */
template <bool WMMA> __device__ void kda_prep(const kda_views &w, int rows, int dk)
{
    const float *qs = w.q ? w.q : w.Qh, *ks = w.k ? w.k : w.Kh, *gs = w.G ? w.G : w.Kc;
    for (int i = threadIdx.x; i < dk; i += KDA_NT) {
        float Gr[KDA_CT], acc = 0.f;
#pragma unroll
        for (int r = 0; r < KDA_CT; r++) {
            acc += gs[r * dk + i];
            Gr[r] = acc;
        }
        w.eGc[i] = expf(acc);
#pragma unroll
        for (int r = 0; r < KDA_CT; r++) {
            int o = r * dk + i;
            float qv = qs[o], kv = ks[o], e = expf(Gr[r]);
            bool live = r < rows;
            float qh = live ? qv * e : 0.f, kh = live ? kv * e : 0.f;
            w.Qh[o] = qh;
            w.Kh[o] = kh;
            w.Kr[o] = live ? kv * expf(acc - Gr[r]) : 0.f;
            if (w.G) w.G[o] = Gr[r];
            if (w.Kc) {
                float kc = live ? kv * expf(-Gr[r]) : 0.f;
                w.Kc[o] = kc;
                if constexpr (WMMA) kda_split(w.Cb, KDA_CT * dk, o, kc);
            }
            if constexpr (WMMA) {
                kda_split(w.Qb, KDA_CT * dk, o, qh);
                kda_split(w.Kb, KDA_CT * dk, o, kh);
            }
        }
    }
}

/* Af = StrictTril(K̂Ǩᵀ) and P = Tril(Q̂Ǩᵀ), masked by selection (kda.md §5). FMA: one warp per pair,
   upper pairs never formed. wmma: warps 0 and 1 form the full 16x16 products (the upper triangle may hold
   e^{+80}); kda_solve masks P and reads Af below the diagonal only. */
template <bool WMMA> __device__ void kda_pairs(const kda_views &w, int dk, int safe)
{
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if constexpr (WMMA) {
        using namespace nvcuda;
        if (warp < 2) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, kda_bf16, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, kda_bf16, wmma::col_major> fb;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
            wmma::fill_fragment(fc, 0.f);
            const kda_bf16 *a = warp == 0 ? w.Kb : w.Qb;
            const int n = KDA_CT * dk;
            for (int kk = 0; kk < dk; kk += 16) {
                /* Ǩᵀ: Ǩ row-major is Ǩᵀ column-major; the small terms first */
                wmma::load_matrix_sync(fa, a + n + kk, dk);
                wmma::load_matrix_sync(fb, w.Cb + kk, dk);
                wmma::mma_sync(fc, fa, fb, fc);
                wmma::load_matrix_sync(fa, a + kk, dk);
                wmma::load_matrix_sync(fb, w.Cb + n + kk, dk);
                wmma::mma_sync(fc, fa, fb, fc);
                wmma::load_matrix_sync(fb, w.Cb + kk, dk);
                wmma::mma_sync(fc, fa, fb, fc);
            }
            wmma::store_matrix_sync(warp == 0 ? w.Af : w.P, fc, KDA_CT, wmma::mem_row_major);
        }
        return;
    } else {
        for (int pr = warp; pr < KDA_CT * KDA_CT; pr += KDA_NW) {
            int r = pr / KDA_CT, j = pr - r * KDA_CT;
            float a = 0.f, p = 0.f;
            if (j <= r) {                                     /* warp-uniform */
                if (safe) {
                    for (int i = lane; i < dk; i += 32) {
                        float kj = w.k[j * dk + i] * expf(w.G[r * dk + i] - w.G[j * dk + i]);
                        a += w.k[r * dk + i] * kj;
                        p += w.q[r * dk + i] * kj;
                    }
                } else {
                    for (int i = lane; i < dk; i += 32) {
                        float kc = w.Kc[j * dk + i];
                        a += w.Kh[r * dk + i] * kc;
                        p += w.Qh[r * dk + i] * kc;
                    }
                }
                a = kda_warp_sum(a);
                p = kda_warp_sum(p);
            }
            if (lane == 0) {
                w.Af[pr] = j < r ? a : 0.f;
                w.P[pr] = j <= r ? p : 0.f;
            }
        }
    }
}

/* M = (I + A)⁻¹, A = diag(β) StrictTril(K̂Ǩᵀ), by forward substitution (kda.md §4): thread `col` solves
   column col, M[r][col] = δ_{r,col} − Σ_{j<r} A[r][j] M[j][col], all in registers. */
template <bool WMMA> __device__ void kda_solve(const kda_views &w)
{
    int col = threadIdx.x;
    if (col < KDA_CT) {
        float m[KDA_CT];
#pragma unroll
        for (int r = 0; r < KDA_CT; r++) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < r; j++) s += w.Af[r * KDA_CT + j] * m[j];
            m[r] = r < col ? 0.f : (r == col ? 1.f : -w.beta[r] * s);
            w.M[r * KDA_CT + col] = m[r];
            if constexpr (WMMA) kda_split(w.Mb, KDA_CT * KDA_CT, r * KDA_CT + col, m[r]);
        }
    }
    if constexpr (WMMA) {
        for (int idx = threadIdx.x; idx < KDA_CT * KDA_CT; idx += KDA_NT) {
            int r = idx / KDA_CT, j = idx - r * KDA_CT;
            float p = j <= r ? w.P[idx] : 0.f;
            w.P[idx] = p;
            kda_split(w.Pb, KDA_CT * KDA_CT, idx, p);
        }
    }
}

/* ---- forward ---------------------------------------------------------------------------------------- */

template <typename T> struct kda_fwd_args {
    T *o;                          /* NULL: no output (the backward's passes) */
    float *s_out;
    float *ckpt;                   /* blk < 0: checkpoints written here (or NULL); blk >= 0: read from here */
    float *states;                 /* blk >= 0: the block's chunk start states [slot, H, dk, dv], slot buf0 + i */
    int64_t blk;                   /* -1: whole segments from s0; else block blk of each segment: states only, or
                                      with o the training forward's round blk (kda_forward_rounds): o for the block's
                                      chunks from s0 (blk 0) or checkpoint blk, then checkpoint blk + 1 or s_out */
    const float *intra;            /* NULL, or per state slot and head the chunk's Af, P, M (kda_intra_kernel) */
    int roll;                      /* the rounds of a forward that keeps no checkpoints: every block of a segment
                                      reads its start state from, and leaves the next block's in, one scratch slot
                                      ck0 (a block reads its slot into shared memory before it writes it back) */
    const T *q, *k, *v, *g, *beta;
    const float *s0;
    const kda_seg *seg;
    int H, dk, dv, C, safe, check;
    int nv;                        /* column split (launch.h tide_kda_vsplit): blocks (segment, head, dv / nv columns) */
    double lb;
    unsigned long long *bad, bad_base;   /* the deferred record and this call's key (common.cuh) */
    kda_smem L;                    /* sized for dv / nv columns */
};

template <typename T, bool WMMA> __global__ void __launch_bounds__(KDA_NT) kda_chunk_kernel(kda_fwd_args<T> a)
{
    extern __shared__ __align__(128) float4 kda_smem4[]; /* wmma wants 32-byte aligned tiles */
    float *sm = reinterpret_cast<float *>(kda_smem4);
    const kda_views w = kda_make_views(sm, a.L);
    const int bid = blockIdx.x / a.nv, DV = a.dv, dv = DV / a.nv, v0 = (blockIdx.x - bid * a.nv) * dv;
    const kda_seg sg = a.seg[bid / a.H];
    const int h = bid % a.H, dk = a.dk, H = a.H;
    const int64_t sz = (int64_t)dk * DV;

    const int64_t nch = (sg.len + a.C - 1) / a.C;
    int64_t c0 = 0, c1 = nch;
    const float *s0 = (sg.s0_row >= 0 && a.s0) ? a.s0 + (sg.s0_row * H + h) * sz : nullptr;
    if (a.blk >= 0) {                    /* one block of chunks from its checkpoint */
        c0 = a.blk * sg.kbc;
        if (c0 >= nch) return;           /* the whole block: this segment has no such block */
        c1 = c0 + sg.kbc < nch ? c0 + sg.kbc : nch;
        if (!a.o || a.blk > 0) s0 = a.ckpt + ((sg.ck0 + (a.roll ? 0 : a.blk)) * H + h) * sz;
    }
    for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) w.S[idx] = s0 ? s0[kda_sidx(idx, dv, DV, v0)] : 0.f;

    for (int64_t ch = c0; ch < c1; ch++) {
        const int64_t tok0 = sg.start + ch * a.C;
        const int rows = (int)(sg.len - ch * a.C < a.C ? sg.len - ch * a.C : a.C);
        __syncthreads();                 /* S is final for this chunk; the buffers are free */
        if (a.ckpt && !a.roll && ch % sg.kbc == 0 && (a.blk < 0 || (a.o && ch == 0))) {
            float *st = a.ckpt + ((sg.ck0 + ch / sg.kbc) * H + h) * sz;
            for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) st[kda_sidx(idx, dv, DV, v0)] = w.S[idx];
        }
        if (a.states) {
            float *st = a.states + ((sg.buf0 + ch - c0) * H + h) * sz;
            for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) st[kda_sidx(idx, dv, DV, v0)] = w.S[idx];
            if (ch == c1 - 1) return;    /* the block's last start state: its chunk is the backward's */
        }
        kda_load<T>(w, a.q, a.k, a.v, a.g, a.beta, (const T *)nullptr, tok0, rows, h, H, dk, dv, DV, v0, a.check,
                    a.lb, a.bad, a.bad_base);
        __syncthreads();
        kda_prep<WMMA>(w, rows, dk);
        __syncthreads();
        const float *pre = a.intra ? a.intra + ((sg.buf0 + ch - c0) * H + h) * (int64_t)KDA_INTRA : nullptr;
        if (pre) {   /* the pre-pass's P and M (the same functions on the same chunk); Af only feeds the inverse */
            for (int idx = threadIdx.x; idx < KDA_CT * KDA_CT; idx += KDA_NT) {
                w.P[idx] = pre[KDA_CT * KDA_CT + idx];
                w.M[idx] = pre[2 * KDA_CT * KDA_CT + idx];
            }
        } else {
            kda_pairs<WMMA>(w, dk, a.safe);
        }
        /* R = V − K̂S₀ and O = Q̂S₀ (the inter-chunk part), RB rows x one column per item */
        for (int it = threadIdx.x; it < KDA_RG * dv; it += KDA_NT) {
            int rg = it / dv, j = it - rg * dv, r0 = rg * KDA_RB;
            float ks[KDA_RB], qs[KDA_RB];
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) ks[rr] = qs[rr] = 0.f;
            for (int i = 0; i < dk; i++) {
                float s = w.S[i * dv + j];
#pragma unroll
                for (int rr = 0; rr < KDA_RB; rr++) {
                    ks[rr] += w.Kh[(r0 + rr) * dk + i] * s;
                    qs[rr] += w.Qh[(r0 + rr) * dk + i] * s;
                }
            }
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) {
                int o = (r0 + rr) * dv + j;
                w.O[o] = qs[rr];
                if constexpr (WMMA) {
                    float vv = r0 + rr < rows ? tide_ld(a.v, ((tok0 + r0 + rr) * H + h) * (int64_t)DV + v0 + j) : 0.f;
                    kda_split(w.Rb, KDA_CT * dv, o, w.beta[r0 + rr] * (vv - ks[rr]));
                } else {
                    w.R[o] -= ks[rr];
                }
            }
        }
        __syncthreads();
        if (!pre) {
            kda_solve<WMMA>(w);
        } else if constexpr (WMMA) {   /* the bf16 hi/lo halves kda_solve makes of M and the masked P */
            for (int idx = threadIdx.x; idx < KDA_CT * KDA_CT; idx += KDA_NT) {
                kda_split(w.Mb, KDA_CT * KDA_CT, idx, w.M[idx]);
                kda_split(w.Pb, KDA_CT * KDA_CT, idx, w.P[idx]);
            }
        }
        __syncthreads();
        /* U = M diag(β) R; with wmma each warp owns 16 columns and also adds P U into O there */
        if constexpr (WMMA) {
            using namespace nvcuda;
            int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
            const int cc = KDA_CT * KDA_CT, cv = KDA_CT * dv;
            for (int n = warp; n < dv / 16; n += KDA_NW) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, kda_bf16, wmma::row_major> fa, fal;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, kda_bf16, wmma::row_major> fb, fbl;
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
                wmma::fill_fragment(fc, 0.f);
                wmma::load_matrix_sync(fa, w.Mb, KDA_CT);
                wmma::load_matrix_sync(fal, w.Mb + cc, KDA_CT);
                wmma::load_matrix_sync(fb, w.Rb + n * 16, dv);
                wmma::load_matrix_sync(fbl, w.Rb + cv + n * 16, dv);
                wmma::mma_sync(fc, fal, fb, fc);
                wmma::mma_sync(fc, fa, fbl, fc);
                wmma::mma_sync(fc, fa, fb, fc);
                wmma::store_matrix_sync(w.U + n * 16, fc, dv, wmma::mem_row_major);
                __syncwarp();
                for (int e = lane; e < 256; e += 32) {
                    int o = (e >> 4) * dv + n * 16 + (e & 15);
                    kda_split(w.Ub, cv, o, w.U[o]);
                }
                __syncwarp();
                wmma::load_matrix_sync(fa, w.Pb, KDA_CT);
                wmma::load_matrix_sync(fal, w.Pb + cc, KDA_CT);
                wmma::load_matrix_sync(fb, w.Ub + n * 16, dv);
                wmma::load_matrix_sync(fbl, w.Ub + cv + n * 16, dv);
                wmma::load_matrix_sync(fc, w.O + n * 16, dv, wmma::mem_row_major);
                wmma::mma_sync(fc, fal, fb, fc);
                wmma::mma_sync(fc, fa, fbl, fc);
                wmma::mma_sync(fc, fa, fb, fc);
                wmma::store_matrix_sync(w.O + n * 16, fc, dv, wmma::mem_row_major);
            }
        } else {
            for (int it = threadIdx.x; it < KDA_RG * dv; it += KDA_NT) {
                int rg = it / dv, j = it - rg * dv, r0 = rg * KDA_RB;
                float u[KDA_RB];
#pragma unroll
                for (int rr = 0; rr < KDA_RB; rr++) u[rr] = 0.f;
                for (int rp = 0; rp < KDA_CT; rp++) {
                    float br = w.beta[rp] * w.R[rp * dv + j];
#pragma unroll
                    for (int rr = 0; rr < KDA_RB; rr++) u[rr] += w.M[(r0 + rr) * KDA_CT + rp] * br;
                }
#pragma unroll
                for (int rr = 0; rr < KDA_RB; rr++) w.U[(r0 + rr) * dv + j] = u[rr];
            }
        }
        __syncthreads();
        /* O = Q̂S₀ + P U out (the FMA path adds P U here), and S ← diag(Γ_c) S + K_rᵀ U */
        if (a.o) {
            for (int it = threadIdx.x; it < KDA_RG * dv; it += KDA_NT) {
                int rg = it / dv, j = it - rg * dv, r0 = rg * KDA_RB;
                float ov[KDA_RB];
#pragma unroll
                for (int rr = 0; rr < KDA_RB; rr++) ov[rr] = w.O[(r0 + rr) * dv + j];
                if constexpr (!WMMA) {
                    for (int rp = 0; rp < KDA_CT; rp++) {
                        float uv = w.U[rp * dv + j];
#pragma unroll
                        for (int rr = 0; rr < KDA_RB; rr++) ov[rr] += w.P[(r0 + rr) * KDA_CT + rp] * uv;
                    }
                }
#pragma unroll
                for (int rr = 0; rr < KDA_RB; rr++)
                    if (r0 + rr < rows) tide_st(a.o, ((tok0 + r0 + rr) * H + h) * (int64_t)DV + v0 + j, ov[rr]);
            }
        }
        for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) {
            int i = idx / dv, j = idx - i * dv;
            float s = w.eGc[i] * w.S[idx];
#pragma unroll
            for (int r = 0; r < KDA_CT; r++) s += w.Kr[r * dk + i] * w.U[r * dv + j];
            w.S[idx] = s;
        }
    }
    __syncthreads();
    if (a.blk >= 0 && c1 < nch) {        /* a round that is not the segment's last: the next block's checkpoint */
        if (a.o && a.ckpt) {
            float *st = a.ckpt + ((sg.ck0 + (a.roll ? 0 : a.blk + 1)) * H + h) * sz;
            for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) st[kda_sidx(idx, dv, DV, v0)] = w.S[idx];
        }
    } else if (sg.sout_row >= 0 && a.s_out) {
        float *so = a.s_out + (sg.sout_row * H + h) * sz;
        for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) so[kda_sidx(idx, dv, DV, v0)] = w.S[idx];
    }
}

/* ---- the token recurrence (kda.md §3): decode, and the reference path ------------------------------
   S (dk x dv) in shared memory; thread (p, j) owns column j for rows i ≡ p (mod P), so the decay, the
   error Sᵀk, the rank-1 write and the read Sᵀq need no synchronisation on S itself. */

template <typename T> struct kda_rec_args {
    T *o;
    float *s_out;
    const T *q, *k, *v, *g, *beta;
    const float *s0;
    const kda_seg *seg;
    int H, dk, dv;
};

template <typename T> __global__ void __launch_bounds__(KDA_NT) kda_recurrent_kernel(kda_rec_args<T> a)
{
    extern __shared__ __align__(128) float4 kda_smem4[]; /* wmma wants 32-byte aligned tiles */
    float *S = reinterpret_cast<float *>(kda_smem4);
    const int dk = a.dk, dv = a.dv, H = a.H;
    const int P = dv >= KDA_NT ? 1 : KDA_NT / dv;
    float *kv = S + dk * dv, *qv = kv + dk, *av = qv + dk, *vv = av + dk, *uv = vv + dv, *part = uv + dv;
    const kda_seg sg = a.seg[blockIdx.x / H];
    const int h = blockIdx.x % H;
    const int64_t sz = (int64_t)dk * dv;
    const int p = dv >= KDA_NT ? 0 : threadIdx.x / dv;
    const int j0 = dv >= KDA_NT ? threadIdx.x : threadIdx.x % dv, js = dv >= KDA_NT ? KDA_NT : dv;
    const bool active = p < P;

    const float *s0 = (sg.s0_row >= 0 && a.s0) ? a.s0 + (sg.s0_row * H + h) * sz : nullptr;
    for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) S[idx] = s0 ? s0[idx] : 0.f;
    __shared__ float beta_t;

    for (int64_t t = 0; t < sg.len; t++) {
        const int64_t tok = sg.start + t, base = (tok * H + h);
        for (int i = threadIdx.x; i < dk; i += KDA_NT) {
            kv[i] = tide_ld(a.k, base * dk + i);
            qv[i] = tide_ld(a.q, base * dk + i);
            av[i] = expf(tide_ld(a.g, base * dk + i));
        }
        for (int j = threadIdx.x; j < dv; j += KDA_NT) vv[j] = tide_ld(a.v, base * dv + j);
        if (threadIdx.x == 0) beta_t = tide_ld(a.beta, base);
        __syncthreads();
        /* S ← diag(α) S, and the partial sums of Sᵀk over this thread's rows */
        if (active)
            for (int j = j0; j < dv; j += js) {
                float acc = 0.f;
                for (int i = p; i < dk; i += P) {
                    float s = S[i * dv + j] * av[i];
                    S[i * dv + j] = s;
                    acc += s * kv[i];
                }
                part[p * dv + j] = acc;
            }
        __syncthreads();
        /* u = β (v − Sᵀk) against the decayed state */
        for (int j = threadIdx.x; j < dv; j += KDA_NT) {
            float e = 0.f;
            for (int pp = 0; pp < P; pp++) e += part[pp * dv + j];
            uv[j] = beta_t * (vv[j] - e);
        }
        __syncthreads();
        /* S ← S + k uᵀ, and the partial sums of Sᵀq */
        if (active)
            for (int j = j0; j < dv; j += js) {
                float acc = 0.f, u = uv[j];
                for (int i = p; i < dk; i += P) {
                    float s = S[i * dv + j] + kv[i] * u;
                    S[i * dv + j] = s;
                    acc += s * qv[i];
                }
                part[p * dv + j] = acc;
            }
        __syncthreads();
        for (int j = threadIdx.x; j < dv; j += KDA_NT) {
            float o = 0.f;
            for (int pp = 0; pp < P; pp++) o += part[pp * dv + j];
            tide_st(a.o, base * dv + j, o);
        }
        /* no barrier here: the next token's loads touch only kv..beta_t, and its first barrier orders part */
    }
    if (sg.sout_row >= 0 && a.s_out) {
        float *so = a.s_out + (sg.sout_row * H + h) * sz;
        for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) so[idx] = S[idx];
    }
}

static size_t kda_recurrent_smem(int dk, int dv)
{
    int P = dv >= KDA_NT ? 1 : KDA_NT / dv;
    return ((size_t)dk * dv + 3 * (size_t)dk + 2 * (size_t)dv + (size_t)P * dv) * sizeof(float);
}

/* ---- backward (kda.md §6) -------------------------------------------------------------------------- */

template <typename T> struct kda_bwd_args {
    T *gq, *gk, *gv, *gg, *gbeta;
    float *gs0;
    const T *gout;
    const float *gs_out, *states;  /* states: the block's chunk start states (kda_fwd_args) */
    float *carry;                  /* dS between blocks: [segment of the group, H, dk, dv] */
    int64_t blk;
    const T *q, *k, *v, *g, *beta;
    const kda_seg *seg;
    int H, dk, dv, C, safe;
    int nv;                        /* column split (kda_fwd_args); nv > 1: the dk-side gradients go to part */
    float *part;                   /* [nv, prow, H, KDA_PW(dk)]: each split's dq, dk, dg, dβ over its columns, the rows */
    int64_t prow;                  /* of the group's state slots (slot·C + r); kda_vsum_kernel adds them in order */
    const float *intra;            /* NULL, or per state slot and head the chunk's Af, P, M (kda_intra_kernel) */
    kda_smem L;                    /* sized for dv / nv columns */
};

#define KDA_PW(dk) (3 * (dk) + 1)  /* a row's partial gradients: dq, dk, dg, then dβ */

template <typename T> __global__ void __launch_bounds__(KDA_NT) kda_chunk_backward_kernel(kda_bwd_args<T> a)
{
    extern __shared__ __align__(128) float4 kda_smem4[]; /* wmma wants 32-byte aligned tiles */
    float *sm = reinterpret_cast<float *>(kda_smem4);
    const kda_views w = kda_make_views(sm, a.L);
    const int bid = blockIdx.x / a.nv, vs = blockIdx.x - bid * a.nv, DV = a.dv, dv = DV / a.nv, v0 = vs * dv;
    const kda_seg sg = a.seg[bid / a.H];
    const int h = bid % a.H, dk = a.dk, H = a.H, lds = w.lds, safe = a.safe;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t sz = (int64_t)dk * DV;
    /* split: this block's partial dq, dk, dg, dβ rows (a row: slot·C + r of the group's state slots) */
    float *part = a.nv > 1 ? a.part + (int64_t)vs * a.prow * H * KDA_PW(dk) : nullptr;
    float *dS = w.S;
    float *dGs = w.R, *KrT = w.dU;   /* R and dU are dead by the time these are written */

    const int64_t nch = (sg.len + a.C - 1) / a.C, c0 = a.blk * sg.kbc;
    if (c0 >= nch) return;               /* the whole block: this segment has no such block */
    const int64_t c1 = c0 + sg.kbc < nch ? c0 + sg.kbc : nch;
    float *carry = a.carry ? a.carry + (int64_t)bid * sz : nullptr;   /* (segment of the group, head) */
    const float *gso = c1 < nch ? carry
                       : (sg.sout_row >= 0 && a.gs_out) ? a.gs_out + (sg.sout_row * H + h) * sz : nullptr;
    for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) {
        int i = idx / dv, j = idx - i * dv;
        dS[i * lds + j] = gso ? gso[kda_sidx(idx, dv, DV, v0)] : 0.f;
    }

    for (int64_t ch = c1 - 1; ch >= c0; ch--) {
        const int64_t tok0 = sg.start + ch * a.C;
        const int rows = (int)(sg.len - ch * a.C < a.C ? sg.len - ch * a.C : a.C);
        const float *S0 = a.states + ((sg.buf0 + ch - c0) * H + h) * sz + v0;   /* row stride DV */
        const int64_t prow0 = (sg.buf0 + ch - c0) * a.C;                      /* the chunk's first partial row */
        __syncthreads();
        kda_load<T>(w, a.q, a.k, a.v, a.g, a.beta, a.gout, tok0, rows, h, H, dk, dv, DV, v0, 0, 0.0, nullptr);
        __syncthreads();
        kda_prep<false>(w, rows, dk);
        __syncthreads();
        const float *pre = a.intra ? a.intra + ((sg.buf0 + ch - c0) * H + h) * (int64_t)KDA_INTRA : nullptr;
        if (pre) {   /* the pre-pass's bits: the same functions on the same chunk */
            for (int idx = threadIdx.x; idx < KDA_CT * KDA_CT; idx += KDA_NT) {
                w.Af[idx] = pre[idx];
                w.P[idx] = pre[KDA_CT * KDA_CT + idx];
                w.M[idx] = pre[2 * KDA_CT * KDA_CT + idx];
            }
        } else {
            kda_pairs<false>(w, dk, safe);
        }
        /* R = V − K̂S₀, and the state part of dU: K_r dS_c */
        for (int it = threadIdx.x; it < KDA_RG * dv; it += KDA_NT) {
            int rg = it / dv, j = it - rg * dv, r0 = rg * KDA_RB;
            float ks[KDA_RB], du[KDA_RB];
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) ks[rr] = du[rr] = 0.f;
            for (int i = 0; i < dk; i++) {
                float s = S0[i * DV + j], d = dS[i * lds + j];
#pragma unroll
                for (int rr = 0; rr < KDA_RB; rr++) {
                    ks[rr] += w.Kh[(r0 + rr) * dk + i] * s;
                    du[rr] += w.Kr[(r0 + rr) * dk + i] * d;
                }
            }
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) {
                int o = (r0 + rr) * dv + j;
                w.R[o] -= ks[rr];
                w.dU[o] = du[rr];
            }
        }
        __syncthreads();
        if (!pre) kda_solve<false>(w);
        __syncthreads();
        /* U = M diag(β) R;  dU += Pᵀ dO */
        for (int it = threadIdx.x; it < KDA_RG * dv; it += KDA_NT) {
            int rg = it / dv, j = it - rg * dv, r0 = rg * KDA_RB;
            float u[KDA_RB], du[KDA_RB];
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) u[rr] = du[rr] = 0.f;
            for (int rp = 0; rp < KDA_CT; rp++) {
                float br = w.beta[rp] * w.R[rp * dv + j], d = w.dO[rp * dv + j];
#pragma unroll
                for (int rr = 0; rr < KDA_RB; rr++) {
                    u[rr] += w.M[(r0 + rr) * KDA_CT + rp] * br;
                    du[rr] += w.P[rp * KDA_CT + r0 + rr] * d;
                }
            }
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) {
                w.U[(r0 + rr) * dv + j] = u[rr];
                w.dU[(r0 + rr) * dv + j] += du[rr];
            }
        }
        __syncthreads();
        /* dB = Mᵀ dU */
        for (int it = threadIdx.x; it < KDA_RG * dv; it += KDA_NT) {
            int rg = it / dv, j = it - rg * dv, r0 = rg * KDA_RB;
            float b[KDA_RB];
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) b[rr] = 0.f;
            for (int rp = 0; rp < KDA_CT; rp++) {
                float d = w.dU[rp * dv + j];
#pragma unroll
                for (int rr = 0; rr < KDA_RB; rr++) b[rr] += w.M[rp * KDA_CT + r0 + rr] * d;
            }
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) w.dB[(r0 + rr) * dv + j] = b[rr];
        }
        __syncthreads();
        /* dP = Tril(dO Uᵀ), dA = −StrictTril(dB Uᵀ) (one warp per pair); the R part of dβ (one warp per
           row); dV = diag(β) dB */
        for (int pr = warp; pr < KDA_CT * KDA_CT; pr += KDA_NW) {
            int r = pr / KDA_CT, j = pr - r * KDA_CT;
            float p = 0.f, d = 0.f;
            if (j <= r) {
                for (int jj = lane; jj < dv; jj += 32) {
                    float u = w.U[j * dv + jj];
                    p += w.dO[r * dv + jj] * u;
                    d += w.dB[r * dv + jj] * u;
                }
                p = kda_warp_sum(p);
                d = kda_warp_sum(d);
            }
            if (lane == 0) {
                w.dP[pr] = j <= r ? p : 0.f;
                w.dA[pr] = j < r ? -d : 0.f;
            }
        }
        for (int r = warp; r < KDA_CT; r += KDA_NW) {
            float s = 0.f;
            for (int jj = lane; jj < dv; jj += 32) s += w.dB[r * dv + jj] * w.R[r * dv + jj];
            s = kda_warp_sum(s);
            if (lane == 0) w.dbr[r] = s;
        }
        if (a.gv)
            for (int idx = threadIdx.x; idx < rows * dv; idx += KDA_NT) {
                int r = idx / dv, j = idx - r * dv;
                tide_st(a.gv, ((tok0 + r) * H + h) * (int64_t)DV + v0 + j, w.beta[r] * w.dB[idx]);
            }
        __syncthreads();
        /* dβ = rowsum(dB ⊙ R) + rowsum(dA ⊙ K̂Ǩᵀ) */
        if ((a.gbeta || part) && threadIdx.x < rows) {
            int r = threadIdx.x;
            float s = w.dbr[r];
            for (int j = 0; j < r; j++) s += w.dA[r * KDA_CT + j] * w.Af[r * KDA_CT + j];
            if (part) part[((prow0 + r) * H + h) * KDA_PW(dk) + 3 * dk] = s;
            else tide_st(a.gbeta, (tok0 + r) * H + h, s);
        }
        /* per (row group, channel): dQ̂, dK̂, dǨ, dK_r (kda.md §6) -> dq, dk, and dG (the K_r term apart).
           State parts: dQ̂ = dO S₀ᵀ, dK̂ = −diag(β) dB S₀ᵀ, dK_r = U dSᵀ. Intra parts per the path: the
           factorised products dP Ǩ, diag(β) dA Ǩ, dPᵀQ̂ + (diag(β)dA)ᵀK̂, or the same sums with the
           per-pair exp(G_r − G_j) (never above the diagonal, where it could overflow). */
        for (int it = threadIdx.x; it < KDA_RG * dk; it += KDA_NT) {
            int rg = it / dk, i = it - rg * dk, r0 = rg * KDA_RB;
            float aq[KDA_RB], ak[KDA_RB], ar[KDA_RB], rs = 0.f;
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) aq[rr] = ak[rr] = ar[rr] = 0.f;
            for (int j = 0; j < dv; j++) {
                float s0 = S0[i * DV + j], d = dS[i * lds + j];
                rs += d * s0;
#pragma unroll
                for (int rr = 0; rr < KDA_RB; rr++) {
                    int o = (r0 + rr) * dv + j;
                    aq[rr] += w.dO[o] * s0;
                    ak[rr] += w.beta[r0 + rr] * w.dB[o] * s0;
                    ar[rr] += w.U[o] * d;
                }
            }
            if (rg == 0) w.rs[i] = rs;
            const float gc = w.G[(KDA_CT - 1) * dk + i];
#pragma unroll
            for (int rr = 0; rr < KDA_RB; rr++) {
                const int r = r0 + rr, o = r * dk + i;
                const float Gr = w.G[o], e = expf(Gr), eR = expf(gc - Gr);
                float dqi = 0.f, dka = 0.f, dkb = 0.f, dq, dkk, dg;
                if (safe) {
                    for (int j = 0; j <= r; j++) {
                        float x = w.k[j * dk + i] * expf(Gr - w.G[j * dk + i]);
                        dqi += w.dP[r * KDA_CT + j] * x;
                        dka += w.dA[r * KDA_CT + j] * x;
                    }
                    dka *= w.beta[r];
                    for (int j = r; j < KDA_CT; j++)
                        dkb += (w.dP[j * KDA_CT + r] * w.q[j * dk + i] + w.beta[j] * w.dA[j * KDA_CT + r] * w.k[j * dk + i]) *
                               expf(w.G[j * dk + i] - Gr);
                    dq = e * aq[rr] + dqi;
                    dkk = -e * ak[rr] + dka + dkb + eR * ar[rr];
                    dg = w.Qh[o] * aq[rr] - w.Kh[o] * ak[rr] + w.q[o] * dqi + w.k[o] * (dka - dkb);
                } else {
                    for (int j = 0; j <= r; j++) {
                        float kc = w.Kc[j * dk + i];
                        dqi += w.dP[r * KDA_CT + j] * kc;
                        dka += w.dA[r * KDA_CT + j] * kc;
                    }
                    dka *= w.beta[r];
                    for (int j = r; j < KDA_CT; j++)
                        dkb += w.dP[j * KDA_CT + r] * w.Qh[j * dk + i] + w.beta[j] * w.dA[j * KDA_CT + r] * w.Kh[j * dk + i];
                    const float dqh = aq[rr] + dqi, dkh = dka - ak[rr];
                    dq = e * dqh;
                    dkk = e * dkh + expf(-Gr) * dkb + eR * ar[rr];
                    dg = dqh * w.Qh[o] + dkh * w.Kh[o] - dkb * w.Kc[o];
                }
                dGs[o] = dg;
                KrT[o] = ar[rr] * w.Kr[o];
                if (r < rows) {
                    if (part) {
                        float *pr = part + ((prow0 + r) * H + h) * KDA_PW(dk);
                        pr[i] = dq;
                        pr[dk + i] = dkk;
                    } else {
                        int64_t go = ((tok0 + r) * H + h) * (int64_t)dk + i;
                        if (a.gq) tide_st(a.gq, go, dq);
                        if (a.gk) tide_st(a.gk, go, dkk);
                    }
                }
            }
        }
        __syncthreads();
        /* dS_c of the previous chunk: dS₀ = Q̂ᵀ dO + diag(Γ_c) dS_c − K̂ᵀ diag(β) dB */
        for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) {
            int i = idx / dv, j = idx - i * dv;
            float d = w.eGc[i] * dS[i * lds + j];
#pragma unroll
            for (int r = 0; r < KDA_CT; r++)
                d += w.Qh[r * dk + i] * w.dO[r * dv + j] - w.Kh[r * dk + i] * w.beta[r] * w.dB[r * dv + j];
            dS[i * lds + j] = d;
        }
        /* dg = reverse cumsum of dG; the last row adds colsum(dK_r ⊙ K_r) + Γ_c ⊙ rowsum(dS_c ⊙ S₀), which
           every row of the chunk inherits through the cumsum */
        if (a.gg || part)
            for (int i = threadIdx.x; i < dk; i += KDA_NT) {
                float acc = w.eGc[i] * w.rs[i];
#pragma unroll
                for (int r = 0; r < KDA_CT; r++) acc += KrT[r * dk + i];
#pragma unroll
                for (int r = KDA_CT - 1; r >= 0; r--) {
                    acc += dGs[r * dk + i] - KrT[r * dk + i];
                    if (r < rows) {
                        if (part) part[((prow0 + r) * H + h) * KDA_PW(dk) + 2 * dk + i] = acc;
                        else tide_st(a.gg, ((tok0 + r) * H + h) * (int64_t)dk + i, acc);
                    }
                }
            }
    }
    __syncthreads();
    float *o = c0 > 0 ? carry : (sg.s0_row >= 0 && a.gs0) ? a.gs0 + (sg.s0_row * H + h) * sz : nullptr;
    if (o)
        for (int idx = threadIdx.x; idx < dk * dv; idx += KDA_NT) {
            int i = idx / dv, j = idx - i * dv;
            o[kda_sidx(idx, dv, DV, v0)] = dS[i * lds + j];
        }
}

/* the backward's pre-pass over a block of chunks: per chunk and head, in parallel, the dk-side work that needs no
   state (kda.md §4: Af = StrictTril(K̂Ǩᵀ), P = Tril(Q̂Ǩᵀ), M = (I + diag(β)Af)⁻¹), written per state slot (the group's
   slots, as kda_vsum_kernel maps them) for the sequential kernel to read instead of forming them on its critical
   path: the K̂Ǩᵀ products and the 16-step substitution leave the chain of T / 16 dependent steps. Blocks: slot x head. */
template <typename T> struct kda_intra_args {
    float *out;                    /* [slots, H, KDA_INTRA] */
    const T *q, *k, *g, *beta;
    const kda_seg *seg;
    int nseg, H, dk, C, safe;
    int64_t blk;
    kda_smem L;
};

template <typename T, bool WMMA> __global__ void __launch_bounds__(KDA_NT) kda_intra_kernel(kda_intra_args<T> a)
{
    extern __shared__ __align__(128) float4 kda_smem4[];
    float *sm = reinterpret_cast<float *>(kda_smem4);
    const kda_views w = kda_make_views(sm, a.L);
    const int H = a.H, h = blockIdx.x % H;
    const int64_t slot = blockIdx.x / H;
    int lo = 0, hi = a.nseg - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (a.seg[mid].buf0 <= slot) lo = mid;
        else hi = mid - 1;
    }
    const kda_seg sg = a.seg[lo];
    const int64_t nch = (sg.len + a.C - 1) / a.C, ch = a.blk * sg.kbc + (slot - sg.buf0);
    if (slot - sg.buf0 >= sg.kbc || ch >= nch) return;   /* block-uniform */
    const int64_t tok0 = sg.start + ch * a.C;
    const int rows = (int)(sg.len - ch * a.C < a.C ? sg.len - ch * a.C : a.C);
    kda_load<T>(w, a.q, a.k, (const T *)nullptr, a.g, a.beta, (const T *)nullptr, tok0, rows, h, H, a.dk, 0, 0, 0, 0,
                0.0, nullptr);
    __syncthreads();
    kda_prep<WMMA>(w, rows, a.dk);
    __syncthreads();
    kda_pairs<WMMA>(w, a.dk, a.safe);
    __syncthreads();
    kda_solve<WMMA>(w);
    __syncthreads();
    float *o = a.out + (slot * H + h) * (int64_t)KDA_INTRA;
    for (int idx = threadIdx.x; idx < KDA_CT * KDA_CT; idx += KDA_NT) {
        o[idx] = w.Af[idx];
        o[KDA_CT * KDA_CT + idx] = w.P[idx];
        o[2 * KDA_CT * KDA_CT + idx] = w.M[idx];
    }
}

/* the split backward's dq, dk, dg, dβ: each row's partials over the nv column splits, added in split order in
   fp32 and rounded once. Rows are the group's state slots (slot·C + r); a row's segment is the last whose first
   slot is at or before it; rows past a segment's block or tokens are unused. */
template <typename T>
__global__ void kda_vsum_kernel(T *gq, T *gk, T *gg, T *gbeta, const float *part, const kda_seg *seg, int nseg,
                                int64_t blk, int64_t prow, int H, int dk, int C, int nv)
{
    const int W = KDA_PW(dk);
    const int64_t per = (int64_t)H * W, stride = prow * per;
    TIDE_GRID_LOOP(idx, prow * per) {
        int64_t p = idx / per, rem = idx - p * per, slot = p / C;
        int h = (int)(rem / W), c = (int)(rem - (int64_t)h * W);
        int lo = 0, hi = nseg - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (seg[mid].buf0 <= slot) lo = mid;
            else hi = mid - 1;
        }
        const kda_seg sg = seg[lo];
        int64_t nch = (sg.len + C - 1) / C, ch = blk * sg.kbc + (slot - sg.buf0), t = ch * C + (p - slot * C);
        if (slot - sg.buf0 >= sg.kbc || ch >= nch || t >= sg.len) continue;
        float s = 0.f;
        for (int v = 0; v < nv; v++) s += part[v * stride + idx];
        int64_t tok = sg.start + t;
        if (c < dk) { if (gq) tide_st(gq, (tok * H + h) * (int64_t)dk + c, s); }
        else if (c < 2 * dk) { if (gk) tide_st(gk, (tok * H + h) * (int64_t)dk + c - dk, s); }
        else if (c < 3 * dk) { if (gg) tide_st(gg, (tok * H + h) * (int64_t)dk + c - 2 * dk, s); }
        else if (gbeta) tide_st(gbeta, tok * H + h, s);
    }
}

/* ---- host side -------------------------------------------------------------------------------------- */

/* the non-empty segments of cu (NULL: one per row), checked: boundaries rise from 0 to B·T and no
   segment crosses a row start (backend.h: every row start is a boundary). Checkpoints: the layout of
   backend.h (ceil(ceil(len / chunk) / kb) per segment, segments in order; *n_ckpt in all); a segment's
   kbc chunks of C tokens per checkpoint spread its chunks over the checkpoints it has. */
static int kda_segments(const char *what, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T, int64_t C,
                        int64_t chunk, int64_t kb, kda_seg **out, int64_t *n_out, int64_t *n_ckpt)
{
    *out = NULL;
    *n_out = *n_ckpt = 0;
    int64_t N = B * T, n = cu ? n_seg : B;
    if (cu) {
        if (n_seg < 1) return tide_set_error("%s: cu_seqlens has %lld segments, expected at least 1", what, (long long)n_seg);
        if (cu[0] != 0 || cu[n_seg] != N)
            return tide_set_error("%s: cu_seqlens runs from %lld to %lld, expected 0 to B·T = %lld", what,
                                  (long long)cu[0], (long long)cu[n_seg], (long long)N);
    }
    kda_seg *s = (kda_seg *)malloc((size_t)(n > 0 ? n : 1) * sizeof *s);
    if (!s) return tide_set_error("%s: out of host memory for %lld segments", what, (long long)n);
    int64_t m = 0, cks = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t a = cu ? cu[i] : i * T, e = cu ? cu[i + 1] : (i + 1) * T;
        if (e < a) {
            free(s);
            return tide_set_error("%s: cu_seqlens decreases at %lld (%lld then %lld)", what, (long long)i,
                                  (long long)a, (long long)e);
        }
        if (e == a) continue;
        int64_t b = a / T;
        if ((e - 1) / T != b) {
            free(s);
            return tide_set_error("%s: segment [%lld, %lld) crosses the start of row %lld (T = %lld)", what,
                                  (long long)a, (long long)e, (long long)(b + 1), (long long)T);
        }
        int64_t nch = (e - a + C - 1) / C, ncap = ((e - a + chunk - 1) / chunk + kb - 1) / kb;
        s[m].start = a;
        s[m].len = e - a;
        s[m].ck0 = cks;
        s[m].kbc = (nch + ncap - 1) / ncap;
        s[m].buf0 = 0;
        s[m].s0_row = a == b * T ? b : -1;
        s[m].sout_row = e == (b + 1) * T ? b : -1;
        cks += ncap;
        m++;
    }
    *out = s;
    *n_out = m;
    *n_ckpt = cks;
    return 0;
}

/* a segment's state slots in the backward's buffer: one block's chunk start states */
static int64_t kda_slots(const kda_seg &s, int64_t C)
{
    int64_t nch = (s.len + C - 1) / C;
    return s.kbc < nch ? s.kbc : nch;
}

/* the backward's groups of consecutive segments: starts[0..n] (starts[n] = nseg); a group's slots together
   at most `budget` (a segment alone may have more); sets buf0; *slots / *segs: the largest group's slots and
   segment count (the buffers' sizes) */
static int kda_groups(kda_seg *s, int64_t nseg, int64_t C, int64_t budget, std::vector<int64_t> &starts,
                      int64_t *slots, int64_t *segs)
{
    starts.clear();
    *slots = *segs = 0;
    int64_t used = 0;
    for (int64_t i = 0; i < nseg; i++) {
        int64_t n = kda_slots(s[i], C);
        if (starts.empty() || used + n > budget) {
            starts.push_back(i);
            used = 0;
        }
        s[i].buf0 = used;
        used += n;
        if (used > *slots) *slots = used;
        int64_t g = i + 1 - starts.back();
        if (g > *segs) *segs = g;
    }
    starts.push_back(nseg);
    return 0;
}

/* the CUDA backward's own checkpoints when the forward kept none (the recurrent path, a direct call):
   every kda_bwd_ckpt_chunks-th chunk; the group budget in state slots (0: the checkpoint count). Tests of the
   emulator set them. */
static int64_t kda_bwd_ckpt_chunks = TIDE_KDA_CUDA_CKPT_CHUNKS;
static int64_t kda_bwd_budget = 0;

/* the column split of a chunked call (launch.h tide_kda_vsplit) over `blocks` (segment, head) blocks. TIDE_KDA_VSPLIT
   (a positive integer dividing dv; 1 = never split) overrides the choice, for benchmarks; tests of the emulator set
   kda_vsplit_force. -1 with the error set on a bad value. */
static int kda_vsplit_force = 0;
/* whether the pre-pass (kda_intra_kernel) runs: TIDE_KDA_PREPASS=0 turns it off (benchmarks, the emulator's bitwise
   check): each chunk's Af, P, M are then formed in the sequential kernel and the training forward runs in one launch;
   1 or unset keeps it; -1 with the error set on another value */
static int kda_prepass(const char *what)
{
    const char *env = getenv("TIDE_KDA_PREPASS");
    if (env && *env && strcmp(env, "0") && strcmp(env, "1"))
        return tide_set_error("%s: TIDE_KDA_PREPASS=%s: expected 0 (off) or 1 (on)", what, env);
    return !(env && !strcmp(env, "0"));
}

static int kda_vsplit(const char *what, int64_t blocks, int64_t dv)
{
    int force = kda_vsplit_force;
    const char *env = getenv("TIDE_KDA_VSPLIT");
    if (!force && env && *env) {
        char *end = NULL;
        long v = strtol(env, &end, 10);
        if (*end || v < 1 || v > dv || dv % v || (dv % 16 == 0 && (dv / v) % 16))
            return tide_set_error("%s: TIDE_KDA_VSPLIT=%s: expected a positive integer that divides dv = %lld%s", what,
                                  env, (long long)dv, dv % 16 == 0 ? " into multiples of 16" : "");
        force = (int)v;
    }
    return tide_kda_vsplit(blocks, dv, tide_cuda_sm_count(), force);
}

static int kda_smem_limit(void)
{
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
        cudaGetLastError();
        return 48 * 1024;
    }
    return v;
}

/* the dynamic shared memory a kernel may take: the opt-in limit less the kernel's own static shared memory
   (the recurrent kernel's broadcast β) */
template <typename K> static int kda_dyn_limit(K kernel)
{
    int limit = kda_smem_limit();
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
        cudaGetLastError();
        return limit;
    }
    return limit - (int)fa.sharedSizeBytes;
}

/* a kernel's dynamic shared memory: refused by name past the device's limit (dk x dv, or dk alone when dv is 0;
   `where` says which pass), else its attribute set */
template <typename K>
static int kda_smem_attr(K kernel, size_t bytes, const char *what, int64_t dk, int64_t dv, const char *where)
{
    int limit = kda_dyn_limit(kernel);
    if (bytes > (size_t)limit) {
        char sizes[64];
        if (dv) snprintf(sizes, sizeof sizes, "dk %lld x dv %lld", (long long)dk, (long long)dv);
        else snprintf(sizes, sizeof sizes, "dk %lld", (long long)dk);
        return tide_set_error("%s: %s needs %zu bytes of shared memory per block%s; the device allows %d", what, sizes,
                              bytes, where, limit);
    }
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) != cudaSuccess)
        return tide_set_error("cuda %s (shared memory attribute%s): %s", what, where,
                              cudaGetErrorString(cudaGetLastError()));
    return 0;
}

static int kda_check_sizes(const char *what, int dtype, int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv)
{
    if (dtype == TIDE_F64) return tide_set_error("%s: not implemented on the cuda backend for f64", what);
    if (dtype != TIDE_F32 && dtype != TIDE_BF16)
        return tide_set_error("%s: dtype %s is not supported on the cuda backend (f32, bf16)", what,
                              tide_cuda_dtype_str(dtype));
    if (B < 0 || T < 0 || H < 1 || dk < 1 || dv < 1 || H > INT_MAX || dk > 4096 || dv > 4096)
        return tide_set_error("%s: bad sizes B %lld T %lld H %lld dk %lld dv %lld", what, (long long)B, (long long)T,
                              (long long)H, (long long)dk, (long long)dv);
    return 0;
}

/* the device copy of the segment table; *d is released by the caller */
static int kda_upload_segments(const char *what, const kda_seg *s, int64_t n, kda_seg **d, cudaStream_t st)
{
    *d = NULL;
    cudaError_t e = tide_cuda_alloc((void **)d, (size_t)n * sizeof(kda_seg), st);
    if (e != cudaSuccess) return tide_set_error("cuda %s segment table alloc: %s", what, cudaGetErrorString(e));
    /* staged (tide_cuda_upload): the host table may be freed */
    e = tide_cuda_upload(*d, s, (size_t)n * sizeof(kda_seg), st);
    if (e != cudaSuccess) return tide_set_error("cuda %s segment table copy: %s", what, cudaGetErrorString(e));
    return 0;
}


/* the bound check (g outside [lb, 0], kda.md §5) is deferred (common.cuh): the record's key for this call, the
   message's context kept; after the kernels, the capture of the offending g */
static int kda_check_begin(const char *what, int64_t T_, int64_t H, int64_t dk, double lb, tide_cuda_scratch **sc,
                           unsigned long long *base)
{
    if (tide_cuda_get_scratch(sc)) return -1;
    tide_cuda_defer_ctx c = {};
    c.kind = TIDE_DEFER_KDA;
    snprintf(c.what, sizeof c.what, "%s", what);
    c.n = T_;
    c.H = H;
    c.dk = dk;
    c.lb = lb;
    return tide_cuda_defer_begin(&c, base);
}

template <typename T>
static int kda_check_end(tide_cuda_scratch *sc, unsigned long long base, const void *g, cudaStream_t s)
{
    tide_defer_capture_kernel<T><<<1, 32, 0, s>>>(sc, base, (const T *)g);
    TIDE_CU_LAUNCH("kda bound check capture kernel");
    return 0;
}

/* states s_out of rows without tokens (T = 0): the initial state itself */
static int kda_empty_rows(const char *what, float *s_out, const float *s0, int64_t B, int64_t H, int64_t dk,
                          int64_t dv, cudaStream_t s)
{
    if (!s_out) return 0;
    size_t n = (size_t)(B * H * dk * dv) * sizeof(float);
    if (s0) TIDE_CU(cudaMemcpyAsync(s_out, s0, n, cudaMemcpyDeviceToDevice, s), what);
    else TIDE_CU(cudaMemsetAsync(s_out, 0, n, s), what);
    return 0;
}

static int kda_chunk_of(int path, int64_t chunk)
{
    if (path == TIDE_KDA_RECURRENT) return KDA_CT;
    return chunk < KDA_CT ? (int)chunk : KDA_CT;
}

template <typename T, bool WMMA>
static int kda_launch_forward(const char *what, const kda_fwd_args<T> &args, int64_t blocks, cudaStream_t s)
{
    size_t bytes = (size_t)args.L.total * sizeof(float);
    if (kda_smem_attr(kda_chunk_kernel<T, WMMA>, bytes, what, args.dk, args.dv, "")) return -1;
    kda_chunk_kernel<T, WMMA><<<(unsigned)blocks, KDA_NT, bytes, s>>>(args);
    TIDE_CU_LAUNCH("kda forward kernel");
    return 0;
}

/* the chunked forward of one dtype (kda_fwd_args): blk < 0: o, s_out and ckpt (each may be NULL); blk >= 0: the
   start states of block blk of every segment into states, from ckpt, or with o round blk of kda_forward_rounds */
template <typename T>
static int kda_forward_chunks(const char *what, T *o, float *s_out, float *ckpt, float *states, int64_t blk,
                              const T *q, const T *k,
                              const T *v, const T *g, const T *beta, const float *s0, const kda_seg *seg_d,
                              int64_t nseg, int64_t H, int64_t dk, int64_t dv, int safe, int C, int check, double lb,
                              unsigned long long *bad, unsigned long long bad_base, int nv, cudaStream_t s,
                              const float *intra = nullptr, int roll = 0)
{
    /* tensor cores for bf16 on the factorised path (kda.md §5), whole 16-column tiles in every split; f32 and the
       per-pair path use FMA. The split changes no bit: a column's sums run in the same order in any block. */
    bool wmma = sizeof(T) == 2 && !safe && dk % 16 == 0 && (dv / nv) % 16 == 0;
    kda_fwd_args<T> args;
    args.o = o;
    args.s_out = s_out;
    args.ckpt = ckpt;
    args.states = states;
    args.blk = blk;
    args.q = q;
    args.k = k;
    args.v = v;
    args.g = g;
    args.beta = beta;
    args.s0 = s0;
    args.seg = seg_d;
    args.H = (int)H;
    args.dk = (int)dk;
    args.dv = (int)dv;
    args.C = C;
    args.safe = safe;
    args.check = check;
    args.lb = lb;
    args.bad = bad;
    args.bad_base = bad_base;
    args.nv = nv;
    args.intra = intra;
    args.roll = roll;
    args.L = kda_layout((int)dk, (int)(dv / nv), safe, wmma, 0);
    if (nseg * H * nv > INT_MAX)
        return tide_set_error("%s: %lld segments x %lld heads x %d column splits is too many blocks", what,
                              (long long)nseg, (long long)H, nv);
    if constexpr (sizeof(T) == 2) {
        if (wmma) return kda_launch_forward<T, true>(what, args, nseg * H * nv, s);
    }
    return kda_launch_forward<T, false>(what, args, nseg * H * nv, s);
}

template <typename T>
static int kda_forward_recurrent(const char *what, T *o, float *s_out, const T *q, const T *k, const T *v, const T *g,
                                 const T *beta, const float *s0, const kda_seg *seg_d, int64_t nseg, int64_t H,
                                 int64_t dk, int64_t dv, cudaStream_t s)
{
    kda_rec_args<T> args;
    args.o = o;
    args.s_out = s_out;
    args.q = q;
    args.k = k;
    args.v = v;
    args.g = g;
    args.beta = beta;
    args.s0 = s0;
    args.seg = seg_d;
    args.H = (int)H;
    args.dk = (int)dk;
    args.dv = (int)dv;
    size_t bytes = kda_recurrent_smem((int)dk, (int)dv);
    if (kda_smem_attr(kda_recurrent_kernel<T>, bytes, what, dk, dv, "")) return -1;
    if (nseg * H > INT_MAX) return tide_set_error("%s: %lld segments x %lld heads is too many blocks", what, (long long)nseg, (long long)H);
    kda_recurrent_kernel<T><<<(unsigned)(nseg * H), KDA_NT, bytes, s>>>(args);
    TIDE_CU_LAUNCH("kda recurrent kernel");
    return 0;
}

/* what the backward runs over: the segments with their checkpoint layout (the forward's, or its own when
   own), the groups (kda_groups) and per group its segments' most blocks */
struct kda_bwd_plan {
    kda_seg *seg;                 /* malloc'ed; the caller frees it */
    int64_t nseg, n_ck, slots, gsegs, maxblk, C;
    int own, nv;                  /* nv: the column split (kda_vsplit) over the largest group's blocks */
    int intra;                    /* the pre-pass (kda_intra_kernel) runs */
    std::vector<int64_t> groups, nblk;
};

static int kda_backward_plan(const char *what, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T_, int64_t H,
                             int64_t dv, int path, int64_t chunk, int no_ckpt, kda_bwd_plan &p)
{
    int64_t C = kda_chunk_of(path, chunk);
    /* the forward's checkpoints in the engine's layout, else our own: every kda_bwd_ckpt_chunks-th chunk */
    p.own = no_ckpt || path == TIDE_KDA_RECURRENT;
    if (kda_segments(what, cu, n_seg, B, T_, C, p.own ? C : chunk, p.own ? kda_bwd_ckpt_chunks : TIDE_KDA_CUDA_CKPT_CHUNKS,
                     &p.seg, &p.nseg, &p.n_ck))
        return -1;
    kda_groups(p.seg, p.nseg, C, kda_bwd_budget > 0 ? kda_bwd_budget : p.n_ck, p.groups, &p.slots, &p.gsegs);
    p.C = C;
    p.intra = kda_prepass(what);
    p.nv = p.intra < 0 ? -1 : kda_vsplit(what, p.gsegs * H, dv);
    if (p.nv < 0) {
        free(p.seg);
        p.seg = NULL;
        return -1;
    }
    p.nblk.assign(p.groups.size(), 0);
    p.maxblk = 0;
    for (size_t gi = 0; gi + 1 < p.groups.size(); gi++) {
        for (int64_t i = p.groups[gi]; i < p.groups[gi + 1]; i++) {
            int64_t nb = ((p.seg[i].len + C - 1) / C + p.seg[i].kbc - 1) / p.seg[i].kbc;
            if (nb > p.nblk[gi]) p.nblk[gi] = nb;
        }
        if (p.nblk[gi] > p.maxblk) p.maxblk = p.nblk[gi];
    }
    return 0;
}

/* device bytes the backward allocates (segment table, its own checkpoints, the state and carry buffers, and
   with a column split the partial dq, dk, dg, dβ of every split over the group's slot rows) and the forward's
   checkpoint tensor that the engine keeps for it (*ckpt_bytes; 0 for the recurrent path) */
static size_t kda_partial_bytes(const kda_bwd_plan &p, int64_t H, int64_t dk)
{
    return p.nv > 1 ? (size_t)p.nv * (size_t)(p.slots * p.C) * (size_t)H * (size_t)KDA_PW(dk) * sizeof(float) : 0;
}

static size_t kda_intra_bytes(const kda_bwd_plan &p, int64_t H)
{
    return p.intra ? (size_t)p.slots * (size_t)H * KDA_INTRA * sizeof(float) : 0;
}

static size_t kda_backward_bytes(const kda_bwd_plan &p, int64_t H, int64_t dk, int64_t dv, size_t *ckpt_bytes)
{
    const size_t sz = (size_t)H * (size_t)dk * (size_t)dv * sizeof(float);
    *ckpt_bytes = p.own ? 0 : (size_t)p.n_ck * sz;
    return (size_t)p.nseg * sizeof(kda_seg) + (p.own ? (size_t)p.n_ck * sz : 0) + (size_t)p.slots * sz +
           (p.maxblk > 1 ? (size_t)p.gsegs * sz : 0) + kda_partial_bytes(p, H, dk) + kda_intra_bytes(p, H);
}

/* the pre-pass over block blk of the group's segments seg_d[0, ng): a block per state slot and head */
template <typename T, bool WMMA>
static int kda_launch_intra(const char *what, kda_intra_args<T> ia, int64_t slots, int64_t H, cudaStream_t s)
{
    size_t bytes = (size_t)ia.L.total * sizeof(float);
    if (kda_smem_attr(kda_intra_kernel<T, WMMA>, bytes, what, ia.dk, 0, " in the pre-pass")) return -1;
    if (slots * H > INT_MAX)
        return tide_set_error("%s: %lld state slots x %lld heads is too many blocks", what, (long long)slots, (long long)H);
    kda_intra_kernel<T, WMMA><<<(unsigned)(slots * H), KDA_NT, bytes, s>>>(ia);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tide_set_error("cuda %s pre-pass kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

template <typename T>
static kda_intra_args<T> kda_intra_of(float *out, const void *q, const void *k, const void *g, const void *beta,
                                      int64_t H, int64_t dk, int C, int safe, int wmma)
{
    kda_intra_args<T> ia;
    memset(&ia, 0, sizeof ia);
    ia.out = out;
    ia.q = (const T *)q;
    ia.k = (const T *)k;
    ia.g = (const T *)g;
    ia.beta = (const T *)beta;
    ia.H = (int)H;
    ia.dk = (int)dk;
    ia.C = C;
    ia.safe = safe;
    ia.L = kda_layout((int)dk, 0, safe, wmma, 0, 1);
    return ia;
}

/* The forward with an output (kda_forward_typed) in rounds: per group of segments (kda_groups, as the backward takes
   them) and block of kbc chunks, the pre-pass forms every chunk's P and M in parallel, then the sequential kernel
   runs the block from s0 or the block's checkpoint and writes the next block's checkpoint. The same functions on the
   same chunks: o, the final states and the checkpoints are the single-launch forward's bits. Without checkpoints
   (ckpt NULL: no backward follows) the start states pass through one scratch slot per segment instead. */
template <typename T>
static int kda_forward_rounds(const char *what, T *o, float *s_out, float *ckpt, const T *q, const T *k, const T *v,
                              const T *g, const T *beta, const float *s0, const int64_t *cu, int64_t n_seg, int64_t B,
                              int64_t T_, int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk, int check,
                              double lb, unsigned long long *bad, unsigned long long bad_base, cudaStream_t s)
{
    int safe = path == TIDE_KDA_CHUNK_SAFE, C = kda_chunk_of(path, chunk);
    kda_bwd_plan pl;
    if (kda_backward_plan(what, cu, n_seg, B, T_, H, dv, path, chunk, 0, pl)) return -1;
    /* no checkpoints kept (no backward follows): a segment's round start states pass through one scratch slot, which
       each round reads and then overwrites with the next round's */
    const int roll = ckpt == NULL;
    const int64_t roll_slots = roll ? pl.nseg : 0;
    for (int64_t i = 0; i < roll_slots; i++) pl.seg[i].ck0 = i;
    kda_seg *seg_d = NULL;
    int rc = kda_upload_segments(what, pl.seg, pl.nseg, &seg_d, s);
    free(pl.seg);
    const int nv = pl.nv;
    const bool wmma = sizeof(T) == 2 && !safe && dk % 16 == 0 && (dv / nv) % 16 == 0;
    float *intra = NULL, *own = NULL;
    if (!rc && tide_cuda_alloc((void **)&intra, kda_intra_bytes(pl, H), s) != cudaSuccess)
        rc = tide_set_error("cuda %s: %zu bytes of scratch for the pre-pass", what, kda_intra_bytes(pl, H));
    size_t roll_bytes = (size_t)roll_slots * (size_t)(H * dk * dv) * sizeof(float);
    if (!rc && roll && tide_cuda_alloc((void **)&own, roll_bytes, s) != cudaSuccess)
        rc = tide_set_error("cuda %s: %zu bytes of scratch for the round start states", what, roll_bytes);
    if (roll) ckpt = own;
    kda_intra_args<T> ia = kda_intra_of<T>(intra, q, k, g, beta, H, dk, C, safe, wmma);
    for (size_t gi = 0; !rc && gi + 1 < pl.groups.size(); gi++) {
        int64_t g0 = pl.groups[gi], ng = pl.groups[gi + 1] - g0;
        for (int64_t blk = 0; blk < pl.nblk[gi] && !rc; blk++) {
            ia.seg = seg_d + g0;
            ia.nseg = (int)ng;
            ia.blk = blk;
            if constexpr (sizeof(T) == 2) {
                if (wmma) rc = kda_launch_intra<T, true>(what, ia, pl.slots, H, s);
                else rc = kda_launch_intra<T, false>(what, ia, pl.slots, H, s);
            } else {
                rc = kda_launch_intra<T, false>(what, ia, pl.slots, H, s);
            }
            if (!rc)
                rc = kda_forward_chunks<T>(what, o, s_out, ckpt, (float *)NULL, blk, q, k, v, g, beta, s0, seg_d + g0, ng,
                                           H, dk, dv, safe, C, check, lb, bad, bad_base, nv, s, intra, roll);
        }
    }
    tide_cuda_release(own, s);
    tide_cuda_release(intra, s);
    tide_cuda_release(seg_d, s);
    return rc;
}

template <typename T>
static int kda_forward_typed(void *o, void *s_out, const void *q, const void *k, const void *v, const void *g,
                             const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T_,
                             int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk, double lb, void *ckpt)
{
    const char *what = "kda";
    TIDE_STREAM(s);
    if (B * T_ == 0) return kda_empty_rows(what, (float *)s_out, (const float *)s0, B, H, dk, dv, s);
    int C = kda_chunk_of(path, chunk);
    kda_seg *seg = NULL, *seg_d = NULL;
    int64_t nseg = 0, n_ck = 0;
    if (kda_segments(what, cu, n_seg, B, T_, C, path == TIDE_KDA_RECURRENT ? C : chunk, TIDE_KDA_CUDA_CKPT_CHUNKS,
                     &seg, &nseg, &n_ck))
        return -1;
    int rc = kda_upload_segments(what, seg, nseg, &seg_d, s);
    free(seg);
    int check = path == TIDE_KDA_CHUNK && !(isinf(lb) && lb < 0);
    if (B * T_ * H * dk >= (1ll << TIDE_DEFER_SHIFT)) check = 0;   /* past the record's position bits (2^40) */
    tide_cuda_scratch *sc = NULL;
    unsigned long long base = 0;
    int nv = path == TIDE_KDA_RECURRENT ? 1 : kda_vsplit(what, nseg * H, dv);
    int prepass = path == TIDE_KDA_RECURRENT || !o ? 0 : kda_prepass(what);
    if (nv < 0 || prepass < 0) rc = -1;
    if (!rc && check) rc = kda_check_begin(what, T_, H, dk, lb, &sc, &base);
    if (!rc) {
        if (path == TIDE_KDA_RECURRENT)
            rc = kda_forward_recurrent<T>(what, (T *)o, (float *)s_out, (const T *)q, (const T *)k, (const T *)v,
                                          (const T *)g, (const T *)beta, (const float *)s0, seg_d, nseg, H, dk, dv, s);
        else if (prepass)   /* in rounds behind the pre-pass (no checkpoints kept: rolling start states) */
            rc = kda_forward_rounds<T>(what, (T *)o, (float *)s_out, (float *)ckpt, (const T *)q, (const T *)k,
                                       (const T *)v, (const T *)g, (const T *)beta, (const float *)s0, cu, n_seg, B,
                                       T_, H, dk, dv, path, chunk, check, lb,
                                       check ? &sc->defer_key : (unsigned long long *)NULL, base, s);
        else
            rc = kda_forward_chunks<T>(what, (T *)o, (float *)s_out, (float *)ckpt, (float *)NULL, -1, (const T *)q,
                                       (const T *)k, (const T *)v, (const T *)g, (const T *)beta, (const float *)s0,
                                       seg_d, nseg, H, dk, dv, path == TIDE_KDA_CHUNK_SAFE, C, check, lb,
                                       check ? &sc->defer_key : (unsigned long long *)NULL, base, nv, s);
    }
    tide_cuda_release(seg_d, s);
    if (!rc && check) rc = kda_check_end<T>(sc, base, g, s);
    return rc;
}

int tide_cuda_kda(int dtype, void *o, void *s_out, const void *q, const void *k, const void *v, const void *g,
                  const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T, int64_t H,
                  int64_t dk, int64_t dv, int path, int64_t chunk, double lb, void *ckpt)
{
    if (kda_check_sizes("kda", dtype, B, T, H, dk, dv)) return -1;
    if (path != TIDE_KDA_CHUNK && path != TIDE_KDA_CHUNK_SAFE && path != TIDE_KDA_RECURRENT)
        return tide_set_error("kda: unknown path %d (TIDE_KDA_CHUNK, TIDE_KDA_CHUNK_SAFE, TIDE_KDA_RECURRENT)", path);
    if (path != TIDE_KDA_RECURRENT && chunk < 1) return tide_set_error("kda: chunk %lld must be positive", (long long)chunk);
    if (dtype == TIDE_F32)
        return kda_forward_typed<float>(o, s_out, q, k, v, g, beta, s0, cu, n_seg, B, T, H, dk, dv, path, chunk, lb,
                                        path == TIDE_KDA_RECURRENT ? NULL : ckpt);
    return kda_forward_typed<kda_bf16>(o, s_out, q, k, v, g, beta, s0, cu, n_seg, B, T, H, dk, dv, path, chunk, lb,
                                       path == TIDE_KDA_RECURRENT ? NULL : ckpt);
}

/* one block of chunks of the backward: blk of every segment in the group seg_d[0, nseg) */
template <typename T>
static int kda_backward_block(const char *what, kda_bwd_args<T> args, int64_t nseg, size_t bytes, cudaStream_t s)
{
    if (nseg * args.H * args.nv > INT_MAX)
        return tide_set_error("%s: %lld segments x %d heads x %d column splits is too many blocks", what,
                              (long long)nseg, args.H, args.nv);
    kda_chunk_backward_kernel<T><<<(unsigned)(nseg * args.H * args.nv), KDA_NT, bytes, s>>>(args);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tide_set_error("cuda %s kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

template <typename T>
static int kda_backward_typed(void *gq, void *gk, void *gv, void *gg, void *gbeta, void *gs0, const void *gout,
                              const void *gs_out, const void *q, const void *k, const void *v, const void *g,
                              const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B,
                              int64_t T_, int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk, double lb,
                              const void *ckpt_in)
{
    const char *what = "kda backward";
    TIDE_STREAM(s);
    if (B * T_ == 0) {
        if (gs0) {
            size_t n = (size_t)(B * H * dk * dv) * sizeof(float);
            if (gs_out) TIDE_CU(cudaMemcpyAsync(gs0, gs_out, n, cudaMemcpyDeviceToDevice, s), what);
            else TIDE_CU(cudaMemsetAsync(gs0, 0, n, s), what);
        }
        return 0;
    }
    /* the recurrence's gradient is the chunk form's (the same function), on the per-pair path */
    int safe = path != TIDE_KDA_CHUNK, C = kda_chunk_of(path, chunk);
    kda_bwd_plan pl;
    if (kda_backward_plan(what, cu, n_seg, B, T_, H, dv, path, chunk, ckpt_in == NULL, pl)) return -1;
    const int own = pl.own, nv = pl.nv;
    const int64_t nseg = pl.nseg, n_ck = pl.n_ck, slots = pl.slots, gsegs = pl.gsegs;
    const std::vector<int64_t> &groups = pl.groups, &nblk = pl.nblk;
    kda_seg *seg_d = NULL;
    int rc = kda_upload_segments(what, pl.seg, nseg, &seg_d, s);
    free(pl.seg);
    const size_t sz = (size_t)H * (size_t)dk * (size_t)dv * sizeof(float);
    float *ckpt = (float *)ckpt_in, *states = NULL, *carry = NULL, *part = NULL, *intra = NULL;
    cudaError_t e = cudaSuccess;
    if (!rc && own) e = tide_cuda_alloc((void **)&ckpt, (size_t)n_ck * sz, s);
    if (!rc && e == cudaSuccess) e = tide_cuda_alloc((void **)&states, (size_t)slots * sz, s);
    if (!rc && e == cudaSuccess && pl.maxblk > 1) e = tide_cuda_alloc((void **)&carry, (size_t)gsegs * sz, s);
    if (!rc && e == cudaSuccess && nv > 1) e = tide_cuda_alloc((void **)&part, kda_partial_bytes(pl, H, dk), s);
    if (!rc && e == cudaSuccess && pl.intra) e = tide_cuda_alloc((void **)&intra, kda_intra_bytes(pl, H), s);
    if (!rc && e != cudaSuccess) {
        size_t ck_bytes;
        rc = tide_set_error("cuda %s: %zu bytes of scratch (%lld checkpoints%s, %lld chunk start states, %lld carried "
                            "gradients, %d column splits, the pre-pass): %s", what, kda_backward_bytes(pl, H, dk, dv, &ck_bytes),
                            (long long)n_ck, own ? "" : " kept by the forward", (long long)slots, (long long)gsegs, nv,
                            cudaGetErrorString(e));
    }
    /* the bound check rides on the forward that writes the checkpoints: here only when we write them */
    int check = own && path == TIDE_KDA_CHUNK && !(isinf(lb) && lb < 0);
    if (B * T_ * H * dk >= (1ll << TIDE_DEFER_SHIFT)) check = 0;
    tide_cuda_scratch *sc = NULL;
    unsigned long long base = 0;
    if (!rc && check) rc = kda_check_begin(what, T_, H, dk, lb, &sc, &base);
    if (!rc && own)
        rc = kda_forward_chunks<T>(what, (T *)NULL, (float *)NULL, ckpt, (float *)NULL, -1, (const T *)q, (const T *)k,
                                   (const T *)v, (const T *)g, (const T *)beta, (const float *)s0, seg_d, nseg, H, dk,
                                   dv, safe, C, check, lb, check ? &sc->defer_key : (unsigned long long *)NULL, base,
                                   nv, s);
    kda_bwd_args<T> args;
    args.gq = (T *)gq;
    args.gk = (T *)gk;
    args.gv = (T *)gv;
    args.gg = (T *)gg;
    args.gbeta = (T *)gbeta;
    args.gs0 = (float *)gs0;
    args.gout = (const T *)gout;
    args.gs_out = (const float *)gs_out;
    args.states = states;
    args.carry = carry;
    args.q = (const T *)q;
    args.k = (const T *)k;
    args.v = (const T *)v;
    args.g = (const T *)g;
    args.beta = (const T *)beta;
    args.H = (int)H;
    args.dk = (int)dk;
    args.dv = (int)dv;
    args.C = C;
    args.safe = safe;
    args.nv = nv;
    args.part = part;
    args.prow = slots * C;
    args.intra = intra;
    args.L = kda_layout((int)dk, (int)(dv / nv), safe, 0, 1);
    size_t bytes = (size_t)args.L.total * sizeof(float);
    kda_intra_args<T> ia = kda_intra_of<T>(intra, q, k, g, beta, H, dk, C, safe, 0);
    if (!rc) rc = kda_smem_attr(kda_chunk_backward_kernel<T>, bytes, what, dk, dv, "");
    /* each group: its blocks from the last, the start states of a block then its chunks in reverse */
    for (size_t gi = 0; !rc && gi + 1 < groups.size(); gi++) {
        int64_t g0 = groups[gi], ng = groups[gi + 1] - g0;
        for (int64_t blk = nblk[gi] - 1; blk >= 0 && !rc; blk--) {
            rc = kda_forward_chunks<T>(what, (T *)NULL, (float *)NULL, ckpt, states, blk, (const T *)q, (const T *)k,
                                       (const T *)v, (const T *)g, (const T *)beta, (const float *)s0, seg_d + g0, ng,
                                       H, dk, dv, safe, C, 0, lb, (unsigned long long *)NULL, 0, nv, s);
            args.seg = seg_d + g0;
            args.blk = blk;
            if (!rc && intra) {
                ia.seg = seg_d + g0;
                ia.nseg = (int)ng;
                ia.blk = blk;
                rc = kda_launch_intra<T, false>(what, ia, slots, H, s);
            }
            if (!rc) rc = kda_backward_block<T>(what, args, ng, bytes, s);
            if (!rc && nv > 1) {
                int64_t n = args.prow * H * KDA_PW(dk);
                kda_vsum_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>(args.gq, args.gk, args.gg, args.gbeta, part,
                                                                           seg_d + g0, (int)ng, blk, args.prow, (int)H,
                                                                           (int)dk, C, nv);
                cudaError_t le = cudaGetLastError();
                if (le != cudaSuccess) rc = tide_set_error("cuda %s column-split sum kernel: %s", what, cudaGetErrorString(le));
            }
        }
    }
    tide_cuda_release(intra, s);
    tide_cuda_release(part, s);
    tide_cuda_release(carry, s);
    tide_cuda_release(states, s);
    if (own) tide_cuda_release(ckpt, s);
    tide_cuda_release(seg_d, s);
    if (!rc && check) rc = kda_check_end<T>(sc, base, g, s);
    return rc;
}

int tide_cuda_kda_backward(int dtype, void *gq, void *gk, void *gv, void *gg, void *gbeta, void *gs0, const void *gout,
                           const void *gs_out, const void *q, const void *k, const void *v, const void *g,
                           const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T,
                           int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk, double lb, const void *ckpt)
{
    if (kda_check_sizes("kda backward", dtype, B, T, H, dk, dv)) return -1;
    if (path != TIDE_KDA_CHUNK && path != TIDE_KDA_CHUNK_SAFE && path != TIDE_KDA_RECURRENT)
        return tide_set_error("kda backward: unknown path %d", path);
    if (path != TIDE_KDA_RECURRENT && chunk < 1)
        return tide_set_error("kda backward: chunk %lld must be positive", (long long)chunk);
    if (dtype == TIDE_F32)
        return kda_backward_typed<float>(gq, gk, gv, gg, gbeta, gs0, gout, gs_out, q, k, v, g, beta, s0, cu, n_seg, B,
                                         T, H, dk, dv, path, chunk, lb, ckpt);
    return kda_backward_typed<kda_bf16>(gq, gk, gv, gg, gbeta, gs0, gout, gs_out, q, k, v, g, beta, s0, cu, n_seg, B, T,
                                        H, dk, dv, path, chunk, lb, ckpt);
}

/* ---- the decay gate (kda.md §2; derivatives §6 "Outside the kernel") --------------------------------
   BOUNDED: g = lb σ(u), u = e^{A_h}(z + b).  SOFTPLUS: g = −e^{A_h} softplus(z + b). σ and softplus are
   written so that no |x| overflows: exp of a large argument goes to inf and 1/(1 + inf) is 0. */

template <typename A> __device__ __forceinline__ A kda_sigmoid(A x) { return A(1) / (A(1) + exp(-x)); }
template <typename A> __device__ __forceinline__ A kda_softplus(A x)
{
    return (x > A(0) ? x : A(0)) + log1p(exp(-fabs(x)));
}

template <typename T>
__global__ void kda_gate_kernel(T *g, const T *z, const T *A_log, const T *dt_bias, int64_t N, int64_t H, int64_t D,
                                double lb, int form)
{
    typedef TIDE_ACC(T) A;
    const int64_t HD = H * D;
    TIDE_GRID_LOOP(idx, N * HD) {
        int64_t hd = idx % HD;
        A x = tide_ld(z, idx) + tide_ld(dt_bias, hd), ea = exp(tide_ld(A_log, hd / D));
        A out = form == TIDE_KDA_GATE_BOUNDED ? A(lb) * kda_sigmoid(ea * x) : -ea * kda_softplus(x);
        tide_st(g, idx, out);
    }
}

/* gz elementwise; per column (h, d) partial sums over a chunk of rows of gz (for gb) and of gg ∂g/∂A
   (for gA). Block (32, 8): 32 columns, 8 row lanes; fixed order, so the sums are deterministic. */
template <typename T>
__global__ void kda_gate_backward_kernel(T *gz, TIDE_ACC(T) *pb, TIDE_ACC(T) *pa, const T *gg, const T *z,
                                         const T *A_log, const T *dt_bias, int64_t N, int64_t H, int64_t D, double lb,
                                         int form, int64_t rows_per)
{
    typedef TIDE_ACC(T) A;
    __shared__ A shb[8][33], sha[8][33];
    const int64_t HD = H * D;
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t col = (int64_t)blockIdx.x * 32 + tx;
    int64_t n0 = (int64_t)blockIdx.y * rows_per, n1 = n0 + rows_per < N ? n0 + rows_per : N;
    A sb = A(0), sa = A(0);
    if (col < HD) {
        A b = tide_ld(dt_bias, col), ea = exp(tide_ld(A_log, col / D));
        for (int64_t n = n0 + ty; n < n1; n += 8) {
            int64_t idx = n * HD + col;
            A x = tide_ld(z, idx) + b, gv = tide_ld(gg, idx), dz, dA;
            if (form == TIDE_KDA_GATE_BOUNDED) {
                A u = ea * x, s = kda_sigmoid(u), d = A(lb) * s * (A(1) - s);
                dz = d * ea;
                dA = d * u;
            } else {
                dz = -ea * kda_sigmoid(x);
                dA = -ea * kda_softplus(x);   /* ∂g/∂A = g */
            }
            if (gz) tide_st(gz, idx, gv * dz);
            sb += gv * dz;
            sa += gv * dA;
        }
    }
    shb[ty][tx] = sb;
    sha[ty][tx] = sa;
    __syncthreads();
    if (ty == 0 && col < HD && pb) {
        for (int k = 1; k < 8; k++) {
            sb += shb[k][tx];
            sa += sha[k][tx];
        }
        pb[blockIdx.y * HD + col] = sb;
        pa[blockIdx.y * HD + col] = sa;
    }
}

/* gb[c] = Σ_chunks pb[., c];  gA[h] = Σ_chunks Σ_d pa[., h·D + d], in a fixed order */
template <typename T>
__global__ void kda_gate_final_kernel(T *gA, T *gb, const TIDE_ACC(T) *pb, const TIDE_ACC(T) *pa, int64_t H, int64_t D,
                                      int nchunks)
{
    typedef TIDE_ACC(T) A;
    const int64_t HD = H * D;
    TIDE_GRID_LOOP(c, HD + H) {
        A s = A(0);
        if (c < HD) {
            for (int k = 0; k < nchunks; k++) s += pb[(int64_t)k * HD + c];
            if (gb) tide_st(gb, c, s);
        } else {
            int64_t h = c - HD;
            for (int k = 0; k < nchunks; k++)
                for (int64_t d = 0; d < D; d++) s += pa[(int64_t)k * HD + h * D + d];
            if (gA) tide_st(gA, h, s);
        }
    }
}

static int kda_gate_check(const char *what, int64_t N, int64_t H, int64_t D, int form)
{
    if (N < 0 || H < 0 || D < 0)
        return tide_set_error("%s: negative size N %lld H %lld D %lld", what, (long long)N, (long long)H, (long long)D);
    if (form != TIDE_KDA_GATE_BOUNDED && form != TIDE_KDA_GATE_SOFTPLUS)
        return tide_set_error("%s: unknown form %d (TIDE_KDA_GATE_BOUNDED, TIDE_KDA_GATE_SOFTPLUS)", what, form);
    return 0;
}

int tide_cuda_kda_gate(int dtype, void *g, const void *z, const void *A_log, const void *dt_bias, int64_t N, int64_t H,
                       int64_t D, double lb, int form)
{
    if (kda_gate_check("kda_gate", N, H, D, form)) return -1;
    if (N * H * D == 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "kda_gate", {
        kda_gate_kernel<T><<<tide_blocks(N * H * D), TIDE_THREADS, 0, s>>>((T *)g, (const T *)z, (const T *)A_log,
                                                                          (const T *)dt_bias, N, H, D, lb, form);
        TIDE_CU_LAUNCH("kda_gate kernel");
    });
    return 0;
}

template <typename T>
static int kda_gate_backward_typed(T *gz, T *gA, T *gb, const T *gg, const T *z, const T *A_log, const T *dt_bias,
                                   int64_t N, int64_t H, int64_t D, double lb, int form, cudaStream_t s)
{
    typedef TIDE_ACC(T) A;
    const char *what = "kda_gate backward";
    const int64_t HD = H * D;
    if (HD == 0) return 0;
    if (N == 0) {   /* empty sums */
        if (gA) TIDE_CU(cudaMemsetAsync(gA, 0, (size_t)H * sizeof(T), s), what);
        if (gb) TIDE_CU(cudaMemsetAsync(gb, 0, (size_t)HD * sizeof(T), s), what);
        return 0;
    }
    int64_t colblocks = (HD + 31) / 32;
    if (colblocks > INT_MAX) return tide_set_error("%s: H·D %lld too large", what, (long long)HD);
    /* enough blocks to fill the device, at least ~32 rows per chunk, at most 1024 chunks */
    int64_t want = 4 * (int64_t)tide_cuda_sm_count();
    int64_t nchunks = (want + colblocks - 1) / colblocks, maxc = (N + 31) / 32;
    if (nchunks > maxc) nchunks = maxc;
    if (nchunks > 1024) nchunks = 1024;
    if (nchunks < 1) nchunks = 1;
    int64_t rows_per = (N + nchunks - 1) / nchunks;
    nchunks = (N + rows_per - 1) / rows_per;
    A *part = NULL;
    if (gA || gb) TIDE_CU(tide_cuda_alloc((void **)&part, (size_t)(2 * nchunks * HD) * sizeof(A), s), "kda_gate backward scratch alloc");
    A *pb = part, *pa = part ? part + nchunks * HD : NULL;
    kda_gate_backward_kernel<T><<<dim3((unsigned)colblocks, (unsigned)nchunks), dim3(32, 8), 0, s>>>(
        gz, pb, pa, gg, z, A_log, dt_bias, N, H, D, lb, form, rows_per);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess && part) {
        kda_gate_final_kernel<T><<<tide_blocks(HD + H), TIDE_THREADS, 0, s>>>(gA, gb, pb, pa, H, D, (int)nchunks);
        e = cudaGetLastError();
    }
    tide_cuda_release(part, s);
    if (e != cudaSuccess) return tide_set_error("cuda %s kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

int tide_cuda_kda_gate_backward(int dtype, void *gz, void *gA, void *gb, const void *gg, const void *z,
                                const void *A_log, const void *dt_bias, int64_t N, int64_t H, int64_t D, double lb,
                                int form)
{
    if (kda_gate_check("kda_gate backward", N, H, D, form)) return -1;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "kda_gate backward", {
        if (kda_gate_backward_typed<T>((T *)gz, (T *)gA, (T *)gb, (const T *)gg, (const T *)z, (const T *)A_log,
                                       (const T *)dt_bias, N, H, D, lb, form, s))
            return -1;
    });
    return 0;
}

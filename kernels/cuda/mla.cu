/*
 * mla.cu — the attention of gated NoPE MLA on the GPU (spec/mla.md §1, §4, §5), flash style: tiles of
 * queries × keys with an online softmax, no [Tq, Tk] buffer.
 *
 * score = (q_n·k_n + q_r·k_r)·scale: the rope slot q_r (the last dr values of a q row) meets the one k_r that
 * every head shares, so a key tile is [k_n^h | k_r] (dn + dr columns) against the q row as it is. Query i of a
 * row sees key j iff j <= i + (Tk − Tq) and, with documents (§5), j is not before the start of i's document;
 * a token's document is found by binary search in the boundaries (copied to the device).
 *
 * Forward: one block per (query tile, head, batch row) walks the key tiles it can see with K/V tiles in shared
 * memory, keeps the running max m and sum l (fp32) and the output accumulator (fp32, shared memory), and
 * writes o = acc / l, lse = m + log l (o = 0 and lse = −inf for a query that sees nothing).
 * Backward (§4, P recomputed from lse): D = rowsum(dO ⊙ O) first; then a dQ kernel per (query tile, head,
 * row) over key tiles and a dK/dV kernel per (key tile, head group, row) over query tiles. Each block owns
 * what it writes, so nothing is accumulated with atomics. dk_r = Σ_h dk_r^h: a dK/dV block walks its heads
 * in order and sums their dk_r in shared memory; with several head groups (short sequences, for parallelism)
 * a last kernel adds the group partials in group order. Results are deterministic on a given device.
 *
 * bf16: the six products (QKᵀ, PV, dO Vᵀ, Pᵀ dO, dSᵀQ, dS K) run on tensor cores (wmma: bf16 operands, fp32
 * accumulate), with P and dS rounded to bf16 as operands; softmax max and sum, lse and D stay fp32. f32 uses
 * fp32 FMA loops. Head dims are padded to 16 with zeros; the tile sizes are the first of a short list whose
 * shared memory fits the device (so any head dims whose 16x16 tiles fit work).
 * The dense baseline's softmax attention (attention.cu) runs on the same kernels: one head per row, no rope
 * part, an offset that makes it causal or not, and lse in the storage type when the engine keeps it so.
 * varlen_attention (spec/vision.md §3, §5) runs on them too, bidirectional inside each segment (bidir): no rope
 * part, one packed row, every query sees [its segment's start, its segment's end), and the key (query) tiles
 * outside a tile's segments are skipped.
 * mla_latent_attention runs them a chunk of keys at a time on keys and values expanded from the latent by cuBLAS
 * (the section at its entry): the kernels read k_n and v with strides from the chunk's expansion and know the
 * chunk's place in its row (kbase, Tkr) for the causal limit, the documents and k_r.
 */
#include "common.cuh"
#include <mma.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#define MLA_NT 256                /* threads per block (8 warps) */

typedef __nv_bfloat16 mla_bf16;

enum { MLA_FWD, MLA_DQ, MLA_DKV };

/* ---- shared memory layout (byte offsets, -1 = absent); the same function sizes it on the host ------------ */
struct mla_layout {
    int BQ, BK, DQ, DV;           /* query / key tile rows; dn + dr and dv padded to 16 */
    int ldq, ldv, ldp;            /* operand strides (storage elements): [*, DQ], [*, DV], bf16 [*, BK] */
    int lds, ldaq, ldav;          /* fp32 strides: scores [*, BK], accumulators [*, DQ] and [*, DV] */
    int Q, K, V, dO;              /* operand tiles (storage type) */
    int S, dP;                    /* fp32 [BQ, BK]: scores then P (fp32 path: the P operand); dP then dS */
    int Pb, dSb;                  /* bf16 [BQ, BK]: the P and dS operands of the tensor-core path */
    int acc_q, acc_v;             /* fp32 accumulators: dQ [BQ, DQ] or dK [BK, DQ]; O [BQ, DV] or dV [BK, DV] */
    int dkr;                      /* fp32 [BK, dr]: dk_r summed over the block's heads */
    int m, l, lse, D, lo, hi;     /* per query row of the tile (hi: bidir only) */
    int total;                    /* bytes */
};

static int mla_take(int *cur, size_t bytes)
{
    int off = *cur;
    *cur += (int)((bytes + 127) & ~(size_t)127);   /* 128-byte regions: wmma wants 32-byte aligned tiles */
    return off;
}

static mla_layout mla_make_layout(int kind, int tc, int BQ, int BK, int DQ, int DV, int dr_sum, int bidir = 0)
{
    mla_layout L;
    memset(&L, 0xff, sizeof L);
    size_t es = tc ? 2 : 4;
    int cur = 0;
    L.BQ = BQ;
    L.BK = BK;
    L.DQ = DQ;
    L.DV = DV;
    /* bf16: +8 keeps wmma's 16-byte stride rule and spreads rows over the banks; fp32 FMA: an odd stride, as
       the QKᵀ and dO Vᵀ loops read K and V down columns */
    L.ldq = tc ? DQ + 8 : DQ + 1;
    L.ldv = tc ? DV + 8 : DV + 1;
    L.ldp = BK + 8;
    L.lds = BK + 4;
    L.ldaq = DQ + 4;
    L.ldav = DV + 4;
    L.Q = mla_take(&cur, (size_t)BQ * L.ldq * es);
    L.K = mla_take(&cur, (size_t)BK * L.ldq * es);
    L.V = mla_take(&cur, (size_t)BK * L.ldv * es);
    L.S = mla_take(&cur, (size_t)BQ * L.lds * 4);
    L.lo = mla_take(&cur, (size_t)BQ * 4);
    if (bidir) L.hi = mla_take(&cur, (size_t)BQ * 4);
    if (kind == MLA_FWD) {
        if (tc) L.Pb = mla_take(&cur, (size_t)BQ * L.ldp * 2);
        L.acc_v = mla_take(&cur, (size_t)BQ * L.ldav * 4);
        L.m = mla_take(&cur, (size_t)BQ * 4);
        L.l = mla_take(&cur, (size_t)BQ * 4);
    } else {
        L.dO = mla_take(&cur, (size_t)BQ * L.ldv * es);
        L.dP = mla_take(&cur, (size_t)BQ * L.lds * 4);
        L.lse = mla_take(&cur, (size_t)BQ * 4);
        L.D = mla_take(&cur, (size_t)BQ * 4);
        if (tc) L.dSb = mla_take(&cur, (size_t)BQ * L.ldp * 2);
        if (kind == MLA_DQ) {
            L.acc_q = mla_take(&cur, (size_t)BQ * L.ldaq * 4);
        } else {
            if (tc) L.Pb = mla_take(&cur, (size_t)BQ * L.ldp * 2);
            L.acc_q = mla_take(&cur, (size_t)BK * L.ldaq * 4);
            L.acc_v = mla_take(&cur, (size_t)BK * L.ldav * 4);
            if (dr_sum > 0) L.dkr = mla_take(&cur, (size_t)BK * dr_sum * 4);
        }
    }
    L.total = cur;
    return L;
}

template <typename T> struct mla_args {
    T *out;                       /* forward; NULL: lse only (attention.cu's bf16 backward) */
    float *out_f32;               /* or the output in fp32 instead (mla_latent's running output) */
    int merge;                    /* mla_latent's later chunks: out_f32 and lse_out hold the running output and lse,
                                     which take in this chunk's (queries that see none of its keys keep theirs) */
    float *lse_out;               /* the fp32 lse, or NULL: lse_t gets it in the storage type */
    T *lse_t;
    T *gq, *gkn, *gkr, *gv;       /* backward; gkr_part: [groups, B·Tk·dr] when there are several head groups */
    float *gkr_part;
    float *gq_run;                /* or dQ in fp32 instead of gq, added to what it holds when gq_add (mla_latent) */
    int gq_add;
    const T *gout;
    const float *lse, *D;
    const T *q, *kn, *kr, *v;
    /* key token t = b·Tk + j, head h: kn (and gkn) at t·kn_rs + h·kn_hs, v (and gv) at t·v_rs + h·v_hs; [B, Tk, H,
       dn] and [B, Tk, H, dv] as a rule, one interleaved [B, Tk, H, dn + dv] expansion in mla_latent */
    int64_t kn_rs, v_rs;
    int kn_hs, v_hs;
    /* the keys are [kbase, kbase + Tk) of rows of Tkr keys: kr, gkr and the boundaries cu are over whole rows
       (kbase 0 and Tkr = Tk but for mla_latent's chunks; lo, off and the key tiles count from kbase) */
    int kbase, Tkr;
    const int64_t *cu;            /* device copy of the boundaries, or NULL */
    int n_seg;
    int Tq, Tk, H, dn, dr, dv, off;   /* query i sees keys j <= i + off: Tk − Tq (causal), Tk (attention.cu, not causal) */
    int qt0;                      /* the first query tile (blockIdx.x counts from it): the ones before see no key */
    int hpg, groups;              /* dK/dV: heads per group, groups */
    int bidir;                    /* not causal: query i sees its whole segment (varlen_attention; needs cu) */
    float scale;
    mla_layout L;
};

/* ---- device helpers --------------------------------------------------------------------------------------- */

/* the document holding flattened token n: the largest s < n_seg with cu[s] <= n (skips empty documents) */
__device__ __forceinline__ int mla_doc(const int64_t *cu, int n_seg, int64_t n)
{
    int lo = 0, hi = n_seg - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (cu[mid] <= n) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* lo[r] = the first key query i0 + r may see (its document start, counted from key kbase of the row, at least
   0); INT_MAX past the tile's rows, so padding rows see nothing. hi (bidir, else NULL): hi[r] = one past its
   document's last key */
__device__ void mla_doc_starts(int *lo, int *hi, const int64_t *cu, int n_seg, int64_t row0, int qoff, int kbase, int i0,
                               int rows, int R)
{
    /* row0 = b·Tkr: the boundaries are over the row's keys; query i is key position i + qoff (qoff = Tkr − Tq: the
       last query on the last key) */
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int v = INT_MAX, e = 0;
        if (r < rows && cu) {
            int d = mla_doc(cu, n_seg, row0 + qoff + i0 + r);
            int64_t s = cu[d] - row0 - kbase;
            v = s > 0 ? (int)s : 0;
            e = (int)(cu[d + 1] - row0 - kbase);
        } else if (r < rows) {
            v = 0;
            e = INT_MAX;
        }
        lo[r] = v;
        if (hi) hi[r] = e;
    }
}

/* a [R, DP] tile (stride ld) from rows of up to two sources: columns [0, na) from a + r·ars, [na, na + nb)
   from b + r·brs, zeros elsewhere and in rows >= nrows (zero padding keeps the products exact) */
template <typename T>
__device__ void mla_load_tile(T *dst, int ld, int R, int DP, int nrows, const T *a, int64_t ars, int na, const T *b,
                              int64_t brs, int nb)
{
    const T zero = tide_tr<T>::store(0.f);
    for (int idx = threadIdx.x; idx < R * DP; idx += blockDim.x) {
        int r = idx / DP, c = idx - r * DP;
        T x = zero;
        if (r < nrows) {
            if (c < na) x = a[r * ars + c];
            else if (c < na + nb) x = b[r * brs + (c - na)];
        }
        dst[r * ld + c] = x;
    }
}

__device__ void mla_zero(float *p, int ld, int R, int C)
{
    for (int idx = threadIdx.x; idx < R * C; idx += blockDim.x) {
        int r = idx / C;
        p[r * ld + (idx - r * C)] = 0.f;
    }
}

/* C [M, N] (fp32, stride ldc) = or += op(A) op(B) over K; AT: A is stored as Aᵀ [K, M]; BT: B is stored as
   Bᵀ [N, K]. bf16 operands: tensor cores, one warp per 16x16 output tile (M, N, K multiples of 16). fp32:
   one thread per output element. Every thread of the block calls it; callers synchronise around it. */
template <bool AT, bool BT, typename E>
__device__ void mla_mm(float *C, int ldc, const E *A, int lda, const E *B, int ldb, int M, int N, int K, bool acc)
{
    if constexpr (sizeof(E) == 2) {
        using namespace nvcuda;
        typedef typename std::conditional<AT, wmma::col_major, wmma::row_major>::type LA;
        typedef typename std::conditional<BT, wmma::col_major, wmma::row_major>::type LB;
        int warp = threadIdx.x >> 5, nw = blockDim.x >> 5, tn = N >> 4, nt = (M >> 4) * tn;
        for (int t = warp; t < nt; t += nw) {
            int m0 = (t / tn) << 4, n0 = (t - (t / tn) * tn) << 4;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
            if (acc) wmma::load_matrix_sync(fc, C + m0 * ldc + n0, ldc, wmma::mem_row_major);
            else wmma::fill_fragment(fc, 0.f);
            for (int k0 = 0; k0 < K; k0 += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, E, LA> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, E, LB> fb;
                wmma::load_matrix_sync(fa, AT ? A + k0 * lda + m0 : A + m0 * lda + k0, lda);
                wmma::load_matrix_sync(fb, BT ? B + n0 * ldb + k0 : B + k0 * ldb + n0, ldb);
                wmma::mma_sync(fc, fa, fb, fc);
            }
            wmma::store_matrix_sync(C + m0 * ldc + n0, fc, ldc, wmma::mem_row_major);
        }
    } else {
        int as = AT ? lda : 1, bs = BT ? 1 : ldb;
        for (int idx = threadIdx.x; idx < M * N; idx += blockDim.x) {
            int r = idx / N, c = idx - r * N;
            const E *a = AT ? A + r : A + r * lda, *b = BT ? B + c * ldb : B + c;
            float s = acc ? C[r * ldc + c] : 0.f;
            for (int k = 0; k < K; k++) s = fmaf(a[k * as], b[k * bs], s);
            C[r * ldc + c] = s;
        }
    }
}

template <typename T> struct mla_views {
    T *Q, *K, *V, *dO;
    float *S, *dP, *acc_q, *acc_v, *dkr, *m, *l, *lse, *D;
    mla_bf16 *Pb, *dSb;
    int *lo, *hi;
};

template <typename T> __device__ __forceinline__ mla_views<T> mla_make_views(char *sm, const mla_layout &L)
{
    mla_views<T> w;
    w.Q = (T *)(sm + L.Q);
    w.K = (T *)(sm + L.K);
    w.V = (T *)(sm + L.V);
    w.dO = L.dO >= 0 ? (T *)(sm + L.dO) : nullptr;
    w.S = (float *)(sm + L.S);
    w.dP = L.dP >= 0 ? (float *)(sm + L.dP) : nullptr;
    w.acc_q = L.acc_q >= 0 ? (float *)(sm + L.acc_q) : nullptr;
    w.acc_v = L.acc_v >= 0 ? (float *)(sm + L.acc_v) : nullptr;
    w.dkr = L.dkr >= 0 ? (float *)(sm + L.dkr) : nullptr;
    w.m = L.m >= 0 ? (float *)(sm + L.m) : nullptr;
    w.l = L.l >= 0 ? (float *)(sm + L.l) : nullptr;
    w.lse = L.lse >= 0 ? (float *)(sm + L.lse) : nullptr;
    w.D = L.D >= 0 ? (float *)(sm + L.D) : nullptr;
    w.Pb = L.Pb >= 0 ? (mla_bf16 *)(sm + L.Pb) : nullptr;
    w.dSb = L.dSb >= 0 ? (mla_bf16 *)(sm + L.dSb) : nullptr;
    w.lo = (int *)(sm + L.lo);
    w.hi = L.hi >= 0 ? (int *)(sm + L.hi) : nullptr;
    return w;
}

/* the key tile [k_n^h | k_r] and the V tile of head h at key j0 */
template <typename T>
__device__ void mla_load_kv(const mla_args<T> &a, const mla_views<T> &w, int b, int h, int j0)
{
    const mla_layout &L = a.L;
    int cols = a.Tk - j0 < L.BK ? a.Tk - j0 : L.BK;
    int64_t t0 = (int64_t)b * a.Tk + j0, tr = (int64_t)b * a.Tkr + a.kbase + j0;
    mla_load_tile(w.K, L.ldq, L.BK, L.DQ, cols, a.kn + t0 * a.kn_rs + (int64_t)h * a.kn_hs, a.kn_rs, a.dn,
                  a.dr ? a.kr + tr * a.dr : a.kr, (int64_t)a.dr, a.dr);
    mla_load_tile(w.V, L.ldv, L.BK, L.DV, cols, a.v + t0 * a.v_rs + (int64_t)h * a.v_hs, a.v_rs, a.dv,
                  (const T *)nullptr, 0, 0);
}

/* the backward's query tile of head h at query i0: Q, dO, lse, D, document starts */
template <typename T>
__device__ void mla_load_q_bwd(const mla_args<T> &a, const mla_views<T> &w, int b, int h, int i0)
{
    const mla_layout &L = a.L;
    int rows = a.Tq - i0 < L.BQ ? a.Tq - i0 : L.BQ, dqk = a.dn + a.dr;
    int64_t t0 = (int64_t)b * a.Tq + i0;
    mla_load_tile(w.Q, L.ldq, L.BQ, L.DQ, rows, a.q + (t0 * a.H + h) * dqk, (int64_t)a.H * dqk, dqk,
                  (const T *)nullptr, 0, 0);
    mla_load_tile(w.dO, L.ldv, L.BQ, L.DV, rows, a.gout + (t0 * a.H + h) * a.dv, (int64_t)a.H * a.dv, a.dv,
                  (const T *)nullptr, 0, 0);
    for (int r = threadIdx.x; r < L.BQ; r += blockDim.x) {
        int64_t at = ((int64_t)b * a.H + h) * a.Tq + i0 + r;
        w.lse[r] = r < rows ? a.lse[at] : -INFINITY;
        w.D[r] = r < rows ? a.D[at] : 0.f;
    }
    mla_doc_starts(w.lo, w.hi, a.cu, a.n_seg, (int64_t)b * a.Tkr, a.Tkr - a.Tq, a.kbase, i0, rows, L.BQ);
}

/* P = exp(S·scale − lse) on the visible pairs (0 elsewhere) and dS = P ⊙ (dP − D) (mla.md §4). fp32: P over
   S, dS over dP in place; bf16: into the bf16 operand tiles. */
template <typename T>
__device__ void mla_probs_bwd(const mla_args<T> &a, const mla_views<T> &w, int i0, int j0, bool want_p, bool want_ds)
{
    const mla_layout &L = a.L;
    for (int idx = threadIdx.x; idx < L.BQ * L.BK; idx += blockDim.x) {
        int r = idx / L.BK, c = idx - r * L.BK, i = i0 + r, j = j0 + c;
        float ls = w.lse[r], p = 0.f, ds = 0.f;
        if (j < a.Tk && j >= w.lo[r] && j <= i + a.off && (!w.hi || j < w.hi[r]) && ls > -INFINITY) {
            p = expf(w.S[r * L.lds + c] * a.scale - ls);
            if (want_ds) ds = p * (w.dP[r * L.lds + c] - w.D[r]);
        }
        if constexpr (sizeof(T) == 2) {
            if (want_p) w.Pb[r * L.ldp + c] = __float2bfloat16(p);
            if (want_ds) w.dSb[r * L.ldp + c] = __float2bfloat16(ds);
        } else {
            w.S[r * L.lds + c] = p;
            if (want_ds) w.dP[r * L.lds + c] = ds;
        }
    }
}

/* ---- forward ------------------------------------------------------------------------------------------------ */

template <typename T> __global__ void __launch_bounds__(MLA_NT) mla_forward_kernel(mla_args<T> a)
{
    extern __shared__ __align__(128) float4 mla_smem4[];
    const mla_layout &L = a.L;
    mla_views<T> w = mla_make_views<T>(reinterpret_cast<char *>(mla_smem4), L);
    /* the last query tiles see the most keys: start them first */
    int it = a.qt0 + (int)(gridDim.x - 1 - blockIdx.x), h = blockIdx.y, b = blockIdx.z;
    int i0 = it * L.BQ, rows = a.Tq - i0 < L.BQ ? a.Tq - i0 : L.BQ, dqk = a.dn + a.dr;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    bool want_o = a.out || a.out_f32;
    int64_t t0 = (int64_t)b * a.Tq + i0;
    mla_load_tile(w.Q, L.ldq, L.BQ, L.DQ, rows, a.q + (t0 * a.H + h) * dqk, (int64_t)a.H * dqk, dqk,
                  (const T *)nullptr, 0, 0);
    mla_doc_starts(w.lo, w.hi, a.cu, a.n_seg, (int64_t)b * a.Tkr, a.Tkr - a.Tq, a.kbase, i0, rows, L.BQ);
    mla_zero(w.acc_v, L.ldav, L.BQ, L.DV);
    for (int r = threadIdx.x; r < L.BQ; r += blockDim.x) {
        w.m[r] = -INFINITY;
        w.l[r] = 0.f;
    }
    __syncthreads();
    /* keys from the first row's document start to the last row's causal limit (bidir: its document end) */
    int jlast = i0 + rows - 1 + a.off < a.Tk - 1 ? i0 + rows - 1 + a.off : a.Tk - 1;
    if (w.hi && w.hi[rows - 1] - 1 < jlast) jlast = w.hi[rows - 1] - 1;
    for (int j0 = w.lo[0] / L.BK * L.BK; j0 <= jlast; j0 += L.BK) {
        mla_load_kv(a, w, b, h, j0);
        __syncthreads();
        mla_mm<false, true>(w.S, L.lds, w.Q, L.ldq, w.K, L.ldq, L.BQ, L.BK, L.DQ, false);
        __syncthreads();
        /* online softmax, one warp per row: rescale the row's accumulator by exp(m_old − m_new) */
        for (int r = warp; r < L.BQ; r += nw) {
            float *s = w.S + r * L.lds, mx = -INFINITY;
            int i = i0 + r;
            for (int c = lane; c < L.BK; c += 32) {
                int j = j0 + c;
                float x = (j < a.Tk && j >= w.lo[r] && j <= i + a.off && (!w.hi || j < w.hi[r])) ? s[c] * a.scale
                                                                                              : -INFINITY;
                s[c] = x;
                mx = fmaxf(mx, x);
            }
            mx = tide_warp_reduce(mx, tide_max_op());
            float mo = w.m[r], mn = fmaxf(mo, mx), sum = 0.f;
            for (int c = lane; c < L.BK; c += 32) {
                float p = s[c] == -INFINITY ? 0.f : expf(s[c] - mn);
                sum += p;
                if constexpr (sizeof(T) == 2) w.Pb[r * L.ldp + c] = __float2bfloat16(p);
                else s[c] = p;
            }
            sum = tide_warp_reduce(sum, tide_sum_op());
            float alpha = mo == -INFINITY ? 0.f : expf(mo - mn);
            if (want_o)
                for (int c = lane; c < L.DV; c += 32) w.acc_v[r * L.ldav + c] *= alpha;
            __syncwarp();
            if (lane == 0) {
                w.m[r] = mn;
                w.l[r] = w.l[r] * alpha + sum;
            }
        }
        __syncthreads();
        if (want_o) {
            if constexpr (sizeof(T) == 2)
                mla_mm<false, false>(w.acc_v, L.ldav, w.Pb, L.ldp, w.V, L.ldv, L.BQ, L.DV, L.BK, true);
            else
                mla_mm<false, false>(w.acc_v, L.ldav, (const float *)w.S, L.lds, w.V, L.ldv, L.BQ, L.DV, L.BK, true);
        }
        __syncthreads();
    }
    for (int r = warp; r < rows; r += nw) {
        float l = w.l[r], inv = l > 0.f ? 1.f / l : 0.f, lse = l > 0.f ? w.m[r] + logf(l) : -INFINITY;
        int64_t at = ((int64_t)b * a.H + h) * a.Tq + i0 + r, at_o = ((t0 + r) * a.H + h) * a.dv;
        if (a.merge) {
            /* mla_latent's later chunks: into the running output and lse (fp32) by the log-sum-exp rule,
               o = (e^{l1−m} o1 + e^{l2−m} o2) / (e^{l1−m} + e^{l2−m}), l = m + log(e^{l1−m} + e^{l2−m}) */
            float l1 = a.lse_out[at], w1 = 0.f, w2 = 1.f, ln = lse;
            if (lse == -INFINITY) continue;       /* no key of the chunk for this query: it keeps what it has */
            if (l1 != -INFINITY) {
                float mm = fmaxf(l1, lse), e1 = expf(l1 - mm), e2 = expf(lse - mm), sum = e1 + e2;
                w1 = e1 / sum;
                w2 = e2 / sum;
                ln = mm + logf(sum);
            }
            for (int c = lane; c < a.dv; c += 32) {
                float x = w.acc_v[r * L.ldav + c] * inv;
                a.out_f32[at_o + c] = l1 == -INFINITY ? x : w1 * a.out_f32[at_o + c] + w2 * x;
            }
            __syncwarp();
            if (lane == 0) a.lse_out[at] = ln;
            continue;
        }
        if (a.out_f32)
            for (int c = lane; c < a.dv; c += 32) a.out_f32[at_o + c] = w.acc_v[r * L.ldav + c] * inv;
        else if (a.out)
            for (int c = lane; c < a.dv; c += 32) a.out[at_o + c] = tide_tr<T>::store(w.acc_v[r * L.ldav + c] * inv);
        if (lane == 0) {
            if (a.lse_out) a.lse_out[at] = lse;
            else a.lse_t[at] = tide_tr<T>::store(lse);
        }
    }
}

/* ---- backward ----------------------------------------------------------------------------------------------- */

/* D[b, h, i] = Σ_c dO[b, i, h, c] O[b, i, h, c], one warp per (b, i, h) */
template <typename T>
__global__ void __launch_bounds__(MLA_NT) mla_rowdot_kernel(float *D, const T *gout, const T *o, int64_t n, int Tq,
                                                            int H, int dv)
{
    int lane = threadIdx.x & 31;
    int64_t w0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t row = w0; row < n; row += nw) {
        float s = 0.f;
        for (int c = lane; c < dv; c += 32) s += tide_ld(gout, row * dv + c) * tide_ld(o, row * dv + c);
        s = tide_warp_reduce(s, tide_sum_op());
        int64_t h = row % H, bt = row / H, i = bt % Tq, b = bt / Tq;
        if (lane == 0) D[(b * H + h) * Tq + i] = s;
    }
}

/* dQ = scale · dS K over the key tiles a query tile sees */
template <typename T> __global__ void __launch_bounds__(MLA_NT) mla_dq_kernel(mla_args<T> a)
{
    extern __shared__ __align__(128) float4 mla_smem4[];
    const mla_layout &L = a.L;
    mla_views<T> w = mla_make_views<T>(reinterpret_cast<char *>(mla_smem4), L);
    int it = a.qt0 + (int)(gridDim.x - 1 - blockIdx.x), h = blockIdx.y, b = blockIdx.z;
    int i0 = it * L.BQ, rows = a.Tq - i0 < L.BQ ? a.Tq - i0 : L.BQ, dqk = a.dn + a.dr;
    mla_load_q_bwd(a, w, b, h, i0);
    mla_zero(w.acc_q, L.ldaq, L.BQ, L.DQ);
    __syncthreads();
    int jlast = i0 + rows - 1 + a.off < a.Tk - 1 ? i0 + rows - 1 + a.off : a.Tk - 1;
    if (w.hi && w.hi[rows - 1] - 1 < jlast) jlast = w.hi[rows - 1] - 1;
    for (int j0 = w.lo[0] / L.BK * L.BK; j0 <= jlast; j0 += L.BK) {
        mla_load_kv(a, w, b, h, j0);
        __syncthreads();
        mla_mm<false, true>(w.S, L.lds, w.Q, L.ldq, w.K, L.ldq, L.BQ, L.BK, L.DQ, false);
        mla_mm<false, true>(w.dP, L.lds, w.dO, L.ldv, w.V, L.ldv, L.BQ, L.BK, L.DV, false);
        __syncthreads();
        mla_probs_bwd(a, w, i0, j0, false, true);
        __syncthreads();
        if constexpr (sizeof(T) == 2)
            mla_mm<false, false>(w.acc_q, L.ldaq, w.dSb, L.ldp, w.K, L.ldq, L.BQ, L.DQ, L.BK, true);
        else
            mla_mm<false, false>(w.acc_q, L.ldaq, (const float *)w.dP, L.lds, w.K, L.ldq, L.BQ, L.DQ, L.BK, true);
        __syncthreads();
    }
    int64_t t0 = (int64_t)b * a.Tq + i0;
    for (int idx = threadIdx.x; idx < rows * dqk; idx += blockDim.x) {
        int r = idx / dqk, c = idx - r * dqk;
        int64_t at = ((t0 + r) * a.H + h) * dqk + c;
        float x = w.acc_q[r * L.ldaq + c] * a.scale;
        if (a.gq_run) a.gq_run[at] = a.gq_add ? a.gq_run[at] + x : x;
        else a.gq[at] = tide_tr<T>::store(x);
    }
}

/* dV = Pᵀ dO and dK = scale · dSᵀ Q of one key tile, head by head over the block's head group; dk_r summed over
   those heads in order */
template <typename T> __global__ void __launch_bounds__(MLA_NT) mla_dkv_kernel(mla_args<T> a)
{
    extern __shared__ __align__(128) float4 mla_smem4[];
    const mla_layout &L = a.L;
    mla_views<T> w = mla_make_views<T>(reinterpret_cast<char *>(mla_smem4), L);
    int kt = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
    int j0 = kt * L.BK, cols = a.Tk - j0 < L.BK ? a.Tk - j0 : L.BK;
    bool want_k = a.gkn || w.dkr, want_v = a.gv != nullptr;
    /* the queries that see a key of the tile: from the first key's causal start (bidir: its document start) to
       the end of the last key's document */
    int ilo = j0 - a.off > 0 ? j0 - a.off : 0, ihi = a.Tq;
    if (a.cu) {
        int64_t row0 = (int64_t)b * a.Tkr + a.kbase;
        /* the end of the last key's document, as a query index (query i is key i + Tkr − Tq of the row) */
        int64_t e = a.cu[mla_doc(a.cu, a.n_seg, row0 + j0 + cols - 1) + 1] - (int64_t)b * a.Tkr - (a.Tkr - a.Tq);
        if (e < ihi) ihi = (int)e;
        if (a.bidir) ilo = (int)(a.cu[mla_doc(a.cu, a.n_seg, row0 + j0)] - (int64_t)b * a.Tkr - (a.Tkr - a.Tq));
    }
    if (w.dkr) mla_zero(w.dkr, a.dr, L.BK, a.dr);
    int h1 = (g + 1) * a.hpg < a.H ? (g + 1) * a.hpg : a.H;
    for (int h = g * a.hpg; h < h1; h++) {
        __syncthreads();
        mla_load_kv(a, w, b, h, j0);
        if (want_k) mla_zero(w.acc_q, L.ldaq, L.BK, L.DQ);
        if (want_v) mla_zero(w.acc_v, L.ldav, L.BK, L.DV);
        for (int i0 = ilo / L.BQ * L.BQ; i0 < ihi; i0 += L.BQ) {
            __syncthreads();
            mla_load_q_bwd(a, w, b, h, i0);
            __syncthreads();
            mla_mm<false, true>(w.S, L.lds, w.Q, L.ldq, w.K, L.ldq, L.BQ, L.BK, L.DQ, false);
            if (want_k) mla_mm<false, true>(w.dP, L.lds, w.dO, L.ldv, w.V, L.ldv, L.BQ, L.BK, L.DV, false);
            __syncthreads();
            mla_probs_bwd(a, w, i0, j0, want_v, want_k);
            __syncthreads();
            if constexpr (sizeof(T) == 2) {
                if (want_v) mla_mm<true, false>(w.acc_v, L.ldav, w.Pb, L.ldp, w.dO, L.ldv, L.BK, L.DV, L.BQ, true);
                if (want_k) mla_mm<true, false>(w.acc_q, L.ldaq, w.dSb, L.ldp, w.Q, L.ldq, L.BK, L.DQ, L.BQ, true);
            } else {
                if (want_v)
                    mla_mm<true, false>(w.acc_v, L.ldav, (const float *)w.S, L.lds, w.dO, L.ldv, L.BK, L.DV, L.BQ, true);
                if (want_k)
                    mla_mm<true, false>(w.acc_q, L.ldaq, (const float *)w.dP, L.lds, w.Q, L.ldq, L.BK, L.DQ, L.BQ, true);
            }
        }
        __syncthreads();
        int64_t t0 = (int64_t)b * a.Tk + j0;
        if (a.gkn)
            for (int idx = threadIdx.x; idx < cols * a.dn; idx += blockDim.x) {
                int r = idx / a.dn, c = idx - r * a.dn;
                a.gkn[(t0 + r) * a.kn_rs + (int64_t)h * a.kn_hs + c] =
                    tide_tr<T>::store(w.acc_q[r * L.ldaq + c] * a.scale);
            }
        if (want_v)
            for (int idx = threadIdx.x; idx < cols * a.dv; idx += blockDim.x) {
                int r = idx / a.dv, c = idx - r * a.dv;
                a.gv[(t0 + r) * a.v_rs + (int64_t)h * a.v_hs + c] = tide_tr<T>::store(w.acc_v[r * L.ldav + c]);
            }
        if (w.dkr)
            for (int idx = threadIdx.x; idx < L.BK * a.dr; idx += blockDim.x) {
                int r = idx / a.dr, c = idx - r * a.dr;
                w.dkr[idx] += w.acc_q[r * L.ldaq + a.dn + c] * a.scale;
            }
    }
    if (!w.dkr) return;
    __syncthreads();
    int64_t t0 = (int64_t)b * a.Tk + j0, tr = (int64_t)b * a.Tkr + a.kbase + j0;
    for (int idx = threadIdx.x; idx < cols * a.dr; idx += blockDim.x) {
        if (a.groups == 1) a.gkr[tr * a.dr + idx] = tide_tr<T>::store(w.dkr[idx]);
        else a.gkr_part[(int64_t)g * ((int64_t)gridDim.z * a.Tk * a.dr) + t0 * a.dr + idx] = w.dkr[idx];
    }
}

/* gkr = Σ_g part[g], in group order; part holds keys [kbase, kbase + Tk) of rows of Tkr keys, n = B·Tk·dr */
template <typename T>
__global__ void __launch_bounds__(MLA_NT) mla_sum_groups_kernel(T *gkr, const float *part, int64_t n, int groups,
                                                                int64_t Tk, int64_t Tkr, int64_t kbase, int dr)
{
    TIDE_GRID_LOOP(k, n)
    {
        float s = 0.f;
        for (int g = 0; g < groups; g++) s += part[(int64_t)g * n + k];
        int64_t b = k / (Tk * dr);
        gkr[(b * Tkr + kbase) * dr + (k - b * Tk * dr)] = tide_tr<T>::store(s);
    }
}

/* ---- host side ---------------------------------------------------------------------------------------------- */

static int mla_smem_limit(void)
{
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
        cudaGetLastError();
        return 48 * 1024;
    }
    return v;
}

/* the first tile shape (query rows, key rows) whose shared memory fits the device */
static int mla_pick_layout(const char *what, int kind, int tc, int64_t dn, int64_t dr, int64_t dv, int dr_sum,
                           mla_layout *out, int bidir = 0)
{
    static const int fwd[][2] = {{64, 64}, {64, 32}, {32, 32}, {16, 32}, {16, 16}};
    static const int dkv[][2] = {{64, 64}, {32, 64}, {32, 32}, {16, 32}, {16, 16}};
    const int(*list)[2] = kind == MLA_DKV ? dkv : fwd;
    int DQ = (int)((dn + dr + 15) / 16 * 16), DV = (int)((dv + 15) / 16 * 16), limit = mla_smem_limit();
    mla_layout L = mla_make_layout(kind, tc, 16, 16, DQ, DV, dr_sum, bidir);
    for (int c = 0; c < 5; c++) {
        mla_layout t = mla_make_layout(kind, tc, list[c][0], list[c][1], DQ, DV, dr_sum, bidir);
        if (t.total <= limit) {
            *out = t;
            return 0;
        }
    }
    if (dr == 0 && dn == dv)
        return tide_set_error("%s: head dim D %lld needs %d bytes of shared memory per block even with 16x16 tiles; the "
                              "device allows %d (D up to 256 fits on every target)", what, (long long)dn, L.total, limit);
    return tide_set_error("%s: head dims dn %lld + dr %lld, dv %lld need %d bytes of shared memory per block even "
                          "with 16x16 tiles; the device allows %d (dn, dr, dv up to 128 fit)", what, (long long)dn,
                          (long long)dr, (long long)dv, L.total, limit);
}

static int mla_check(const char *what, int dtype, const void *kr, const int64_t *cu, int64_t n_seg, int64_t B,
                     int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv)
{
    if (dtype == TIDE_F64) return tide_set_error("%s: f64 is not implemented on the cuda backend (f32, bf16)", what);
    if (dtype != TIDE_F32 && dtype != TIDE_BF16)
        return tide_set_error("%s: dtype %s is not supported on the cuda backend (f32, bf16)", what,
                              tide_cuda_dtype_str(dtype));
    if (B < 0 || Tq < 0 || Tk < 0 || H < 1 || dn < 0 || dr < 0 || dn + dr < 1 || dv < 1 || B > 65535 || H > 65535 ||
        Tq > INT_MAX / 4 || Tk > INT_MAX / 4 || dn + dr > 4096 || dv > 4096)
        return tide_set_error("%s: bad sizes B %lld Tq %lld Tk %lld H %lld dn %lld dr %lld dv %lld (B, H <= 65535)",
                              what, (long long)B, (long long)Tq, (long long)Tk, (long long)H, (long long)dn,
                              (long long)dr, (long long)dv);
    if (dr > 0 && !kr) return tide_set_error("%s: k_r is NULL but dr = %lld", what, (long long)dr);
    if (!cu) return 0;
    if (Tq > Tk)
        return tide_set_error("%s: document boundaries need Tq <= Tk, got Tq %lld and Tk %lld", what, (long long)Tq,
                              (long long)Tk);
    int64_t N = B * Tk;     /* the boundaries are over the keys */
    if (n_seg < 1 || n_seg > INT_MAX)
        return tide_set_error("%s: cu_seqlens has %lld segments, expected 1 to %d", what, (long long)n_seg, INT_MAX);
    if (cu[0] != 0 || cu[n_seg] != N)
        return tide_set_error("%s: cu_seqlens runs from %lld to %lld, expected 0 to B·T = %lld", what,
                              (long long)cu[0], (long long)cu[n_seg], (long long)N);
    for (int64_t i = 0; i < n_seg; i++) {
        int64_t s = cu[i], e = cu[i + 1];
        if (e < s)
            return tide_set_error("%s: cu_seqlens decreases at %lld (%lld then %lld)", what, (long long)i,
                                  (long long)s, (long long)e);
        if (e > s && (e - 1) / Tk != s / Tk)
            return tide_set_error("%s: segment [%lld, %lld) crosses the start of row %lld (T = %lld)", what,
                                  (long long)s, (long long)e, (long long)(s / Tk + 1), (long long)Tk);
    }
    return 0;
}

/* the device copy of the boundaries (NULL without documents); released by the caller */
static int mla_upload_cu(const char *what, const int64_t *cu, int64_t n_seg, int64_t **d, cudaStream_t s)
{
    *d = NULL;
    if (!cu) return 0;
    size_t n = (size_t)(n_seg + 1) * sizeof(int64_t);
    cudaError_t e = tide_cuda_alloc((void **)d, n, s);
    if (e != cudaSuccess) return tide_set_error("cuda %s boundaries alloc: %s", what, cudaGetErrorString(e));
    /* staged (tide_cuda_upload): the caller's array may go */
    e = tide_cuda_upload(*d, cu, n, s);
    if (e != cudaSuccess) return tide_set_error("cuda %s boundaries copy: %s", what, cudaGetErrorString(e));
    return 0;
}

template <typename T>
static void mla_fill_args(mla_args<T> &a, const void *q, const void *kn, const void *kr, const void *v,
                          int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr,
                          int64_t dv, int64_t off, double scale, int bidir)
{
    memset(&a, 0, sizeof a);
    a.bidir = bidir;
    a.q = (const T *)q;
    a.kn = (const T *)kn;
    a.kr = (const T *)kr;
    a.v = (const T *)v;
    a.kn_rs = H * dn;
    a.v_rs = H * dv;
    a.kn_hs = (int)dn;
    a.v_hs = (int)dv;
    a.Tkr = (int)Tk;
    a.Tq = (int)Tq;
    a.Tk = (int)Tk;
    a.H = (int)H;
    a.dn = (int)dn;
    a.dr = (int)dr;
    a.dv = (int)dv;
    a.off = (int)off;
    a.scale = (float)scale;
}

template <typename T, int KIND> static int mla_launch(const char *what, const mla_args<T> &a, dim3 grid, cudaStream_t s)
{
    size_t bytes = (size_t)a.L.total;
    if constexpr (KIND == MLA_FWD) {
        TIDE_CU(cudaFuncSetAttribute(mla_forward_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                "mla forward (shared memory attribute)");
        mla_forward_kernel<T><<<grid, MLA_NT, bytes, s>>>(a);
    } else if constexpr (KIND == MLA_DQ) {
        TIDE_CU(cudaFuncSetAttribute(mla_dq_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                "mla backward dq (shared memory attribute)");
        mla_dq_kernel<T><<<grid, MLA_NT, bytes, s>>>(a);
    } else {
        TIDE_CU(cudaFuncSetAttribute(mla_dkv_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                "mla backward dk/dv (shared memory attribute)");
        mla_dkv_kernel<T><<<grid, MLA_NT, bytes, s>>>(a);
    }
    TIDE_CU_LAUNCH(what);
    return 0;
}

/* lse_f32: lse is fp32, else it has the storage type T */
template <typename T>
static int mla_forward_typed(const char *what, void *out, void *lse, int lse_f32, const void *q, const void *kn,
                             const void *kr, const void *v, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq,
                             int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t off, double scale,
                             int bidir)
{
    TIDE_STREAM(s);
    if (B * Tq == 0) return 0;
    mla_args<T> a;
    mla_fill_args<T>(a, q, kn, kr, v, Tq, Tk, H, dn, dr, dv, off, scale, bidir);
    if (mla_pick_layout(what, MLA_FWD, sizeof(T) == 2, dn, dr, dv, 0, &a.L, bidir)) return -1;
    a.out = (T *)out;
    a.lse_out = lse_f32 ? (float *)lse : NULL;
    a.lse_t = lse_f32 ? NULL : (T *)lse;
    int64_t *cu_d = NULL;
    int rc = mla_upload_cu(what, cu, n_seg, &cu_d, s);
    a.cu = cu_d;
    a.n_seg = cu_d ? (int)n_seg : 0;
    if (!rc) rc = mla_launch<T, MLA_FWD>("mla forward kernel", a, dim3((unsigned)((Tq + a.L.BQ - 1) / a.L.BQ),
                                                                       (unsigned)H, (unsigned)B), s);
    tide_cuda_release(cu_d, s);
    return rc;
}

int tide_cuda_mla_attention(int dtype, void *out, void *lse, const void *q, const void *kn, const void *kr,
                            const void *v, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk,
                            int64_t H, int64_t dn, int64_t dr, int64_t dv, double scale)
{
    const char *what = "mla_attention";
    if (mla_check(what, dtype, kr, cu, n_seg, B, Tq, Tk, H, dn, dr, dv)) return -1;
    if (dtype == TIDE_F32)
        return mla_forward_typed<float>(what, out, lse, 1, q, kn, kr, v, cu, n_seg, B, Tq, Tk, H, dn, dr, dv, Tk - Tq,
                                        scale, 0);
    return mla_forward_typed<mla_bf16>(what, out, lse, 1, q, kn, kr, v, cu, n_seg, B, Tq, Tk, H, dn, dr, dv, Tk - Tq,
                                       scale, 0);
}

/* D[b, h, i] = rowsum(dO ⊙ O) of the n = B·H·Tq query rows */
template <typename T>
static int mla_rowdot(const char *what, float *D, const void *gout, const void *out, int64_t n, int64_t Tq, int64_t H,
                      int64_t dv, cudaStream_t s)
{
    int64_t blocks = (n + MLA_NT / 32 - 1) / (MLA_NT / 32), cap = (int64_t)tide_cuda_sm_count() * 32;
    mla_rowdot_kernel<T><<<(unsigned)(blocks < cap ? blocks : cap), MLA_NT, 0, s>>>(D, (const T *)gout, (const T *)out,
                                                                                   n, (int)Tq, (int)H, (int)dv);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tide_set_error("cuda %s rowsum(dO ⊙ O) kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

/* the dK/dV kernel over the nkt key tiles of a.Tk keys and a.groups head groups, then (several groups) the sum of
   the groups' dk_r partials into gkr, in group order */
template <typename T>
static int mla_dkv_run(const char *what, const mla_args<T> &a, int64_t B, int64_t nkt, cudaStream_t s)
{
    if (mla_launch<T, MLA_DKV>("mla backward dk/dv kernel", a, dim3((unsigned)nkt, (unsigned)a.groups, (unsigned)B), s))
        return -1;
    if (!a.gkr || a.groups == 1) return 0;
    int64_t n = B * a.Tk * a.dr;
    mla_sum_groups_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>(a.gkr, a.gkr_part, n, a.groups, a.Tk, a.Tkr,
                                                                     a.kbase, a.dr);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tide_set_error("cuda %s dk_r group sum kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

/* fixed, so the head grouping (hence the summation order of dk_r) depends on the shapes only; the emulator
   (tests/gpu/emu) sets a small value to reach both the one-group and the several-group paths */
#ifndef MLA_DKV_TARGET_BLOCKS
#define MLA_DKV_TARGET_BLOCKS 1024
#endif

/* dK/dV head groups (returns heads per group): one head per block unless dk_r needs summing, then as few groups
   as give MLA_DKV_TARGET_BLOCKS blocks (the fp32 partials stay below about 2·MLA_DKV_TARGET_BLOCKS key tiles of
   dk_r) */
static int64_t mla_head_groups(int64_t H, int64_t B, int64_t nkt, bool want_kr, int64_t *groups)
{
    int64_t g = H;
    if (want_kr && nkt * B > 0) {
        g = (MLA_DKV_TARGET_BLOCKS + nkt * B - 1) / (nkt * B);
        if (g > H) g = H;
        if (g < 1) g = 1;
    }
    int64_t hpg = (H + g - 1) / g;
    *groups = (H + hpg - 1) / hpg;
    return hpg;
}

template <typename T>
static int mla_backward_typed(const char *what, void *gq, void *gkn, void *gkr, void *gv, const void *gout,
                              const void *q, const void *kn, const void *kr, const void *v, const void *out,
                              const void *lse, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk,
                              int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t off, double scale, int bidir)
{
    TIDE_STREAM(s);
    int tc = sizeof(T) == 2;
    bool want_q = gq && B * Tq > 0, want_kr = gkr && dr > 0;
    bool want_kv = (gkn || gv || want_kr) && B * Tk > 0;
    if (!want_q && !want_kv) return 0;
    mla_args<T> a;
    mla_fill_args<T>(a, q, kn, kr, v, Tq, Tk, H, dn, dr, dv, off, scale, bidir);
    a.gout = (const T *)gout;
    a.lse = (const float *)lse;
    mla_layout Lq, Lkv;
    if (want_q && mla_pick_layout(what, MLA_DQ, tc, dn, dr, dv, 0, &Lq, bidir)) return -1;
    if (want_kv && mla_pick_layout(what, MLA_DKV, tc, dn, dr, dv, want_kr ? (int)dr : 0, &Lkv, bidir)) return -1;
    int64_t nkt = want_kv ? (Tk + Lkv.BK - 1) / Lkv.BK : 0, groups = 0;
    a.hpg = (int)mla_head_groups(H, B, nkt, want_kr, &groups);
    a.groups = (int)groups;

    int64_t *cu_d = NULL;
    float *D = NULL, *part = NULL;
    int rc = mla_upload_cu(what, cu, n_seg, &cu_d, s);
    a.cu = cu_d;
    a.n_seg = cu_d ? (int)n_seg : 0;
    int64_t nD = B * H * Tq;
    if (!rc && nD > 0) {
        cudaError_t e = tide_cuda_alloc((void **)&D, (size_t)nD * sizeof(float), s);
        if (e != cudaSuccess) rc = tide_set_error("cuda %s D alloc (%lld floats): %s", what, (long long)nD, cudaGetErrorString(e));
    }
    if (!rc && want_kr && groups > 1) {
        size_t n = (size_t)(groups * B * Tk * dr) * sizeof(float);
        cudaError_t e = tide_cuda_alloc((void **)&part, n, s);
        if (e != cudaSuccess) rc = tide_set_error("cuda %s dk_r partials alloc (%zu bytes): %s", what, n, cudaGetErrorString(e));
    }
    a.D = D;
    if (!rc && nD > 0) rc = mla_rowdot<T>(what, D, gout, out, nD, Tq, H, dv, s);
    if (!rc && want_q) {
        a.L = Lq;
        a.gq = (T *)gq;
        rc = mla_launch<T, MLA_DQ>("mla backward dq kernel", a, dim3((unsigned)((Tq + Lq.BQ - 1) / Lq.BQ), (unsigned)H,
                                                                     (unsigned)B), s);
    }
    if (!rc && want_kv) {
        a.L = Lkv;
        a.gkn = (T *)gkn;
        a.gv = (T *)gv;
        a.gkr = want_kr ? (T *)gkr : NULL;
        a.gkr_part = part;
        rc = mla_dkv_run<T>(what, a, B, nkt, s);
    }
    tide_cuda_release(part, s);
    tide_cuda_release(D, s);
    tide_cuda_release(cu_d, s);
    return rc;
}

int tide_cuda_mla_attention_backward(int dtype, void *gq, void *gkn, void *gkr, void *gv, const void *gout,
                                     const void *q, const void *kn, const void *kr, const void *v, const void *out,
                                     const void *lse, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq,
                                     int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, double scale)
{
    const char *what = "mla_attention backward";
    if (mla_check(what, dtype, kr, cu, n_seg, B, Tq, Tk, H, dn, dr, dv)) return -1;
    if (dtype == TIDE_F32)
        return mla_backward_typed<float>(what, gq, gkn, gkr, gv, gout, q, kn, kr, v, out, lse, cu, n_seg, B, Tq, Tk, H,
                                         dn, dr, dv, Tk - Tq, scale, 0);
    return mla_backward_typed<mla_bf16>(what, gq, gkn, gkr, gv, gout, q, kn, kr, v, out, lse, cu, n_seg, B, Tq, Tk, H,
                                        dn, dr, dv, Tk - Tq, scale, 0);
}

/* ---- mla_latent_attention (backend.h): the keys and values expanded from the latent a chunk at a time ---------
   Per chunk of Kc keys [k0, k0 + kc) one strided-batched GEMM (a product per batch row) expands the chunk,
   [B, kc, H·(dn + dv)] = ĉ[:, k0 : k0 + kc] Wᵀ with W = [W_UK^h ; W_UV^h] [H·(dn + dv), dc], into scratch of the
   chunk's size, and the flash kernels above read k_n^h and v^h from it in place (strides), with the chunk's place in
   the row (kbase = k0, Tkr = Tk: query i on key i + Tk − Tq, documents over the row's keys; k_r read from the row).
   forward: the first chunk writes the output (fp32) and lse, each later one merges its own into them by the
   log-sum-exp rule in the forward kernel's last step (merge: the block owns its rows), only for the queries that
   can see the chunk (query tiles before it are not launched): no buffer of a chunk's output.
   backward (mla.md §4, with the whole row's out and lse; D = rowsum(dO ⊙ O) once): per chunk the expansion again,
   dQ of the chunk added to a fp32 sum (the dQ kernel's own block writes it), the chunk's [gk_n^h | gv^h] into scratch
   in the expansion's layout and its dk_r into gk_r, then gĉ of the chunk = [gk_n | gv] W (one strided-batched GEMM,
   rows written once) and gW += [gk_n | gv]ᵀ ĉ (a GEMM per batch row, into fp32, rows then chunks in order). The
   order of every sum is fixed by the shapes: no atomics. One chunk (Kc >= Tk) is mla_attention's kernels as they
   are. bf16: the fp32 sums (output, dQ, gW) are rounded to bf16 once at the end. */

/* the fp32 sums kept over the chunks to the bf16 result */
__global__ void __launch_bounds__(MLA_NT) mla_to_bf16_kernel(mla_bf16 *dst, const float *src, int64_t n)
{
    TIDE_GRID_LOOP(k, n) dst[k] = __float2bfloat16(src[k]);
}

static int mla_to_bf16(const char *what, void *dst, const float *src, int64_t n, cudaStream_t s)
{
    if (n <= 0) return 0;
    mla_to_bf16_kernel<<<tide_blocks(n), TIDE_THREADS, 0, s>>>((mla_bf16 *)dst, src, n);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tide_set_error("cuda %s fp32 to bf16 kernel: %s", what, cudaGetErrorString(e));
    return 0;
}

static int mla_latent_check(const char *what, int dtype, const void *kr, const int64_t *cu, int64_t n_seg, int64_t B,
                            int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc,
                            int64_t chunk)
{
    if (mla_check(what, dtype, kr, cu, n_seg, B, Tq, Tk, H, dn, dr, dv)) return -1;
    if (chunk < 1) return tide_set_error("%s: chunk must be at least 1 key, got %lld", what, (long long)chunk);
    if (dc < 1) return tide_set_error("%s: the latent width dc must be at least 1, got %lld", what, (long long)dc);
    /* the GEMMs' sizes and leading dimensions are 32-bit */
    if (H * (dn + dv) > INT_MAX || dc > INT_MAX)
        return tide_set_error("%s: H·(dn + dv) = %lld and dc %lld must be at most %d (cuBLAS's 32-bit sizes)", what,
                              (long long)(H * (dn + dv)), (long long)dc, INT_MAX);
    return 0;
}

/* a chunk's arguments for the flash kernels: keys [k0, k0 + kc) of rows of Tk, k_n and v read from the expansion
   kv [B, kc, H, dn + dv] */
template <typename T>
static void mla_latent_args(mla_args<T> &a, const void *q, const T *kv, const void *kr, const int64_t *cu_d,
                            int64_t n_seg, int64_t Tq, int64_t Tk, int64_t k0, int64_t kc, int64_t H, int64_t dn,
                            int64_t dr, int64_t dv, double scale)
{
    mla_fill_args<T>(a, q, kv, kr, kv + dn, Tq, kc, H, dn, dr, dv, Tk - Tq - k0, scale, 0);
    a.kn_rs = a.v_rs = H * (dn + dv);
    a.kn_hs = a.v_hs = (int)(dn + dv);
    a.kbase = (int)k0;
    a.Tkr = (int)Tk;
    a.cu = cu_d;
    a.n_seg = cu_d ? (int)n_seg : 0;
}

/* the first query tile that sees a key of the chunk from k0 (query i sees key k0 iff i >= k0 − (Tk − Tq)); the
   first chunk runs them all, so every query is written once */
static int mla_latent_qt0(int64_t k0, int64_t Tq, int64_t Tk, int BQ)
{
    int64_t i = k0 - (Tk - Tq);
    return k0 == 0 || i <= 0 ? 0 : (int)(i / BQ);
}

template <typename T>
static int mla_latent_forward_typed(const char *what, void *out, void *lse, const void *q, const void *c,
                                    const void *kr, const void *w, const int64_t *cu, int64_t n_seg, int64_t B,
                                    int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc,
                                    int64_t chunk, double scale)
{
    TIDE_STREAM(s);
    if (B * Tq == 0) return 0;
    if (Tk == 0)   /* no keys: out 0, lse −inf, as mla_attention gives */
        return mla_forward_typed<T>(what, out, lse, 1, q, NULL, kr, NULL, cu, n_seg, B, Tq, Tk, H, dn, dr, dv, Tk - Tq,
                                    scale, 0);
    const bool bf = sizeof(T) == 2;
    const int dtype = bf ? TIDE_BF16 : TIDE_F32;
    int64_t E = H * (dn + dv), Kc = chunk < Tk ? chunk : Tk, n_o = B * Tq * H * dv;
    bool one = Kc == Tk;
    mla_layout L;
    if (mla_pick_layout(what, MLA_FWD, bf, dn, dr, dv, 0, &L)) return -1;
    int64_t nqt = (Tq + L.BQ - 1) / L.BQ;
    T *kv = NULL;
    float *acc = NULL;
    int64_t *cu_d = NULL;
    int rc = mla_upload_cu(what, cu, n_seg, &cu_d, s);
    cudaError_t e = cudaSuccess;
    if (!rc) e = tide_cuda_alloc((void **)&kv, (size_t)(B * Kc * E) * sizeof(T), s);
    if (!rc && e == cudaSuccess && !one && bf) e = tide_cuda_alloc((void **)&acc, (size_t)n_o * sizeof(float), s);
    if (!rc && e != cudaSuccess)
        rc = tide_set_error("cuda %s scratch for a chunk of %lld keys: %s", what, (long long)Kc, cudaGetErrorString(e));
    float *run = bf ? acc : (float *)out;   /* the running output (fp32) */
    for (int64_t k0 = 0; k0 < Tk && !rc; k0 += Kc) {
        int64_t kc = Tk - k0 < Kc ? Tk - k0 : Kc;
        rc = tide_cuda_gemm_batched(dtype, 0, 1, kc, E, dc, 1.0, (const T *)c + k0 * dc, dc, Tk * dc, w, dc, 0, 0.0, kv,
                                    E, kc * E, B);
        if (rc) break;
        mla_args<T> a;
        mla_latent_args<T>(a, q, kv, kr, cu_d, n_seg, Tq, Tk, k0, kc, H, dn, dr, dv, scale);
        a.L = L;
        a.qt0 = mla_latent_qt0(k0, Tq, Tk, L.BQ);
        a.lse_out = (float *)lse;
        if (one) a.out = (T *)out;
        else a.out_f32 = run;
        a.merge = k0 > 0;
        rc = mla_launch<T, MLA_FWD>("mla_latent forward kernel", a, dim3((unsigned)(nqt - a.qt0), (unsigned)H,
                                                                         (unsigned)B), s);
    }
    if (!rc && bf && !one) rc = mla_to_bf16(what, out, acc, n_o, s);
    tide_cuda_release(acc, s);
    tide_cuda_release(kv, s);
    tide_cuda_release(cu_d, s);
    return rc;
}

int tide_cuda_mla_latent_attention(int dtype, void *out, void *lse, const void *q, const void *c, const void *kr,
                                   const void *w, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk,
                                   int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc, int64_t chunk,
                                   double scale)
{
    const char *what = "mla_latent_attention";
    if (mla_latent_check(what, dtype, kr, cu, n_seg, B, Tq, Tk, H, dn, dr, dv, dc, chunk)) return -1;
    if (dtype == TIDE_F32)
        return mla_latent_forward_typed<float>(what, out, lse, q, c, kr, w, cu, n_seg, B, Tq, Tk, H, dn, dr, dv, dc,
                                               chunk, scale);
    return mla_latent_forward_typed<mla_bf16>(what, out, lse, q, c, kr, w, cu, n_seg, B, Tq, Tk, H, dn, dr, dv, dc,
                                              chunk, scale);
}

template <typename T>
static int mla_latent_backward_typed(const char *what, void *gq, void *gc, void *gkr, void *gw, const void *gout,
                                     const void *q, const void *c, const void *kr, const void *w, const void *out,
                                     const void *lse, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq,
                                     int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc,
                                     int64_t chunk, double scale)
{
    TIDE_STREAM(s);
    const bool bf = sizeof(T) == 2;
    const int dtype = bf ? TIDE_BF16 : TIDE_F32;
    int64_t E = H * (dn + dv), dqk = dn + dr, n_q = B * Tq * H * dqk;
    if (B * Tq == 0 || Tk == 0) {   /* no query sees a key: every gradient is 0 */
        if (gq && n_q > 0)
            TIDE_CU(cudaMemsetAsync(gq, 0, (size_t)n_q * sizeof(T), s), "mla_latent backward (zero dq)");
        if (gc && B * Tk > 0)
            TIDE_CU(cudaMemsetAsync(gc, 0, (size_t)(B * Tk * dc) * sizeof(T), s), "mla_latent backward (zero dc)");
        if (gkr && B * Tk * dr > 0)
            TIDE_CU(cudaMemsetAsync(gkr, 0, (size_t)(B * Tk * dr) * sizeof(T), s), "mla_latent backward (zero dk_r)");
        if (gw) TIDE_CU(cudaMemsetAsync(gw, 0, (size_t)(E * dc) * sizeof(T), s), "mla_latent backward (zero dw)");
        return 0;
    }
    bool want_q = gq != NULL, want_kr = gkr && dr > 0, want_kv = gc || gw;
    if (!want_q && !want_kr && !want_kv) return 0;
    int64_t Kc = chunk < Tk ? chunk : Tk, last = Tk - (Tk - 1) / Kc * Kc, nD = B * H * Tq;
    bool one = Kc == Tk;
    mla_layout Lq, Lkv;
    if (want_q && mla_pick_layout(what, MLA_DQ, bf, dn, dr, dv, 0, &Lq)) return -1;
    if ((want_kv || want_kr) && mla_pick_layout(what, MLA_DKV, bf, dn, dr, dv, want_kr ? (int)dr : 0, &Lkv)) return -1;
    int64_t nqt = want_q ? (Tq + Lq.BQ - 1) / Lq.BQ : 0, part_n = 0;
    if (want_kr)   /* the dk_r partials of the head groups: the most over a full and the last chunk */
        for (int64_t kc : {Kc, last}) {
            int64_t groups = 0;
            mla_head_groups(H, B, (kc + Lkv.BK - 1) / Lkv.BK, true, &groups);
            if (groups > 1 && groups * B * kc * dr > part_n) part_n = groups * B * kc * dr;
        }
    T *kv = NULL, *gkv = NULL;
    float *D = NULL, *qsum = NULL, *wsum = NULL, *part = NULL;
    int64_t *cu_d = NULL;
    int rc = mla_upload_cu(what, cu, n_seg, &cu_d, s);
    cudaError_t e = cudaSuccess;
    if (!rc) e = tide_cuda_alloc((void **)&kv, (size_t)(B * Kc * E) * sizeof(T), s);
    if (!rc && e == cudaSuccess) e = tide_cuda_alloc((void **)&D, (size_t)nD * sizeof(float), s);
    if (!rc && e == cudaSuccess && want_kv) e = tide_cuda_alloc((void **)&gkv, (size_t)(B * Kc * E) * sizeof(T), s);
    if (!rc && e == cudaSuccess && want_q && bf && !one)
        e = tide_cuda_alloc((void **)&qsum, (size_t)n_q * sizeof(float), s);
    if (!rc && e == cudaSuccess && gw && bf) e = tide_cuda_alloc((void **)&wsum, (size_t)(E * dc) * sizeof(float), s);
    if (!rc && e == cudaSuccess && part_n) e = tide_cuda_alloc((void **)&part, (size_t)part_n * sizeof(float), s);
    if (!rc && e != cudaSuccess)
        rc = tide_set_error("cuda %s scratch for a chunk of %lld keys: %s", what, (long long)Kc, cudaGetErrorString(e));
    if (!rc) rc = mla_rowdot<T>(what, D, gout, out, nD, Tq, H, dv, s);
    if (!bf && want_q && !one) qsum = (float *)gq;   /* f32: dQ sums in gq itself */
    float *wacc = bf ? wsum : (float *)gw;
    for (int64_t k0 = 0; k0 < Tk && !rc; k0 += Kc) {
        int64_t kc = Tk - k0 < Kc ? Tk - k0 : Kc;
        rc = tide_cuda_gemm_batched(dtype, 0, 1, kc, E, dc, 1.0, (const T *)c + k0 * dc, dc, Tk * dc, w, dc, 0, 0.0, kv,
                                    E, kc * E, B);
        if (rc) break;
        mla_args<T> a;
        mla_latent_args<T>(a, q, kv, kr, cu_d, n_seg, Tq, Tk, k0, kc, H, dn, dr, dv, scale);
        a.gout = (const T *)gout;
        a.lse = (const float *)lse;
        a.D = D;
        if (want_q) {
            a.L = Lq;
            a.qt0 = mla_latent_qt0(k0, Tq, Tk, Lq.BQ);
            if (one) a.gq = (T *)gq;
            a.gq_run = one ? NULL : qsum;
            a.gq_add = k0 > 0;
            rc = mla_launch<T, MLA_DQ>("mla_latent backward dq kernel", a, dim3((unsigned)(nqt - a.qt0), (unsigned)H,
                                                                                (unsigned)B), s);
            if (rc) break;
            a.qt0 = 0;
        }
        if (want_kv || want_kr) {
            int64_t nkt = (kc + Lkv.BK - 1) / Lkv.BK, groups = 0;
            a.L = Lkv;
            a.hpg = (int)mla_head_groups(H, B, nkt, want_kr, &groups);
            a.groups = (int)groups;
            a.gkn = want_kv ? gkv : NULL;
            a.gv = want_kv ? gkv + dn : NULL;
            a.gkr = want_kr ? (T *)gkr : NULL;
            a.gkr_part = part;
            rc = mla_dkv_run<T>(what, a, B, nkt, s);
            if (rc) break;
        }
        /* gĉ of the chunk's rows = [gk_n | gv] W; gW += [gk_n | gv]ᵀ ĉ, a batch row at a time */
        if (gc)
            rc = tide_cuda_gemm_batched(dtype, 0, 0, kc, dc, E, 1.0, gkv, E, kc * E, w, dc, 0, 0.0, (T *)gc + k0 * dc,
                                        dc, Tk * dc, B);
        for (int64_t b = 0; gw && b < B && !rc; b++)
            rc = tide_cuda_gemm_f32out(dtype, 1, 0, E, dc, kc, 1.0, gkv + b * kc * E, E,
                                       (const T *)c + (b * Tk + k0) * dc, dc, k0 == 0 && b == 0 ? 0.0 : 1.0, wacc, dc);
    }
    if (!rc && bf && qsum && !one) rc = mla_to_bf16(what, gq, qsum, n_q, s);
    if (!rc && bf && gw) rc = mla_to_bf16(what, gw, wsum, E * dc, s);
    tide_cuda_release(part, s);
    if (bf) tide_cuda_release(qsum, s);
    tide_cuda_release(wsum, s);
    tide_cuda_release(gkv, s);
    tide_cuda_release(D, s);
    tide_cuda_release(kv, s);
    tide_cuda_release(cu_d, s);
    return rc;
}

int tide_cuda_mla_latent_attention_backward(int dtype, void *gq, void *gc, void *gkr, void *gw, const void *gout,
                                            const void *q, const void *c, const void *kr, const void *w,
                                            const void *out, const void *lse, const int64_t *cu, int64_t n_seg,
                                            int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr,
                                            int64_t dv, int64_t dc, int64_t chunk, double scale)
{
    const char *what = "mla_latent_attention backward";
    if (mla_latent_check(what, dtype, kr, cu, n_seg, B, Tq, Tk, H, dn, dr, dv, dc, chunk)) return -1;
    if (dtype == TIDE_F32)
        return mla_latent_backward_typed<float>(what, gq, gc, gkr, gw, gout, q, c, kr, w, out, lse, cu, n_seg, B, Tq,
                                                Tk, H, dn, dr, dv, dc, chunk, scale);
    return mla_latent_backward_typed<mla_bf16>(what, gq, gc, gkr, gw, gout, q, c, kr, w, out, lse, cu, n_seg, B, Tq,
                                               Tk, H, dn, dr, dv, dc, chunk, scale);
}

/* the same kernels for attention.cu (no documents, no rope part; the caller has checked the arguments) */
int tide_cuda_flash_forward(const char *what, int dtype, void *out, void *lse, int lse_f32, const void *q,
                            const void *k, const void *v, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t D,
                            int64_t off, double scale)
{
    if (dtype == TIDE_F32)
        return mla_forward_typed<float>(what, out, lse, lse_f32, q, k, NULL, v, NULL, 0, B, Tq, Tk, H, D, 0, D, off,
                                        scale, 0);
    return mla_forward_typed<mla_bf16>(what, out, lse, lse_f32, q, k, NULL, v, NULL, 0, B, Tq, Tk, H, D, 0, D, off,
                                       scale, 0);
}

int tide_cuda_flash_backward(const char *what, int dtype, void *dq, void *dk, void *dv, const void *dout,
                             const void *q, const void *k, const void *v, const void *out, const float *lse, int64_t B,
                             int64_t Tq, int64_t Tk, int64_t H, int64_t D, int64_t off, double scale)
{
    if (dtype == TIDE_F32)
        return mla_backward_typed<float>(what, dq, dk, NULL, dv, dout, q, k, NULL, v, out, lse, NULL, 0, B, Tq, Tk, H,
                                         D, 0, D, off, scale, 0);
    return mla_backward_typed<mla_bf16>(what, dq, dk, NULL, dv, dout, q, k, NULL, v, out, lse, NULL, 0, B, Tq, Tk, H,
                                        D, 0, D, off, scale, 0);
}

/* ---- varlen_attention (spec/vision.md §3, §5): one packed row [T, H, D], bidirectional inside each segment --- */

static int varlen_check(const char *what, int dtype, const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D)
{
    if (!cu) return tide_set_error("%s: cu_seqlens is NULL (the segment boundaries are required)", what);
    return mla_check(what, dtype, NULL, cu, n_seg, 1, T, T, H, D, 0, D);
}

/* off = T: no causal limit; bidir: keys up to the end of each query's segment */
int tide_cuda_varlen_attention(int dtype, void *out, void *lse, const void *q, const void *k, const void *v,
                               const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale)
{
    const char *what = "varlen_attention";
    if (varlen_check(what, dtype, cu, n_seg, T, H, D)) return -1;
    if (dtype == TIDE_F32)
        return mla_forward_typed<float>(what, out, lse, 1, q, k, NULL, v, cu, n_seg, 1, T, T, H, D, 0, D, T, scale, 1);
    return mla_forward_typed<mla_bf16>(what, out, lse, 1, q, k, NULL, v, cu, n_seg, 1, T, T, H, D, 0, D, T, scale, 1);
}

int tide_cuda_varlen_attention_backward(int dtype, void *gq, void *gk, void *gv, const void *gout, const void *q,
                                        const void *k, const void *v, const void *out, const void *lse,
                                        const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale)
{
    const char *what = "varlen_attention backward";
    if (varlen_check(what, dtype, cu, n_seg, T, H, D)) return -1;
    if (dtype == TIDE_F32)
        return mla_backward_typed<float>(what, gq, gk, NULL, gv, gout, q, k, NULL, v, out, lse, cu, n_seg, 1, T, T, H,
                                         D, 0, D, T, scale, 1);
    return mla_backward_typed<mla_bf16>(what, gq, gk, NULL, gv, gout, q, k, NULL, v, out, lse, cu, n_seg, 1, T, T, H,
                                        D, 0, D, T, scale, 1);
}

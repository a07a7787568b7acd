/*
 * kda_impl.h — the body of the KDA CPU kernels for one float type. kda.c includes it twice, with
 * T = float / SFX = f32 and T = double / SFX = f64. Math and notation: spec/kda.md (§3 recurrence,
 * §4 chunk form, §5 why the factorised decay needs the lower bound, §6 backward).
 *
 * Dot products over a head dimension are `omp simd` reductions: vector partial sums (a fixed order for a
 * given build, independent of the thread count) instead of one serial chain of dependent adds.
 *
 * Layout: q, k, g [B, T, H, dk], v, o [B, T, H, dv], beta [B, T, H]; the rows of head h are H·dk
 * (H·dv, H) elements apart. A work item is one (segment, head): it owns those rows of every output.
 */
#define KCAT_(a, b) a##_##b
#define KCAT(a, b) KCAT_(a, b)
#define F(name) KCAT(name, SFX)

#include "tile_mm.h"

/* a row of an output that the kernel writes once and never reads back: whole vectors go around the cache
   (non-temporal stores: no read of the line first, nothing of the working set evicted). The caller's work item
   ends with a fence (KDA_OUT_FENCE) so that the stores are visible to the threads that read the result. */
static inline void F(copy_out)(T *dst, const T *src, int64_t n)
{
#if defined(__AVX512F__) || defined(__AVX2__)
    if (((uintptr_t)dst & 63) == 0 && n % TMM_VL == 0) {
        for (int64_t i = 0; i < n; i += TMM_VL) tide_cpu_stream_line(dst + i, src + i);
        return;
    }
#endif
    F(copy)(dst, src, n);
}

/* row `row` of head h of a [tokens, H, d] array into the cache ahead of use. A head's rows are H·d elements apart,
   a stride the hardware prefetchers follow poorly, and memory is far (about 200 ns here): without this a chunk
   spent a fifth of its time waiting on its input rows. One row at a time, spread over a chunk's work: a burst of a
   whole chunk's rows fills the line-fill buffers and stalls the pipeline as surely as the misses did. */
#define KDA_PREFETCH_ROW(base, row, H, h, d)                                                                   \
    do {                                                                                                       \
        tide_cpu_prefetch_bytes((base) + ((row) * (H) + (h)) * (d), (size_t)(d) * sizeof(T));                 \
    } while (0)

/* Σ a[i] b[i] in order, each product rounded before it is added (no fused multiply-add), and acc[i] += a[i] b[i]
   likewise: the backward's sums for rowsum(K̂ ⊙ X) and the last row of dG have always been these (GCC vectorises
   such loops as in-order reductions, which do not fuse), and a quickstart run's recall rows past the trained length
   move with the rounding of the gradients. Not inlined, so that the contraction setting holds. dots_inorder_t
   forms the row sums: x[r] = Σ_i a[r][i] b[r][i] in that order for the c rows, from their transposes aT [n, lda]
   and bT [n, ldb], the c sums advancing together, one lane a row (one row after another, each sum was a chain of
   n dependent adds). */
#ifndef KDA_NO_CONTRACT
#if defined(__clang__)
#define KDA_NO_CONTRACT __attribute__((noinline))
#define KDA_NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#else
#define KDA_NO_CONTRACT __attribute__((noinline, optimize("fp-contract=off")))
#define KDA_NO_CONTRACT_BODY
#endif
#endif
KDA_NO_CONTRACT static void F(acc_products)(T *restrict acc, const T *restrict a, const T *restrict b, int64_t n)
{
    KDA_NO_CONTRACT_BODY
    for (int64_t i = 0; i < n; i++) acc[i] += a[i] * b[i];
}
KDA_NO_CONTRACT static void F(dots_inorder_t)(T *restrict x, const T *restrict aT, int64_t lda, const T *restrict bT,
                                              int64_t ldb, int64_t c, int64_t n)
{
    KDA_NO_CONTRACT_BODY
    for (int64_t r = 0; r < c; r++) x[r] = 0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = 0; r < c; r++) x[r] += aT[i * lda + r] * bT[i * ldb + r];
}

/* M = (I + A)⁻¹ for a strictly lower-triangular A [c, c] (row stride C), by forward substitution:
   M[r][j] = δ_rj − Σ_{j ≤ m < r} A[r][m] M[m][j]  (kda.md §4; the reference form) */
static void F(unit_lower_inverse)(T *M, const T *A, int64_t c, int64_t C)
{
    for (int64_t r = 0; r < c; r++) {
        T *mr = M + r * C;
        for (int64_t j = 0; j < C; j++) mr[j] = 0;
        mr[r] = 1;
        for (int64_t m = 0; m < r; m++) {
            T a = A[r * C + m];
            if (a == 0) continue;
            const T *mm = M + m * C;
            for (int64_t j = 0; j <= m; j++) mr[j] -= a * mm[j];
        }
    }
}

/* ---- per-thread workspace ---------------------------------------------------------------------- */
/* A chunk's operands live in a "prep area" (prep() and chunk_state() fill it); the backward keeps one area
   per chunk of a recompute block, so its reverse sweep reuses what the state pass computed. The rest is
   scratch shared by all chunks. */
typedef struct {
    int64_t C, dk, dv, prep_size;
    /* prep area */
    T *Q, *K, *V, *beta;               /* the chunk's rows, contiguous */
    T *G, *Gam, *Gi, *Er, *Qh, *Kh, *Kc, *Kr;   /* G cumsum, Γ = exp(G), 1/Γ (dense path), exp(G_c − G),
                                                  Q⊙Γ, K⊙Γ, K⊙Γ⁻¹, K⊙Er */
    T *Araw, *A, *P, *M, *W, *Ut, *U;
    /* scratch */
    T *KcT, *bK, *bV;
    T *dO, *dU, *UT, *dP, *dB, *dA, *bdA, *dV, *dOT, *dVT, *dPT, *bdAT, *dQhT, *dKhT, *dKrT, *dQh, *dKh, *dKr, *dKc,
      *gQ, *gK, *gG, *lastG;
    T *Ob;                             /* the forward's output rows before they are stored */
    T *buf;
    /* rows to bring into the cache while this chunk computes (KDA_PREFETCH_ROW): the next chunk's inputs during
       prep(), its output gradient during chunk_backward(); c = 0 for none */
    int64_t pf_tok, pf_c, pg_tok, pg_c;
} F(ws);

static int64_t F(prep_size)(int64_t C, int64_t dk, int64_t dv)
{
    return 11 * C * dk + 3 * C * dv + C + 4 * C * C;
}

/* point the prep fields at `area` (prep_size elements) */
static void F(bind)(F(ws) *w, T *area)
{
    int64_t C = w->C, ck = C * w->dk, cv = C * w->dv, cc = C * C;
    T *p = area;
#define TAKE(name, n) (w->name = p, p += (n))
    TAKE(Q, ck); TAKE(K, ck); TAKE(V, cv); TAKE(beta, C);
    TAKE(G, ck); TAKE(Gam, ck); TAKE(Gi, ck); TAKE(Er, ck); TAKE(Qh, ck); TAKE(Kh, ck); TAKE(Kc, ck); TAKE(Kr, ck);
    TAKE(Araw, cc); TAKE(A, cc); TAKE(P, cc); TAKE(M, cc); TAKE(W, ck); TAKE(Ut, cv); TAKE(U, cv);
#undef TAKE
}

static int F(ws_init)(F(ws) *w, int64_t C, int64_t dk, int64_t dv)
{
    w->C = C; w->dk = dk; w->dv = dv;
    w->prep_size = F(prep_size)(C, dk, dv);
    int64_t ck = C * dk, cv = C * dv, cc = C * C;
    int64_t total = w->prep_size                     /* one prep area, for the forward */
                  + 2 * ck + cv                      /* KcT bK bV */
                  + 7 * cv + 5 * cc                  /* dO dU UT dB dV dOT dVT, dP dA bdA dPT bdAT */
                  + 10 * ck + dk                     /* dQhT dKhT dKrT dQh dKh dKr dKc gQ gK gG, lastG */
                  + cv;                              /* Ob */
    w->buf = tide_cpu_malloc((size_t)total * sizeof(T));   /* 64-byte aligned: whole-vector rows */
    if (!w->buf) return -1;
    F(bind)(w, w->buf);
    T *p = w->buf + w->prep_size;
#define TAKE(name, n) (w->name = p, p += (n))
    TAKE(KcT, ck); TAKE(bK, ck); TAKE(bV, cv);
    TAKE(dO, cv); TAKE(dU, cv); TAKE(UT, cv); TAKE(dP, cc); TAKE(dB, cv); TAKE(dA, cc); TAKE(bdA, cc);
    TAKE(dV, cv); TAKE(dOT, cv); TAKE(dVT, cv); TAKE(dPT, cc); TAKE(bdAT, cc); TAKE(dQhT, ck); TAKE(dKhT, ck);
    TAKE(dKrT, ck);
    TAKE(dQh, ck); TAKE(dKh, ck); TAKE(dKr, ck); TAKE(dKc, ck);
    TAKE(gQ, ck); TAKE(gK, ck); TAKE(gG, ck); TAKE(lastG, dk); TAKE(Ob, cv);
    w->pf_c = w->pg_c = 0;
#undef TAKE
    return 0;
}

/* ---- one chunk: operands that do not depend on the state (kda.md §4) ------------------------------- */
/* rows [tok, tok + c) of head h; safe = per-pair exp(G_r − G_j) instead of the factorised products; need_p = 0
   skips P = Tril(Q̂Ǩᵀ) (the passes that only carry the state need no output) */
static void F(prep)(F(ws) *w, const T *q, const T *k, const T *v, const T *g, const T *beta, int64_t tok, int64_t c,
                    int64_t H, int64_t h, int safe, int need_p)
{
    int64_t C = w->C, dk = w->dk, dv = w->dv;
    for (int64_t r = 0; r < c; r++) {
        int64_t row = tok + r;
        F(copy)(w->Q + r * dk, q + (row * H + h) * dk, dk);
        F(copy)(w->K + r * dk, k + (row * H + h) * dk, dk);
        F(copy)(w->V + r * dv, v + (row * H + h) * dv, dv);
        w->beta[r] = beta[row * H + h];
        const T *gr = g + (row * H + h) * dk;
        T *G = w->G + r * dk;
        if (r == 0) for (int64_t i = 0; i < dk; i++) G[i] = gr[i];
        else for (int64_t i = 0; i < dk; i++) G[i] = G[i - dk] + gr[i];
        if (r < w->pf_c) {
            int64_t pr = w->pf_tok + r;
            KDA_PREFETCH_ROW(q, pr, H, h, dk);
            KDA_PREFETCH_ROW(k, pr, H, h, dk);
            KDA_PREFETCH_ROW(v, pr, H, h, dv);
            KDA_PREFETCH_ROW(g, pr, H, h, dk);
        }
    }
    for (int64_t x = 0; x < c * dk; x++) w->Gam[x] = EXP(w->G[x]);
    const T *Gc = w->G + (c - 1) * dk, *Gam_c = w->Gam + (c - 1) * dk;
    for (int64_t r = 0; r < c; r++) {
        const T *G = w->G + r * dk, *Q = w->Q + r * dk, *K = w->K + r * dk, *Gam = w->Gam + r * dk;
        T *Gi = w->Gi + r * dk, *Er = w->Er + r * dk, *Qh = w->Qh + r * dk, *Kh = w->Kh + r * dk;
        T *Kr = w->Kr + r * dk, *Kc = w->Kc + r * dk;
        if (!safe)
            /* under the bound Γ >= e^{-80}: 1/Γ and Γ_c/Γ are normal numbers (kda.md §5) */
            _Pragma("omp simd")
            for (int64_t i = 0; i < dk; i++) {
                Gi[i] = 1 / Gam[i];
                Er[i] = Gam_c[i] * Gi[i];
                Kc[i] = K[i] * Gi[i];
            }
        else
            _Pragma("omp simd")
            for (int64_t i = 0; i < dk; i++) Er[i] = EXP(Gc[i] - G[i]);
        /* (the fields of w are disjoint arrays: omp simd says so where GCC cannot prove it) */
        _Pragma("omp simd")
        for (int64_t i = 0; i < dk; i++) {
            Qh[i] = Q[i] * Gam[i];
            Kh[i] = K[i] * Gam[i];
            Kr[i] = K[i] * Er[i];
        }
    }
    /* Araw[r][j] = Σ k_r k_j exp(G_r − G_j) (j < r), P[r][j] = Σ q_r k_j exp(G_r − G_j) (j ≤ r). The upper
       triangle of the dense products may hold e^{+80}: it is discarded by selection, never multiplied. */
    if (!safe) {
        F(transpose)(w->KcT, w->Kc, c, dk, dk);
        F(mm)(w->Araw, C, w->Kh, dk, 1, w->KcT, c, c, c, dk, 1, 0);
        if (need_p) F(mm)(w->P, C, w->Qh, dk, 1, w->KcT, c, c, c, dk, 1, 0);
        for (int64_t r = 0; r < c; r++)
            for (int64_t j = r + 1; j < c; j++) { w->Araw[r * C + j] = 0; w->P[r * C + j] = 0; }
        for (int64_t r = 0; r < c; r++) w->Araw[r * C + r] = 0;
    } else {
        for (int64_t r = 0; r < c; r++) {
            const T *Gr = w->G + r * dk, *Qr = w->Q + r * dk, *Kr = w->K + r * dk;
            for (int64_t j = 0; j < c; j++) {
                if (j > r) { w->Araw[r * C + j] = 0; w->P[r * C + j] = 0; continue; }
                const T *Gj = w->G + j * dk, *Kj = w->K + j * dk;
                T sa = 0, sp = 0;
                _Pragma("omp simd reduction(+ : sa, sp)")
                for (int64_t i = 0; i < dk; i++) {
                    T e = EXP(Gr[i] - Gj[i]);
                    sa += Kr[i] * Kj[i] * e;
                    sp += Qr[i] * Kj[i] * e;
                }
                w->Araw[r * C + j] = j < r ? sa : 0;
                w->P[r * C + j] = sp;
            }
        }
    }
    for (int64_t r = 0; r < c; r++) {
        T b = w->beta[r];
        _Pragma("omp simd")
        for (int64_t j = 0; j < c; j++) w->A[r * C + j] = b * w->Araw[r * C + j];
    }
    F(unit_lower_inverse)(w->M, w->A, c, C);
    for (int64_t r = 0; r < c; r++) {
        T b = w->beta[r];
        for (int64_t i = 0; i < dk; i++) w->bK[r * dk + i] = b * w->Kh[r * dk + i];
        for (int64_t j = 0; j < dv; j++) w->bV[r * dv + j] = b * w->V[r * dv + j];
    }
    F(mm)(w->W, dk, w->M, C, 1, w->bK, dk, c, dk, c, 1, 0);     /* W = M diag(β) K̂ */
    F(mm)(w->Ut, dv, w->M, C, 1, w->bV, dv, c, dv, c, 1, 0);    /* Ũ = M diag(β) V */
}

/* U = Ũ − W S₀; o rows (stride ldo) = Q̂ S₀ + P U when o; then S_next = diag(Γ_c) S + K_rᵀ U
   (S_next may be S: in place) */
static void F(chunk_state)(F(ws) *w, const T *S, T *S_next, T *o, int64_t ldo, int64_t c)
{
    int64_t C = w->C, dk = w->dk, dv = w->dv;
    F(copy)(w->U, w->Ut, c * dv);
    F(mm)(w->U, dv, w->W, dk, 1, S, dv, c, dv, dk, -1, 1);
    if (o) {
        F(mm)(w->Ob, dv, w->Qh, dk, 1, S, dv, c, dv, dk, 1, 0);
        F(mm)(w->Ob, dv, w->P, C, 1, w->U, dv, c, dv, c, 1, 1);
        for (int64_t r = 0; r < c; r++) F(copy_out)(o + r * ldo, w->Ob + r * dv, dv);
    }
    const T *Gam_c = w->Gam + (c - 1) * dk;
    for (int64_t i = 0; i < dk; i++) {
        T a = Gam_c[i];
        const T *s = S + i * dv;
        T *sn = S_next + i * dv;
        _Pragma("omp simd")
        for (int64_t j = 0; j < dv; j++) sn[j] = a * s[j];
    }
    F(mm)(S_next, dv, w->Kr, 1, dk, w->U, dv, dk, dv, c, 1, 1);
}

/* backward of one chunk (kda.md §6). S0 is the chunk's entering state, dS holds dS_c on entry and dS₀ on
   return. Writes the chunk's rows of gq, gk, gv, gg, gbeta (each may be NULL). prep() (with P) and
   chunk_state() from S0 must have run on the bound prep area. */
static void F(chunk_backward)(F(ws) *w, const T *S0, T *dS, const T *gout, int64_t tok, int64_t c, int64_t H,
                              int64_t h, int safe, T *gq, T *gk, T *gv, T *gg, T *gbeta)
{
    int64_t C = w->C, dk = w->dk, dv = w->dv;
    /* U = Ũ − W S₀ is in the prep area (chunk_state ran on it) */
    for (int64_t r = 0; r < c; r++) {
        if (gout) F(copy)(w->dO + r * dv, gout + ((tok + r) * H + h) * dv, dv);
        else memset(w->dO + r * dv, 0, (size_t)dv * sizeof(T));
    }
    /* dU = Pᵀ dO + K_r dS_c;  dK_r = U dS_cᵀ;  Γ_c ⊙ rowsum(dS_c ⊙ S₀) for the last row of dG */
    F(mm)(w->dU, dv, w->P, 1, C, w->dO, dv, c, dv, c, 1, 0);
    F(mm)(w->dU, dv, w->Kr, dk, 1, dS, dv, c, dv, dk, 1, 1);
    F(transpose)(w->UT, w->U, c, dv, dv);
    F(mm)(w->dKrT, C, dS, dv, 1, w->UT, c, dk, c, dv, 1, 0);       /* dK_rᵀ = dS_c Uᵀ  [dk, c] */
    const T *Gam_c = w->Gam + (c - 1) * dk;
    /* (the reductions of this function keep their summation orders: see dots_inorder_t) */
    for (int64_t i = 0; i < dk; i++) {
        T s = 0;
        _Pragma("omp simd reduction(+ : s)")
        for (int64_t j = 0; j < dv; j++) s += dS[i * dv + j] * S0[i * dv + j];
        w->lastG[i] = Gam_c[i] * s;
    }
    /* dP = Tril(dO Uᵀ);  dB = Mᵀ dU;  dA = −StrictTril(dB Uᵀ);  dV = diag(β) dB */
    F(mm)(w->dP, C, w->dO, dv, 1, w->UT, c, c, c, dv, 1, 0);
    F(mm)(w->dB, dv, w->M, 1, C, w->dU, dv, c, dv, c, 1, 0);
    F(mm)(w->dA, C, w->dB, dv, 1, w->UT, c, c, c, dv, -1, 0);
    for (int64_t r = 0; r < c; r++)
        for (int64_t j = 0; j < c; j++) {
            if (j > r) w->dP[r * C + j] = 0;
            if (j >= r) w->dA[r * C + j] = 0;
            w->bdA[r * C + j] = w->beta[r] * w->dA[r * C + j];
        }
    /* X = dB S₀ᵀ, formed transposed ([dk, c]) so that the dk x dv state is never transposed; it gives both
       dK̂ = −diag(β) X (+ the intra part) and, with R = V − K̂ S₀, rowsum(dB ⊙ R) = rowsum(dB ⊙ V) − rowsum(K̂ ⊙ X)
       without forming R (one c x dk x dv product fewer). dQ̂ and dK̂ stay transposed through their products (the
       same products, so the same bits, whatever c and dk), then turn into rows for the rest of the backward. */
    F(transpose)(w->dVT, w->dB, c, dv, dv);
    F(mm)(w->dKhT, C, S0, dv, 1, w->dVT, c, dk, c, dv, 1, 0);
    /* rowsum(K̂ ⊙ X) of every row, from K̂ᵀ and Xᵀ (into dOT; K̂ᵀ in dQhT: both free until their own products below) */
    T *xr = w->dOT;
    F(transpose)(w->dQhT, w->Kh, c, dk, dk);
    F(dots_inorder_t)(xr, w->dQhT, c, w->dKhT, C, c, dk);
    for (int64_t r = 0; r < c; r++) {
        T b = w->beta[r], s = 0, x = xr[r];
        _Pragma("omp simd reduction(+ : s)")
        for (int64_t j = 0; j < dv; j++) {
            w->dV[r * dv + j] = b * w->dB[r * dv + j];
            s += w->dB[r * dv + j] * w->V[r * dv + j];
        }
        s -= x;
        for (int64_t j = 0; j < r; j++) s += w->dA[r * C + j] * w->Araw[r * C + j];
        if (gbeta) gbeta[(tok + r) * H + h] = s;
        if (gv) F(copy_out)(gv + ((tok + r) * H + h) * dv, w->dV + r * dv, dv);
        if (r < w->pg_c && gout) KDA_PREFETCH_ROW(gout, w->pg_tok + r, H, h, dv);
    }
    for (int64_t i = 0; i < dk; i++) {
        T *row = w->dKhT + i * C;
        _Pragma("omp simd")
        for (int64_t r = 0; r < c; r++) row[r] *= -w->beta[r];
    }
    /* dQ̂ = dO S₀ᵀ (+ dP Ǩ);  dK̂ = −dV S₀ᵀ (+ diag(β) dA Ǩ);  dǨ = dPᵀ Q̂ + (diag(β) dA)ᵀ K̂ */
    F(transpose)(w->dOT, w->dO, c, dv, dv);
    F(mm)(w->dQhT, C, S0, dv, 1, w->dOT, c, dk, c, dv, 1, 0);
    if (!safe) {
        F(transpose)(w->dPT, w->dP, c, c, C);
        F(transpose)(w->bdAT, w->bdA, c, c, C);
        F(mm)(w->dQhT, C, w->Kc, 1, dk, w->dPT, c, dk, c, c, 1, 1);
        F(mm)(w->dKhT, C, w->Kc, 1, dk, w->bdAT, c, dk, c, c, 1, 1);
        F(mm)(w->dKc, dk, w->dP, 1, C, w->Qh, dk, c, dk, c, 1, 0);
        F(mm)(w->dKc, dk, w->bdA, 1, C, w->Kh, dk, c, dk, c, 1, 1);
    }
    F(transpose_ld)(w->dQh, dk, w->dQhT, dk, c, C);
    F(transpose_ld)(w->dKh, dk, w->dKhT, dk, c, C);
    /* dS₀ = diag(Γ_c) dS_c + Q̂ᵀ dO − K̂ᵀ dV  (in place) */
    for (int64_t i = 0; i < dk; i++) {
        T a = Gam_c[i];
        _Pragma("omp simd")
        for (int64_t j = 0; j < dv; j++) dS[i * dv + j] *= a;
    }
    F(mm)(dS, dv, w->Qh, 1, dk, w->dO, dv, dk, dv, c, 1, 1);
    F(mm)(dS, dv, w->Kh, 1, dk, w->dV, dv, dk, dv, c, -1, 1);
    /* back to q, k and the cumulative decay G */
    F(transpose_ld)(w->dKr, dk, w->dKrT, dk, c, C);
    for (int64_t r = 0; r < c; r++) {
        const T *dQh = w->dQh + r * dk, *dKh = w->dKh + r * dk, *dKr = w->dKr + r * dk, *dKc = w->dKc + r * dk;
        const T *Gam = w->Gam + r * dk, *Er = w->Er + r * dk, *Gi = w->Gi + r * dk, *Qh = w->Qh + r * dk,
                *Kh = w->Kh + r * dk, *Kr = w->Kr + r * dk, *Kc = w->Kc + r * dk;
        T *gQ = w->gQ + r * dk, *gK = w->gK + r * dk, *gG = w->gG + r * dk;
        _Pragma("omp simd")
        for (int64_t i = 0; i < dk; i++) {
            gQ[i] = dQh[i] * Gam[i];
            gK[i] = dKh[i] * Gam[i] + dKr[i] * Er[i];
            gG[i] = dQh[i] * Qh[i] + dKh[i] * Kh[i] - dKr[i] * Kr[i];
            if (!safe) {
                gK[i] += dKc[i] * Gi[i];
                gG[i] -= dKc[i] * Kc[i];
            }
        }
    }
    if (safe) {
        /* the intra-chunk terms pair by pair, with e = EXP(G_r − G_j) <= 1 */
        for (int64_t r = 0; r < c; r++)
            for (int64_t j = 0; j <= r; j++) {
                T a = w->dP[r * C + j], b = w->bdA[r * C + j];
                if (a == 0 && b == 0) continue;
                const T *Gr = w->G + r * dk, *Gj = w->G + j * dk, *Qr = w->Q + r * dk, *Kr = w->K + r * dk,
                        *Kj = w->K + j * dk;
                T *dqr = w->gQ + r * dk, *dkr = w->gK + r * dk, *dkj = w->gK + j * dk, *dGr = w->gG + r * dk,
                  *dGj = w->gG + j * dk;
                for (int64_t i = 0; i < dk; i++) {
                    T e = EXP(Gr[i] - Gj[i]);
                    T t = (a * Qr[i] + b * Kr[i]) * Kj[i] * e;
                    dqr[i] += a * Kj[i] * e;
                    dkj[i] += (a * Qr[i] + b * Kr[i]) * e;
                    dkr[i] += b * Kj[i] * e;
                    dGr[i] += t;
                    dGj[i] -= t;
                }
            }
    }
    /* the last row of dG: + Σ_r dK_r ⊙ K_r over the chunk's rows (in row order) + Γ_c ⊙ rowsum(dS_c ⊙ S₀) */
    T *dGc = w->gG + (c - 1) * dk, *acc = w->dQhT;     /* dQhT is free by now: dk elements of scratch */
    for (int64_t i = 0; i < dk; i++) acc[i] = 0;
    for (int64_t r = 0; r < c; r++) F(acc_products)(acc, w->dKr + r * dk, w->Kr + r * dk, dk);
    _Pragma("omp simd")
    for (int64_t i = 0; i < dk; i++) dGc[i] += acc[i] + w->lastG[i];
    /* dg_i = Σ_{r >= i} dG_r (reverse cumsum inside the chunk) */
    for (int64_t r = c - 2; r >= 0; r--)
        _Pragma("omp simd")
        for (int64_t i = 0; i < dk; i++) w->gG[r * dk + i] += w->gG[(r + 1) * dk + i];
    for (int64_t r = 0; r < c; r++) {
        int64_t row = ((tok + r) * H + h) * dk;
        if (gq) F(copy_out)(gq + row, w->gQ + r * dk, dk);
        if (gk) F(copy_out)(gk + row, w->gK + r * dk, dk);
        if (gg) F(copy_out)(gg + row, w->gG + r * dk, dk);
    }
}

#ifndef KDA_BLOCK
#define KDA_BLOCK TIDE_KDA_CPU_CKPT_CHUNKS
#endif

/* ---- one work item: a segment [t0, t1) of flattened tokens, head h ------------------------------- */
/* chunk path forward; S enters holding the initial state and leaves holding the final one */
static void F(segment_chunk_forward)(F(ws) *w, T *S, T *o, const T *q, const T *k, const T *v, const T *g,
                                     const T *beta, int64_t t0, int64_t t1, int64_t H, int64_t h, int safe, T *ck)
{
    int64_t SZ = w->dk * w->dv;
    for (int64_t tok = t0, i = 0; tok < t1; tok += w->C, i++) {
        int64_t c = t1 - tok < w->C ? t1 - tok : w->C;
        if (ck && i % KDA_BLOCK == 0) F(copy)(ck + ((i / KDA_BLOCK) * H + h) * SZ, S, SZ);
        w->pf_tok = tok + w->C;
        w->pf_c = tok + w->C < t1 ? (t1 - tok - w->C < w->C ? t1 - tok - w->C : w->C) : 0;
        F(prep)(w, q, k, v, g, beta, tok, c, H, h, safe, o != NULL);
        F(chunk_state)(w, S, S, o ? o + (tok * H + h) * w->dv : NULL, H * w->dv, c);
    }
    w->pf_c = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);     /* the non-temporal stores of copy_out before the result is read */
}

/* chunks per recompute block of the backward: one block's chunk start states and prep areas are kept
   (16 x ~58 KB at C = 16, dk = dv = 64: in L2). The blocks' own start states are the checkpoints the
   forward wrote (ck: one state per 16 chunks, 1/16 of what storing every chunk's state would cost; kda.md
   §6), or, without them, come from a first state pass here. */

static int F(segment_chunk_backward)(F(ws) *w, const T *s_init, T *dS, const T *gout, const T *q, const T *k,
                                     const T *v, const T *g, const T *beta, int64_t t0, int64_t t1, int64_t H,
                                     int64_t h, int safe, T *gq, T *gk, T *gv, T *gg, T *gbeta, const T *ck_in)
{
    int64_t C = w->C, dk = w->dk, dv = w->dv, SZ = dk * dv;
    int64_t nch = (t1 - t0 + C - 1) / C, nblk = (nch + KDA_BLOCK - 1) / KDA_BLOCK;
    T *ck = tide_cpu_malloc((size_t)(((ck_in ? 0 : nblk) + KDA_BLOCK + 1) * SZ + KDA_BLOCK * w->prep_size) * sizeof(T));
    if (!ck) return -1;
    T *st = ck + (ck_in ? 0 : nblk) * SZ, *S = st + KDA_BLOCK * SZ, *areas = S + SZ, *own = w->Q;
    if (!ck_in) {
        if (s_init) F(copy)(S, s_init, SZ);
        else memset(S, 0, (size_t)SZ * sizeof(T));
        for (int64_t i = 0; i < nch; i++) {
            if (i % KDA_BLOCK == 0) F(copy)(ck + (i / KDA_BLOCK) * SZ, S, SZ);
            if (i / KDA_BLOCK == nblk - 1) break;      /* the last block is replayed below anyway */
            int64_t tok = t0 + i * C, c = t1 - tok < C ? t1 - tok : C;
            w->pf_tok = tok + C;
            w->pf_c = i + 1 < nch ? (t1 - tok - C < C ? t1 - tok - C : C) : 0;
            F(prep)(w, q, k, v, g, beta, tok, c, H, h, safe, 0);
            F(chunk_state)(w, S, S, NULL, 0, c);
        }
    }
    for (int64_t b = nblk - 1; b >= 0; b--) {
        int64_t i0 = b * KDA_BLOCK, i1 = i0 + KDA_BLOCK < nch ? i0 + KDA_BLOCK : nch;
        F(copy)(st, ck_in ? ck_in + (b * H + h) * SZ : ck + b * SZ, SZ);
        for (int64_t i = i0; i < i1; i++) {
            int64_t tok = t0 + i * C, c = t1 - tok < C ? t1 - tok : C;
            F(bind)(w, areas + (i - i0) * w->prep_size);
            w->pf_tok = tok + C;
            w->pf_c = i + 1 < i1 ? (t1 - tok - C < C ? t1 - tok - C : C) : 0;
            F(prep)(w, q, k, v, g, beta, tok, c, H, h, safe, 1);
            /* the state after the block's last chunk is not needed: U alone is computed there */
            F(chunk_state)(w, st + (i - i0) * SZ, i + 1 < i1 ? st + (i + 1 - i0) * SZ : S, NULL, 0, c);
        }
        for (int64_t i = i1 - 1; i >= i0; i--) {
            int64_t tok = t0 + i * C, c = t1 - tok < C ? t1 - tok : C;
            F(bind)(w, areas + (i - i0) * w->prep_size);
            /* the next chunk of the reverse sweep: its gradient rows */
            w->pg_tok = tok - C;
            w->pg_c = i > i0 ? C : 0;
            F(chunk_backward)(w, st + (i - i0) * SZ, dS, gout, tok, c, H, h, safe, gq, gk, gv, gg, gbeta);
        }
    }
    F(bind)(w, own);
    w->pf_c = w->pg_c = 0;
    tide_cpu_free(ck);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);     /* the non-temporal stores of copy_out before the result is read */
    return 0;
}

/* the token recurrence (kda.md §3); S in/out */
static void F(segment_recurrent_forward)(T *S, T *o, const T *q, const T *k, const T *v, const T *g, const T *beta,
                                         int64_t t0, int64_t t1, int64_t H, int64_t h, int64_t dk, int64_t dv,
                                         T *kS)
{
    /* the token's decays exp(g_i) first, as one loop that vectorises (the same values as one EXP per row of S
       below; up to KDA_REC_DK of them on the stack, past that per row) */
    enum { KDA_REC_DK = 512 };
    T al[KDA_REC_DK];
    for (int64_t t = t0; t < t1; t++) {
        const T *qt = q + (t * H + h) * dk, *kt = k + (t * H + h) * dk, *gt = g + (t * H + h) * dk;
        const T *vt = v + (t * H + h) * dv;
        T b = beta[t * H + h];
        if (dk <= KDA_REC_DK)
            for (int64_t i = 0; i < dk; i++) al[i] = EXP(gt[i]);
        /* S ← diag(exp(g)) S, and kS = Sᵀ k against the decayed state */
        for (int64_t j = 0; j < dv; j++) kS[j] = 0;
        for (int64_t i = 0; i < dk; i++) {
            T a = dk <= KDA_REC_DK ? al[i] : EXP(gt[i]), ki = kt[i];
            T *s = S + i * dv;
            for (int64_t j = 0; j < dv; j++) { s[j] *= a; kS[j] += ki * s[j]; }
        }
        /* u = β (v − Sᵀk);  S += k uᵀ;  o = Sᵀ q */
        for (int64_t j = 0; j < dv; j++) kS[j] = b * (vt[j] - kS[j]);
        T *ot = o ? o + (t * H + h) * dv : NULL;
        if (ot) for (int64_t j = 0; j < dv; j++) ot[j] = 0;
        for (int64_t i = 0; i < dk; i++) {
            T ki = kt[i], qi = qt[i];
            T *s = S + i * dv;
            if (ot) for (int64_t j = 0; j < dv; j++) { s[j] += ki * kS[j]; ot[j] += qi * s[j]; }
            else for (int64_t j = 0; j < dv; j++) s[j] += ki * kS[j];
        }
    }
}

/* backward of the recurrence for one segment: states every `blk` tokens from a first pass, then per block
   the states before each token, then the tokens in reverse (the per-token gradient is written out in
   kda.md §6's variables: S' = diag(α) S_prev, u = β(v − S'ᵀk), S_t = S' + k uᵀ, o = S_tᵀ q) */
static int F(segment_recurrent_backward)(const T *s_init, T *dS, const T *gout, const T *q, const T *k, const T *v,
                                         const T *g, const T *beta, int64_t t0, int64_t t1, int64_t H, int64_t h,
                                         int64_t dk, int64_t dv, T *gq, T *gk, T *gv, T *gg, T *gbeta)
{
    int64_t n = t1 - t0, SZ = dk * dv;
    int64_t blk = 64;
    while ((n + blk - 1) / blk > 1024) blk *= 2;
    int64_t nblk = (n + blk - 1) / blk;
    T *ck = tide_cpu_malloc((size_t)((nblk + blk + 1) * SZ + 8 * (dk + dv)) * sizeof(T));
    if (!ck) return -1;
    T *st = ck + nblk * SZ, *S = st + blk * SZ, *tmp = S + SZ;
    T *kS = tmp, *u = kS + dv, *du = u + dv, *dkS = du + dv, *dq = dkS + dv, *dk_ = dq + dk, *dg = dk_ + dk, *al = dg + dk;
    if (s_init) F(copy)(S, s_init, SZ);
    else memset(S, 0, (size_t)SZ * sizeof(T));
    for (int64_t b = 0; b < nblk - 1; b++) {
        F(copy)(ck + b * SZ, S, SZ);
        F(segment_recurrent_forward)(S, NULL, q, k, v, g, beta, t0 + b * blk, t0 + (b + 1) * blk, H, h, dk, dv, kS);
    }
    F(copy)(ck + (nblk - 1) * SZ, S, SZ);
    for (int64_t b = nblk - 1; b >= 0; b--) {
        int64_t a0 = t0 + b * blk, a1 = a0 + blk < t1 ? a0 + blk : t1;
        F(copy)(S, ck + b * SZ, SZ);
        for (int64_t t = a0; t < a1; t++) {
            F(copy)(st + (t - a0) * SZ, S, SZ);
            if (t + 1 < a1) F(segment_recurrent_forward)(S, NULL, q, k, v, g, beta, t, t + 1, H, h, dk, dv, kS);
        }
        for (int64_t t = a1 - 1; t >= a0; t--) {
            const T *Sp = st + (t - a0) * SZ;
            const T *qt = q + (t * H + h) * dk, *kt = k + (t * H + h) * dk, *gt = g + (t * H + h) * dk;
            const T *vt = v + (t * H + h) * dv, *dot = gout ? gout + (t * H + h) * dv : NULL;
            T bt = beta[t * H + h];
            for (int64_t i = 0; i < dk; i++) al[i] = EXP(gt[i]);
            for (int64_t j = 0; j < dv; j++) kS[j] = 0;
            for (int64_t i = 0; i < dk; i++) {
                T a = al[i] * kt[i];
                const T *s = Sp + i * dv;
                for (int64_t j = 0; j < dv; j++) kS[j] += a * s[j];
            }
            for (int64_t j = 0; j < dv; j++) { u[j] = bt * (vt[j] - kS[j]); du[j] = 0; }
            /* dS_t += q doᵀ; dq = S_t do; du = dS_tᵀ k; dk = dS_t u */
            for (int64_t i = 0; i < dk; i++) {
                T *d = dS + i * dv;
                const T *s = Sp + i * dv;
                T qi = qt[i], ki = kt[i], ai = al[i], sq = 0, sk = 0;
                if (dot) for (int64_t j = 0; j < dv; j++) d[j] += qi * dot[j];
                _Pragma("omp simd reduction(+ : sq, sk)")
                for (int64_t j = 0; j < dv; j++) {
                    T stij = ai * s[j] + ki * u[j];
                    if (dot) sq += stij * dot[j];
                    du[j] += ki * d[j];
                    sk += d[j] * u[j];
                }
                dq[i] = sq;
                dk_[i] = sk;
            }
            T db = 0;
            _Pragma("omp simd reduction(+ : db)")
            for (int64_t j = 0; j < dv; j++) { db += du[j] * (vt[j] - kS[j]); dkS[j] = -bt * du[j]; }
            /* dS' = dS_t + k dkSᵀ; dk += S' dkS; dg = rowsum(dS' ⊙ S'); dS_prev = diag(α) dS' */
            for (int64_t i = 0; i < dk; i++) {
                T *d = dS + i * dv;
                const T *s = Sp + i * dv;
                T ki = kt[i], ai = al[i], sk = 0, sg = 0;
                _Pragma("omp simd reduction(+ : sk, sg)")
                for (int64_t j = 0; j < dv; j++) {
                    T sd = ai * s[j], dd = d[j] + ki * dkS[j];
                    sk += sd * dkS[j];
                    sg += dd * sd;
                    d[j] = ai * dd;
                }
                dk_[i] += sk;
                dg[i] = sg;
            }
            int64_t rk = (t * H + h) * dk, rv = (t * H + h) * dv;
            if (gq) F(copy)(gq + rk, dq, dk);
            if (gk) F(copy)(gk + rk, dk_, dk);
            if (gg) F(copy)(gg + rk, dg, dk);
            if (gv) for (int64_t j = 0; j < dv; j++) gv[rv + j] = bt * du[j];
            if (gbeta) gbeta[t * H + h] = db;
        }
    }
    tide_cpu_free(ck);
    return 0;
}

/* ---- the entries -------------------------------------------------------------------------------- */
/* work item i = (segment i / H, head i % H); row b of a segment is t0 / T */
/* off[sg] = checkpoints before segment sg (ceil(chunks / KDA_BLOCK) per segment); NULL + nothing when
   there are no checkpoints */
static int64_t *F(ckpt_offsets)(const int64_t *cu, int64_t n_seg, int64_t chunk)
{
    int64_t *off = malloc((size_t)(n_seg + 1) * sizeof *off);
    if (!off) return NULL;
    off[0] = 0;
    for (int64_t sg = 0; sg < n_seg; sg++) {
        int64_t nch = (cu[sg + 1] - cu[sg] + chunk - 1) / chunk;
        off[sg + 1] = off[sg] + (nch + KDA_BLOCK - 1) / KDA_BLOCK;
    }
    return off;
}

/* one decoding step of R rows over their own states (in place): row r's q, k, g [H, dk], v [H, dv], beta [H]; the
   token recurrence of kda_forward's recurrent path on each (row, head), so a row's bits are its step alone */
static int F(kda_decode_rows)(T *o, const T *q, const T *k, const T *v, const T *g, const T *beta, void *const *states,
                              int64_t R, int64_t H, int64_t dk, int64_t dv)
{
    int failed = 0;
    _Pragma("omp parallel if(R * H * dk * dv > TIDE_OMP_MIN)")
    {
        unsigned int csr = kda_flush_denormals();
        T *kS = malloc((size_t)dv * sizeof(T));
        if (!kS) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t it = 0; it < R * H; it++) {
            if (!kS) continue;
            int64_t r = it / H, h = it % H;
            T *S = (T *)states[r] + h * dk * dv;
            F(segment_recurrent_forward)(S, o + r * H * dv, q + r * H * dk, k + r * H * dk, v + r * H * dv,
                                         g + r * H * dk, beta + r * H, 0, 1, H, h, dk, dv, kS);
        }
        free(kS);
        kda_restore_denormals(csr);
    }
    return failed ? tide_set_error("kda_decode_rows: out of memory") : 0;
}

static int F(kda_forward)(T *o, T *s_out, const T *q, const T *k, const T *v, const T *g, const T *beta,
                          const T *s0, const int64_t *cu, int64_t n_seg, int64_t T_, int64_t H, int64_t dk,
                          int64_t dv, int path, int64_t chunk, T *ckpt)
{
    int64_t *off = NULL;
    if (ckpt && path != TIDE_KDA_RECURRENT && !(off = F(ckpt_offsets)(cu, n_seg, chunk)))
        return tide_set_error("kda: out of memory");
    int failed = 0;
    int64_t items = n_seg * H, SZ = dk * dv;
    _Pragma("omp parallel")
    {
        unsigned int csr = kda_flush_denormals();
        F(ws) w;
        int ok = path == TIDE_KDA_RECURRENT ? 1 : F(ws_init)(&w, chunk, dk, dv) == 0;
        T *S = ok ? tide_cpu_malloc((size_t)(SZ + dv) * sizeof(T)) : NULL;
        if (!S) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t it = 0; it < items; it++) {
            if (!S) continue;
            int64_t sg = it / H, h = it % H, t0 = cu[sg], t1 = cu[sg + 1], b = t0 / T_;
            if (t0 == b * T_ && s0) F(copy)(S, s0 + (b * H + h) * SZ, SZ);
            else memset(S, 0, (size_t)SZ * sizeof(T));
            if (path == TIDE_KDA_RECURRENT) F(segment_recurrent_forward)(S, o, q, k, v, g, beta, t0, t1, H, h, dk, dv, S + SZ);
            else F(segment_chunk_forward)(&w, S, o, q, k, v, g, beta, t0, t1, H, h, path == TIDE_KDA_CHUNK_SAFE,
                                          off ? ckpt + off[sg] * H * SZ : NULL);
            if (t1 == (b + 1) * T_ && s_out) F(copy)(s_out + (b * H + h) * SZ, S, SZ);
        }
        tide_cpu_free(S);
        if (path != TIDE_KDA_RECURRENT && ok) tide_cpu_free(w.buf);
        kda_restore_denormals(csr);
    }
    free(off);
    return failed ? tide_set_error("kda: out of memory for the kernel workspace") : 0;
}

static int F(kda_backward)(T *gq, T *gk, T *gv, T *gg, T *gbeta, T *gs0, const T *gout, const T *gs_out,
                           const T *q, const T *k, const T *v, const T *g, const T *beta, const T *s0,
                           const int64_t *cu, int64_t n_seg, int64_t T_, int64_t H, int64_t dk, int64_t dv, int path,
                           int64_t chunk, const T *ckpt)
{
    int64_t *off = NULL;
    if (ckpt && path != TIDE_KDA_RECURRENT && !(off = F(ckpt_offsets)(cu, n_seg, chunk)))
        return tide_set_error("kda backward: out of memory");
    int failed = 0;
    int64_t items = n_seg * H, SZ = dk * dv;
    _Pragma("omp parallel")
    {
        unsigned int csr = kda_flush_denormals();
        F(ws) w;
        int ok = path == TIDE_KDA_RECURRENT ? 1 : F(ws_init)(&w, chunk, dk, dv) == 0;
        T *dS = ok ? tide_cpu_malloc((size_t)SZ * sizeof(T)) : NULL;
        if (!dS) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t it = 0; it < items; it++) {
            if (!dS) continue;
            int64_t sg = it / H, h = it % H, t0 = cu[sg], t1 = cu[sg + 1], b = t0 / T_;
            int first = t0 == b * T_, last = t1 == (b + 1) * T_;
            if (last && gs_out) F(copy)(dS, gs_out + (b * H + h) * SZ, SZ);
            else memset(dS, 0, (size_t)SZ * sizeof(T));
            const T *init = first && s0 ? s0 + (b * H + h) * SZ : NULL;
            int rc = path == TIDE_KDA_RECURRENT
                         ? F(segment_recurrent_backward)(init, dS, gout, q, k, v, g, beta, t0, t1, H, h, dk, dv, gq, gk,
                                                         gv, gg, gbeta)
                         : F(segment_chunk_backward)(&w, init, dS, gout, q, k, v, g, beta, t0, t1, H, h,
                                                     path == TIDE_KDA_CHUNK_SAFE, gq, gk, gv, gg, gbeta,
                                                     off ? ckpt + off[sg] * H * SZ : NULL);
            if (rc) {
                _Pragma("omp atomic write")
                failed = 1;
            }
            if (gs0 && first) F(copy)(gs0 + (b * H + h) * SZ, dS, SZ);
        }
        tide_cpu_free(dS);
        if (path != TIDE_KDA_RECURRENT && ok) tide_cpu_free(w.buf);
        kda_restore_denormals(csr);
    }
    /* rows of s0 whose row has no first segment cannot exist (every row start is a boundary) */
    free(off);
    return failed ? tide_set_error("kda: out of memory for the backward workspace") : 0;
}

#undef F
#undef KCAT
#undef KCAT_
#undef KDA_PREFETCH_ROW
#undef TMM_VL
#undef TMM_NV
#undef TMM_STAGES

/*
 * varlen_impl.h — varlen_attention through BLAS (spec/vision.md §3, §5) for one float type: mla.c includes it
 * after mla_impl.h with T, SFX and EXP defined. Not causal, so a query sees its whole segment and full score
 * rows fit in O(VL_BQ · L) scratch: per (segment, head, block of VL_BQ queries) S = scale · Q Kᵀ [bq, L] is one
 * gemm, the row softmax is exact (max, exp, sum; lse saved as the tiled kernel saves it, [H, T]), O = P V a
 * second gemm. The backward is flash-attention-2's from the saved lse and D = rowsum(dO ∘ O).
 *
 * Operands are read in place: a head's rows of [T, H, D] are a matrix with leading dimension H·D. Every gemm
 * runs single-threaded inside our OpenMP loop (gemm.c: OpenBLAS checks omp_in_parallel()), so a segment's
 * numbers depend only on its own tokens and on block starts counted from the segment start (isolation).
 */
#define KCAT_(a, b) a##_##b
#define KCAT(a, b) KCAT_(a, b)
#define F(name) KCAT(name, SFX)

#ifndef VL_BQ
#define VL_BQ 256      /* queries per block: a [256, L] f32 score block; fewer blocks re-pack K and V fewer times (64: 15% slower) */
#endif

/* row-major C [M, N] = alpha · op(A) op(B) + beta · C; sizes already within the BLAS int range */
static inline void F(vl_gemm)(int ta, int tb, int64_t M, int64_t N, int64_t K, T alpha, const T *A, int64_t lda,
                              const T *B, int64_t ldb, T beta, T *C, int64_t ldc)
{
    enum CBLAS_TRANSPOSE opa = ta ? CblasTrans : CblasNoTrans, opb = tb ? CblasTrans : CblasNoTrans;
    if (sizeof(T) == sizeof(float))
        cblas_sgemm(CblasRowMajor, opa, opb, (int)M, (int)N, (int)K, (float)alpha, (const float *)A, (int)lda,
                    (const float *)B, (int)ldb, (float)beta, (float *)C, (int)ldc);
    else
        cblas_dgemm(CblasRowMajor, opa, opb, (int)M, (int)N, (int)K, (double)alpha, (const double *)A, (int)lda,
                    (const double *)B, (int)ldb, (double)beta, (double *)C, (int)ldc);
}

/* forward of one (segment [s0, s0 + L), head h, query block from i0): S [bq, L] scratch */
static void F(vl_forward_block)(T *out, T *lse, const T *q, const T *k, const T *v, int64_t s0, int64_t L,
                                int64_t i0, int64_t h, int64_t Ttot, int64_t H, int64_t D, double scale, T *S)
{
    int64_t ld = H * D, bq = L - i0 < VL_BQ ? L - i0 : VL_BQ;
    const T *Qb = q + ((s0 + i0) * H + h) * D, *Ks = k + (s0 * H + h) * D, *Vs = v + (s0 * H + h) * D;
    T *Ob = out + ((s0 + i0) * H + h) * D, inv[VL_BQ];
    F(vl_gemm)(0, 1, bq, L, D, (T)scale, Qb, ld, Ks, ld, 0, S, L);
    for (int64_t r = 0; r < bq; r++) {
        T *sr = S + r * L, mx = sr[0], sum = 0;
        /* simd reductions: their order depends on L and the row's alignment, fixed by the 64-byte scratch */
        _Pragma("omp simd reduction(max : mx)")
        for (int64_t j = 1; j < L; j++) mx = sr[j] > mx ? sr[j] : mx;
        _Pragma("omp simd reduction(+ : sum)")
        for (int64_t j = 0; j < L; j++) { sr[j] = EXP(sr[j] - mx); sum += sr[j]; }
        inv[r] = 1 / sum;                                  /* sum >= 1: the maximum contributes exp(0) */
        lse[h * Ttot + s0 + i0 + r] = mx + (T)log((double)sum);
    }
    F(vl_gemm)(0, 0, bq, D, L, 1, S, L, Vs, ld, 0, Ob, ld);    /* unnormalised P V, then each row / sum */
    for (int64_t r = 0; r < bq; r++)
        for (int64_t c = 0; c < D; c++) Ob[r * ld + c] *= inv[r];
}

/* d[r] = Σ_c a_rc b_rc in order (not address-dependent) for the n rows of a and b (row stride ld, D terms): eight
   rows' chains advance together (one row after another, each was a chain of D dependent adds) */
static void F(vl_row_dots)(T *d, const T *a, const T *b, int64_t ld, int64_t n, int64_t D)
{
    int64_t r = 0;
    for (; r + 8 <= n; r += 8) {
        const T *g = a + r * ld, *o = b + r * ld;
        T d0 = 0, d1 = 0, d2 = 0, d3 = 0, d4 = 0, d5 = 0, d6 = 0, d7 = 0;
        for (int64_t c = 0; c < D; c++) {
            d0 += g[c] * o[c];
            d1 += g[ld + c] * o[ld + c];
            d2 += g[2 * ld + c] * o[2 * ld + c];
            d3 += g[3 * ld + c] * o[3 * ld + c];
            d4 += g[4 * ld + c] * o[4 * ld + c];
            d5 += g[5 * ld + c] * o[5 * ld + c];
            d6 += g[6 * ld + c] * o[6 * ld + c];
            d7 += g[7 * ld + c] * o[7 * ld + c];
        }
        d[r] = d0; d[r + 1] = d1; d[r + 2] = d2; d[r + 3] = d3;
        d[r + 4] = d4; d[r + 5] = d5; d[r + 6] = d6; d[r + 7] = d7;
    }
    for (; r < n; r++) {
        T t = 0;
        for (int64_t c = 0; c < D; c++) t += a[r * ld + c] * b[r * ld + c];
        d[r] = t;
    }
}

/* backward of one (segment, head): query blocks in order, this pair owning its dK, dV rows (beta 0 on the
   first block overwrites them); P and dP/dS [bq, L] scratch */
static void F(vl_backward_pair)(T *gq, T *gk, T *gv, const T *gout, const T *q, const T *k, const T *v, const T *out,
                                const T *lse, int64_t s0, int64_t L, int64_t h, int64_t Ttot, int64_t H, int64_t D,
                                double scale, T *P, T *dS)
{
    int64_t ld = H * D, base = (s0 * H + h) * D;
    const T *Ks = k + base, *Vs = v + base;
    for (int64_t i0 = 0; i0 < L; i0 += VL_BQ) {
        int64_t bq = L - i0 < VL_BQ ? L - i0 : VL_BQ, off = i0 * ld;
        const T *Qb = q + base + off, *dOb = gout + base + off, *Ob = out + base + off;
        T beta = i0 == 0 ? 0 : 1;
        F(vl_gemm)(0, 1, bq, L, D, (T)scale, Qb, ld, Ks, ld, 0, P, L);      /* S = scale Q Kᵀ */
        F(vl_gemm)(0, 1, bq, L, D, 1, dOb, ld, Vs, ld, 0, dS, L);          /* dP = dO Vᵀ */
        T Dsum[VL_BQ];
        F(vl_row_dots)(Dsum, dOb, Ob, ld, bq, D);
        for (int64_t r = 0; r < bq; r++) {
            T ls = lse[h * Ttot + s0 + i0 + r], Dr = Dsum[r], *pr = P + r * L, *dr = dS + r * L;
            _Pragma("omp simd")
            for (int64_t j = 0; j < L; j++) {
                T p = EXP(pr[j] - ls);
                pr[j] = p;
                dr[j] = p * (dr[j] - Dr);                  /* dS = P ∘ (dP − D); scale goes into the gemms */
            }
        }
        if (gv) F(vl_gemm)(1, 0, L, D, bq, 1, P, L, dOb, ld, beta, gv + base, ld);              /* dV += Pᵀ dO */
        if (gk) F(vl_gemm)(1, 0, L, D, bq, (T)scale, dS, L, Qb, ld, beta, gk + base, ld);       /* dK += scale dSᵀ Q */
        if (gq) F(vl_gemm)(0, 0, bq, D, L, (T)scale, dS, L, Ks, ld, 0, gq + base + off, ld);    /* dQ = scale dS K */
    }
}

/* n values aligned to 64 bytes, so the vectorised row loops split a row the same way whatever the address */
static T *F(vl_scratch)(int64_t n)
{
    size_t bytes = ((size_t)(n > 0 ? n : 1) * sizeof(T) + 63) / 64 * 64;
    return aligned_alloc(64, bytes);
}

/* order: the non-empty segments, longest first (the longest pairs start first under the dynamic schedule);
   Lmax: the longest segment */
static int F(vl_forward)(T *out, T *lse, const T *q, const T *k, const T *v, const int64_t *cu, const int64_t *order,
                         int64_t n_order, int64_t Lmax, int64_t Ttot, int64_t H, int64_t D, double scale)
{
    /* blocks of the ordered segments, each for every head: item = block · H + h */
    int64_t nblk = 0;
    for (int64_t o = 0; o < n_order; o++) nblk += (cu[order[o] + 1] - cu[order[o]] + VL_BQ - 1) / VL_BQ;
    int64_t *blk = malloc((size_t)(nblk > 0 ? nblk : 1) * 2 * sizeof *blk);
    if (!blk) return tide_set_error("varlen_attention: out of memory for %lld query blocks", (long long)nblk);
    for (int64_t o = 0, b = 0; o < n_order; o++)
        for (int64_t i0 = 0; i0 < cu[order[o] + 1] - cu[order[o]]; i0 += VL_BQ, b++) {
            blk[2 * b] = order[o];
            blk[2 * b + 1] = i0;
        }
    int failed = 0;
    _Pragma("omp parallel")
    {
        T *S = F(vl_scratch)(VL_BQ * Lmax);
        if (!S) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t it = 0; it < nblk * H; it++) {
            if (!S) continue;
            int64_t b = it / H, g = blk[2 * b];
            F(vl_forward_block)(out, lse, q, k, v, cu[g], cu[g + 1] - cu[g], blk[2 * b + 1], it % H, Ttot, H, D,
                                scale, S);
        }
        free(S);
    }
    free(blk);
    return failed ? tide_set_error("varlen_attention: out of memory for the [%d, %lld] score blocks", VL_BQ,
                                   (long long)Lmax)
                  : 0;
}

static int F(vl_backward)(T *gq, T *gk, T *gv, const T *gout, const T *q, const T *k, const T *v, const T *out,
                          const T *lse, const int64_t *cu, const int64_t *order, int64_t n_order, int64_t Lmax,
                          int64_t Ttot, int64_t H, int64_t D, double scale)
{
    int failed = 0;
    _Pragma("omp parallel")
    {
        T *P = F(vl_scratch)(2 * VL_BQ * Lmax);
        if (!P) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t it = 0; it < n_order * H; it++) {
            if (!P) continue;
            int64_t g = order[it / H];
            F(vl_backward_pair)(gq, gk, gv, gout, q, k, v, out, lse, cu[g], cu[g + 1] - cu[g], it % H, Ttot, H, D,
                                scale, P, P + VL_BQ * Lmax);
        }
        free(P);
    }
    return failed ? tide_set_error("varlen_attention backward: out of memory for the [%d, %lld] score blocks",
                                   VL_BQ, (long long)Lmax)
                  : 0;
}

#undef F
#undef KCAT
#undef KCAT_

/*
 * mla_impl.h — the body of the MLA attention CPU kernels for one float type (mla.c includes it with
 * T = float / double). Math: spec/mla.md §1 (score with the unrotated rope slot), §4 (flash backward),
 * §5 (document-causal mask); with seg_end given, the same kernels run bidirectional inside each segment
 * (spec/vision.md §3, §5: varlen_attention).
 *
 * Per (row b, head h) the keys are [k_n^h | k_r] (dn + dr values, k_r shared by the heads) and the scores
 * are built tile by tile: a tile of BQ queries against a tile of BK keys, with a running max and sum per
 * query (online softmax), so no [Tq, Tk] buffer exists. Masked scores are SELECTED to −inf.
 */
#define KCAT_(a, b) a##_##b
#define KCAT(a, b) KCAT_(a, b)
#define F(name) KCAT(name, SFX)

#include "tile_mm.h"

#ifndef MLA_BQ
#define MLA_BQ 64      /* queries per tile */
#define MLA_BK 64      /* keys per tile */
#endif

/* the visible key range [lo, hi] of query i (0-based in its row): causal, query i on key i + off (off = Tk − Tq:
   the last query on the last key; a chunk of the keys starting at k0: Tk − Tq − k0), and within i's segment when
   seg_start is given (its key index, flattened as b·Tq + j); with seg_end (the flattened end of i's segment; only
   with seg_start) not causal: every key of the segment */
static inline void F(key_range)(const int64_t *seg_start, const int64_t *seg_end, int64_t b, int64_t i, int64_t Tq,
                                int64_t off, int64_t *lo, int64_t *hi)
{
    *hi = seg_end ? seg_end[b * Tq + i] - b * Tq - 1 : i + off;
    *lo = seg_start ? seg_start[b * Tq + i] - b * Tq : 0;
}

/* K tile rows [j0, j0 + bk) of head h as Kt [bk, dn + dr] (row-major) */
static void F(load_k)(T *Kt, const T *kn, const T *kr, int64_t b, int64_t h, int64_t j0, int64_t bk, int64_t Tk,
                      int64_t H, int64_t dn, int64_t dr)
{
    int64_t dqk = dn + dr;
    for (int64_t jj = 0; jj < bk; jj++) {
        int64_t j = b * Tk + j0 + jj;
        F(copy)(Kt + jj * dqk, kn + (j * H + h) * dn, dn);
        if (dr) F(copy)(Kt + jj * dqk + dn, kr + j * dr, dr);
    }
}

/* S [bq, BK] ← scale · Q Kᵀ with every score outside a query's key range selected to −inf */
static void F(scores)(T *S, const T *Qt, const T *KT, int64_t bq, int64_t bk, int64_t dqk, double scale,
                      const int64_t *lo, const int64_t *hi, int64_t j0)
{
    F(mm)(S, MLA_BK, Qt, dqk, 1, KT, bk, bq, bk, dqk, (T)scale, 0);
    for (int64_t r = 0; r < bq; r++) {          /* the visible columns [a, e) of the row; the rest −inf */
        int64_t a = lo[r] - j0, e = hi[r] - j0 + 1;
        a = a < 0 ? 0 : a > bk ? bk : a;
        e = e < a ? a : e > bk ? bk : e;
        T *sr = S + r * MLA_BK;
        for (int64_t jj = 0; jj < a; jj++) sr[jj] = (T)-INFINITY;
        for (int64_t jj = e; jj < bk; jj++) sr[jj] = (T)-INFINITY;
    }
}

/* sum[r] = S[r][0] + S[r][1] + ... + S[r][n - 1] for the n rows of S (row stride ld), each in sequence (the order of
   the online softmax's l). Summed one row at a time, the sequence is a chain of dependent adds (GCC vectorised the
   loop with the exps and then added the lanes one by one); eight rows' chains advance together here, so they
   overlap, and each row's sum is the same as alone. */
static void F(row_sums)(T *sum, const T *S, int64_t ld, int64_t n, int64_t bk)
{
    int64_t r = 0;
    for (; r + 8 <= n; r += 8) {
        const T *p = S + r * ld;
        T s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
        for (int64_t j = 0; j < bk; j++) {
            s0 += p[j];
            s1 += p[ld + j];
            s2 += p[2 * ld + j];
            s3 += p[3 * ld + j];
            s4 += p[4 * ld + j];
            s5 += p[5 * ld + j];
            s6 += p[6 * ld + j];
            s7 += p[7 * ld + j];
        }
        sum[r] = s0; sum[r + 1] = s1; sum[r + 2] = s2; sum[r + 3] = s3;
        sum[r + 4] = s4; sum[r + 5] = s5; sum[r + 6] = s6; sum[r + 7] = s7;
    }
    for (; r < n; r++) {
        T s = 0;
        for (int64_t j = 0; j < bk; j++) s += S[r * ld + j];
        sum[r] = s;
    }
}

/* forward of one (row, head, query tile) */
static void F(forward_tile)(T *out, T *lse, const T *q, const T *kn, const T *kr, const T *v, const int64_t *seg_start,
                            const int64_t *seg_end, int64_t b, int64_t h, int64_t i0, int64_t Tq, int64_t Tk, int64_t H,
                            int64_t dn, int64_t dr, int64_t dv, int64_t off, double scale, T *buf)
{
    int64_t dqk = dn + dr, bq = Tq - i0 < MLA_BQ ? Tq - i0 : MLA_BQ;
    T *Qt = buf, *Kt = Qt + MLA_BQ * dqk, *KT = Kt + MLA_BK * dqk, *Vt = KT + MLA_BK * dqk, *S = Vt + MLA_BK * dv;
    T *O = S + MLA_BQ * MLA_BK, *m = O + MLA_BQ * dv, *l = m + MLA_BQ;
    int64_t lo[MLA_BQ], hi[MLA_BQ], kmin = INT64_MAX, kmax = -1;
    for (int64_t r = 0; r < bq; r++) {
        F(copy)(Qt + r * dqk, q + ((b * Tq + i0 + r) * H + h) * dqk, dqk);
        F(key_range)(seg_start, seg_end, b, i0 + r, Tq, off, &lo[r], &hi[r]);
        if (hi[r] > Tk - 1) hi[r] = Tk - 1;
        if (lo[r] < kmin) kmin = lo[r];
        if (hi[r] > kmax) kmax = hi[r];
        m[r] = (T)-INFINITY;
        l[r] = 0;
        for (int64_t c = 0; c < dv; c++) O[r * dv + c] = 0;
    }
    for (int64_t j0 = kmin; j0 <= kmax; j0 += MLA_BK) {
        int64_t bk = kmax + 1 - j0 < MLA_BK ? kmax + 1 - j0 : MLA_BK;
        /* Kᵀ straight from k_n's and k_r's rows (no row-major copy first); V is read in place below */
        F(transpose_ld)(KT, bk, kn + ((b * Tk + j0) * H + h) * dn, bk, dn, H * dn);
        if (dr) F(transpose_ld)(KT + dn * bk, bk, kr + (b * Tk + j0) * dr, bk, dr, dr);
        F(scores)(S, Qt, KT, bq, bk, dqk, scale, lo, hi, j0);
        T alpha[MLA_BQ], sum[MLA_BQ];
        for (int64_t r = 0; r < bq; r++) {
            T *sr = S + r * MLA_BK, mx = F(max)(sr, bk, m[r]);   /* fastmath.h: the sequential max, in vector lanes */
            if (mx == (T)-INFINITY) {                    /* nothing visible in this tile yet: l and m stay */
                for (int64_t jj = 0; jj < bk; jj++) sr[jj] = 0;
                alpha[r] = (T)-INFINITY;
                continue;
            }
            alpha[r] = m[r] == (T)-INFINITY ? 0 : EXP(m[r] - mx);
            for (int64_t jj = 0; jj < bk; jj++) sr[jj] = EXP(sr[jj] - mx);
            m[r] = mx;
            for (int64_t c = 0; c < dv; c++) O[r * dv + c] *= alpha[r];
        }
        F(row_sums)(sum, S, MLA_BK, bq, bk);
        for (int64_t r = 0; r < bq; r++)
            if (alpha[r] != (T)-INFINITY) l[r] = l[r] * alpha[r] + sum[r];
        F(mm)(O, dv, S, MLA_BK, 1, v + ((b * Tk + j0) * H + h) * dv, H * dv, bq, dv, bk, 1, 1);
    }
    for (int64_t r = 0; r < bq; r++) {
        T *o = out + ((b * Tq + i0 + r) * H + h) * dv;
        T inv = l[r] > 0 ? 1 / l[r] : 0;
        for (int64_t c = 0; c < dv; c++) o[c] = O[r * dv + c] * inv;
        lse[(b * H + h) * Tq + i0 + r] = l[r] > 0 ? m[r] + (T)log((double)l[r]) : (T)-INFINITY;
    }
}

static int64_t F(tile_buf)(int64_t dn, int64_t dr, int64_t dv)
{
    int64_t dqk = dn + dr;
    return MLA_BQ * dqk + 2 * MLA_BK * dqk + MLA_BK * dv + MLA_BQ * MLA_BK + MLA_BQ * dv + 2 * MLA_BQ;
}

static int F(forward)(T *out, T *lse, const T *q, const T *kn, const T *kr, const T *v, const int64_t *seg_start,
                      const int64_t *seg_end, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr,
                      int64_t dv, int64_t off, double scale)
{
    int64_t nqt = (Tq + MLA_BQ - 1) / MLA_BQ, items = B * H * nqt;
    int failed = 0;
    _Pragma("omp parallel")
    {
        T *buf = malloc((size_t)F(tile_buf)(dn, dr, dv) * sizeof(T));
        if (!buf) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t it = 0; it < items; it++) {
            if (!buf) continue;
            int64_t t = it % nqt, bh = it / nqt;
            F(forward_tile)(out, lse, q, kn, kr, v, seg_start, seg_end, bh / H, bh % H, t * MLA_BQ, Tq, Tk, H, dn, dr,
                            dv, off, scale, buf);
        }
        free(buf);
    }
    return failed ? tide_set_error("%s: out of memory for the tile buffers",
                                   seg_end ? "varlen_attention" : "mla_attention")
                  : 0;
}

/* backward of one (row, head): key tiles outer, the query tiles that see them inner (mla.md §4);
   gq rows of this head accumulate in place, gkn / gv rows are written per key tile, the k_r gradient goes
   to this head's slice of gkr_h [H, B·Tk, dr] (summed over heads by the caller) */
static void F(backward_bh)(T *gq, T *gkn, T *gkr_h, T *gv, const T *gout, const T *q, const T *kn, const T *kr,
                           const T *v, const T *lse, const T *Dsum, const int64_t *seg_start, const int64_t *seg_end,
                           int64_t b, int64_t h, int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv,
                           int64_t off, double scale, T *buf)
{
    int64_t dqk = dn + dr;
    T *Qt = buf, *dOt = Qt + MLA_BQ * dqk, *Kt = dOt + MLA_BQ * dv, *KT = Kt + MLA_BK * dqk, *VT = KT + MLA_BK * dqk;
    T *Vt = VT + MLA_BK * dv, *S = Vt + MLA_BK * dv, *dP = S + MLA_BQ * MLA_BK, *dKt = dP + MLA_BQ * MLA_BK;
    T *dVt = dKt + MLA_BK * dqk;
    T *gq_h = gq ? gq + (b * Tq * H + h) * dqk : NULL;
    if (gq_h)
        for (int64_t i = 0; i < Tq; i++)
            for (int64_t c = 0; c < dqk; c++) gq_h[i * H * dqk + c] = 0;
    for (int64_t j0 = 0; j0 < Tk; j0 += MLA_BK) {
        int64_t bk = Tk - j0 < MLA_BK ? Tk - j0 : MLA_BK;
        F(load_k)(Kt, kn, kr, b, h, j0, bk, Tk, H, dn, dr);
        F(transpose)(KT, Kt, bk, dqk, dqk);
        for (int64_t jj = 0; jj < bk; jj++) F(copy)(Vt + jj * dv, v + ((b * Tk + j0 + jj) * H + h) * dv, dv);
        F(transpose)(VT, Vt, bk, dv, dv);
        for (int64_t x = 0; x < bk * dqk; x++) dKt[x] = 0;
        for (int64_t x = 0; x < bk * dv; x++) dVt[x] = 0;
        /* the first query that can see key j0: causal, the key's own position; bidirectional, its segment start */
        int64_t istart = seg_end ? seg_start[b * Tk + j0] - b * Tk : j0 - off > 0 ? j0 - off : 0;
        for (int64_t i0 = istart - istart % MLA_BQ; i0 < Tq; i0 += MLA_BQ) {
            int64_t bq = Tq - i0 < MLA_BQ ? Tq - i0 : MLA_BQ, lo[MLA_BQ], hi[MLA_BQ];
            for (int64_t r = 0; r < bq; r++) F(key_range)(seg_start, seg_end, b, i0 + r, Tq, off, &lo[r], &hi[r]);
            if (lo[0] > j0 + bk - 1) break;              /* lo is non-decreasing: no later query sees the tile */
            for (int64_t r = 0; r < bq; r++) {
                int64_t row = (b * Tq + i0 + r) * H + h;
                F(copy)(Qt + r * dqk, q + row * dqk, dqk);
                F(copy)(dOt + r * dv, gout + row * dv, dv);
            }
            F(scores)(S, Qt, KT, bq, bk, dqk, scale, lo, hi, j0);
            /* P = exp(S − lse) (0 where masked or the query sees nothing); dP = dO Vᵀ; dS = P (dP − D) scale */
            F(mm)(dP, MLA_BK, dOt, dv, 1, VT, bk, bq, bk, dv, 1, 0);
            for (int64_t r = 0; r < bq; r++) {
                T ls = lse[(b * H + h) * Tq + i0 + r], Dr = Dsum[i0 + r];
                T *sr = S + r * MLA_BK, *pr = dP + r * MLA_BK;
                for (int64_t jj = 0; jj < bk; jj++) {
                    T p = ls == (T)-INFINITY ? 0 : EXP(sr[jj] - ls);
                    sr[jj] = p;
                    pr[jj] = p * (pr[jj] - Dr) * (T)scale;
                }
            }
            F(mm)(dVt, dv, S, 1, MLA_BK, dOt, dv, bk, dv, bq, 1, 1);      /* dV += Pᵀ dO */
            F(mm)(dKt, dqk, dP, 1, MLA_BK, Qt, dqk, bk, dqk, bq, 1, 1);   /* dK += dSᵀ Q */
            if (gq_h) F(mm)(gq_h + i0 * H * dqk, H * dqk, dP, MLA_BK, 1, Kt, dqk, bq, dqk, bk, 1, 1);   /* dQ += dS K */
        }
        for (int64_t jj = 0; jj < bk; jj++) {
            int64_t j = b * Tk + j0 + jj;
            if (gkn) F(copy)(gkn + (j * H + h) * dn, dKt + jj * dqk, dn);
            if (gkr_h && dr) F(copy)(gkr_h + j * dr, dKt + jj * dqk + dn, dr);
            if (gv) F(copy)(gv + (j * H + h) * dv, dVt + jj * dv, dv);
        }
    }
}

static int F(backward)(T *gq, T *gkn, T *gkr, T *gv, const T *gout, const T *q, const T *kn, const T *kr, const T *v,
                       const T *out, const T *lse, const int64_t *seg_start, const int64_t *seg_end, int64_t B,
                       int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t off, double scale)
{
    int64_t dqk = dn + dr, items = B * H;
    /* D_i = Σ dO_i O_i per (row, head, query); the per-head k_r gradients, reduced over heads in order below */
    T *Dsum = malloc((size_t)(B * H * Tq) * sizeof(T));
    T *gkr_h = gkr && dr ? malloc((size_t)(H * B * Tk * dr) * sizeof(T)) : NULL;
    if (!Dsum || (gkr && dr && !gkr_h)) {
        free(Dsum);
        free(gkr_h);
        return tide_set_error("%s backward: out of memory", seg_end ? "varlen_attention" : "mla_attention");
    }
    int failed = 0;
    _Pragma("omp parallel")
    {
        _Pragma("omp for")
        for (int64_t x = 0; x < B * Tq * H; x++) {
            const T *g = gout + x * dv, *o = out + x * dv;
            T s = 0;
            _Pragma("omp simd reduction(+ : s)")
            for (int64_t c = 0; c < dv; c++) s += g[c] * o[c];
            int64_t h = x % H, bt = x / H;
            Dsum[(bt / Tq * H + h) * Tq + bt % Tq] = s;
        }
        int64_t bufn = 2 * MLA_BQ * (dqk + dv) + 2 * MLA_BK * dqk + 2 * MLA_BK * dv + 2 * MLA_BQ * MLA_BK + MLA_BK * (dqk + dv);
        T *buf = malloc((size_t)bufn * sizeof(T));
        if (!buf) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t it = 0; it < items; it++) {
            if (!buf) continue;
            int64_t b = it / H, h = it % H;
            F(backward_bh)(gq, gkn, gkr_h ? gkr_h + h * B * Tk * dr : NULL, gv, gout, q, kn, kr, v, lse,
                           Dsum + (b * H + h) * Tq, seg_start, seg_end, b, h, Tq, Tk, H, dn, dr, dv, off, scale, buf);
        }
        free(buf);
        if (gkr_h) {
            _Pragma("omp for")
            for (int64_t x = 0; x < B * Tk * dr; x++) {
                T s = 0;
                for (int64_t h = 0; h < H; h++) s += gkr_h[h * B * Tk * dr + x];
                gkr[x] = s;
            }
        }
    }
    free(Dsum);
    free(gkr_h);
    return failed ? tide_set_error("%s backward: out of memory for the tile buffers",
                                   seg_end ? "varlen_attention" : "mla_attention")
                  : 0;
}

#undef F
#undef KCAT
#undef KCAT_
#undef TMM_VL
#undef TMM_NV
#undef TMM_STAGES

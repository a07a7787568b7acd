/*
 * mla_decode_impl.h — one absorbed MLA decoding step of R rows over their own latent caches (kernels/backend.h:
 * mla_decode_rows; spec/mla.md §6), instantiated by mla.c for T = float / double with EXP. Each (row, group of up
 * to 4 heads) is one task that reads each cached token once for the group; a head's scores, softmax and weighted
 * sum of latents run over its row's own cached tokens in a fixed order
 * (tokens in sequence, the latent dims in fixed lanes), so a row's result does not depend on R or on the other
 * rows. No BLAS: a BLAS product picks its blocking from the sizes, which would tie a row's bits to its length's
 * neighbours. Two consecutive rows that are consecutive queries over one buffer (an exact prefill's) run as one
 * task on the packed float path, each cached token loaded once for both; every value is still computed as for
 * the row alone.
 */
#define DCAT_(a, b) a##_##b
#define DCAT(a, b) DCAT_(a, b)

/* the score of one cached token: [q1 | q2] · [c_t | k_t] over dc + dr values, element i of each part into lane
   i mod 8 in sequence (the last partial block of each part zero-padded), then a fixed pairwise sum of the lanes
   (decode_sum8) */
typedef T DCAT(dvec8, SFX) __attribute__((vector_size(8 * sizeof(T))));

static inline void DCAT(decode_acc, SFX)(DCAT(dvec8, SFX) *acc, const T *q, const T *x, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        DCAT(dvec8, SFX) a, b;
        memcpy(&a, q + i, sizeof a);
        memcpy(&b, x + i, sizeof b);
        *acc += a * b;
    }
    if (i < n) {
        DCAT(dvec8, SFX) a = {0}, b = {0};
        memcpy(&a, q + i, (size_t)(n - i) * sizeof(T));
        memcpy(&b, x + i, (size_t)(n - i) * sizeof(T));
        *acc += a * b;
    }
}

/* acc[0..3] += p x[0..31] */
static inline void DCAT(decode_axpy32, SFX)(DCAT(dvec8, SFX) *acc, T p, const T *x)
{
    for (int v = 0; v < 4; v++) {
        DCAT(dvec8, SFX) xv;
        memcpy(&xv, x + 8 * v, sizeof xv);
        acc[v] += p * xv;
    }
}

/* acc[j] += the 8-lane products of q with row j of x [8, w] (w a multiple of 8), block by block: decode_acc's order
   for each row, the 8 rows' chains advanced together */
static inline void DCAT(decode_acc8, SFX)(DCAT(dvec8, SFX) *acc, const T *q, const T *x, int64_t w)
{
    for (int64_t i = 0; i < w; i += 8) {
        DCAT(dvec8, SFX) a;
        memcpy(&a, q + i, sizeof a);
        for (int j = 0; j < 8; j++) {
            DCAT(dvec8, SFX) b;
            memcpy(&b, x + j * w + i, sizeof b);
            acc[j] += a * b;
        }
    }
}

/* r[i] = the sum of acc[i]'s 8 lanes by one fixed tree, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); for floats
   under AVX the 8 sums at once (two rounds of pairwise adds, then the halves), the same tree */
static inline void DCAT(decode_sum8, SFX)(const DCAT(dvec8, SFX) *acc, T *r)
{
#if defined(__AVX__)
    if (sizeof(T) == sizeof(float)) {
        __m256 a[8];
        for (int i = 0; i < 8; i++) memcpy(&a[i], &acc[i], sizeof a[i]);
        __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
        __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
        __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
        __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
        memcpy(r, &sum, sizeof sum);
        return;
    }
#endif
    T l[8][8];
    memcpy(l, acc, sizeof l);
    for (int i = 0; i < 8; i++)
        r[i] = ((l[i][0] + l[i][1]) + (l[i][2] + l[i][3])) + ((l[i][4] + l[i][5]) + (l[i][6] + l[i][7]));
}

/* the scores of tokens t0 .. t0 + n - 1 (n <= 8): each token's 8 lanes (decode_acc's order: element i into lane
   i mod 8 in sequence, the parts one after the other), the 8 tokens' accumulators advanced together block by block
   so their chains overlap; then the same tree for every token (decode_sum8) */
static inline void DCAT(decode_scores8, SFX)(T *s, const T *q1, const T *c, int64_t dc, const T *q2, const T *k,
                                             int64_t dr, int64_t t0, int n)
{
    DCAT(dvec8, SFX) acc[8] = {{0}};
    if (n == 8 && dc % 8 == 0 && dr % 8 == 0) {
        DCAT(decode_acc8, SFX)(acc, q1, c + t0 * dc, dc);
        if (dr) DCAT(decode_acc8, SFX)(acc, q2, k + t0 * dr, dr);
    } else {
        for (int j = 0; j < n; j++) {
            DCAT(decode_acc, SFX)(&acc[j], q1, c + (t0 + j) * dc, dc);
            if (dr) DCAT(decode_acc, SFX)(&acc[j], q2, k + (t0 + j) * dr, dr);
        }
    }
    T r[8];
    DCAT(decode_sum8, SFX)(acc, r);
    memcpy(s + t0, r, (size_t)n * sizeof(T));
}

/* acc[hh] = Σ_t p_hh,t x_t over a full block of 32 latent dims (x_t = c + t·dc + j0) for NH heads at once, tokens in
   sequence: the generic loop's sums in its order, with NH a constant at each call so the accumulators stay in
   registers (the generic loop's acc[HG][4], indexed by a runtime head count, lives on the stack) */
static inline __attribute__((always_inline)) void DCAT(decode_wsum32, SFX)(DCAT(dvec8, SFX) (*acc)[4], const T *s,
                                                                          int64_t stride, const T *c, int64_t dc,
                                                                          int64_t j0, int64_t L, const int NH)
{
    DCAT(dvec8, SFX) a[4][4];
    memset(a, 0, sizeof a);
    for (int64_t t = 0; t < L; t++) {
        const T *x = c + t * dc + j0;
        DCAT(dvec8, SFX) xv[4];
        _Pragma("GCC unroll 4")
        for (int v = 0; v < 4; v++) memcpy(&xv[v], x + 8 * v, sizeof xv[v]);
        _Pragma("GCC unroll 4")
        for (int hh = 0; hh < NH; hh++) {
            T p = s[hh * stride + t];
            _Pragma("GCC unroll 4")
            for (int v = 0; v < 4; v++) a[hh][v] += p * xv[v];
        }
    }
    memcpy(acc, a, (size_t)NH * sizeof a[0]);
}

/* decode_scores8 of a full block of 8 tokens with dc, dr multiples of 8: the same sums, its accumulators never
   indexed at run time (so they stay in registers) */
static inline void DCAT(decode_scores8_full, SFX)(T *s, const T *q1, const T *c, int64_t dc, const T *q2, const T *k,
                                                  int64_t dr, int64_t t0)
{
    DCAT(dvec8, SFX) acc[8] = {{0}};
    DCAT(decode_acc8, SFX)(acc, q1, c + t0 * dc, dc);
    if (dr) DCAT(decode_acc8, SFX)(acc, q2, k + t0 * dr, dr);
    DCAT(decode_sum8, SFX)(acc, s + t0);
}

/* decode_acc8 for two heads at once, each token's row of x loaded once for both: acc0 and acc1 advance exactly as
   two decode_acc8 calls would advance them */
static inline void DCAT(decode_acc8x2, SFX)(DCAT(dvec8, SFX) *acc0, DCAT(dvec8, SFX) *acc1, const T *q0, const T *q1,
                                            const T *x, int64_t w)
{
    for (int64_t i = 0; i < w; i += 8) {
        DCAT(dvec8, SFX) a0, a1;
        memcpy(&a0, q0 + i, sizeof a0);
        memcpy(&a1, q1 + i, sizeof a1);
        for (int j = 0; j < 8; j++) {
            DCAT(dvec8, SFX) b;
            memcpy(&b, x + j * w + i, sizeof b);
            acc0[j] += a0 * b;
            acc1[j] += a1 * b;
        }
    }
}

/* decode_scores8_full for two heads (query rows qa, qb; scores into sa, sb): the same bits for each */
static inline void DCAT(decode_scores8_full2, SFX)(T *sa, T *sb, const T *q1a, const T *q1b, const T *c, int64_t dc,
                                                   const T *q2a, const T *q2b, const T *k, int64_t dr, int64_t t0)
{
    DCAT(dvec8, SFX) acc0[8] = {{0}}, acc1[8] = {{0}};
    DCAT(decode_acc8x2, SFX)(acc0, acc1, q1a, q1b, c + t0 * dc, dc);
    if (dr) DCAT(decode_acc8x2, SFX)(acc0, acc1, q2a, q2b, k + t0 * dr, dr);
    DCAT(decode_sum8, SFX)(acc0, sa + t0);
    DCAT(decode_sum8, SFX)(acc1, sb + t0);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(TIDE_DECODE_ZMM)
/* float under AVX-512: two heads in one 16-lane register, head a's 8 lanes in the low half and head b's in the high
   half; every lane runs the same fused multiply-adds in the same order as the 8-lane code above, so the bits are the
   same, at half the instructions */
#define TIDE_DECODE_ZMM 1
enum { DZ_MAXB = 64 };   /* the packed path's most 8-value blocks of [q1 | q2]: dc + dr <= 512 */

/* whether a float type's rows take the packed path: dc and dr multiples of 8, at most DZ_MAXB blocks */
static inline int dz_packed(size_t tsize, int64_t dc, int64_t dr)
{
    return tsize == sizeof(float) && dc % 8 == 0 && dr % 8 == 0 && (dc + dr) / 8 <= DZ_MAXB;
}

/* _mm256_hadd_ps on each 256-bit half: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] in every 128-bit lane */
static inline __m512 dz_hadd(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* decode_scores8_full2 of a full block of 8 tokens from t0: qp[i] = [q_a block i | q_b block i] over the dc / 8
   latent blocks then the dr / 8 rope blocks; each token's block is broadcast to both halves. Lane l of a half is
   decode_acc8's chain, and the lanes fold by decode_sum8's tree (the pairwise adds, then the 128-bit halves) */
static inline void dz_scores8(float *sa, float *sb, const __m512 *qp, const float *c, int64_t dc, const float *k,
                              int64_t dr, int64_t t0)
{
    __m512 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dc / 8; i++) {
        __m512 q = qp[i];
        const float *x = c + t0 * dc + 8 * i;
        _Pragma("GCC unroll 8")
        for (int j = 0; j < 8; j++) acc[j] = _mm512_fmadd_ps(q, _mm512_broadcast_f32x8(_mm256_loadu_ps(x + j * dc)), acc[j]);
    }
    for (int64_t i = 0; i < dr / 8; i++) {
        __m512 q = qp[dc / 8 + i];
        const float *x = k + t0 * dr + 8 * i;
        _Pragma("GCC unroll 8")
        for (int j = 0; j < 8; j++) acc[j] = _mm512_fmadd_ps(q, _mm512_broadcast_f32x8(_mm256_loadu_ps(x + j * dr)), acc[j]);
    }
    __m512 u0 = dz_hadd(dz_hadd(acc[0], acc[1]), dz_hadd(acc[2], acc[3]));
    __m512 u1 = dz_hadd(dz_hadd(acc[4], acc[5]), dz_hadd(acc[6], acc[7]));
    /* u0: tokens 0-3 as [a lanes 0-3 | a lanes 4-7 | b lanes 0-3 | b lanes 4-7], u1 tokens 4-7 */
    __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
    sum = _mm512_shuffle_f32x4(sum, sum, _MM_SHUFFLE(3, 1, 2, 0));   /* [a 0-3 | a 4-7 | b 0-3 | b 4-7] */
    _mm256_storeu_ps(sa + t0, _mm512_castps512_ps256(sum));
    _mm256_storeu_ps(sb + t0, _mm512_extractf32x8_ps(sum, 1));
}

/* a[hh] += Σ_t p_hh,t x_t for tokens t0 .. t1 - 1 in sequence over a full block of 32 latent dims, 16-lane registers
   (x_t = c + t·dc + j0, p_hh,t = s[hh·stride + t]): decode_wsum32's sums in its order */
static inline __attribute__((always_inline)) void dz_wsum_run(__m512 (*a)[2], const float *s, int64_t stride,
                                                              const float *c, int64_t dc, int64_t j0, int64_t t0,
                                                              int64_t t1, const int NH)
{
    for (int64_t t = t0; t < t1; t++) {
        const float *x = c + t * dc + j0;
        __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        _Pragma("GCC unroll 4")
        for (int hh = 0; hh < NH; hh++) {
            __m512 p = _mm512_set1_ps(s[hh * stride + t]);
            a[hh][0] = _mm512_fmadd_ps(p, x0, a[hh][0]);
            a[hh][1] = _mm512_fmadd_ps(p, x1, a[hh][1]);
        }
    }
}

static inline __attribute__((always_inline)) void dz_wsum_store(float *acc, __m512 (*a)[2], const int NH)
{
    for (int hh = 0; hh < NH; hh++) {
        _mm512_storeu_ps(acc + 32 * hh, a[hh][0]);
        _mm512_storeu_ps(acc + 32 * hh + 16, a[hh][1]);
    }
}

/* decode_wsum32 in 16-lane registers: the same sums in the same order */
static inline __attribute__((always_inline)) void dz_wsum32(float *acc, const float *s, int64_t stride,
                                                            const float *c, int64_t dc, int64_t j0, int64_t L,
                                                            const int NH)
{
    __m512 a[4][2];
    for (int hh = 0; hh < 4; hh++) a[hh][0] = a[hh][1] = _mm512_setzero_ps();
    dz_wsum_run(a, s, stride, c, dc, j0, 0, L, NH);
    dz_wsum_store(acc, a, NH);
}
/* dz_scores8 for two query rows a and b over the same cached tokens (the queries of one row's buffer in an exact
   prefill): each token's block is loaded once for both; each row's accumulators advance exactly as in dz_scores8 */
static inline void dz_scores8x2(float *sa0, float *sa1, float *sb0, float *sb1, const __m512 *qa, const __m512 *qb,
                                const float *c, int64_t dc, const float *k, int64_t dr, int64_t t0)
{
    __m512 acc[2][8];
    for (int j = 0; j < 8; j++) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < (dc + dr) / 8; i++) {
        __m512 q0 = qa[i], q1 = qb[i];
        const float *x = i < dc / 8 ? c + t0 * dc + 8 * i : k + t0 * dr + 8 * (i - dc / 8);
        int64_t ld = i < dc / 8 ? dc : dr;
        _Pragma("GCC unroll 8")
        for (int j = 0; j < 8; j++) {
            __m512 xb = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + j * ld));
            acc[0][j] = _mm512_fmadd_ps(q0, xb, acc[0][j]);
            acc[1][j] = _mm512_fmadd_ps(q1, xb, acc[1][j]);
        }
    }
    float *dst[2][2] = {{sa0, sa1}, {sb0, sb1}};
    for (int e = 0; e < 2; e++) {
        __m512 *a = acc[e];
        __m512 u0 = dz_hadd(dz_hadd(a[0], a[1]), dz_hadd(a[2], a[3]));
        __m512 u1 = dz_hadd(dz_hadd(a[4], a[5]), dz_hadd(a[6], a[7]));
        __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
        sum = _mm512_shuffle_f32x4(sum, sum, _MM_SHUFFLE(3, 1, 2, 0));
        _mm256_storeu_ps(dst[e][0] + t0, _mm512_castps512_ps256(sum));
        _mm256_storeu_ps(dst[e][1] + t0, _mm512_extractf32x8_ps(sum, 1));
    }
}

/* dz_wsum32 for two query rows over one buffer, row a over its La tokens and row b over Lb >= La: the first La
   tokens loaded once for both, then b's own; each row's sums in the order dz_wsum32 takes them */
static inline __attribute__((always_inline)) void dz_wsum32x2(float *acca, float *accb, const float *sa,
                                                              const float *sb, int64_t stride, const float *c,
                                                              int64_t dc, int64_t j0, int64_t La, int64_t Lb,
                                                              const int NH)
{
    __m512 a[4][2], b[4][2];
    for (int hh = 0; hh < 4; hh++) a[hh][0] = a[hh][1] = b[hh][0] = b[hh][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < La; t++) {
        const float *x = c + t * dc + j0;
        __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        _Pragma("GCC unroll 4")
        for (int hh = 0; hh < NH; hh++) {
            __m512 p = _mm512_set1_ps(sa[hh * stride + t]), q = _mm512_set1_ps(sb[hh * stride + t]);
            a[hh][0] = _mm512_fmadd_ps(p, x0, a[hh][0]);
            a[hh][1] = _mm512_fmadd_ps(p, x1, a[hh][1]);
            b[hh][0] = _mm512_fmadd_ps(q, x0, b[hh][0]);
            b[hh][1] = _mm512_fmadd_ps(q, x1, b[hh][1]);
        }
    }
    dz_wsum_run(b, sb, stride, c, dc, j0, La, Lb, NH);
    dz_wsum_store(acca, a, NH);
    dz_wsum_store(accb, b, NH);
}

/* the packed queries of a group's head pairs ([q_a | q_b] block by block), rh0 = the group's first (row, head) */
static inline void dz_pack(__m512 (*qp)[DZ_MAXB], const float *qt, const float *qr, int64_t rh0, int nh, int64_t dc,
                           int64_t dr)
{
    for (int pi = 0; 2 * pi + 1 < nh; pi++) {
        int64_t ra = rh0 + 2 * pi;
        for (int64_t i = 0; i < dc / 8; i++)
            qp[pi][i] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qt + ra * dc + 8 * i)),
                                           _mm256_loadu_ps(qt + (ra + 1) * dc + 8 * i), 1);
        for (int64_t i = 0; i < dr / 8; i++)
            qp[pi][dc / 8 + i] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qr + ra * dr + 8 * i)),
                                                    _mm256_loadu_ps(qr + (ra + 1) * dr + 8 * i), 1);
    }
}
#endif

#ifndef TIDE_DECODE_DHG
#define TIDE_DECODE_DHG 1
enum { DHG = 4 };   /* the most heads of one task: they read each cached token once */
#endif

/* the scores of row r's heads h0 .. h0 + nh - 1 over its tokens t0 .. L - 1 (t0 a multiple of 8) into s (head hh at
   s + hh stride): blocks of 8 tokens, two heads over one read of a block where both are full; qp: the group's
   packed head pairs (dz_pack) or NULL */
static void DCAT(decode_scores_from, SFX)(T *s, int64_t stride, const T *qt, const T *qr, const T *c, const T *kr,
                                          int64_t rh0, int nh, int64_t dc, int64_t dr, int64_t L, int64_t t0,
                                          const void *qp)
{
    const int aligned = dc % 8 == 0 && dr % 8 == 0;
    (void)qp;
    for (int64_t t = t0; t < L; t += 8)
        for (int hh = 0; hh < nh; hh++) {
            int64_t rh = rh0 + hh;
            if (aligned && L - t >= 8 && hh + 1 < nh) {   /* two heads over one read of the block */
#if defined(TIDE_DECODE_ZMM)
                if (qp) {
                    dz_scores8((float *)(s + hh * stride), (float *)(s + (hh + 1) * stride),
                               ((const __m512(*)[DZ_MAXB])qp)[hh / 2], (const float *)c, dc, (const float *)kr, dr, t);
                    hh++;
                    continue;
                }
#endif
                DCAT(decode_scores8_full2, SFX)(s + hh * stride, s + (hh + 1) * stride, qt + rh * dc, qt + (rh + 1) * dc,
                                                c, dc, dr ? qr + rh * dr : NULL, dr ? qr + (rh + 1) * dr : NULL, kr, dr, t);
                hh++;
            } else if (aligned && L - t >= 8)
                DCAT(decode_scores8_full, SFX)(s + hh * stride, qt + rh * dc, c, dc, dr ? qr + rh * dr : NULL, kr, dr, t);
            else
                DCAT(decode_scores8, SFX)(s + hh * stride, qt + rh * dc, c, dc, dr ? qr + rh * dr : NULL, kr, dr, t,
                                          L - t < 8 ? (int)(L - t) : 8);
        }
}

/* the scores of nh heads over L tokens to p = exp(scale (s - max)) in place, the tail to the next multiple of 8
   zeroed; inv[hh] = 1 / Σ p, summed in 8 lanes of t mod 8 */
static void DCAT(decode_softmax, SFX)(T *s, int64_t stride, int nh, int64_t L, double scale, T *inv)
{
    for (int hh = 0; hh < nh; hh++) {
        T *sh = s + hh * stride;
        /* the max in vector lanes (fastmath.h): a max is exact, so any order gives the same value */
        T m = DCAT(max, SFX)(sh, L, (T)-INFINITY);
        T sc = (T)scale, ms = m * sc;
        for (int64_t t = 0; t < L; t++) sh[t] = EXP(sh[t] * sc - ms);
        for (int64_t t = L; t < ((L + 7) & ~(int64_t)7); t++) sh[t] = 0;
        DCAT(dvec8, SFX) zv = {0};   /* lane j: sh[j], sh[8 + j], ... in sequence */
        for (int64_t t = 0; t < L; t += 8) {
            DCAT(dvec8, SFX) x;
            memcpy(&x, sh + t, sizeof x);
            zv += x;
        }
        T z[8];
        memcpy(z, &zv, sizeof z);
        T sum = ((z[0] + z[4]) + (z[2] + z[6])) + ((z[1] + z[5]) + (z[3] + z[7]));
        inv[hh] = (T)1 / sum;
    }
}

/* o = Σ_t p_t c_t / Σ p for latent dims j0 .. j0 + w - 1 of nh heads (out: the group's first head row), tokens in
   sequence, 32 latent dims at a time in registers for each head of the group (full blocks in decode_wsum32, a last
   partial block through a zero-padded copy of each token's tail) */
static void DCAT(decode_wsum_block, SFX)(T *out, const T *s, int64_t stride, const T *c, int64_t dc, int64_t j0,
                                         int64_t w, int64_t L, int nh, const T *inv, int zmm)
{
    DCAT(dvec8, SFX) acc[DHG][4];
    memset(acc, 0, sizeof acc);
    (void)zmm;
#if defined(TIDE_DECODE_ZMM)
    if (w == 32 && zmm) {
        switch (nh) {
        case 1: dz_wsum32((float *)acc, (const float *)s, stride, (const float *)c, dc, j0, L, 1); break;
        case 2: dz_wsum32((float *)acc, (const float *)s, stride, (const float *)c, dc, j0, L, 2); break;
        case 3: dz_wsum32((float *)acc, (const float *)s, stride, (const float *)c, dc, j0, L, 3); break;
        default: dz_wsum32((float *)acc, (const float *)s, stride, (const float *)c, dc, j0, L, 4); break;
        }
    } else
#endif
    if (w == 32) {
        switch (nh) {
        case 1: DCAT(decode_wsum32, SFX)(acc, s, stride, c, dc, j0, L, 1); break;
        case 2: DCAT(decode_wsum32, SFX)(acc, s, stride, c, dc, j0, L, 2); break;
        case 3: DCAT(decode_wsum32, SFX)(acc, s, stride, c, dc, j0, L, 3); break;
        default: DCAT(decode_wsum32, SFX)(acc, s, stride, c, dc, j0, L, 4); break;
        }
    } else {
        for (int64_t t = 0; t < L; t++) {
            const T *x = c + t * dc + j0;
            T pad[32];
            memset(pad, 0, sizeof pad);
            memcpy(pad, x, (size_t)w * sizeof(T));
            for (int hh = 0; hh < nh; hh++) DCAT(decode_axpy32, SFX)(acc[hh], s[hh * stride + t], pad);
        }
    }
    for (int hh = 0; hh < nh; hh++) {
        T buf[32], *o = out + hh * dc;
        memcpy(buf, acc[hh], sizeof buf);
        for (int64_t j = 0; j < w; j++) o[j0 + j] = buf[j] * inv[hh];
    }
}

/* one task: query row r's heads h0 .. h0 + nh - 1 over its own L cached tokens; s: DHG x stride scratch */
static void DCAT(decode_task, SFX)(T *out, const T *qt, const T *qr, const T *c, const T *kr, int64_t rh0, int nh,
                                   int64_t dc, int64_t dr, int64_t L, double scale, T *s, int64_t stride)
{
    const void *qp = NULL;
    int zmm = 0;
#if defined(TIDE_DECODE_ZMM)
    __m512 qpk[DHG / 2][DZ_MAXB];
    if (dz_packed(sizeof(T), dc, dr)) {
        dz_pack(qpk, (const float *)qt, (const float *)qr, rh0, nh, dc, dr);
        qp = qpk;
        zmm = 1;
    }
#endif
    T inv[DHG];
    DCAT(decode_scores_from, SFX)(s, stride, qt, qr, c, kr, rh0, nh, dc, dr, L, 0, qp);
    DCAT(decode_softmax, SFX)(s, stride, nh, L, scale, inv);
    for (int64_t j0 = 0; j0 < dc; j0 += 32)
        DCAT(decode_wsum_block, SFX)(out + rh0 * dc, s, stride, c, dc, j0, dc - j0 < 32 ? dc - j0 : 32, L, nh, inv, zmm);
}

#if defined(TIDE_DECODE_ZMM) && !defined(TIDE_DECODE_TASK2)
#define TIDE_DECODE_TASK2 1   /* defined once, in the float instantiation (mla.c includes this file for float first) */
/* two tasks at once: query rows ra and ra + 1 (H heads apart in rh0) over one buffer, row a over La tokens and row b
   over La + 1 (two consecutive queries of an exact prefill): the blocks of tokens both read are loaded once for
   both, and every value is computed as decode_task computes it for each row alone. Float under AVX-512, dc and dr
   multiples of 8. s: 2 x DHG x stride scratch */
static void dz_task2(float *out, const float *qt, const float *qr, const float *c, const float *kr, int64_t rha,
                     int64_t H, int nh, int64_t dc, int64_t dr, int64_t La, double scale, float *s, int64_t stride)
{
    int64_t rhb = rha + H, Lb = La + 1, tf = La & ~(int64_t)7;
    float *sa = s, *sb = s + DHG * stride;
    __m512 qa[DHG / 2][DZ_MAXB], qb[DHG / 2][DZ_MAXB];
    dz_pack(qa, qt, qr, rha, nh, dc, dr);
    dz_pack(qb, qt, qr, rhb, nh, dc, dr);
    for (int64_t t = 0; t < tf; t += 8) {   /* the full blocks of both rows */
        int hh = 0;
        for (; hh + 1 < nh; hh += 2)
            dz_scores8x2(sa + hh * stride, sa + (hh + 1) * stride, sb + hh * stride, sb + (hh + 1) * stride, qa[hh / 2],
                         qb[hh / 2], c, dc, kr, dr, t);
        if (hh < nh) {
            decode_scores8_full_f32(sa + hh * stride, qt + (rha + hh) * dc, c, dc, dr ? qr + (rha + hh) * dr : NULL, kr,
                                    dr, t);
            decode_scores8_full_f32(sb + hh * stride, qt + (rhb + hh) * dc, c, dc, dr ? qr + (rhb + hh) * dr : NULL, kr,
                                    dr, t);
        }
    }
    decode_scores_from_f32(sa, stride, qt, qr, c, kr, rha, nh, dc, dr, La, tf, qa);
    decode_scores_from_f32(sb, stride, qt, qr, c, kr, rhb, nh, dc, dr, Lb, tf, qb);
    float inva[DHG], invb[DHG];
    decode_softmax_f32(sa, stride, nh, La, scale, inva);
    decode_softmax_f32(sb, stride, nh, Lb, scale, invb);
    for (int64_t j0 = 0; j0 < dc; j0 += 32) {
        int64_t w = dc - j0 < 32 ? dc - j0 : 32;
        if (w < 32) {
            decode_wsum_block_f32(out + rha * dc, sa, stride, c, dc, j0, w, La, nh, inva, 1);
            decode_wsum_block_f32(out + rhb * dc, sb, stride, c, dc, j0, w, Lb, nh, invb, 1);
            continue;
        }
        float acca[DHG * 32], accb[DHG * 32];
        switch (nh) {
        case 1: dz_wsum32x2(acca, accb, sa, sb, stride, c, dc, j0, La, Lb, 1); break;
        case 2: dz_wsum32x2(acca, accb, sa, sb, stride, c, dc, j0, La, Lb, 2); break;
        case 3: dz_wsum32x2(acca, accb, sa, sb, stride, c, dc, j0, La, Lb, 3); break;
        default: dz_wsum32x2(acca, accb, sa, sb, stride, c, dc, j0, La, Lb, 4); break;
        }
        for (int hh = 0; hh < nh; hh++)
            for (int64_t j = 0; j < 32; j++) {
                out[(rha + hh) * dc + j0 + j] = acca[32 * hh + j] * inva[hh];
                out[(rhb + hh) * dc + j0 + j] = accb[32 * hh + j] * invb[hh];
            }
    }
}
#endif

static int DCAT(decode_rows, SFX)(T *out, const T *qt, const T *qr, const T *c_new, const T *kr_new, void *const *c_bufs,
                                  void *const *kr_bufs, const int64_t *lens, int64_t R, int64_t H, int64_t dc,
                                  int64_t dr, double scale)
{
    int64_t Lmax = 0;
    for (int64_t r = 0; r < R; r++) {
        /* the new token first (c_new NULL: the buffers hold it already): every head of the row then reads its
           latents from the buffers alone */
        if (c_new) {
            memcpy((T *)c_bufs[r] + lens[r] * dc, c_new + r * dc, (size_t)dc * sizeof(T));
            if (dr) memcpy((T *)kr_bufs[r] + lens[r] * dr, kr_new + r * dr, (size_t)dr * sizeof(T));
        }
        if (lens[r] + 1 > Lmax) Lmax = lens[r] + 1;
    }
    /* the units of work: a row, or two consecutive rows that are consecutive queries over one buffer (an exact
       prefill's), which the packed float path runs together; a unit's low bit marks a pair */
    int64_t *unit = malloc((size_t)(R > 0 ? R : 1) * sizeof *unit), nu = 0;
    if (!unit) return tide_set_error("mla_decode_rows: out of memory for %lld rows", (long long)R);
    int pairs = 0;
#if defined(TIDE_DECODE_ZMM)
    pairs = dz_packed(sizeof(T), dc, dr);
#endif
    for (int64_t r = 0; r < R; r++) {
        int pair = pairs && r + 1 < R && c_bufs[r + 1] == c_bufs[r] && (!dr || kr_bufs[r + 1] == kr_bufs[r]) &&
                   lens[r + 1] == lens[r] + 1;
        unit[nu++] = 2 * r + pair;
        r += pair;
    }
    /* one task per (unit, group of up to DHG heads): the heads of a group read each cached token once */
    int64_t ng = (H + DHG - 1) / DHG;
    int bad = 0;
    _Pragma("omp parallel if(R * H * Lmax * (dc + dr) > TIDE_OMP_MIN) reduction(|:bad)")
    {
        int64_t stride = Lmax + 8;
        T *s = malloc((size_t)(2 * DHG * stride) * sizeof(T));
        if (!s) bad = 1;
        _Pragma("omp for schedule(static)")
        for (int64_t ug = 0; ug < nu * ng; ug++) {
            if (!s) continue;
            int64_t u = unit[ug / ng], r = u / 2, h0 = (ug % ng) * DHG, L = lens[r] + 1;
            int nh = H - h0 < DHG ? (int)(H - h0) : DHG;
            const T *c = c_bufs[r], *kr = dr ? (const T *)kr_bufs[r] : NULL;
#if defined(TIDE_DECODE_ZMM)
            if (u & 1) {
                dz_task2((float *)out, (const float *)qt, (const float *)qr, (const float *)c, (const float *)kr,
                         r * H + h0, H, nh, dc, dr, L, scale, (float *)s, stride);
                continue;
            }
#endif
            DCAT(decode_task, SFX)(out, qt, qr, c, kr, r * H + h0, nh, dc, dr, L, scale, s, stride);
        }
        free(s);
    }
    free(unit);
    return bad ? tide_set_error("mla_decode_rows: out of memory for %lld scores", (long long)Lmax) : 0;
}

#undef DCAT
#undef DCAT_

/*
 * tile_mm.h — small dense products for the fused CPU kernels (KDA chunks, MLA attention tiles), for one
 * float type: included inside a kernel body that has defined T (float or double) and F(name) (a name with
 * the type's suffix). The including file undefines TMM_VL, TMM_NV and TMM_STAGES at its end.
 */
#if defined(__AVX512F__)
#include <immintrin.h>   /* tblock's float shuffles */
#endif
/* ---- a small dense product ------------------------------------------------------------------------ */
/* C [m, n] = (acc ? C : 0) + alpha · A B, with A(r, kk) = A[r·sar + kk·sak] (so a transposed operand is
   a stride swap) and B row-major [k, n]. Tiles of 8 rows x 16 columns keep their accumulators in vector
   registers (GCC vector types: one 64-byte vector is 16 floats or 8 doubles); rows left over take 1-row
   tiles and columns left over (a ragged last chunk) a plain loop. */
typedef T F(vec) __attribute__((vector_size(64)));
#define TMM_VL ((int)(64 / sizeof(T)))
#define TMM_NV (16 / TMM_VL)

/* through pointers: a 64-byte vector passed or returned by value has an ABI note (-Wpsabi) without AVX-512 */
static inline void F(vload)(F(vec) *v, const T *p) { memcpy(v, p, sizeof *v); }
static inline void F(vstore)(T *p, const F(vec) *v) { memcpy(p, v, sizeof *v); }
/* short row copies inline (a libc call per 64-float row cost more than the copy) */
static inline void F(copy)(T *restrict dst, const T *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) dst[i] = src[i];
}

/* shuffle masks: integers as wide as T, as many as a vector holds */
typedef __typeof__(_Generic((T)0, float: (int32_t)0, double: (int64_t)0)) F(ielem);
typedef F(ielem) F(ivec) __attribute__((vector_size(64)));

/* tblock's shuffle masks as constants (built lane by lane at run time they cost more than the shuffles). For stage
   t, s = VL >> (t + 1): [t][0] and [t][1] swap the off-diagonal s x s blocks of a pair of rows. Rows hold 16 lanes;
   a type with 8 lanes reads the first 8. */
#define TMM_LO(s, j) ((j) & (s) ? TMM_VL + (j) - (s) : (j))
#define TMM_HI(s, j) ((j) & (s) ? TMM_VL + (j) : (j) + (s))
#define TMM_16(f, s) f(s, 0), f(s, 1), f(s, 2), f(s, 3), f(s, 4), f(s, 5), f(s, 6), f(s, 7), f(s, 8), f(s, 9), \
                     f(s, 10), f(s, 11), f(s, 12), f(s, 13), f(s, 14), f(s, 15)
#define TMM_STAGE(s) { {TMM_16(TMM_LO, s)}, {TMM_16(TMM_HI, s)} }
static const F(ielem) F(tmask)[4][2][16] = { TMM_STAGE(TMM_VL / 2), TMM_STAGE(TMM_VL / 4), TMM_STAGE(TMM_VL / 8),
                                             TMM_STAGE(TMM_VL / 16 ? TMM_VL / 16 : 1) };
#undef TMM_STAGE
#undef TMM_16
#undef TMM_HI
#undef TMM_LO
#define TMM_STAGES (TMM_VL == 16 ? 4 : TMM_VL == 8 ? 3 : TMM_VL == 4 ? 2 : 1)

#define TMM_TILE(MR, NV)                                                                                  \
    {                                                                                                     \
        F(vec) t[MR][NV];                                                                                 \
        for (int rr = 0; rr < MR; rr++)                                                                   \
            for (int v = 0; v < NV; v++) t[rr][v] = (F(vec)){0};                                          \
        for (int64_t kk = 0; kk < k; kk++) {                                                              \
            F(vec) b[NV];                                                                                 \
            for (int v = 0; v < NV; v++) F(vload)(&b[v], B + kk * ldb + j0 + v * TMM_VL);               \
            for (int rr = 0; rr < MR; rr++) {                                                             \
                T a = A[(r0 + rr) * sar + kk * sak];                                                      \
                for (int v = 0; v < NV; v++) t[rr][v] += a * b[v];                                        \
            }                                                                                             \
        }                                                                                                 \
        for (int rr = 0; rr < MR; rr++)                                                                   \
            for (int v = 0; v < NV; v++) {                                                                \
                T *c = Cm + (r0 + rr) * ldc + j0 + v * TMM_VL;                                            \
                F(vec) cv;                                                                                \
                if (acc) { F(vload)(&cv, c); cv = cv + alpha * t[rr][v]; } else cv = alpha * t[rr][v];   \
                F(vstore)(c, &cv);                                                                        \
            }                                                                                             \
    }

/* columns in tiles of TMM_WCOLS (32 floats: two vectors, 16 accumulators, so each broadcast of A feeds two fused
   multiply-adds; 16 doubles), then a 16-column tile; every element the same chain over k whatever its tile */
#define TMM_WCOLS (TMM_VL == 16 ? 32 : 16)
static __attribute__((unused)) void F(mm)(T *Cm, int64_t ldc, const T *A, int64_t sar, int64_t sak, const T *B, int64_t ldb, int64_t m,
                  int64_t n, int64_t k, T alpha, int acc)
{
    int64_t m8 = m - m % 8, n16 = n - n % 16, j0 = 0;
    for (; j0 + TMM_WCOLS <= n; j0 += TMM_WCOLS) {
        for (int64_t r0 = 0; r0 < m8; r0 += 8) TMM_TILE(8, TMM_WCOLS / TMM_VL)
        for (int64_t r0 = m8; r0 < m; r0++) TMM_TILE(1, TMM_WCOLS / TMM_VL)
    }
    for (; j0 < n16; j0 += 16) {
        for (int64_t r0 = 0; r0 < m8; r0 += 8) TMM_TILE(8, TMM_NV)
        for (int64_t r0 = m8; r0 < m; r0++) TMM_TILE(1, TMM_NV)
    }
    if (n16 == n) return;
    for (int64_t r = 0; r < m; r++) {          /* columns [n16, n) */
        T *c = Cm + r * ldc;
        if (!acc) for (int64_t j = n16; j < n; j++) c[j] = 0;
        for (int64_t kk = 0; kk < k; kk++) {
            T a = alpha * A[r * sar + kk * sak];
            const T *b = B + kk * ldb;
            for (int64_t j = n16; j < n; j++) c[j] += a * b[j];
        }
    }
}
#undef TMM_TILE
#undef TMM_WCOLS

/* a VL x VL block (VL = TMM_VL, one vector a row): out rows (stride ldo) = the in rows' (stride ldi) transpose. Each
   stage swaps the off-diagonal s x s blocks of every 2s x 2s block with two-source shuffles, s = VL/2 ... 1 (16 x 16
   floats: 64 shuffles against 256 scalar moves). */
static inline void F(tblock)(T *out, int64_t ldo, const T *in, int64_t ldi)
{
#if defined(__AVX512F__)
    /* floats under AVX-512: fixed-pattern shuffles (pairs of rows interleaved, then pairs of pairs, then the
       128-bit lanes twice), each one instruction without a mask to load */
    if (sizeof(T) == sizeof(float)) {
        __m512 r[16], t[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps((const float *)in + i * ldi);
        for (int i = 0; i < 8; i++) {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; i++) {
            r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
            r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
            r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
            r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
        }
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 4; i++) {
                t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
                t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
            }
        for (int i = 0; i < 8; i++) {
            r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
            r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
        }
        for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)out + i * ldo, r[i]);
        return;
    }
#endif
#if defined(__clang__)
    /* clang has no two-source shuffle with a mask from memory (__builtin_shufflevector takes constants): moves */
    for (int i = 0; i < TMM_VL; i++)
        for (int j = 0; j < TMM_VL; j++) out[j * ldo + i] = in[i * ldi + j];
#else
    F(vec) a[TMM_VL];
    for (int i = 0; i < TMM_VL; i++) F(vload)(&a[i], in + i * ldi);
    for (int t = 0; t < TMM_STAGES; t++) {
        int s = TMM_VL >> (t + 1);
        F(ivec) lo, hi;
        memcpy(&lo, F(tmask)[t][0], sizeof lo);
        memcpy(&hi, F(tmask)[t][1], sizeof hi);
        for (int i = 0; i < TMM_VL; i++)
            if (!(i & s)) {
                F(vec) x = a[i], y = a[i + s];
                a[i] = __builtin_shuffle(x, y, lo);
                a[i + s] = __builtin_shuffle(x, y, hi);
            }
    }
    for (int i = 0; i < TMM_VL; i++) F(vstore)(out + i * ldo, &a[i]);
#endif
}

/* out [n, m] (row stride ldo) = in [m, n]ᵀ (in has row stride ld): whole VL x VL blocks by shuffles, the edges
   element by element */
static __attribute__((unused)) void F(transpose_ld)(T *out, int64_t ldo, const T *in, int64_t m, int64_t n, int64_t ld)
{
    int64_t mb = m - m % TMM_VL, nb = n - n % TMM_VL;
    for (int64_t r0 = 0; r0 < mb; r0 += TMM_VL)
        for (int64_t j0 = 0; j0 < nb; j0 += TMM_VL) F(tblock)(out + j0 * ldo + r0, ldo, in + r0 * ld + j0, ld);
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = r < mb ? nb : 0; j < n; j++) out[j * ldo + r] = in[r * ld + j];
}

/* out [n, m] = in [m, n]ᵀ (in has row stride ld) */
static __attribute__((unused)) void F(transpose)(T *out, const T *in, int64_t m, int64_t n, int64_t ld)
{
    F(transpose_ld)(out, m, in, m, n, ld);
}

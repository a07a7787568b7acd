/*
 * gemm.c — matrix products through CBLAS (row-major), float32 and float64 (kernels/backend.h).
 *
 * We link the OpenMP build of OpenBLAS, which threads each call itself, so the batched product is a plain
 * loop of threaded products. A call made inside an active OpenMP parallel region runs single-threaded
 * (OpenBLAS checks omp_in_parallel()). A threaded product's bits depend on the thread count (its threads
 * split the output and the edge micro-kernels round differently); moe.c relies on the single-threaded
 * case for its thread-count-invariant tiles.
 *
 * Three shapes run our own kernels in the default mode too, where OpenBLAS's packing and its scaling of C cost more
 * than the products: a short inner dimension (own_is_faster: the batch-invariant kernel), few output columns
 * (narrow_applies: C = A Bᵀ with N <= 32, a router's logits) and a long inner dimension with a small C
 * (long_k_applies: C = Aᵀ B over K >= 1,024 rows, a weight gradient over a batch's tokens).
 *
 * Batch-invariant mode (tide_set_batch_invariant): BLAS picks its blocking and edge kernels from M, so row i of
 * an M-row product need not equal the same row computed alone. A decode step of R rows must give each row the
 * bits it gets as a one-row step (rl.md oracle 9: a replayed row equals the batched sampling that made it), so in
 * this mode every product runs our own kernel: each output element is one fused multiply-add chain over k in
 * sequence, whatever M, N, the leading dimensions, the tiling or the thread count.
 */
#include <limits.h>
#include <pthread.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include <omp.h>
#include "cpu.h"

static int g_batch_invariant;

int tide_cpu_set_batch_invariant(int on) { int prev = g_batch_invariant; g_batch_invariant = on ? 1 : 0; return prev; }
int tide_cpu_batch_invariant(void) { return g_batch_invariant; }

/* Every output element of a batch-invariant product is one fused multiply-add chain over k in sequence,
   c = fma(a_k, b_k, c) from c = 0 for k = 0 .. K-1, whatever M, N, the leading dimensions, the tiling or the thread
   count: a vector lane and a scalar fma round alike, so the tiles (IR rows by a panel of PW columns, the columns in
   vector lanes) and the narrow path (scalar chains, for fewer than IR rows) give the same bits. The fused operation
   is explicit (the FMA intrinsics, or fma() where the target has none), never left to the compiler's contraction. */
#if defined(__AVX512F__)
#define TILE_BYTES 64           /* the widest vectors the target has: the tile's lanes (the chains do not change) */
#else
#define TILE_BYTES 32
#endif
typedef float tvf __attribute__((vector_size(TILE_BYTES)));
typedef double tvd __attribute__((vector_size(TILE_BYTES)));
enum { VLF = TILE_BYTES / 4, VLD = TILE_BYTES / 8 };   /* lanes of a tile vector */

#if defined(__AVX512F__)
#include <immintrin.h>
static inline tvf vfma_f32(tvf a, tvf b, tvf c) { return (tvf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline tvd vfma_f64(tvd a, tvd b, tvd c) { return (tvd)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c); }
static inline tvf vset_f32(float s) { return (tvf)_mm512_set1_ps(s); }
static inline tvd vset_f64(double s) { return (tvd)_mm512_set1_pd(s); }
#elif defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline tvf vfma_f32(tvf a, tvf b, tvf c) { return (tvf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline tvd vfma_f64(tvd a, tvd b, tvd c) { return (tvd)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c); }
static inline tvf vset_f32(float s) { return (tvf)_mm256_set1_ps(s); }
static inline tvd vset_f64(double s) { return (tvd)_mm256_set1_pd(s); }
#else
static inline tvf vfma_f32(tvf a, tvf b, tvf c)
{
    for (int l = 0; l < VLF; l++) c[l] = fmaf(a[l], b[l], c[l]);
    return c;
}
static inline tvd vfma_f64(tvd a, tvd b, tvd c)
{
    for (int l = 0; l < VLD; l++) c[l] = fma(a[l], b[l], c[l]);
    return c;
}
static inline tvf vset_f32(float s) { return (tvf){0} + s; }
static inline tvd vset_f64(double s) { return (tvd){0} + s; }
#endif

/* one vector of a full tile straight into C: alpha · chain, or fma(beta, c, alpha · chain) when beta != 0, lane by
   lane the arithmetic of the scalar store (an IEEE product, then the explicit fused operation) */
#define DEFINE_VSTORE(T, V, SUF)                                                                              \
    static inline void vstore_##SUF(T *c, V acc, T al, T be, int hb)                                          \
    {                                                                                                         \
        V r = vset_##SUF(al) * acc;                                                                           \
        if (hb) {                                                                                             \
            V old;                                                                                            \
            memcpy(&old, c, sizeof old);                                                                      \
            r = vfma_##SUF(vset_##SUF(be), old, r);                                                           \
        }                                                                                                     \
        memcpy(c, &r, sizeof r);                                                                              \
    }
DEFINE_VSTORE(float, tvf, f32)
DEFINE_VSTORE(double, tvd, f64)
#undef DEFINE_VSTORE

enum { IR = 4, IV = 4 };   /* a tile: IR rows by IV vectors of columns */

/* out[IR][IV * VL] = the chains of rows a[0..IR-1] (each K values) with the panel bp [K][IV * VL]; written out
   register by register (an array of vectors is kept on the stack) */
#define TILE_ROW(i, V, VL, SUF)                                                                                           \
    {                                                                                                         \
        V x = vset_##SUF(a##i[k]);                                                                            \
        c##i##0 = vfma_##SUF(x, b0, c##i##0);                                                                 \
        c##i##1 = vfma_##SUF(x, b1, c##i##1);                                                                 \
        c##i##2 = vfma_##SUF(x, b2, c##i##2);                                                                 \
        c##i##3 = vfma_##SUF(x, b3, c##i##3);                                                                 \
    }
#define DEFINE_TILE(T, V, VL, SUF)                                                                            \
    static void tile_##SUF(const T *const *a, const T *bp, int64_t K, T *out, T *cd, int64_t ldc, T al, T be, \
                          int hb)                                                                             \
    {                                                                                                         \
        const T *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3];                                               \
        V c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0}, c10 = {0}, c11 = {0}, c12 = {0}, c13 = {0};             \
        V c20 = {0}, c21 = {0}, c22 = {0}, c23 = {0}, c30 = {0}, c31 = {0}, c32 = {0}, c33 = {0};             \
        for (int64_t k = 0; k < K; k++) {                                                                     \
            const T *bk = bp + k * (4 * VL);                                                                  \
            V b0, b1, b2, b3;                                                                                 \
            memcpy(&b0, bk, sizeof b0);                                                                       \
            memcpy(&b1, bk + VL, sizeof b1);                                                                  \
            memcpy(&b2, bk + 2 * VL, sizeof b2);                                                              \
            memcpy(&b3, bk + 3 * VL, sizeof b3);                                                              \
            TILE_ROW(0, V, VL, SUF) TILE_ROW(1, V, VL, SUF) TILE_ROW(2, V, VL, SUF) TILE_ROW(3, V, VL, SUF)                                                 \
        }                                                                                                     \
        V all[16] = {c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33};        \
        if (!cd) { memcpy(out, all, sizeof all); return; }                                                    \
        for (int i = 0; i < 4; i++)                                                                           \
            for (int v = 0; v < 4; v++) vstore_##SUF(cd + i * ldc + v * VL, all[i * 4 + v], al, be, hb);      \
    }
DEFINE_TILE(float, tvf, VLF, f32)
DEFINE_TILE(double, tvd, VLD, f64)
#undef TILE_ROW
#undef DEFINE_TILE
_Static_assert(IR == 4 && IV == 4, "tile_f32 / tile_f64 are written out for 4 x 4 vectors");

/* thin panels, for products with few output columns (a gate's N = 2 to 32): IRN rows by NV vectors, NV = 1 or 2,
   IRN · NV = 16 accumulators as in the 4 x 4 tile. A 4 x 4 tile's 64-float panel computed 62 padded columns for
   N = 2 (a KDA layer's β projection: 148 us a call at 4,096 tokens). The chains are the same, so the same bits. */
#define DEFINE_THIN_TILE(T, V, VL, SUF, NV, IRN)                                                              \
    static void tile_##SUF##_thin##NV(const T *const *a, const T *bp, int64_t K, T *out, T *cd, int64_t ldc,  \
                                      T al, T be, int hb)                                                     \
    {                                                                                                         \
        V c[IRN][NV];                                                                                         \
        _Pragma("GCC unroll 16")                                                                              \
        for (int i = 0; i < IRN; i++)                                                                         \
            _Pragma("GCC unroll 2")                                                                           \
            for (int v = 0; v < NV; v++) c[i][v] = (V){0};                                                    \
        for (int64_t k = 0; k < K; k++) {                                                                     \
            V b[NV];                                                                                          \
            _Pragma("GCC unroll 2")                                                                           \
            for (int v = 0; v < NV; v++) memcpy(&b[v], bp + k * (NV * VL) + v * VL, sizeof b[v]);              \
            _Pragma("GCC unroll 16")                                                                          \
            for (int i = 0; i < IRN; i++) {                                                                   \
                V x = vset_##SUF(a[i][k]);                                                                    \
                _Pragma("GCC unroll 2")                                                                       \
                for (int v = 0; v < NV; v++) c[i][v] = vfma_##SUF(x, b[v], c[i][v]);                          \
            }                                                                                                 \
        }                                                                                                     \
        if (!cd) { memcpy(out, c, sizeof c); return; }                                                        \
        for (int i = 0; i < IRN; i++)                                                                         \
            for (int v = 0; v < NV; v++) vstore_##SUF(cd + i * ldc + v * VL, c[i][v], al, be, hb);            \
    }
DEFINE_THIN_TILE(float, tvf, VLF, f32, 1, 16)
DEFINE_THIN_TILE(float, tvf, VLF, f32, 2, 8)
DEFINE_THIN_TILE(double, tvd, VLD, f64, 1, 16)
DEFINE_THIN_TILE(double, tvd, VLD, f64, 2, 8)
#undef DEFINE_THIN_TILE
enum { IR_MAX = 16 };

/* the packing buffers of a thread (slot 0: op(A)'s rows, 1: op(B)'s panels), kept between calls up to PACK_KEEP
   bytes each: the many small products of a decoding step reuse them instead of a malloc and a free each (a large
   malloc also made glibc consolidate its free small chunks every call). Larger ones are allocated per call. */
enum { PACK_KEEP = 8 << 20 };
static __thread void *t_pack[2];
static __thread size_t t_pack_cap[2];

/* A thread that ends frees its kept buffers: a pthread key whose destructor runs at the thread's exit (an OpenMP
   worker the runtime retires when the team shrinks, say; the buffers would otherwise be lost with its TLS) */
static pthread_key_t g_pack_key;
static pthread_once_t g_pack_once = PTHREAD_ONCE_INIT;
static int g_pack_key_ok;

static void pack_release(void *unused)
{
    (void)unused;
    for (int s = 0; s < 2; s++) {
        free(t_pack[s]);
        t_pack[s] = NULL;
        t_pack_cap[s] = 0;
    }
}

static void pack_key_init(void) { g_pack_key_ok = pthread_key_create(&g_pack_key, pack_release) == 0; }

static void *pack_get(int slot, size_t n)
{
    if (n > PACK_KEEP) return malloc(n);
    if (n > t_pack_cap[slot]) {
        pthread_once(&g_pack_once, pack_key_init);
        /* without the key (out of keys) the buffer is not kept past this call: pack_put frees it */
        if (!g_pack_key_ok) return malloc(n);
        if (!pthread_getspecific(g_pack_key)) pthread_setspecific(g_pack_key, t_pack);
        size_t cap = 2 * t_pack_cap[slot] > n ? 2 * t_pack_cap[slot] : n;
        if (cap > PACK_KEEP) cap = PACK_KEEP;
        free(t_pack[slot]);
        t_pack[slot] = malloc(cap);
        t_pack_cap[slot] = t_pack[slot] ? cap : 0;
    }
    return t_pack[slot];
}

static void pack_put(int slot, void *p)
{
    if (p && p != t_pack[slot]) free(p);
}

/* rows [n, K] contiguous from a [K, n] matrix with leading dimension ld (a transposed operand), in tiles */
static void *pack_rows(size_t esz, const void *src, int64_t ld, int64_t K, int64_t n)
{
    char *dst = pack_get(0, (size_t)(n * K) * esz + 1);
    if (!dst) return NULL;
    enum { TB = 32 };
    for (int64_t k0 = 0; k0 < K; k0 += TB)
        for (int64_t j0 = 0; j0 < n; j0 += TB) {
            int64_t k1 = k0 + TB < K ? k0 + TB : K, j1 = j0 + TB < n ? j0 + TB : n;
            if (esz == sizeof(float)) {
                const float *s = src; float *d = (float *)dst;
                for (int64_t k = k0; k < k1; k++)
                    for (int64_t j = j0; j < j1; j++) d[j * K + k] = s[k * ld + j];
            } else {
                const double *s = src; double *d = (double *)dst;
                for (int64_t k = k0; k < k1; k++)
                    for (int64_t j = j0; j < j1; j++) d[j * K + k] = s[k * ld + j];
            }
        }
    return dst;
}

/* the panels of op(B) [K, N]: panel p holds columns [p PW, (p + 1) PW) as [K][PW], the columns past N zero */
#define DEFINE_PACK_PANELS(T, SUF)                                                                             \
    static void pack_panels_##SUF(T *dst, int tb, const T *B, int64_t ldb, int64_t K, int64_t N, int64_t PW)  \
    {                                                                                                         \
        int64_t np = (N + PW - 1) / PW;                                                                       \
        for (int64_t p = 0; p < np; p++) {                                                                    \
            int64_t w = N - p * PW < PW ? N - p * PW : PW;                                                    \
            T *d = dst + p * K * PW;                                                                          \
            if (w < PW)                                                                                       \
                for (int64_t k = 0; k < K; k++)                                                               \
                    for (int64_t c = w; c < PW; c++) d[k * PW + c] = 0;                                       \
            if (tb) /* B [N, K]: column j of op(B) is row j, read along k */                                  \
                for (int64_t c = 0; c < w; c++) {                                                             \
                    const T *src = B + (p * PW + c) * ldb;                                                    \
                    for (int64_t k = 0; k < K; k++) d[k * PW + c] = src[k];                                   \
                }                                                                                             \
            else /* B [K, N]: a panel row is w contiguous values */                                           \
                for (int64_t k = 0; k < K; k++) memcpy(d + k * PW, B + k * ldb + p * PW, (size_t)w * sizeof(T)); \
        }                                                                                                     \
    }
DEFINE_PACK_PANELS(float, f32)
DEFINE_PACK_PANELS(double, f64)
#undef DEFINE_PACK_PANELS

/* tile_mm.h's float block transposes (transpose_ld: 16 x 16 blocks by register shuffles, the edges element by
   element) for the panels of a transposed B below */
#define T float
#define F(name) tmm_##name##_f32
#include "tile_mm.h"
#undef F
#undef T
#undef TMM_VL
#undef TMM_NV
#undef TMM_STAGES

/* pack_panels_f32 of a transposed B [N, K] (a Linear's weight): each panel is the transpose of its w rows of B,
   whole blocks in registers. A decoding step's products have few rows, so packing the weight is a large part of
   each call */
static void pack_panels_t_f32(float *dst, const float *B, int64_t ldb, int64_t K, int64_t N, int64_t PW)
{
    int64_t np = (N + PW - 1) / PW;
    for (int64_t p = 0; p < np; p++) {
        int64_t w = N - p * PW < PW ? N - p * PW : PW;
        float *d = dst + p * K * PW;
        if (w < PW)
            for (int64_t k = 0; k < K; k++)
                for (int64_t c = w; c < PW; c++) d[k * PW + c] = 0;
        tmm_transpose_ld_f32(d, PW, B + p * PW * ldb, w, K, ldb);
    }
}

static void *pack_panels(size_t esz, int tb, const void *B, int64_t ldb, int64_t K, int64_t N, int64_t PW)
{
    int64_t np = (N + PW - 1) / PW;
    void *dst = pack_get(1, (size_t)(np * K * PW) * esz + 1);
    if (!dst) return NULL;
    if (esz == sizeof(float) && tb) { pack_panels_t_f32(dst, B, ldb, K, N, PW); return dst; }
    if (esz == sizeof(float)) pack_panels_f32(dst, tb, B, ldb, K, N, PW);
    else pack_panels_f64(dst, tb, B, ldb, K, N, PW);
    return dst;
}

/* C = alpha op(A) op(B) + beta C with every element one fma chain over k in sequence, then c = alpha chain, or
   fma(beta, c, alpha chain) when beta != 0; -1 when out of memory */
static int gemm_invariant(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                          const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    size_t esz = dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    void *pa = ta ? pack_rows(esz, A, lda, K, M) : NULL;
    if (ta && !pa) return -1;
    const char *a = pa ? pa : A;
    int64_t sa = ta ? K : lda;
    if (M < IR) {
        /* the narrow path: each element its scalar chain, op(B) read in place, NC columns' chains interleaved */
        enum { NC = 8 };
        _Pragma("omp parallel for if(M * N * K > TIDE_OMP_MIN_FMA)")
        for (int64_t j0 = 0; j0 < N; j0 += NC)
            for (int64_t i = 0; i < M; i++) {
                int n = N - j0 < NC ? (int)(N - j0) : NC;
                int64_t cs = tb ? ldb : 1, ks = tb ? 1 : ldb;   /* op(B)[k, j] at j * cs + k * ks */
                if (dtype == TIDE_F32) {
                    const float *x = (const float *)a + i * sa, *b = (const float *)B + j0 * cs;
                    float acc[NC] = {0};
                    if (n == NC)
                        for (int64_t k = 0; k < K; k++)
                            for (int c = 0; c < NC; c++) acc[c] = fmaf(x[k], b[c * cs + k * ks], acc[c]);
                    else
                        for (int64_t k = 0; k < K; k++)
                            for (int c = 0; c < n; c++) acc[c] = fmaf(x[k], b[c * cs + k * ks], acc[c]);
                    for (int c = 0; c < n; c++) {
                        float *o = (float *)C + i * ldc + j0 + c, v = (float)alpha * acc[c];
                        *o = beta == 0.0 ? v : fmaf((float)beta, *o, v);
                    }
                } else {
                    const double *x = (const double *)a + i * sa, *b = (const double *)B + j0 * cs;
                    double acc[NC] = {0};
                    if (n == NC)
                        for (int64_t k = 0; k < K; k++)
                            for (int c = 0; c < NC; c++) acc[c] = fma(x[k], b[c * cs + k * ks], acc[c]);
                    else
                        for (int64_t k = 0; k < K; k++)
                            for (int c = 0; c < n; c++) acc[c] = fma(x[k], b[c * cs + k * ks], acc[c]);
                    for (int c = 0; c < n; c++) {
                        double *o = (double *)C + i * ldc + j0 + c, v = alpha * acc[c];
                        *o = beta == 0.0 ? v : fma(beta, *o, v);
                    }
                }
            }
        pack_put(0, pa);
        return 0;
    }
    /* the panel: 4 vectors of columns (4-row tiles), or 1 or 2 when N fits them (16- and 8-row tiles) */
    int64_t VL = dtype == TIDE_F32 ? VLF : VLD;
    int nv = N <= VL ? 1 : N <= 2 * VL ? 2 : IV, ir = nv == 1 ? 16 : nv == 2 ? 8 : IR;
    int64_t PW = nv * VL, np = (N + PW - 1) / PW, nb = (M + ir - 1) / ir;
    void *pb = pack_panels(esz, tb, B, ldb, K, N, PW);
    if (!pb) { pack_put(0, pa); return -1; }
    /* a work item: a block of RB row tiles against one panel, the items of a block one after another. The block's
       rows of A and one panel both stay in L1 (8 + 16 KB at K = 64), each panel read from L2 once per block.
       A row tile against every panel in turn ran 30-45% slower from N = 192 (the panels past L1); one panel over
       all the row tiles 20-25% slower at N = 128-320 (A's rows read from L2 once per panel). */
    enum { RB = 8 };
    int64_t nrb = (nb + RB - 1) / RB;
    _Pragma("omp parallel for if(M * N * K > TIDE_OMP_MIN_FMA)")
    for (int64_t w = 0; w < np * nrb; w++)
    for (int64_t tb = (w / np) * RB, te = tb + RB < nb ? tb + RB : nb, t = tb; t < te; t++) {
        int64_t p = w % np, i0 = t * ir, j0 = p * PW;
        int m = M - i0 < ir ? (int)(M - i0) : ir, n = N - j0 < PW ? (int)(N - j0) : (int)PW;
        /* one tile, then its rows into C: alpha · out (+ beta · C), the beta test outside the loops so they vectorise */
#define TILE_AND_STORE(T, VL, SUF, FMA)                                                                       \
        {                                                                                                     \
            const T *rows[IR_MAX];                                                                            \
            T out[IR * IV * VL], al = (T)alpha, be = (T)beta;                                                 \
            for (int i = 0; i < ir; i++) rows[i] = (const T *)a + (i0 + (i < m ? i : m - 1)) * sa;            \
            const T *panel = (const T *)pb + p * K * PW;                                                      \
            /* a full tile goes straight from its registers into C; an edge tile through out */              \
            T *cd = m == ir && n == PW ? (T *)C + i0 * ldc + j0 : NULL;                                       \
            int hb = beta != 0.0;                                                                             \
            if (nv == 1) tile_##SUF##_thin1(rows, panel, K, out, cd, ldc, al, be, hb);                        \
            else if (nv == 2) tile_##SUF##_thin2(rows, panel, K, out, cd, ldc, al, be, hb);                   \
            else tile_##SUF(rows, panel, K, out, cd, ldc, al, be, hb);                                        \
            for (int i = 0; !cd && i < m; i++) {                                                              \
                T *c = (T *)C + (i0 + i) * ldc + j0;                                                          \
                const T *o = out + i * PW;                                                                    \
                if (beta == 0.0)                                                                              \
                    for (int j = 0; j < n; j++) c[j] = al * o[j];                                             \
                else                                                                                          \
                    for (int j = 0; j < n; j++) c[j] = FMA(be, c[j], al * o[j]);                              \
            }                                                                                                 \
        }
        if (dtype == TIDE_F32) TILE_AND_STORE(float, VLF, f32, fmaf)
        else TILE_AND_STORE(double, VLD, f64, fma)
#undef TILE_AND_STORE
    }
    pack_put(0, pa);
    pack_put(1, pb);
    return 0;
}

/* ---- few output columns: C = alpha A Bᵀ + beta C with N <= NARROW_MAX_N, f32 ---------------------------------
   OpenBLAS packs all of A (M x K) for a product that does only N multiply-adds per element of it, and scales C
   column by column: a router's logits (N = 16 experts, K = 256, M = 2048 tokens) ran at ~45 GFLOP/s. Here both
   operands are read in place along k (row i of A and row j of B are contiguous), each output element c_ij is one
   64-byte vector of lane partial sums over k (lane l holds the k ≡ l mod 16 terms, the last partial vector
   zero-padded), and 16 of them are reduced together by a fixed shuffle-and-add tree. A tile is NR_I rows by
   NR_J columns (16 accumulators); rows and columns past the edge reuse the last one and are not stored. Each
   element's arithmetic depends on K alone (not on M, N, the tile or the thread count). */
#define NARROW_MAX_N 32
#define NARROW_MIN_K 97
typedef float nvf __attribute__((vector_size(64)));
typedef int32_t nvi __attribute__((vector_size(64)));
enum { NVL = 16, NR_I = 4, NR_J = 4 };

static int narrow_applies(int dtype, int ta, int tb, int64_t N, int64_t K)
{
    return dtype == TIDE_F32 && !ta && tb && N <= NARROW_MAX_N && K >= NARROW_MIN_K;
}

static inline nvf nv_load(const float *p) { nvf v; memcpy(&v, p, sizeof v); return v; }
static inline nvf nv_load_part(const float *p, int n)
{
    nvf v = {0};
    memcpy(&v, p, (size_t)n * sizeof(float));
    return v;
}

/* sum the lanes of 16 vectors at once: after the stages with half-width h = 8, 4, 2, 1 lane l holds the sum of
   v[bitrev4(l)]; each sum is the same fixed tree over its vector's lanes */
static inline nvf nv_reduce16(nvf v[16])
{
#define NV_LO(h, j) ((j) & (h) ? NVL + (j) - (h) : (j))
#define NV_HI(h, j) ((j) & (h) ? NVL + (j) : (j) + (h))
#define NV_M16(f, h) f(h, 0), f(h, 1), f(h, 2), f(h, 3), f(h, 4), f(h, 5), f(h, 6), f(h, 7), f(h, 8), f(h, 9), \
                     f(h, 10), f(h, 11), f(h, 12), f(h, 13), f(h, 14), f(h, 15)
/* a two-source shuffle with a constant mask: GCC's __builtin_shuffle takes a mask vector, clang's
   __builtin_shufflevector the indices (the same lanes either way) */
#if defined(__clang__)
#define NV_SHUF(a, b, f, h) __builtin_shufflevector(a, b, NV_M16(f, h))
#else
#define NV_SHUF(a, b, f, h) __builtin_shuffle(a, b, (nvi){NV_M16(f, h)})
#endif
#define NV_STAGE(h, n)                                                                                       \
    for (int q = 0; q < (n); q++) {                                                                          \
        nvf lo = NV_SHUF(v[2 * q], v[2 * q + 1], NV_LO, h);                                                  \
        nvf hi = NV_SHUF(v[2 * q], v[2 * q + 1], NV_HI, h);                                                  \
        v[q] = lo + hi;                                                                                      \
    }
    NV_STAGE(8, 8) NV_STAGE(4, 4) NV_STAGE(2, 2) NV_STAGE(1, 1)
#undef NV_STAGE
#undef NV_SHUF
#undef NV_M16
#undef NV_HI
#undef NV_LO
    return v[0];
}

static const int nv_bitrev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

static void gemm_narrow(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                        int64_t ldb, float beta, float *C, int64_t ldc)
{
    int64_t ni = (M + NR_I - 1) / NR_I, nj = (N + NR_J - 1) / NR_J, K16 = K - K % NVL;
    int tail = (int)(K - K16);
    _Pragma("omp parallel for if(M * N * K > TIDE_OMP_MIN_FMA) schedule(static)")
    for (int64_t bi = 0; bi < ni; bi++) {
        const float *a[NR_I];
        for (int r = 0; r < NR_I; r++) a[r] = A + (bi * NR_I + r < M ? bi * NR_I + r : M - 1) * lda;
        for (int64_t bj = 0; bj < nj; bj++) {
            const float *b[NR_J];
            for (int c = 0; c < NR_J; c++) b[c] = B + (bj * NR_J + c < N ? bj * NR_J + c : N - 1) * ldb;
            nvf acc[NR_I * NR_J];
            for (int t = 0; t < NR_I * NR_J; t++) acc[t] = (nvf){0};
            for (int64_t k = 0; k < K16; k += NVL) {
                nvf av[NR_I], bv[NR_J];
                for (int r = 0; r < NR_I; r++) av[r] = nv_load(a[r] + k);
                for (int c = 0; c < NR_J; c++) bv[c] = nv_load(b[c] + k);
                for (int r = 0; r < NR_I; r++)
                    for (int c = 0; c < NR_J; c++) acc[r * NR_J + c] += av[r] * bv[c];
            }
            if (tail) {
                nvf av[NR_I], bv[NR_J];
                for (int r = 0; r < NR_I; r++) av[r] = nv_load_part(a[r] + K16, tail);
                for (int c = 0; c < NR_J; c++) bv[c] = nv_load_part(b[c] + K16, tail);
                for (int r = 0; r < NR_I; r++)
                    for (int c = 0; c < NR_J; c++) acc[r * NR_J + c] += av[r] * bv[c];
            }
            /* slot s of the tree gets the accumulator whose sum should land in lane s */
            nvf v[16];
            for (int s = 0; s < 16; s++) v[s] = acc[nv_bitrev4[s]];
            nvf sum = nv_reduce16(v);
            for (int r = 0; r < NR_I; r++) {
                int64_t i = bi * NR_I + r;
                if (i >= M) break;
                for (int c = 0; c < NR_J; c++) {
                    int64_t j = bj * NR_J + c;
                    if (j >= N) break;
                    float *o = C + i * ldc + j, x = alpha * sum[r * NR_J + c];
                    *o = beta == 0.0f ? x : fmaf(beta, *o, x);
                }
            }
        }
    }
}

/* ---- a long inner dimension: C = Aᵀ B over many rows (a weight gradient summed over a batch's tokens) ----------
   At M, N <= 64 and K = 4,096 OpenBLAS ran at 80-140 GFLOP/s on 2 cores: its threads split the small C and it
   packs both operands. Here the K rows go in fixed segments of LK_SEG: each segment's partial C is a register
   tile's fused multiply-add chains over its rows in order (LK_MR rows of C by two vectors of columns, A's values
   broadcast from their rows, B's rows loaded as they are; the segment's rows in L1-sized blocks, every tile of an
   item over one block before the next, each chain carried from block to block), the items (segment, panel of LK_MP
   rows of C) run in parallel, and C sums the segments' partials in segment order. A weight gradient's operands
   usually come from memory, not the cache: the items go to the threads in turn, and a thread prefetches the rows of
   its next item while it computes this one (64 x 64 over 4,096 cold rows: 190 -> 163 us, one-off). Rows and columns
   at the edges run the same tile on zero-padded copies (a padded lane adds nothing to the others), each edge tile's
   chains in a buffer of their own. Each element's arithmetic depends on K alone, not on M, N or the thread count.
   250-265 GFLOP/s at those shapes (the one-off comparison behind LK_MIN_K and LK_MAX_MN: at 256 x 256 x 1,024 the
   two are even on 2 threads, and on one thread, as a MoE expert's weight gradient runs inside its parallel region,
   OpenBLAS is ahead there: 127 against 110 GFLOP/s at K = 8,192). */
#define LK_SEG 512
#define LK_MIN_K 1024
#define LK_MAX_MN 32768
#define LK_MP 64
#if defined(__AVX512F__)
#define LK_MR 8             /* 16 accumulators of the 32 vector registers */
#else
#define LK_MR 4             /* 8 of 16 */
#endif
enum { LK_NR = 2 * VLF };

static int long_k_applies(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K)
{
    return dtype == TIDE_F32 && ta && !tb && K >= LK_MIN_K && M * N <= LK_MAX_MN;
}

/* P [LK_MR][LK_NR] (rows ldp apart) = the chains over k < kn of a[k][0..LK_MR) (rows lda apart) with
   b[k][0..LK_NR) (rows ldb apart), each chain continued from P's value when `more` (a later block of the segment's
   rows: the same fused multiply-adds in the same order, so the same bits as one pass), from 0 otherwise; the lines
   pf[0 .. 64 pfn) are prefetched into L2 on the way, one per k */
static void lk_tile(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t kn, float *P, int64_t ldp,
                    int more, const char *pf, int64_t pfn)
{
    tvf c[LK_MR][2];
    for (int i = 0; i < LK_MR; i++) {
        if (more) {
            memcpy(&c[i][0], P + i * ldp, sizeof c[i][0]);
            memcpy(&c[i][1], P + i * ldp + VLF, sizeof c[i][1]);
        } else {
            c[i][0] = c[i][1] = vset_f32(0.0f);
        }
    }
    for (int64_t k = 0; k < kn; k++) {
        if (k < pfn) __builtin_prefetch(pf + 64 * k, 0, 2);
        const float *ak = a + k * lda, *bk = b + k * ldb;
        tvf b0, b1;
        memcpy(&b0, bk, sizeof b0);
        memcpy(&b1, bk + VLF, sizeof b1);
#pragma GCC unroll 8
        for (int i = 0; i < LK_MR; i++) {
            tvf x = vset_f32(ak[i]);
            c[i][0] = vfma_f32(x, b0, c[i][0]);
            c[i][1] = vfma_f32(x, b1, c[i][1]);
        }
    }
    for (int i = 0; i < LK_MR; i++) {
        memcpy(P + i * ldp, &c[i][0], sizeof c[i][0]);
        memcpy(P + i * ldp + VLF, &c[i][1], sizeof c[i][1]);
    }
}

/* the first nr rows of a row-major block (rows ld apart), columns [c0, c0 + nc), into out [nr][w], zeros past nc */
static void lk_pad(float *out, int64_t w, const float *x, int64_t ld, int64_t nr, int64_t c0, int64_t nc)
{
    for (int64_t r = 0; r < nr; r++) {
        float *o = out + r * w;
        memcpy(o, x + r * ld + c0, (size_t)nc * sizeof(float));
        for (int64_t c = nc; c < w; c++) o[c] = 0.0f;
    }
}

/* the rows of the item a thread takes next, to prefetch while it computes this one: two byte ranges (A's rows, B's
   rows), walked by a cursor */
typedef struct { const char *p[2]; int64_t lines[2], at; } lk_next;

/* the next count lines of the walk (a part of one range; fewer at its end): their start, *got set */
static const char *lk_next_lines(lk_next *nx, int64_t count, int64_t *got)
{
    int64_t at = nx->at, r = at < nx->lines[0] ? 0 : 1, off = r ? at - nx->lines[0] : at;
    int64_t left = nx->lines[r] - off;
    *got = left <= 0 ? 0 : left < count ? left : count;
    nx->at += *got;
    return nx->p[r] + 64 * off;
}

/* rows of a block of the segment: the block's rows of A (the item's <= LK_MP columns) and of B in about 32 KB, so
   they stay in L1 while every tile of the item walks them (a tile walking all the segment's rows read them from L2
   at every k: 64 x 64 over 4,096 rows ran at 115 GFLOP/s on one core) */
static int64_t lk_block_rows(int64_t mcols, int64_t N)
{
    int64_t r = (32768 / (int64_t)sizeof(float)) / (mcols + N);
    r -= r % 8;
    return r < 8 ? 8 : r;
}

/* one item: the partial P [M, N] of the segment's kn rows (A and B at its first row) for C rows [m0, m1), in blocks
   of rows, every tile over one block before the next; the rows of the next item (nx) are prefetched along the way,
   an equal part during each tile */
static void lk_item(const float *A, int64_t lda, const float *B, int64_t ldb, int64_t kn, int64_t m0, int64_t m1,
                    int64_t N, float *P, float *pad, lk_next *nx)
{
    int64_t NB = N - N % LK_NR, mt = (m1 - m0 + LK_MR - 1) / LK_MR, nt = (N + LK_NR - 1) / LK_NR;
    int64_t KB = lk_block_rows(m1 - m0, N), nkb = (kn + KB - 1) / KB;
    int64_t per = (nx->lines[0] + nx->lines[1] + mt * nt * nkb - 1) / (mt * nt * nkb), got;
    int64_t mlast = m0 + (mt - 1) * LK_MR, mrl = m1 - mlast;
    /* pad: at, bt, then the edge tiles' chains [nt + mt][LK_MR · LK_NR] (the last row tile's by column tile, then
       the last column tile's by row tile), kept there from block to block */
    float *at = pad, *bt = pad + LK_SEG * LK_MR, *edge = bt + LK_SEG * LK_NR;
    /* zero-padded copies of the edge columns of B and of the last rows of C's A columns, over the whole segment */
    if (NB < N) lk_pad(bt, LK_NR, B, ldb, kn, NB, N - NB);
    if (mrl < LK_MR) lk_pad(at, LK_MR, A, lda, kn, mlast, mrl);
    for (int64_t k0 = 0; k0 < kn; k0 += KB) {
        int64_t kb = kn - k0 < KB ? kn - k0 : KB;
        int more = k0 > 0;
        for (int64_t m = m0; m < m1; m += LK_MR) {
            int64_t mr = m1 - m < LK_MR ? m1 - m : LK_MR;
            const float *a = mr < LK_MR ? at + k0 * LK_MR : A + k0 * lda + m;
            int64_t la = mr < LK_MR ? LK_MR : lda;
            for (int64_t n = 0; n < N; n += LK_NR) {
                int full_n = n < NB;
                const float *b = full_n ? B + k0 * ldb + n : bt + k0 * LK_NR;
                int64_t lb = full_n ? ldb : LK_NR;
                const char *pf = lk_next_lines(nx, per < kb ? per : kb, &got);
                if (mr == LK_MR && full_n) {
                    lk_tile(a, la, b, lb, kb, P + m * N + n, N, more, pf, got);
                    continue;
                }
                /* an edge tile: its chains in its own block of `edge` (the padded lanes are never stored) */
                float *e = edge + (mr < LK_MR ? n / LK_NR : nt + (m - m0) / LK_MR) * (LK_MR * LK_NR);
                lk_tile(a, la, b, lb, kb, e, LK_NR, more, pf, got);
            }
        }
    }
    for (int64_t m = m0; m < m1; m += LK_MR)
        for (int64_t n = 0; n < N; n += LK_NR) {
            int64_t mr = m1 - m < LK_MR ? m1 - m : LK_MR, nc = n < NB ? LK_NR : N - NB;
            if (mr == LK_MR && n < NB) continue;
            const float *e = edge + (mr < LK_MR ? n / LK_NR : nt + (m - m0) / LK_MR) * (LK_MR * LK_NR);
            for (int64_t i = 0; i < mr; i++) memcpy(P + (m + i) * N + n, e + i * LK_NR, (size_t)nc * sizeof(float));
        }
}

/* C = alpha Aᵀ B + beta C, A [K, M] and B [K, N] row-major; -1 when out of memory */
static int gemm_long_k(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                       int64_t ldb, float beta, float *C, int64_t ldc)
{
    int64_t nseg = (K + LK_SEG - 1) / LK_SEG, npan = (M + LK_MP - 1) / LK_MP, items = nseg * npan;
    /* the partials from the engine's pool on the calling thread (a fresh malloc of this size is an mmap whose pages
       fault in at every call: 128 KB at 64 x 64 over 4,096 rows); malloc inside a parallel region (a MoE expert's
       weight gradient), where the pool is not to be used */
    size_t pbytes = (size_t)(nseg * M * N) * sizeof(float);
    int pooled = !omp_in_parallel();
    float *P = pooled ? tide_scratch_alloc(TIDE_CPU_DEVICE, pbytes) : malloc(pbytes);
    if (!P) return -1;
    int failed = 0;
    _Pragma("omp parallel if(items > 1)")
    {
        float *pad = malloc(((size_t)LK_SEG * (LK_MR + LK_NR) +
                             (size_t)(LK_MP / LK_MR + (N + LK_NR - 1) / LK_NR) * (LK_MR * LK_NR)) * sizeof *pad);
        if (!pad) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        /* items in turn over the threads (static, 1), so a thread knows its next item and prefetches its rows */
        int64_t nth = omp_get_num_threads();
        _Pragma("omp for schedule(static, 1)")
        for (int64_t it = 0; it < items; it++) {
            if (!pad) continue;
            int64_t s = it / npan, m0 = (it % npan) * LK_MP, m1 = m0 + LK_MP < M ? m0 + LK_MP : M;
            int64_t k0 = s * LK_SEG, kn = K - k0 < LK_SEG ? K - k0 : LK_SEG;
            lk_next nx = {{NULL, NULL}, {0, 0}, 0};
            if (it + nth < items) {
                int64_t s2 = (it + nth) / npan, k2 = s2 * LK_SEG, kn2 = K - k2 < LK_SEG ? K - k2 : LK_SEG;
                nx.p[0] = (const char *)(A + k2 * lda);
                nx.p[1] = (const char *)(B + k2 * ldb);
                nx.lines[0] = (int64_t)(((size_t)((kn2 - 1) * lda + M) * sizeof(float) + 63) / 64);
                nx.lines[1] = (int64_t)(((size_t)((kn2 - 1) * ldb + N) * sizeof(float) + 63) / 64);
            }
            lk_item(A + k0 * lda, lda, B + k0 * ldb, ldb, kn, m0, m1, N, P + s * M * N, pad, &nx);
        }
        free(pad);
    }
    if (!failed) {
        _Pragma("omp parallel for if(M * N > TIDE_OMP_MIN) schedule(static)")
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) {
                float sum = P[m * N + n];
                for (int64_t g = 1; g < nseg; g++) sum += P[(g * M + m) * N + n];
                float *c = C + m * ldc + n;
                *c = beta == 0.0f ? alpha * sum : alpha * sum + beta * *c;
            }
    }
    if (pooled) tide_scratch_free(TIDE_CPU_DEVICE, P);
    else free(P);
    return failed ? -1 : 0;
}

/* C[M, N] = beta C when the product is empty (K = 0); beta = 0 overwrites, so NaN in C does not survive */
static void scale_c(int dtype, void *C, int64_t ldc, int64_t M, int64_t N, double beta)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            if (dtype == TIDE_F32) {
                float *c = (float *)C + i * ldc + j;
                *c = beta == 0.0 ? 0.0f : (float)beta * *c;
            } else {
                double *c = (double *)C + i * ldc + j;
                *c = beta == 0.0 ? 0.0 : beta * *c;
            }
        }
}

/* sizes, leading dimensions (BLAS demands ld >= stored columns, >= 1) and the 32-bit BLAS int range */
static int check_gemm(const char *what, int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K,
                      int64_t lda, int64_t ldb, int64_t ldc)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s not supported on cpu (expected f32 or f64)", what, tide_cpu_dtype_str(dtype));
    if (M < 0 || N < 0 || K < 0)
        return tide_set_error("%s: sizes M = %lld, N = %lld, K = %lld must be >= 0", what, (long long)M,
                              (long long)N, (long long)K);
    int64_t acols = ta ? M : K, bcols = tb ? K : N;
    int64_t amin = acols > 1 ? acols : 1, bmin = bcols > 1 ? bcols : 1, cmin = N > 1 ? N : 1;
    if (lda < amin || ldb < bmin || ldc < cmin)
        return tide_set_error("%s: leading dimensions lda = %lld, ldb = %lld, ldc = %lld are smaller than the "
                              "row lengths %lld, %lld, %lld", what, (long long)lda, (long long)ldb,
                              (long long)ldc, (long long)amin, (long long)bmin, (long long)cmin);
    if (M > INT_MAX || N > INT_MAX || K > INT_MAX || lda > INT_MAX || ldb > INT_MAX || ldc > INT_MAX)
        return tide_set_error("%s: sizes M = %lld, N = %lld, K = %lld (or a leading dimension) exceed the "
                              "BLAS integer range %d", what, (long long)M, (long long)N, (long long)K, INT_MAX);
    return 0;
}

/* one product, arguments already checked; -1 when the invariant kernel is out of memory */
/* Products with a short inner dimension: OpenBLAS packs both operands and zeroes C before it accumulates, which at
   K <= 96 costs more than the products (the d = 64 models' projections ran at 50-145 GFLOP/s); our kernel reads A
   in place and runs 145-180 there (2 cores, AVX2 lanes). f32 with A not transposed (packing Aᵀ loses), M >= 256. */
#define OWN_MAX_K 96
#define OWN_MIN_M 256
static int own_is_faster(int dtype, int ta, int64_t M, int64_t K)
{
    return dtype == TIDE_F32 && !ta && K <= OWN_MAX_K && M >= OWN_MIN_M;
}

static int gemm_one(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                     const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    if (M == 0 || N == 0) return 0;
    if (K == 0) { scale_c(dtype, C, ldc, M, N, beta); return 0; }
    if (g_batch_invariant || own_is_faster(dtype, ta, M, K)) {
        if (gemm_invariant(dtype, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc))
            return tide_set_error("gemm: out of memory packing a %lld x %lld operand", (long long)K,
                                  (long long)(ta ? M : N));
        return 0;
    }
    if (narrow_applies(dtype, ta, tb, N, K)) {
        gemm_narrow(M, N, K, (float)alpha, A, lda, B, ldb, (float)beta, C, ldc);
        return 0;
    }
    if (long_k_applies(dtype, ta, tb, M, N, K)) {
        if (gemm_long_k(M, N, K, (float)alpha, A, lda, B, ldb, (float)beta, C, ldc))
            return tide_set_error("gemm: out of memory for the partial sums of a %lld x %lld product over %lld rows",
                                  (long long)M, (long long)N, (long long)K);
        return 0;
    }
    /* OpenBLAS zeroes C for beta = 0 with ordinary stores; a C past the caches is zeroed faster by streaming stores
       (tide_cpu_zero_rows) and the product added onto it: the same bits (0 + x), 5 ms less at 1,024 x 50,304 x 256 */
    size_t esz = dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    if (beta == 0.0 && (size_t)M * (size_t)N * esz >= TIDE_CPU_ZERO_STREAM_MIN) {
        tide_cpu_zero_rows(C, M, (size_t)N * esz, (size_t)ldc * esz);
        beta = 1.0;
    }
    enum CBLAS_TRANSPOSE opa = ta ? CblasTrans : CblasNoTrans, opb = tb ? CblasTrans : CblasNoTrans;
    if (dtype == TIDE_F32)
        cblas_sgemm(CblasRowMajor, opa, opb, (int)M, (int)N, (int)K, (float)alpha, A, (int)lda, B, (int)ldb,
                    (float)beta, C, (int)ldc);
    else
        cblas_dgemm(CblasRowMajor, opa, opb, (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta,
                    C, (int)ldc);
    return 0;
}

int tide_cpu_gemm(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A,
                  int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    if (check_gemm("gemm", dtype, ta, tb, M, N, K, lda, ldb, ldc)) return -1;
    return gemm_one(dtype, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

int tide_cpu_gemm_batched(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                          const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                          double beta, void *C, int64_t ldc, int64_t sc, int64_t batch)
{
    if (check_gemm("gemm_batched", dtype, ta, tb, M, N, K, lda, ldb, ldc)) return -1;
    if (batch < 0) return tide_set_error("gemm_batched: batch = %lld must be >= 0", (long long)batch);
    size_t esz = dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    for (int64_t b = 0; b < batch; b++)
        if (gemm_one(dtype, ta, tb, M, N, K, alpha, (const char *)A + b * sa * (int64_t)esz, lda,
                 (const char *)B + b * sb * (int64_t)esz, ldb, beta, (char *)C + b * sc * (int64_t)esz, ldc))
            return -1;
    return 0;
}

/*
 * gemm.c — matrix products through CBLAS (row-major), float32 and float64 (kernels/backend.h).
 *
 * We link the OpenMP build of OpenBLAS, which threads each call itself, so the batched product is a plain
 * loop of threaded products. A call made inside an active OpenMP parallel region runs single-threaded
 * (OpenBLAS checks omp_in_parallel()). A threaded product's bits depend on the thread count (its threads
 * split the output and the edge micro-kernels round differently); moe.c relies on the single-threaded
 * case for its thread-count-invariant tiles.
 *
 * Batch-invariant mode (tide_set_batch_invariant): BLAS picks its blocking and edge kernels from M, so row i of
 * an M-row product need not equal the same row computed alone. A decode step of R rows must give each row the
 * bits it gets as a one-row step (rl.md oracle 9: a replayed row equals the batched sampling that made it), so in
 * this mode every product runs our own kernel: each output element is one dot product over k in an order fixed
 * by K alone (lane k mod W of W accumulators, the last block zero-padded, one fixed reduction tree), whatever M,
 * N, the leading dimensions, the blocking or the thread count.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include "cpu.h"

static int g_batch_invariant;

int tide_cpu_set_batch_invariant(int on) { int prev = g_batch_invariant; g_batch_invariant = on ? 1 : 0; return prev; }
int tide_cpu_batch_invariant(void) { return g_batch_invariant; }

/* the fixed-order dot products of two rows a0, a1 with four rows b0..b3 (each load shared): W = one vector of 8
   floats (of 4 doubles), element k goes to lane k mod W, the last block zero-padded, then one reduction tree. Every
   output element of a product goes through this one function (a short group repeats its last row), so each is
   computed by the same instructions whatever M, N or the position of its row. */
typedef float v8f __attribute__((vector_size(32)));
typedef double v4d __attribute__((vector_size(32)));

#define DEFINE_DOT24(T, V, VL, SUF)                                                                          \
    static inline void step24_##SUF(V acc[2][4], const T *a0, const T *a1, const T *const *b)              \
    {                                                                                                         \
        V x0, x1;                                                                                             \
        memcpy(&x0, a0, sizeof(V));                                                                           \
        memcpy(&x1, a1, sizeof(V));                                                                           \
        for (int j = 0; j < 4; j++) {                                                                         \
            V y;                                                                                              \
            memcpy(&y, b[j], sizeof y);                                                                       \
            acc[0][j] += x0 * y;                                                                              \
            acc[1][j] += x1 * y;                                                                              \
        }                                                                                                     \
    }                                                                                                         \
    static void dot24_##SUF(const T *a0, const T *a1, const T *const *b, int64_t K, T out[2][4])            \
    {                                                                                                         \
        enum { W = VL };                                                                                      \
        V acc[2][4] = {{{0}}};                                                                                \
        int64_t k = 0;                                                                                        \
        for (; k + W <= K; k += W) {                                                                          \
            const T *bk[4] = {b[0] + k, b[1] + k, b[2] + k, b[3] + k};                                        \
            step24_##SUF(acc, a0 + k, a1 + k, bk);                                                            \
        }                                                                                                     \
        if (k < K) { /* the last block, zero-padded: the same lanes as a longer K whose tail is zero */       \
            T pa[2][W], pb[4][W];                                                                             \
            memset(pa, 0, sizeof pa);                                                                         \
            memset(pb, 0, sizeof pb);                                                                         \
            memcpy(pa[0], a0 + k, (size_t)(K - k) * sizeof(T));                                               \
            memcpy(pa[1], a1 + k, (size_t)(K - k) * sizeof(T));                                               \
            for (int j = 0; j < 4; j++) memcpy(pb[j], b[j] + k, (size_t)(K - k) * sizeof(T));                 \
            const T *bk[4] = {pb[0], pb[1], pb[2], pb[3]};                                                    \
            step24_##SUF(acc, pa[0], pa[1], bk);                                                              \
        }                                                                                                     \
        for (int i = 0; i < 2; i++)                                                                           \
            for (int j = 0; j < 4; j++) {                                                                     \
                T l[VL];                                                                                      \
                memcpy(l, &acc[i][j], sizeof l);                                                              \
                for (int w = VL / 2; w >= 1; w /= 2)                                                          \
                    for (int q = 0; q < w; q++) l[q] = l[q] + l[q + w];                                       \
                out[i][j] = l[0];                                                                             \
            }                                                                                                 \
    }
DEFINE_DOT24(float, v8f, 8, f32)
DEFINE_DOT24(double, v4d, 4, f64)

/* rows [n, K] contiguous from a [K, n] matrix with leading dimension ld (a transposed operand), in tiles */
static void *pack_rows(size_t esz, const void *src, int64_t ld, int64_t K, int64_t n)
{
    char *dst = malloc((size_t)(n * K) * esz + 1);
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

/* C = alpha op(A) op(B) + beta C with every element a fixed-order dot product; -1 when out of memory */
static int gemm_invariant(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                          const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    size_t esz = dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    void *pa = ta ? pack_rows(esz, A, lda, K, M) : NULL, *pb = tb ? NULL : pack_rows(esz, B, ldb, K, N);
    if ((ta && !pa) || (!tb && !pb)) { free(pa); free(pb); return -1; }
    const char *a = pa ? pa : A, *b = pb ? pb : B;
    int64_t sa = ta ? K : lda, sb = tb ? ldb : K;
    _Pragma("omp parallel for if(M * N * K > TIDE_OMP_MIN)")
    for (int64_t i0 = 0; i0 < M; i0 += 2)
        for (int64_t j0 = 0; j0 < N; j0 += 4) {
            int m = M - i0 < 2 ? (int)(M - i0) : 2, n = N - j0 < 4 ? (int)(N - j0) : 4;
            if (dtype == TIDE_F32) {
                const float *rows[4], *a0 = (const float *)a + i0 * sa, *a1 = a0 + (m - 1) * sa;
                float d[2][4];
                for (int j = 0; j < 4; j++) rows[j] = (const float *)b + (j0 + (j < n ? j : n - 1)) * sb;
                dot24_f32(a0, a1, rows, K, d);
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < n; j++) {
                        float *c = (float *)C + (i0 + i) * ldc + j0 + j, v = (float)alpha * d[i][j];
                        *c = beta == 0.0 ? v : v + (float)beta * *c;
                    }
            } else {
                const double *rows[4], *a0 = (const double *)a + i0 * sa, *a1 = a0 + (m - 1) * sa;
                double d[2][4];
                for (int j = 0; j < 4; j++) rows[j] = (const double *)b + (j0 + (j < n ? j : n - 1)) * sb;
                dot24_f64(a0, a1, rows, K, d);
                for (int i = 0; i < m; i++)
                    for (int j = 0; j < n; j++) {
                        double *c = (double *)C + (i0 + i) * ldc + j0 + j, v = alpha * d[i][j];
                        *c = beta == 0.0 ? v : v + beta * *c;
                    }
            }
        }
    free(pa); free(pb);
    return 0;
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
static int gemm_one(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                     const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    if (M == 0 || N == 0) return 0;
    if (K == 0) { scale_c(dtype, C, ldc, M, N, beta); return 0; }
    if (g_batch_invariant) {
        if (gemm_invariant(dtype, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc))
            return tide_set_error("gemm: out of memory packing a %lld x %lld operand", (long long)K,
                                  (long long)(ta ? M : N));
        return 0;
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

/*
 * gemm.c — matrix products through CBLAS (row-major), float32 and float64 (kernels/backend.h).
 *
 * We link the OpenMP build of OpenBLAS, which threads each call itself, so the batched product is a plain
 * loop of threaded products. A call made inside an active OpenMP parallel region runs single-threaded
 * (OpenBLAS checks omp_in_parallel()). A threaded product's bits depend on the thread count (its threads
 * split the output and the edge micro-kernels round differently); moe.c relies on the single-threaded
 * case for its thread-count-invariant tiles.
 */
#include <limits.h>
#include <cblas.h>
#include "cpu.h"

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

/* one product, arguments already checked */
static void gemm_one(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                     const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    if (M == 0 || N == 0) return;
    if (K == 0) { scale_c(dtype, C, ldc, M, N, beta); return; }
    enum CBLAS_TRANSPOSE opa = ta ? CblasTrans : CblasNoTrans, opb = tb ? CblasTrans : CblasNoTrans;
    if (dtype == TIDE_F32)
        cblas_sgemm(CblasRowMajor, opa, opb, (int)M, (int)N, (int)K, (float)alpha, A, (int)lda, B, (int)ldb,
                    (float)beta, C, (int)ldc);
    else
        cblas_dgemm(CblasRowMajor, opa, opb, (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta,
                    C, (int)ldc);
}

int tide_cpu_gemm(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A,
                  int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    if (check_gemm("gemm", dtype, ta, tb, M, N, K, lda, ldb, ldc)) return -1;
    gemm_one(dtype, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return 0;
}

int tide_cpu_gemm_batched(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                          const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                          double beta, void *C, int64_t ldc, int64_t sc, int64_t batch)
{
    if (check_gemm("gemm_batched", dtype, ta, tb, M, N, K, lda, ldb, ldc)) return -1;
    if (batch < 0) return tide_set_error("gemm_batched: batch = %lld must be >= 0", (long long)batch);
    size_t esz = dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    for (int64_t b = 0; b < batch; b++)
        gemm_one(dtype, ta, tb, M, N, K, alpha, (const char *)A + b * sa * (int64_t)esz, lda,
                 (const char *)B + b * sb * (int64_t)esz, ldb, beta, (char *)C + b * sc * (int64_t)esz, ldc);
    return 0;
}

/*
 * gemm.cu — dense matrix products through cuBLAS.
 *
 * The engine is row-major and cuBLAS column-major. A row-major matrix with row stride ld is, read
 * column-major, its transpose with leading dimension ld. So row-major C = op(A) op(B) is computed as
 * the column-major product C^T = op(B)^T op(A)^T: cuBLAS gets (B, A) swapped, m = N, n = M, and each
 * operand's transpose flag unchanged (op(B)^T of the column-major view of B is B stored as given).
 *
 * f32: fp32 in, fp32 compute (no TF32). bf16: bf16 in and out, fp32 compute. f64: fp64 throughout.
 * tide_cuda_gemm_f32out: f32 or bf16 in, C in fp32 (a sum kept over several calls, beta = 1, stays fp32).
 */
#include "common.cuh"

/* cuBLAS takes 32-bit sizes and leading dimensions */
static int gemm_check(const char *what, int ta, int tb, int64_t M, int64_t N, int64_t K, int64_t *lda, int64_t *ldb,
                      int64_t *ldc)
{
    if (M < 0 || N < 0 || K < 0)
        return tide_set_error("%s: negative size M %lld N %lld K %lld", what, (long long)M, (long long)N,
                              (long long)K);
    if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
        return tide_set_error("%s: size M %lld N %lld K %lld exceeds cuBLAS's 32-bit limit", what, (long long)M,
                              (long long)N, (long long)K);
    /* stored shapes (row-major rows x cols): A is [M, K] or [K, M]; B is [K, N] or [N, K]; C is [M, N].
       A single stored row has no meaningful row stride, so cuBLAS's ld >= cols rule is met by fixing it. */
    int64_t arows = ta ? K : M, acols = ta ? M : K;
    int64_t brows = tb ? N : K, bcols = tb ? K : N;
    if (arows <= 1 && *lda < acols) *lda = acols;
    if (brows <= 1 && *ldb < bcols) *ldb = bcols;
    if (M <= 1 && *ldc < N) *ldc = N;
    if (*lda < 1) *lda = 1;
    if (*ldb < 1) *ldb = 1;
    if (*ldc < 1) *ldc = 1;
    if (*lda < acols || *ldb < bcols || *ldc < N)
        return tide_set_error("%s: row strides too small (lda %lld for %lld columns, ldb %lld for %lld, ldc %lld for %lld)",
                              what, (long long)*lda, (long long)acols, (long long)*ldb, (long long)bcols,
                              (long long)*ldc, (long long)N);
    if (*lda > INT_MAX || *ldb > INT_MAX || *ldc > INT_MAX)
        return tide_set_error("%s: row stride exceeds cuBLAS's 32-bit limit", what);
    return 0;
}

/* C = beta C for a [M, N] block with row stride ldc (used when K = 0: the product is empty) */
template <typename T> __global__ void scale_rows_kernel(T *C, int64_t M, int64_t N, int64_t ldc, int64_t sc,
                                                        int64_t batch, TIDE_ACC(T) beta)
{
    TIDE_GRID_LOOP(k, batch * M * N) {
        int64_t b = k / (M * N), r = (k / N) % M, c = k % N;
        T *p = C + b * sc + r * ldc + c;
        /* beta = 0 overwrites, so stale NaNs in C do not survive (the BLAS convention) */
        tide_st(p, 0, beta == TIDE_ACC(T)(0) ? TIDE_ACC(T)(0) : beta * tide_ld(p, 0));
    }
}

static int gemm_scale_only(int dtype, void *C, int64_t M, int64_t N, int64_t ldc, int64_t sc, int64_t batch,
                           double beta, cudaStream_t s)
{
    if (beta == 1.0) return 0;
    TIDE_FLOAT_DISPATCH(dtype, "gemm", {
        scale_rows_kernel<T><<<tide_blocks(batch * M * N), TIDE_THREADS, 0, s>>>((T *)C, M, N, ldc, sc, batch,
                                                                                 (TIDE_ACC(T))beta);
        TIDE_CU_LAUNCH("gemm scale kernel");
    });
    return 0;
}

static int gemm_types(int dtype, cudaDataType_t *type, cublasComputeType_t *compute)
{
    switch (dtype) {
    case TIDE_F32: *type = CUDA_R_32F; *compute = CUBLAS_COMPUTE_32F; return 0;
    case TIDE_F64: *type = CUDA_R_64F; *compute = CUBLAS_COMPUTE_64F; return 0;
    case TIDE_BF16: *type = CUDA_R_16BF; *compute = CUBLAS_COMPUTE_32F; return 0;
    }
    return tide_set_error("gemm: dtype %s is not supported on the cuda backend (f32, f64, bf16)",
                          tide_cuda_dtype_str(dtype));
}

/* one entry for all: batch = 1 with zero strides is the plain product; cdtype: C's dtype (dtype, or f32 for bf16
   operands) */
static int gemm_any(const char *what, int dtype, int cdtype, int ta, int tb, int64_t M, int64_t N, int64_t K,
                    double alpha, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                    double beta, void *C, int64_t ldc, int64_t sc, int64_t batch)
{
    if (gemm_check(what, ta, tb, M, N, K, &lda, &ldb, &ldc)) return -1;
    if (batch < 0) return tide_set_error("%s: negative batch %lld", what, (long long)batch);
    if (batch > INT_MAX) return tide_set_error("%s: batch %lld exceeds cuBLAS's 32-bit limit", what, (long long)batch);
    if (cdtype != dtype && !(cdtype == TIDE_F32 && dtype == TIDE_BF16))
        return tide_set_error("%s: a %s product into %s is not supported (C has the operands' dtype, or f32 for bf16)",
                              what, tide_cuda_dtype_str(dtype), tide_cuda_dtype_str(cdtype));
    if (M == 0 || N == 0 || batch == 0) return 0;
    cudaDataType_t type = CUDA_R_32F, ctype = CUDA_R_32F;
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F, ccompute;
    if (gemm_types(dtype, &type, &compute) || gemm_types(cdtype, &ctype, &ccompute)) return -1;
    TIDE_STREAM(s);
    if (K == 0) return gemm_scale_only(cdtype, C, M, N, ldc, sc, batch, beta, s);
    cublasHandle_t h;
    if (tide_cuda_get_cublas(&h)) return -1;
    /* scalars match the compute type: double for fp64, float otherwise */
    float af = (float)alpha, bf = (float)beta;
    const void *pa = dtype == TIDE_F64 ? (const void *)&alpha : (const void *)&af;
    const void *pb = dtype == TIDE_F64 ? (const void *)&beta : (const void *)&bf;
    cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;  /* first cuBLAS operand: B */
    cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;  /* second: A */
    if (batch == 1) {
        TIDE_CUBLAS(cublasGemmEx(h, opb, opa, (int)N, (int)M, (int)K, pa, B, type, (int)ldb, A, type, (int)lda, pb,
                                 C, ctype, (int)ldc, compute, CUBLAS_GEMM_DEFAULT),
                    what);
    } else {
        TIDE_CUBLAS(cublasGemmStridedBatchedEx(h, opb, opa, (int)N, (int)M, (int)K, pa, B, type, (int)ldb,
                                               (long long)sb, A, type, (int)lda, (long long)sa, pb, C, ctype,
                                               (int)ldc, (long long)sc, (int)batch, compute, CUBLAS_GEMM_DEFAULT),
                    what);
    }
    return 0;
}

int tide_cuda_gemm(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A,
                   int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    return gemm_any("gemm", dtype, dtype, ta, tb, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
}

int tide_cuda_gemm_batched(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                           const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                           double beta, void *C, int64_t ldc, int64_t sc, int64_t batch)
{
    return gemm_any("gemm_batched", dtype, dtype, ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc,
                    batch);
}

int tide_cuda_gemm_f32out(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A,
                          int64_t lda, const void *B, int64_t ldb, double beta, float *C, int64_t ldc)
{
    return gemm_any("gemm (fp32 out)", dtype, TIDE_F32, ta, tb, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0,
                    1);
}

// emu_cublas.h — cuBLAS's GEMMs as its documentation states them, for harnesses that run the real gemm.cu:
// cublasGemmEx and cublasGemmStridedBatchedEx, column-major, op N or T per operand, A and B of one type and C of that
// type (R_32F, R_64F, R_16BF) or R_32F for R_16BF operands; COMPUTE_32F (float scalars) for R_32F and R_16BF,
// COMPUTE_64F (double scalars) for R_64F; beta = 0 ignores what C held (NaN included). Products accumulate in fp64
// and round once to C's type. A failure says why, since a status alone says little. Included after emu_host.h.
#pragma once
#include <cstdio>

namespace emu {
int n_cublas_gemm = 0;   // GEMM calls (each batch counted once)
inline double cublas_ld(cudaDataType_t t, const void *p, int64_t i)
{
    if (t == CUDA_R_64F) return ((const double *)p)[i];
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}
inline void cublas_st(cudaDataType_t t, void *p, int64_t i, double v)
{
    if (t == CUDA_R_64F) ((double *)p)[i] = v;
    else if (t == CUDA_R_32F) ((float *)p)[i] = (float)v;
    else ((__nv_bfloat16 *)p)[i] = __float2bfloat16((float)v);
}
inline int64_t cublas_es(cudaDataType_t t) { return t == CUDA_R_64F ? 8 : t == CUDA_R_32F ? 4 : 2; }
inline cublasStatus_t cublas_fail(cublasStatus_t st, const char *why)
{
    printf("  emu cuBLAS GEMM: %s\n", why);
    return st;
}
inline cublasStatus_t cublas_gemm(cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                                  const void *alpha, const void *A, cudaDataType_t Atype, int lda, long long sa,
                                  const void *B, cudaDataType_t Btype, int ldb, long long sb, const void *beta, void *C,
                                  cudaDataType_t Ctype, int ldc, long long sc, int batch, cublasComputeType_t compute)
{
    n_cublas_gemm++;
    bool f64 = Atype == CUDA_R_64F;
    if (Atype != Btype) return cublas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "A and B types differ");
    if (!(Ctype == Atype || (Atype == CUDA_R_16BF && Ctype == CUDA_R_32F)))
        return cublas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "C type for these operands");
    if (!((Atype == CUDA_R_32F || Atype == CUDA_R_16BF) && compute == CUBLAS_COMPUTE_32F) &&
        !(f64 && compute == CUBLAS_COMPUTE_64F))
        return cublas_fail(CUBLAS_STATUS_NOT_SUPPORTED, "type and compute type");
    bool ops = (transa == CUBLAS_OP_N || transa == CUBLAS_OP_T) && (transb == CUBLAS_OP_N || transb == CUBLAS_OP_T);
    if (!ops || m < 0 || n < 0 || k < 0 || batch < 0 || lda < std::max(1, transa == CUBLAS_OP_N ? m : k) ||
        ldb < std::max(1, transb == CUBLAS_OP_N ? k : n) || ldc < std::max(1, m))
        return cublas_fail(CUBLAS_STATUS_INVALID_VALUE, "a size, operation or leading dimension");
    double al = f64 ? *(const double *)alpha : *(const float *)alpha, be = f64 ? *(const double *)beta : *(const float *)beta;
    bool ta = transa == CUBLAS_OP_T, tb = transb == CUBLAS_OP_T;
    for (int p = 0; p < batch; p++) {
        const char *a = (const char *)A + sa * p * cublas_es(Atype), *b = (const char *)B + sb * p * cublas_es(Btype);
        char *c = (char *)C + sc * p * cublas_es(Ctype);
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < m; i++) {
                double acc = 0;
                for (int64_t l = 0; l < k; l++)
                    acc += cublas_ld(Atype, a, ta ? l + i * lda : i + l * lda) * cublas_ld(Btype, b, tb ? j + l * ldb : l + j * ldb);
                int64_t ic = i + j * ldc;
                cublas_st(Ctype, c, ic, al * acc + (be != 0 ? be * cublas_ld(Ctype, c, ic) : 0.0));
            }
    }
    return CUBLAS_STATUS_SUCCESS;
}
}  // namespace emu

int tide_cuda_get_cublas(cublasHandle_t *out)
{
    *out = nullptr;
    return 0;
}
const char *cublasGetStatusString(cublasStatus_t s)
{
    static char b[64];
    snprintf(b, sizeof b, "emu cublas status %d", (int)s);
    return b;
}
cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType_t Atype, int lda, const void *B,
                            cudaDataType_t Btype, int ldb, const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t)
{
    return emu::cublas_gemm(transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta, C, Ctype, ldc, 0, 1,
                            computeType);
}
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t, cublasOperation_t transa, cublasOperation_t transb, int m,
                                          int n, int k, const void *alpha, const void *A, cudaDataType_t Atype, int lda,
                                          long long strideA, const void *B, cudaDataType_t Btype, int ldb,
                                          long long strideB, const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                                          long long strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t)
{
    return emu::cublas_gemm(transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype,
                            ldc, strideC, batchCount, computeType);
}

/*
 * softmax.cu — (log-)softmax over the last dim of [N, C], forward and backward (the cross-entropy is in
 * loss.cu). One block owns one row; arithmetic is fp32 for f32/bf16 (fp64 for f64).
 */
#include "common.cuh"

template <typename T> __global__ void softmax_kernel(T *y, const T *x, int64_t N, int64_t C, int logmode)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[32];
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        const T *xr = x + row * C;
        A m;
        A lse = tide_row_lse(xr, C, &m, sh);
        T *yr = y + row * C;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            A v = tide_ld(xr, j) - lse;
            tide_st(yr, j, logmode ? v : exp(v));
        }
    }
}

/* softmax: dx = y (dy - Σ dy y);  log-softmax: dx = dy - exp(y) Σ dy */
template <typename T> __global__ void softmax_backward_kernel(T *dx, const T *dy, const T *y, int64_t N, int64_t C,
                                                              int logmode)
{
    typedef TIDE_ACC(T) A;
    __shared__ A sh[32];
    for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
        const T *yr = y + row * C, *gr = dy + row * C;
        A acc = A(0);
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) acc += logmode ? tide_ld(gr, j) : tide_ld(gr, j) * tide_ld(yr, j);
        acc = tide_block_reduce(acc, tide_sum_op(), A(0), sh);
        T *dr = dx + row * C;
        for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
            A yv = tide_ld(yr, j), g = tide_ld(gr, j);
            tide_st(dr, j, logmode ? g - exp(yv) * acc : yv * (g - acc));
        }
    }
}

int tide_cuda_softmax(int dtype, void *y, const void *x, int64_t N, int64_t C, int log)
{
    if (N <= 0 || C <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "softmax", {
        softmax_kernel<T><<<tide_row_blocks(N), tide_row_threads(C), 0, s>>>((T *)y, (const T *)x, N, C, log != 0);
        TIDE_CU_LAUNCH("softmax kernel");
    });
    return 0;
}

int tide_cuda_softmax_backward(int dtype, void *dx, const void *dy, const void *y, int64_t N, int64_t C, int log)
{
    if (N <= 0 || C <= 0) return 0;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "softmax backward", {
        softmax_backward_kernel<T><<<tide_row_blocks(N), tide_row_threads(C), 0, s>>>((T *)dx, (const T *)dy,
                                                                                      (const T *)y, N, C, log != 0);
        TIDE_CU_LAUNCH("softmax backward kernel");
    });
    return 0;
}

/*
 * rope.cu — rotary position embedding on [B, T, H, D] (and its inverse, the backward).
 */
#include "common.cuh"
#include <math.h>

/* ---- rotary embedding on [B, T, H, D]: pairs (i, i + D/2), angle (pos0 + t) theta^(-2i/D) --------------
   Like the CPU backend: the angle, its cosine and sine in double (positions reach 1M tokens, where a float
   angle keeps no fractional digits), the rotation in double. Each thread forms its own pair's angle: no
   [T, D/2] table (1 GiB of doubles at T = 1M, D = 128) is built or kept; the arithmetic is the table's, so
   the bits are too. Each pair is read before either half is written, so out may alias x. */

template <typename T> __global__ void rope_kernel(T *out, const T *x, int64_t Tlen, int64_t H, int64_t half,
                                                  int64_t npairs, int64_t D, double theta, int64_t pos0, double sign)
{
    TIDE_GRID_LOOP(k, npairs) {
        int64_t i = k % half, row = k / half;     /* row = (b, t, h) flattened */
        int64_t t = (row / H) % Tlen;
        double ang = sign * (double)(pos0 + t) * pow(theta, -2.0 * (double)i / (double)D), sn, c;
        sincos(ang, &sn, &c);
        int64_t base = row * 2 * half;
        double x1 = (double)tide_ld(x, base + i), x2 = (double)tide_ld(x, base + i + half);
        out[base + i] = tide_from_f64<T>(x1 * c - x2 * sn);
        out[base + i + half] = tide_from_f64<T>(x1 * sn + x2 * c);
    }
}

int tide_cuda_rope(int dtype, void *out, const void *x, int64_t B, int64_t Tlen, int64_t H, int64_t D,
                   double theta, int64_t pos0, int inverse)
{
    if (B < 0 || Tlen < 0 || H < 0 || D < 0)
        return tide_set_error("rope: negative size B=%lld T=%lld H=%lld D=%lld", (long long)B, (long long)Tlen,
                              (long long)H, (long long)D);
    if (D % 2 != 0) return tide_set_error("rope: head dim D=%lld must be even", (long long)D);
    if (!(theta > 0.0)) return tide_set_error("rope: theta must be positive, got %g", theta);
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("rope: dtype %s is not supported on the cuda backend (f32, f64, bf16)",
                              tide_cuda_dtype_str(dtype));
    int64_t half = D / 2, npairs = B * Tlen * H * half;
    if (npairs == 0) return 0;
    TIDE_STREAM(s);
    const double sign = inverse ? -1.0 : 1.0;
    TIDE_FLOAT_DISPATCH(dtype, "rope", {
        rope_kernel<T><<<tide_blocks(npairs), TIDE_THREADS, 0, s>>>((T *)out, (const T *)x, Tlen, H, half, npairs, D,
                                                                    theta, pos0, sign);
    });
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tide_set_error("cuda rope kernel: %s", cudaGetErrorString(e));
    return 0;
}

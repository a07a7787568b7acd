/*
 * optim.cu — the AdamW update (spec/optim.md §2), in place on the parameter and its moments.
 */
#include "common.cuh"
#include <math.h>
#include <string.h>

/* ---- AdamW (spec/optim.md §2): decoupled decay first, then the Adam step ----------------------------
   In double for every dtype, like the CPU backend: the update is memory bound, and small steps on fp32
   master weights then round the same way on both backends. The same pass tests the stored p and v on
   their bits (all-ones exponent: an infinity or a NaN of any payload; m needs no test, as on the CPU: a bad m
   makes p bad in the same update, a bad gradient makes v bad); a thread that saw one sets the device flag
   with atomicOr, so a clean step costs no atomic and the guard no second read of the weights. */

struct adamw_coef {
    double beta1, beta2, decay, lr, bc1, bc2, eps;
};

__device__ __forceinline__ bool adamw_bad(float x)
{
    unsigned u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool adamw_bad(double x)
{
    unsigned long long u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}
__device__ __forceinline__ bool adamw_bad(__nv_bfloat16 x)
{
    unsigned short u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7f80u) == 0x7f80u;
}

template <typename T>
__global__ void adamw_kernel(T *p, const T *g, T *m, T *v, int *nonfinite, int64_t n, adamw_coef c)
{
    bool bad = false;
    TIDE_GRID_LOOP(i, n) {
        double gi = (double)tide_ld(g, i);
        double mi = c.beta1 * (double)tide_ld(m, i) + (1.0 - c.beta1) * gi;
        double vi = c.beta2 * (double)tide_ld(v, i) + (1.0 - c.beta2) * gi * gi;
        double pi = (double)tide_ld(p, i);
        pi -= c.decay * pi;
        pi -= c.lr * (mi / c.bc1) / (sqrt(vi / c.bc2) + c.eps);
        T vo = tide_from_f64<T>(vi), po = tide_from_f64<T>(pi);
        m[i] = tide_from_f64<T>(mi);
        v[i] = vo;
        p[i] = po;
        bad |= adamw_bad(po) | adamw_bad(vo);
    }
    if (bad && nonfinite) atomicOr(nonfinite, 1);
}

int tide_cuda_adamw(int dtype, void *p, const void *g, void *m, void *v, int *nonfinite, int64_t n, double lr,
                    double beta1, double beta2, double eps, double wd, double bc1, double bc2)
{
    if (n < 0) return tide_set_error("adamw: n = %lld must be >= 0", (long long)n);
    if (!(bc1 > 0.0) || !(bc2 > 0.0))
        return tide_set_error("adamw: bias corrections bc1 = %g, bc2 = %g must be > 0", bc1, bc2);
    if (n == 0) return 0;
    TIDE_STREAM(s);
    adamw_coef c = {beta1, beta2, lr * wd, lr, bc1, bc2, eps};
    TIDE_FLOAT_DISPATCH(dtype, "adamw", {
        adamw_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)p, (const T *)g, (T *)m, (T *)v, nonfinite, n, c);
        TIDE_CU_LAUNCH("adamw kernel");
    });
    return 0;
}

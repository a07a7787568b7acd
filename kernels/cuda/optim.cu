/*
 * optim.cu — the AdamW update (spec/optim.md §2), in place on the parameter and its moments.
 */
#include "common.cuh"
#include <math.h>

/* ---- AdamW (spec/optim.md §2): decoupled decay first, then the Adam step ----------------------------
   In double for every dtype, like the CPU backend: the update is memory bound, and small steps on fp32
   master weights then round the same way on both backends. */

struct adamw_coef {
    double beta1, beta2, decay, lr, bc1, bc2, eps;
};

template <typename T> __global__ void adamw_kernel(T *p, const T *g, T *m, T *v, int64_t n, adamw_coef c)
{
    TIDE_GRID_LOOP(i, n) {
        double gi = (double)tide_ld(g, i);
        double mi = c.beta1 * (double)tide_ld(m, i) + (1.0 - c.beta1) * gi;
        double vi = c.beta2 * (double)tide_ld(v, i) + (1.0 - c.beta2) * gi * gi;
        double pi = (double)tide_ld(p, i);
        pi -= c.decay * pi;
        pi -= c.lr * (mi / c.bc1) / (sqrt(vi / c.bc2) + c.eps);
        m[i] = tide_from_f64<T>(mi);
        v[i] = tide_from_f64<T>(vi);
        p[i] = tide_from_f64<T>(pi);
    }
}

int tide_cuda_adamw(int dtype, void *p, const void *g, void *m, void *v, int64_t n, double lr, double beta1,
                    double beta2, double eps, double wd, double bc1, double bc2)
{
    if (n < 0) return tide_set_error("adamw: n = %lld must be >= 0", (long long)n);
    if (!(bc1 > 0.0) || !(bc2 > 0.0))
        return tide_set_error("adamw: bias corrections bc1 = %g, bc2 = %g must be > 0", bc1, bc2);
    if (n == 0) return 0;
    TIDE_STREAM(s);
    adamw_coef c = {beta1, beta2, lr * wd, lr, bc1, bc2, eps};
    TIDE_FLOAT_DISPATCH(dtype, "adamw", {
        adamw_kernel<T><<<tide_blocks(n), TIDE_THREADS, 0, s>>>((T *)p, (const T *)g, (T *)m, (T *)v, n, c);
        TIDE_CU_LAUNCH("adamw kernel");
    });
    return 0;
}

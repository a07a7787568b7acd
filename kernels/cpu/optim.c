/*
 * optim.c — the AdamW update in place, per element (spec/optim.md §2):
 *   m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
 *   p <- p - lr wd p                                  (decoupled decay, applied first)
 *   p <- p - lr (m / bc1) / (sqrt(v / bc2) + eps)     bc1 = 1 - b1^(t+1), bc2 = 1 - b2^(t+1)
 * The arithmetic is done in double for both dtypes: the update is memory bound, so it costs nothing
 * and keeps small steps on float32 weights from rounding differently per platform.
 */
#include <math.h>
#include "cpu.h"

#define PAR_MIN 32768

#define ADAMW(T)                                                                                   \
    static void adamw_##T(T *p, const T *g, T *m, T *v, int64_t n, double lr, double b1,           \
                          double b2, double eps, double wd, double bc1, double bc2)                \
    {                                                                                              \
        double decay = lr * wd;                                                                    \
        _Pragma("omp parallel for if(n > PAR_MIN) schedule(static)")                               \
        for (int64_t i = 0; i < n; i++) {                                                          \
            double gi = g[i];                                                                      \
            double mi = b1 * (double)m[i] + (1.0 - b1) * gi;                                       \
            double vi = b2 * (double)v[i] + (1.0 - b2) * gi * gi;                                  \
            double pi = (double)p[i];                                                              \
            pi -= decay * pi;                                                                      \
            pi -= lr * (mi / bc1) / (sqrt(vi / bc2) + eps);                                        \
            m[i] = (T)mi;                                                                          \
            v[i] = (T)vi;                                                                          \
            p[i] = (T)pi;                                                                          \
        }                                                                                          \
    }

ADAMW(float)
ADAMW(double)

int tide_cpu_adamw(int dtype, void *p, const void *g, void *m, void *v, int64_t n, double lr,
                   double beta1, double beta2, double eps, double wd, double bc1, double bc2)
{
    if (n < 0) return tide_set_error("adamw: n = %lld must be >= 0", (long long)n);
    if (!(bc1 > 0.0) || !(bc2 > 0.0))
        return tide_set_error("adamw: bias corrections bc1 = %g, bc2 = %g must be > 0", bc1, bc2);
    switch (dtype) {
    case TIDE_F32: adamw_float(p, g, m, v, n, lr, beta1, beta2, eps, wd, bc1, bc2); return 0;
    case TIDE_F64: adamw_double(p, g, m, v, n, lr, beta1, beta2, eps, wd, bc1, bc2); return 0;
    default: {
        const char *s = tide_dtype_name(dtype);
        return tide_set_error("adamw: dtype %s not supported on cpu (expected f32 or f64)", s ? s : "unknown");
    }
    }
}

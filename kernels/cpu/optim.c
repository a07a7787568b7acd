/*
 * optim.c — the AdamW update in place, per element (spec/optim.md §2):
 *   m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
 *   p <- p - lr wd p                                  (decoupled decay, applied first)
 *   p <- p - lr (m / bc1) / (sqrt(v / bc2) + eps)     bc1 = 1 - b1^(t+1), bc2 = 1 - b2^(t+1)
 * The moments and the weight are updated in double for every dtype (a weight rounds once, the same on every
 * platform); lr / bc1 and 1 / sqrt(bc2) are computed once per call, so an element costs one square root and one
 * division: in double for f64, in float for f32 and bf16 weights (IEEE, correctly rounded: no platform
 * difference). Double divisions and square roots per element made the update compute-bound at half the memory
 * speed.
 *
 * The same pass reports whether a stored value is a NaN or an infinity (the step's post-update guard,
 * spec/optim.md §2), so the guard costs no second read of the weights: the largest magnitude, as bits, of
 * the stored p and v (an all-ones exponent, any payload, is above every finite number), max-reduced over
 * the threads (an integer max vectorises; about 3% of the update on f32). m needs no test: with a finite
 * gradient it stays a mean of finite numbers, a non-finite gradient makes v non-finite, and a non-finite m
 * brought in makes p non-finite. *nonfinite is set to 1, never cleared.
 */
#include <math.h>
#include <string.h>
#include "cpu.h"

#define PAR_MIN 32768

/* |x| as bits: above *_INF exactly when x is an infinity or a NaN */
static inline uint32_t f32_mag(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7fffffffu;
}
static inline uint64_t f64_mag(double x)
{
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7fffffffffffffffull;
}
static inline uint16_t bf16_mag(uint16_t h) { return h & 0x7fffu; }
#define F32_INF 0x7f800000u
#define F64_INF 0x7ff0000000000000ull
#define BF16_INF 0x7f80u

#define LD_F(x) ((double)(x))
#define ST_F32(x) ((float)(x))
#define ST_F64(x) (x)
#define LD_BF16(x) ((double)tide_cpu_bf16_to_f32(x))
#define ST_BF16(x) tide_cpu_f32_to_bf16((float)(x))

/* returns 1 when a stored p or v is not finite */
#define ADAMW(NAME, T, U, LD, ST, MAG, INF, STEP)                                                  \
    static int adamw_##NAME(T *p, const T *g, T *m, T *v, int64_t n, double lr, double b1,         \
                            double b2, double eps, double wd, double bc1, double bc2)              \
    {                                                                                              \
        double decay = lr * wd, a1 = lr / bc1, s2 = 1.0 / sqrt(bc2);                               \
        float s2f = (float)s2, ef = (float)eps;                                                    \
        (void)s2f, (void)ef;                                                                       \
        U mx = 0;                                                                                  \
        _Pragma("omp parallel for if(n > PAR_MIN) schedule(static) reduction(max:mx)")             \
        for (int64_t i = 0; i < n; i++) {                                                          \
            double gi = LD(g[i]);                                                                  \
            double mi = b1 * LD(m[i]) + (1.0 - b1) * gi;                                           \
            double vi = b2 * LD(v[i]) + (1.0 - b2) * gi * gi;                                      \
            double pi = LD(p[i]);                                                                  \
            pi -= decay * pi;                                                                      \
            pi -= a1 * STEP(mi, vi);                                                               \
            T vo = ST(vi), po = ST(pi);                                                            \
            m[i] = ST(mi);                                                                         \
            v[i] = vo;                                                                             \
            p[i] = po;                                                                             \
            U a = MAG(po), b = MAG(vo);                                                            \
            a = a > b ? a : b;                                                                     \
            mx = mx > a ? mx : a;                                                                  \
        }                                                                                          \
        return mx >= INF;                                                                          \
    }

/* the step's ratio m̂ / (sqrt(v̂) + eps) without its lr / bc1: in double for f64; for float weights in float (the
   ratio's few float ulp are far below an ulp of the weight it moves), which keeps the division and the square
   root off the double units: the update then runs at memory speed */
#define STEP_F64(mi, vi) (mi / (sqrt(vi) * s2 + eps))
#define STEP_F32(mi, vi) ((double)((float)(mi) / (sqrtf((float)(vi)) * s2f + ef)))

ADAMW(f32, float, uint32_t, LD_F, ST_F32, f32_mag, F32_INF, STEP_F32)
ADAMW(f64, double, uint64_t, LD_F, ST_F64, f64_mag, F64_INF, STEP_F64)
ADAMW(bf16, uint16_t, uint16_t, LD_BF16, ST_BF16, bf16_mag, BF16_INF, STEP_F32)

int tide_cpu_adamw(int dtype, void *p, const void *g, void *m, void *v, int *nonfinite, int64_t n, double lr,
                   double beta1, double beta2, double eps, double wd, double bc1, double bc2)
{
    if (n < 0) return tide_set_error("adamw: n = %lld must be >= 0", (long long)n);
    if (!(bc1 > 0.0) || !(bc2 > 0.0))
        return tide_set_error("adamw: bias corrections bc1 = %g, bc2 = %g must be > 0", bc1, bc2);
    int bad;
    switch (dtype) {
    case TIDE_F32: bad = adamw_f32(p, g, m, v, n, lr, beta1, beta2, eps, wd, bc1, bc2); break;
    case TIDE_F64: bad = adamw_f64(p, g, m, v, n, lr, beta1, beta2, eps, wd, bc1, bc2); break;
    case TIDE_BF16: bad = adamw_bf16(p, g, m, v, n, lr, beta1, beta2, eps, wd, bc1, bc2); break;
    default:
        return tide_set_error("adamw: dtype %s not supported on cpu (expected f32, f64 or bf16)",
                              tide_cpu_dtype_str(dtype));
    }
    if (bad && nonfinite) *nonfinite = 1;
    return 0;
}

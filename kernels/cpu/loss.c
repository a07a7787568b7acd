/*
 * loss.c — per-token cross-entropy over logits [N, V] (kernels/backend.h).
 *
 *   lse_n   = log Σ_v exp(logits[n, v])                 (max-subtracted, summed in double)
 *   loss[n] = w_n (lse_n − logits[n, t_n]),  valid[n] = w_n  (w_n = 1 without weights)
 *   ignored rows (t_n == ignore): loss 0, valid 0, lse still written
 *   dlogits[n, :] = dloss[n] w_n (softmax(logits[n]) − onehot(t_n)),  0 for ignored rows
 * The reduction (mean over valid weight, sum) is the op layer's job. Targets are checked before any
 * output is written, so a bad target leaves the outputs untouched.
 */
#include <math.h>
#include "cpu.h"

static int64_t target_at(const void *targets, int tdtype, int64_t n)
{
    return tdtype == TIDE_I32 ? (int64_t)((const int32_t *)targets)[n] : ((const int64_t *)targets)[n];
}

/* every target is ignore or in [0, V); names the first bad row otherwise */
static int check_targets(const char *op, const void *targets, int tdtype, int64_t N, int64_t V, int64_t ignore)
{
    if (tdtype != TIDE_I32 && tdtype != TIDE_I64)
        return tide_set_error("%s: targets dtype %s not supported (expected i32 or i64)", op, tide_cpu_dtype_str(tdtype));
    for (int64_t n = 0; n < N; n++) {
        int64_t t = target_at(targets, tdtype, n);
        if (t != ignore && (t < 0 || t >= V))
            return tide_set_error("%s: target %lld at row %lld is out of range [0, %lld) and is not "
                                  "ignore_index %lld", op, (long long)t, (long long)n, (long long)V,
                                  (long long)ignore);
    }
    return 0;
}

#define DEFINE_CROSS_ENTROPY(T, SFX)                                                                    \
static void cross_entropy_##SFX(T *loss, T *valid, T *lse, const T *logits, const void *targets,       \
                                int tdtype, const T *weights, int64_t N, int64_t V, int64_t ignore)     \
{                                                                                                       \
    _Pragma("omp parallel for if(N * V > TIDE_OMP_MIN)")                                                       \
    for (int64_t n = 0; n < N; n++) {                                                                   \
        const T *xr = logits + n * V;                                                                   \
        double mx = -INFINITY;                                                                          \
        for (int64_t v = 0; v < V; v++) if ((double)xr[v] > mx) mx = (double)xr[v];                     \
        double sum = 0.0;                                                                               \
        for (int64_t v = 0; v < V; v++) sum += exp((double)xr[v] - mx);                                 \
        double l = mx + log(sum);                                                                       \
        lse[n] = (T)l;                                                                                  \
        int64_t t = target_at(targets, tdtype, n);                                                      \
        if (t == ignore) {                                                                              \
            loss[n] = 0;                                                                                \
            valid[n] = 0;                                                                               \
        } else {                                                                                        \
            double w = weights ? (double)weights[n] : 1.0;                                              \
            loss[n] = (T)(w * (l - (double)xr[t]));                                                     \
            valid[n] = (T)w;                                                                            \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
static void cross_entropy_backward_##SFX(T *dlogits, const T *dloss, const T *logits, const T *lse,    \
                                         const void *targets, int tdtype, const T *weights, int64_t N, \
                                         int64_t V, int64_t ignore)                                     \
{                                                                                                       \
    _Pragma("omp parallel for if(N * V > TIDE_OMP_MIN)")                                                       \
    for (int64_t n = 0; n < N; n++) {                                                                   \
        const T *xr = logits + n * V;                                                                   \
        T *dr = dlogits + n * V;                                                                        \
        int64_t t = target_at(targets, tdtype, n);                                                      \
        if (t == ignore) {                                                                              \
            for (int64_t v = 0; v < V; v++) dr[v] = 0;                                                  \
            continue;                                                                                   \
        }                                                                                               \
        double g = (double)dloss[n] * (weights ? (double)weights[n] : 1.0), l = (double)lse[n];         \
        for (int64_t v = 0; v < V; v++) dr[v] = (T)(g * exp((double)xr[v] - l));                        \
        dr[t] = (T)(g * (exp((double)xr[t] - l) - 1.0));                                                \
    }                                                                                                   \
}

DEFINE_CROSS_ENTROPY(float, f32)
DEFINE_CROSS_ENTROPY(double, f64)

int tide_cpu_cross_entropy(int dtype, void *loss, void *valid, void *lse, const void *logits, const void *targets,
                           int tdtype, const void *weights, int64_t N, int64_t V, int64_t ignore)
{
    if (N < 0 || V < 0)
        return tide_set_error("cross_entropy: negative size N=%lld V=%lld", (long long)N, (long long)V);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("cross_entropy: dtype %s not supported on cpu (expected f32 or f64)",
                              tide_cpu_dtype_str(dtype));
    int rc = check_targets("cross_entropy", targets, tdtype, N, V, ignore);
    if (rc) return rc;
    if (dtype == TIDE_F32) cross_entropy_f32(loss, valid, lse, logits, targets, tdtype, weights, N, V, ignore);
    else cross_entropy_f64(loss, valid, lse, logits, targets, tdtype, weights, N, V, ignore);
    return 0;
}

int tide_cpu_cross_entropy_backward(int dtype, void *dlogits, const void *dloss, const void *logits,
                                    const void *lse, const void *targets, int tdtype, const void *weights,
                                    int64_t N, int64_t V, int64_t ignore)
{
    if (N < 0 || V < 0)
        return tide_set_error("cross_entropy_backward: negative size N=%lld V=%lld", (long long)N, (long long)V);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("cross_entropy_backward: dtype %s not supported on cpu (expected f32 or f64)",
                              tide_cpu_dtype_str(dtype));
    int rc = check_targets("cross_entropy_backward", targets, tdtype, N, V, ignore);
    if (rc) return rc;
    if (dtype == TIDE_F32)
        cross_entropy_backward_f32(dlogits, dloss, logits, lse, targets, tdtype, weights, N, V, ignore);
    else
        cross_entropy_backward_f64(dlogits, dloss, logits, lse, targets, tdtype, weights, N, V, ignore);
    return 0;
}

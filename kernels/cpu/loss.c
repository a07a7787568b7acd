/*
 * loss.c — per-token cross-entropy over logits [N, V] (kernels/backend.h).
 *
 *   lse_n   = log Σ_v exp(logits[n, v])                 (max-subtracted, summed in double; f32 rows in float math)
 *   loss[n] = w_n (lse_n − logits[n, t_n]),  valid[n] = w_n  (w_n = 1 without weights)
 *   ignored rows (t_n == ignore): loss 0, valid 0, lse still written
 *   dlogits[n, :] = dloss[n] w_n (softmax(logits[n]) − onehot(t_n)),  0 for ignored rows
 * The reduction (mean over valid weight, sum) is the op layer's job. Targets are checked before any
 * output is written, so a bad target leaves the outputs untouched.
 *
 * token_logprobs over the same [N, V] rows (the RL objectives' per-token log-probs and entropy):
 *   d_v = logits[n, v] - m (m = row max), s = Σ exp(d_v), u = Σ exp(d_v) d_v       (two passes, no [N, V] buffer)
 *   lse_n = m + log s,  logp[n] = logits[n, t_n] - lse_n,  entropy[n] = log s - u / s   (= -Σ p log p)
 *   dlogits[n, j] = dlogp[n] ([j == t_n] - p_j) - dentropy[n] p_j (log p_j + entropy[n]);  ignored rows: 0
 * f32 rows use exp_f32 (vectorised) with the sums in double; terms with p = 0 (a -inf logit) add nothing.
 */
/* GCC keeps a loop with a float compare-and-select scalar under -ftrapping-math (the default), so the exp_f32 loops
   would not vectorise; tide never reads the floating-point exception flags */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
/* the exponential loops are compute-bound: with AVX-512 they run on 512-bit vectors (GCC prefers 256 by default),
   about 1.4x the element rate on this kernel's rows */
#if defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#endif
#include <math.h>
#include "cpu.h"
#include "fastmath.h"

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

/* f32 rows: float arithmetic on exp_f32 (fastmath.h, vectorised; within 3 ulp), CE_LANES lanes at a time, in
   one sweep over the row: per block of CE_BLOCK logits (in L1) the block max, then e^(x − m) summed in double
   lanes against the running max m (the lanes rescaled by e^(m_old − m) when a block raises it) and the lanes
   added in a fixed order at the end, so a row's bits depend on V alone (not on the thread count). The backward's
   softmax is float from the stored (float) lse. f64 rows on libm: a max pass, then a sequential double sum. */
#define CE_LANES 16
#define CE_BLOCK 2048

/* log Σ_v e^(x_v); NaN when the row holds a NaN, is all −inf or holds +inf (as e^(x − max) makes it in the f64
   path) */
static double ce_row_lse_f32(const float *xr, int64_t V)
{
    double acc[CE_LANES] = {0};
    float m = -INFINITY;
    int nan = 0;
    for (int64_t b0 = 0; b0 < V; b0 += CE_BLOCK) {
        const float *x = xr + b0;
        int64_t n = V - b0 < CE_BLOCK ? V - b0 : CE_BLOCK;
        float bm = max_f32(x, n, -INFINITY);
        if (bm > m) {
            if (m > -INFINITY) {
                double sc = exp((double)m - (double)bm);
                for (int j = 0; j < CE_LANES; j++) acc[j] *= sc;
            }
            m = bm;
        }
        if (m == INFINITY) return NAN;
        if (m == -INFINITY) {                       /* −inf and NaN only, so far */
            for (int64_t v = 0; v < n; v++) nan |= x[v] != x[v];
            continue;
        }
        int64_t v = 0;
        for (; v + CE_LANES <= n; v += CE_LANES) {
            __builtin_prefetch(x + CE_BLOCK + v);
            for (int j = 0; j < CE_LANES; j++) acc[j] += (double)exp_f32(x[v + j] - m);
        }
        for (int j = 0; v + j < n; j++) acc[j] += (double)exp_f32(x[v + j] - m);
    }
    if (nan || m == -INFINITY) return NAN;
    double sum = 0.0;
    for (int j = 0; j < CE_LANES; j++) sum += acc[j];
    return (double)m + log(sum);
}

static void cross_entropy_f32(float *loss, float *valid, float *lse, const float *logits, const void *targets,
                              int tdtype, const float *weights, int64_t N, int64_t V, int64_t ignore)
{
#pragma omp parallel for if(N * V > TIDE_OMP_MIN)
    for (int64_t n = 0; n < N; n++) {
        const float *xr = logits + n * V;
        double l = ce_row_lse_f32(xr, V);
        lse[n] = (float)l;
        int64_t t = target_at(targets, tdtype, n);
        if (t == ignore) {
            loss[n] = 0;
            valid[n] = 0;
        } else {
            double w = weights ? (double)weights[n] : 1.0;
            loss[n] = (float)(w * (l - (double)xr[t]));
            valid[n] = (float)w;
        }
    }
}

static void cross_entropy_f64(double *loss, double *valid, double *lse, const double *logits, const void *targets,
                              int tdtype, const double *weights, int64_t N, int64_t V, int64_t ignore)
{
#pragma omp parallel for if(N * V > TIDE_OMP_MIN)
    for (int64_t n = 0; n < N; n++) {
        const double *xr = logits + n * V;
        double mx = max_f64(xr, V, -INFINITY);
        double sum = 0.0;
        for (int64_t v = 0; v < V; v++) sum += exp(xr[v] - mx);
        double l = mx + log(sum);
        lse[n] = l;
        int64_t t = target_at(targets, tdtype, n);
        if (t == ignore) {
            loss[n] = 0;
            valid[n] = 0;
        } else {
            double w = weights ? weights[n] : 1.0;
            loss[n] = w * (l - xr[t]);
            valid[n] = w;
        }
    }
}

/* the exponential of the backward passes (and of token_logprobs): f32 in float on exp_f32, f64 on libm */
static inline float exp_t_f32(float x) { return exp_f32(x); }
static inline double exp_t_f64(double x) { return exp(x); }

/* the start of a backward's row n: its logits xr, its gradient row dr and its target t; a row whose target is
   `ignore` gets a zero gradient and the loop goes on to the next row */
#define GRAD_ROW_START(T)                                                                               \
    const T *xr = logits + n * V;                                                                       \
    T *dr = dlogits + n * V;                                                                            \
    int64_t t = target_at(targets, tdtype, n);                                                          \
    if (t == ignore) {                                                                                  \
        for (int64_t v = 0; v < V; v++) dr[v] = 0;                                                      \
        continue;                                                                                       \
    }

/* dlogits = g (softmax − onehot) from the stored lse */

#define CE_BACKWARD(T, SFX)                                                                             \
static void cross_entropy_backward_##SFX(T *dlogits, const T *dloss, const T *logits, const T *lse,    \
                                         const void *targets, int tdtype, const T *weights, int64_t N, \
                                         int64_t V, int64_t ignore)                                     \
{                                                                                                       \
    _Pragma("omp parallel for if(N * V > TIDE_OMP_MIN)")                                                \
    for (int64_t n = 0; n < N; n++) {                                                                   \
        GRAD_ROW_START(T)                                                                               \
        T g = (T)((double)dloss[n] * (weights ? (double)weights[n] : 1.0)), l = lse[n];                 \
        int64_t v = 0;                                                                                  \
        for (; v + CE_LANES <= V; v += CE_LANES) {                                                      \
            __builtin_prefetch(xr + v + CE_BLOCK);                                                      \
            for (int j = 0; j < CE_LANES; j++) dr[v + j] = g * exp_t_##SFX(xr[v + j] - l);             \
        }                                                                                               \
        for (; v < V; v++) dr[v] = g * exp_t_##SFX(xr[v] - l);                                         \
        dr[t] = g * (exp_t_##SFX(xr[t] - l) - (T)1);                                                   \
    }                                                                                                   \
}
CE_BACKWARD(float, f32)
CE_BACKWARD(double, f64)



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

/* ---- token_logprobs ------------------------------------------------------------------------------------------ */

#define DEFINE_TOKEN_LOGPROBS(T, SFX)                                                                   \
static void token_logprobs_##SFX(T *logp, T *ent, T *lse, const T *logits, const void *targets,        \
                                 int tdtype, int64_t N, int64_t V, int64_t ignore)                     \
{                                                                                                       \
    _Pragma("omp parallel for if(N * V > TIDE_OMP_MIN)")                                               \
    for (int64_t n = 0; n < N; n++) {                                                                   \
        const T *xr = logits + n * V;                                                                   \
        T mx = max_##SFX(xr, V, (T)-INFINITY);                                                          \
        T sh = isinf(mx) ? (T)0 : mx;                  /* an all -inf row: lse -inf, not NaN */         \
        double s = 0.0, u = 0.0;                                                                        \
        _Pragma("omp simd reduction(+:s, u)")                                                          \
        for (int64_t v = 0; v < V; v++) {                                                               \
            T d = xr[v] - sh, e = exp_t_##SFX(d);                                                       \
            s += (double)e;                                                                             \
            u += e > 0 ? (double)e * (double)d : 0.0;                                                   \
        }                                                                                               \
        double ls = log(s), l = (double)sh + ls;                                                        \
        lse[n] = (T)l;                                                                                  \
        int64_t t = target_at(targets, tdtype, n);                                                      \
        if (t == ignore) {                                                                              \
            logp[n] = 0;                                                                                \
            ent[n] = 0;                                                                                 \
        } else {                                                                                        \
            logp[n] = (T)((double)xr[t] - l);                                                           \
            ent[n] = (T)(ls - u / s);                                                                   \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
static void token_logprobs_backward_##SFX(T *dlogits, const T *dlogp, const T *dent, const T *logits,  \
                                          const T *lse, const T *ent, const void *targets, int tdtype, \
                                          int64_t N, int64_t V, int64_t ignore)                        \
{                                                                                                       \
    _Pragma("omp parallel for if(N * V > TIDE_OMP_MIN)")                                               \
    for (int64_t n = 0; n < N; n++) {                                                                   \
        GRAD_ROW_START(T)                                                                               \
        T a = dlogp ? dlogp[n] : (T)0, b = dent ? dent[n] : (T)0, l = lse[n], H = ent[n];               \
        _Pragma("omp simd")                                                                            \
        for (int64_t v = 0; v < V; v++) {                                                               \
            T lp = xr[v] - l, p = exp_t_##SFX(lp);                                                      \
            dr[v] = -a * p - b * (p > 0 ? p * (lp + H) : (T)0);                                         \
        }                                                                                               \
        dr[t] += a;                                                                                     \
    }                                                                                                   \
}

DEFINE_TOKEN_LOGPROBS(float, f32)
DEFINE_TOKEN_LOGPROBS(double, f64)
#undef GRAD_ROW_START

int tide_cpu_token_logprobs(int dtype, void *logp, void *entropy, void *lse, const void *logits, const void *targets,
                            int tdtype, int64_t N, int64_t V, int64_t ignore)
{
    if (N < 0 || V <= 0)
        return tide_set_error("token_logprobs: sizes N=%lld V=%lld (expected N >= 0, V > 0)", (long long)N, (long long)V);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("token_logprobs: dtype %s not supported on cpu (expected f32 or f64)",
                              tide_cpu_dtype_str(dtype));
    int rc = check_targets("token_logprobs", targets, tdtype, N, V, ignore);
    if (rc) return rc;
    if (dtype == TIDE_F32) token_logprobs_f32(logp, entropy, lse, logits, targets, tdtype, N, V, ignore);
    else token_logprobs_f64(logp, entropy, lse, logits, targets, tdtype, N, V, ignore);
    return 0;
}

int tide_cpu_token_logprobs_backward(int dtype, void *dlogits, const void *dlogp, const void *dentropy,
                                     const void *logits, const void *lse, const void *entropy, const void *targets,
                                     int tdtype, int64_t N, int64_t V, int64_t ignore)
{
    if (N < 0 || V <= 0)
        return tide_set_error("token_logprobs_backward: sizes N=%lld V=%lld (expected N >= 0, V > 0)", (long long)N,
                              (long long)V);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("token_logprobs_backward: dtype %s not supported on cpu (expected f32 or f64)",
                              tide_cpu_dtype_str(dtype));
    int rc = check_targets("token_logprobs_backward", targets, tdtype, N, V, ignore);
    if (rc) return rc;
    if (dtype == TIDE_F32)
        token_logprobs_backward_f32(dlogits, dlogp, dentropy, logits, lse, entropy, targets, tdtype, N, V, ignore);
    else
        token_logprobs_backward_f64(dlogits, dlogp, dentropy, logits, lse, entropy, targets, tdtype, N, V, ignore);
    return 0;
}

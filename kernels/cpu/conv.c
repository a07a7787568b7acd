/*
 * conv.c — the depthwise causal convolution over time in front of KDA's q, k, v (spec/kda.md §1.2, §8),
 * with SiLU fused (kernels/backend.h: causal_conv1d).
 *
 *   y[b,t,c] = Σ_j w[c,j] x[b, t−K+1+j, c]      (tap K−1 is the current token)
 *
 * A source position before the start of t's document reads 0 (the conv history resets at every document
 * boundary: forgetting it leaks K−1 tokens across documents), except in the first document of a row,
 * where positions before t = 0 read the decode cache [B, K−1, C] (the previous K−1 inputs of the row).
 * The backward recomputes the pre-activation for SiLU instead of storing it. Every loop runs over the C
 * channels of a token row at once (vectorised); tap sums are in double. The backward splits the channels among
 * the threads, each walking the tokens in order (gx and gw in one walk), so it does not depend on the thread
 * count.
 */
/* the channel loops are compute-bound in double (the taps, σ's exp and division): 512-bit vectors where AVX-512
   exists (GCC prefers 256 by default; every lane does the same arithmetic, so the same bits): the forward 29% and
   the backward 20% faster single-threaded at 4,096 tokens x 64 channels */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "cpu.h"
#include "fastmath.h"

/* start[p] = flattened index where token p's segment starts (cu: segment boundaries, host) */
static int64_t *segment_starts(const int64_t *cu, int64_t n_seg, int64_t n)
{
    int64_t *start = malloc((size_t)(n > 0 ? n : 1) * sizeof *start);
    if (!start) return NULL;
    for (int64_t s = 0; s < n_seg; s++)
        for (int64_t p = cu[s]; p < cu[s + 1]; p++) start[p] = cu[s];
    return start;
}

/* the fused SiLU, σ(a) of the double tap sum in double on both paths: a float SiLU (fastmath.h) rounds differently,
   and the quickstart's recall row at 4,096 tokens moves with rounding (recipes/quickstart.lua). The f32 path takes
   σ from exp_f64 (fastmath.h: within an ulp of libm's double, so the float results are libm's) so its channel
   loops vectorise; f64 stays on libm. */
static inline double sigm(double x) { return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x)); }
#define sigm_f32 sigmoid_f64x
#define sigm_f64 sigm

/* the backward's way out when an allocation fails: what it holds so far freed (NULL: nothing) */
static int conv_backward_oom(double *wt, double *acc)
{
    free(wt);
    free(acc);
    return tide_set_error("causal_conv1d backward: out of memory");
}

#define DEFINE_CONV(TT, SFX)                                                                                  \
/* tap j of token p = (b, t) reads one row of C channels: x's row p - (K-1) + j inside the segment, else the   \
   cache's row of the same offset when the segment is the row's first, else zeros (NULL) */                   \
static inline const TT *tap_row_##SFX(const TT *x, const TT *cache, const int64_t *start, int64_t p, int64_t j, \
                                     int64_t T_, int64_t C, int64_t K)                                        \
{                                                                                                             \
    int64_t sp = p - (K - 1) + j;                                                                              \
    if (sp >= start[p]) return x + sp * C;                                                                    \
    int64_t b = p / T_, t = p % T_;                                                                           \
    if (cache && start[p] == b * T_) return cache + (b * (K - 1) + t + j) * C;                                \
    return NULL;                                                                                              \
}                                                                                                             \
                                                                                                              \
/* a[c] = Σ_j w[c, j] src_j[c] for token p, taps in order, in double over the channels at once (wt = w          \
   transposed to [K, C] in double) */                                                                         \
static inline void taps_##SFX(double *a, const TT *x, const TT *cache, const int64_t *start, const double *wt, \
                              int64_t p, int64_t T_, int64_t C, int64_t K)                                    \
{                                                                                                             \
    for (int64_t c = 0; c < C; c++) a[c] = 0;                                                                 \
    for (int64_t j = 0; j < K; j++) {                                                                         \
        const TT *src = tap_row_##SFX(x, cache, start, p, j, T_, C, K);                                      \
        if (!src) continue;                                                                                   \
        const double *wj = wt + j * C;                                                                        \
        for (int64_t c = 0; c < C; c++) a[c] += wj[c] * (double)src[c];                                       \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
static double *transposed_##SFX(const TT *w, int64_t C, int64_t K)                                             \
{                                                                                                             \
    double *wt = malloc((size_t)(K * C > 0 ? K * C : 1) * sizeof *wt);                                       \
    if (wt)                                                                                                   \
        for (int64_t c = 0; c < C; c++)                                                                       \
            for (int64_t j = 0; j < K; j++) wt[j * C + c] = (double)w[c * K + j];                             \
    return wt;                                                                                                \
}                                                                                                             \
                                                                                                              \
static int conv_##SFX(TT *out, const TT *x, const TT *w, const TT *cache, const int64_t *start, int64_t n,     \
                      int64_t T_, int64_t C, int64_t K, int silu)                                             \
{                                                                                                             \
    double *wt = transposed_##SFX(w, C, K);                                                                   \
    if (!wt) return tide_set_error("causal_conv1d: out of memory");                                           \
    int bad = 0;                                                                                              \
    _Pragma("omp parallel if(n * C > TIDE_OMP_MIN_MATH) reduction(|:bad)")                                        \
    {                                                                                                         \
        double *a = malloc((size_t)(C > 0 ? C : 1) * sizeof *a);                                              \
        if (!a) bad = 1;                                                                                      \
        _Pragma("omp for schedule(static)")                                                                   \
        for (int64_t p = 0; p < n; p++) {                                                                     \
            if (!a) continue;                                                                                 \
            taps_##SFX(a, x, cache, start, wt, p, T_, C, K);                                                  \
            TT *o = out + p * C;                                                                              \
            if (silu) for (int64_t c = 0; c < C; c++) o[c] = (TT)(a[c] * sigm_##SFX(a[c]));                   \
            else for (int64_t c = 0; c < C; c++) o[c] = (TT)a[c];                                             \
        }                                                                                                     \
        free(a);                                                                                              \
    }                                                                                                         \
    free(wt);                                                                                                 \
    return bad ? tide_set_error("causal_conv1d: out of memory") : 0;                                          \
}                                                                                                             \
                                                                                                              \
/* one decoding step of R rows over their own histories h_r [K-1, C]: conv_'s taps for a row of one token       \
   (history rows, then the token; the same sums in the same order), then h_r shifted by one token in place */   \
static int conv_rows_##SFX(TT *out, const TT *x, const TT *w, void *const *caches, int64_t R, int64_t C,       \
                           int64_t K, int silu)                                                               \
{                                                                                                             \
    double *wt = transposed_##SFX(w, C, K);                                                                   \
    if (!wt) return tide_set_error("conv_decode_rows: out of memory");                                        \
    int bad = 0;                                                                                              \
    _Pragma("omp parallel if(R * C * K > TIDE_OMP_MIN_MATH) reduction(|:bad)")                                    \
    {                                                                                                         \
        double *a = malloc((size_t)(C > 0 ? C : 1) * sizeof *a);                                              \
        if (!a) bad = 1;                                                                                      \
        _Pragma("omp for schedule(static)")                                                                   \
        for (int64_t r = 0; r < R; r++) {                                                                     \
            if (!a) continue;                                                                                 \
            TT *h = caches[r];                                                                                \
            const TT *xr = x + r * C;                                                                         \
            for (int64_t c = 0; c < C; c++) a[c] = 0;                                                         \
            for (int64_t j = 0; j < K; j++) {                                                                 \
                const TT *src = j < K - 1 ? h + j * C : xr;                                                   \
                const double *wj = wt + j * C;                                                                \
                for (int64_t c = 0; c < C; c++) a[c] += wj[c] * (double)src[c];                               \
            }                                                                                                 \
            TT *o = out + r * C;                                                                              \
            if (silu) for (int64_t c = 0; c < C; c++) o[c] = (TT)(a[c] * sigm_##SFX(a[c]));                   \
            else for (int64_t c = 0; c < C; c++) o[c] = (TT)a[c];                                             \
            if (K > 1) {                                                                                      \
                memmove(h, h + C, (size_t)((K - 2) * C) * sizeof(TT));                                        \
                memcpy(h + (K - 2) * C, xr, (size_t)C * sizeof(TT));                                          \
            }                                                                                                 \
        }                                                                                                     \
        free(a);                                                                                              \
    }                                                                                                         \
    free(wt);                                                                                                 \
    return bad ? tide_set_error("conv_decode_rows: out of memory") : 0;                                       \
}                                                                                                             \
                                                                                                              \
/* ga = dL/d(pre-activation) of token p, channels [c0, c0 + w_): the pre-activation recomputed (the forward's taps,   \
   in order) and SiLU's derivative applied, or the output gradient itself without SiLU; a: w_ doubles of scratch */ \
static inline void ga_row_##SFX(double *ga, double *a, const TT *gout, const TT *x, const TT *cache,            \
                                const int64_t *start, const double *wt, int64_t p, int64_t T_, int64_t C,      \
                                int64_t K, int64_t c0, int64_t w_, int silu)                                   \
{                                                                                                             \
    const TT *g = gout + p * C + c0;                                                                          \
    if (!silu) { for (int64_t c = 0; c < w_; c++) ga[c] = (double)g[c]; return; }                             \
    for (int64_t c = 0; c < w_; c++) a[c] = 0;                                                                \
    for (int64_t j = 0; j < K; j++) {                                                                         \
        const TT *src = tap_row_##SFX(x, cache, start, p, j, T_, C, K);                                      \
        if (!src) continue;                                                                                   \
        const double *wj = wt + j * C + c0;                                                                   \
        src += c0;                                                                                            \
        for (int64_t c = 0; c < w_; c++) a[c] += wj[c] * (double)src[c];                                      \
    }                                                                                                         \
    for (int64_t c = 0; c < w_; c++) {                                                                        \
        double s = sigm_##SFX(a[c]);                                                                          \
        ga[c] = (double)g[c] * (s + a[c] * s * (1 - s));                                                      \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* The backward in one walk over the tokens, without an [n, C] ga in memory: each thread owns a range of channels  \
   (whole lines of the gw accumulators) and, token by token, forms the token's ga (ga_row), keeps the last K rows  \
   of it in a ring, adds the token's terms to its gw accumulators and writes gx of the token K - 1 back, whose      \
   readers are then all in the ring. gx[p] = Σ_j w[j] ga[p + K−1−j] over the readers of p's segment, taps in order; \
   gw[c, j] = Σ_p ga[p, c] src_j(p)[c], the tokens in order: neither sum depends on the thread count. (Writing ga   \
   out and reading it back in two more passes cost more than forming it: 2 MB of doubles at 4,096 x 64.) */        \
static int conv_backward_##SFX(TT *gx, TT *gw, TT *gcache, const TT *gout, const TT *x, const TT *w,           \
                               const TT *cache, const int64_t *start, int64_t B, int64_t n, int64_t T_,       \
                               int64_t C, int64_t K, int silu)                                                \
{                                                                                                             \
    double *wt = transposed_##SFX(w, C, K);                                                                   \
    double *acc = wt && gw ? calloc((size_t)(K * C > 0 ? K * C : 1), sizeof *acc) : NULL;                      \
    if (!wt || (gw && !acc)) return conv_backward_oom(wt, acc);                                         \
    int bad = 0;                                                                                              \
    _Pragma("omp parallel if(n * C > TIDE_OMP_MIN_MATH) reduction(|:bad)")                                    \
    {                                                                                                         \
        int64_t c0, c1;                                                                                       \
        tide_cpu_column_range(C, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);                     \
        int64_t w_ = c1 - c0, nm = acc ? K * w_ : 0;                                                          \
        /* ring [K][w_], the gw accumulators [K][w_], a gx row and the taps' scratch [w_] each */              \
        double *ring = w_ > 0 ? malloc((size_t)(K * w_ + nm + 2 * w_) * sizeof *ring) : NULL;                 \
        if (w_ > 0 && !ring) bad = 1;                                                                         \
        double *my = ring ? ring + K * w_ : NULL, *s = my ? my + nm : NULL, *a = s ? s + w_ : NULL;           \
        for (int64_t i = 0; i < nm && my; i++) my[i] = 0;                                                     \
        for (int64_t p = 0; ring && p < n + K - 1; p++) {                                                     \
            if (p < n) {                                                                                      \
                double *gap = ring + (p % K) * w_;                                                            \
                ga_row_##SFX(gap, a, gout, x, cache, start, wt, p, T_, C, K, c0, w_, silu);                   \
                for (int64_t j = 0; acc && j < K; j++) {                                                      \
                    const TT *src = tap_row_##SFX(x, cache, start, p, j, T_, C, K);                          \
                    if (!src) continue;                                                                       \
                    double *restrict aj = my + j * w_;                                                        \
                    const TT *restrict sj = src + c0;                                                         \
                    for (int64_t c = 0; c < w_; c++) aj[c] += gap[c] * (double)sj[c];                         \
                }                                                                                             \
            }                                                                                                 \
            int64_t q = p - (K - 1);                                                                          \
            if (!gx || q < 0) continue;                                                                       \
            for (int64_t c = 0; c < w_; c++) s[c] = 0;                                                        \
            for (int64_t j = 0; j < K; j++) {                                                                 \
                int64_t r = q + K - 1 - j;                                                                    \
                if (r >= n || start[r] != start[q]) continue;                                                 \
                const double *wj = wt + j * C + c0, *gr = ring + (r % K) * w_;                                \
                for (int64_t c = 0; c < w_; c++) s[c] += wj[c] * gr[c];                                       \
            }                                                                                                 \
            TT *o = gx + q * C + c0;                                                                          \
            for (int64_t c = 0; c < w_; c++) o[c] = (TT)s[c];                                                 \
        }                                                                                                     \
        for (int64_t j = 0; acc && my && j < K; j++) memcpy(acc + j * C + c0, my + j * w_, (size_t)w_ * sizeof *my); \
        free(ring);                                                                                           \
    }                                                                                                         \
    if (bad) return conv_backward_oom(wt, acc);                                                         \
    if (gw)                                                                                                   \
        for (int64_t c = 0; c < C; c++)                                                                       \
            for (int64_t j = 0; j < K; j++) gw[c * K + j] = (TT)acc[j * C + c];                               \
    /* cache slot m holds time m − (K−1) of row b; token t of the row's first segment reads it at tap j = m − t    \
       (ga of those tokens formed again here, a whole row at a time) */                                       \
    if (gcache && K > 1) {                                                                                    \
        double *gb = malloc((size_t)(2 * (K - 1) * C) * sizeof *gb);                                          \
        if (!gb) return conv_backward_oom(wt, acc);                                                     \
        for (int64_t b = 0; b < B; b++) {                                                                     \
            for (int64_t t = 0; t < K - 1 && t < T_; t++)                                                     \
                ga_row_##SFX(gb + t * C, gb + (K - 1) * C, gout, x, cache, start, wt, b * T_ + t, T_, C, K, 0, C, silu); \
            for (int64_t m = 0; m < K - 1; m++)                                                               \
                for (int64_t c = 0; c < C; c++) {                                                             \
                    double sum = 0;                                                                           \
                    for (int64_t t = 0; t <= m && t < T_; t++) {                                              \
                        int64_t p = b * T_ + t;                                                               \
                        if (start[p] == b * T_) sum += (double)w[c * K + (m - t)] * gb[t * C + c];            \
                    }                                                                                         \
                    gcache[(b * (K - 1) + m) * C + c] = (TT)sum;                                              \
                }                                                                                             \
        }                                                                                                     \
        free(gb);                                                                                             \
    }                                                                                                         \
    free(acc);                                                                                                \
    free(wt);                                                                                                 \
    return 0;                                                                                                 \
}

DEFINE_CONV(float, f32)
DEFINE_CONV(double, f64)

int tide_cpu_causal_conv1d(int dtype, void *out, const void *x, const void *w, const void *cache, const int64_t *cu,
                           int64_t n_seg, int64_t B, int64_t T_, int64_t C, int64_t K, int silu)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("causal_conv1d: dtype %s is not supported on the cpu backend (f32, f64)", tide_cpu_dtype_str(dtype));
    int64_t n = B * T_, *start = segment_starts(cu, n_seg, n);
    if (!start) return tide_set_error("causal_conv1d: out of memory");
    int rc = dtype == TIDE_F32 ? conv_f32(out, x, w, cache, start, n, T_, C, K, silu)
                               : conv_f64(out, x, w, cache, start, n, T_, C, K, silu);
    free(start);
    return rc;
}

int tide_cpu_conv_decode_rows(int dtype, void *out, const void *x, const void *w, void *const *caches, int64_t R,
                              int64_t C, int64_t K, int silu)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("conv_decode_rows: dtype %s is not supported on the cpu backend (f32, f64)",
                              tide_cpu_dtype_str(dtype));
    return dtype == TIDE_F32 ? conv_rows_f32(out, x, w, caches, R, C, K, silu)
                             : conv_rows_f64(out, x, w, caches, R, C, K, silu);
}

int tide_cpu_causal_conv1d_backward(int dtype, void *gx, void *gw, void *gcache, const void *gout, const void *x,
                                    const void *w, const void *cache, const int64_t *cu, int64_t n_seg, int64_t B,
                                    int64_t T_, int64_t C, int64_t K, int silu)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("causal_conv1d: dtype %s is not supported on the cpu backend (f32, f64)", tide_cpu_dtype_str(dtype));
    int64_t n = B * T_, *start = segment_starts(cu, n_seg, n);
    if (!start) return tide_set_error("causal_conv1d: out of memory");
    int rc = dtype == TIDE_F32 ? conv_backward_f32(gx, gw, gcache, gout, x, w, cache, start, B, n, T_, C, K, silu)
                               : conv_backward_f64(gx, gw, gcache, gout, x, w, cache, start, B, n, T_, C, K, silu);
    free(start);
    return rc;
}

/*
 * attention.c — softmax attention per (batch·head) on q [BH, Tq, D], k, v [BH, Tk, D] (kernels/backend.h).
 *
 * Forward, per head:  S = scale Q Kᵀ,  lse_i = log Σ_{j visible} exp(S_ij),  P = exp(S − lse),  O = P V.
 * Backward (spec/mla.md §4), recomputing P from the saved lse instead of storing it:
 *   dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ⊙ (dP − rowsum(dO ⊙ O)),  dQ = scale dS K,  dK = scale dSᵀ Q.
 * causal: query i sees key j iff j <= i + (Tk − Tq) (the last query aligns with the last key). A query
 * that sees no key (causal with Tq > Tk) gets out 0, lse −inf and no gradient.
 *
 * The products go to BLAS one head at a time with a [Tq, Tk] scratch. Many small heads (a score matrix of at most
 * HEAD_PAR_MAX elements, at least two heads) run in parallel, one head per thread with its own scratch: a BLAS
 * call inside the parallel region runs single-threaded (OpenBLAS checks omp_in_parallel(); gemm.c), and one
 * threaded BLAS call per small head cost more in waking its threads than its products. Larger heads run one after
 * another, each product threaded by BLAS and the softmax rows by OpenMP.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#include <omp.h>
#include "cpu.h"
#include "fastmath.h"

/* the softmax exponentials in double: f32 on exp_f64 (fastmath.h: libm's float results, in loops that vectorise; the
   sums a block at a time, in order), f64 on libm */
#define ATT_BLOCK 64
static inline double att_exp_f32(double x) { return exp_f64(x); }
static inline double att_exp_f64(double x) { return exp(x); }
/* a row's max over its first n scores, as double (the float max widened: the same value as comparing in double) */
static inline double att_max_f32(const float *x, int64_t n) { return (double)max_f32(x, n, -INFINITY); }
static inline double att_max_f64(const double *x, int64_t n) { return max_f64(x, n, -INFINITY); }

/* index of the last key query i may see (−1: none) */
static inline int64_t last_key(int64_t i, int64_t Tq, int64_t Tk, int causal)
{
    if (!causal) return Tk - 1;
    int64_t last = i + (Tk - Tq);
    return last < Tk - 1 ? last : Tk - 1;
}

static inline blasint ld_of(int64_t n) { return (blasint)(n > 0 ? n : 1); }

/* heads in parallel when a head's score matrix has at most this many elements (a 1,024 x 1,024 f32 scratch: 4 MB
   a thread, 8 MB in the backward) */
#define HEAD_PAR_MAX ((int64_t)1 << 20)

/* the threads that share the heads: 1 (heads in sequence, BLAS and the row loops threaded) or up to one a head */
static int head_threads(int64_t BH, int64_t Tq, int64_t Tk)
{
    int nt = omp_get_max_threads();
    if (BH < 2 || nt < 2 || Tq * Tk > HEAD_PAR_MAX) return 1;
    return BH < nt ? (int)BH : nt;
}

/* C [M, N] = alpha op(A) op(B) (beta = 0), row-major; an empty inner dim gives C = 0 */
#define DEFINE_MM(T, SFX, GEMM)                                                                         \
static void mm_##SFX(int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const T *A,        \
                     int64_t lda, const T *B, int64_t ldb, T *C, int64_t ldc)                           \
{                                                                                                       \
    if (M == 0 || N == 0) return;                                                                       \
    if (K == 0) {                                                                                       \
        for (int64_t i = 0; i < M; i++) memset(C + i * ldc, 0, (size_t)N * sizeof(T));                  \
        return;                                                                                         \
    }                                                                                                   \
    GEMM(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (blasint)M,     \
         (blasint)N, (blasint)K, (T)alpha, A, ld_of(lda), B, ld_of(ldb), (T)0, C, ld_of(ldc));          \
}

DEFINE_MM(float, f32, cblas_sgemm)
DEFINE_MM(double, f64, cblas_dgemm)

#define DEFINE_ATTENTION(T, SFX)                                                                        \
/* S [Tq, Tk] holds scale·Q Kᵀ; on return it holds P (0 at masked keys). lse may be NULL (backward     \
   passes the saved one in slse instead and P is recomputed from it). */                                \
static void probs_##SFX(T *S, T *lse, const T *slse, int64_t Tq, int64_t Tk, int causal, int par)      \
{                                                                                                       \
    _Pragma("omp parallel for if(par && Tq * Tk > TIDE_OMP_MIN_MATH)")                                              \
    for (int64_t i = 0; i < Tq; i++) {                                                                  \
        T *sr = S + i * Tk;                                                                             \
        int64_t last = last_key(i, Tq, Tk, causal);                                                     \
        double l;                                                                                       \
        if (slse) {                                                                                     \
            l = (double)slse[i];                                                                        \
        } else if (last < 0) {                                                                          \
            l = -INFINITY;                                                                              \
        } else {                                                                                        \
            double mx = att_max_##SFX(sr, last + 1), sum = 0.0;                                        \
            double e[ATT_BLOCK];                                                                        \
            for (int64_t j0 = 0; j0 <= last; j0 += ATT_BLOCK) {                                         \
                int64_t m = last + 1 - j0 < ATT_BLOCK ? last + 1 - j0 : ATT_BLOCK;                      \
                for (int64_t jj = 0; jj < m; jj++) e[jj] = att_exp_##SFX((double)sr[j0 + jj] - mx);     \
                for (int64_t jj = 0; jj < m; jj++) sum += e[jj];                                        \
            }                                                                                           \
            l = mx + log(sum);                                                                          \
        }                                                                                               \
        if (lse) lse[i] = (T)l;                                                                         \
        int64_t j = 0;                                                                                  \
        if (l != -INFINITY)                                                                             \
            for (; j <= last; j++) sr[j] = (T)att_exp_##SFX((double)sr[j] - l);                         \
        for (; j < Tk; j++) sr[j] = 0;                                                                  \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
/* S: nt [Tq, Tk] scratches, one a thread */                                                            \
static void attention_##SFX(T *out, T *lse, const T *q, const T *k, const T *v, T *S, int64_t BH,      \
                            int64_t Tq, int64_t Tk, int64_t D, int causal, double scale, int nt)        \
{                                                                                                       \
    _Pragma("omp parallel for num_threads(nt) schedule(static) if(nt > 1)")                             \
    for (int64_t h = 0; h < BH; h++) {                                                                  \
        const T *qh = q + h * Tq * D, *kh = k + h * Tk * D, *vh = v + h * Tk * D;                       \
        T *oh = out + h * Tq * D, *Sh = S + (int64_t)omp_get_thread_num() * Tq * Tk;                    \
        mm_##SFX(0, 1, Tq, Tk, D, scale, qh, D, kh, D, Sh, Tk);                                         \
        probs_##SFX(Sh, lse + h * Tq, NULL, Tq, Tk, causal, nt == 1);                                   \
        mm_##SFX(0, 0, Tq, D, Tk, 1.0, Sh, Tk, vh, D, oh, D);                                           \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
/* PS: nt pairs of [Tq, Tk] scratches (P, dS), one a thread */                                          \
static void attention_backward_##SFX(T *dq, T *dk, T *dv, const T *dout, const T *q, const T *k,       \
                                     const T *v, const T *out, const T *lse, T *PS, int64_t BH,        \
                                     int64_t Tq, int64_t Tk, int64_t D, int causal, double scale, int nt) \
{                                                                                                       \
    _Pragma("omp parallel for num_threads(nt) schedule(static) if(nt > 1)")                             \
    for (int64_t h = 0; h < BH; h++) {                                                                  \
        const T *qh = q + h * Tq * D, *kh = k + h * Tk * D, *vh = v + h * Tk * D;                       \
        const T *oh = out + h * Tq * D, *doh = dout + h * Tq * D;                                       \
        T *dqh = dq + h * Tq * D, *dkh = dk + h * Tk * D, *dvh = dv + h * Tk * D;                       \
        T *P = PS + (int64_t)omp_get_thread_num() * 2 * Tq * Tk, *dS = P + Tq * Tk;                     \
        mm_##SFX(0, 1, Tq, Tk, D, scale, qh, D, kh, D, P, Tk);                                          \
        probs_##SFX(P, NULL, lse + h * Tq, Tq, Tk, causal, nt == 1);                                    \
        mm_##SFX(1, 0, Tk, D, Tq, 1.0, P, Tk, doh, D, dvh, D);          /* dV = Pᵀ dO */                \
        mm_##SFX(0, 1, Tq, Tk, D, 1.0, doh, D, vh, D, dS, Tk);          /* dP = dO Vᵀ */                \
        _Pragma("omp parallel for if(nt == 1 && Tq * Tk > TIDE_OMP_MIN_MATH)")                                      \
        for (int64_t i = 0; i < Tq; i++) {                                                              \
            const T *orow = oh + i * D, *grow = doh + i * D, *pr = P + i * Tk;                          \
            T *dr = dS + i * Tk;                                                                        \
            double di = 0.0;                                                                            \
            for (int64_t d = 0; d < D; d++) di += (double)grow[d] * (double)orow[d];                    \
            for (int64_t j = 0; j < Tk; j++) dr[j] = (T)((double)pr[j] * ((double)dr[j] - di));         \
        }                                                                                               \
        mm_##SFX(0, 0, Tq, D, Tk, scale, dS, Tk, kh, D, dqh, D);        /* dQ = scale dS K */           \
        mm_##SFX(1, 0, Tk, D, Tq, scale, dS, Tk, qh, D, dkh, D);        /* dK = scale dSᵀ Q */          \
    }                                                                                                   \
}

DEFINE_ATTENTION(float, f32)
DEFINE_ATTENTION(double, f64)

/* shared argument checks; *bytes gets the size of one [Tq, Tk] scratch */
static int check_args(const char *op, int dtype, int64_t BH, int64_t Tq, int64_t Tk, int64_t D, size_t *bytes)
{
    if (BH < 0 || Tq < 0 || Tk < 0 || D < 0)
        return tide_set_error("%s: negative size BH=%lld Tq=%lld Tk=%lld D=%lld", op, (long long)BH,
                              (long long)Tq, (long long)Tk, (long long)D);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s not supported on cpu (expected f32 or f64)", op, tide_cpu_dtype_str(dtype));
    if (Tq > INT32_MAX || Tk > INT32_MAX || D > INT32_MAX)
        return tide_set_error("%s: sizes Tq=%lld Tk=%lld D=%lld exceed the BLAS index range", op,
                              (long long)Tq, (long long)Tk, (long long)D);
    size_t es = dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    if (Tk > 0 && (uint64_t)Tq > SIZE_MAX / 2 / es / (uint64_t)Tk)
        return tide_set_error("%s: score scratch of %lld x %lld does not fit in memory", op, (long long)Tq,
                              (long long)Tk);
    *bytes = (size_t)Tq * (size_t)Tk * es;
    return 0;
}

int tide_cpu_attention(int dtype, void *out, void *lse, const void *q, const void *k, const void *v, int64_t BH,
                       int64_t Tq, int64_t Tk, int64_t D, int causal, double scale)
{
    size_t bytes = 0;
    int rc = check_args("attention", dtype, BH, Tq, Tk, D, &bytes);
    if (rc) return rc;
    if (BH == 0 || Tq == 0) return 0;
    int nt = head_threads(BH, Tq, Tk);
    void *S = malloc(bytes ? (size_t)nt * bytes : 1);
    if (!S) return tide_set_error("attention: out of memory allocating %zu bytes for the score scratch", (size_t)nt * bytes);
    if (dtype == TIDE_F32) attention_f32(out, lse, q, k, v, S, BH, Tq, Tk, D, causal, scale, nt);
    else attention_f64(out, lse, q, k, v, S, BH, Tq, Tk, D, causal, scale, nt);
    free(S);
    return 0;
}

int tide_cpu_attention_backward(int dtype, void *dq, void *dk, void *dv, const void *dout, const void *q,
                                const void *k, const void *v, const void *out, const void *lse, int64_t BH,
                                int64_t Tq, int64_t Tk, int64_t D, int causal, double scale)
{
    size_t bytes = 0;
    int rc = check_args("attention_backward", dtype, BH, Tq, Tk, D, &bytes);
    if (rc) return rc;
    if (BH == 0) return 0;
    int nt = head_threads(BH, Tq, Tk);
    void *P = malloc(bytes ? 2 * (size_t)nt * bytes : 1);
    if (!P)
        return tide_set_error("attention_backward: out of memory allocating %zu bytes for the score scratch",
                              2 * (size_t)nt * bytes);
    if (dtype == TIDE_F32)
        attention_backward_f32(dq, dk, dv, dout, q, k, v, out, lse, P, BH, Tq, Tk, D, causal, scale, nt);
    else
        attention_backward_f64(dq, dk, dv, dout, q, k, v, out, lse, P, BH, Tq, Tk, D, causal, scale, nt);
    free(P);
    return 0;
}

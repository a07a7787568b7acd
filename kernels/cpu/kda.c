/*
 * kda.c — Kimi Delta Attention on the CPU (kernels/backend.h; math in spec/kda.md):
 *   - the token recurrence (§3): the readable reference and the decode step, with its backward;
 *   - the chunk form (§4) with C-token chunks whose intra-chunk decay is factorised
 *     exp(G_r − G_j) = exp(G_r)·exp(−G_j), so the diagonal block goes through the same dense products as
 *     everything else. That is only valid because the decay is lower-bounded: with g >= lb and C·|lb| <= 80
 *     both factors stay normal floats (§5). The kernel therefore refuses any g outside [lb, 0];
 *   - the same chunk form with per-pair exp(G_r − G_j) (any g <= 0), for the unbounded softplus gate;
 *   - the decay gate (§2) and its backward.
 * The backward of the chunk form recomputes the chunk start states (first the start state of every block
 * of 64 chunks, then one block's chunks at a time) instead of storing them (§6).
 * Work is split over (document segment, head) pairs; each owns its rows of every output, so the result
 * does not depend on the thread count. float32 and float64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "cpu.h"

#include "fastmath.h"

/* the kernels' short row copies and zero fills stay inline loops: GCC would otherwise turn each into a libc call,
   and at 16-64 elements a row the calls cost more than the copies (a sixth of the chunk path's time) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-loop-distribute-patterns")
#endif

/* subnormals flush to zero inside the KDA kernels (cpu.h: tide_cpu_flush_denormals): a decayed state entry or
   gradient below FLT_MIN carries nothing of value (1e-38 of the scale), but a strongly decaying gate produces many,
   and x86 computes on subnormals about 100x slower: the recurrence ran at half speed on realistic gates without it */
#define kda_flush_denormals tide_cpu_flush_denormals
#define kda_restore_denormals tide_cpu_restore_denormals

/* EXP: the vectorisable float exp above, libm's exp for double */
#define T float
#define SFX f32
#define EXP exp_f32
#include "kda_impl.h"
#undef T
#undef SFX
#undef EXP
#define T double
#define SFX f64
#define EXP exp
#include "kda_impl.h"
#undef T
#undef SFX
#undef EXP

static double load(int dtype, const void *p, int64_t i)
{
    return dtype == TIDE_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

/* the first index in [0, n) whose g is outside [lb, 0], or n: blocks of 1,024 tested with a branch-free or (the loop
   vectorises), the offending block searched element by element */
#define BOUND_SCAN(TY)                                                                                          \
    {                                                                                                           \
        const TY *x = g;                                                                                        \
        _Pragma("omp parallel for reduction(min : bad) schedule(static) if (n > 4 * TIDE_OMP_MIN)")                        \
        for (int64_t b0 = 0; b0 < n; b0 += 1024) {                                                              \
            int64_t b1 = b0 + 1024 < n ? b0 + 1024 : n;                                                         \
            int out = 0;                                                                                        \
            for (int64_t i = b0; i < b1; i++) out |= ((double)x[i] < lb) | ((double)x[i] > 0);                  \
            if (!out) continue;                                                                                 \
            for (int64_t i = b0; i < b1; i++)                                                                   \
                if (((double)x[i] < lb || x[i] > 0) && i < bad) { bad = i; break; }                             \
        }                                                                                                       \
    }

/* the dense path's precondition: lb <= g <= 0 everywhere (NaN passes: training reports it) */
static int check_bound(int dtype, const void *g, int64_t n, int64_t H, int64_t dk, int64_t T_, double lb)
{
    int64_t bad = n;
    if (dtype == TIDE_F32) BOUND_SCAN(float)
    else BOUND_SCAN(double)
    if (bad == n) return 0;
    int64_t ch = bad % dk, h = bad / dk % H, tok = bad / dk / H;
    return tide_set_error("kda: g = %g at [b %lld, t %lld, head %lld, channel %lld] is outside [%g, 0]: the chunk path "
                          "factorises the decay and needs the lower-bounded gate (kda.md §5); use the bounded gate "
                          "or the chunk_safe path", load(dtype, g, bad), (long long)(tok / T_), (long long)(tok % T_),
                          (long long)h, (long long)ch, lb);
}

static int check_args(const char *op, int dtype, int path, int64_t chunk, double lb)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s is not supported on the cpu backend (f32, f64)", op, tide_cpu_dtype_str(dtype));
    if (path < TIDE_KDA_CHUNK || path > TIDE_KDA_RECURRENT) return tide_set_error("%s: unknown path %d", op, path);
    if (path != TIDE_KDA_RECURRENT && (chunk < 1 || chunk > 1024))
        return tide_set_error("%s: chunk must be in [1, 1024], got %lld", op, (long long)chunk);
    /* |G| <= chunk·|lb| must keep exp(±G) normal: 80 nats in f32 (kda.md §5), 700 in f64 */
    double limit = dtype == TIDE_F64 ? 700.0 : 80.0;
    if (path == TIDE_KDA_CHUNK && !isinf(lb) && !(lb < 0 && (double)chunk * -lb <= limit))
        return tide_set_error("%s: the chunk path needs lower bound lb < 0 with chunk·|lb| <= %g for %s (kda.md §5), got "
                              "lb %g and chunk %lld", op, limit, tide_cpu_dtype_str(dtype), lb, (long long)chunk);
    return 0;
}

int tide_cpu_kda(int dtype, void *o, void *s_out, const void *q, const void *k, const void *v, const void *g,
                 const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T_, int64_t H,
                 int64_t dk, int64_t dv, int path, int64_t chunk, double lb, void *ckpt)
{
    if (check_args("kda", dtype, path, chunk, lb)) return -1;
    if (path == TIDE_KDA_CHUNK && !isinf(lb) && check_bound(dtype, g, B * T_ * H * dk, H, dk, T_, lb)) return -1;
    if (dtype == TIDE_F32)
        return kda_forward_f32(o, s_out, q, k, v, g, beta, s0, cu, n_seg, T_, H, dk, dv, path, chunk, ckpt);
    return kda_forward_f64(o, s_out, q, k, v, g, beta, s0, cu, n_seg, T_, H, dk, dv, path, chunk, ckpt);
}

int tide_cpu_kda_decode_rows(int dtype, void *o, const void *q, const void *k, const void *v, const void *g,
                             const void *beta, void *const *states, int64_t R, int64_t H, int64_t dk, int64_t dv)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("kda_decode_rows: dtype %s is not supported on the cpu backend (f32, f64)",
                              tide_cpu_dtype_str(dtype));
    if (dtype == TIDE_F32) return kda_decode_rows_f32(o, q, k, v, g, beta, states, R, H, dk, dv);
    return kda_decode_rows_f64(o, q, k, v, g, beta, states, R, H, dk, dv);
}

int tide_cpu_kda_backward(int dtype, void *gq, void *gk, void *gv, void *gg, void *gbeta, void *gs0, const void *gout,
                          const void *gs_out, const void *q, const void *k, const void *v, const void *g,
                          const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T_,
                          int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk, double lb, const void *ckpt)
{
    if (check_args("kda backward", dtype, path, chunk, lb)) return -1;
    if (path == TIDE_KDA_CHUNK && !isinf(lb) && check_bound(dtype, g, B * T_ * H * dk, H, dk, T_, lb)) return -1;
    /* rows of gs0 without a first segment do not exist: every row start is a boundary */
    if (dtype == TIDE_F32)
        return kda_backward_f32(gq, gk, gv, gg, gbeta, gs0, gout, gs_out, q, k, v, g, beta, s0, cu, n_seg, T_, H, dk,
                                dv, path, chunk, ckpt);
    return kda_backward_f64(gq, gk, gv, gg, gbeta, gs0, gout, gs_out, q, k, v, g, beta, s0, cu, n_seg, T_, H, dk, dv,
                            path, chunk, ckpt);
}

/* (I + A)⁻¹ of a strictly lower-triangular c x c matrix (row stride c), for tests: method 0 = forward
   substitution (what the kernel uses), 1 = the nilpotent product (I − A)(I + A²)(I + A⁴)(I + A⁸)…
   (exact when A^(2^m) = 0, i.e. c <= 2^m; kda.md §4) */
int tide_cpu_kda_unit_lower_inverse(int dtype, void *M, const void *A, int64_t c, int method)
{
    if (dtype != TIDE_F64) return tide_set_error("kda inverse: only f64 is provided for tests");
    double *out = M;
    const double *a = A;
    if (method == 0) { unit_lower_inverse_f64(out, a, c, c); return 0; }
    double *P = malloc((size_t)(3 * c * c) * sizeof(double)), *X = P + c * c, *Y = X + c * c;
    if (!P) return tide_set_error("kda inverse: out of memory");
    /* out = I − A;  P = A²;  repeat: out ← out (I + P), P ← P² while P != 0 */
    for (int64_t i = 0; i < c * c; i++) out[i] = -a[i];
    for (int64_t i = 0; i < c; i++) out[i * c + i] += 1;
    mm_f64(P, c, a, c, 1, a, c, c, c, c, 1, 0);
    for (int64_t pw = 2; pw < c; pw *= 2) {
        memcpy(X, P, (size_t)(c * c) * sizeof(double));
        for (int64_t i = 0; i < c; i++) X[i * c + i] += 1;
        mm_f64(Y, c, out, c, 1, X, c, c, c, c, 1, 0);
        memcpy(out, Y, (size_t)(c * c) * sizeof(double));
        mm_f64(Y, c, P, c, 1, P, c, c, c, c, 1, 0);
        memcpy(P, Y, (size_t)(c * c) * sizeof(double));
    }
    free(P);
    return 0;
}

/* ---- the decay gate (kda.md §2, derivatives in §6) ---------------------------------------------------- */
/* in double for both dtypes (exp(A_log) once per channel, not per element); the f32 bounded gate's σ on exp_f64
   (fastmath.h: libm's float results, in loops that vectorise), f64 and the softplus form on libm */
static inline double sigmoid_f64(double x) { return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x)); }
static inline double softplus_f64(double x) { return x > 30 ? x : log1p(exp(x)); }

/* rows n of the gate backward over this thread's channels [c0, c1); BOUNDED, WZ (write gz) and WC (sum into colA)
   are constants at each use */
#define GATE_BWD_ROWS(TT, SIG, SOFTPLUS, BOUNDED, WZ, WC)                                                                   \
    for (int64_t n = 0; n < N; n++)                                                                           \
        for (int64_t c = c0; c < c1; c++) {                                                                   \
            double x = (double)z[n * HD + c] + (double)b[c];                                                  \
            double dgx, dga, go = (double)gg[n * HD + c];                                                     \
            if (BOUNDED) {                                                                                    \
                double u = ea[c] * x, s = SIG(u), ds = lb * s * (1 - s);                                      \
                dgx = ds * ea[c];                                                                             \
                dga = ds * u;                                                                                 \
            } else {                                                                                          \
                dgx = -ea[c] * SIG(x);                                                                        \
                dga = -ea[c] * SOFTPLUS(x);                                                                   \
            }                                                                                                 \
            if (WZ) gz[n * HD + c] = (TT)(go * dgx);                                                          \
            if (WC) { colA[c] += go * dga; colA[HP + c] += go * dgx; }                                        \
        }

#define DEFINE_GATE(TT, SFX2, SIG, SOFTPLUS)                                                                   \
static int gate_##SFX2(TT *g, const TT *z, const TT *A_log, const TT *b, int64_t N, int64_t H, int64_t D,       \
                       double lb, int form)                                                                   \
{                                                                                                             \
    int64_t HD = H * D;                                                                                       \
    double *ea = malloc((size_t)(HD > 0 ? HD : 1) * sizeof *ea);        /* exp(A_log) per channel */          \
    if (!ea) return tide_set_error("kda_gate: out of memory");                                                \
    for (int64_t c = 0; c < HD; c++) ea[c] = exp((double)A_log[c / D]);                                       \
    _Pragma("omp parallel for if(N * HD > TIDE_OMP_MIN_MATH)")                                                            \
    for (int64_t n = 0; n < N; n++) {                                                                         \
        const TT *zr = z + n * HD;                                                                            \
        TT *gr = g + n * HD;                                                                                  \
        if (form == TIDE_KDA_GATE_BOUNDED)                                                                    \
            for (int64_t c = 0; c < HD; c++) gr[c] = (TT)(lb * SIG(ea[c] * ((double)zr[c] + (double)b[c])));  \
        else                                                                                                  \
            for (int64_t c = 0; c < HD; c++) gr[c] = (TT)(-ea[c] * SOFTPLUS((double)zr[c] + (double)b[c]));   \
    }                                                                                                         \
    free(ea);                                                                                                 \
    return 0;                                                                                                 \
}                                                                                                             \
                                                                                                              \
/* per element: dz = gg ∂g/∂x, and the A_log term gg ∂g/∂A; db and dA are column sums over N, split by     \
   column range among threads (each walks every row: no race, order independent of the thread count) */     \
static int gate_backward_##SFX2(TT *gz, TT *gA, TT *gb, const TT *gg, const TT *z, const TT *A_log,          \
                                const TT *b, int64_t N, int64_t H, int64_t D, double lb, int form)           \
{                                                                                                             \
    int64_t HD = H * D;                                                                                       \
    int64_t HP = TIDE_CPU_PAD8(HD);       /* colA: [0, HD) the A terms, [HP, HP + HD) the b terms */         \
    double *colA = (gA || gb) ? tide_cpu_malloc((size_t)(2 * HP) * sizeof(double)) : NULL;                     \
    double *ea = malloc((size_t)(HD > 0 ? HD : 1) * sizeof *ea);                                              \
    if (((gA || gb) && !colA) || !ea) { tide_cpu_free(colA); free(ea); return tide_set_error("kda_gate backward: out of memory"); } \
    if (colA) memset(colA, 0, (size_t)(2 * HP) * sizeof(double));                                             \
    for (int64_t c = 0; c < HD; c++) ea[c] = exp((double)A_log[c / D]);                                       \
    _Pragma("omp parallel if(N * HD > TIDE_OMP_MIN_MATH)")                                                                \
    {                                                                                                         \
        int64_t c0, c1;                       /* whole cache lines of colA per thread */                       \
        tide_cpu_column_range(HD, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);                     \
        /* the branches on the form and on which outputs are wanted taken once, outside the channel loops (the  \
           bounded form's loops then vectorise) */                                                            \
        if (form == TIDE_KDA_GATE_BOUNDED) {                                                                  \
            if (gz && colA) GATE_BWD_ROWS(TT, SIG, SOFTPLUS, 1, 1, 1)                                                       \
            else if (gz) GATE_BWD_ROWS(TT, SIG, SOFTPLUS, 1, 1, 0)                                                          \
            else if (colA) GATE_BWD_ROWS(TT, SIG, SOFTPLUS, 1, 0, 1)                                                        \
        } else {                                                                                              \
            if (gz && colA) GATE_BWD_ROWS(TT, SIG, SOFTPLUS, 0, 1, 1)                                                       \
            else if (gz) GATE_BWD_ROWS(TT, SIG, SOFTPLUS, 0, 1, 0)                                                          \
            else if (colA) GATE_BWD_ROWS(TT, SIG, SOFTPLUS, 0, 0, 1)                                                        \
        }                                                                                                     \
    }                                                                                                         \
    if (gb) for (int64_t c = 0; c < HD; c++) gb[c] = (TT)colA[HP + c];                                        \
    if (gA)                                                                                                   \
        for (int64_t h = 0; h < H; h++) {                                                                     \
            double s = 0;                                                                                     \
            for (int64_t d = 0; d < D; d++) s += colA[h * D + d];                                             \
            gA[h] = (TT)s;                                                                                    \
        }                                                                                                     \
    tide_cpu_free(colA);                                                                                      \
    free(ea);                                                                                                 \
    return 0;                                                                                                 \
}

DEFINE_GATE(float, f32, sigmoid_f64x, softplus_f64)
DEFINE_GATE(double, f64, sigmoid_f64, softplus_f64)
#undef GATE_BWD_ROWS

int tide_cpu_kda_gate(int dtype, void *g, const void *z, const void *A_log, const void *dt_bias, int64_t N, int64_t H,
                      int64_t D, double lb, int form)
{
    if (form != TIDE_KDA_GATE_BOUNDED && form != TIDE_KDA_GATE_SOFTPLUS) return tide_set_error("kda_gate: unknown form %d", form);
    if (dtype == TIDE_F32) return gate_f32(g, z, A_log, dt_bias, N, H, D, lb, form);
    if (dtype == TIDE_F64) return gate_f64(g, z, A_log, dt_bias, N, H, D, lb, form);
    return tide_set_error("kda_gate: dtype %s is not supported on the cpu backend (f32, f64)", tide_cpu_dtype_str(dtype));
}

int tide_cpu_kda_gate_backward(int dtype, void *gz, void *gA, void *gb, const void *gg, const void *z, const void *A_log,
                               const void *dt_bias, int64_t N, int64_t H, int64_t D, double lb, int form)
{
    if (form != TIDE_KDA_GATE_BOUNDED && form != TIDE_KDA_GATE_SOFTPLUS) return tide_set_error("kda_gate: unknown form %d", form);
    if (dtype == TIDE_F32) return gate_backward_f32(gz, gA, gb, gg, z, A_log, dt_bias, N, H, D, lb, form);
    if (dtype == TIDE_F64) return gate_backward_f64(gz, gA, gb, gg, z, A_log, dt_bias, N, H, D, lb, form);
    return tide_set_error("kda_gate: dtype %s is not supported on the cpu backend (f32, f64)", tide_cpu_dtype_str(dtype));
}

/*
 * test_parity.c — every op the CUDA backend implements, run on cuda:0 and on the CPU from the same
 * inputs, through the public API only (engine/tide.h). Forward outputs and input gradients must agree
 * within the tolerances of the case table below, and the GPU results must be finite.
 *
 * Gradients: each output is reduced as loss = sum(out ⊙ r) with a fixed random r (plain sum(out) would
 * give a zero gradient for softmax and hide errors), then tide_backward, then the leaves' grads are
 * compared. bf16 cases feed the GPU op bf16 copies of inputs that were first rounded to bf16 on the
 * CPU, so both sides see identical values and the difference is the bf16 arithmetic alone.
 *
 * Every op of the registry (tide_op_defs, engine/internal.h) must appear in the coverage table at the end of
 * this file, with the parity cases that exercise it or the reason it has none (as ggml's test-backend-ops
 * requires a test per op). That check needs no GPU and runs first: a new op without a parity case fails the
 * test on every machine.
 *
 * Exit code: 0 all passed, 1 some failed (or an op lacks coverage), 77 skipped (no CUDA device; CTest
 * SKIP_RETURN_CODE).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tide.h"
#include "internal.h"

#define CPU 0
#define GPU 1   /* cuda:0 */

/* ---- inputs ----------------------------------------------------------------------------------- */

enum {
    IN_NORMAL,      /* f32 N(0, 1) */
    IN_POS,         /* f32 uniform [0.5, 2): log, sqrt, rsqrt, pow and divisors */
    IN_IDS,         /* i64 uniform in [0, hi) */
    IN_IDS32,       /* i32 uniform in [0, hi) */
    IN_TARGETS,     /* i64 in [0, hi), every fourth row the ignore index -100 */
    IN_WEIGHTS,     /* f32 uniform [0.5, 1.5) */
    IN_CU,          /* i64 document boundaries [n]: 0 < distinct sorted cuts < hi (= B·T) */
};

typedef struct {
    int kind;
    int ndim;
    int64_t shape[4];
    int64_t hi;
} input_spec;

typedef tide_tensor *(*case_fn)(tide_tensor **in);

typedef struct {
    const char *name;
    case_fn fn;
    int n_in;
    input_spec in[4];
    int grad_mask;            /* bit i: input i requires grad and its gradient is compared */
    double atol, rtol;        /* forward: |gpu - cpu| <= atol + rtol |cpu| per element */
    double gatol, grtol;      /* gradients, same form */
    int bf16;                 /* run the GPU op on bf16 inputs */
} op_case;

static uint64_t lcg_state = 0x9E3779B97F4A7C15ull;
static uint64_t next_rand(void)
{
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return lcg_state >> 33;
}

static tide_tensor *make_input(const input_spec *s)
{
    int64_t n = 1;
    for (int d = 0; d < s->ndim; d++) n *= s->shape[d];
    switch (s->kind) {
    case IN_NORMAL: return tide_randn(TIDE_F32, s->ndim, s->shape, CPU, 0.0, 1.0);
    case IN_POS: return tide_rand(TIDE_F32, s->ndim, s->shape, CPU, 0.5, 2.0);
    case IN_WEIGHTS: return tide_rand(TIDE_F32, s->ndim, s->shape, CPU, 0.5, 1.5);
    default: break;
    }
    double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof *v);
    if (!v) return NULL;
    if (s->kind == IN_CU) {   /* n >= 2, hi >= n - 1: insertion of distinct random cuts */
        v[0] = 0;
        v[n - 1] = (double)s->hi;
        for (int64_t i = 1; i < n - 1; i++) {
            double c;
            int fresh;
            do {
                c = (double)(1 + (int64_t)(next_rand() % (uint64_t)(s->hi - 1)));
                fresh = 1;
                for (int64_t j = 1; j < i; j++) fresh = fresh && v[j] != c;
            } while (!fresh);
            int64_t j = i;
            while (j > 1 && v[j - 1] > c) { v[j] = v[j - 1]; j--; }
            v[j] = c;
        }
        tide_tensor *t = tide_from_f64(TIDE_I64, s->ndim, s->shape, CPU, v);
        free(v);
        return t;
    }
    for (int64_t i = 0; i < n; i++) {
        v[i] = (double)(int64_t)(next_rand() % (uint64_t)s->hi);
        if (s->kind == IN_TARGETS && i % 4 == 3) v[i] = -100.0;
    }
    tide_tensor *t = tide_from_f64(s->kind == IN_IDS32 ? TIDE_I32 : TIDE_I64, s->ndim, s->shape, CPU, v);
    free(v);
    return t;
}

/* ---- the ops under test --------------------------------------------------------------------------- */

static tide_tensor *f_neg(tide_tensor **in) { return tide_neg(in[0]); }
static tide_tensor *f_exp(tide_tensor **in) { return tide_exp(in[0]); }
static tide_tensor *f_log(tide_tensor **in) { return tide_log(in[0]); }
static tide_tensor *f_sqrt(tide_tensor **in) { return tide_sqrt(in[0]); }
static tide_tensor *f_rsqrt(tide_tensor **in) { return tide_rsqrt(in[0]); }
static tide_tensor *f_tanh(tide_tensor **in) { return tide_tanh(in[0]); }
static tide_tensor *f_sigmoid(tide_tensor **in) { return tide_sigmoid(in[0]); }
static tide_tensor *f_silu(tide_tensor **in) { return tide_silu(in[0]); }
static tide_tensor *f_gelu(tide_tensor **in) { return tide_gelu(in[0]); }
static tide_tensor *f_gelu_erf(tide_tensor **in) { return tide_gelu_erf(in[0]); }
static tide_tensor *f_softplus(tide_tensor **in) { return tide_softplus(in[0]); }
static tide_tensor *f_relu(tide_tensor **in) { return tide_relu(in[0]); }
static tide_tensor *f_abs(tide_tensor **in) { return tide_abs(in[0]); }
static tide_tensor *f_add_scalar(tide_tensor **in) { return tide_add_scalar(in[0], 0.75); }
static tide_tensor *f_mul_scalar(tide_tensor **in) { return tide_mul_scalar(in[0], -1.25); }
static tide_tensor *f_pow_frac(tide_tensor **in) { return tide_pow_scalar(in[0], 1.7); }
static tide_tensor *f_pow_2(tide_tensor **in) { return tide_pow_scalar(in[0], 2.0); }

static tide_tensor *f_add(tide_tensor **in) { return tide_add(in[0], in[1]); }
static tide_tensor *f_sub(tide_tensor **in) { return tide_sub(in[0], in[1]); }
static tide_tensor *f_mul(tide_tensor **in) { return tide_mul(in[0], in[1]); }
static tide_tensor *f_div(tide_tensor **in) { return tide_div(in[0], in[1]); }
static tide_tensor *f_swiglu(tide_tensor **in) { return tide_swiglu(in[0], in[1]); }
/* moe.md §6, §2: SiTU-GLU with small caps (both tanh factors bend on N(0, 1)·3 inputs) and top-k values */
static tide_tensor *f_situ(tide_tensor **in) { return tide_situ_glu(in[0], in[1], 1.5, 2.0); }
static tide_tensor *f_topk(tide_tensor **in)
{
    tide_tensor *v = NULL, *id = NULL;
    if (tide_topk(in[0], 5, &v, &id)) return NULL;
    tide_tensor_release(id);
    return v;
}

static tide_tensor *f_sum_all(tide_tensor **in) { return tide_sum(in[0], 0, NULL, 0); }
static tide_tensor *f_sum_d1(tide_tensor **in) { int d[1] = {1}; return tide_sum(in[0], 1, d, 0); }
static tide_tensor *f_sum_d02k(tide_tensor **in) { int d[2] = {0, 2}; return tide_sum(in[0], 2, d, 1); }
static tide_tensor *f_sum_last(tide_tensor **in) { int d[1] = {-1}; return tide_sum(in[0], 1, d, 0); }
static tide_tensor *f_mean_d2(tide_tensor **in) { int d[1] = {2}; return tide_mean(in[0], 1, d, 0); }
static tide_tensor *f_max_d1(tide_tensor **in) { return tide_max(in[0], 1, 0); }
static tide_tensor *f_max_last(tide_tensor **in) { return tide_max(in[0], -1, 1); }
static tide_tensor *f_argmax_d2(tide_tensor **in) { return tide_argmax(in[0], 2, 0); }
static tide_tensor *f_argmax_d0(tide_tensor **in) { return tide_argmax(in[0], 0, 1); }
static tide_tensor *f_lse_d0(tide_tensor **in) { return tide_logsumexp(in[0], 0, 0); }
static tide_tensor *f_lse_last(tide_tensor **in) { return tide_logsumexp(in[0], -1, 0); }

static tide_tensor *f_mm(tide_tensor **in) { return tide_matmul(in[0], in[1], 0, 0); }
static tide_tensor *f_mm_ta(tide_tensor **in) { return tide_matmul(in[0], in[1], 1, 0); }
static tide_tensor *f_mm_tb(tide_tensor **in) { return tide_matmul(in[0], in[1], 0, 1); }
static tide_tensor *f_mm_tatb(tide_tensor **in) { return tide_matmul(in[0], in[1], 1, 1); }
static tide_tensor *f_linear(tide_tensor **in) { return tide_linear(in[0], in[1], in[2]); }
static tide_tensor *f_linear_nob(tide_tensor **in) { return tide_linear(in[0], in[1], NULL); }

static tide_tensor *f_rmsnorm(tide_tensor **in) { return tide_rmsnorm(in[0], in[1], 1e-5); }
static tide_tensor *f_layernorm(tide_tensor **in) { return tide_layernorm(in[0], in[1], in[2], 1e-5); }
static tide_tensor *f_softmax(tide_tensor **in) { return tide_softmax(in[0], -1); }
static tide_tensor *f_softmax_d0(tide_tensor **in) { return tide_softmax(in[0], 0); }
static tide_tensor *f_log_softmax(tide_tensor **in) { return tide_log_softmax(in[0], -1); }
static tide_tensor *f_ce_mean(tide_tensor **in) { return tide_cross_entropy(in[0], in[1], NULL, -100, 0); }
static tide_tensor *f_ce_w_sum(tide_tensor **in) { return tide_cross_entropy(in[0], in[1], in[2], -100, 1); }
static tide_tensor *f_ce_w_none(tide_tensor **in) { return tide_cross_entropy(in[0], in[1], in[2], -100, 2); }
static tide_tensor *f_ce_w_mean(tide_tensor **in) { return tide_cross_entropy(in[0], in[1], in[2], -100, 0); }
/* token_logprobs: logp and entropy in one vector, so the gradient seeds both outputs at once */
static tide_tensor *f_tlp(tide_tensor **in)
{
    tide_tensor *lp = NULL, *h = NULL;
    if (tide_token_logprobs(in[0], in[1], -100, &lp, &h)) return NULL;
    int64_t flat[1] = {-1};
    tide_tensor *a = tide_reshape(lp, 1, flat), *b = tide_reshape(h, 1, flat);
    tide_tensor *pair[2] = {a, b}, *y = (a && b) ? tide_concat(2, pair, 0) : NULL;
    tide_tensor_release(lp); tide_tensor_release(h); tide_tensor_release(a); tide_tensor_release(b);
    return y;
}
static tide_tensor *f_rope(tide_tensor **in) { return tide_rope(in[0], 10000.0, 3); }
static tide_tensor *f_rope_far(tide_tensor **in) { return tide_rope(in[0], 10000.0, 1000000); }
/* vision.md §4: 2D RoPE with (row, col) positions in [0, 512); the position table resampled to fixed grids
   (upsample, the native grid: a copy, 1x1, non-square), the grids a CPU tensor (the op reads them on the host) */
static tide_tensor *f_rope2d(tide_tensor **in) { return tide_rope2d(in[0], in[1], 10000.0); }
static tide_tensor *f_pos_interp(tide_tensor **in)
{
    double v[8] = {13, 5, 8, 8, 1, 1, 3, 17};
    int64_t s[2] = {4, 2};
    tide_tensor *g = tide_from_f64(TIDE_I64, 2, s, CPU, v);
    tide_tensor *y = g ? tide_pos_interp(in[0], g) : NULL;
    tide_tensor_release(g);
    return y;
}
static tide_tensor *f_pos_interp_big(tide_tensor **in)
{
    double v[4] = {64, 48, 5, 70};
    int64_t s[2] = {2, 2};
    tide_tensor *g = tide_from_f64(TIDE_I32, 2, s, CPU, v);
    tide_tensor *y = g ? tide_pos_interp(in[0], g) : NULL;
    tide_tensor_release(g);
    return y;
}
static tide_tensor *f_embedding(tide_tensor **in) { return tide_embedding(in[0], in[1]); }
/* kda.md §1-§2: the gate (both forms), the short conv (cache, documents, SiLU), the L2 norm */
static tide_tensor *f_gate_bounded(tide_tensor **in) { return tide_kda_gate(in[0], in[1], in[2], -5.0, TIDE_KDA_GATE_BOUNDED); }
static tide_tensor *f_gate_softplus(tide_tensor **in) { return tide_kda_gate(in[0], in[1], in[2], 0.0, TIDE_KDA_GATE_SOFTPLUS); }
static tide_tensor *f_conv(tide_tensor **in) { return tide_causal_conv1d(in[0], in[1], in[2], in[3], 1); }
static tide_tensor *f_conv_plain(tide_tensor **in) { return tide_causal_conv1d(in[0], in[1], NULL, NULL, 0); }
static tide_tensor *f_l2norm(tide_tensor **in) { return tide_l2norm(in[0], 1e-6, 0.125); }
static tide_tensor *f_index_select(tide_tensor **in) { return tide_index_select(in[0], 1, in[1]); }
static tide_tensor *f_gather(tide_tensor **in) { return tide_gather(in[0], 1, in[1]); }
static tide_tensor *f_scatter_add(tide_tensor **in) { return tide_scatter_add(in[0], 1, in[1], in[2]); }
/* layout and conversion kernels: a strided copy, and f32 -> bf16 -> f32 */
static tide_tensor *f_transpose_contig(tide_tensor **in)
{
    tide_tensor *t = tide_transpose(in[0], 0, 2);
    tide_tensor *c = t ? tide_contiguous(t) : NULL;
    tide_tensor_release(t);
    return c;
}
/* view ops (no kernel forward; their backward and every read of a view run the copy, fill and sum kernels) */
static tide_tensor *f_reshape(tide_tensor **in) { int64_t s[2] = {5, 12}; return tide_reshape(in[0], 2, s); }
static tide_tensor *f_permute(tide_tensor **in) { int p[3] = {2, 0, 1}; return tide_permute(in[0], 3, p); }
static tide_tensor *f_slice(tide_tensor **in) { return tide_slice(in[0], 1, 1, 8, 2); }
static tide_tensor *f_expand(tide_tensor **in) { int64_t s[3] = {3, 4, 5}; return tide_expand(in[0], 3, s); }
static tide_tensor *f_concat(tide_tensor **in) { return tide_concat(3, in, 1); }
static tide_tensor *f_split(tide_tensor **in)
{
    int64_t sizes[2] = {2, 3};
    tide_tensor *outs[2] = {0};
    if (tide_split(in[0], 2, 2, sizes, outs)) return NULL;
    tide_tensor_release(outs[0]);
    return outs[1];
}
static tide_tensor *f_bf16_roundtrip(tide_tensor **in)
{
    tide_tensor *b = tide_to_dtype(in[0], TIDE_BF16);
    tide_tensor *f = b ? tide_to_dtype(b, TIDE_F32) : NULL;
    tide_tensor_release(b);
    return f;
}

#define S1(a) 1, {a}
#define S2(a, b) 2, {a, b}
#define S3(a, b, c) 3, {a, b, c}
#define S4(a, b, c, d) 4, {a, b, c, d}
#define NORMAL(shape) {IN_NORMAL, shape, 0}
#define POS(shape) {IN_POS, shape, 0}
#define WEIGHTS(shape) {IN_WEIGHTS, shape, 0}
#define IDS(shape, hi) {IN_IDS, shape, hi}
#define IDS32(shape, hi) {IN_IDS32, shape, hi}
#define TARGETS(shape, hi) {IN_TARGETS, shape, hi}
#define CU(shape, hi) {IN_CU, shape, hi}

/*
 * The case table, with its tolerances. Why these numbers:
 *  - f32 elementwise: both sides round once per operation; CUDA's expf/logf/tanhf are within 2 ulp,
 *    so 1e-6 relative plus 1e-6 absolute (near zero) is ~10 ulp of slack.
 *  - f32 reductions, norms, softmax, cross-entropy: the CPU accumulates in double, the GPU in float
 *    over a tree; the error grows like log2(n) ulp of the summed magnitude: 1e-5 for rows of up to a
 *    few thousand, 1e-3 absolute for sums of 1e5 - 3e5 terms (sum magnitude ~ 500, float ulp 3e-5).
 *  - f32 matmul: cuBLAS reorders the K-sum (no TF32); error ~ sqrt(K) ulp of |a||b|: 1e-4.
 *  - bf16 cases: the output is rounded to bf16 (relative step 2^-8 = 0.0039) and intermediates too,
 *    so 2e-2 relative plus an absolute term of about one bf16 step at the output's typical magnitude.
 *  - argmax: exact (integers). randn/rand: same Philox counters, double math; 1e-6 covers the last-ulp
 *    differences of the device log/cos.
 */
static const op_case cases[] = {
    /* unary */
    {"neg", f_neg, 1, {NORMAL(S2(4, 33))}, 1, 0, 0, 0, 0, 0},
    {"exp", f_exp, 1, {NORMAL(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"log", f_log, 1, {POS(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"sqrt", f_sqrt, 1, {POS(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"rsqrt", f_rsqrt, 1, {POS(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"tanh", f_tanh, 1, {NORMAL(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"sigmoid", f_sigmoid, 1, {NORMAL(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"silu", f_silu, 1, {NORMAL(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"gelu", f_gelu, 1, {NORMAL(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"gelu_erf", f_gelu_erf, 1, {NORMAL(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"gelu_erf bf16", f_gelu_erf, 1, {NORMAL(S2(4, 33))}, 1, 1e-2, 2e-2, 1e-2, 2e-2, 1},
    {"softplus", f_softplus, 1, {NORMAL(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"relu", f_relu, 1, {NORMAL(S2(4, 33))}, 1, 0, 0, 0, 0, 0},
    {"abs", f_abs, 1, {NORMAL(S2(4, 33))}, 1, 0, 0, 0, 0, 0},
    {"add_scalar", f_add_scalar, 1, {NORMAL(S2(4, 33))}, 1, 0, 0, 0, 0, 0},
    {"mul_scalar", f_mul_scalar, 1, {NORMAL(S2(4, 33))}, 1, 0, 0, 0, 0, 0},
    {"pow_scalar 1.7", f_pow_frac, 1, {POS(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"pow_scalar 2", f_pow_2, 1, {NORMAL(S2(4, 33))}, 1, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"silu bf16", f_silu, 1, {NORMAL(S2(4, 33))}, 1, 1e-2, 2e-2, 1e-2, 2e-2, 1},
    /* binary with broadcasting */
    {"add [2,3,5]+[3,1]", f_add, 2, {NORMAL(S3(2, 3, 5)), NORMAL(S2(3, 1))}, 3, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"sub [4,1]-[1,5]", f_sub, 2, {NORMAL(S2(4, 1)), NORMAL(S2(1, 5))}, 3, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"mul [2,3,5]*[5]", f_mul, 2, {NORMAL(S3(2, 3, 5)), NORMAL(S1(5))}, 3, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"div [2,3,5]/[2,1,5]", f_div, 2, {NORMAL(S3(2, 3, 5)), POS(S3(2, 1, 5))}, 3, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"mul same shape", f_mul, 2, {NORMAL(S2(37, 129)), NORMAL(S2(37, 129))}, 3, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"add bf16", f_add, 2, {NORMAL(S3(2, 3, 5)), NORMAL(S2(3, 1))}, 3, 1e-2, 2e-2, 1e-2, 2e-2, 1},
    {"swiglu", f_swiglu, 2, {NORMAL(S2(5, 40)), NORMAL(S2(5, 40))}, 3, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"swiglu bf16", f_swiglu, 2, {NORMAL(S2(5, 40)), NORMAL(S2(5, 40))}, 3, 1e-2, 2e-2, 1e-2, 2e-2, 1},
    {"situ_glu", f_situ, 2, {NORMAL(S2(5, 40)), NORMAL(S2(5, 40))}, 3, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    {"situ_glu bf16", f_situ, 2, {NORMAL(S2(5, 40)), NORMAL(S2(5, 40))}, 3, 1e-2, 2e-2, 1e-2, 2e-2, 1},
    {"topk 5 of 33 (values, gradient scatter)", f_topk, 1, {NORMAL(S3(3, 7, 33))}, 1, 0, 0, 0, 0, 0},
    /* reductions */
    {"sum all", f_sum_all, 1, {NORMAL(S3(4, 6, 5))}, 1, 1e-5, 1e-5, 0, 0, 0},
    {"sum dim 1", f_sum_d1, 1, {NORMAL(S3(4, 6, 5))}, 1, 1e-5, 1e-5, 0, 0, 0},
    {"sum dims 0,2 keepdim", f_sum_d02k, 1, {NORMAL(S3(4, 6, 5))}, 1, 1e-5, 1e-5, 0, 0, 0},
    {"sum last [3,100000]", f_sum_last, 1, {NORMAL(S2(3, 100000))}, 1, 1e-3, 1e-5, 0, 0, 0},
    {"sum all [300000]", f_sum_all, 1, {NORMAL(S1(300000))}, 1, 1e-3, 1e-5, 0, 0, 0},
    {"sum dim 1 [2,20000,7]", f_sum_d1, 1, {NORMAL(S3(2, 20000, 7))}, 1, 1e-3, 1e-5, 0, 0, 0},
    {"mean dim 2", f_mean_d2, 1, {NORMAL(S3(4, 6, 5))}, 1, 1e-6, 1e-5, 1e-7, 1e-6, 0},
    {"max dim 1", f_max_d1, 1, {NORMAL(S3(4, 6, 5))}, 1, 0, 0, 0, 0, 0},
    {"max last keepdim [5,3000]", f_max_last, 1, {NORMAL(S2(5, 3000))}, 1, 0, 0, 0, 0, 0},
    {"argmax dim 2", f_argmax_d2, 1, {NORMAL(S3(4, 6, 5))}, 0, 0, 0, 0, 0, 0},
    {"argmax dim 0 keepdim", f_argmax_d0, 1, {NORMAL(S3(40, 6, 5))}, 0, 0, 0, 0, 0, 0},
    {"logsumexp dim 0", f_lse_d0, 1, {NORMAL(S3(4, 6, 5))}, 1, 1e-5, 1e-5, 1e-6, 1e-5, 0},
    {"logsumexp last [3,50000]", f_lse_last, 1, {NORMAL(S2(3, 50000))}, 1, 1e-4, 1e-5, 1e-7, 1e-4, 0},
    /* matmul */
    {"matmul", f_mm, 2, {NORMAL(S2(5, 7)), NORMAL(S2(7, 9))}, 3, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"matmul ta", f_mm_ta, 2, {NORMAL(S2(7, 5)), NORMAL(S2(7, 9))}, 3, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"matmul tb", f_mm_tb, 2, {NORMAL(S2(5, 7)), NORMAL(S2(9, 7))}, 3, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"matmul ta tb", f_mm_tatb, 2, {NORMAL(S2(7, 5)), NORMAL(S2(9, 7))}, 3, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"matmul vector row", f_mm, 2, {NORMAL(S2(1, 7)), NORMAL(S2(7, 9))}, 3, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"matmul batched", f_mm, 2, {NORMAL(S3(3, 5, 7)), NORMAL(S3(3, 7, 9))}, 3, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"matmul batched ta tb", f_mm_tatb, 2, {NORMAL(S4(2, 3, 7, 5)), NORMAL(S4(2, 3, 9, 7))}, 3, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"matmul linear (shared b, tb)", f_mm_tb, 2, {NORMAL(S3(2, 4, 16)), NORMAL(S2(8, 16))}, 3, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"matmul [64,128]x[128,96]", f_mm, 2, {NORMAL(S2(64, 128)), NORMAL(S2(128, 96))}, 3, 1e-4, 1e-4, 1e-4, 1e-4, 0},
    {"matmul bf16 [64,128]x[128,96]", f_mm, 2, {NORMAL(S2(64, 128)), NORMAL(S2(128, 96))}, 3, 1e-1, 2e-2, 1e-1, 2e-2, 1},
    /* K >= 8,192 in bf16, the shapes where cuBLAS may split K: partial sums must stay fp32 (backend_cuda.cu) */
    {"matmul bf16 K 8192 [32,8192]x[8192,48]", f_mm, 2, {NORMAL(S2(32, 8192)), NORMAL(S2(8192, 48))}, 3, 2e-1, 1.0 / 128, 2e-1, 1.0 / 128, 1},
    {"matmul bf16 weight-grad form K 16384 (ta)", f_mm_ta, 2, {NORMAL(S2(16384, 24)), NORMAL(S2(16384, 40))}, 3, 3e-1, 1.0 / 128, 3e-1, 1.0 / 128, 1},
    {"matmul bf16 linear", f_mm_tb, 2, {NORMAL(S3(2, 4, 16)), NORMAL(S2(8, 16))}, 3, 5e-2, 2e-2, 5e-2, 2e-2, 1},
    {"linear bias", f_linear, 3, {NORMAL(S3(2, 4, 16)), NORMAL(S2(8, 16)), NORMAL(S1(8))}, 7, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"linear no bias [64,128]", f_linear_nob, 2, {NORMAL(S2(64, 128)), NORMAL(S2(96, 128))}, 3, 1e-4, 1e-4, 1e-4, 1e-4, 0},
    {"linear bf16 bias", f_linear, 3, {NORMAL(S3(2, 4, 16)), NORMAL(S2(8, 16)), NORMAL(S1(8))}, 7, 5e-2, 2e-2, 5e-2, 2e-2, 1},
    /* normalisation, softmax, losses */
    {"rmsnorm", f_rmsnorm, 2, {NORMAL(S2(6, 64)), NORMAL(S1(64))}, 3, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"rmsnorm [37,1000]", f_rmsnorm, 2, {NORMAL(S2(37, 1000)), NORMAL(S1(1000))}, 3, 1e-5, 1e-5, 1e-4, 1e-5, 0},
    {"rmsnorm bf16", f_rmsnorm, 2, {NORMAL(S2(6, 64)), NORMAL(S1(64))}, 3, 3e-2, 2e-2, 5e-2, 2e-2, 1},
    {"layernorm", f_layernorm, 3, {NORMAL(S2(6, 64)), NORMAL(S1(64)), NORMAL(S1(64))}, 7, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"layernorm [37,1000]", f_layernorm, 3, {NORMAL(S2(37, 1000)), NORMAL(S1(1000)), NORMAL(S1(1000))}, 7, 1e-5, 1e-5, 1e-4, 1e-5, 0},
    {"softmax", f_softmax, 1, {NORMAL(S2(6, 37))}, 1, 1e-6, 1e-5, 1e-6, 1e-5, 0},
    {"softmax dim 0", f_softmax_d0, 1, {NORMAL(S2(6, 37))}, 1, 1e-6, 1e-5, 1e-6, 1e-5, 0},
    {"softmax [3,5000]", f_softmax, 1, {NORMAL(S2(3, 5000))}, 1, 1e-7, 1e-5, 1e-7, 1e-5, 0},
    {"softmax bf16", f_softmax, 1, {NORMAL(S2(6, 37))}, 1, 5e-3, 2e-2, 1e-2, 2e-2, 1},
    {"log_softmax", f_log_softmax, 1, {NORMAL(S2(6, 37))}, 1, 1e-5, 1e-5, 1e-5, 1e-5, 0},
    {"cross_entropy mean, ignore", f_ce_mean, 2, {NORMAL(S2(8, 11)), TARGETS(S1(8), 11)}, 1, 1e-5, 1e-5, 1e-6, 1e-5, 0},
    {"cross_entropy weights sum", f_ce_w_sum, 3, {NORMAL(S2(8, 11)), TARGETS(S1(8), 11), WEIGHTS(S1(8))}, 1, 1e-5, 1e-5, 1e-6, 1e-5, 0},
    {"cross_entropy weights none", f_ce_w_none, 3, {NORMAL(S2(8, 11)), TARGETS(S1(8), 11), WEIGHTS(S1(8))}, 1, 1e-5, 1e-5, 1e-6, 1e-5, 0},
    {"cross_entropy weights mean", f_ce_w_mean, 3, {NORMAL(S2(8, 11)), TARGETS(S1(8), 11), WEIGHTS(S1(8))}, 1, 1e-5, 1e-5, 1e-6, 1e-5, 0},
    {"cross_entropy [16,3000]", f_ce_mean, 2, {NORMAL(S2(16, 3000)), TARGETS(S1(16), 3000)}, 1, 1e-5, 1e-5, 1e-7, 1e-5, 0},
    {"cross_entropy bf16", f_ce_mean, 2, {NORMAL(S2(8, 11)), TARGETS(S1(8), 11)}, 1, 3e-2, 2e-2, 5e-3, 2e-2, 1},
    /* token_logprobs: outputs f32 for bf16 logits (the same f32 arithmetic from the same rounded inputs on both
       sides); the bf16 gradient rounds to 8 bits */
    {"token_logprobs [4,5,300] logp + entropy", f_tlp, 2, {NORMAL(S3(4, 5, 300)), TARGETS(S2(4, 5), 300)}, 1, 1e-5, 1e-5, 1e-6, 1e-5, 0},
    {"token_logprobs [16,3000]", f_tlp, 2, {NORMAL(S2(16, 3000)), TARGETS(S1(16), 3000)}, 1, 1e-5, 1e-5, 1e-7, 1e-5, 0},
    {"token_logprobs bf16 [8,500]", f_tlp, 2, {NORMAL(S2(8, 500)), TARGETS(S1(8), 500)}, 1, 1e-4, 1e-4, 5e-3, 2e-2, 1},
    {"rope", f_rope, 1, {NORMAL(S4(2, 5, 3, 8))}, 1, 1e-6, 1e-5, 1e-6, 1e-5, 0},
    {"rope pos0 1e6", f_rope_far, 1, {NORMAL(S4(2, 5, 3, 8))}, 1, 1e-6, 1e-5, 1e-6, 1e-5, 0},
    /* vision positions: both sides compute angles, taps and sums in double; the f32 result rounds once */
    {"rope2d [37,3,72] i64 pos", f_rope2d, 2, {NORMAL(S3(37, 3, 72)), IDS(S2(37, 2), 512)}, 1, 1e-6, 1e-5, 1e-6, 1e-5, 0},
    {"rope2d [20,4,16] i32 pos", f_rope2d, 2, {NORMAL(S3(20, 4, 16)), IDS32(S2(20, 2), 512)}, 1, 1e-6, 1e-5, 1e-6, 1e-5, 0},
    {"rope2d bf16 [37,3,72]", f_rope2d, 2, {NORMAL(S3(37, 3, 72)), IDS(S2(37, 2), 512)}, 1, 1e-2, 2e-2, 1e-2, 2e-2, 1},
    {"pos_interp [8,8,40] to 13x5, 8x8, 1x1, 3x17", f_pos_interp, 1, {NORMAL(S3(8, 8, 40))}, 1, 1e-6, 1e-5, 1e-5, 1e-5, 0},
    {"pos_interp [16,16,96] to 64x48, 5x70", f_pos_interp_big, 1, {NORMAL(S3(16, 16, 96))}, 1, 1e-6, 1e-5, 1e-4, 1e-5, 0},
    {"pos_interp bf16", f_pos_interp, 1, {NORMAL(S3(8, 8, 40))}, 1, 1e-2, 2e-2, 5e-2, 2e-2, 1},
    /* indexing */
    {"embedding i64 ids", f_embedding, 2, {NORMAL(S2(10, 6)), IDS(S1(7), 10)}, 1, 0, 0, 1e-6, 1e-6, 0},
    {"embedding i32 ids [2,9]", f_embedding, 2, {NORMAL(S2(10, 6)), IDS32(S2(2, 9), 10)}, 1, 0, 0, 1e-6, 1e-6, 0},
    {"index_select dim 1", f_index_select, 2, {NORMAL(S3(4, 10, 3)), IDS(S1(5), 10)}, 1, 0, 0, 1e-6, 1e-6, 0},
    {"gather dim 1", f_gather, 2, {NORMAL(S3(4, 6, 3)), IDS(S3(4, 5, 3), 6)}, 1, 0, 0, 1e-6, 1e-6, 0},
    {"scatter_add dim 1", f_scatter_add, 3, {NORMAL(S3(4, 6, 3)), IDS(S3(4, 5, 3), 6), NORMAL(S3(4, 5, 3))}, 5, 1e-6, 1e-6, 1e-6, 1e-6, 0},
    /* KDA's elementwise parts (the kernel itself: test_kda below). The gate sums gA, gb over tokens and the
       conv sums gw over tokens: reductions, hence 1e-5; the conv's documents reset its history. */
    {"kda_gate bounded", f_gate_bounded, 3, {NORMAL(S3(9, 3, 8)), NORMAL(S1(3)), NORMAL(S1(24))}, 7, 1e-6, 1e-5, 1e-5, 1e-5, 0},
    {"kda_gate softplus [H, D] bias", f_gate_softplus, 3, {NORMAL(S3(9, 3, 8)), NORMAL(S1(3)), NORMAL(S2(3, 8))}, 7, 1e-6, 1e-5, 1e-5, 1e-5, 0},
    {"kda_gate bounded bf16", f_gate_bounded, 3, {NORMAL(S3(9, 3, 8)), NORMAL(S1(3)), NORMAL(S1(24))}, 7, 3e-2, 2e-2, 5e-2, 2e-2, 1},
    {"causal_conv1d cache, docs, silu", f_conv, 4, {NORMAL(S3(2, 11, 6)), NORMAL(S2(6, 4)), NORMAL(S3(2, 3, 6)), CU(S1(5), 22)}, 7, 1e-6, 1e-5, 1e-5, 1e-5, 0},
    {"causal_conv1d plain [3,40,96]", f_conv_plain, 2, {NORMAL(S3(3, 40, 96)), NORMAL(S2(96, 4))}, 3, 1e-6, 1e-5, 1e-5, 1e-5, 0},
    {"causal_conv1d bf16", f_conv, 4, {NORMAL(S3(2, 11, 6)), NORMAL(S2(6, 4)), NORMAL(S3(2, 3, 6)), CU(S1(5), 22)}, 7, 3e-2, 2e-2, 5e-2, 2e-2, 1},
    {"l2norm", f_l2norm, 1, {NORMAL(S2(6, 64))}, 1, 1e-6, 1e-5, 1e-6, 1e-5, 0},
    {"l2norm [37,128]", f_l2norm, 1, {NORMAL(S3(37, 2, 128))}, 1, 1e-6, 1e-5, 1e-6, 1e-5, 0},
    {"l2norm bf16", f_l2norm, 1, {NORMAL(S2(6, 64))}, 1, 5e-4, 2e-2, 5e-4, 2e-2, 1},
    /* layout and dtype conversion */
    {"contiguous(transpose 0,2)", f_transpose_contig, 1, {NORMAL(S3(3, 4, 5))}, 1, 0, 0, 0, 0, 0},
    {"reshape [3,4,5] -> [5,12]", f_reshape, 1, {NORMAL(S3(3, 4, 5))}, 1, 0, 0, 0, 0, 0},
    {"permute [3,4,5] (2,0,1)", f_permute, 1, {NORMAL(S3(3, 4, 5))}, 1, 0, 0, 0, 0, 0},
    {"slice dim 1 [1:8:2]", f_slice, 1, {NORMAL(S3(3, 9, 5))}, 1, 0, 0, 0, 0, 0},
    {"expand [3,1,5] -> [3,4,5]", f_expand, 1, {NORMAL(S3(3, 1, 5))}, 1, 0, 0, 1e-6, 1e-6, 0},
    {"concat dim 1 of 3", f_concat, 3, {NORMAL(S3(2, 3, 4)), NORMAL(S3(2, 1, 4)), NORMAL(S3(2, 5, 4))}, 7, 0, 0, 0, 0, 0},
    {"split dim 2 into 2 and 3, second", f_split, 1, {NORMAL(S3(3, 4, 5))}, 1, 0, 0, 0, 0, 0},
    {"f32 -> bf16 -> f32", f_bf16_roundtrip, 1, {NORMAL(S2(9, 17))}, 1, 0, 0, 0, 0, 0},
};

/* ---- comparison ------------------------------------------------------------------------------------ */

typedef struct {
    double max_abs, max_rel;
    int64_t bad, nonfinite;
} diff;

/* host doubles of any tensor (any device, any dtype) */
static double *host_values(tide_tensor *t)
{
    tide_tensor *h = tide_to_device(t, CPU);
    if (!h) return NULL;
    double *v = malloc((size_t)(h->numel > 0 ? h->numel : 1) * sizeof *v);
    if (v && tide_to_f64_buffer(h, v, h->numel)) {
        free(v);
        v = NULL;
    }
    tide_tensor_release(h);
    return v;
}

static int same_shape(const tide_tensor *a, const tide_tensor *b)
{
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

/* 0 when compared (d filled), -1 on an error or a shape/dtype/device mismatch (message printed) */
static int compare(const char *name, const char *what, tide_tensor *cpu, tide_tensor *gpu, double atol,
                   double rtol, diff *d)
{
    memset(d, 0, sizeof *d);
    if (!cpu || !gpu) {
        printf("  %s: %s missing (%s)\n", name, what, tide_last_error());
        return -1;
    }
    if (gpu->device != GPU) {
        printf("  %s: %s is on device %d, expected %d\n", name, what, gpu->device, GPU);
        return -1;
    }
    if (!same_shape(cpu, gpu) || cpu->dtype != gpu->dtype) {
        printf("  %s: %s shape/dtype differ (cpu ndim %d dtype %d, gpu ndim %d dtype %d)\n", name, what, cpu->ndim,
               cpu->dtype, gpu->ndim, gpu->dtype);
        return -1;
    }
    double *c = host_values(cpu), *g = host_values(gpu);
    if (!c || !g) {
        printf("  %s: %s could not be read back (%s)\n", name, what, tide_last_error());
        free(c);
        free(g);
        return -1;
    }
    for (int64_t i = 0; i < cpu->numel; i++) {
        if (!isfinite(g[i]) || !isfinite(c[i])) {
            d->nonfinite++;
            continue;
        }
        double e = fabs(g[i] - c[i]);
        double r = e / (fabs(c[i]) > 1e-30 ? fabs(c[i]) : 1e-30);
        if (e > d->max_abs) d->max_abs = e;
        if (e > 0 && r > d->max_rel) d->max_rel = r;
        if (e > atol + rtol * fabs(c[i])) d->bad++;
    }
    free(c);
    free(g);
    return 0;
}

static int diff_ok(const diff *d) { return d->bad == 0 && d->nonfinite == 0; }

/* ---- one case ---------------------------------------------------------------------------------------- */

static tide_tensor *round_to_bf16(tide_tensor *x)
{
    tide_tensor *b = tide_to_dtype(x, TIDE_BF16);
    tide_tensor *f = b ? tide_to_dtype(b, TIDE_F32) : NULL;
    tide_tensor_release(b);
    return f;
}

static int is_float_input(int kind) { return kind == IN_NORMAL || kind == IN_POS || kind == IN_WEIGHTS; }

/* the GPU side of a bf16 case: bf16 copies of the float inputs in, f32 out */
static tide_tensor *run_bf16(const op_case *c, tide_tensor **in)
{
    tide_tensor *b[4] = {0};
    tide_tensor *out = NULL;
    int i;
    for (i = 0; i < c->n_in; i++) {
        if (is_float_input(c->in[i].kind)) {
            b[i] = tide_to_dtype(in[i], TIDE_BF16);
        } else {
            tide_tensor_retain(in[i]);
            b[i] = in[i];
        }
        if (!b[i]) break;
    }
    if (i == c->n_in) {
        tide_tensor *o = c->fn(b);
        if (o) out = tide_to_dtype(o, TIDE_F32);
        tide_tensor_release(o);
    }
    for (i = 0; i < c->n_in; i++) tide_tensor_release(b[i]);
    return out;
}

/* loss = sum(out ⊙ r) */
static tide_tensor *weighted_sum(tide_tensor *out, tide_tensor *r)
{
    tide_tensor *p = tide_mul(out, r);
    tide_tensor *s = p ? tide_sum(p, 0, NULL, 0) : NULL;
    tide_tensor_release(p);
    return s;
}

typedef struct {
    tide_tensor *cin[4], *gin[4];
    tide_tensor *cout, *gout, *r, *rg, *lc, *lg;
    char line[640];
    int len;
} case_state;

static void say(case_state *st, const char *fmt, double a, double b)
{
    if (st->len < (int)sizeof st->line - 1)
        st->len += snprintf(st->line + st->len, sizeof st->line - st->len, fmt, a, b);
    if (st->len > (int)sizeof st->line - 1) st->len = (int)sizeof st->line - 1;
}

/* 1 passed, 0 failed within tolerance, -1 could not run (message printed) */
static int case_body(const op_case *c, case_state *st)
{
    for (int i = 0; i < c->n_in; i++) {
        st->cin[i] = make_input(&c->in[i]);
        if (st->cin[i] && c->bf16 && is_float_input(c->in[i].kind)) {
            tide_tensor *rd = round_to_bf16(st->cin[i]);
            tide_tensor_release(st->cin[i]);
            st->cin[i] = rd;
        }
        st->gin[i] = st->cin[i] ? tide_to_device(st->cin[i], GPU) : NULL;
        if (!st->cin[i] || !st->gin[i]) {
            printf("  %s: input %d: %s\n", c->name, i, tide_last_error());
            return -1;
        }
        if ((c->grad_mask & (1 << i)) &&
            (tide_set_requires_grad(st->cin[i], 1) || tide_set_requires_grad(st->gin[i], 1))) {
            printf("  %s: requires_grad on input %d: %s\n", c->name, i, tide_last_error());
            return -1;
        }
    }
    st->cout = c->fn(st->cin);
    if (!st->cout) {
        printf("  %s: cpu op failed: %s\n", c->name, tide_last_error());
        return -1;
    }
    st->gout = c->bf16 ? run_bf16(c, st->gin) : c->fn(st->gin);
    if (!st->gout) {
        printf("  %s: gpu op failed: %s\n", c->name, tide_last_error());
        return -1;
    }

    diff d;
    int prev = tide_set_grad_enabled(0);
    int rc = compare(c->name, "output", st->cout, st->gout, c->atol, c->rtol, &d);
    tide_set_grad_enabled(prev);
    if (rc) return -1;
    int passed = diff_ok(&d);
    say(st, "out abs %.1e rel %.1e", d.max_abs, d.max_rel);
    if (!diff_ok(&d)) say(st, " [%g beyond tol, %g non-finite]", (double)d.bad, (double)d.nonfinite);
    if (!c->grad_mask) return passed;

    st->r = tide_randn(TIDE_F32, st->cout->ndim, st->cout->shape, CPU, 0.0, 1.0);
    st->rg = st->r ? tide_to_device(st->r, GPU) : NULL;
    st->lc = st->r ? weighted_sum(st->cout, st->r) : NULL;
    st->lg = st->rg ? weighted_sum(st->gout, st->rg) : NULL;
    if (!st->lc || !st->lg || tide_backward(st->lc, NULL) || tide_backward(st->lg, NULL)) {
        printf("  %s: backward failed: %s\n", c->name, tide_last_error());
        return -1;
    }
    for (int i = 0; i < c->n_in; i++) {
        if (!(c->grad_mask & (1 << i))) continue;
        tide_tensor *gc = tide_grad(st->cin[i]), *gg = tide_grad(st->gin[i]);
        char what[32];
        snprintf(what, sizeof what, "grad of input %d", i);
        prev = tide_set_grad_enabled(0);
        rc = compare(c->name, what, gc, gg, c->gatol, c->grtol, &d);
        tide_set_grad_enabled(prev);
        tide_tensor_release(gc);
        tide_tensor_release(gg);
        if (rc) return -1;
        char fmt[64];
        snprintf(fmt, sizeof fmt, " | d%d abs %%.1e rel %%.1e", i);
        say(st, fmt, d.max_abs, d.max_rel);
        if (!diff_ok(&d)) {
            passed = 0;
            say(st, " [%g beyond tol, %g non-finite]", (double)d.bad, (double)d.nonfinite);
        }
    }
    return passed;
}

static int run_case(const op_case *c)
{
    case_state st;
    memset(&st, 0, sizeof st);
    tide_set_grad_enabled(1);
    int rc = case_body(c, &st);
    printf("%-36s %s %s\n", c->name, rc == 1 ? "ok  " : "FAIL", st.line);
    for (int i = 0; i < 4; i++) {
        tide_tensor_release(st.cin[i]);
        tide_tensor_release(st.gin[i]);
    }
    tide_tensor_release(st.cout);
    tide_tensor_release(st.gout);
    tide_tensor_release(st.r);
    tide_tensor_release(st.rg);
    tide_tensor_release(st.lc);
    tide_tensor_release(st.lg);
    return rc == 1;
}

/* ---- checks that are not "op on inputs" ------------------------------------------------------------ */

/* the bad-input checks on the GPU are deferred (kernels/cuda/common.cuh): the op returns, and the next read that
   waits for the device fails with the check's message; host_read_fails reads t and says whether it failed */
static int host_read_fails(tide_tensor *t)
{
    if (!t) return 0;
    tide_tensor *h = tide_to_device(t, CPU);
    tide_tensor_release(h);
    return h == NULL;
}

static int report(const char *name, int ok, const char *detail)
{
    printf("%-36s %s %s\n", name, ok ? "ok  " : "FAIL", detail);
    return ok;
}

static int check_pair(const char *name, const char *what, tide_tensor *c, tide_tensor *g, double atol, double rtol,
                      char *detail, size_t n)
{
    diff d;
    if (compare(name, what, c, g, atol, rtol, &d)) return 0;
    size_t len = strlen(detail);
    snprintf(detail + len, n - len, "%s%s abs %.1e rel %.1e", len ? " | " : "", what, d.max_abs, d.max_rel);
    return diff_ok(&d);
}

/* same seed, same Philox counters: the device stream must equal the host stream */
static int test_random(void)
{
    int64_t s1[1] = {1000}, s2[2] = {7, 111};
    tide_manual_seed(42);
    tide_tensor *a1 = tide_randn(TIDE_F32, 1, s1, CPU, 0.5, 2.0), *a2 = tide_rand(TIDE_F32, 2, s2, CPU, -1.0, 3.0);
    tide_manual_seed(42);
    tide_tensor *b1 = tide_randn(TIDE_F32, 1, s1, GPU, 0.5, 2.0), *b2 = tide_rand(TIDE_F32, 2, s2, GPU, -1.0, 3.0);
    char detail[256] = "";
    int ok = check_pair("randn/rand", "randn", a1, b1, 1e-6, 1e-6, detail, sizeof detail);
    ok = check_pair("randn/rand", "rand", a2, b2, 1e-6, 1e-6, detail, sizeof detail) && ok;
    tide_tensor_release(a1);
    tide_tensor_release(a2);
    tide_tensor_release(b1);
    tide_tensor_release(b2);
    return report("randn / rand (same seed)", ok, detail);
}

/* writes through strided views must land exactly inside the view: guard values around it survive */
static int test_guard(void)
{
    int64_t sd[2] = {6, 10}, ss[2] = {6, 6};
    tide_tensor *dst = tide_full(TIDE_F32, 2, sd, GPU, 7.5);
    tide_tensor *cols = dst ? tide_slice(dst, 1, 2, 8, 1) : NULL;    /* [6, 6], row stride 10 */
    tide_tensor *src = tide_randn(TIDE_F32, 2, ss, CPU, 0.0, 1.0);
    tide_tensor *srcg = src ? tide_to_device(src, GPU) : NULL;
    int ok = cols && srcg && tide_copy_(cols, srcg) == 0;
    tide_tensor *rows = ok ? tide_slice(dst, 0, 1, 6, 2) : NULL;     /* rows 1, 3, 5 */
    ok = ok && rows && tide_fill_(rows, -3.0) == 0;
    double *h = ok ? host_values(dst) : NULL, *sv = ok ? host_values(src) : NULL;
    int64_t wrong = 0;
    if (h && sv) {
        for (int64_t i = 0; i < 6; i++)
            for (int64_t j = 0; j < 10; j++) {
                double want = (i % 2 == 1) ? -3.0 : (j >= 2 && j < 8) ? sv[i * 6 + (j - 2)] : 7.5;
                if (h[i * 10 + j] != want) wrong++;
            }
    } else {
        ok = 0;
    }
    char detail[128];
    if (!ok) snprintf(detail, sizeof detail, "error: %s", tide_last_error());
    else snprintf(detail, sizeof detail, "%lld of 60 elements wrong", (long long)wrong);
    free(h);
    free(sv);
    tide_tensor_release(dst);
    tide_tensor_release(cols);
    tide_tensor_release(rows);
    tide_tensor_release(src);
    tide_tensor_release(srcg);
    return report("copy_/fill_ into strided views", ok && wrong == 0, detail);
}

/* the fused finite check over many GPU tensors (f32, f64, bf16; one of 3 chunks; a strided view) equals the CPU
   pass over the same tensors, for a NaN or an infinity planted in each in turn and a later one planted too */
static int test_first_nonfinite_gpu(void)
{
    enum { NT = 5 };
    const int dts[NT] = {TIDE_F32, TIDE_F64, TIDE_BF16, TIDE_F32, TIDE_F32};
    const int64_t lens[NT] = {3, 140000, 70001, 1, 4096};
    char detail[256] = "";
    int ok = 1, rounds = 0;
    for (int bad = -1; bad < NT && ok; bad++) {
        tide_tensor *c[NT] = {0}, *g[NT] = {0};
        for (int i = 0; i < NT && ok; i++) {
            int64_t sh[1] = {lens[i]};
            c[i] = tide_zeros(dts[i], 1, sh, CPU);
            ok = c[i] != NULL;
            if (ok && (i == bad || (bad >= 0 && i == NT - 1))) {
                double v = (i + rounds) % 2 ? NAN : -INFINITY;
                tide_tensor *at = tide_slice(c[i], 0, lens[i] - 1, lens[i], 1);
                ok = at && tide_fill_(at, v) == 0;
                tide_tensor_release(at);
            }
            g[i] = ok ? tide_to_device(c[i], GPU) : NULL;
            ok = ok && g[i];
        }
        int fc = -1, fg = -1;
        ok = ok && tide_first_nonfinite(c, NT, &fc) == 0 && tide_first_nonfinite(g, NT, &fg) == 0;
        int want = bad < 0 ? NT : bad;
        if (ok && (fc != want || fg != want)) {
            snprintf(detail, sizeof detail, "planted in %d: cpu says %d, gpu says %d", bad, fc, fg);
            ok = 0;
        }
        for (int i = 0; i < NT; i++) tide_tensor_release(c[i]), tide_tensor_release(g[i]);
        rounds++;
    }
    if (!ok && !detail[0]) snprintf(detail, sizeof detail, "error: %s", tide_last_error());
    if (ok) snprintf(detail, sizeof detail, "%d rounds agree", rounds);
    return report("first_nonfinite (fused)", ok, detail);
}

/* sum of squares, finiteness, axpy_ and scale_ (the optimiser's helpers) */
static int test_vector_helpers(void)
{
    int64_t s[2] = {1000, 37};
    tide_tensor *x = tide_randn(TIDE_F32, 2, s, CPU, 0.0, 1.0), *y = tide_randn(TIDE_F32, 2, s, CPU, 0.0, 1.0);
    tide_tensor *xg = x ? tide_to_device(x, GPU) : NULL, *yg = y ? tide_to_device(y, GPU) : NULL;
    char detail[256] = "";
    int ok = xg && yg;
    double sc = 0, sg = 0;
    ok = ok && tide_sum_squares(x, &sc) == 0 && tide_sum_squares(xg, &sg) == 0;
    if (ok) {
        /* both accumulate f32 values in double; only the order differs */
        double rel = fabs(sg - sc) / sc;
        snprintf(detail, sizeof detail, "sum_squares rel %.1e", rel);
        ok = rel < 1e-9;
    }
    ok = ok && tide_all_finite(xg) == 1;
    double vals[4] = {1.0, INFINITY, 2.0, NAN};
    int64_t s4[1] = {4};
    tide_tensor *bad = tide_from_f64(TIDE_F32, 1, s4, CPU, vals);
    tide_tensor *badg = bad ? tide_to_device(bad, GPU) : NULL;
    tide_tensor *good2 = badg ? tide_slice(badg, 0, 0, 1, 1) : NULL;
    ok = ok && badg && tide_all_finite(badg) == 0 && good2 && tide_all_finite(good2) == 1;
    ok = ok && tide_axpy_(y, 0.3, x) == 0 && tide_axpy_(yg, 0.3, xg) == 0;
    ok = ok && tide_scale_(y, -1.5) == 0 && tide_scale_(yg, -1.5) == 0;
    ok = ok && check_pair("vector helpers", "axpy_+scale_", y, yg, 1e-6, 1e-6, detail, sizeof detail);
    if (!ok && !detail[0]) snprintf(detail, sizeof detail, "error: %s", tide_last_error());
    tide_tensor_release(x);
    tide_tensor_release(y);
    tide_tensor_release(xg);
    tide_tensor_release(yg);
    tide_tensor_release(bad);
    tide_tensor_release(badg);
    tide_tensor_release(good2);
    return report("sum_squares / all_finite / axpy_", ok, detail);
}

/* ---- Kimi Delta Attention (kda.md): seven inputs with their own distributions, two outputs ---------------
   q, k are L2-normalised (q scaled by dk^-1/2), g comes from the lower-bounded gate (lb = -5) or, for the
   per-pair paths, from the unbounded softplus gate with some steps far below -5; β in (0, 1); s0 ~ N(0, 1/4).
   The loss sum(o ⊙ r) + sum(state ⊙ r2) reaches every input. Tolerances are relative to each tensor's scale,
   |gpu - cpu| <= tol · max|cpu|: f32 1e-4 (both sides are ~1e-6 from fp64); bf16 outputs 2^-7 (kda.md oracle
   4: about one bf16 ulp of the output scale), bf16 gradients 2^-6 (the incoming gradient is rounded to bf16
   on the GPU side too; ~3e-3 measured in emulation). */
typedef struct {
    const char *name;
    int B, T, H, dk, dv;
    int n_cu;
    double cu[6];             /* document boundaries over B·T tokens (row starts are added by the op) */
    int path, chunk;
    int softplus_gate, with_s0, bf16;
    double tol, gtol;
} kda_case;

static const kda_case kda_cases[] = {
    {"kda chunk f32 64, docs, s0", 2, 37, 2, 64, 64, 5, {0, 5, 37, 50, 74}, TIDE_KDA_CHUNK, 16, 0, 1, 0, 1e-4, 1e-4},
    {"kda chunk f32 chunk 7, no s0", 2, 21, 2, 32, 48, 3, {0, 30, 42}, TIDE_KDA_CHUNK, 7, 0, 0, 0, 1e-4, 1e-4},
    {"kda chunk_safe f32 softplus gate", 2, 37, 2, 64, 64, 4, {0, 20, 37, 74}, TIDE_KDA_CHUNK_SAFE, 64, 1, 1, 0, 1e-4, 1e-4},
    {"kda recurrent f32, docs, s0", 2, 37, 2, 64, 64, 5, {0, 5, 37, 50, 74}, TIDE_KDA_RECURRENT, 0, 1, 1, 0, 1e-4, 1e-4},
    {"kda chunk f32 128", 1, 40, 2, 128, 128, 3, {0, 23, 40}, TIDE_KDA_CHUNK, 16, 0, 1, 0, 1e-4, 1e-4},
    {"kda recurrent f32 decode T=1", 3, 1, 2, 128, 128, 0, {0}, TIDE_KDA_RECURRENT, 0, 0, 1, 0, 1e-4, 1e-4},
    {"kda chunk bf16 64 (tensor cores)", 2, 37, 2, 64, 64, 5, {0, 5, 37, 50, 74}, TIDE_KDA_CHUNK, 16, 0, 1, 1, 1.0 / 128, 1.0 / 64},
    {"kda chunk bf16 128 (tensor cores)", 1, 40, 2, 128, 128, 3, {0, 23, 40}, TIDE_KDA_CHUNK, 16, 0, 1, 1, 1.0 / 128, 1.0 / 64},
    {"kda recurrent bf16, docs", 2, 37, 2, 64, 64, 5, {0, 5, 37, 50, 74}, TIDE_KDA_RECURRENT, 0, 0, 1, 1, 1.0 / 128, 1.0 / 64},
    {"kda chunk_safe bf16 softplus gate", 2, 37, 1, 64, 32, 4, {0, 20, 37, 74}, TIDE_KDA_CHUNK_SAFE, 16, 1, 1, 1, 1.0 / 128, 1.0 / 64},
    /* long T at K3 head dims: 4,096 chunks, 64 checkpointed blocks in the CUDA backward */
    {"kda chunk f32 K3 dims, T 64K", 1, 65536, 1, 128, 128, 0, {0}, TIDE_KDA_CHUNK, 16, 0, 1, 0, 1e-4, 1e-4},
    {"kda chunk bf16 K3 dims, T 64K, docs", 1, 65536, 2, 128, 128, 4, {0, 1000, 40000, 65536}, TIDE_KDA_CHUNK, 16, 0, 1, 1, 1.0 / 128, 1.0 / 64},
};

static double uniform01(void) { return ((double)next_rand() + 0.5) / 2147483648.0; }
static double normal01(void) { return sqrt(-2.0 * log(uniform01())) * cos(6.283185307179586 * uniform01()); }
static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

/* f32 CPU tensor of n values; with bf16, rounded to bf16 first so both devices see the same numbers */
static tide_tensor *kda_input(int ndim, const int64_t *shape, double *v, int bf16)
{
    tide_tensor *t = tide_from_f64(TIDE_F32, ndim, shape, CPU, v);
    if (t && bf16) {
        tide_tensor *r = round_to_bf16(t);
        tide_tensor_release(t);
        t = r;
    }
    return t;
}

/* |gpu - cpu| <= tol · max|cpu|; the gpu tensor is converted to the cpu's dtype first (bf16 -> f32) */
static int check_scaled(const char *name, const char *what, tide_tensor *c, tide_tensor *g, double tol, char *detail,
                        size_t n)
{
    int prev = tide_set_grad_enabled(0);
    tide_tensor *g32 = (c && g && g->dtype != c->dtype) ? tide_to_dtype(g, c->dtype) : NULL;
    tide_tensor *gg = g32 ? g32 : g;
    double *cv = c ? host_values(c) : NULL, mx = 0;
    if (cv)
        for (int64_t i = 0; i < c->numel; i++) mx = fabs(cv[i]) > mx ? fabs(cv[i]) : mx;
    free(cv);
    diff d;
    int ok = compare(name, what, c, gg, tol * mx, 0.0, &d) == 0;
    if (ok) {
        size_t len = strlen(detail);
        snprintf(detail + len, n - len, "%s%s %.1e", len ? " " : "", what, mx > 0 ? d.max_abs / mx : d.max_abs);
        if (!diff_ok(&d)) {
            len = strlen(detail);
            snprintf(detail + len, n - len, "[%lld bad, %lld non-finite]", (long long)d.bad, (long long)d.nonfinite);
        }
        ok = diff_ok(&d);
    }
    tide_tensor_release(g32);
    tide_set_grad_enabled(prev);
    return ok;
}

static int test_kda_case(const kda_case *kc)
{
    enum { Q, K, V, G, BETA, S0, NIN };
    int64_t B = kc->B, T = kc->T, H = kc->H, dk = kc->dk, dv = kc->dv;
    int64_t shp[NIN][4] = {{B, T, H, dk}, {B, T, H, dk}, {B, T, H, dv}, {B, T, H, dk}, {B, T, H, 0}, {B, H, dk, dv}};
    int nd[NIN] = {4, 4, 4, 4, 3, 4};
    int64_t ntok = B * T * H, nmax = ntok * (dk > dv ? dk : dv);
    if (B * H * dk * dv > nmax) nmax = B * H * dk * dv;
    double *buf = malloc((size_t)nmax * sizeof *buf);
    tide_tensor *c[NIN] = {0}, *gp[NIN] = {0}, *cu_c = NULL, *cu_g = NULL;
    tide_tensor *oc = NULL, *sc = NULL, *og = NULL, *sg = NULL, *og32 = NULL, *r1 = NULL, *r2 = NULL, *r1g = NULL,
                *r2g = NULL, *l[6] = {0};
    char detail[512] = "";
    int ok = buf != NULL, nin = kc->with_s0 ? NIN : S0;
    for (int i = 0; ok && i < nin; i++) {
        int64_t n = 1;
        for (int d = 0; d < nd[i]; d++) n *= shp[i][d];
        if (i == Q || i == K) {   /* L2-normalised rows, q scaled by dk^-1/2 */
            for (int64_t t = 0; t < ntok; t++) {
                double ss = 0;
                for (int64_t j = 0; j < dk; j++) {
                    buf[t * dk + j] = normal01();
                    ss += buf[t * dk + j] * buf[t * dk + j];
                }
                double sc_ = (i == Q ? 1.0 / sqrt((double)dk) : 1.0) / sqrt(ss + 1e-6);
                for (int64_t j = 0; j < dk; j++) buf[t * dk + j] *= sc_;
            }
        } else if (i == G) {
            for (int64_t j = 0; j < n; j++) {
                double z = 2.0 * normal01();
                buf[j] = kc->softplus_gate ? -log1p(exp(z)) * (uniform01() < 0.05 ? 40.0 : 1.0) : -5.0 * sigm(z);
            }
        } else if (i == BETA) {
            for (int64_t j = 0; j < n; j++) buf[j] = sigm(normal01());
        } else {
            for (int64_t j = 0; j < n; j++) buf[j] = (i == S0 ? 0.5 : 1.0) * normal01();
        }
        c[i] = kda_input(nd[i], shp[i], buf, kc->bf16 && i != S0);
        tide_tensor *d = c[i] ? tide_to_device(c[i], GPU) : NULL;
        gp[i] = (d && kc->bf16 && i != S0) ? tide_to_dtype(d, TIDE_BF16) : d;
        if (gp[i] != d) tide_tensor_release(d);
        ok = c[i] && gp[i] && !tide_set_requires_grad(c[i], 1) && !tide_set_requires_grad(gp[i], 1);
    }
    if (ok && kc->n_cu) {
        int64_t ncu = kc->n_cu;
        cu_c = tide_from_f64(TIDE_I64, 1, &ncu, CPU, kc->cu);
        cu_g = cu_c ? tide_to_device(cu_c, GPU) : NULL;
        ok = cu_g != NULL;
    }
    ok = ok && !tide_kda(c[Q], c[K], c[V], c[G], c[BETA], kc->with_s0 ? c[S0] : NULL, cu_c, kc->path, kc->chunk, -5.0, &oc, &sc);
    if (!ok) snprintf(detail, sizeof detail, "cpu: %s", tide_last_error());
    ok = ok && !tide_kda(gp[Q], gp[K], gp[V], gp[G], gp[BETA], kc->with_s0 ? gp[S0] : NULL, cu_g, kc->path, kc->chunk,
                         -5.0, &og, &sg);
    if (!ok && !detail[0]) snprintf(detail, sizeof detail, "gpu: %s", tide_last_error());
    og32 = ok ? (og->dtype == TIDE_F32 ? (tide_tensor_retain(og), og) : tide_to_dtype(og, TIDE_F32)) : NULL;
    ok = ok && og32;
    int pass = ok;
    if (ok) {
        pass = check_scaled(kc->name, "o", oc, og32, kc->tol, detail, sizeof detail);
        pass = check_scaled(kc->name, "state", sc, sg, kc->tol, detail, sizeof detail) && pass;
        r1 = tide_randn(TIDE_F32, 4, oc->shape, CPU, 0.0, 1.0);
        r2 = tide_randn(TIDE_F32, 4, sc->shape, CPU, 0.0, 1.0);
        r1g = r1 ? tide_to_device(r1, GPU) : NULL;
        r2g = r2 ? tide_to_device(r2, GPU) : NULL;
        l[0] = r1 ? weighted_sum(oc, r1) : NULL;
        l[1] = r2 ? weighted_sum(sc, r2) : NULL;
        l[2] = (l[0] && l[1]) ? tide_add(l[0], l[1]) : NULL;
        l[3] = r1g ? weighted_sum(og32, r1g) : NULL;
        l[4] = r2g ? weighted_sum(sg, r2g) : NULL;
        l[5] = (l[3] && l[4]) ? tide_add(l[3], l[4]) : NULL;
        ok = l[2] && l[5] && !tide_backward(l[2], NULL) && !tide_backward(l[5], NULL);
        if (!ok) snprintf(detail, sizeof detail, "backward: %s", tide_last_error());
    }
    const char *gname[NIN] = {"dq", "dk", "dv", "dg", "dbeta", "ds0"};
    for (int i = 0; ok && i < nin; i++) {
        tide_tensor *gc = tide_grad(c[i]), *gg = tide_grad(gp[i]);
        pass = check_scaled(kc->name, gname[i], gc, gg, kc->gtol, detail, sizeof detail) && pass;
        tide_tensor_release(gc);
        tide_tensor_release(gg);
    }
    tide_tensor *all[] = {oc, sc, og, sg, og32, r1, r2, r1g, r2g, cu_c, cu_g, l[0], l[1], l[2], l[3], l[4], l[5]};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    for (int i = 0; i < NIN; i++) {
        tide_tensor_release(c[i]);
        tide_tensor_release(gp[i]);
    }
    free(buf);
    return report(kc->name, ok && pass, detail);
}

/* the chunk path's precondition g in [lb, 0] is checked on the GPU too, and the error names the value */
static int test_kda_bound(void)
{
    int64_t s4[4] = {1, 20, 1, 16}, s3[3] = {1, 20, 1};
    tide_tensor *q = tide_randn(TIDE_F32, 4, s4, GPU, 0.0, 0.25), *k = tide_randn(TIDE_F32, 4, s4, GPU, 0.0, 0.25);
    tide_tensor *v = tide_randn(TIDE_F32, 4, s4, GPU, 0.0, 1.0), *b = tide_full(TIDE_F32, 3, s3, GPU, 0.5);
    double *gv = malloc(20 * 16 * sizeof *gv);
    for (int i = 0; gv && i < 20 * 16; i++) gv[i] = -1.0;
    if (gv) gv[7 * 16 + 3] = -5.5;
    tide_tensor *gc = gv ? tide_from_f64(TIDE_F32, 4, s4, CPU, gv) : NULL, *g = gc ? tide_to_device(gc, GPU) : NULL;
    tide_tensor *o = NULL, *s = NULL;
    int rc = (q && k && v && b && g) ? tide_kda(q, k, v, g, b, NULL, NULL, TIDE_KDA_CHUNK, 16, -5.0, &o, &s) : -1;
    int ok = !rc && host_read_fails(o) && strstr(tide_last_error(), "-5.5") != NULL &&
             strstr(tide_last_error(), "t 7, head 0, channel 3") != NULL;
    char detail[320];
    snprintf(detail, sizeof detail, "error: %s", tide_last_error());
    tide_clear_error();
    tide_tensor *all[] = {q, k, v, b, gc, g, o, s};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    free(gv);
    return report("kda chunk: g < lb -> error", ok, detail);
}

static int test_kda(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof kda_cases / sizeof kda_cases[0]; i++) passed = test_kda_case(&kda_cases[i]) && passed;
    return passed;
}

/* ---- MLA attention (mla.md §1, §4, §5): q with the rope slot last, k_n, k_r shared by the heads, v ---------------
   All N(0, 1), scale (dn + dr)^-1/2; the loss sum(o ⊙ r) reaches every input, and k_r's gradient sums over heads.
   Shapes: K3 (dn 128, dr 64, dv 128) and tiny (64, 32, 64) head dims, documents, decode (Tq = 1) and append
   (Tq < Tk) forms, dr = 0 with k_r NULL, head dims that are not multiples of 16, T not a multiple of any tile.
   |gpu - cpu| <= tol · max|cpu|: f32 1e-4 (both sides ~1e-6 from fp64); bf16 outputs 2^-7 (the bf16 output itself
   rounds by up to 2^-9 of its size, P is rounded to bf16 for PV), gradients 2^-6 (dS and the incoming gradient in
   bf16); the emulator (tests/gpu/emu) measures ~2.5e-3 and ~3.5e-3 at these shapes. */
typedef struct {
    const char *name;
    int B, Tq, Tk, H, dn, dr, dv;
    int n_cu;
    double cu[6];             /* document boundaries over B·T tokens (row starts are added by the op) */
    int bf16;
} mla_case;

static const mla_case mla_cases[] = {
    {"mla f32 K3 dims, docs", 2, 100, 100, 3, 128, 64, 128, 5, {0, 30, 100, 170, 200}, 0},
    {"mla f32 tiny dims, T 77", 1, 77, 77, 2, 64, 32, 64, 0, {0}, 0},
    {"mla f32 decode Tq 1, Tk 45", 3, 1, 45, 2, 64, 32, 64, 0, {0}, 0},
    {"mla f32 append Tq 20, Tk 83", 2, 20, 83, 2, 64, 32, 64, 0, {0}, 0},
    {"mla f32 dr 0 (k_r NULL), docs", 2, 37, 37, 2, 64, 0, 48, 4, {0, 20, 37, 74}, 0},
    {"mla f32 CP slice Tq 20 < Tk 83, docs over the keys", 2, 20, 83, 2, 64, 32, 64, 6, {0, 30, 70, 83, 150, 166}, 0},
    {"mla f32 dims 40+24, 40, docs", 1, 50, 50, 3, 40, 24, 40, 3, {0, 21, 50}, 0},
    {"mla bf16 K3 dims, docs", 2, 100, 100, 3, 128, 64, 128, 5, {0, 30, 100, 170, 200}, 1},
    {"mla bf16 tiny dims, T 77", 1, 77, 77, 2, 64, 32, 64, 0, {0}, 1},
    {"mla bf16 decode Tq 1, Tk 45", 3, 1, 45, 2, 64, 32, 64, 0, {0}, 1},
    {"mla bf16 append Tq 20, Tk 83", 2, 20, 83, 2, 128, 64, 128, 0, {0}, 1},
    {"mla bf16 dr 0 (k_r NULL), docs", 2, 37, 37, 2, 64, 0, 48, 4, {0, 20, 37, 74}, 1},
    {"mla bf16 dims 40+24, 40, docs", 1, 50, 50, 3, 40, 24, 40, 3, {0, 21, 50}, 1},
    {"mla bf16 CP slice Tq 20 < Tk 83, docs over the keys", 2, 20, 83, 2, 64, 32, 64, 6, {0, 30, 70, 83, 150, 166}, 1},
};

/* the end of an MLA parity case of four inputs (mla_attention's and mla_latent_attention's): the output against the
   CPU's, the four gradients of one random weighting of it, then everything released and the case reported */
static int mla_parity_finish(const char *name, int ok, tide_tensor *oc, tide_tensor *og, tide_tensor *og32,
                             tide_tensor **c, tide_tensor **gp, const char *const *gname, double tol, double gtol,
                             tide_tensor *cu_c, tide_tensor *cu_g, void *buf, char *detail, size_t dsize)
{
    tide_tensor *r = NULL, *rg = NULL, *lc = NULL, *lg = NULL;
    ok = ok && og32;
    int pass = ok;
    if (ok) {
        pass = check_scaled(name, "o", oc, og32, tol, detail, dsize);
        r = tide_randn(TIDE_F32, 4, oc->shape, CPU, 0.0, 1.0);
        rg = r ? tide_to_device(r, GPU) : NULL;
        lc = r ? weighted_sum(oc, r) : NULL;
        lg = rg ? weighted_sum(og32, rg) : NULL;
        ok = lc && lg && !tide_backward(lc, NULL) && !tide_backward(lg, NULL);
        if (!ok) snprintf(detail, dsize, "backward: %s", tide_last_error());
    }
    for (int i = 0; ok && i < 4; i++) {
        if (!c[i]) continue;
        tide_tensor *gc = tide_grad(c[i]), *gg = tide_grad(gp[i]);
        pass = check_scaled(name, gname[i], gc, gg, gtol, detail, dsize) && pass;
        tide_tensor_release(gc);
        tide_tensor_release(gg);
    }
    tide_tensor *all[] = {oc, og, og32, r, rg, lc, lg, cu_c, cu_g};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    for (int i = 0; i < 4; i++) {
        tide_tensor_release(c[i]);
        tide_tensor_release(gp[i]);
    }
    free(buf);
    return report(name, ok && pass, detail);
}

static int test_mla_case(const mla_case *mc)
{
    enum { Q, KN, KR, V, NIN };
    int64_t B = mc->B, Tq = mc->Tq, Tk = mc->Tk, H = mc->H, dn = mc->dn, dr = mc->dr, dv = mc->dv;
    int64_t shp[NIN][4] = {{B, Tq, H, dn + dr}, {B, Tk, H, dn}, {B, Tk, dr, 0}, {B, Tk, H, dv}};
    int nd[NIN] = {4, 4, 3, 4};
    int64_t nmax = B * (Tq > Tk ? Tq : Tk) * H * (dn + dr > dv ? dn + dr : dv);
    double *buf = malloc((size_t)nmax * sizeof *buf);
    tide_tensor *c[NIN] = {0}, *gp[NIN] = {0}, *cu_c = NULL, *cu_g = NULL;
    tide_tensor *oc = NULL, *og = NULL, *og32 = NULL;
    char detail[512] = "";
    int ok = buf != NULL;
    double tol = mc->bf16 ? 1.0 / 128 : 1e-4, gtol = mc->bf16 ? 1.0 / 64 : 1e-4;
    for (int i = 0; ok && i < NIN; i++) {
        if (i == KR && dr == 0) continue;
        int64_t n = 1;
        for (int d = 0; d < nd[i]; d++) n *= shp[i][d];
        for (int64_t j = 0; j < n; j++) buf[j] = normal01();
        c[i] = kda_input(nd[i], shp[i], buf, mc->bf16);
        tide_tensor *d = c[i] ? tide_to_device(c[i], GPU) : NULL;
        gp[i] = (d && mc->bf16) ? tide_to_dtype(d, TIDE_BF16) : d;
        if (gp[i] != d) tide_tensor_release(d);
        ok = c[i] && gp[i] && !tide_set_requires_grad(c[i], 1) && !tide_set_requires_grad(gp[i], 1);
    }
    if (ok && mc->n_cu) {
        int64_t ncu = mc->n_cu;
        cu_c = tide_from_f64(TIDE_I64, 1, &ncu, CPU, mc->cu);
        cu_g = cu_c ? tide_to_device(cu_c, GPU) : NULL;
        ok = cu_g != NULL;
    }
    double scale = 1.0 / sqrt((double)(dn + dr));
    oc = ok ? tide_mla_attention(c[Q], c[KN], c[KR], c[V], cu_c, scale) : NULL;
    ok = oc != NULL;
    if (!ok) snprintf(detail, sizeof detail, "cpu: %s", tide_last_error());
    og = ok ? tide_mla_attention(gp[Q], gp[KN], gp[KR], gp[V], cu_g, scale) : NULL;
    if (ok && !og) snprintf(detail, sizeof detail, "gpu: %s", tide_last_error());
    ok = ok && og;
    og32 = ok ? (og->dtype == TIDE_F32 ? (tide_tensor_retain(og), og) : tide_to_dtype(og, TIDE_F32)) : NULL;
    return mla_parity_finish(mc->name, ok, oc, og, og32, c, gp, (const char *[]){"dq", "dk_n", "dk_r", "dv"}, tol, gtol, cu_c, cu_g, buf,
                             detail, sizeof detail);
}

static int test_mla(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof mla_cases / sizeof mla_cases[0]; i++) passed = test_mla_case(&mla_cases[i]) && passed;
    return passed;
}

/* ---- MLA attention read from the latent (mla_latent_attention): keys and values expanded a chunk at a time -------
   q, c, k_r N(0, 1), w N(0, 1/dc) (expanded keys and values of unit size), scale (dn + dr)^-1/2, the loss sum(o ⊙ r)
   reaches q, c, k_r and w. Chunks of 1, 7, 32, 64 and one bigger than Tk, documents over the keys, CP slices
   (Tq < Tk), dr = 0 with k_r NULL, K3 and tiny head dims. Both sides chunk alike (the CPU's chunks are its own
   sums, the same values). |gpu - cpu| <= tol · max|cpu| as for mla: f32 1e-4; bf16 outputs 2^-7 and gradients 2^-6
   (the expansion itself is rounded to bf16 on the GPU, as F.linear's would be; dQ, dW and the output are summed
   over the chunks in fp32); the emulator (tests/gpu/emu, group mlalatent) measures 3.2e-3 and up to 7.2e-3 at small
   shapes. */
typedef struct {
    const char *name;
    int B, Tq, Tk, H, dn, dr, dv, dc, chunk;
    int n_cu;
    double cu[6];             /* document boundaries over B·Tk keys (row starts are added by the op) */
    int bf16;
} mla_latent_case;

static const mla_latent_case mla_latent_cases[] = {
    {"mla_latent f32 K3 dims, CP slice Tq 40 < Tk 100, docs, chunk 32", 2, 40, 100, 3, 128, 64, 128, 512, 32, 5,
     {0, 30, 100, 170, 200}, 0},
    {"mla_latent f32 tiny dims, T 77, docs, chunk 7", 2, 77, 77, 2, 64, 32, 64, 96, 7, 4, {0, 20, 77, 154}, 0},
    {"mla_latent f32 dr 0 (k_r NULL), chunk 1", 1, 9, 20, 2, 64, 0, 48, 64, 1, 0, {0}, 0},
    {"mla_latent f32 one chunk > Tk, CP slice Tq 20 < Tk 83, docs", 2, 20, 83, 2, 64, 32, 64, 96, 1024, 6,
     {0, 30, 70, 83, 150, 166}, 0},
    {"mla_latent bf16 K3 dims, CP slice Tq 40 < Tk 100, docs, chunk 32", 2, 40, 100, 3, 128, 64, 128, 512, 32, 5,
     {0, 30, 100, 170, 200}, 1},
    {"mla_latent bf16 tiny dims, T 77, docs, chunk 7", 2, 77, 77, 2, 64, 32, 64, 96, 7, 4, {0, 20, 77, 154}, 1},
    {"mla_latent bf16 dr 0 (k_r NULL), Tq 50 < Tk 150, chunk 64", 1, 50, 150, 2, 64, 0, 48, 64, 64, 0, {0}, 1},
};

static int test_mla_latent_case(const mla_latent_case *mc)
{
    enum { Q, C, KR, W, NIN };
    int64_t B = mc->B, Tq = mc->Tq, Tk = mc->Tk, H = mc->H, dn = mc->dn, dr = mc->dr, dv = mc->dv, dc = mc->dc;
    int64_t shp[NIN][4] = {{B, Tq, H, dn + dr}, {B, Tk, dc}, {B, Tk, dr}, {H, dn + dv, dc}};
    int nd[NIN] = {4, 3, 3, 3};
    int64_t nmax = B * Tq * H * (dn + dr);
    if (B * Tk * dc > nmax) nmax = B * Tk * dc;
    if (H * (dn + dv) * dc > nmax) nmax = H * (dn + dv) * dc;
    double *buf = malloc((size_t)nmax * sizeof *buf);
    tide_tensor *c[NIN] = {0}, *gp[NIN] = {0}, *cu_c = NULL, *cu_g = NULL;
    tide_tensor *oc = NULL, *og = NULL, *og32 = NULL;
    char detail[512] = "";
    int ok = buf != NULL;
    double tol = mc->bf16 ? 1.0 / 128 : 1e-4, gtol = mc->bf16 ? 1.0 / 64 : 1e-4;
    for (int i = 0; ok && i < NIN; i++) {
        if (i == KR && dr == 0) continue;
        int64_t n = 1;
        for (int d = 0; d < nd[i]; d++) n *= shp[i][d];
        for (int64_t j = 0; j < n; j++) buf[j] = normal01() * (i == W ? 1.0 / sqrt((double)dc) : 1.0);
        c[i] = kda_input(nd[i], shp[i], buf, mc->bf16);
        tide_tensor *d = c[i] ? tide_to_device(c[i], GPU) : NULL;
        gp[i] = (d && mc->bf16) ? tide_to_dtype(d, TIDE_BF16) : d;
        if (gp[i] != d) tide_tensor_release(d);
        ok = c[i] && gp[i] && !tide_set_requires_grad(c[i], 1) && !tide_set_requires_grad(gp[i], 1);
    }
    if (ok && mc->n_cu) {
        int64_t ncu = mc->n_cu;
        cu_c = tide_from_f64(TIDE_I64, 1, &ncu, CPU, mc->cu);
        cu_g = cu_c ? tide_to_device(cu_c, GPU) : NULL;
        ok = cu_g != NULL;
    }
    double scale = 1.0 / sqrt((double)(dn + dr));
    oc = ok ? tide_mla_latent_attention(c[Q], c[C], c[KR], c[W], cu_c, scale, mc->chunk) : NULL;
    ok = oc != NULL;
    if (!ok) snprintf(detail, sizeof detail, "cpu: %s", tide_last_error());
    og = ok ? tide_mla_latent_attention(gp[Q], gp[C], gp[KR], gp[W], cu_g, scale, mc->chunk) : NULL;
    if (ok && !og) snprintf(detail, sizeof detail, "gpu: %s", tide_last_error());
    ok = ok && og;
    og32 = ok ? (og->dtype == TIDE_F32 ? (tide_tensor_retain(og), og) : tide_to_dtype(og, TIDE_F32)) : NULL;
    return mla_parity_finish(mc->name, ok, oc, og, og32, c, gp, (const char *[]){"dq", "dc", "dk_r", "dw"}, tol, gtol, cu_c, cu_g, buf,
                             detail, sizeof detail);
}

static int test_mla_latent(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof mla_latent_cases / sizeof mla_latent_cases[0]; i++)
        passed = test_mla_latent_case(&mla_latent_cases[i]) && passed;
    return passed;
}

/* the point of the op: a CP slice at K3 widths (H 96, dn 128, dr 64, dv 128, dc 512), Tq 8K queries (the last of
   the row) over Tk 128K keys, bf16, chunks of 1,024 keys. The forward and backward hold the chunk's expansion (twice
   in the backward: keys and values, their gradients) and the fp32 sums over the chunks (output; dq, dw), about
   0.75 GiB whatever Tk, never the row's [Tk, H, dn + dv] expansion (6 GiB here, 50 GB at 1M keys). The peak beyond
   the inputs, the output, the loss's weights and the gradients stays under a quarter of that expansion. */
static int test_mla_latent_memory(void)
{
    const int64_t Tq = 8192, Tk = 131072, H = 96, dn = 128, dr = 64, dv = 128, dc = 512, chunk = 1024;
    int64_t sq[4] = {1, Tq, H, dn + dr}, sc[3] = {1, Tk, dc}, sk[3] = {1, Tk, dr}, sw[3] = {H, dn + dv, dc};
    int64_t *shp[4] = {sq, sc, sk, sw};
    int nd[4] = {4, 3, 3, 3};
    char detail[256] = "";
    tide_tensor *in[4] = {0}, *o = NULL, *r = NULL, *l = NULL;
    int ok = 1;
    tide_memory_stats m0, m1;
    ok = !tide_memory_stats_get(GPU, &m0);
    for (int i = 0; ok && i < 4; i++) {
        tide_tensor *f = tide_randn(TIDE_F32, nd[i], shp[i], GPU, 0.0, i == 3 ? 1.0 / sqrt((double)dc) : 1.0);
        in[i] = f ? tide_to_dtype(f, TIDE_BF16) : NULL;
        tide_tensor_release(f);
        ok = in[i] && !tide_set_requires_grad(in[i], 1);
    }
    if (ok) tide_memory_reset_peak(GPU);
    o = ok ? tide_mla_latent_attention(in[0], in[1], in[2], in[3], NULL, 1.0 / sqrt((double)(dn + dr)), chunk) : NULL;
    tide_tensor *r32 = o ? tide_randn(TIDE_F32, 4, o->shape, GPU, 0.0, 1.0) : NULL;
    r = r32 ? tide_to_dtype(r32, TIDE_BF16) : NULL;
    tide_tensor_release(r32);
    l = r ? weighted_sum(o, r) : NULL;
    ok = l && !tide_backward(l, NULL) && !tide_memory_stats_get(GPU, &m1);
    if (!ok) snprintf(detail, sizeof detail, "%s", tide_last_error());
    int pass = ok;
    if (ok) {
        double inputs = 2.0 * (double)(Tq * H * (dn + dr) + Tk * (dc + dr) + H * (dn + dv) * dc);
        double held = 2.0 * inputs + 2.0 * (double)(2 * Tq * H * dv) + 4.0 * (double)(H * Tq);   /* + grads, o, r, lse */
        double expansion = 2.0 * (double)(Tk * H * (dn + dv)), extra = (double)(m1.peak - m0.current) - held;
        pass = extra <= expansion / 4;
        snprintf(detail, sizeof detail, "peak %.2f GiB; +%.0f MiB beyond inputs, output and gradients (the row's "
                 "expansion alone: %.0f MiB)", (double)m1.peak / 1073741824, extra / 1048576, expansion / 1048576);
    }
    tide_tensor *all[] = {in[0], in[1], in[2], in[3], o, r, l};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    return report("mla_latent memory K3, Tq 8K < Tk 128K", pass, detail);
}

/* ---- MLA decode rows (mla.md §6): R rows append one latent each to their own caches, then attend over them ----------
   qt, qr, c_new, kr_new and the cached tokens N(0, 1), scale (dc + dr)^-1/2; each buffer holds three tokens past
   lens[r] + 1, which must stay as they were. Lengths around the GPU's 64-token tile (L = 1, 64, 65) and long rows,
   dc not a multiple of 32, dr = 0 (no rope part) and dr > 0. out: |gpu - cpu| <= tol · max|cpu|, f32 1e-4, f64 1e-10,
   bf16 2^-7 (CPU f32 on the bf16-rounded inputs; the bf16 output rounds by 2^-9); the buffers must match exactly. */
typedef struct {
    const char *name;
    int R, H, dc, dr;
    int64_t lens[4];
    int dtype;                /* of the GPU op; bf16: the CPU runs f32 on the same (bf16-rounded) values */
    int appended;             /* c_new NULL: the rows share one buffer that holds their tokens (an exact prefill) */
} decode_case;

static const decode_case decode_cases[] = {
    {"mla_decode_rows f32 dr 32, lens 0 63 64 300", 4, 3, 80, 32, {0, 63, 64, 300}, TIDE_F32},
    {"mla_decode_rows f32 dr 0, lens 5 127 1000", 3, 2, 64, 0, {5, 127, 1000}, TIDE_F32},
    {"mla_decode_rows f64 dr 32, lens 0 200 129", 3, 2, 80, 32, {0, 200, 129}, TIDE_F64},
    {"mla_decode_rows f64 dr 0, dc 512, lens 2000 7", 2, 4, 512, 0, {2000, 7}, TIDE_F64},
    {"mla_decode_rows bf16 dr 64, lens 0 64 500", 3, 2, 128, 64, {0, 64, 500}, TIDE_BF16},
    {"mla_decode_rows appended f32 dr 16, one buffer, lens 40 41 42 43", 4, 2, 80, 16, {40, 41, 42, 43}, TIDE_F32, 1},
    {"mla_decode_rows appended f64 dr 0, one buffer, lens 0 1 2", 3, 2, 64, 0, {0, 1, 2}, TIDE_F64, 1},
};

/* a CPU tensor of N(0, 1) values (f64 cases: f64, else f32, bf16-rounded for bf16 cases) and its GPU copy in the
   case's dtype; 0 on success */
static int decode_pair(int dtype, int ndim, const int64_t *shape, tide_tensor **c, tide_tensor **g)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof *v);
    *c = *g = NULL;
    if (!v) return -1;
    for (int64_t j = 0; j < n; j++) v[j] = normal01();
    *c = dtype == TIDE_F64 ? tide_from_f64(TIDE_F64, ndim, shape, CPU, v) : kda_input(ndim, shape, v, dtype == TIDE_BF16);
    free(v);
    tide_tensor *d = *c ? tide_to_device(*c, GPU) : NULL;
    *g = (d && dtype == TIDE_BF16) ? tide_to_dtype(d, TIDE_BF16) : d;
    if (*g != d) tide_tensor_release(d);
    return *c && *g ? 0 : -1;
}

static int test_decode_case(const decode_case *dk)
{
    enum { QT, QR, CN, KN, NIN };
    int R = dk->R, has_kr = dk->dr > 0;
    int64_t H = dk->H, dc = dk->dc, dr = dk->dr;
    int64_t shp[NIN][3] = {{R, H, dc}, {R, H, dr}, {R, dc, 0}, {R, dr, 0}};
    int nd[NIN] = {3, 3, 2, 2};
    tide_tensor *c[NIN] = {0}, *g[NIN] = {0}, *cb_c[4] = {0}, *cb_g[4] = {0}, *kb_c[4] = {0}, *kb_g[4] = {0};
    tide_tensor *pc[4] = {0}, *pg[4] = {0}, *qc[4] = {0}, *qg[4] = {0};   /* the row lists passed (shared: row 0's) */
    tide_tensor *oc = NULL, *og = NULL;
    char detail[512] = "";
    int ok = 1;
    for (int i = 0; ok && i < NIN; i++) {
        if ((!has_kr && (i == QR || i == KN)) || (dk->appended && (i == CN || i == KN))) continue;
        ok = !decode_pair(dk->dtype, nd[i], shp[i], &c[i], &g[i]);
    }
    int64_t maxlen = 0;
    for (int r = 0; r < R; r++) maxlen = dk->lens[r] > maxlen ? dk->lens[r] : maxlen;
    for (int r = 0; ok && r < (dk->appended ? 1 : R); r++) {
        int64_t cap = (dk->appended ? maxlen : dk->lens[r]) + 4, sc[2] = {cap, dc}, sk[2] = {cap, dr};
        ok = !decode_pair(dk->dtype, 2, sc, &cb_c[r], &cb_g[r]) && (!has_kr || !decode_pair(dk->dtype, 2, sk, &kb_c[r], &kb_g[r]));
    }
    for (int r = 0; r < R; r++) {
        int b = dk->appended ? 0 : r;
        pc[r] = cb_c[b]; pg[r] = cb_g[b]; qc[r] = kb_c[b]; qg[r] = kb_g[b];
    }
    if (!ok) snprintf(detail, sizeof detail, "inputs: %s", tide_last_error());
    double scale = 1.0 / sqrt((double)(dc + dr));
    oc = ok ? tide_mla_decode_rows(c[QT], c[QR], c[CN], c[KN], R, pc, has_kr ? qc : NULL, dk->lens, scale) : NULL;
    if (ok && !oc) snprintf(detail, sizeof detail, "cpu: %s", tide_last_error());
    ok = ok && oc;
    og = ok ? tide_mla_decode_rows(g[QT], g[QR], g[CN], g[KN], R, pg, has_kr ? qg : NULL, dk->lens, scale) : NULL;
    if (ok && !og) snprintf(detail, sizeof detail, "gpu: %s", tide_last_error());
    ok = ok && og;
    double tol = dk->dtype == TIDE_F64 ? 1e-10 : dk->dtype == TIDE_BF16 ? 1.0 / 128 : 1e-4;
    int pass = ok && check_scaled(dk->name, "o", oc, og, tol, detail, sizeof detail);
    for (int r = 0; ok && r < (dk->appended ? 1 : R); r++) {
        char what[32];
        snprintf(what, sizeof what, "c_bufs[%d]", r);
        pass = check_scaled(dk->name, what, cb_c[r], cb_g[r], 0.0, detail, sizeof detail) && pass;
        snprintf(what, sizeof what, "kr_bufs[%d]", r);
        if (has_kr) pass = check_scaled(dk->name, what, kb_c[r], kb_g[r], 0.0, detail, sizeof detail) && pass;
    }
    tide_tensor_release(oc);
    tide_tensor_release(og);
    for (int i = 0; i < NIN; i++) {
        tide_tensor_release(c[i]);
        tide_tensor_release(g[i]);
    }
    for (int r = 0; r < 4; r++) {
        tide_tensor_release(cb_c[r]);
        tide_tensor_release(cb_g[r]);
        tide_tensor_release(kb_c[r]);
        tide_tensor_release(kb_g[r]);
    }
    return report(dk->name, ok && pass, detail);
}

static int test_decode(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof decode_cases / sizeof decode_cases[0]; i++)
        passed = test_decode_case(&decode_cases[i]) && passed;
    return passed;
}

/* ---- kda_decode_rows (kda.md §3, §7): one decoding step of R rows over their own states, in place ---------------
   q, k L2-normalised (q scaled), g = log of a decay in (0, 1), beta in (0, 1), states N(0, 0.5²) (fp32). out:
   |gpu - cpu| <= tol · max|cpu| (f32 1e-5; bf16: the CPU runs f32 on the same bf16-rounded values, out rounded to
   bf16 within 2^-7); every row's state after the step (fp32 on both) within 1e-5. */
typedef struct {
    const char *name;
    int R, H, dk, dv, bf16;
} kdec_case;

static const kdec_case kdec_cases[] = {
    {"kda_decode_rows f32 R 5 H 3 dk dv 64", 5, 3, 64, 64, 0},
    {"kda_decode_rows f32 R 2 H 2 dk 128 dv 200 (dv > threads)", 2, 2, 128, 200, 0},
    {"kda_decode_rows bf16 R 4 H 2 dk dv 128", 4, 2, 128, 128, 1},
};

static int test_kdec_case(const kdec_case *kc)
{
    int R = kc->R;
    int64_t H = kc->H, dk = kc->dk, dv = kc->dv, nq = R * H * dk, nv = R * H * dv, sz = H * dk * dv;
    double *qv = malloc((size_t)nq * sizeof *qv), *kv = malloc((size_t)nq * sizeof *kv), *gv = malloc((size_t)nq * sizeof *gv);
    double *vv = malloc((size_t)nv * sizeof *vv), *bv = malloc((size_t)(R * H) * sizeof *bv);
    double *sv = malloc((size_t)sz * sizeof *sv);
    char detail[512] = "";
    int ok = qv && kv && gv && vv && bv && sv;
    for (int64_t rh = 0; ok && rh < R * H; rh++) {
        double nq2 = 0, nk2 = 0;
        for (int64_t i = 0; i < dk; i++) {
            qv[rh * dk + i] = normal01(); kv[rh * dk + i] = normal01(); gv[rh * dk + i] = log(0.5 + 0.5 * uniform01());
            nq2 += qv[rh * dk + i] * qv[rh * dk + i]; nk2 += kv[rh * dk + i] * kv[rh * dk + i];
        }
        for (int64_t i = 0; i < dk; i++) { qv[rh * dk + i] /= sqrt(nq2 * (double)dk); kv[rh * dk + i] /= sqrt(nk2); }
        for (int64_t j = 0; j < dv; j++) vv[rh * dv + j] = normal01();
        bv[rh] = sigm(normal01());
    }
    int64_t s3[3] = {R, H, dk}, sv3[3] = {R, H, dv}, sb[2] = {R, H}, ss[4] = {1, H, dk, dv};
    tide_tensor *c[5] = {0}, *g[5] = {0}, *cs[8] = {0}, *gs[8] = {0}, *oc = NULL, *og = NULL;
    if (ok) {
        c[0] = kda_input(3, s3, qv, kc->bf16); c[1] = kda_input(3, s3, kv, kc->bf16); c[2] = kda_input(3, sv3, vv, kc->bf16);
        c[3] = kda_input(3, s3, gv, kc->bf16); c[4] = kda_input(2, sb, bv, kc->bf16);
        for (int i = 0; i < 5; i++) {
            tide_tensor *d = c[i] ? tide_to_device(c[i], GPU) : NULL;
            g[i] = d && kc->bf16 ? tide_to_dtype(d, TIDE_BF16) : d;
            if (g[i] != d) tide_tensor_release(d);
            ok = ok && c[i] && g[i];
        }
        for (int r = 0; ok && r < R; r++) {
            for (int64_t e = 0; e < sz; e++) sv[e] = 0.5 * normal01();
            cs[r] = tide_from_f64(TIDE_F32, 4, ss, CPU, sv);
            gs[r] = cs[r] ? tide_to_device(cs[r], GPU) : NULL;
            ok = cs[r] && gs[r];
        }
    }
    if (!ok) snprintf(detail, sizeof detail, "inputs: %s", tide_last_error());
    oc = ok ? tide_kda_decode_rows(c[0], c[1], c[2], c[3], c[4], R, cs) : NULL;
    if (ok && !oc) snprintf(detail, sizeof detail, "cpu: %s", tide_last_error());
    ok = ok && oc;
    og = ok ? tide_kda_decode_rows(g[0], g[1], g[2], g[3], g[4], R, gs) : NULL;
    if (ok && !og) snprintf(detail, sizeof detail, "gpu: %s", tide_last_error());
    ok = ok && og;
    int pass = ok && check_scaled(kc->name, "o", oc, og, kc->bf16 ? 1.0 / 128 : 1e-5, detail, sizeof detail);
    for (int r = 0; ok && r < R; r++) {
        char what[32];
        snprintf(what, sizeof what, "states[%d]", r);
        pass = check_scaled(kc->name, what, cs[r], gs[r], 1e-5, detail, sizeof detail) && pass;
    }
    tide_tensor_release(oc); tide_tensor_release(og);
    for (int i = 0; i < 5; i++) { tide_tensor_release(c[i]); tide_tensor_release(g[i]); }
    for (int r = 0; r < 8; r++) { tide_tensor_release(cs[r]); tide_tensor_release(gs[r]); }
    free(qv); free(kv); free(gv); free(vv); free(bv); free(sv);
    return report(kc->name, ok && pass, detail);
}

static int test_kdec(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof kdec_cases / sizeof kdec_cases[0]; i++) passed = test_kdec_case(&kdec_cases[i]) && passed;
    return passed;
}

/* ---- conv_decode_rows (kda.md §1.2): one causal-conv decoding step of R rows over their own histories, in place ------
   x [R, 1, C], w [C, K], histories [1, K-1, C], all N(0, 1). out (silu on): |gpu - cpu| <= tol · max|cpu| (f32 1e-6;
   bf16: the CPU runs f32 on the same bf16-rounded values, out rounded to bf16 within 2^-7); every row's history after
   the step is a copy (exact). */
typedef struct {
    const char *name;
    int R, C, K, bf16;
} cdec_case;

static const cdec_case cdec_cases[] = {
    {"conv_decode_rows f32 R 7 C 96 K 4", 7, 96, 4, 0},
    {"conv_decode_rows f32 R 3 C 5 K 1 (no history)", 3, 5, 1, 0},
    {"conv_decode_rows bf16 R 4 C 128 K 4", 4, 128, 4, 1},
};

static int test_cdec_case(const cdec_case *kc)
{
    int R = kc->R;
    int64_t C = kc->C, K = kc->K, nh = (K - 1) * C;
    double *xv = malloc((size_t)(R * C) * sizeof *xv), *wv = malloc((size_t)(C * K) * sizeof *wv);
    double *hv = malloc((size_t)(nh > 0 ? nh : 1) * sizeof *hv);
    char detail[512] = "";
    int ok = xv && wv && hv;
    for (int64_t i = 0; ok && i < R * C; i++) xv[i] = normal01();
    for (int64_t i = 0; ok && i < C * K; i++) wv[i] = normal01();
    int64_t sx[3] = {R, 1, C}, sw[2] = {C, K}, sh[3] = {1, K - 1, C};
    tide_tensor *c[2] = {0}, *g[2] = {0}, *cs[8] = {0}, *gs[8] = {0}, *oc = NULL, *og = NULL;
    if (ok) {
        c[0] = kda_input(3, sx, xv, kc->bf16);
        c[1] = kda_input(2, sw, wv, kc->bf16);
        for (int i = 0; i < 2; i++) {
            tide_tensor *d = c[i] ? tide_to_device(c[i], GPU) : NULL;
            g[i] = d && kc->bf16 ? tide_to_dtype(d, TIDE_BF16) : d;
            if (g[i] != d) tide_tensor_release(d);
            ok = ok && c[i] && g[i];
        }
        for (int r = 0; ok && r < R; r++) {
            for (int64_t e = 0; e < nh; e++) hv[e] = normal01();
            cs[r] = kda_input(3, sh, hv, kc->bf16);
            tide_tensor *d = cs[r] ? tide_to_device(cs[r], GPU) : NULL;
            gs[r] = d && kc->bf16 ? tide_to_dtype(d, TIDE_BF16) : d;
            if (gs[r] != d) tide_tensor_release(d);
            ok = cs[r] && gs[r];
        }
    }
    if (!ok) snprintf(detail, sizeof detail, "inputs: %s", tide_last_error());
    oc = ok ? tide_conv_decode_rows(c[0], c[1], R, cs, 1) : NULL;
    if (ok && !oc) snprintf(detail, sizeof detail, "cpu: %s", tide_last_error());
    ok = ok && oc;
    og = ok ? tide_conv_decode_rows(g[0], g[1], R, gs, 1) : NULL;
    if (ok && !og) snprintf(detail, sizeof detail, "gpu: %s", tide_last_error());
    ok = ok && og;
    int pass = ok && check_scaled(kc->name, "out", oc, og, kc->bf16 ? 1.0 / 128 : 1e-6, detail, sizeof detail);
    for (int r = 0; ok && r < R && K > 1; r++) {
        char what[32];
        snprintf(what, sizeof what, "caches[%d]", r);
        pass = check_scaled(kc->name, what, cs[r], gs[r], 0, detail, sizeof detail) && pass;
    }
    tide_tensor_release(oc); tide_tensor_release(og);
    for (int i = 0; i < 2; i++) { tide_tensor_release(c[i]); tide_tensor_release(g[i]); }
    for (int r = 0; r < 8; r++) { tide_tensor_release(cs[r]); tide_tensor_release(gs[r]); }
    free(xv); free(wv); free(hv);
    return report(kc->name, ok && pass, detail);
}

static int test_cdec(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof cdec_cases / sizeof cdec_cases[0]; i++) passed = test_cdec_case(&cdec_cases[i]) && passed;
    return passed;
}

/* ---- varlen attention (vision.md §3, §5): q, k, v [T, H, D] of packed images, bidirectional inside each image -----
   All N(0, 1), scale D^-1/2, the loss sum(o ⊙ r). Shapes: MoonViT's head dim 72 (not a multiple of 16) and tiny-vlm's
   16, images of one token, images longer than a 64-key tile, an empty image (a repeated boundary). The CPU runs the
   MLA tile kernels in f32, the GPU mla.cu's flash kernels with bidir set. Tolerances as for mla (same kernels, the
   same sums per query; the bf16 output and P, dS operands rounded to bf16). */
typedef struct {
    const char *name;
    int T, H, D;
    int n_cu;
    double cu[8];
    int bf16;
} varlen_case;

static const varlen_case varlen_cases[] = {
    {"varlen f32 D 72, images 1, 70, 129", 200, 3, 72, 4, {0, 1, 71, 200}, 0},
    {"varlen f32 D 16, 4 images (one empty)", 150, 4, 16, 6, {0, 64, 64, 65, 100, 150}, 0},
    {"varlen f32 D 64, one image of 300", 300, 2, 64, 2, {0, 300}, 0},
    {"varlen bf16 D 72, images 1, 70, 129", 200, 3, 72, 4, {0, 1, 71, 200}, 1},
    {"varlen bf16 D 64, 3 images", 180, 2, 64, 4, {0, 50, 51, 180}, 1},
};

static int test_varlen_case(const varlen_case *vc)
{
    int64_t T = vc->T, H = vc->H, D = vc->D, shp[3] = {T, H, D}, n = T * H * D, ncu = vc->n_cu;
    double *buf = malloc((size_t)n * sizeof *buf);
    tide_tensor *c[3] = {0}, *gp[3] = {0}, *cu_c = NULL, *cu_g = NULL;
    tide_tensor *oc = NULL, *og = NULL, *og32 = NULL, *r = NULL, *rg = NULL, *lc = NULL, *lg = NULL;
    char detail[512] = "";
    int ok = buf != NULL;
    double tol = vc->bf16 ? 1.0 / 128 : 1e-4, gtol = vc->bf16 ? 1.0 / 64 : 1e-4;
    for (int i = 0; ok && i < 3; i++) {
        for (int64_t j = 0; j < n; j++) buf[j] = normal01();
        c[i] = kda_input(3, shp, buf, vc->bf16);
        tide_tensor *d = c[i] ? tide_to_device(c[i], GPU) : NULL;
        gp[i] = (d && vc->bf16) ? tide_to_dtype(d, TIDE_BF16) : d;
        if (gp[i] != d) tide_tensor_release(d);
        ok = c[i] && gp[i] && !tide_set_requires_grad(c[i], 1) && !tide_set_requires_grad(gp[i], 1);
    }
    cu_c = ok ? tide_from_f64(TIDE_I32, 1, &ncu, CPU, vc->cu) : NULL;
    cu_g = cu_c ? tide_to_device(cu_c, GPU) : NULL;
    ok = ok && cu_g;
    double scale = 1.0 / sqrt((double)D);
    oc = ok ? tide_varlen_attention(c[0], c[1], c[2], cu_c, scale) : NULL;
    ok = oc != NULL;
    if (!ok) snprintf(detail, sizeof detail, "cpu: %s", tide_last_error());
    og = ok ? tide_varlen_attention(gp[0], gp[1], gp[2], cu_g, scale) : NULL;
    if (ok && !og) snprintf(detail, sizeof detail, "gpu: %s", tide_last_error());
    ok = ok && og;
    og32 = ok ? (og->dtype == TIDE_F32 ? (tide_tensor_retain(og), og) : tide_to_dtype(og, TIDE_F32)) : NULL;
    ok = ok && og32;
    int pass = ok;
    if (ok) {
        pass = check_scaled(vc->name, "o", oc, og32, tol, detail, sizeof detail);
        r = tide_randn(TIDE_F32, 3, oc->shape, CPU, 0.0, 1.0);
        rg = r ? tide_to_device(r, GPU) : NULL;
        lc = r ? weighted_sum(oc, r) : NULL;
        lg = rg ? weighted_sum(og32, rg) : NULL;
        ok = lc && lg && !tide_backward(lc, NULL) && !tide_backward(lg, NULL);
        if (!ok) snprintf(detail, sizeof detail, "backward: %s", tide_last_error());
    }
    const char *gname[3] = {"dq", "dk", "dv"};
    for (int i = 0; ok && i < 3; i++) {
        tide_tensor *gc = tide_grad(c[i]), *gg = tide_grad(gp[i]);
        pass = check_scaled(vc->name, gname[i], gc, gg, gtol, detail, sizeof detail) && pass;
        tide_tensor_release(gc);
        tide_tensor_release(gg);
    }
    tide_tensor *all[] = {oc, og, og32, r, rg, lc, lg, cu_c, cu_g};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    for (int i = 0; i < 3; i++) {
        tide_tensor_release(c[i]);
        tide_tensor_release(gp[i]);
    }
    free(buf);
    return report(vc->name, ok && pass, detail);
}

static int test_varlen(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof varlen_cases / sizeof varlen_cases[0]; i++)
        passed = test_varlen_case(&varlen_cases[i]) && passed;
    return passed;
}

/* ---- softmax attention (the dense baseline's F.attention): q [B, H, Tq, D], k, v [B, H, Tk, D] -----------------
   N(0, 4) inputs (scores of a few units: peaked rows), scale D^-1/2; causal and not, Tq < Tk and Tq > Tk (not
   causal), T not a multiple of any tile, GPT-2 small's head dim 64. The CPU runs f32 BLAS products with the softmax
   in double; the GPU the flash kernels of mla.cu. |gpu - cpu| <= tol · max|cpu|: f32 1e-5 for the output, 1e-4 for
   the gradients (fp32 sums over up to 200 keys on both sides; ~1e-6 from f64 measured in emulation); bf16 outputs
   2^-7 (P is rounded to bf16 for P V, the output to bf16), gradients 2^-6 (dS and the incoming gradient in bf16),
   as for mla. */
typedef struct {
    const char *name;
    int64_t B, H, Tq, Tk, D;
    int causal, bf16;
    double tol, gtol;
} attention_case;

static const attention_case attention_cases[] = {
    {"attention f32 causal [2,3,77,64]", 2, 3, 77, 77, 64, 1, 0, 1e-5, 1e-4},
    {"attention f32 not causal, Tq 20 < Tk 83", 1, 2, 20, 83, 64, 0, 0, 1e-5, 1e-4},
    {"attention f32 causal, Tq 20 < Tk 83", 1, 2, 20, 83, 64, 1, 0, 1e-5, 1e-4},
    {"attention f32 not causal, Tq 50 > Tk 9, D 40", 2, 2, 50, 9, 40, 0, 0, 1e-5, 1e-4},
    {"attention f32 causal T 200, D 128", 1, 2, 200, 200, 128, 1, 0, 1e-5, 1e-4},
    {"attention bf16 causal [2,3,77,64]", 2, 3, 77, 77, 64, 1, 1, 1.0 / 128, 1.0 / 64},
    {"attention bf16 not causal, Tq 20 < Tk 83", 1, 2, 20, 83, 64, 0, 1, 1.0 / 128, 1.0 / 64},
    {"attention bf16 causal T 200, D 128", 1, 2, 200, 200, 128, 1, 1, 1.0 / 128, 1.0 / 64},
};

static int test_attention_case(const attention_case *ac)
{
    enum { Q, K, V, NIN };
    int64_t shp[NIN][4] = {{ac->B, ac->H, ac->Tq, ac->D}, {ac->B, ac->H, ac->Tk, ac->D}, {ac->B, ac->H, ac->Tk, ac->D}};
    int64_t most = ac->B * ac->H * (ac->Tq > ac->Tk ? ac->Tq : ac->Tk) * ac->D;
    double *buf = malloc((size_t)most * sizeof *buf);
    tide_tensor *c[NIN] = {0}, *gp[NIN] = {0}, *oc = NULL, *og = NULL, *og32 = NULL, *r = NULL, *rg = NULL, *lc = NULL,
                *lg = NULL;
    char detail[512] = "";
    int ok = buf != NULL;
    for (int i = 0; ok && i < NIN; i++) {
        int64_t n = shp[i][0] * shp[i][1] * shp[i][2] * shp[i][3];
        for (int64_t j = 0; j < n; j++) buf[j] = 2.0 * normal01();
        c[i] = kda_input(4, shp[i], buf, ac->bf16);
        tide_tensor *d = c[i] ? tide_to_device(c[i], GPU) : NULL;
        gp[i] = (d && ac->bf16) ? tide_to_dtype(d, TIDE_BF16) : d;
        if (gp[i] != d) tide_tensor_release(d);
        ok = c[i] && gp[i] && !tide_set_requires_grad(c[i], 1) && !tide_set_requires_grad(gp[i], 1);
    }
    double scale = 1.0 / sqrt((double)ac->D);
    oc = ok ? tide_attention(c[Q], c[K], c[V], ac->causal, scale) : NULL;
    og = oc ? tide_attention(gp[Q], gp[K], gp[V], ac->causal, scale) : NULL;
    og32 = og ? (og->dtype == TIDE_F32 ? (tide_tensor_retain(og), og) : tide_to_dtype(og, TIDE_F32)) : NULL;
    if (ok && !og32) snprintf(detail, sizeof detail, "%s: %s", oc ? "gpu" : "cpu", tide_last_error());
    ok = ok && og32;
    int pass = ok;
    if (ok) {
        pass = check_scaled(ac->name, "o", oc, og32, ac->tol, detail, sizeof detail);
        r = tide_randn(TIDE_F32, 4, oc->shape, CPU, 0.0, 1.0);
        rg = r ? tide_to_device(r, GPU) : NULL;
        lc = r ? weighted_sum(oc, r) : NULL;
        lg = rg ? weighted_sum(og32, rg) : NULL;
        ok = lc && lg && !tide_backward(lc, NULL) && !tide_backward(lg, NULL);
        if (!ok) snprintf(detail, sizeof detail, "backward: %s", tide_last_error());
    }
    const char *gname[NIN] = {"dq", "dk", "dv"};
    for (int i = 0; ok && i < NIN; i++) {
        tide_tensor *gc = tide_grad(c[i]), *gg = tide_grad(gp[i]);
        pass = check_scaled(ac->name, gname[i], gc, gg, ac->gtol, detail, sizeof detail) && pass;
        tide_tensor_release(gc);
        tide_tensor_release(gg);
    }
    tide_tensor *all[] = {oc, og, og32, r, rg, lc, lg};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    for (int i = 0; i < NIN; i++) {
        tide_tensor_release(c[i]);
        tide_tensor_release(gp[i]);
    }
    free(buf);
    return report(ac->name, ok && pass, detail);
}

static int test_attention(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof attention_cases / sizeof attention_cases[0]; i++)
        passed = test_attention_case(&attention_cases[i]) && passed;
    return passed;
}

/* ---- Attention Residuals (attnres.md §1, §4): n sources, w, nu -> one output ----------------------------------
   The GPU forward is the online-softmax form, the CPU's the direct one (oracle 5). |gpu - cpu| <= tol · max|cpu|:
   f32 1e-5 (fp32 block sums of d terms against double sums), gradients 1e-4 (dw and dν sum rows·n terms); bf16
   outputs 2^-7 and gradients 2^-6 (one bf16 step of the scale, as for kda). d 7168 is K3's hidden size. */
typedef struct {
    const char *name;
    int n;
    int64_t B, T, d;
    double wscale;
    int bf16;
    double tol, gtol;
} attnres_case;

static const attnres_case attnres_cases[] = {
    {"attnres f32 5 sources [2,37,96]", 5, 2, 37, 96, 0.3, 0, 1e-5, 1e-4},
    {"attnres f32 1 source", 1, 1, 9, 64, 1.0, 0, 1e-5, 1e-4},
    {"attnres f32 17 sources [1,20,256]", 17, 1, 20, 256, 0.1, 0, 1e-5, 1e-4},
    {"attnres f32 9 sources d 7168", 9, 1, 6, 7168, 0.02, 0, 1e-5, 1e-4},
    {"attnres bf16 5 sources [2,37,96]", 5, 2, 37, 96, 0.3, 1, 1.0 / 128, 1.0 / 64},
    {"attnres bf16 9 sources d 7168", 9, 1, 6, 7168, 0.02, 1, 1.0 / 128, 1.0 / 64},
    /* widths past K3's: the launch shape at its register limit (kernels/cuda/launch.h, gpu-launch-limits) */
    {"attnres f32 9 sources d 8192", 9, 1, 5, 8192, 0.02, 0, 1e-5, 1e-4},
    {"attnres bf16 5 sources d 8192", 5, 2, 3, 8192, 0.02, 1, 1.0 / 128, 1.0 / 64},
    {"attnres f32 5 sources d 16384", 5, 1, 4, 16384, 0.01, 0, 1e-5, 1e-4},
};

static int test_attnres_case(const attnres_case *ac)
{
    enum { MAXN = 17 };
    int n = ac->n;
    int64_t sshape[3] = {ac->B, ac->T, ac->d}, wshape[1] = {ac->d}, nsrc = ac->B * ac->T * ac->d;
    double *buf = malloc((size_t)nsrc * sizeof *buf);
    tide_tensor *c[MAXN + 2] = {0}, *gp[MAXN + 2] = {0}, *oc = NULL, *og = NULL, *og32 = NULL, *r = NULL, *rg = NULL,
                *lc = NULL, *lg = NULL;
    char detail[512] = "";
    int ok = buf != NULL && n <= MAXN;
    for (int i = 0; ok && i < n + 2; i++) {
        int64_t cnt = i < n ? nsrc : ac->d;
        for (int64_t j = 0; j < cnt; j++)
            buf[j] = i < n ? (0.5 + 0.1 * i) * normal01() : i == n ? ac->wscale * normal01() : 1.0 + 0.2 * normal01();
        c[i] = kda_input(i < n ? 3 : 1, i < n ? sshape : wshape, buf, ac->bf16);
        tide_tensor *d = c[i] ? tide_to_device(c[i], GPU) : NULL;
        gp[i] = (d && ac->bf16) ? tide_to_dtype(d, TIDE_BF16) : d;
        if (gp[i] != d) tide_tensor_release(d);
        ok = c[i] && gp[i] && !tide_set_requires_grad(c[i], 1) && !tide_set_requires_grad(gp[i], 1);
    }
    oc = ok ? tide_attnres(n, c, c[n], c[n + 1], 1e-5) : NULL;
    og = oc ? tide_attnres(n, gp, gp[n], gp[n + 1], 1e-5) : NULL;
    og32 = og ? (og->dtype == TIDE_F32 ? (tide_tensor_retain(og), og) : tide_to_dtype(og, TIDE_F32)) : NULL;
    if (ok && !og32) snprintf(detail, sizeof detail, "%s: %s", oc ? "gpu" : "cpu", tide_last_error());
    ok = ok && og32;
    int pass = ok;
    if (ok) {
        pass = check_scaled(ac->name, "out", oc, og32, ac->tol, detail, sizeof detail);
        r = tide_randn(TIDE_F32, 3, oc->shape, CPU, 0.0, 1.0);
        rg = r ? tide_to_device(r, GPU) : NULL;
        lc = r ? weighted_sum(oc, r) : NULL;
        lg = rg ? weighted_sum(og32, rg) : NULL;
        ok = lc && lg && !tide_backward(lc, NULL) && !tide_backward(lg, NULL);
        if (!ok) snprintf(detail, sizeof detail, "backward: %s", tide_last_error());
    }
    for (int i = 0; ok && i < n + 2; i++) {
        char what[16];
        if (i < n) snprintf(what, sizeof what, "dv%d", i);
        else snprintf(what, sizeof what, "%s", i == n ? "dw" : "dnu");
        tide_tensor *gc = tide_grad(c[i]), *gg = tide_grad(gp[i]);
        pass = check_scaled(ac->name, what, gc, gg, ac->gtol, detail, sizeof detail) && pass;
        tide_tensor_release(gc);
        tide_tensor_release(gg);
    }
    tide_tensor *all[] = {oc, og, og32, r, rg, lc, lg};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    for (int i = 0; i < MAXN + 2; i++) {
        tide_tensor_release(c[i]);
        tide_tensor_release(gp[i]);
    }
    free(buf);
    return report(ac->name, ok && pass, detail);
}

/* ---- MoE experts (moe.md §8): k 2, expert 3 in every token; n 8: experts 5 and 6 idle, else n − 2 and n − 1;
   forward, dx, dp, dw vs the CPU; the GPU run repeated is bitwise equal (no atomics); the capacity drops the same
   count on both. m·k past 1,024 and n past 256 take the device sort over several tiles; bf16 rows whose length is
   not a multiple of 8 take the per-product GEMM fallback instead of the grouped one. Under no_grad (no backward, so
   no host offsets) m·k up to TIDE_MOE_DEVICE_ROWS runs without a host sync (moe_rows_gemm_kernel): the same output
   within the tolerance, and bitwise equal run to run ---- */
typedef struct {
    int bf16;
    double tol;
    int64_t m, n, din, de, dout;
} moe_case;

/* f32: cuBLAS reorders the K-sums (K <= 48, or the ~700 rows of expert 3 in the weight gradients): 1e-5 of the
   largest value; bf16: the inputs, pre-activations, h and y are rounded to bf16 (step 2^-8) along the way: 1/64 of
   the largest value */
static const moe_case moe_cases[] = {
    {0, 1e-5, 37, 8, 48, 32, 40},
    {1, 1.0 / 64, 37, 8, 48, 32, 40},
    {0, 1e-5, 700, 300, 16, 8, 24},
    {1, 1.0 / 64, 41, 6, 7, 5, 9},
};

static void moe_case_name(const moe_case *mc, char *name, size_t n)
{
    snprintf(name, n, "moe_experts %s m %lld n %lld k 2 d %lld/%lld/%lld", mc->bf16 ? "bf16" : "f32", (long long)mc->m,
             (long long)mc->n, (long long)mc->din, (long long)mc->de, (long long)mc->dout);
}

static int test_moe_case(const moe_case *mc)
{
    int bf16 = mc->bf16;
    double tol = mc->tol;
    int64_t m = mc->m, n = mc->n, din = mc->din, de = mc->de, dout = mc->dout;
    enum { X, SEL, P, WGU, WD, NIN };
    const int64_t k = 2;
    int64_t shp[NIN][3] = {{m, din}, {m, k}, {m, k}, {n, 2 * de, din}, {n, dout, de}};
    int nd[NIN] = {2, 2, 2, 3, 3};
    int64_t most = m * (din > k ? din : k);   /* the largest input: x or sel, w_gate_up, w_down */
    most = most > n * 2 * de * din ? most : n * 2 * de * din;
    most = most > n * dout * de ? most : n * dout * de;
    double *buf = malloc((size_t)most * sizeof *buf);
    tide_tensor *c[NIN] = {0}, *g[NIN] = {0}, *oc = NULL, *og = NULL, *og2 = NULL, *og32 = NULL, *r = NULL, *rg = NULL,
                *lc = NULL, *lg = NULL, *cap_c = NULL, *cap_g = NULL, *ng = NULL, *ng2 = NULL, *ng32 = NULL;
    static const int cyc[5] = {7, 0, 4, 1, 2};
    char detail[512] = "", name[160];
    moe_case_name(mc, name, sizeof name);
    int ok = buf != NULL;
    for (int i = 0; ok && i < NIN; i++) {
        int64_t cnt = 1;
        for (int d = 0; d < nd[i]; d++) cnt *= shp[i][d];
        for (int64_t j = 0; j < cnt; j++)
            buf[j] = i == SEL ? (j % 2 ? (n == 8 ? cyc[(j / 2 * 3) % 5] : (j / 2 * 7) % (n - 2)) : 3) :
                     i == P ? 0.1 + 0.9 * uniform01() :
                     i == X ? normal01() : 0.2 * normal01();
        if (i == SEL) {
            c[i] = tide_from_f64(TIDE_I64, 2, shp[i], CPU, buf);
            g[i] = c[i] ? tide_to_device(c[i], GPU) : NULL;
            ok = c[i] && g[i];
            continue;
        }
        c[i] = kda_input(nd[i], shp[i], buf, bf16);
        tide_tensor *d = c[i] ? tide_to_device(c[i], GPU) : NULL;
        g[i] = (d && bf16) ? tide_to_dtype(d, TIDE_BF16) : d;
        if (g[i] != d) tide_tensor_release(d);
        ok = c[i] && g[i] && !tide_set_requires_grad(c[i], 1) && !tide_set_requires_grad(g[i], 1);
    }
    int64_t dc = -1, dg = -2;
    oc = ok ? tide_moe_experts(c[X], c[SEL], c[P], c[WGU], c[WD], TIDE_MOE_SITU, 4, 25, 0, NULL) : NULL;
    og = oc ? tide_moe_experts(g[X], g[SEL], g[P], g[WGU], g[WD], TIDE_MOE_SITU, 4, 25, 0, NULL) : NULL;
    og2 = og ? tide_moe_experts(g[X], g[SEL], g[P], g[WGU], g[WD], TIDE_MOE_SITU, 4, 25, 0, NULL) : NULL;
    cap_c = og2 ? tide_moe_experts(c[X], c[SEL], c[P], c[WGU], c[WD], TIDE_MOE_SWIGLU, 4, 25, 0.75, &dc) : NULL;
    cap_g = cap_c ? tide_moe_experts(g[X], g[SEL], g[P], g[WGU], g[WD], TIDE_MOE_SWIGLU, 4, 25, 0.75, &dg) : NULL;
    og32 = og ? (og->dtype == TIDE_F32 ? (tide_tensor_retain(og), og) : tide_to_dtype(og, TIDE_F32)) : NULL;
    int prev_grad = tide_set_grad_enabled(0);
    ng = cap_g ? tide_moe_experts(g[X], g[SEL], g[P], g[WGU], g[WD], TIDE_MOE_SITU, 4, 25, 0, NULL) : NULL;
    ng2 = ng ? tide_moe_experts(g[X], g[SEL], g[P], g[WGU], g[WD], TIDE_MOE_SITU, 4, 25, 0, NULL) : NULL;
    ng32 = ng2 ? (ng->dtype == TIDE_F32 ? (tide_tensor_retain(ng), ng) : tide_to_dtype(ng, TIDE_F32)) : NULL;
    tide_set_grad_enabled(prev_grad);
    if (ok && !(og32 && cap_g && ng32)) snprintf(detail, sizeof detail, "%s", tide_last_error());
    ok = ok && og32 && cap_g && ng32;
    int pass = ok;
    if (ok) {
        double *a = host_values(og), *b = host_values(og2), *na = host_values(ng), *nb = host_values(ng2);
        int same = a && b && !memcmp(a, b, (size_t)og->numel * sizeof *a);
        int nsame = na && nb && !memcmp(na, nb, (size_t)ng->numel * sizeof *na);
        free(a); free(b); free(na); free(nb);
        if (!same || !nsame) snprintf(detail, sizeof detail, "two GPU runs differ%s ", same ? " (no_grad)" : "");
        pass = same && nsame && dc == dg && dc > 0 && check_scaled(name, "out", oc, og32, tol, detail, sizeof detail) &&
               check_scaled(name, "no_grad out", oc, ng32, tol, detail, sizeof detail) &&
               check_scaled(name, "capacity out", cap_c, cap_g, tol, detail, sizeof detail);
        if (dc != dg) { size_t len = strlen(detail); snprintf(detail + len, sizeof detail - len, " dropped cpu %lld gpu %lld", (long long)dc, (long long)dg); }
        r = tide_randn(TIDE_F32, 2, oc->shape, CPU, 0.0, 1.0);
        rg = r ? tide_to_device(r, GPU) : NULL;
        lc = r ? weighted_sum(oc, r) : NULL;
        lg = rg ? weighted_sum(og32, rg) : NULL;
        ok = lc && lg && !tide_backward(lc, NULL) && !tide_backward(lg, NULL);
        if (!ok) snprintf(detail, sizeof detail, "backward: %s", tide_last_error());
    }
    static const char *what[NIN] = {"dx", "", "dp", "dw_gate_up", "dw_down"};
    for (int i = 0; ok && i < NIN; i++) {
        if (i == SEL) continue;
        tide_tensor *gc = tide_grad(c[i]), *gg = tide_grad(g[i]);
        pass = check_scaled(name, what[i], gc, gg, tol, detail, sizeof detail) && pass;
        tide_tensor_release(gc);
        tide_tensor_release(gg);
    }
    tide_tensor *all[] = {oc, og, og2, og32, r, rg, lc, lg, cap_c, cap_g, ng, ng2, ng32};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    for (int i = 0; i < NIN; i++) { tide_tensor_release(c[i]); tide_tensor_release(g[i]); }
    free(buf);
    return report(name, ok && pass, detail);
}

static int test_moe(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof moe_cases / sizeof moe_cases[0]; i++) passed = test_moe_case(&moe_cases[i]) && passed;
    return passed;
}

static int test_attnres(void)
{
    int passed = 1;
    for (size_t i = 0; i < sizeof attnres_cases / sizeof attnres_cases[0]; i++)
        passed = test_attnres_case(&attnres_cases[i]) && passed;
    return passed;
}

/* three AdamW steps from the same state on both devices (both compute the update in double), f32, bf16 and f64,
   one block and many, each with its device's non-finite flag: 0 on both after the clean steps; then a NaN planted
   in the last gradient element, and lr 1e300 (f32 weights overflow when stored), set it on both */
static int adamw_case(int dt, int64_t n, char *detail, size_t dn)
{
    int64_t s[1] = {n}, one[1] = {1};
    tide_tensor *p = tide_randn(dt, 1, s, CPU, 0.0, 1.0), *g = tide_randn(dt, 1, s, CPU, 0.0, 1.0);
    tide_tensor *m = tide_zeros(dt, 1, s, CPU), *v = tide_zeros(dt, 1, s, CPU);
    tide_tensor *pg = p ? tide_to_device(p, GPU) : NULL, *gg = g ? tide_to_device(g, GPU) : NULL;
    tide_tensor *mg = m ? tide_to_device(m, GPU) : NULL, *vg = v ? tide_to_device(v, GPU) : NULL;
    tide_tensor *fc = tide_zeros(TIDE_I32, 1, one, CPU), *fg = tide_zeros(TIDE_I32, 1, one, GPU);
    const char *dn_ = dt == TIDE_F32 ? "f32" : dt == TIDE_F64 ? "f64" : "bf16";
    double tol = dt == TIDE_F64 ? 1e-12 : dt == TIDE_F32 ? 1e-6 : 1e-2;
    int ok = pg && gg && mg && vg && fc && fg;
    for (int64_t step = 0; ok && step < 3; step++) {
        ok = tide_adamw_step_checked_(p, g, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, fc) == 0 &&
             tide_adamw_step_checked_(pg, gg, mg, vg, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, fg) == 0;
    }
    if (ok) {
        size_t len = strlen(detail);
        snprintf(detail + len, dn - len, "%s%s n %lld:", len ? " | " : "", dn_, (long long)n);
        int a = check_pair("adamw", "param", p, pg, tol, tol, detail, dn);
        int b = check_pair("adamw", "m", m, mg, tol, tol, detail, dn);
        int c = check_pair("adamw", "v", v, vg, tol, tol, detail, dn);
        int clean = tide_item(fc) == 0 && tide_item(fg) == 0;
        tide_tensor *lc = tide_slice(g, 0, n - 1, n, 1), *lg = tide_slice(gg, 0, n - 1, n, 1);
        ok = lc && lg && tide_fill_(lc, NAN) == 0 && tide_fill_(lg, NAN) == 0 &&
             tide_adamw_step_checked_(p, g, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, 3, fc) == 0 &&
             tide_adamw_step_checked_(pg, gg, mg, vg, 1e-2, 0.9, 0.95, 1e-8, 0.1, 3, fg) == 0;
        int nan_flag = ok && tide_item(fc) == 1 && tide_item(fg) == 1;
        tide_tensor_release(lc), tide_tensor_release(lg);
        int huge_flag = 1;
        if (ok && dt == TIDE_F32) {   /* fresh weights, finite gradients: only the stored weights overflow */
            tide_fill_(fc, 0), tide_fill_(fg, 0), tide_fill_(p, 1.0), tide_fill_(pg, 1.0);
            tide_fill_(g, 0.5), tide_fill_(gg, 0.5);
            tide_fill_(m, 0), tide_fill_(mg, 0), tide_fill_(v, 0), tide_fill_(vg, 0);
            ok = tide_adamw_step_checked_(p, g, m, v, 1e300, 0.9, 0.95, 1e-8, 0.0, 4, fc) == 0 &&
                 tide_adamw_step_checked_(pg, gg, mg, vg, 1e300, 0.9, 0.95, 1e-8, 0.0, 4, fg) == 0;
            huge_flag = ok && tide_item(fc) == 1 && tide_item(fg) == 1;
        }
        if (!clean || !nan_flag || !huge_flag) {
            len = strlen(detail);
            snprintf(detail + len, dn - len, " flags: clean %d, nan %d, lr 1e300 %d", clean, nan_flag, huge_flag);
        }
        ok = ok && a && b && c && clean && nan_flag && huge_flag;
    }
    if (!ok && !strstr(detail, "flags") && !strstr(detail, "abs")) {
        size_t len = strlen(detail);
        snprintf(detail + len, dn - len, " error: %s", tide_last_error());
    }
    tide_tensor *all[10] = {p, g, m, v, pg, gg, mg, vg, fc, fg};
    for (int i = 0; i < 10; i++) tide_tensor_release(all[i]);
    return ok;
}

static int test_adamw(void)
{
    char detail[512] = "";
    int ok = adamw_case(TIDE_F32, 257, detail, sizeof detail);
    ok = adamw_case(TIDE_F32, 140001, detail, sizeof detail) && ok;
    ok = adamw_case(TIDE_BF16, 70001, detail, sizeof detail) && ok;
    ok = adamw_case(TIDE_F64, 1031, detail, sizeof detail) && ok;
    return report("adamw step x3", ok, detail);
}

/* a target outside [0, V) must be an error on the GPU too, not a silent read */
static int test_bad_target(void)
{
    int64_t sl[2] = {3, 5}, st[1] = {3};
    double tv[3] = {1, 7, 2};
    tide_tensor *l = tide_randn(TIDE_F32, 2, sl, GPU, 0.0, 1.0);
    tide_tensor *tc = tide_from_f64(TIDE_I64, 1, st, CPU, tv);
    tide_tensor *t = tc ? tide_to_device(tc, GPU) : NULL;
    tide_tensor *out = (l && t) ? tide_cross_entropy(l, t, NULL, -100, 0) : NULL;
    int ok = out && host_read_fails(out) && strstr(tide_last_error(), "target 7 at row 1") != NULL;
    char detail[256];
    snprintf(detail, sizeof detail, "error: %s", tide_last_error());
    tide_clear_error();
    tide_tensor_release(l);
    tide_tensor_release(tc);
    tide_tensor_release(t);
    tide_tensor_release(out);
    return report("cross_entropy bad target -> error", ok, detail);
}

static int test_tlp_bad_target(void)
{
    int64_t sl[2] = {3, 5}, st[1] = {3};
    double tv[3] = {1, 7, 2};
    tide_tensor *l = tide_randn(TIDE_F32, 2, sl, GPU, 0.0, 1.0);
    tide_tensor *tc = tide_from_f64(TIDE_I32, 1, st, CPU, tv);
    tide_tensor *t = tc ? tide_to_device(tc, GPU) : NULL, *lp = NULL, *h = NULL;
    int rc = (l && t) ? tide_token_logprobs(l, t, -100, &lp, &h) : -1;
    int ok = !rc && host_read_fails(lp) && strstr(tide_last_error(), "target 7 at row 1") != NULL;
    char detail[256];
    snprintf(detail, sizeof detail, "error: %s", tide_last_error());
    tide_clear_error();
    tide_tensor_release(l);
    tide_tensor_release(tc);
    tide_tensor_release(t);
    tide_tensor_release(lp);
    tide_tensor_release(h);
    return report("token_logprobs bad target -> error", ok, detail);
}

/* an expert id outside [0, n) is an error on the GPU too, found on the device (the kernels leave it unrouted): with
   gradients (the grouped path) and under no_grad (the path without a host sync); the run after it works again */
static int test_moe_bad_id(void)
{
    int64_t sx[2] = {4, 6}, ss[2] = {4, 2}, sgu[3] = {3, 8, 6}, sd[3] = {3, 5, 4};
    double sv[8] = {0, 1, 2, 1, 0, 3, 2, 2};   /* id 3 at position 5, n = 3 */
    tide_tensor *x = tide_randn(TIDE_F32, 2, sx, GPU, 0.0, 1.0), *p = tide_rand(TIDE_F32, 2, ss, GPU, 0.1, 1.0);
    tide_tensor *wgu = tide_randn(TIDE_F32, 3, sgu, GPU, 0.0, 0.3), *wd = tide_randn(TIDE_F32, 3, sd, GPU, 0.0, 0.3);
    tide_tensor *sc = tide_from_f64(TIDE_I64, 2, ss, CPU, sv), *sel = sc ? tide_to_device(sc, GPU) : NULL;
    int ok = x && p && wgu && wd && sel && !tide_set_requires_grad(x, 1);
    char detail[320] = "";
    for (int ng = 0; ng < 2 && ok; ng++) {
        int prev = tide_set_grad_enabled(!ng);
        tide_tensor *o = tide_moe_experts(x, sel, p, wgu, wd, TIDE_MOE_SWIGLU, 4, 25, 0, NULL);
        tide_set_grad_enabled(prev);
        ok = o && host_read_fails(o) && strstr(tide_last_error(), "expert id 3 at position 5, outside [0, 3)") != NULL;
        snprintf(detail, sizeof detail, "%s: %s", ng ? "no_grad" : "grad", tide_last_error());
        tide_clear_error();
        tide_tensor_release(o);
    }
    tide_tensor_release(sc);
    tide_tensor_release(sel);
    sv[5] = 1;
    sc = ok ? tide_from_f64(TIDE_I64, 2, ss, CPU, sv) : NULL;
    sel = sc ? tide_to_device(sc, GPU) : NULL;
    tide_tensor *o = sel ? tide_moe_experts(x, sel, p, wgu, wd, TIDE_MOE_SWIGLU, 4, 25, 0, NULL) : NULL;
    if (ok && !(o && !host_read_fails(o))) { ok = 0; snprintf(detail, sizeof detail, "after it: %s", tide_last_error()); }
    tide_tensor *all[] = {x, p, wgu, wd, sc, sel, o};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    return report("moe_experts bad expert id -> error", ok, detail);
}

/* ---- coverage: every op of the registry -> the cases above that exercise it, or why it has none ------------------
   cases: case names, '|'-separated, each of which must exist in a case table; reason: instead, when the op has no
   case of its own. An op of tide_op_defs without an entry here fails the test, with or without a GPU. */
typedef struct {
    const char *op;
    const char *cases;
    const char *reason;
} op_coverage;

static const op_coverage coverage[] = {
    {"reshape", "reshape [3,4,5] -> [5,12]", NULL},
    {"permute", "permute [3,4,5] (2,0,1)|contiguous(transpose 0,2)", NULL},
    {"slice", "slice dim 1 [1:8:2]", NULL},
    {"contiguous", "contiguous(transpose 0,2)", NULL},
    {"expand", "expand [3,1,5] -> [3,4,5]", NULL},
    {"concat", "concat dim 1 of 3", NULL},
    {"split", "split dim 2 into 2 and 3, second", NULL},
    {"index_select", "index_select dim 1", NULL},
    {"gather", "gather dim 1", NULL},
    {"scatter_add", "scatter_add dim 1", NULL},
    {"to_dtype", "f32 -> bf16 -> f32|silu bf16|matmul bf16 linear", NULL},
    {"to_device", NULL, "every case copies its inputs to cuda:0 and its results back to the cpu"},
    {"add", "add [2,3,5]+[3,1]|add bf16", NULL},
    {"sub", "sub [4,1]-[1,5]", NULL},
    {"mul", "mul [2,3,5]*[5]|mul same shape", NULL},
    {"div", "div [2,3,5]/[2,1,5]", NULL},
    {"add_scalar", "add_scalar", NULL},
    {"mul_scalar", "mul_scalar", NULL},
    {"pow_scalar", "pow_scalar 1.7|pow_scalar 2", NULL},
    {"neg", "neg", NULL},
    {"exp", "exp", NULL},
    {"log", "log", NULL},
    {"sqrt", "sqrt", NULL},
    {"rsqrt", "rsqrt", NULL},
    {"tanh", "tanh", NULL},
    {"sigmoid", "sigmoid", NULL},
    {"silu", "silu|silu bf16", NULL},
    {"gelu", "gelu", NULL},
    {"gelu_erf", "gelu_erf|gelu_erf bf16", NULL},
    {"softplus", "softplus", NULL},
    {"relu", "relu", NULL},
    {"abs", "abs", NULL},
    {"swiglu", "swiglu|swiglu bf16", NULL},
    {"sum", "sum all|sum dim 1|sum dims 0,2 keepdim|sum last [3,100000]|sum all [300000]|sum dim 1 [2,20000,7]", NULL},
    {"mean", "mean dim 2", NULL},
    {"max", "max dim 1|max last keepdim [5,3000]", NULL},
    {"argmax", "argmax dim 2|argmax dim 0 keepdim", NULL},
    {"logsumexp", "logsumexp dim 0|logsumexp last [3,50000]", NULL},
    {"matmul", "matmul|matmul ta|matmul tb|matmul ta tb|matmul batched|matmul bf16 [64,128]x[128,96]", NULL},
    {"linear", "linear bias|linear no bias [64,128]|linear bf16 bias", NULL},
    {"embedding", "embedding i64 ids|embedding i32 ids [2,9]", NULL},
    {"rmsnorm", "rmsnorm|rmsnorm [37,1000]|rmsnorm bf16", NULL},
    {"layernorm", "layernorm|layernorm [37,1000]", NULL},
    {"softmax", "softmax|softmax dim 0|softmax [3,5000]|softmax bf16", NULL},
    {"log_softmax", "log_softmax", NULL},
    {"cross_entropy", "cross_entropy mean, ignore|cross_entropy weights sum|cross_entropy [16,3000]|cross_entropy bf16|"
                      "cross_entropy bad target -> error", NULL},
    {"token_logprobs", "token_logprobs [4,5,300] logp + entropy|token_logprobs [16,3000]|token_logprobs bf16 [8,500]|"
                       "token_logprobs bad target -> error", NULL},
    {"rope", "rope|rope pos0 1e6", NULL},
    {"rope2d", "rope2d [37,3,72] i64 pos|rope2d [20,4,16] i32 pos|rope2d bf16 [37,3,72]", NULL},
    {"pos_interp", "pos_interp [8,8,40] to 13x5, 8x8, 1x1, 3x17|pos_interp [16,16,96] to 64x48, 5x70|pos_interp bf16", NULL},
    {"attention", "attention f32 causal [2,3,77,64]|attention f32 not causal, Tq 20 < Tk 83|"
                  "attention f32 causal, Tq 20 < Tk 83|attention f32 not causal, Tq 50 > Tk 9, D 40|"
                  "attention bf16 causal [2,3,77,64]|attention bf16 not causal, Tq 20 < Tk 83", NULL},
    {"kda", "kda chunk f32 64, docs, s0|kda chunk_safe f32 softplus gate|kda recurrent f32, docs, s0|"
            "kda chunk bf16 64 (tensor cores)|kda chunk: g < lb -> error", NULL},
    {"kda_decode_rows", "kda_decode_rows f32 R 5 H 3 dk dv 64|kda_decode_rows f32 R 2 H 2 dk 128 dv 200 (dv > threads)|"
                        "kda_decode_rows bf16 R 4 H 2 dk dv 128", NULL},
    {"kda_gate", "kda_gate bounded|kda_gate softplus [H, D] bias|kda_gate bounded bf16", NULL},
    {"causal_conv1d", "causal_conv1d cache, docs, silu|causal_conv1d plain [3,40,96]|causal_conv1d bf16", NULL},
    {"conv_decode_rows", "conv_decode_rows f32 R 7 C 96 K 4|conv_decode_rows f32 R 3 C 5 K 1 (no history)|"
                         "conv_decode_rows bf16 R 4 C 128 K 4", NULL},
    {"l2norm", "l2norm|l2norm [37,128]|l2norm bf16", NULL},
    {"mla_attention", "mla f32 K3 dims, docs|mla f32 decode Tq 1, Tk 45|mla bf16 K3 dims, docs", NULL},
    {"kda_pairs", NULL, "the kda kernels on [v | 0] from [0 | I] (the cases kda ...), with no kernel of its own; "
                        "the CPU op is held bitwise to kda on the widened inputs by test_cp"},
    {"mla_latent_attention", "mla_latent f32 K3 dims, CP slice Tq 40 < Tk 100, docs, chunk 32|"
                             "mla_latent f32 tiny dims, T 77, docs, chunk 7|mla_latent f32 dr 0 (k_r NULL), chunk 1|"
                             "mla_latent f32 one chunk > Tk, CP slice Tq 20 < Tk 83, docs|"
                             "mla_latent bf16 K3 dims, CP slice Tq 40 < Tk 100, docs, chunk 32|"
                             "mla_latent bf16 tiny dims, T 77, docs, chunk 7|"
                             "mla_latent bf16 dr 0 (k_r NULL), Tq 50 < Tk 150, chunk 64|"
                             "mla_latent memory K3, Tq 8K < Tk 128K", NULL},
    {"mla_decode_rows", "mla_decode_rows f32 dr 32, lens 0 63 64 300|mla_decode_rows f32 dr 0, lens 5 127 1000|"
                        "mla_decode_rows f64 dr 32, lens 0 200 129|mla_decode_rows f64 dr 0, dc 512, lens 2000 7|"
                        "mla_decode_rows bf16 dr 64, lens 0 64 500|"
                        "mla_decode_rows appended f32 dr 16, one buffer, lens 40 41 42 43|"
                        "mla_decode_rows appended f64 dr 0, one buffer, lens 0 1 2", NULL},
    {"varlen_attention", "varlen f32 D 72, images 1, 70, 129|varlen f32 D 16, 4 images (one empty)|"
                         "varlen f32 D 64, one image of 300|varlen bf16 D 72, images 1, 70, 129|"
                         "varlen bf16 D 64, 3 images", NULL},
    {"attnres", "attnres f32 5 sources [2,37,96]|attnres f32 9 sources d 7168|attnres bf16 9 sources d 7168", NULL},
    {"situ_glu", "situ_glu|situ_glu bf16", NULL},
    {"topk", "topk 5 of 33 (values, gradient scatter)", NULL},
    {"moe_experts", "moe_experts f32 m 37 n 8 k 2 d 48/32/40|moe_experts bf16 m 37 n 8 k 2 d 48/32/40|"
                    "moe_experts f32 m 700 n 300 k 2 d 16/8/24", NULL},
    {"alltoallv", NULL, "a collective, no kernel: the exchange is the backend's dist_alltoallv entry (NCCL), tested by "
                        "gpu-test-nccl; one rank copies"},
};

/* the checks that report under their own name (see report() calls above) */
static const char *const extra_names[] = {
    "randn / rand (same seed)", "copy_/fill_ into strided views", "sum_squares / all_finite / axpy_",
    "first_nonfinite (fused)", "kda chunk: g < lb -> error", "adamw step x3", "cross_entropy bad target -> error",
    "token_logprobs bad target -> error", "mla_latent memory K3, Tq 8K < Tk 128K",
};

#define NAMES_IN(table, field, want, len)                                                                  \
    for (size_t i_ = 0; i_ < sizeof table / sizeof table[0]; i_++)                                        \
        if (strlen(table[i_] field) == (len) && !strncmp(table[i_] field, (want), (len))) return 1;

static int case_exists(const char *want, size_t len)
{
    NAMES_IN(cases, .name, want, len)
    NAMES_IN(kda_cases, .name, want, len)
    NAMES_IN(mla_cases, .name, want, len)
    NAMES_IN(mla_latent_cases, .name, want, len)
    NAMES_IN(decode_cases, .name, want, len)
    NAMES_IN(kdec_cases, .name, want, len)
    NAMES_IN(cdec_cases, .name, want, len)
    NAMES_IN(varlen_cases, .name, want, len)
    NAMES_IN(attention_cases, .name, want, len)
    NAMES_IN(attnres_cases, .name, want, len)
    NAMES_IN(extra_names, , want, len)
    for (size_t i = 0; i < sizeof moe_cases / sizeof moe_cases[0]; i++) {
        char name[160];
        moe_case_name(&moe_cases[i], name, sizeof name);
        if (strlen(name) == len && !strncmp(name, want, len)) return 1;
    }
    return 0;
}

/* the number of problems: registry ops without an entry, entries naming unknown cases or no registry op */
static int check_coverage(void)
{
    int problems = 0, with_cases = 0, with_reason = 0;
    for (int id = 0; id < TIDE_OP_COUNT; id++) {
        const char *op = tide_op_defs[id].name;
        if (!op) {
            printf("parity coverage: FAIL registry id %d has no entry in tide_op_defs\n", id);
            problems++;
            continue;
        }
        const op_coverage *cv = NULL;
        for (size_t i = 0; i < sizeof coverage / sizeof coverage[0]; i++)
            if (!strcmp(coverage[i].op, op)) cv = &coverage[i];
        if (!cv || (!cv->cases && !cv->reason)) {
            printf("parity coverage: FAIL op '%s' (registry id %d) has no parity case and no reason in the coverage "
                   "table of tests/gpu/test_parity.c\n", op, id);
            problems++;
            continue;
        }
        if (!cv->cases) {
            with_reason++;
            continue;
        }
        with_cases++;
        for (const char *c = cv->cases; *c;) {
            size_t len = strcspn(c, "|");
            if (!case_exists(c, len)) {
                printf("parity coverage: FAIL op '%s' lists the case '%.*s', which no case table holds\n", op, (int)len, c);
                problems++;
            }
            c += len + (c[len] == '|');
        }
    }
    for (size_t i = 0; i < sizeof coverage / sizeof coverage[0]; i++) {
        int found = 0;
        for (int id = 0; id < TIDE_OP_COUNT; id++) found = found || (tide_op_defs[id].name && !strcmp(tide_op_defs[id].name, coverage[i].op));
        if (!found) {
            printf("parity coverage: FAIL the coverage entry '%s' names no op of the registry\n", coverage[i].op);
            problems++;
        }
    }
    printf("parity coverage: %d registry ops, %d with parity cases, %d with a reason, %d problems\n", (int)TIDE_OP_COUNT,
           with_cases, with_reason, problems);
    return problems;
}

/* ---- deterministic scatter gradients (index.cu): the embedding backward (index_add) and the top-k backward
   (scatter_add) run twice on the GPU from the same inputs must give the same bits, and in f32 the CPU's bits (both
   add in index order); bf16 embedding gradients within one bf16 step of the CPU's f32 sums. Ids repeat heavily
   (three hot rows take three quarters of 16K tokens), where float atomics would reorder and, in bf16, lose adds. */
static tide_tensor *emb_grad(tide_tensor *w, tide_tensor *ids, tide_tensor *r, char *detail, size_t dn)
{
    tide_tensor *wl = tide_detach(w);
    if (!wl || tide_set_requires_grad(wl, 1)) { tide_tensor_release(wl); return NULL; }
    tide_tensor *e = tide_embedding(wl, ids), *l = e ? weighted_sum(e, r) : NULL, *g = NULL;
    if (l && !tide_backward(l, NULL)) g = tide_grad(wl);
    if (!g) snprintf(detail, dn, "embedding backward on %s: %s", w->device ? "gpu" : "cpu", tide_last_error());
    tide_tensor_release(e);
    tide_tensor_release(l);
    tide_tensor_release(wl);
    return g;
}

static tide_tensor *topk_grad(tide_tensor *x, tide_tensor *r, char *detail, size_t dn)
{
    tide_tensor *xl = tide_detach(x), *v = NULL, *id = NULL, *l = NULL, *g = NULL;
    if (xl && !tide_set_requires_grad(xl, 1) && !tide_topk(xl, 8, &v, &id)) l = weighted_sum(v, r);
    if (l && !tide_backward(l, NULL)) g = tide_grad(xl);
    if (!g) snprintf(detail, dn, "topk backward on %s: %s", x->device ? "gpu" : "cpu", tide_last_error());
    tide_tensor *all[] = {xl, v, id, l};
    for (size_t i = 0; i < 4; i++) tide_tensor_release(all[i]);
    return g;
}

static int same_bits(tide_tensor *a, tide_tensor *b)
{
    if (!a || !b || a->numel != b->numel) return 0;
    double *x = malloc((size_t)a->numel * sizeof *x), *y = malloc((size_t)b->numel * sizeof *y);
    int ok = x && y && !tide_to_f64_buffer(a, x, a->numel) && !tide_to_f64_buffer(b, y, b->numel) &&
             !memcmp(x, y, (size_t)a->numel * sizeof *x);
    free(x);
    free(y);
    return ok;
}

static int test_scatter_determinism(void)
{
    enum { V = 1000, D = 192, N = 16384, ROWS = 2048, E = 64 };
    char detail[256] = "";
    double *ids = malloc((size_t)N * sizeof *ids);
    if (!ids) return report("scatter determinism", 0, "out of memory");
    for (int i = 0; i < N; i++) ids[i] = uniform01() < 0.75 ? (double)(next_rand() % 3) : (double)(next_rand() % V);
    int64_t ws[2] = {V, D}, is[1] = {N}, rs[2] = {N, D}, xs[2] = {ROWS, E}, ks[2] = {ROWS, 8};
    tide_tensor *wc = tide_randn(TIDE_F32, 2, ws, CPU, 0.0, 1.0), *ic = tide_from_f64(TIDE_I64, 1, is, CPU, ids);
    tide_tensor *rc = tide_randn(TIDE_F32, 2, rs, CPU, 0.0, 1.0), *xc = tide_randn(TIDE_F32, 2, xs, CPU, 0.0, 1.0);
    tide_tensor *kc = tide_randn(TIDE_F32, 2, ks, CPU, 0.0, 1.0);
    free(ids);
    tide_tensor *wg = wc ? tide_to_device(wc, GPU) : NULL, *ig = ic ? tide_to_device(ic, GPU) : NULL;
    tide_tensor *rg = rc ? tide_to_device(rc, GPU) : NULL, *xg = xc ? tide_to_device(xc, GPU) : NULL;
    tide_tensor *kg = kc ? tide_to_device(kc, GPU) : NULL;
    tide_tensor *w16 = wg ? tide_to_dtype(wg, TIDE_BF16) : NULL, *r16 = rg ? tide_to_dtype(rg, TIDE_BF16) : NULL;
    int ok = wg && ig && rg && xg && kg && w16 && r16;
    if (!ok) snprintf(detail, sizeof detail, "setup: %s", tide_last_error());
    tide_tensor *ec = ok ? emb_grad(wc, ic, rc, detail, sizeof detail) : NULL;
    tide_tensor *e1 = ec ? emb_grad(wg, ig, rg, detail, sizeof detail) : NULL;
    tide_tensor *e2 = e1 ? emb_grad(wg, ig, rg, detail, sizeof detail) : NULL;
    tide_tensor *b1 = e2 ? emb_grad(w16, ig, r16, detail, sizeof detail) : NULL;
    tide_tensor *b2 = b1 ? emb_grad(w16, ig, r16, detail, sizeof detail) : NULL;
    tide_tensor *tc = b2 ? topk_grad(xc, kc, detail, sizeof detail) : NULL;
    tide_tensor *t1 = tc ? topk_grad(xg, kg, detail, sizeof detail) : NULL;
    tide_tensor *t2 = t1 ? topk_grad(xg, kg, detail, sizeof detail) : NULL;
    int pass = t2 != NULL;
    if (pass) {
        int a = same_bits(e1, e2), b = same_bits(e1, ec), c = same_bits(b1, b2), d = same_bits(t1, t2), e = same_bits(t1, tc);
        tide_tensor *b32 = tide_to_dtype(b1, TIDE_F32);
        int f = b32 && check_scaled("embedding backward bf16", "dw", ec, b32, 1.0 / 128, detail, sizeof detail);
        tide_tensor_release(b32);
        pass = a && b && c && d && e && f;
        if (!pass && !detail[0])
            snprintf(detail, sizeof detail, "embedding f32 twice %s, = cpu %s; bf16 twice %s; topk twice %s, = cpu %s",
                     a ? "same" : "DIFFER", b ? "yes" : "NO", c ? "same" : "DIFFER", d ? "same" : "DIFFER", e ? "yes" : "NO");
    }
    tide_tensor *all[] = {wc, ic, rc, xc, kc, wg, ig, rg, xg, kg, w16, r16, ec, e1, e2, b1, b2, tc, t1, t2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    return report("scatter gradients deterministic", pass, detail);
}

/* ---- KDA backward memory at K3 (bench/results/kda_cuda_memory.md): one layer, H 96, dk = dv 128, bf16, T 64K,
   forward + backward on the GPU alone. What the backward adds to the device's peak beyond the gradients it returns
   must be within the checkpointed backward's scratch (390 MiB at these shapes; the forward's 384 MiB of checkpoints
   are already held) plus, where the 96 (segment, head) blocks do not fill the device, the column split's partial
   sums (launch.h tide_kda_vsplit: 2 splits on up to 192 SMs, 289 MiB) and the pre-pass's chunk matrices (18 MiB), far
   below the 24 GiB the every-state backward needed. The peak is printed for the record. */
static int test_kda_memory(void)
{
    const int64_t T = 65536, H = 96, dk = 128;   /* dv = dk */
    int64_t sk[4] = {1, T, H, dk}, sb[3] = {1, T, H};
    char detail[256] = "";
    tide_tensor *in[5] = {0}, *o = NULL, *st = NULL, *r = NULL, *l = NULL;
    int ok = 1;
    for (int i = 0; ok && i < 5; i++) {
        tide_tensor *f = i == 4 ? tide_rand(TIDE_F32, 3, sb, GPU, 0.1, 0.9)
                        : i == 3 ? tide_rand(TIDE_F32, 4, sk, GPU, -0.5, -0.01)
                                 : tide_randn(TIDE_F32, 4, sk, GPU, 0.0, i == 2 ? 1.0 : 0.05);
        tide_tensor *t = f ? tide_to_dtype(f, TIDE_BF16) : NULL;
        tide_tensor_release(f);
        in[i] = t;
        ok = t && !tide_set_requires_grad(t, 1);
    }
    if (ok) ok = !tide_kda(in[0], in[1], in[2], in[3], in[4], NULL, NULL, TIDE_KDA_CHUNK, 16, -5.0, &o, &st);
    tide_tensor *r32 = ok ? tide_randn(TIDE_F32, 4, o->shape, GPU, 0.0, 1.0) : NULL;
    r = r32 ? tide_to_dtype(r32, TIDE_BF16) : NULL;
    tide_tensor_release(r32);
    l = r ? weighted_sum(o, r) : NULL;
    tide_memory_stats m0, m1;
    ok = l && !tide_memory_stats_get(GPU, &m0);
    tide_memory_reset_peak(GPU);
    if (ok) ok = !tide_backward(l, NULL) && !tide_memory_stats_get(GPU, &m1);
    if (!ok) snprintf(detail, sizeof detail, "%s", tide_last_error());
    int pass = ok;
    if (ok) {
        double grads = 4.0 * (double)(T * H * dk) * 2 + (double)(T * H) * 2;   /* dq dk dv dg (dk = dv) and dβ */
        /* 2 splits x 64 chunks of 16 rows x H x (3 dk + 1) floats, and the pre-pass's Af, P, M of 64 chunks */
        double part = 2.0 * 64 * 16 * (double)H * (3 * dk + 1) * 4 + 64.0 * (double)H * 3 * 256 * 4;
        double extra = (double)(m1.peak - m0.current) - grads, scratch = 390.0 * 1048576 + part;
        double old = 24.0 * 1073741824;
        pass = extra <= 1.25 * scratch + 64.0 * 1048576;
        snprintf(detail, sizeof detail, "peak %.2f GiB; the backward's own +%.0f MiB beyond its gradients (scratch "
                 "formula 390 MiB + %.0f MiB of split partials and pre-pass at most; every state was 24 GiB = %.0fx more)",
                 (double)m1.peak / 1073741824, extra / 1048576, part / 1048576, old / (extra > 1 ? extra : 1));
    }
    tide_tensor *all[] = {in[0], in[1], in[2], in[3], in[4], o, st, r, l};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    return report("kda backward memory K3 T 64K", pass, detail);
}

int main(void)
{
    /* before the GPU check: an op without a parity case fails on every machine */
    int uncovered = check_coverage();
    if (!tide_cuda_available()) {
        printf("gpu parity: skipped (no CUDA device: %s)\n", tide_cuda_info());
        return uncovered ? 1 : 77;
    }
    printf("gpu parity: %s\n", tide_cuda_info());
    tide_manual_seed(1234);
    int passed = uncovered ? 0 : 1, failed = uncovered ? 1 : 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (run_case(&cases[i])) passed++;
        else failed++;
    }
    int (*const extra[])(void) = {test_random, test_guard, test_vector_helpers, test_first_nonfinite_gpu, test_adamw,
                                  test_bad_target, test_tlp_bad_target, test_moe_bad_id, test_kda, test_kda_bound, test_kdec, test_cdec, test_attnres, test_mla, test_mla_latent, test_decode,
                                  test_varlen, test_attention, test_moe, test_scatter_determinism, test_kda_memory,
                                  test_mla_latent_memory};
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++) {
        if (extra[i]()) passed++;
        else failed++;
    }
    /* every case released what it made, on both devices */
    char detail[64];
    snprintf(detail, sizeof detail, "%lld live tensors", (long long)tide_live_tensors());
    if (report("no tensors leaked", tide_live_tensors() == 0, detail)) passed++;
    else failed++;
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}

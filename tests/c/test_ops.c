/*
 * test-ops — every op in the registry, on the CPU:
 *   1. float64 gradient check by central differences for every differentiable input (DESIGN.md §5);
 *   2. the float32 forward agrees with the float64 forward (the fast f32 kernels are consistent);
 *   3. where a fast kernel exists (BLAS GEMM, fused norms, softmax, cross-entropy, attention) the output
 *      equals a slow reference written here with plain loops.
 *   4. no kernel writes outside its buffers: the allocator's guard mode puts sentinel bytes before and after every
 *      block (inputs, outputs, saved tensors, gradients) and a case fails when a block it released had one
 *      changed; the run first shows that a kernel writing one element too many is caught.
 * Coverage is enforced: an op id without a case fails the run, so a new op cannot slip in untested.
 * Tolerances: gradient |num - ana| <= 1e-7 + 1e-6 |ana| (f64, eps 1e-6: truncation ~1e-12, rounding
 * ~1e-10); f32 vs f64 forward <= 2e-4 (1 + |y|); reference vs fast f64 <= 1e-10 (1 + |y|).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "../../kernels/cpu/cpu.h"
#include "testutil.h"

static int g_pass, g_fail;
#define FAIL(...) do { printf("  FAIL "); printf(__VA_ARGS__); printf("\n"); g_fail++; } while (0)

/* ---- tensor helpers ------------------------------------------------------------------------------------------ */
static tide_tensor *T(int ndim, const int64_t *shape, double lo, double hi)
{
    tide_tensor *t = lo == hi ? tide_randn(TIDE_F64, ndim, shape, 0, 0.0, 1.0) : tide_rand(TIDE_F64, ndim, shape, 0, lo, hi);
    tide_set_requires_grad(t, 1);
    return t;
}
#define SHAPE(...) (int64_t[]){__VA_ARGS__}
#define NDIM(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t))
#define RANDN(...) T(NDIM(__VA_ARGS__), SHAPE(__VA_ARGS__), 0, 0)
#define RANDU(lo, hi, ...) T(NDIM(__VA_ARGS__), SHAPE(__VA_ARGS__), lo, hi)

static tide_tensor *ints(int dtype, int ndim, const int64_t *shape, int64_t hi, int64_t special_at, int64_t special)
{
    int64_t n = tide_shape_numel(ndim, shape);
    double *v = malloc((size_t)n * sizeof *v), *u = malloc((size_t)n * sizeof *u);
    tide_philox_uniform(99, (uint64_t)n * 7, u, n);
    for (int64_t i = 0; i < n; i++) v[i] = (double)(int64_t)(u[i] * (double)hi);
    if (special_at >= 0 && special_at < n) v[special_at] = (double)special;
    tide_tensor *t = tide_from_f64(dtype, ndim, shape, 0, v);
    free(v); free(u);
    return t;
}

/* ---- the cases --------------------------------------------------------------------------------------------------- */
typedef struct {
    int op;                        /* the registry id this case covers */
    const char *what;
    int n_in;
    tide_tensor *in[6];
    int no_f32;                    /* skip the f32-vs-f64 comparison */
    tide_tensor *(*run)(tide_tensor **in);
    void (*ref)(tide_tensor **in, double *out);   /* slow reference of the output, or NULL */
} op_case;

/* run functions */
#define RUN(name, expr) static tide_tensor *name(tide_tensor **x) { return expr; }
RUN(r_reshape, tide_reshape(x[0], 3, SHAPE(4, -1, 2)))
static tide_tensor *r_permute(tide_tensor **x) { return tide_permute(x[0], 3, (int[]){2, 0, 1}); }
RUN(r_slice, tide_slice(x[0], 1, 1, 7, 2))
static tide_tensor *r_contig(tide_tensor **x)
{
    tide_tensor *t = tide_transpose(x[0], 0, 1), *c = tide_contiguous(t);
    tide_tensor_release(t);
    return c;
}
RUN(r_expand, tide_expand(x[0], 3, SHAPE(2, 3, 4)))
RUN(r_concat, tide_concat(3, x, 1))
static tide_tensor *r_split(tide_tensor **x)
{
    tide_tensor *o[3];
    if (tide_split(x[0], 1, 3, SHAPE(2, 1, 3), o)) return NULL;
    tide_tensor *pair[2] = {o[2], o[0]};   /* o[1] unused: its gradient must come back as zeros */
    tide_tensor *c = tide_concat(2, pair, 1);
    for (int i = 0; i < 3; i++) tide_tensor_release(o[i]);
    return c;
}
RUN(r_index_select, tide_index_select(x[0], 1, x[1]))
RUN(r_gather, tide_gather(x[0], 1, x[1]))
RUN(r_scatter_add, tide_scatter_add(x[0], 1, x[1], x[2]))
RUN(r_to_dtype, tide_to_dtype(x[0], x[0]->dtype))
RUN(r_to_device, tide_to_device(x[0], 0))
RUN(r_add, tide_add(x[0], x[1]))
RUN(r_sub, tide_sub(x[0], x[1]))
RUN(r_mul, tide_mul(x[0], x[1]))
RUN(r_div, tide_div(x[0], x[1]))
RUN(r_add_scalar, tide_add_scalar(x[0], 0.75))
RUN(r_mul_scalar, tide_mul_scalar(x[0], -1.5))
RUN(r_pow_scalar, tide_pow_scalar(x[0], 2.5))
RUN(r_neg, tide_neg(x[0]))
RUN(r_exp, tide_exp(x[0]))
RUN(r_log, tide_log(x[0]))
RUN(r_sqrt, tide_sqrt(x[0]))
RUN(r_rsqrt, tide_rsqrt(x[0]))
RUN(r_tanh, tide_tanh(x[0]))
RUN(r_sigmoid, tide_sigmoid(x[0]))
RUN(r_silu, tide_silu(x[0]))
RUN(r_gelu, tide_gelu(x[0]))
RUN(r_gelu_erf, tide_gelu_erf(x[0]))
RUN(r_softplus, tide_softplus(x[0]))
RUN(r_relu, tide_relu(x[0]))
RUN(r_abs, tide_abs(x[0]))
RUN(r_swiglu, tide_swiglu(x[0], x[1]))
RUN(r_sum, tide_sum(x[0], 2, (int[]){0, 2}, 0))
RUN(r_sum_all, tide_sum(x[0], 0, NULL, 1))
RUN(r_mean, tide_mean(x[0], 1, (int[]){-1}, 1))
RUN(r_max, tide_max(x[0], 1, 0))
RUN(r_argmax, tide_argmax(x[0], -1, 0))
RUN(r_logsumexp, tide_logsumexp(x[0], 1, 1))
RUN(r_matmul, tide_matmul(x[0], x[1], 0, 0))
RUN(r_matmul_tb, tide_matmul(x[0], x[1], 0, 1))
RUN(r_matmul_ta, tide_matmul(x[0], x[1], 1, 0))
RUN(r_matmul_tt, tide_matmul(x[0], x[1], 1, 1))
RUN(r_matmul_bshared, tide_matmul(x[0], x[1], 1, 0))
RUN(r_linear, tide_linear(x[0], x[1], x[2]))
RUN(r_linear_nob, tide_linear(x[0], x[1], NULL))
RUN(r_embedding, tide_embedding(x[0], x[1]))
RUN(r_rmsnorm, tide_rmsnorm(x[0], x[1], 1e-5))
RUN(r_layernorm, tide_layernorm(x[0], x[1], x[2], 1e-5))
RUN(r_layernorm_nob, tide_layernorm(x[0], x[1], NULL, 1e-5))
RUN(r_softmax, tide_softmax(x[0], -1))
RUN(r_softmax_d0, tide_softmax(x[0], 0))
RUN(r_log_softmax, tide_log_softmax(x[0], 1))
RUN(r_ce_mean, tide_cross_entropy(x[0], x[1], x[2], -100, 0))
RUN(r_ce_sum, tide_cross_entropy(x[0], x[1], NULL, -100, 1))
RUN(r_ce_none, tide_cross_entropy(x[0], x[1], NULL, 2, 2))
/* token_logprobs: both outputs in one vector (logp, then entropy) so the gradient check covers both; or one of them,
   so the other's gradient is the zeros autograd supplies */
static tide_tensor *tlp_run(tide_tensor **x, int64_t ignore, int which)
{
    tide_tensor *lp, *h;
    if (tide_token_logprobs(x[0], x[1], ignore, &lp, &h)) return NULL;
    if (which == 1) { tide_tensor_release(h); return lp; }
    if (which == 2) { tide_tensor_release(lp); return h; }
    tide_tensor *flp = tide_reshape(lp, 1, SHAPE(-1)), *fh = tide_reshape(h, 1, SHAPE(-1));
    tide_tensor *pair[2] = {flp, fh}, *y = tide_concat(2, pair, 0);
    tide_tensor_release(lp); tide_tensor_release(h); tide_tensor_release(flp); tide_tensor_release(fh);
    return y;
}
static tide_tensor *r_tlp_both(tide_tensor **x) { return tlp_run(x, -100, 0); }
static tide_tensor *r_tlp_logp(tide_tensor **x) { return tlp_run(x, 3, 1); }
static tide_tensor *r_tlp_entropy(tide_tensor **x) { return tlp_run(x, -100, 2); }
RUN(r_rope, tide_rope(x[0], 10000.0, 3))
RUN(r_rope2d, tide_rope2d(x[0], x[1], 100.0))
RUN(r_pos_interp, tide_pos_interp(x[0], x[1]))
RUN(r_attn_causal, tide_attention(x[0], x[1], x[2], 1, 0.5))
RUN(r_attn_full, tide_attention(x[0], x[1], x[2], 0, 0.4))

/* kda: both outputs in one vector so the gradient check covers o and the final state */
static tide_tensor *kda_run(tide_tensor **x, int has_s0, int path, int chunk, const int64_t *cu, int n_cu)
{
    tide_tensor *o, *s, *cut = NULL;
    if (cu) {
        double v[8];
        for (int i = 0; i < n_cu; i++) v[i] = (double)cu[i];
        cut = tide_from_f64(TIDE_I64, 1, (int64_t[]){n_cu}, 0, v);
    }
    int rc = tide_kda(x[0], x[1], x[2], x[3], x[4], has_s0 ? x[5] : NULL, cut, path, chunk, -5.0, &o, &s);
    tide_tensor_release(cut);
    if (rc) return NULL;
    tide_tensor *fo = tide_reshape(o, 1, SHAPE(-1)), *fs = tide_reshape(s, 1, SHAPE(-1));
    tide_tensor *pair[2] = {fo, fs}, *y = tide_concat(2, pair, 0);
    tide_tensor_release(o); tide_tensor_release(s); tide_tensor_release(fo); tide_tensor_release(fs);
    return y;
}
static tide_tensor *r_kda_chunk(tide_tensor **x) { return kda_run(x, 1, TIDE_KDA_CHUNK, 4, NULL, 0); }
static tide_tensor *r_kda_packed(tide_tensor **x)
{
    static const int64_t cu[4] = {0, 3, 12, 18};   /* B = 2, T = 9: documents [0,3) [3,9) | [9,12) [12,18) */
    return kda_run(x, 1, TIDE_KDA_CHUNK, 4, cu, 4);
}
static tide_tensor *r_kda_safe(tide_tensor **x) { return kda_run(x, 0, TIDE_KDA_CHUNK_SAFE, 3, NULL, 0); }
static tide_tensor *r_kda_rec(tide_tensor **x) { return kda_run(x, 1, TIDE_KDA_RECURRENT, 0, NULL, 0); }
/* kda_pairs: each row's (h_ext | M); packed documents (the last row's first document crosses a chunk edge) */
static tide_tensor *r_kda_pairs(tide_tensor **x)
{
    double v[4] = {0, 3, 12, 18};                  /* B = 2, T = 9: documents [0,3) [3,9) | [9,12) [12,18) */
    tide_tensor *cu = tide_from_f64(TIDE_I64, 1, SHAPE(4), 0, v);
    tide_tensor *y = tide_kda_pairs(x[0], x[1], x[2], x[3], x[4], cu, TIDE_KDA_CHUNK_SAFE, 2, 0);
    tide_tensor_release(cu);
    return y;
}
RUN(r_kda_pairs_rec, tide_kda_pairs(x[0], x[1], x[2], x[3], x[4], NULL, TIDE_KDA_RECURRENT, 0, 0))
RUN(r_kda_gate, tide_kda_gate(x[0], x[1], x[2], -5.0, TIDE_KDA_GATE_BOUNDED))
RUN(r_kda_gate_sp, tide_kda_gate(x[0], x[1], x[2], 0.0, TIDE_KDA_GATE_SOFTPLUS))
static tide_tensor *r_conv(tide_tensor **x)
{
    double v[4] = {0, 2, 5, 10};                    /* B = 2, T = 5: documents [0,2) [2,5) | [5,10) */
    tide_tensor *cu = tide_from_f64(TIDE_I32, 1, SHAPE(4), 0, v);
    tide_tensor *y = tide_causal_conv1d(x[0], x[1], x[2], cu, 1);
    tide_tensor_release(cu);
    return y;
}
RUN(r_conv_plain, tide_causal_conv1d(x[0], x[1], NULL, NULL, 0))
RUN(r_l2norm, tide_l2norm(x[0], 1e-6, 0.35))

static tide_tensor *r_mla_packed(tide_tensor **x)
{
    double v[4] = {0, 4, 6, 10};                    /* B = 2, T = 5: documents [0,4) [4,5) | [5,6) [6,10) */
    tide_tensor *cu = tide_from_f64(TIDE_I64, 1, SHAPE(4), 0, v);
    tide_tensor *y = tide_mla_attention(x[0], x[1], x[2], x[3], cu, 0.45);
    tide_tensor_release(cu);
    return y;
}
RUN(r_mla_decode, tide_mla_attention(x[0], x[1], x[2], x[3], NULL, 0.5))
RUN(r_mla_nor, tide_mla_attention(x[0], x[1], NULL, x[2], NULL, 0.6))
/* two rows over their own latent buffers (lengths 2 and 0; the op writes the new latents, the same each run) */
static tide_tensor *r_mla_decode_rows(tide_tensor **x)
{
    tide_tensor *bufs[2] = {x[2], x[3]};
    return tide_mla_decode_rows(x[0], NULL, x[1], NULL, 2, bufs, NULL, (const int64_t[]){2, 0}, 0.5);
}
/* two rows over their own states: q, k, v [2, 2, 3]; g = -sigmoid(k) (a decay); beta = sigmoid(v[..., 0]); the
   states x[3] [2, 2, 3, 3] are cloned (the op advances them in place; every run starts from the same values) */
static void kdec_parts(tide_tensor **x, tide_tensor **g, tide_tensor **beta, tide_tensor **s)
{
    tide_tensor *sg = tide_sigmoid(x[1]);
    *g = tide_neg(sg);
    tide_tensor *v0 = tide_slice(x[2], 2, 0, 1, 1), *v0r = tide_reshape(v0, 2, (int64_t[]){2, 2});
    *beta = tide_sigmoid(v0r);
    tide_tensor *all = tide_contiguous(x[3]), *c = tide_empty(all->dtype, 4, all->shape, all->device);
    tide_copy_(c, all);
    s[0] = tide_slice(c, 0, 0, 1, 1);
    s[1] = tide_slice(c, 0, 1, 2, 1);
    tide_tensor_release(sg); tide_tensor_release(v0); tide_tensor_release(v0r); tide_tensor_release(all);
    tide_tensor_release(c);
}
static tide_tensor *r_kda_decode_rows(tide_tensor **x)
{
    tide_tensor *g, *beta, *s[2];
    kdec_parts(x, &g, &beta, s);
    tide_tensor *y = tide_kda_decode_rows(x[0], x[1], x[2], g, beta, 2, s);
    tide_tensor_release(g); tide_tensor_release(beta); tide_tensor_release(s[0]); tide_tensor_release(s[1]);
    return y;
}
/* the recurrence (kda.md §3) of each row and head from its state, in double */
static void ref_kda_decode_rows(tide_tensor **x, double *out)
{
    double *q = host(x[0]), *k = host(x[1]), *v = host(x[2]), *s0 = host(x[3]);
    for (int r = 0; r < 2; r++)
        for (int h = 0; h < 2; h++) {
            const double *qh = q + (r * 2 + h) * 3, *kh = k + (r * 2 + h) * 3, *vh = v + (r * 2 + h) * 3;
            double S[3][3], b = 1 / (1 + exp(-vh[0]));
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 3; j++) S[i][j] = s0[((r * 2 + h) * 3 + i) * 3 + j] * exp(-1 / (1 + exp(-kh[i])));
            for (int j = 0; j < 3; j++) {
                double e = 0;
                for (int i = 0; i < 3; i++) e += kh[i] * S[i][j];
                double u = b * (vh[j] - e), o = 0;
                for (int i = 0; i < 3; i++) { S[i][j] += kh[i] * u; o += qh[i] * S[i][j]; }
                out[(r * 2 + h) * 3 + j] = o;
            }
        }
    free(q); free(k); free(v); free(s0);
}
/* two rows over their own conv histories: x [2, 1, 3], w [3, 4], the histories x[2] [2, 3, 3] cloned (the op shifts
   them in place; every run starts from the same values) */
static tide_tensor *r_conv_decode_rows(tide_tensor **x)
{
    tide_tensor *all = tide_contiguous(x[2]), *c = tide_empty(all->dtype, 3, all->shape, all->device);
    tide_copy_(c, all);
    tide_tensor *h[2] = {tide_slice(c, 0, 0, 1, 1), tide_slice(c, 0, 1, 2, 1)};
    tide_tensor *y = tide_conv_decode_rows(x[0], x[1], 2, h, 1);
    tide_tensor_release(all); tide_tensor_release(c); tide_tensor_release(h[0]); tide_tensor_release(h[1]);
    return y;
}
/* out[r, c] = silu(Σ_{j<3} w[c, j] h[r, j, c] + w[c, 3] x[r, c]), in double */
static void ref_conv_decode_rows(tide_tensor **x, double *out)
{
    double *xv = host(x[0]), *w = host(x[1]), *h = host(x[2]);
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 3; c++) {
            double a = w[c * 4 + 3] * xv[r * 3 + c];
            for (int j = 0; j < 3; j++) a += w[c * 4 + j] * h[(r * 3 + j) * 3 + c];
            out[r * 3 + c] = a / (1 + exp(-a));
        }
    free(xv); free(w); free(h);
}
static tide_tensor *r_varlen(tide_tensor **x)
{
    double v[4] = {0, 3, 4, 7};                     /* T = 7: images [0,3) [3,4) [4,7), bidirectional inside each */
    tide_tensor *cu = tide_from_f64(TIDE_I32, 1, SHAPE(4), 0, v);
    tide_tensor *y = tide_varlen_attention(x[0], x[1], x[2], cu, 0.45);
    tide_tensor_release(cu);
    return y;
}
/* attnres: the sources, then w and nu */
RUN(r_attnres3, tide_attnres(3, x, x[3], x[4], 1e-5))
RUN(r_attnres1, tide_attnres(1, x, x[1], x[2], 1e-5))
/* sparse MoE (spec/moe.md §6, §2, §8) */
RUN(r_situ, tide_situ_glu(x[0], x[1], 4.0, 25.0))
RUN(r_situ_small, tide_situ_glu(x[0], x[1], 1.5, 2.0))
static tide_tensor *r_topk(tide_tensor **x)
{
    tide_tensor *v, *id;
    if (tide_topk(x[0], 3, &v, &id)) return NULL;
    tide_tensor_release(id);
    return v;
}
RUN(r_moe_situ, tide_moe_experts(x[0], x[1], x[2], x[3], x[4], TIDE_MOE_SITU, 1.5, 2.0, 0.0, NULL))
RUN(r_moe_swiglu_cap, tide_moe_experts(x[0], x[1], x[2], x[3], x[4], TIDE_MOE_SWIGLU, 4.0, 25.0, 0.6, NULL))
/* alltoallv over the world of this one process: every row to itself (the exchange between ranks: tests/dist) */
RUN(r_alltoallv, tide_alltoallv(x[0], 0, 1, (int64_t[]){5}, (int64_t[]){5}))

/* slow references (plain loops on host copies) */
static void ref_matmul_tb(tide_tensor **in, double *out)   /* a [B, M, K], b [N, K] -> [B, M, N] */
{
    double *a = host(in[0]), *b = host(in[1]);
    int64_t B = in[0]->shape[0], M = in[0]->shape[1], K = in[0]->shape[2], N = in[1]->shape[0];
    for (int64_t p = 0; p < B; p++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double s = 0;
                for (int64_t k = 0; k < K; k++) s += a[(p * M + i) * K + k] * b[j * K + k];
                out[(p * M + i) * N + j] = s;
            }
    free(a); free(b);
}

static void ref_linear(tide_tensor **in, double *out)    /* x [..., K], w [N, K], b [N] -> [..., N] */
{
    double *x = host(in[0]), *w = host(in[1]), *b = host(in[2]);
    int64_t K = in[1]->shape[1], N = in[1]->shape[0], M = in[0]->numel / K;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = b[j];
            for (int64_t k = 0; k < K; k++) s += x[i * K + k] * w[j * K + k];
            out[i * N + j] = s;
        }
    free(x); free(w); free(b);
}

static void ref_softmax(tide_tensor **in, double *out)
{
    double *x = host(in[0]);
    int64_t C = in[0]->shape[in[0]->ndim - 1], R = in[0]->numel / C;
    for (int64_t r = 0; r < R; r++) {
        double m = -INFINITY, s = 0;
        for (int64_t c = 0; c < C; c++) m = fmax(m, x[r * C + c]);
        for (int64_t c = 0; c < C; c++) s += exp(x[r * C + c] - m);
        for (int64_t c = 0; c < C; c++) out[r * C + c] = exp(x[r * C + c] - m) / s;
    }
    free(x);
}

static void ref_rmsnorm(tide_tensor **in, double *out)
{
    double *x = host(in[0]), *w = host(in[1]);
    int64_t C = in[1]->shape[0], R = in[0]->numel / C;
    for (int64_t r = 0; r < R; r++) {
        double ss = 0;
        for (int64_t c = 0; c < C; c++) ss += x[r * C + c] * x[r * C + c];
        double rs = 1.0 / sqrt(ss / (double)C + 1e-5);
        for (int64_t c = 0; c < C; c++) out[r * C + c] = x[r * C + c] * rs * w[c];
    }
    free(x); free(w);
}

static void ref_attention(tide_tensor **in, double *out, int causal, double scale)
{
    double *q = host(in[0]), *k = host(in[1]), *v = host(in[2]);
    int64_t BH = in[0]->shape[0] * in[0]->shape[1], Tq = in[0]->shape[2], Tk = in[1]->shape[2], D = in[0]->shape[3];
    double *p = malloc((size_t)Tk * sizeof *p);
    for (int64_t h = 0; h < BH; h++)
        for (int64_t i = 0; i < Tq; i++) {
            double m = -INFINITY, s = 0;
            for (int64_t j = 0; j < Tk; j++) {
                if (causal && j > i + (Tk - Tq)) { p[j] = -INFINITY; continue; }
                double d = 0;
                for (int64_t c = 0; c < D; c++) d += q[(h * Tq + i) * D + c] * k[(h * Tk + j) * D + c];
                p[j] = d * scale;
                m = fmax(m, p[j]);
            }
            for (int64_t j = 0; j < Tk; j++) { p[j] = p[j] == -INFINITY ? 0 : exp(p[j] - m); s += p[j]; }
            for (int64_t c = 0; c < D; c++) {
                double o = 0;
                for (int64_t j = 0; j < Tk; j++) o += p[j] * v[(h * Tk + j) * D + c];
                out[(h * Tq + i) * D + c] = o / s;
            }
        }
    free(p); free(q); free(k); free(v);
}
static void ref_attn_causal(tide_tensor **in, double *out) { ref_attention(in, out, 1, 0.5); }
static void ref_attn_full(tide_tensor **in, double *out) { ref_attention(in, out, 0, 0.4); }

static void ref_ce_mean(tide_tensor **in, double *out)
{
    double *x = host(in[0]), *t = host(in[1]), *w = host(in[2]);
    int64_t N = in[0]->shape[0], V = in[0]->shape[1];
    double num = 0, den = 0;
    for (int64_t r = 0; r < N; r++) {
        if (t[r] == -100) continue;
        double m = -INFINITY, s = 0;
        for (int64_t c = 0; c < V; c++) m = fmax(m, x[r * V + c]);
        for (int64_t c = 0; c < V; c++) s += exp(x[r * V + c] - m);
        num += w[r] * (m + log(s) - x[r * V + (int64_t)t[r]]);
        den += w[r];
    }
    out[0] = num / den;
    free(x); free(t); free(w);
}

/* token_logprobs by the definition: log_softmax, gathered at the target, then -Σ p log p; both 0 at ignore -100 */
static void ref_tlp_both(tide_tensor **in, double *out)
{
    double *x = host(in[0]), *t = host(in[1]);
    int64_t V = in[0]->shape[in[0]->ndim - 1], N = in[1]->numel;
    double *ls = malloc((size_t)V * sizeof *ls);
    for (int64_t r = 0; r < N; r++) {
        double m = -INFINITY, s = 0, h = 0;
        for (int64_t c = 0; c < V; c++) m = fmax(m, x[r * V + c]);
        for (int64_t c = 0; c < V; c++) s += exp(x[r * V + c] - m);
        for (int64_t c = 0; c < V; c++) { ls[c] = x[r * V + c] - m - log(s); h -= exp(ls[c]) * ls[c]; }
        int ign = t[r] == -100;
        out[r] = ign ? 0 : ls[(int64_t)t[r]];
        out[N + r] = ign ? 0 : h;
    }
    free(ls); free(x); free(t);
}

/* MLA attention by the definition (mla.md §1, §5): q [B, Tq, H, dn + dr], k_n, k_r (or none), v; score over
   the visible keys of each query (causal, last query on the last key, within its document when docs given) */
static void ref_mla(tide_tensor *tq, tide_tensor *tkn, tide_tensor *tkr, tide_tensor *tv, double scale, const int64_t *doc,
                    double *out)
{
    double *q = host(tq), *kn = host(tkn), *kr = tkr ? host(tkr) : NULL, *v = host(tv);
    int64_t B = tq->shape[0], Tq = tq->shape[1], H = tq->shape[2], dqk = tq->shape[3], Tk = tkn->shape[1], dn = tkn->shape[3];
    int64_t dr = dqk - dn, dv = tv->shape[3];
    double *p = malloc((size_t)Tk * sizeof *p);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Tq; i++) {
                double m = -INFINITY, s = 0;
                for (int64_t j = 0; j < Tk; j++) {
                    int visible = j <= i + (Tk - Tq) && (!doc || doc[b * Tk + i + (Tk - Tq)] == doc[b * Tk + j]);
                    if (!visible) { p[j] = -INFINITY; continue; }
                    double d = 0;
                    for (int64_t c = 0; c < dn; c++) d += q[((b * Tq + i) * H + h) * dqk + c] * kn[((b * Tk + j) * H + h) * dn + c];
                    for (int64_t c = 0; c < dr; c++) d += q[((b * Tq + i) * H + h) * dqk + dn + c] * kr[(b * Tk + j) * dr + c];
                    p[j] = d * scale;
                    m = fmax(m, p[j]);
                }
                for (int64_t j = 0; j < Tk; j++) { p[j] = p[j] == -INFINITY ? 0 : exp(p[j] - m); s += p[j]; }
                for (int64_t c = 0; c < dv; c++) {
                    double o = 0;
                    for (int64_t j = 0; j < Tk; j++) o += p[j] * v[((b * Tk + j) * H + h) * dv + c];
                    out[((b * Tq + i) * H + h) * dv + c] = o / s;
                }
            }
    free(p); free(q); free(kn); free(kr); free(v);
}
static void ref_mla_packed(tide_tensor **in, double *out)
{
    static const int64_t doc[10] = {0, 0, 0, 0, 1, 2, 3, 3, 3, 3};
    ref_mla(in[0], in[1], in[2], in[3], 0.45, doc, out);
}
static void ref_mla_decode(tide_tensor **in, double *out) { ref_mla(in[0], in[1], in[2], in[3], 0.5, NULL, out); }
/* a context-parallel slice (long_context.md §5): queries = the last 3 of each row of 7 keys, documents over the keys
   (B = 2: [0,2) [2,5) [5,7) | [7,12) [12,14)) so one query row starts a document, one sees a document that began
   before the slice and one is in a later document */
static const int64_t mla_cp_doc[14] = {0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 4, 4};
static tide_tensor *r_mla_cp(tide_tensor **x)
{
    double v[6] = {0, 2, 5, 7, 12, 14};
    tide_tensor *cu = tide_from_f64(TIDE_I64, 1, SHAPE(6), 0, v);
    tide_tensor *y = tide_mla_attention(x[0], x[1], x[2], x[3], cu, 0.4);
    tide_tensor_release(cu);
    return y;
}
static void ref_mla_cp(tide_tensor **in, double *out) { ref_mla(in[0], in[1], in[2], in[3], 0.4, mla_cp_doc, out); }
static void ref_mla_nor(tide_tensor **in, double *out) { ref_mla(in[0], in[1], NULL, in[2], 0.6, NULL, out); }
/* mla_latent_attention by the definition: the keys and values expanded from the latent (k_n^h = W_UK^h c, v^h =
   W_UV^h c, w [H, dn + dv, dc]), then ref_mla */
static void ref_mla_latent(tide_tensor **in, int has_kr, double scale, const int64_t *doc, double *out)
{
    tide_tensor *tq = in[0], *tc = in[1], *tkr = has_kr ? in[2] : NULL, *tw = in[2 + has_kr];
    double *c = host(tc), *w = host(tw);
    int64_t B = tc->shape[0], Tk = tc->shape[1], dc = tc->shape[2], H = tw->shape[0], E = tw->shape[1];
    int64_t dr = tkr ? tkr->shape[2] : 0, dn = tq->shape[3] - dr, dv = E - dn;
    double *kn = malloc((size_t)(B * Tk * H * dn) * sizeof *kn), *v = malloc((size_t)(B * Tk * H * dv) * sizeof *v);
    for (int64_t t = 0; t < B * Tk; t++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t r = 0; r < E; r++) {
                double x = 0;
                for (int64_t e = 0; e < dc; e++) x += w[(h * E + r) * dc + e] * c[t * dc + e];
                if (r < dn) kn[(t * H + h) * dn + r] = x; else v[(t * H + h) * dv + r - dn] = x;
            }
    tide_tensor *tkn = tide_from_f64(TIDE_F64, 4, SHAPE(B, Tk, H, dn), 0, kn), *tv = tide_from_f64(TIDE_F64, 4, SHAPE(B, Tk, H, dv), 0, v);
    ref_mla(tq, tkn, tkr, tv, scale, doc, out);
    tide_tensor_release(tkn); tide_tensor_release(tv);
    free(c); free(w); free(kn); free(v);
}
/* a CP slice (Tq 3 of Tk 7, documents over the keys as r_mla_cp) expanded 2 keys at a time: 4 chunks, the last
   ragged, a document starting inside a chunk and one before it */
static tide_tensor *r_mla_latent_cp(tide_tensor **x)
{
    double v[6] = {0, 2, 5, 7, 12, 14};
    tide_tensor *cu = tide_from_f64(TIDE_I64, 1, SHAPE(6), 0, v);
    tide_tensor *y = tide_mla_latent_attention(x[0], x[1], x[2], x[3], cu, 0.4, 2);
    tide_tensor_release(cu);
    return y;
}
static void ref_mla_latent_cp(tide_tensor **in, double *out) { ref_mla_latent(in, 1, 0.4, mla_cp_doc, out); }
RUN(r_mla_latent_nor, tide_mla_latent_attention(x[0], x[1], NULL, x[2], NULL, 0.6, 3))
static void ref_mla_latent_nor(tide_tensor **in, double *out) { ref_mla_latent(in, 0, 0.6, NULL, out); }
/* packed documents, Tq = Tk, one chunk holding every key */
static tide_tensor *r_mla_latent_one(tide_tensor **x)
{
    double v[4] = {0, 4, 6, 10};
    tide_tensor *cu = tide_from_f64(TIDE_I64, 1, SHAPE(4), 0, v);
    tide_tensor *y = tide_mla_latent_attention(x[0], x[1], x[2], x[3], cu, 0.45, 64);
    tide_tensor_release(cu);
    return y;
}
static void ref_mla_latent_one(tide_tensor **in, double *out)
{
    static const int64_t doc[10] = {0, 0, 0, 0, 1, 2, 3, 3, 3, 3};
    ref_mla_latent(in, 1, 0.45, doc, out);
}
/* varlen attention by the definition (vision.md §3): q, k, v [T, H, D], every key of the query's image visible */
static void ref_varlen(tide_tensor **in, double *out)
{
    static const int64_t img[7] = {0, 0, 0, 1, 2, 2, 2};
    double *q = host(in[0]), *k = host(in[1]), *v = host(in[2]), p[7];
    int64_t T = in[0]->shape[0], H = in[0]->shape[1], D = in[0]->shape[2];
    for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < T; i++) {
            double m = -INFINITY, s = 0;
            for (int64_t j = 0; j < T; j++) {
                double d = 0;
                for (int64_t c = 0; c < D; c++) d += q[(i * H + h) * D + c] * k[(j * H + h) * D + c];
                p[j] = img[i] == img[j] ? d * 0.45 : -INFINITY;
                m = fmax(m, p[j]);
            }
            for (int64_t j = 0; j < T; j++) { p[j] = p[j] == -INFINITY ? 0 : exp(p[j] - m); s += p[j]; }
            for (int64_t c = 0; c < D; c++) {
                double o = 0;
                for (int64_t j = 0; j < T; j++) o += p[j] * v[(j * H + h) * D + c];
                out[(i * H + h) * D + c] = o / s;
            }
        }
    free(q); free(k); free(v);
}

/* attnres by the definition (attnres.md §1): n sources [rows, d], then w, nu [d]; eps 1e-5 */
static void ref_attnres(tide_tensor **in, int n, double *out)
{
    int64_t d = in[n]->shape[0], rows = in[0]->numel / d;
    double *w = host(in[n]), *nu = host(in[n + 1]), *v[3], s[3];
    for (int i = 0; i < n; i++) v[i] = host(in[i]);
    for (int64_t t = 0; t < rows; t++) {
        double m = -INFINITY, z = 0;
        for (int i = 0; i < n; i++) {
            double ss = 0, dot = 0;
            for (int64_t c = 0; c < d; c++) { ss += v[i][t * d + c] * v[i][t * d + c]; dot += w[c] * nu[c] * v[i][t * d + c]; }
            s[i] = dot / sqrt(ss / (double)d + 1e-5);
            m = fmax(m, s[i]);
        }
        for (int i = 0; i < n; i++) { s[i] = exp(s[i] - m); z += s[i]; }
        for (int64_t c = 0; c < d; c++) {
            double o = 0;
            for (int i = 0; i < n; i++) o += s[i] / z * v[i][t * d + c];
            out[t * d + c] = o;
        }
    }
    for (int i = 0; i < n; i++) free(v[i]);
    free(w); free(nu);
}
static void ref_attnres3(tide_tensor **in, double *out) { ref_attnres(in, 3, out); }

/* the routed experts by the definition (moe.md §8), dense per token: u[t] = Σ_slot p E_sel(x_t) */
static void ref_moe_situ(tide_tensor **in, double *out)
{
    double *x = host(in[0]), *sel = host(in[1]), *p = host(in[2]), *wgu = host(in[3]), *wd = host(in[4]);
    int64_t m = in[0]->shape[0], din = in[0]->shape[1], k = in[1]->shape[1], de = in[3]->shape[1] / 2, dout = in[4]->shape[1];
    double h[16];
    for (int64_t t = 0; t < m; t++)
        for (int64_t c = 0; c < dout; c++) out[t * dout + c] = 0;
    for (int64_t t = 0; t < m; t++)
        for (int64_t s = 0; s < k; s++) {
            int64_t e = (int64_t)sel[t * k + s];
            for (int64_t j = 0; j < de; j++) {
                double g = 0, u = 0;
                for (int64_t i = 0; i < din; i++) {
                    g += wgu[(e * 2 * de + j) * din + i] * x[t * din + i];
                    u += wgu[(e * 2 * de + de + j) * din + i] * x[t * din + i];
                }
                h[j] = 1.5 * tanh(g / 1.5) / (1 + exp(-g)) * 2.0 * tanh(u / 2.0);
            }
            for (int64_t c = 0; c < dout; c++) {
                double y = 0;
                for (int64_t j = 0; j < de; j++) y += wd[(e * dout + c) * de + j] * h[j];
                out[t * dout + c] += p[t * k + s] * y;
            }
        }
    free(x); free(sel); free(p); free(wgu); free(wd);
}

static int n_cases;
static op_case cases[96];

static void add(int op, const char *what, tide_tensor *(*run)(tide_tensor **), void (*ref)(tide_tensor **, double *), int no_f32,
                int n_in, tide_tensor *a, tide_tensor *b, tide_tensor *c, tide_tensor *d)
{
    op_case *k = &cases[n_cases++];
    k->op = op; k->what = what; k->run = run; k->ref = ref; k->no_f32 = no_f32; k->n_in = n_in;
    k->in[0] = a; k->in[1] = b; k->in[2] = c; k->in[3] = d;
}

/* a case with five or six inputs (the kda op) */
static void add6(int op, const char *what, tide_tensor *(*run)(tide_tensor **), int n_in, tide_tensor *a, tide_tensor *b,
                 tide_tensor *c, tide_tensor *d, tide_tensor *e, tide_tensor *f)
{
    add(op, what, run, NULL, 0, n_in, a, b, c, d);
    cases[n_cases - 1].in[4] = e;
    cases[n_cases - 1].in[5] = f;
}

static void build_cases(void)
{
    int64_t s4[1] = {4};
    add(TIDE_OP_RESHAPE, "[2,3,4] -> [4,-1,2]", r_reshape, NULL, 0, 1, RANDN(2, 3, 4), 0, 0, 0);
    add(TIDE_OP_PERMUTE, "(2,0,1)", r_permute, NULL, 0, 1, RANDN(2, 3, 4), 0, 0, 0);
    add(TIDE_OP_SLICE, "dim 1 [1:7:2]", r_slice, NULL, 0, 1, RANDN(3, 8), 0, 0, 0);
    add(TIDE_OP_CONTIGUOUS, "of a transpose", r_contig, NULL, 0, 1, RANDN(3, 5), 0, 0, 0);
    add(TIDE_OP_EXPAND, "[3,1] -> [2,3,4]", r_expand, NULL, 0, 1, RANDN(3, 1), 0, 0, 0);
    add(TIDE_OP_CONCAT, "3 tensors, dim 1", r_concat, NULL, 0, 3, RANDN(2, 1, 3), RANDN(2, 2, 3), RANDN(2, 3, 3), 0);
    add(TIDE_OP_SPLIT, "[2,1,3] on dim 1, one part unused", r_split, NULL, 0, 1, RANDN(2, 6), 0, 0, 0);
    add(TIDE_OP_INDEX_SELECT, "dim 1, repeated indices", r_index_select, NULL, 0, 2, RANDN(2, 5, 3),
        ints(TIDE_I64, 1, SHAPE(7), 5, 0, 4), 0, 0);
    add(TIDE_OP_GATHER, "dim 1", r_gather, NULL, 0, 2, RANDN(3, 4, 2), ints(TIDE_I32, 3, SHAPE(3, 6, 2), 4, -1, 0), 0, 0);
    add(TIDE_OP_SCATTER_ADD, "dim 1", r_scatter_add, NULL, 0, 3, RANDN(3, 4, 2), ints(TIDE_I64, 3, SHAPE(3, 5, 2), 4, -1, 0),
        RANDN(3, 5, 2), 0);
    add(TIDE_OP_TO_DTYPE, "same dtype copy", r_to_dtype, NULL, 0, 1, RANDN(4, 3), 0, 0, 0);
    add(TIDE_OP_TO_DEVICE, "cpu -> cpu", r_to_device, NULL, 0, 1, RANDN(4, 3), 0, 0, 0);
    add(TIDE_OP_ADD, "broadcast [2,3,4] + [4]", r_add, NULL, 0, 2, RANDN(2, 3, 4), RANDN(4), 0, 0);
    add(TIDE_OP_SUB, "broadcast [3,1] - [2,1,4]", r_sub, NULL, 0, 2, RANDN(3, 1), RANDN(2, 1, 4), 0, 0);
    add(TIDE_OP_MUL, "broadcast [2,3,4] * [3,1]", r_mul, NULL, 0, 2, RANDN(2, 3, 4), RANDN(3, 1), 0, 0);
    add(TIDE_OP_DIV, "broadcast [2,3] / [3]", r_div, NULL, 0, 2, RANDN(2, 3), RANDU(0.5, 2.0, 3), 0, 0);
    add(TIDE_OP_ADD_SCALAR, "+0.75", r_add_scalar, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_MUL_SCALAR, "*-1.5", r_mul_scalar, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_POW_SCALAR, "^2.5", r_pow_scalar, NULL, 0, 1, RANDU(0.5, 2.0, 3, 4), 0, 0, 0);
    add(TIDE_OP_NEG, "", r_neg, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_EXP, "", r_exp, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_LOG, "", r_log, NULL, 0, 1, RANDU(0.5, 3.0, 3, 4), 0, 0, 0);
    add(TIDE_OP_SQRT, "", r_sqrt, NULL, 0, 1, RANDU(0.5, 3.0, 3, 4), 0, 0, 0);
    add(TIDE_OP_RSQRT, "", r_rsqrt, NULL, 0, 1, RANDU(0.5, 3.0, 3, 4), 0, 0, 0);
    add(TIDE_OP_TANH, "", r_tanh, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_SIGMOID, "", r_sigmoid, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_SILU, "", r_silu, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_GELU, "", r_gelu, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_GELU_ERF, "", r_gelu_erf, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_SOFTPLUS, "", r_softplus, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_RELU, "", r_relu, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_ABS, "", r_abs, NULL, 0, 1, RANDN(3, 4), 0, 0, 0);
    add(TIDE_OP_SWIGLU, "", r_swiglu, NULL, 0, 2, RANDN(3, 4), RANDN(3, 4), 0, 0);
    add(TIDE_OP_SUM, "dims (0,2)", r_sum, NULL, 0, 1, RANDN(2, 3, 4), 0, 0, 0);
    add(TIDE_OP_SUM, "all, keepdim", r_sum_all, NULL, 0, 1, RANDN(2, 3, 4), 0, 0, 0);
    add(TIDE_OP_MEAN, "last dim, keepdim", r_mean, NULL, 0, 1, RANDN(2, 3, 4), 0, 0, 0);
    add(TIDE_OP_MAX, "dim 1", r_max, NULL, 0, 1, RANDN(2, 5, 3), 0, 0, 0);
    add(TIDE_OP_ARGMAX, "last dim (forward only: not differentiable)", r_argmax, NULL, 0, 1, RANDN(4, 7), 0, 0, 0);
    add(TIDE_OP_LOGSUMEXP, "dim 1, keepdim", r_logsumexp, NULL, 0, 1, RANDN(2, 5, 3), 0, 0, 0);
    add(TIDE_OP_MATMUL, "[3,4]x[4,5]", r_matmul, NULL, 0, 2, RANDN(3, 4), RANDN(4, 5), 0, 0);
    add(TIDE_OP_MATMUL, "[2,3,4]x[5,4]^T (Linear)", r_matmul_tb, ref_matmul_tb, 0, 2, RANDN(2, 3, 4), RANDN(5, 4), 0, 0);
    add(TIDE_OP_MATMUL, "[2,4,3]^T x [2,4,5]", r_matmul_ta, NULL, 0, 2, RANDN(2, 4, 3), RANDN(2, 4, 5), 0, 0);
    add(TIDE_OP_MATMUL, "[4,3]^T x [5,4]^T", r_matmul_tt, NULL, 0, 2, RANDN(4, 3), RANDN(5, 4), 0, 0);
    add(TIDE_OP_MATMUL, "[2,4,3]^T x [4,5] (shared b)", r_matmul_bshared, NULL, 0, 2, RANDN(2, 4, 3), RANDN(4, 5), 0, 0);
    add(TIDE_OP_LINEAR, "[2,3,4] W [5,4] + b [5]", r_linear, ref_linear, 0, 3, RANDN(2, 3, 4), RANDN(5, 4), RANDN(5), 0);
    add(TIDE_OP_LINEAR, "[3,4] W [5,4], no bias", r_linear_nob, NULL, 0, 2, RANDN(3, 4), RANDN(5, 4), 0, 0);
    add(TIDE_OP_LINEAR, "[4] W [2,4] + b (a vector x)", r_linear, NULL, 0, 3, RANDN(4), RANDN(2, 4), RANDN(2), 0);
    add(TIDE_OP_EMBEDDING, "V=6 d=4 ids [2,3]", r_embedding, NULL, 0, 2, RANDN(6, 4), ints(TIDE_I64, 2, SHAPE(2, 3), 6, 1, 1), 0, 0);
    add(TIDE_OP_RMSNORM, "[2,3,8]", r_rmsnorm, ref_rmsnorm, 0, 2, RANDN(2, 3, 8), RANDN(8), 0, 0);
    add(TIDE_OP_LAYERNORM, "with bias", r_layernorm, NULL, 0, 3, RANDN(3, 6), RANDN(6), RANDN(6), 0);
    add(TIDE_OP_LAYERNORM, "without bias", r_layernorm_nob, NULL, 0, 2, RANDN(3, 6), RANDN(6), 0, 0);
    add(TIDE_OP_SOFTMAX, "last dim", r_softmax, ref_softmax, 0, 1, RANDN(3, 7), 0, 0, 0);
    add(TIDE_OP_SOFTMAX, "dim 0", r_softmax_d0, NULL, 0, 1, RANDN(4, 3, 2), 0, 0, 0);
    add(TIDE_OP_LOG_SOFTMAX, "dim 1 of 3", r_log_softmax, NULL, 0, 1, RANDN(2, 5, 3), 0, 0, 0);
    add(TIDE_OP_CROSS_ENTROPY, "mean, weights, one ignored", r_ce_mean, ref_ce_mean, 0, 3, RANDN(6, 5),
        ints(TIDE_I64, 1, SHAPE(6), 5, 2, -100), RANDU(0.5, 1.5, 6), 0);
    add(TIDE_OP_CROSS_ENTROPY, "sum, i32 targets", r_ce_sum, NULL, 0, 2, RANDN(6, 5), ints(TIDE_I32, 1, SHAPE(6), 5, -1, 0), 0, 0);
    add(TIDE_OP_CROSS_ENTROPY, "none, ignore 2", r_ce_none, NULL, 0, 2, RANDN(6, 5), ints(TIDE_I64, 1, SHAPE(6), 5, -1, 0), 0, 0);
    /* token_logprobs: logits [2,3,7] uniform in [-4, 4] with targets [2,3]; each case has an ignored target */
    add(TIDE_OP_TOKEN_LOGPROBS, "logp + entropy, [2,3,7], i64, one ignored", r_tlp_both, ref_tlp_both, 0, 2,
        RANDU(-4.0, 4.0, 2, 3, 7), ints(TIDE_I64, 2, SHAPE(2, 3), 7, 4, -100), 0, 0);
    add(TIDE_OP_TOKEN_LOGPROBS, "logp only, ignore 3, [5,6]", r_tlp_logp, NULL, 0, 2, RANDN(5, 6),
        ints(TIDE_I64, 1, SHAPE(5), 6, 1, 3), 0, 0);
    add(TIDE_OP_TOKEN_LOGPROBS, "entropy only, i32, one ignored", r_tlp_entropy, NULL, 0, 2, RANDN(4, 9),
        ints(TIDE_I32, 1, SHAPE(4), 9, 0, -100), 0, 0);
    add(TIDE_OP_ROPE, "[2,5,3,4] pos0 3", r_rope, NULL, 0, 1, RANDN(2, 5, 3, 4), 0, 0, 0);
    add(TIDE_OP_ROPE2D, "[5,2,8] i32 pos < 512", r_rope2d, NULL, 0, 2, RANDN(5, 2, 8), ints(TIDE_I32, 2, SHAPE(5, 2), 512, -1, 0),
        0, 0);
    add(TIDE_OP_POS_INTERP, "[4,4,3] to 6x5, 2x3, 4x4, 1x1", r_pos_interp, NULL, 0, 2, RANDN(4, 4, 3),
        tide_from_f64(TIDE_I64, 2, SHAPE(4, 2), 0, (double[]){6, 5, 2, 3, 4, 4, 1, 1}), 0, 0);
    add(TIDE_OP_ATTENTION, "causal Tq 5 < Tk 7", r_attn_causal, ref_attn_causal, 0, 3, RANDN(2, 2, 5, 4), RANDN(2, 2, 7, 4),
        RANDN(2, 2, 7, 4), 0);
    add(TIDE_OP_ATTENTION, "non-causal", r_attn_full, ref_attn_full, 0, 3, RANDN(1, 3, 4, 8), RANDN(1, 3, 6, 8), RANDN(1, 3, 6, 8), 0);
    /* kda: q, k, v, g (in [lb, 0]), beta (0, 1), s0; T not a multiple of the chunk */
    add6(TIDE_OP_KDA, "chunk 4, T 7, s0", r_kda_chunk, 6, RANDN(2, 7, 2, 3), RANDN(2, 7, 2, 3), RANDN(2, 7, 2, 4),
         RANDU(-0.9, -0.01, 2, 7, 2, 3), RANDU(0.05, 0.95, 2, 7, 2), RANDN(2, 2, 3, 4));
    add6(TIDE_OP_KDA, "chunk 4, packed documents, s0", r_kda_packed, 6, RANDN(2, 9, 1, 3), RANDN(2, 9, 1, 3),
         RANDN(2, 9, 1, 2), RANDU(-0.9, -0.01, 2, 9, 1, 3), RANDU(0.05, 0.95, 2, 9, 1), RANDN(2, 1, 3, 2));
    add6(TIDE_OP_KDA, "chunk_safe 3, strong decay", r_kda_safe, 5, RANDN(1, 8, 2, 3), RANDN(1, 8, 2, 3), RANDN(1, 8, 2, 2),
         RANDU(-6.0, -0.01, 1, 8, 2, 3), RANDU(0.05, 0.95, 1, 8, 2), NULL);
    add6(TIDE_OP_KDA, "recurrent, s0", r_kda_rec, 6, RANDN(1, 6, 2, 3), RANDN(1, 6, 2, 3), RANDN(1, 6, 2, 2),
         RANDU(-0.9, -0.01, 1, 6, 2, 3), RANDU(0.05, 0.95, 1, 6, 2), RANDN(1, 2, 3, 2));
    add6(TIDE_OP_KDA_PAIRS, "chunk_safe 2, packed documents", r_kda_pairs, 5, RANDN(2, 9, 2, 3), RANDN(2, 9, 2, 3),
         RANDN(2, 9, 2, 2), RANDU(-0.9, -0.01, 2, 9, 2, 3), RANDU(0.05, 0.95, 2, 9, 2), NULL);
    add6(TIDE_OP_KDA_PAIRS, "recurrent", r_kda_pairs_rec, 5, RANDN(1, 6, 2, 3), RANDN(1, 6, 2, 3), RANDN(1, 6, 2, 4),
         RANDU(-0.9, -0.01, 1, 6, 2, 3), RANDU(0.05, 0.95, 1, 6, 2), NULL);
    add(TIDE_OP_KDA_GATE, "lower-bounded, dt_bias [H, D]", r_kda_gate, NULL, 0, 3, RANDN(3, 2, 4), RANDN(2), RANDN(2, 4), 0);
    add(TIDE_OP_KDA_GATE, "softplus, dt_bias [H·D]", r_kda_gate_sp, NULL, 0, 3, RANDN(3, 2, 4), RANDN(2), RANDN(8), 0);
    add(TIDE_OP_CAUSAL_CONV1D, "K 4, cache, packed, silu", r_conv, NULL, 0, 3, RANDN(2, 5, 3), RANDN(3, 4), RANDN(2, 3, 3), 0);
    add(TIDE_OP_CAUSAL_CONV1D, "K 3, no cache", r_conv_plain, NULL, 0, 2, RANDN(2, 6, 4), RANDN(4, 3), 0, 0);
    add(TIDE_OP_L2NORM, "[2,3,5] scale 0.35", r_l2norm, NULL, 0, 1, RANDN(2, 3, 5), 0, 0, 0);
    /* mla_attention: q [B, T, H, dn + dr], k_n [B, T, H, dn], k_r [B, T, dr] shared by the heads, v */
    add(TIDE_OP_MLA_ATTENTION, "packed documents, rope slot", r_mla_packed, ref_mla_packed, 0, 4, RANDN(2, 5, 2, 5),
        RANDN(2, 5, 2, 3), RANDN(2, 5, 2), RANDN(2, 5, 2, 4));
    add(TIDE_OP_MLA_ATTENTION, "Tq 2 < Tk 6", r_mla_decode, ref_mla_decode, 0, 4, RANDN(1, 2, 3, 4), RANDN(1, 6, 3, 3),
        RANDN(1, 6, 1), RANDN(1, 6, 3, 2));
    add(TIDE_OP_MLA_ATTENTION, "Tq 3 < Tk 7 with documents over the keys (a CP slice)", r_mla_cp, ref_mla_cp, 0, 4,
        RANDN(2, 3, 2, 5), RANDN(2, 7, 2, 3), RANDN(2, 7, 2), RANDN(2, 7, 2, 4));
    add(TIDE_OP_MLA_ATTENTION, "no rope slot", r_mla_nor, ref_mla_nor, 0, 3, RANDN(1, 4, 2, 3), RANDN(1, 4, 2, 3),
        RANDN(1, 4, 2, 3), 0);
    /* mla_latent_attention: q [B, Tq, H, dn + dr], c [B, Tk, dc], k_r [B, Tk, dr], w [H, dn + dv, dc] */
    add(TIDE_OP_MLA_LATENT_ATTENTION, "CP slice Tq 3 < Tk 7, documents over the keys, chunks of 2", r_mla_latent_cp,
        ref_mla_latent_cp, 0, 4, RANDN(2, 3, 2, 5), RANDN(2, 7, 4), RANDN(2, 7, 2), RANDN(2, 7, 4));
    add(TIDE_OP_MLA_LATENT_ATTENTION, "no rope slot, chunks of 3", r_mla_latent_nor, ref_mla_latent_nor, 0, 3,
        RANDN(1, 5, 2, 3), RANDN(1, 5, 3), RANDN(2, 5, 3), 0);
    add(TIDE_OP_MLA_LATENT_ATTENTION, "packed documents, one chunk", r_mla_latent_one, ref_mla_latent_one, 0, 4,
        RANDN(2, 5, 2, 5), RANDN(2, 5, 3), RANDN(2, 5, 2), RANDN(2, 6, 3));
    add(TIDE_OP_MLA_DECODE_ROWS, "2 rows, own buffers (forward only: decoding, no gradient)", r_mla_decode_rows, NULL, 0, 4,
        RANDN(2, 3, 4), RANDN(2, 1, 4), RANDN(1, 4, 4), RANDN(1, 2, 4));
    add(TIDE_OP_KDA_DECODE_ROWS, "2 rows, own states (forward only: decoding, no gradient)", r_kda_decode_rows,
        ref_kda_decode_rows, 0, 4, RANDN(2, 2, 3), RANDN(2, 2, 3), RANDN(2, 2, 3), RANDN(2, 2, 3, 3));
    add(TIDE_OP_CONV_DECODE_ROWS, "2 rows, own histories, silu (forward only: decoding, no gradient)",
        r_conv_decode_rows, ref_conv_decode_rows, 0, 3, RANDN(2, 1, 3), RANDN(3, 4), RANDN(2, 3, 3), 0);
    /* varlen_attention: q, k, v [T, H, D], three images (one of length 1), not causal */
    add(TIDE_OP_VARLEN_ATTENTION, "3 images [0,3) [3,4) [4,7)", r_varlen, ref_varlen, 0, 3, RANDN(7, 2, 3), RANDN(7, 2, 3),
        RANDN(7, 2, 3), 0);
    /* attnres: random w so the weights are far from uniform; one source is the identity */
    add6(TIDE_OP_ATTNRES, "3 sources [2,3,8]", r_attnres3, 5, RANDN(2, 3, 8), RANDN(2, 3, 8), RANDN(2, 3, 8), RANDN(8),
         RANDU(0.5, 1.5, 8), NULL);
    cases[n_cases - 1].ref = ref_attnres3;
    add(TIDE_OP_ATTNRES, "1 source [5,6]", r_attnres1, NULL, 0, 3, RANDN(5, 6), RANDN(6), RANDU(0.5, 1.5, 6), 0);
    add(TIDE_OP_SITU_GLU, "k 4, 25 on [-6, 6]", r_situ, NULL, 0, 2, RANDU(-6.0, 6.0, 3, 5), RANDU(-6.0, 6.0, 3, 5), 0, 0);
    add(TIDE_OP_SITU_GLU, "k 1.5, 2 (saturating)", r_situ_small, NULL, 0, 2, RANDU(-4.0, 4.0, 4, 3), RANDU(-4.0, 4.0, 4, 3), 0, 0);
    add(TIDE_OP_TOPK, "k 3 of 7 over [2,3,7]", r_topk, NULL, 0, 1, RANDN(2, 3, 7), 0, 0, 0);
    /* moe_experts: x [6,3], sel [6,2] over 4 experts, p, w_gate_up [4, 2·2, 3], w_down [4, 3, 2] */
    add6(TIDE_OP_MOE_EXPERTS, "SiTU, n 4, k 2", r_moe_situ, 5, RANDN(6, 3), ints(TIDE_I64, 2, SHAPE(6, 2), 4, -1, 0),
         RANDU(0.1, 1.0, 6, 2), RANDN(4, 4, 3), RANDN(4, 3, 2), NULL);
    cases[n_cases - 1].ref = ref_moe_situ;
    add6(TIDE_OP_MOE_EXPERTS, "SwiGLU, capacity 0.6, i32 sel", r_moe_swiglu_cap, 5, RANDN(7, 3),
         ints(TIDE_I32, 2, SHAPE(7, 2), 3, -1, 0), RANDU(0.1, 1.0, 7, 2), RANDN(3, 4, 3), RANDN(3, 2, 2), NULL);
    add(TIDE_OP_ALLTOALLV, "one rank, [5,3,2]", r_alltoallv, NULL, 0, 1, RANDN(5, 3, 2), 0, 0, 0);
    (void)s4;
}

/* ---- the checks ------------------------------------------------------------------------------------------------- */
static int check_case(op_case *k)
{
    int fails0 = g_fail;
    tide_tensor *y = k->run(k->in);
    if (!y) { FAIL("%s (%s): forward failed: %s", tide_op_name(k->op), k->what, tide_last_error()); return 0; }
    double *yv = host(y);
    for (int64_t i = 0; i < y->numel; i++)
        if (!isfinite(yv[i])) { FAIL("%s (%s): non-finite output at %lld", tide_op_name(k->op), k->what, (long long)i); break; }

    /* 3. slow reference */
    if (k->ref) {
        double *r = malloc((size_t)y->numel * sizeof *r), worst = 0;
        k->ref(k->in, r);
        for (int64_t i = 0; i < y->numel; i++) worst = fmax(worst, fabs(r[i] - yv[i]) / (1 + fabs(r[i])));
        if (worst > 1e-10) FAIL("%s (%s): differs from the slow reference by %.3g", tide_op_name(k->op), k->what, worst);
        free(r);
    }

    /* 2. f32 forward vs f64 forward */
    if (!k->no_f32) {
        tide_tensor *in32[6] = {0};
        for (int i = 0; i < k->n_in; i++)
            in32[i] = k->in[i]->dtype == TIDE_F64 ? tide_to_dtype(k->in[i], TIDE_F32) : (tide_tensor_retain(k->in[i]), k->in[i]);
        tide_tensor *y32 = k->run(in32);
        if (!y32) FAIL("%s (%s): f32 forward failed: %s", tide_op_name(k->op), k->what, tide_last_error());
        else {
            double *v = host(y32), worst = 0;
            for (int64_t i = 0; i < y->numel; i++) worst = fmax(worst, fabs(v[i] - yv[i]) / (1 + fabs(yv[i])));
            if (worst > 2e-4) FAIL("%s (%s): f32 differs from f64 by %.3g", tide_op_name(k->op), k->what, worst);
            free(v);
        }
        tide_tensor_release(y32);
        for (int i = 0; i < k->n_in; i++) tide_tensor_release(in32[i]);
    }

    /* 1. gradient check: L = sum(y * r) */
    if (y->requires_grad) {
        tide_tensor *r = tide_randn(TIDE_F64, y->ndim, y->shape, 0, 0, 1);
        double *rv = host(r);
        for (int i = 0; i < k->n_in; i++) tide_zero_grad(k->in[i]);
        tide_tensor *p = tide_mul(y, r), *L = tide_sum(p, 0, NULL, 0);
        if (!L || tide_backward(L, NULL)) FAIL("%s (%s): backward failed: %s", tide_op_name(k->op), k->what, tide_last_error());
        tide_tensor_release(p); tide_tensor_release(L);
        int prev = tide_set_grad_enabled(0);
        for (int i = 0; i < k->n_in && g_fail == fails0; i++) {
            tide_tensor *x = k->in[i];
            if (!x->requires_grad) continue;
            if (!x->grad) { FAIL("%s (%s): input %d got no gradient", tide_op_name(k->op), k->what, i); break; }
            double *xv = host(x), *gv = host(x->grad), worst = 0;
            int64_t step = x->numel > 120 ? x->numel / 120 : 1;
            for (int64_t e = 0; e < x->numel; e += step) {
                double f[2], orig = xv[e];
                for (int s = 0; s < 2; s++) {
                    xv[e] = orig + (s ? -1e-6 : 1e-6);
                    tide_write_bytes(x, xv, (size_t)x->numel * 8);
                    tide_tensor *yy = k->run(k->in);
                    double *yyv = host(yy), acc = 0;
                    for (int64_t j = 0; j < yy->numel; j++) acc += yyv[j] * rv[j];
                    f[s] = acc;
                    free(yyv);
                    tide_tensor_release(yy);
                }
                xv[e] = orig;
                tide_write_bytes(x, xv, (size_t)x->numel * 8);
                double num = (f[0] - f[1]) / 2e-6, err = fabs(num - gv[e]) - 1e-6 * fabs(gv[e]);
                worst = fmax(worst, err);
                if (err > 1e-7) {
                    FAIL("%s (%s): d/d(input %d)[%lld] analytic %.10g vs numeric %.10g", tide_op_name(k->op), k->what, i,
                         (long long)e, gv[e], num);
                    break;
                }
            }
            free(xv); free(gv);
        }
        tide_set_grad_enabled(prev);
        free(rv);
        tide_tensor_release(r);
    }
    free(yv);
    tide_tensor_release(y);
    return g_fail == fails0;
}

/* token_logprobs against log_softmax + gather and a plain entropy (-Σ softmax · log_softmax) built from the engine's
   own ops, forward and gradient (L = Σ r1 logp + Σ r2 entropy), at V = 1000 with logits of std 3, in f64 and f32; an
   ignored row gives 0, 0 and a zero gradient row; a -inf logit (a masked token) keeps everything finite and gets a
   zero gradient; a target outside [0, V) is an error naming the row. Tolerances per element, |a - b| / (1 + |b|):
   f64 1e-12 (both sides measured within 2e-15); f32 1e-6, forward and gradient (measured 6e-8 and 1.4e-7: exp_f32
   and the softmax kernel's exp differ by a few ulp, and both round the row's lse to float) */
static double tlp_worst(tide_tensor *a, tide_tensor *b)
{
    double *x = host(a), *y = host(b), w = max_rel_diff(x, y, a->numel);
    free(x); free(y);
    return w;
}

static void check_token_logprobs_reference(void)
{
    enum { N = 6, V = 1000 };
    int64_t sx[2] = {N, V}, sn[1] = {N}, sn1[2] = {N, 1};
    double tv[N] = {17, 999, -100, 0, 512, 3}, tsafe[N], mask[N];
    for (int i = 0; i < N; i++) { tsafe[i] = tv[i] == -100 ? 0 : tv[i]; mask[i] = tv[i] == -100 ? 0 : 1; }
    tide_tensor *base = tide_randn(TIDE_F64, 2, sx, 0, 0.0, 3.0), *t = tide_from_f64(TIDE_I64, 1, sn, 0, tv);
    tide_tensor *t1 = tide_from_f64(TIDE_I64, 2, sn1, 0, tsafe);
    tide_tensor *r1 = tide_randn(TIDE_F64, 1, sn, 0, 0.0, 1.0), *r2 = tide_randn(TIDE_F64, 1, sn, 0, 0.0, 1.0);
    for (int pass = 0; pass < 2; pass++) {
        int dt = pass ? TIDE_F32 : TIDE_F64;
        double tf = pass ? 1e-6 : 1e-12, tg = pass ? 1e-6 : 1e-12;
        tide_tensor *x = tide_to_dtype(base, dt), *mk = tide_from_f64(dt, 1, sn, 0, mask);
        tide_tensor *w1 = tide_to_dtype(r1, dt), *w2 = tide_to_dtype(r2, dt);
        tide_set_requires_grad(x, 1);
        /* fused */
        tide_tensor *lp, *h;
        int rc = tide_token_logprobs(x, t, -100, &lp, &h);
        if (rc) { FAIL("token_logprobs reference: forward failed: %s", tide_last_error()); return; }
        tide_tensor *a1 = tide_mul(lp, w1), *a2 = tide_mul(h, w2), *s1 = tide_sum(a1, 0, NULL, 0), *s2 = tide_sum(a2, 0, NULL, 0);
        tide_tensor *L = tide_add(s1, s2);
        tide_backward(L, NULL);
        tide_tensor *gf = tide_to_dtype(x->grad, TIDE_F64);
        tide_zero_grad(x);
        /* composed */
        tide_tensor *ls = tide_log_softmax(x, -1), *g = tide_gather(ls, 1, t1), *gr = tide_reshape(g, 1, sn);
        tide_tensor *lpc = tide_mul(gr, mk), *p = tide_softmax(x, -1), *pl = tide_mul(p, ls);
        tide_tensor *hs = tide_sum(pl, 1, (int[]){-1}, 0), *hn = tide_neg(hs), *hc = tide_mul(hn, mk);
        tide_tensor *b1 = tide_mul(lpc, w1), *b2 = tide_mul(hc, w2), *q1 = tide_sum(b1, 0, NULL, 0), *q2 = tide_sum(b2, 0, NULL, 0);
        tide_tensor *Lc = tide_add(q1, q2);
        tide_backward(Lc, NULL);
        double elp = tlp_worst(lp, lpc), eh = tlp_worst(h, hc), eg = tlp_worst(gf, x->grad);
        double *gv = host(gf), row_ign = 0;
        for (int64_t c = 0; c < V; c++) row_ign = fmax(row_ign, fabs(gv[2 * V + c]));
        free(gv);
        if (elp > tf || eh > tf || eg > tg || row_ign != 0)
            FAIL("token_logprobs vs log_softmax + gather (%s): logp %.3g entropy %.3g (tol %.0e) gradient %.3g (tol %.0e), "
                 "ignored row's gradient max %.3g (want 0)", pass ? "f32" : "f64", elp, eh, tf, eg, tg, row_ign);
        else {
            printf("ok    token_logprobs vs log_softmax + gather, [6,1000] %s: logp %.2g entropy %.2g gradient %.2g\n",
                   pass ? "f32" : "f64", elp, eh, eg);
            g_pass++;
        }
        tide_tensor *all[] = {x, mk, w1, w2, lp, h, a1, a2, s1, s2, L, gf, ls, g, gr, lpc, p, pl, hs, hn, hc, b1, b2, q1, q2, Lc};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    }
    /* a -inf logit in row 0 (not the target): finite outputs, a zero gradient there */
    {
        double *xv = host(base);
        xv[5] = -INFINITY;
        tide_tensor *x = tide_from_f64(TIDE_F32, 2, sx, 0, xv), *lp, *h;
        tide_set_requires_grad(x, 1);
        int rc = tide_token_logprobs(x, t, -100, &lp, &h);
        tide_tensor *s1 = rc ? NULL : tide_sum(lp, 0, NULL, 0), *s2 = rc ? NULL : tide_sum(h, 0, NULL, 0);
        tide_tensor *L = s1 && s2 ? tide_add(s1, s2) : NULL;
        int ok = L && !tide_backward(L, NULL);
        double *lv = ok ? host(lp) : NULL, *hv = ok ? host(h) : NULL, *gv = ok ? host(x->grad) : NULL;
        for (int i = 0; ok && i < N; i++) ok = isfinite(lv[i]) && isfinite(hv[i]);
        for (int64_t c = 0; ok && c < N * V; c++) ok = isfinite(gv[c]);
        if (ok) ok = gv[5] == 0;
        if (ok) { printf("ok    token_logprobs with a -inf logit: finite logp, entropy and gradient, 0 at the -inf\n"); g_pass++; }
        else FAIL("token_logprobs with a -inf logit: non-finite result or a non-zero gradient at it (%s)", rc ? tide_last_error() : "");
        free(xv); free(lv); free(hv); free(gv);
        tide_tensor_release(x); tide_tensor_release(s1); tide_tensor_release(s2); tide_tensor_release(L);
        if (!rc) { tide_tensor_release(lp); tide_tensor_release(h); }
    }
    /* a target outside [0, V) */
    {
        double bad[N] = {1, 2, 1000, 0, 0, 0};
        tide_tensor *tb = tide_from_f64(TIDE_I32, 1, sn, 0, bad), *lp = NULL, *h = NULL;
        int rc = tide_token_logprobs(base, tb, -100, &lp, &h);
        const char *want = "token_logprobs: target 1000 at row 2 is out of range [0, 1000) and is not ignore_index -100";
        if (rc && !strcmp(tide_last_error(), want)) { printf("ok    token_logprobs bad target: %s\n", want); g_pass++; }
        else FAIL("token_logprobs bad target: rc %d, \"%s\" (want \"%s\")", rc, rc ? tide_last_error() : "", want);
        tide_tensor_release(tb);
        if (!rc) { tide_tensor_release(lp); tide_tensor_release(h); }
    }
    tide_tensor_release(base); tide_tensor_release(t); tide_tensor_release(t1); tide_tensor_release(r1); tide_tensor_release(r2);
}

/* a fill kernel with an off-by-one: it writes n + 1 elements */
static int overrunning_fill(void *out, int dtype, int64_t n, double value) { return tide_cpu_fill(out, dtype, n + 1, value); }

/* the guard catches an overrun, and names the block */
static void check_guard_catches_overrun(void)
{
    tide_backend bad = tide_cpu_backend;
    bad.fill = overrunning_fill;
    int64_t before = tide_alloc_guard_violations(NULL), shape[1] = {24};
    tide_backend_override(TIDE_CPU, &bad);
    tide_tensor *t = tide_full(TIDE_F32, 1, shape, TIDE_CPU, 1.0);
    tide_backend_override(TIDE_CPU, NULL);
    tide_tensor_release(t);
    const char *msg = NULL;
    int64_t caught = tide_alloc_guard_violations(&msg) - before;
    const char *want = "a 96-byte block on cpu was written outside its bounds: 0 byte(s) before it, 4 byte(s) past its end";
    if (t && caught == 1 && !strcmp(msg, want)) { printf("ok    guard          a fill writing one f32 past its end: %s\n", msg); g_pass++; }
    else { FAIL("guard: a fill writing one f32 past its end gave %lld violations, \"%s\" (want 1, \"%s\")", (long long)caught, msg, want); }
}

int main(void)
{
    /* before the first allocation: every block from here on carries guard bytes */
    if (tide_alloc_guard_enable()) { printf("alloc guard: %s\n", tide_last_error()); return 1; }
    check_guard_catches_overrun();
    tide_manual_seed(1234);
    if (TIDE_OP_COUNT != tide_op_count()) { printf("op count mismatch\n"); return 1; }
    check_token_logprobs_reference();
    build_cases();
    int covered[TIDE_OP_COUNT] = {0};
    for (int c = 0; c < n_cases; c++) {
        op_case *k = &cases[c];
        for (int i = 0; i < k->n_in; i++)
            if (!k->in[i]) { printf("case %s: input %d could not be made: %s\n", tide_op_name(k->op), i, tide_last_error()); return 1; }
        covered[k->op]++;
        int64_t guard0 = tide_alloc_guard_violations(NULL);
        int ok = check_case(k);
        for (int i = 0; i < k->n_in; i++) tide_tensor_release(k->in[i]);
        const char *gmsg = NULL;
        int64_t overruns = tide_alloc_guard_violations(&gmsg) - guard0;
        if (overruns) { FAIL("%s (%s): %lld block(s) written outside their bounds; last: %s", tide_op_name(k->op), k->what,
                             (long long)overruns, gmsg); ok = 0; }
        printf("%-5s %-14s %s\n", ok ? "ok" : "FAIL", tide_op_name(k->op), k->what);
        if (ok) g_pass++;
    }
    for (int op = 0; op < TIDE_OP_COUNT; op++) {
        if (!tide_op_defs[op].name || !tide_op_defs[op].forward) { printf("FAIL op %d has no registry entry\n", op); g_fail++; }
        else if (!covered[op]) { printf("FAIL op %s has no test case in test_ops.c\n", tide_op_name(op)); g_fail++; }
    }
    if (tide_graph_live_nodes() != 0) { printf("FAIL %lld graph nodes leaked\n", (long long)tide_graph_live_nodes()); g_fail++; }
    if (tide_live_tensors() != 0) { printf("FAIL %lld tensors leaked\n", (long long)tide_live_tensors()); g_fail++; }
    printf("\n%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

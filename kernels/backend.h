/*
 * backend.h — the per-device kernel table (ggml's backend discipline).
 *
 * The op layer (engine/ops) checks shapes, records the graph and calls these entries; kernels are the
 * only code that reads or writes tensor bytes. Conventions (STYLE.md): outputs first, then inputs, then
 * sizes; every pointer already includes the tensor's offset; every entry returns 0 on success or a
 * non-zero status after setting the error message (tide_set_error). An entry left NULL means "not
 * implemented on this backend": engine/ reaches every entry through TIDE_DISPATCH (engine/internal.h), which
 * reports it by name ("rope: no rope kernel on the cuda backend (device cuda:0)") instead of calling it.
 *
 * Unless stated otherwise buffers are contiguous, float kernels accept TIDE_F32 and TIDE_F64 on the CPU
 * (and TIDE_F32 / TIDE_BF16 on CUDA), index buffers accept TIDE_I32 and TIDE_I64.
 */
#ifndef TIDE_BACKEND_H
#define TIDE_BACKEND_H
#include <stddef.h>
#include <stdint.h>
#include "../engine/tide.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The op enums below come from X-macro lists (X(ID, name)), so a kernel's name table is generated from the same
   list as the enum and cannot miss an entry: `#define X(ID, name) [TIDE_UN_##ID] = #name,`. */

/* elementwise unary ops; p is the scalar parameter of the *_SCALAR ops */
#define TIDE_UNARY_OPS(X)                                                                                          \
    X(NEG, neg) X(EXP, exp) X(LOG, log) X(SQRT, sqrt) X(RSQRT, rsqrt) X(TANH, tanh) X(SIGMOID, sigmoid)            \
    X(SILU, silu) X(GELU, gelu) X(SOFTPLUS, softplus) X(RELU, relu) X(ABS, abs) X(ADD_SCALAR, add_scalar)          \
    X(MUL_SCALAR, mul_scalar) X(POW_SCALAR, pow_scalar) X(GELU_ERF, gelu_erf)
#define TIDE_BINARY_OPS(X) X(ADD, add) X(SUB, sub) X(MUL, mul) X(DIV, div)
/* reductions over the middle axis of a contiguous [outer, red, inner] buffer -> [outer, inner] */
#define TIDE_REDUCE_OPS(X) X(SUM, sum) X(MAX, max) X(ARGMAX, argmax) X(LOGSUMEXP, logsumexp)

#define TIDE_UN_ENUM_(ID, name) TIDE_UN_##ID,
#define TIDE_BIN_ENUM_(ID, name) TIDE_BIN_##ID,
#define TIDE_RED_ENUM_(ID, name) TIDE_RED_##ID,
typedef enum { TIDE_UNARY_OPS(TIDE_UN_ENUM_) TIDE_UN_COUNT } tide_unary_op;
typedef enum { TIDE_BINARY_OPS(TIDE_BIN_ENUM_) TIDE_BIN_COUNT } tide_binary_op;
typedef enum { TIDE_REDUCE_OPS(TIDE_RED_ENUM_) TIDE_RED_COUNT } tide_reduce_op;
#undef TIDE_UN_ENUM_
#undef TIDE_BIN_ENUM_
#undef TIDE_RED_ENUM_

/* a process group as a backend's collectives see it (engine/dist/comm.c, DESIGN.md §9): id 0 is the world, the others
   the groups of tide_dist_group_split (the same id on every member, fewer than TIDE_DIST_MAX_GROUPS); rank and size:
   this process's place in the group, members[r] the world rank of group rank r (NULL: the world, r itself); mpi_comm:
   the group's MPI communicator (an MPI_Comm *), over which a backend bootstraps its own communicator for the group
   on the group's first collective (every member calls it: collectives are) */
#define TIDE_DIST_MAX_GROUPS 64
typedef struct tide_dist_grp {
    int id, rank, size;
    const int *members;
    const void *mpi_comm;
} tide_dist_grp;

typedef struct tide_backend {
    const char *name;

    /* memory: raw device bytes (the caching allocator in engine/alloc.c sits on top of these) */
    void *(*malloc)(size_t nbytes);
    void (*free)(void *p);
    int (*memcpy_h2d)(void *dst, const void *src, size_t n);
    int (*memcpy_d2h)(void *dst, const void *src, size_t n);
    int (*memcpy_d2d)(void *dst, const void *src, size_t n);
    int (*synchronize)(void);

    /* out[i] = value for n elements of dtype */
    int (*fill)(void *out, int dtype, int64_t n, double value);
    /* general strided copy with dtype conversion: out[idx·ostride] = x[idx·xstride] over `shape`
       (strides in elements; any dtype pair, float→int rounds toward zero) */
    int (*copy)(void *out, int odtype, const int64_t *ostride, const void *x, int xdtype,
                const int64_t *xstride, int ndim, const int64_t *shape);
    /* Philox stream (rng.c): element i uses counter offset + i. normal: mean a, std b; uniform [a, b) */
    int (*randn)(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b);
    int (*rand)(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b);

    /* y = f(x) (y may alias x); gx = gy * f'(x) with y = f(x) also given */
    int (*unary)(int op, int dtype, void *y, const void *x, int64_t n, double p);
    int (*unary_backward)(int op, int dtype, void *gx, const void *gy, const void *x, const void *y,
                          int64_t n, double p);
    /* out (contiguous, `shape`) = a op b with element strides sa, sb (0 on broadcast dims) */
    int (*binary)(int op, int dtype, void *out, const void *a, const int64_t *sa, const void *b,
                  const int64_t *sb, int ndim, const int64_t *shape);
    /* out = silu(g) * u; backward dg, du from dout */
    int (*swiglu)(int dtype, void *out, const void *g, const void *u, int64_t n);
    int (*swiglu_backward)(int dtype, void *dg, void *du, const void *dout, const void *g,
                           const void *u, int64_t n);
    /* y = a x + y */
    int (*axpy)(int dtype, void *y, double a, const void *x, int64_t n);
    /* *out = sum x², accumulated in double */
    int (*sum_squares)(int dtype, const void *x, int64_t n, double *out);
    /* *out = 1 when every element is finite */
    int (*all_finite)(int dtype, const void *x, int64_t n, int *out);
    /* *first = the smallest i in [0, n) whose buffer (dtypes[i], ptrs[i], lens[i] elements) holds a NaN or
       an infinity, n when none: one pass over many buffers (the post-update weight check, the gradients) */
    int (*first_nonfinite)(int n, const int *dtypes, const void *const *ptrs, const int64_t *lens, int *first);

    /* reductions; ARGMAX writes int64; out has outer*inner elements */
    int (*reduce)(int op, int dtype, void *out, const void *x, int64_t outer, int64_t red, int64_t inner);
    /* gradient of max: gx[o, r, i] = gy[o, i] at the first r attaining y[o, i], else 0 */
    int (*reduce_max_backward)(int dtype, void *gx, const void *gy, const void *x, const void *y,
                               int64_t outer, int64_t red, int64_t inner);

    /* C = alpha op(A) op(B) + beta C, row-major; op(A) is [M, K], op(B) is [K, N]; ld* are row
       strides of the stored (untransposed) matrices. batched: `batch` products with element
       strides sa, sb, sc between them (sb = 0 shares B) */
    int (*gemm)(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc);
    int (*gemm_batched)(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                        const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                        double beta, void *C, int64_t ldc, int64_t sc, int64_t batch);

    /* x viewed as [outer, n_src, inner], idx [n_idx] -> out [outer, n_idx, inner] */
    int (*index_select)(int dtype, void *out, const void *x, const void *idx, int idx_dtype,
                        int64_t outer, int64_t n_src, int64_t inner, int64_t n_idx);
    /* gx [outer, n_dst, inner] += gy [outer, n_idx, inner] at rows idx (the backward of index_select) */
    int (*index_add)(int dtype, void *gx, const void *gy, const void *idx, int idx_dtype,
                     int64_t outer, int64_t n_dst, int64_t inner, int64_t n_idx);
    /* out[o, j, i] = x[o, idx[o, j, i], i];  x [outer, n_x, inner], idx and out [outer, n_idx, inner] */
    int (*gather)(int dtype, void *out, const void *x, const void *idx, int idx_dtype,
                  int64_t outer, int64_t n_x, int64_t n_idx, int64_t inner);
    /* out[o, idx[o, j, i], i] += src[o, j, i];  out [outer, n_out, inner] */
    int (*scatter_add)(int dtype, void *out, const void *src, const void *idx, int idx_dtype,
                       int64_t outer, int64_t n_out, int64_t n_idx, int64_t inner);
    /* every index in [0, n); *bad gets the first offending value when not. defer = 1: the kernels that read these
       indices are safe with any value (they read 0 and write nowhere out of range), so a backend may record a
       problem on the device and report it, named by `what`, at its next synchronisation instead of waiting here
       (*ok = 1 then); defer = 0 (the indices address memory, as 2D RoPE positions do): answer now */
    int (*check_index)(const char *what, const void *idx, int idx_dtype, int64_t count, int64_t n, int defer,
                       int64_t *bad, int *ok);

    /* normalisation over the last dim of x [N, C]; rstd (and mean) [N] saved for backward;
       backward writes dx and ACCUMULATES into dw (and db) */
    int (*rmsnorm)(int dtype, void *out, void *rstd, const void *x, const void *w, int64_t N, int64_t C,
                   double eps);
    int (*rmsnorm_backward)(int dtype, void *dx, void *dw, const void *dout, const void *x,
                            const void *w, const void *rstd, int64_t N, int64_t C);
    int (*layernorm)(int dtype, void *out, void *mean, void *rstd, const void *x, const void *w,
                     const void *b, int64_t N, int64_t C, double eps);
    int (*layernorm_backward)(int dtype, void *dx, void *dw, void *db, const void *dout, const void *x,
                              const void *w, const void *mean, const void *rstd, int64_t N, int64_t C);

    /* (log_)softmax over the last dim of [N, C]; backward from y = the forward output */
    int (*softmax)(int dtype, void *y, const void *x, int64_t N, int64_t C, int log);
    int (*softmax_backward)(int dtype, void *dx, const void *dy, const void *y, int64_t N, int64_t C,
                            int log);

    /* per-token cross-entropy: loss[n] = w_n (lse_n - logits[n, t_n]); valid[n] = w_n (1 when
       weights is NULL) or 0 when t_n == ignore; lse saved. Targets out of [0, V) (not ignore) fail. */
    int (*cross_entropy)(int dtype, void *loss, void *valid, void *lse, const void *logits,
                         const void *targets, int tdtype, const void *weights, int64_t N, int64_t V,
                         int64_t ignore);
    /* dlogits[n, :] = dloss[n] * w_n * (softmax(logits[n]) - onehot(t_n)); 0 for ignored rows */
    int (*cross_entropy_backward)(int dtype, void *dlogits, const void *dloss, const void *logits,
                                  const void *lse, const void *targets, int tdtype, const void *weights,
                                  int64_t N, int64_t V, int64_t ignore);
    /* per-token log-prob of the given token and the entropy over logits [N, V] (spec: the token_logprobs
       comment in engine/tide.h): lse_n = log Σ_v exp(logits[n, v]), logp[n] = logits[n, t_n] - lse_n,
       entropy[n] = -Σ_v p_v log p_v; 0 and 0 when t_n == ignore (lse still written). logp, entropy and lse are
       f32 for bf16 logits, else the logits' dtype. Targets out of [0, V) (not ignore) fail. */
    int (*token_logprobs)(int dtype, void *logp, void *entropy, void *lse, const void *logits,
                          const void *targets, int tdtype, int64_t N, int64_t V, int64_t ignore);
    /* dlogits[n, j] = dlogp[n] ([j == t_n] - p_j) - dentropy[n] p_j (log p_j + entropy[n]), p = softmax(logits[n]);
       0 for ignored rows; dlogp or dentropy NULL counts as zero (the stats' dtype as in the forward) */
    int (*token_logprobs_backward)(int dtype, void *dlogits, const void *dlogp, const void *dentropy,
                                   const void *logits, const void *lse, const void *entropy, const void *targets,
                                   int tdtype, int64_t N, int64_t V, int64_t ignore);

    /* rotary embedding on [B, T, H, D], pairs (i, i + D/2), angle (pos0 + t) * theta^(-2i/D);
       inverse = 1 rotates by the negative angle (the backward) */
    int (*rope)(int dtype, void *out, const void *x, int64_t B, int64_t T, int64_t H, int64_t D,
                double theta, int64_t pos0, int inverse);
    /* 2D RoPE (spec/vision.md §4) on x [T, H, hd], hd % 4 == 0, with pos [T, 2] = (row, col) per token (pos_dtype
       i32/i64, values in [0, 512): checked by the caller): complex slot j in [0, hd/2) rotates the adjacent pair
       (x[2j], x[2j+1]) by φ = p · theta^(−4⌊j/2⌋/hd), p = col for even j, row for odd j; inverse = 1 rotates by −φ
       (the backward). out may alias x. */
    int (*rope2d)(int dtype, void *out, const void *x, const void *pos, int pos_dtype, int64_t T, int64_t H,
                  int64_t hd, double theta, int inverse);
    /* the position table resampled bicubically to each image's grid (spec/vision.md §4; PyTorch's
       interpolate(mode="bicubic", align_corners=False), a = −0.75, clamped border taps): table [Gh, Gw, d],
       grids HOST int64 [n, 2] of (h, w) -> out [Σ h·w, d], image i's [h_i, w_i, d] in raster order after image
       i − 1's; an image with (h, w) = (Gh, Gw) is a copy. backward OVERWRITES dtable [Gh, Gw, d] with the
       transposed weights applied to dout, in a fixed order (no atomics). */
    int (*pos_interp)(int dtype, void *out, const void *table, const int64_t *grids, int64_t n, int64_t Gh,
                      int64_t Gw, int64_t d);
    int (*pos_interp_backward)(int dtype, void *dtable, const void *dout, const int64_t *grids, int64_t n,
                               int64_t Gh, int64_t Gw, int64_t d);

    /* softmax attention per (batch*head) on q [BH, Tq, D], k, v [BH, Tk, D]; lse [BH, Tq] saved.
       causal: query i sees keys j <= i + (Tk - Tq) */
    int (*attention)(int dtype, void *out, void *lse, const void *q, const void *k, const void *v,
                     int64_t BH, int64_t Tq, int64_t Tk, int64_t D, int causal, double scale);
    int (*attention_backward)(int dtype, void *dq, void *dk, void *dv, const void *dout, const void *q,
                              const void *k, const void *v, const void *out, const void *lse,
                              int64_t BH, int64_t Tq, int64_t Tk, int64_t D, int causal, double scale);

    /* Kimi Delta Attention (spec/kda.md §3-§6) on q, k, g [B, T, H, dk], v [B, T, H, dv], beta [B, T, H],
       o [B, T, H, dv]; states [B, H, dk, dv] in f32 when dtype is bf16, else in dtype (s0 NULL = zeros,
       s_out may be NULL). cu: HOST int64 [n_seg + 1], boundaries over the flattened B·T tokens, every row
       start included: the state restarts at zero at each segment start, except the first segment of row b
       which starts from s0[b]; s_out[b] is the state after row b's last token.
       path (tide.h): TIDE_KDA_CHUNK factorises the decay and must fail (naming the value) on any g < lb,
       unless lb is -inf (tests use that to show the overflow); TIDE_KDA_CHUNK_SAFE forms exp(G_r - G_j)
       per pair; TIDE_KDA_RECURRENT runs the token recurrence. chunk is C for the chunk paths.
       backward: gradients of every input from gout [B, T, H, dv] and gs_out (NULL = zero); any gradient
       pointer may be NULL when not wanted.
       ckpt (chunk paths, when kda_ckpt_chunks > 0 and a backward will follow, else NULL; the backward then
       computes its own): the forward writes the start state of every
       kda_ckpt_chunks-th chunk of each segment and the backward reads them instead of recomputing them;
       layout [Σ_seg ceil(chunks(seg) / kda_ckpt_chunks), H, dk, dv], segments in order, state dtype. */
    int (*kda)(int dtype, void *o, void *s_out, const void *q, const void *k, const void *v, const void *g,
               const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T,
               int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk, double lb, void *ckpt);
    int (*kda_backward)(int dtype, void *gq, void *gk, void *gv, void *gg, void *gbeta, void *gs0,
                        const void *gout, const void *gs_out, const void *q, const void *k, const void *v,
                        const void *g, const void *beta, const void *s0, const int64_t *cu, int64_t n_seg,
                        int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk,
                        double lb, const void *ckpt);
    /* chunks between the state checkpoints above; 0 = this backend keeps none (its backward recomputes
       every chunk start state itself). A backend may place its checkpoints more densely within that count
       (the CUDA one runs chunks of at most 16 tokens, however large chunk is) but never needs more. */
    int kda_ckpt_chunks;
    /* one KDA decoding step of R rows over their own states, no gradient (spec/kda.md §3, §7): q, k, g [R, H, dk],
       v and o [R, H, dv], beta [R, H]; states: a HOST array of R device pointers, row r's state [H, dk, dv] in the
       state dtype (f32 for bf16 inputs), updated in place. The token recurrence of the kda recurrent path on each
       (row, head), so a row's output and state do not depend on R or on the other rows. */
    int (*kda_decode_rows)(int dtype, void *o, const void *q, const void *k, const void *v, const void *g,
                           const void *beta, void *const *states, int64_t R, int64_t H, int64_t dk, int64_t dv);
    /* KDA gate (kda.md §2) over z [N, H, D], A_log [H], dt_bias [H·D]; form TIDE_KDA_GATE_BOUNDED:
       g = lb σ(e^{A_h}(z + b)); TIDE_KDA_GATE_SOFTPLUS: g = -e^{A_h} softplus(z + b). backward writes gz
       and OVERWRITES gA [H] and gb [H·D] (sums over N); any of the three may be NULL */
    int (*kda_gate)(int dtype, void *g, const void *z, const void *A_log, const void *dt_bias, int64_t N,
                    int64_t H, int64_t D, double lb, int form);
    int (*kda_gate_backward)(int dtype, void *gz, void *gA, void *gb, const void *gg, const void *z,
                             const void *A_log, const void *dt_bias, int64_t N, int64_t H, int64_t D,
                             double lb, int form);
    /* depthwise causal conv over time, x and out [B, T, C], w [C, K]:
       out[b,t,c] = Σ_j w[c,j] x[b, t-K+1+j, c]; positions before the start of t's segment read 0, except
       in the first segment of a row, which reads cache [B, K-1, C] (NULL = zeros) before t = 0. cu as for
       kda (host). silu: out = silu(conv). backward writes gx, gcache and OVERWRITES gw [C, K] (any may be
       NULL), recomputing the pre-activation when silu is set */
    int (*causal_conv1d)(int dtype, void *out, const void *x, const void *w, const void *cache,
                         const int64_t *cu, int64_t n_seg, int64_t B, int64_t T, int64_t C, int64_t K, int silu);
    int (*causal_conv1d_backward)(int dtype, void *gx, void *gw, void *gcache, const void *gout, const void *x,
                                  const void *w, const void *cache, const int64_t *cu, int64_t n_seg, int64_t B,
                                  int64_t T, int64_t C, int64_t K, int silu);
    /* one causal-conv decoding step of R rows over their own histories, no gradient: x and out [R, C] (one token a
       row), w [C, K]; caches: a HOST array of R device pointers, row r's history [K-1, C] (its previous K-1 inputs,
       oldest first), advanced IN PLACE (shifted by one token, x[r] appended). out[r] is bitwise what causal_conv1d
       gives for the row's token alone with that history as its cache, whatever R or the other rows. */
    int (*conv_decode_rows)(int dtype, void *out, const void *x, const void *w, void *const *caches, int64_t R,
                            int64_t C, int64_t K, int silu);

    /* MLA attention (spec/mla.md §4, §5) on q [B, Tq, H, dn + dr], kn [B, Tk, H, dn], kr [B, Tk, dr] (shared by
       the heads; NULL when dr = 0), v [B, Tk, H, dv] -> out [B, Tq, H, dv] and the row log-sum-exp lse
       [B, H, Tq] (f32 when dtype is bf16). Query i of row b sees key j iff j <= i + (Tk − Tq) and, when cu is
       given (HOST int64 boundaries over the flattened B·T tokens, every row start included; only with
       Tq = Tk), j is in i's segment. A query that sees no key gets out 0 and lse −inf. Tiled with an online
       softmax: no [Tq, Tk] buffer. backward: gq, gkn, gkr (summed over heads), gv from gout, recomputing the
       probabilities from lse; any gradient pointer may be NULL. */
    int (*mla_attention)(int dtype, void *out, void *lse, const void *q, const void *kn, const void *kr,
                         const void *v, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk,
                         int64_t H, int64_t dn, int64_t dr, int64_t dv, double scale);
    int (*mla_attention_backward)(int dtype, void *gq, void *gkn, void *gkr, void *gv, const void *gout,
                                  const void *q, const void *kn, const void *kr, const void *v, const void *out,
                                  const void *lse, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq,
                                  int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, double scale);
    /* mla_attention read from the latent: q [B, Tq, H, dn + dr], c [B, Tk, dc], kr [B, Tk, dr] (NULL when dr = 0),
       w [H, dn + dv, dc] (per head W_UK^h then W_UV^h: k_n^h = W_UK^h c, v^h = W_UV^h c) -> out [B, Tq, H, dv] and
       lse [B, H, Tq], the mla_attention of the expanded keys and values (same masks: query i on key i + Tk − Tq, cu
       over the keys), expanding `chunk` keys at a time so no [B, Tk, H, dn + dv] tensor exists. backward: gq, gc,
       gkr, gw (any may be NULL) from gout, out and lse, re-expanding chunk by chunk. NULL on a backend without it
       (the caller expands the keys and values itself). */
    int (*mla_latent_attention)(int dtype, void *out, void *lse, const void *q, const void *c, const void *kr,
                                const void *w, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk,
                                int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc, int64_t chunk, double scale);
    int (*mla_latent_attention_backward)(int dtype, void *gq, void *gc, void *gkr, void *gw, const void *gout,
                                         const void *q, const void *c, const void *kr, const void *w, const void *out,
                                         const void *lse, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq,
                                         int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc,
                                         int64_t chunk, double scale);
    /* one absorbed MLA decoding step of R rows over their own latent caches (spec/mla.md §6), no gradient. c_bufs,
       kr_bufs: HOST arrays of R device pointers, row r's latent buffer [cap_r, dc] and rope-key buffer [cap_r, dr]
       (kr_bufs NULL when dr = 0); lens: HOST int64 [R], the tokens each row has cached. Row r's new latent
       c_new[r] [dc] (k_r: kr_new[r] [dr]) is written at position lens[r] of its buffers (c_new and kr_new NULL:
       the buffers hold it already, and several rows may share one buffer), then its queries qt[r]
       [H, dc], qr[r] [H, dr] attend over the lens[r] + 1 cached tokens: out[r, h] = Σ_t p_t c_t with
       p = softmax_t(scale (qt·c_t + qr·kr_t)), every row and head in an order fixed by its own length alone. */
    int (*mla_decode_rows)(int dtype, void *out, const void *qt, const void *qr, const void *c_new, const void *kr_new,
                           void *const *c_bufs, void *const *kr_bufs, const int64_t *lens, int64_t R, int64_t H,
                           int64_t dc, int64_t dr, double scale);
    /* varlen attention (spec/vision.md §3, §5): bidirectional softmax attention over packed sequences, q, k, v and
       out [T, H, D], lse [H, T] (f32 when dtype is bf16). cu: HOST int64 [n_seg + 1] boundaries over the T tokens,
       from 0 to T, non-decreasing (an empty segment is a repeated boundary). Query i sees exactly the keys of its
       segment. The MLA kernels above without the causal limit: tiled with an online softmax, no [T, T] buffer.
       backward: gq, gk, gv (any may be NULL) from gout, recomputing the probabilities from lse. */
    int (*varlen_attention)(int dtype, void *out, void *lse, const void *q, const void *k, const void *v,
                            const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale);
    int (*varlen_attention_backward)(int dtype, void *gq, void *gk, void *gv, const void *gout, const void *q,
                                     const void *k, const void *v, const void *out, const void *lse, const int64_t *cu,
                                     int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale);

    /* Attention Residuals (spec/attnres.md §1, §4): srcs is a HOST array of n source pointers, each [rows, d];
       w, nu [d]. out [rows, d] = Σ_i p_i v_i with p = softmax_i(r_i (w ⊙ nu)·v_i), r_i = (mean v_i² + eps)^-1/2.
       stats [2, n, rows] (f32 when dtype is bf16, else dtype): p, then r, for the backward (it recomputes the
       scores from them). backward writes gsrcs[i] (an entry, or the whole array, may be NULL: not wanted) and
       OVERWRITES gw, gnu [d] (either may be NULL) with sums over rows in a fixed order (no float atomics). */
    int (*attnres)(int dtype, void *out, void *stats, const void *const *srcs, int64_t n, int64_t rows, int64_t d,
                   const void *w, const void *nu, double eps);
    int (*attnres_backward)(int dtype, void *const *gsrcs, void *gw, void *gnu, const void *gout,
                            const void *const *srcs, const void *stats, int64_t n, int64_t rows, int64_t d,
                            const void *w, const void *nu);

    /* sparse MoE (spec/moe.md). situ_glu: out = k_gate tanh(g/k_gate) σ(g) · k_lin tanh(u/k_lin) (§6), backward dg, du.
       topk over the last dim of x [rows, C]: values [rows, k] descending, indices int64, ties to the lowest index.
       moe_experts (§8): x [m, d_in], sel [m, k] (sel_dtype i32/i64, every id in [0, n)), p [m, k], w_gate_up
       [n, 2 d_e, d_in], w_down [n, d_out, d_e] -> out [m, d_out]; writes route (int64, in device memory)
       [perm (m·k) | pos (m·k) | offsets (n + 1)] of the stable sort by (expert, t, slot), pre [m·k, 2 d_e]
       (gate | up pre-activations, sorted rows) and y [m·k, d_out] (expert outputs, sorted rows); rows past
       offsets[n] are unused. capacity < 0: dropless; else each expert keeps its first `capacity` rows and
       *dropped (host) gets the count of the others. act: TIDE_MOE_SITU or TIDE_MOE_SWIGLU. host_off (host memory,
       n + 1 int64; may be NULL) gets a copy of the offsets, for the backward: given it back, a backend whose route
       lives in device memory needs no read of the offsets (CUDA: no stream synchronisation in the backward). NULL
       (the op passes it when no backward will follow) lets such a backend keep them on the device: CUDA's forward
       of a small dropless batch then runs without a synchronisation (launch.h TIDE_MOE_DEVICE_ROWS). The
       backward writes dx, dp and OVERWRITES dw_gate_up, dw_down (any may be NULL), reducing in a fixed order. */
    int (*situ_glu)(int dtype, void *out, const void *g, const void *u, int64_t n, double k_gate, double k_lin);
    int (*situ_glu_backward)(int dtype, void *dg, void *du, const void *dout, const void *g, const void *u, int64_t n,
                             double k_gate, double k_lin);
    int (*topk)(int dtype, void *values, int64_t *indices, const void *x, int64_t rows, int64_t C, int64_t k);
    int (*moe_experts)(int dtype, void *out, int64_t *route, void *pre, void *y, const void *x, const void *sel,
                       int sel_dtype, const void *p, const void *w_gate_up, const void *w_down, int64_t m, int64_t k,
                       int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate, double k_lin,
                       int64_t capacity, int64_t *dropped, int64_t *host_off);
    int (*moe_experts_backward)(int dtype, void *dx, void *dp, void *dw_gate_up, void *dw_down, const void *du,
                                const int64_t *route, const int64_t *host_off, const void *pre, const void *y,
                                const void *x, const void *p, const void *w_gate_up, const void *w_down, int64_t m,
                                int64_t k, int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate,
                                double k_lin);

    /* AdamW in place (optim.md §2); bc1 = 1 - beta1^(t+1), bc2 = 1 - beta2^(t+1). nonfinite: NULL, or one int in
       the device's memory set to 1 (never cleared) when a stored value of p, m or v is a NaN or an infinity */
    int (*adamw)(int dtype, void *p, const void *g, void *m, void *v, int *nonfinite, int64_t n, double lr,
                 double beta1, double beta2, double eps, double wd, double bc1, double bc2);

    /* collectives over a process group of an MPI job for this device's tensors (engine/dist/comm.c calls them for
       non-CPU tensors; the CPU's own path is MPI in comm.c, so the CPU table leaves them NULL). g: the group
       (tide_dist_grp: the world, or a dp / ep / cp group of a layout); ranks, peers and roots are the group's.
       dist_allreduce_sum: data [n] of dtype f32/f64 summed in place in the group's rank order (the chain of comm.c:
       ((x_0 + x_1) + x_2) + ...), receiving into scratch (n elements of the device's memory) or, when it is NULL,
       into a buffer of its own; dist_broadcast: root's nbytes to every rank; dist_send / dist_recv: nbytes to /
       from one rank; dist_init: the device's communicator of the group set up now (the others set it up on first
       use), *world its rank count. */
    int (*dist_allreduce_sum)(const tide_dist_grp *g, int dtype, void *data, int64_t n, void *scratch);
    int (*dist_init)(const tide_dist_grp *g, int *world);
    /* dist_allgather: every rank's nbytes of send, concatenated in rank order into recv (size · nbytes);
       dist_alltoallv: send_bytes[r] bytes from send + send_off[r] to rank r, recv_bytes[r] from rank r into
       recv + recv_off[r] (one grouped exchange) */
    int (*dist_allgather)(const tide_dist_grp *g, const void *send, void *recv, int64_t nbytes);
    int (*dist_alltoallv)(const tide_dist_grp *g, const void *send, const int64_t *send_bytes, const int64_t *send_off,
                          void *recv, const int64_t *recv_bytes, const int64_t *recv_off);
    int (*dist_broadcast)(const tide_dist_grp *g, void *data, int64_t nbytes, int root);
    int (*dist_send)(const tide_dist_grp *g, const void *data, int64_t nbytes, int peer);
    int (*dist_recv)(const tide_dist_grp *g, void *data, int64_t nbytes, int peer);
    /* the side stream of the gradient buckets (engine/dist/reducer.c), so their sums run beside the backward; NULL
       where collectives block the calling thread (the CPU: its buckets sum on a helper thread). comm_fork: the
       calling thread's collectives go on the side stream from now on, after everything the main stream has been
       given so far; comm_back: back to the main stream; comm_join: the main stream waits for the side stream. The
       side stream must allocate nothing: the engine's block cache does not follow streams (hence dist_allreduce_sum's
       scratch). */
    int (*comm_fork)(void);
    int (*comm_back)(void);
    int (*comm_join)(void);
} tide_backend;

/* the tables; the CUDA one exists only when built with CUDA (TIDE_HAVE_CUDA) */
extern const tide_backend tide_cpu_backend;
#ifdef TIDE_HAVE_CUDA
extern const tide_backend tide_cuda_backend;
int tide_cuda_runtime_device_count(void);     /* 0 when no driver / GPU */
const char *tide_cuda_runtime_info(void);
int tide_cuda_runtime_mem_info(int device, int64_t *free_bytes, int64_t *total_bytes);   /* cudaMemGetInfo */
#endif

/* set the thread-local error message (engine/error.c); returns -1 so kernels can `return tide_set_error(...)` */
int tide_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* kernel scratch from the engine's caching allocator (engine/alloc.c): counted in the memory statistics and
   the limit, served from cached blocks, and retried once after the cache is emptied when the device is full.
   NULL with the error set on failure. Free by pointer, on the device it came from. tide_scratch_live: the
   bytes of scratch blocks not yet freed (tests). */
void *tide_scratch_alloc(int device, size_t nbytes);
void tide_scratch_free(int device, void *p);
int64_t tide_scratch_live(int device);

#ifdef __cplusplus
}
#endif
#endif

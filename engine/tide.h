/*
 * tide.h — the one public header of the tide engine.
 *
 * Lua reads the text between the TIDE_CDEF_BEGIN and TIDE_CDEF_END markers with ffi.cdef, so that
 * part holds plain C declarations only: no macros, no preprocessor lines, literal array sizes.
 *
 * Conventions (DESIGN.md):
 *  - Every fallible function returns NULL (pointers) or a non-zero status (int) and sets a thread-local
 *    message readable with tide_last_error(). Nothing aborts on user input.
 *  - Tensors are reference counted. A function returning a tensor returns a NEW reference the caller
 *    owns (release with tide_tensor_release); tensors passed as arguments are borrowed.
 *  - Indices are 0-based. Negative dims count from the end (-1 = last).
 *  - Ops record a node on the autograd graph when grad mode is on and an input requires grad.
 */
#ifndef TIDE_H
#define TIDE_H
#include <stdint.h>
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif

/* TIDE_CDEF_BEGIN */

/* ---- dtypes and devices -------------------------------------------------------------------- */
typedef enum {
    TIDE_F32 = 0, TIDE_F64 = 1, TIDE_BF16 = 2, TIDE_I32 = 3, TIDE_I64 = 4, TIDE_U8 = 5,
    TIDE_DTYPE_COUNT = 6
} tide_dtype;

/* device: 0 = cpu, 1 + n = cuda:n */
enum { TIDE_CPU = 0, TIDE_CUDA0 = 1 };

const char *tide_dtype_name(int dtype);          /* "f32", ... ; NULL when out of range */
int tide_dtype_from_name(const char *name);      /* -1 when unknown */
size_t tide_dtype_size(int dtype);               /* 0 when out of range */

/* ---- errors ---------------------------------------------------------------------------------- */
const char *tide_last_error(void);               /* "" when none */
void tide_clear_error(void);
void tide_set_error_str(const char *msg);        /* lets front ends report through the same channel */

/* ---- tensors ---------------------------------------------------------------------------------- */
struct tide_storage;                             /* opaque: bytes on one device, reference counted */
struct tide_node;                                /* opaque: autograd graph node */

typedef struct tide_tensor {
    int32_t dtype;                /* tide_dtype */
    int32_t device;               /* 0 = cpu, 1+n = cuda:n */
    int32_t ndim;                 /* 0..8; 0 = scalar */
    int32_t requires_grad;        /* leaf flag set by the user, or 1 on outputs of recorded ops */
    int64_t shape[8];
    int64_t stride[8];            /* in elements */
    int64_t offset;               /* in elements, from the storage base */
    int64_t numel;
    int32_t refcount;
    int32_t out_index;            /* which output of `node` this tensor is */
    struct tide_storage *storage;
    struct tide_tensor *grad;     /* accumulated gradient of a leaf (owned), or NULL */
    struct tide_node *node;       /* the op that made it (owned reference), NULL for leaves */
    int32_t grad_slot;            /* a leaf watched by a gradient reducer: its index + 1 there (0: none) */
    int32_t grad_pending;         /* during a backward: the graph's uses of this watched leaf not yet run */
} tide_tensor;

void tide_tensor_retain(tide_tensor *t);
void tide_tensor_release(tide_tensor *t);        /* NULL is fine */
int tide_is_contiguous(const tide_tensor *t);
int64_t tide_tensor_nbytes(const tide_tensor *t);  /* numel * dtype size */
/* stable identity of the underlying bytes (for "do these share storage" checks) */
const void *tide_tensor_storage_id(const tide_tensor *t);

/* creation (no autograd history; requires_grad = 0) */
tide_tensor *tide_empty(int dtype, int ndim, const int64_t *shape, int device);
tide_tensor *tide_zeros(int dtype, int ndim, const int64_t *shape, int device);
tide_tensor *tide_ones(int dtype, int ndim, const int64_t *shape, int device);
tide_tensor *tide_full(int dtype, int ndim, const int64_t *shape, int device, double value);
tide_tensor *tide_arange(int dtype, double start, double end, double step, int device);
tide_tensor *tide_randn(int dtype, int ndim, const int64_t *shape, int device, double mean, double std);
tide_tensor *tide_rand(int dtype, int ndim, const int64_t *shape, int device, double lo, double hi);
/* values given as doubles, converted to dtype (integers must be exact) */
tide_tensor *tide_from_f64(int dtype, int ndim, const int64_t *shape, int device, const double *values);
/* raw little-endian bytes in the tensor's own dtype; nbytes must equal numel * dtype size */
tide_tensor *tide_from_bytes(int dtype, int ndim, const int64_t *shape, int device, const void *bytes, size_t nbytes);

/* explicit copies out of / into tensor memory (the only way front ends touch tensor bytes). Every double the
   engine hands out (to_f64_buffer, item, sum_squares) is canonical: any NaN is +NaN 0x7FF8000000000000, as
   LuaJIT needs. read_bytes copies bytes as stored, NaN payloads included: read its float values through
   tide_canon_f64 / tide_canon_f32, never with a plain buf[i]. */
int tide_to_f64_buffer(const tide_tensor *t, double *out, int64_t n);      /* n must equal numel */
int tide_read_bytes(const tide_tensor *t, void *out, size_t nbytes);       /* row-major, tensor dtype */
int tide_write_bytes(tide_tensor *t, const void *bytes, size_t nbytes);    /* into a contiguous tensor */
double tide_item(const tide_tensor *t);                                    /* numel must be 1; NaN + error otherwise */
/* p[i] as a canonical double (a NaN of any payload becomes +NaN); the buffer form rewrites p[0..n) in place */
double tide_canon_f64(const double *p, int64_t i);
double tide_canon_f32(const float *p, int64_t i);
void tide_canon_f64_buffer(double *p, int64_t n);

/* in-place, never recorded on the graph (optimiser and initialisation work) */
int tide_fill_(tide_tensor *t, double value);
int tide_copy_(tide_tensor *dst, const tide_tensor *src);   /* same shape; converts dtype/device */
int tide_randn_(tide_tensor *t, double mean, double std);
int tide_rand_(tide_tensor *t, double lo, double hi);
int tide_scale_(tide_tensor *t, double s);                  /* t *= s */
int tide_axpy_(tide_tensor *y, double a, const tide_tensor *x);   /* y += a x, same shape */
/* sum of squares of all elements, accumulated in double; NaN/inf propagate (a NaN as the canonical +NaN) */
int tide_sum_squares(const tide_tensor *t, double *out);
int tide_all_finite(const tide_tensor *t);                  /* 1, 0, or -1 on error */
/* *first = the smallest i whose tensor ts[i] holds a NaN or an infinity, n when all are finite (NULL entries
   are skipped): one fused pass per device over all the tensors; 0, or -1 on error */
int tide_first_nonfinite(tide_tensor *const *ts, int n, int *first);

/* ---- autograd ---------------------------------------------------------------------------------- */
int tide_set_requires_grad(tide_tensor *t, int flag);      /* leaves only */
int tide_backward(tide_tensor *loss, const tide_tensor *grad);  /* grad NULL: loss must have numel 1 */
int tide_grad_enabled(void);
int tide_set_grad_enabled(int on);                          /* returns the previous value */
tide_tensor *tide_detach(tide_tensor *t);                   /* shares storage, no history */
void tide_zero_grad(tide_tensor *t);                        /* drops t->grad */
tide_tensor *tide_grad(tide_tensor *t);                     /* new reference to t->grad or NULL */
int tide_set_grad(tide_tensor *t, tide_tensor *g);          /* replaces t->grad (g borrowed) */
/* recompute regions: nodes recorded between begin and end keep their inputs, not their saved
   activations or intermediate outputs; backward replays the region's forward first. Regions nest
   as a single region (inner begin/end pairs are counted). */
int tide_recompute_begin(void);
int tide_recompute_end(void);
int64_t tide_graph_live_nodes(void);                        /* for leak tests */

/* ---- RNG (Philox 4x32-10, counter based) -------------------------------------------------------- */
void tide_manual_seed(uint64_t seed);
void tide_rng_get(uint64_t *seed, uint64_t *offset);
void tide_rng_set(uint64_t seed, uint64_t offset);
/* the raw stream, for tests and for Lua-side sampling: n uniforms in [0,1) from (seed, offset) */
void tide_philox_uniform(uint64_t seed, uint64_t offset, double *out, int64_t n);

/* ---- Quantile Balancing's host arithmetic (spec/moe.md §4.1; engine/balance.c), on row-major double arrays ---- */
/* mu [m·n] = s − c_t, c_t the (k+1)-th largest s_t + b over the experts allowed[t·n + j] != 0 (allowed NULL: all) */
int tide_qb_margins(const double *s, const double *b, int64_t m, int64_t n, int64_t k, const uint8_t *allowed,
                    double *mu);
/* theta [n]: column j's (1 − k/n) quantile of mu, linearly interpolated / its bare (⌊m·k/n⌋ + 1)-th largest */
int tide_qb_theta_exact(const double *mu, int64_t m, int64_t n, int64_t k, double *theta);
int tide_qb_theta_order_statistic(const double *mu, int64_t m, int64_t n, int64_t k, double *theta);
/* counts [n·bins] of the required bias −mu over [lo, hi) in uniform bins, the values outside in the edge bins */
int tide_qb_histogram(const double *mu, int64_t m, int64_t n, double lo, double hi, int64_t bins, int64_t *counts,
                      int64_t *clamped);

/* ---- memory ---------------------------------------------------------------------------------- */
typedef struct tide_memory_stats {
    int64_t current;              /* bytes held by live storages */
    int64_t peak;                 /* max of current since start or last reset */
    int64_t cached;               /* bytes held in the allocator's free lists */
    int64_t limit;                /* 0 = none; allocations that would exceed it fail with an error */
    int64_t n_alloc;              /* allocations served */
    int64_t n_cache_hits;
} tide_memory_stats;
int tide_memory_stats_get(int device, tide_memory_stats *out);
void tide_memory_reset_peak(int device);
void tide_memory_empty_cache(int device);
int tide_memory_set_limit(int device, int64_t bytes);
/* the device's memory as the system reports it: *free_bytes available to a new allocation (CPU: /proc/meminfo's
   MemAvailable; CUDA: cudaMemGetInfo's free), *total_bytes its size; the engine's cached blocks count as used */
int tide_device_memory(int device, int64_t *free_bytes, int64_t *total_bytes);
int64_t tide_live_tensors(void);

/* ---- runtime ---------------------------------------------------------------------------------- */
const char *tide_version(void);
const char *tide_build_info(void);                          /* "Release, gcc 12.2.0, commit 1a2b3c4d5e6f" */
int tide_num_threads(void);
void tide_set_num_threads(int n);
/* batch-invariant mode: CPU matrix products give each output row the bits it gets in a one-row product (a fixed
   reduction order per element, whatever the batch); slower than BLAS at large sizes. Returns the previous value.
   Decode steps run in it (nn: a row's logits do not depend on the rows that share its step). CUDA ignores it. */
int tide_set_batch_invariant(int on);
int tide_batch_invariant(void);
const char *tide_blas_info(void);                           /* e.g. "OpenBLAS 0.3.21 Haswell openmp" */
/* the OpenBLAS kernels (an OPENBLAS_CORETYPE name) this CPU should load instead of the generic fallback OpenBLAS
   chose, NULL when OPENBLAS_CORETYPE is set or the detected kernels stand; read by the tide executable at start */
const char *tide_blas_core_hint(void);
int tide_cuda_available(void);                              /* 1 when built with CUDA and a GPU is present */
int tide_cuda_device_count(void);
const char *tide_cuda_info(void);                           /* build/runtime summary, never NULL */
int tide_mpi_available(void);                               /* 1 when built with MPI */
double tide_time_now(void);                                 /* monotonic seconds */

/* ---- ops: creation of views and layout (differentiable) ----------------------------------------- */
tide_tensor *tide_reshape(tide_tensor *x, int ndim, const int64_t *shape);  /* one -1 allowed */
tide_tensor *tide_permute(tide_tensor *x, int ndim, const int *perm);
tide_tensor *tide_transpose(tide_tensor *x, int d0, int d1);
tide_tensor *tide_slice(tide_tensor *x, int dim, int64_t start, int64_t end, int64_t step);  /* view */
/* dim `dim` of the view t set to len in place, inside its storage (t held once, no graph; -1 + error otherwise) */
int tide_view_set_length(tide_tensor *t, int dim, int64_t len);
tide_tensor *tide_contiguous(tide_tensor *x);               /* new reference; x itself if contiguous */
tide_tensor *tide_expand(tide_tensor *x, int ndim, const int64_t *shape);    /* broadcast view */
tide_tensor *tide_concat(int n, tide_tensor **xs, int dim);
int tide_split(tide_tensor *x, int dim, int n, const int64_t *sizes, tide_tensor **outs);
tide_tensor *tide_index_select(tide_tensor *x, int dim, tide_tensor *index);  /* index i32/i64 1-D */
tide_tensor *tide_gather(tide_tensor *x, int dim, tide_tensor *index);        /* index same ndim as x */
tide_tensor *tide_scatter_add(tide_tensor *x, int dim, tide_tensor *index, tide_tensor *src);
tide_tensor *tide_to_dtype(tide_tensor *x, int dtype);
tide_tensor *tide_to_device(tide_tensor *x, int device);

/* ---- ops: elementwise ---------------------------------------------------------------------------- */
/* binary ops broadcast numpy-style */
tide_tensor *tide_add(tide_tensor *a, tide_tensor *b);
tide_tensor *tide_sub(tide_tensor *a, tide_tensor *b);
tide_tensor *tide_mul(tide_tensor *a, tide_tensor *b);
tide_tensor *tide_div(tide_tensor *a, tide_tensor *b);
tide_tensor *tide_add_scalar(tide_tensor *x, double s);
tide_tensor *tide_mul_scalar(tide_tensor *x, double s);
tide_tensor *tide_pow_scalar(tide_tensor *x, double p);
tide_tensor *tide_neg(tide_tensor *x);
tide_tensor *tide_exp(tide_tensor *x);
tide_tensor *tide_log(tide_tensor *x);
tide_tensor *tide_sqrt(tide_tensor *x);
tide_tensor *tide_rsqrt(tide_tensor *x);
tide_tensor *tide_tanh(tide_tensor *x);
tide_tensor *tide_sigmoid(tide_tensor *x);
tide_tensor *tide_silu(tide_tensor *x);
tide_tensor *tide_gelu(tide_tensor *x);                     /* tanh approximation (GPT-2) */
/* the exact GELU 0.5 x (1 + erf(x / sqrt 2)) (vision.md §6: the projector's; the ViT MLP uses tide_gelu) */
tide_tensor *tide_gelu_erf(tide_tensor *x);
tide_tensor *tide_softplus(tide_tensor *x);
tide_tensor *tide_relu(tide_tensor *x);
tide_tensor *tide_abs(tide_tensor *x);
tide_tensor *tide_swiglu(tide_tensor *gate, tide_tensor *up);   /* silu(gate) * up, fused */

/* ---- ops: reductions (dims: list of n dims; n = 0 means all) -------------------------------------- */
tide_tensor *tide_sum(tide_tensor *x, int n, const int *dims, int keepdim);
tide_tensor *tide_mean(tide_tensor *x, int n, const int *dims, int keepdim);
tide_tensor *tide_max(tide_tensor *x, int dim, int keepdim);        /* gradient to the first argmax */
tide_tensor *tide_argmax(tide_tensor *x, int dim, int keepdim);     /* i64, not differentiable */
tide_tensor *tide_logsumexp(tide_tensor *x, int dim, int keepdim);

/* ---- ops: linear algebra ------------------------------------------------------------------------ */
/* a [..., M, K] (or [..., K, M] when ta), b [..., K, N] (or [..., N, K] when tb); batch dims of a and b
   must be equal, or b may be 2-D (shared across the batch: a Linear layer is matmul(x, W, 0, 1)) */
tide_tensor *tide_matmul(tide_tensor *a, tide_tensor *b, int ta, int tb);
/* x [..., in] Wᵀ + bias: weight [out, in] (HuggingFace layout), bias [out] or NULL; the bias rides in the GEMM */
tide_tensor *tide_linear(tide_tensor *x, tide_tensor *weight, tide_tensor *bias);

/* ---- ops: neural network ------------------------------------------------------------------------- */
tide_tensor *tide_embedding(tide_tensor *weight, tide_tensor *ids);        /* weight [V, d], ids int */
tide_tensor *tide_rmsnorm(tide_tensor *x, tide_tensor *weight, double eps);  /* over the last dim */
tide_tensor *tide_layernorm(tide_tensor *x, tide_tensor *weight, tide_tensor *bias, double eps);
tide_tensor *tide_softmax(tide_tensor *x, int dim);
tide_tensor *tide_log_softmax(tide_tensor *x, int dim);
/* logits [N, V], targets int [N], weights [N] float or NULL. reduction: 0 = weighted mean over
   non-ignored tokens, 1 = sum, 2 = none ([N], zero at ignored tokens) */
tide_tensor *tide_cross_entropy(tide_tensor *logits, tide_tensor *targets, tide_tensor *weights,
                                int64_t ignore_index, int reduction);
/* per-token log-probs of given tokens, fused (the RL objectives' input): logits [..., V] (f32, f64; bf16 on cuda),
   targets int [...] (i32/i64, in [0, V) or ignore_index). *logp [...] = logits[t] - logsumexp(logits) and
   *entropy [...] = -Σ_v p_v log p_v (p = softmax(logits)), both 0 where the target is ignore_index (and no gradient
   there); f32 for bf16 logits, else the logits' dtype. Two reads of each row (max, then the sums), no [N, V]
   buffer; backward: dlogits = dlogp (onehot(t) - p) - dentropy p (log p + entropy). Returns 0, or -1 with the
   error set. */
int tide_token_logprobs(tide_tensor *logits, tide_tensor *targets, int64_t ignore_index, tide_tensor **logp,
                        tide_tensor **entropy);
/* rotary embedding on x [B, T, H, D] (D even, pairs (i, i + D/2)), positions pos0 + t */
tide_tensor *tide_rope(tide_tensor *x, double theta, int64_t pos0);
/* 2D RoPE of the ViT encoder (vision.md §4, MoonViT's adjacent-pair layout) on x [T, H, head_dim] (head_dim % 4 == 0)
   with pos an i32/i64 tensor [T, 2] of (row, col) per token (any device; values in [0, 512), the spec's table limit):
   complex slot j in [0, head_dim/2) rotates (x[2j], x[2j+1]) by φ = p · theta^(−4⌊j/2⌋/head_dim), p = col for even
   j, row for odd j. Returns the rotated [T, H, head_dim]; the backward rotates by −φ (pos gets no gradient). */
tide_tensor *tide_rope2d(tide_tensor *x, tide_tensor *pos, double theta);
/* the learnable absolute position table resampled to each image's patch grid (vision.md §4): table [G, G, d]
   (any [Gh, Gw, d]), grids an int tensor [n, 2] of (h, w) per image (any device; 1 <= h, w <= 65536). Returns
   [Σ h_i·w_i, d]: image i's table resampled to [h_i, w_i, d] in raster order, images concatenated. PyTorch's
   interpolate(table.permute(2, 0, 1)[None], size = (h, w), mode = "bicubic", align_corners = False): a = −0.75,
   source index (dst + 0.5)·G/h − 0.5, taps clamped at the borders; (h, w) = (Gh, Gw) copies the table bitwise.
   The gradient of the table applies the transposed weights in a fixed order (deterministic). */
tide_tensor *tide_pos_interp(tide_tensor *table, tide_tensor *grids);
/* q [B, H, Tq, D], k/v [B, H, Tk, D]; causal aligns the last query with the last key */
tide_tensor *tide_attention(tide_tensor *q, tide_tensor *k, tide_tensor *v, int causal, double scale);

/* ---- ops: Kimi Delta Attention (spec/kda.md) ------------------------------------------------------ */
/* kernel paths of tide_kda:
   CHUNK      chunks of `chunk` tokens with the intra-chunk decay factorised exp(G_r)·exp(-G_j), so every
              block is one dense matmul; valid only for a lower-bounded decay: needs lower_bound <= g <= 0
              and chunk·|lower_bound| <= 80 (700 in f64; kda.md §5), and fails naming the first g outside [lb, 0];
   CHUNK_SAFE the same chunk form with per-pair exp(G_r - G_j): any g <= 0 (the unbounded softplus gate);
   RECURRENT  the token recurrence (kda.md §3): the reference, and the decode step. */
enum { TIDE_KDA_CHUNK = 0, TIDE_KDA_CHUNK_SAFE = 1, TIDE_KDA_RECURRENT = 2 };
/* o [B, T, H, dv] and the final state [B, H, dk, dv] from q, k, g [B, T, H, dk], v [B, T, H, dv],
   beta [B, T, H] (q, k already L2-normalised, q scaled). s0 [B, H, dk, dv] or NULL (zeros).
   cu_seqlens: NULL, or an int tensor [n + 1] of document boundaries over the flattened B·T tokens
   (0 = c_0 < c_1 < ... < c_n = B·T; row starts are boundaries whether listed or not). The state restarts
   at zero at every document start, except the first document of row b, which starts from s0[b]; the
   final state of row b is the state after its last token. States are f32 when the inputs are bf16.
   One graph node with two outputs; returns 0 or -1. */
int tide_kda(tide_tensor *q, tide_tensor *k, tide_tensor *v, tide_tensor *g, tide_tensor *beta, tide_tensor *s0,
             tide_tensor *cu_seqlens, int path, int chunk, double lower_bound, tide_tensor **o, tide_tensor **state);
/* each row's (h_ext | M) for context parallelism (long_context.md §5): the final state [B, H, dk, dv + dk] of
   tide_kda on [v | 0] from s0 = [0 | I] (h_ext: the row's state from zero; M: its transition), q, k, v, g, beta, the
   boundaries and the options as there. The node keeps only its inputs: the widened v, the start state and the
   kernel's checkpoints are rebuilt (the call rerun) by the backward, which takes the gradient of the pairs. */
tide_tensor *tide_kda_pairs(tide_tensor *q, tide_tensor *k, tide_tensor *v, tide_tensor *g, tide_tensor *beta,
                            tide_tensor *cu_seqlens, int path, int chunk, double lower_bound);
/* the KDA decay gate over z [..., H, D] with A_log [H] and dt_bias [H, D] or [H·D] (kda.md §2):
   form 0 (lower-bounded): g = lower_bound · sigmoid(exp(A_log_h) · (z + dt_bias)), g in [lower_bound, 0];
   form 1 (softplus, Kimi Linear): g = -exp(A_log_h) · softplus(z + dt_bias) (lower_bound unused) */
enum { TIDE_KDA_GATE_BOUNDED = 0, TIDE_KDA_GATE_SOFTPLUS = 1 };
tide_tensor *tide_kda_gate(tide_tensor *z, tide_tensor *A_log, tide_tensor *dt_bias, double lower_bound, int form);
/* depthwise causal convolution over time: x [B, T, C], w [C, K] -> [B, T, C],
   y[b,t,c] = sum_j w[c,j] x[b, t-K+1+j, c]; positions before the start of t's document read 0, except in
   the first document of a row, which reads cache [B, K-1, C] (NULL = zeros) for positions before t = 0.
   cu_seqlens as for tide_kda. silu != 0 applies SiLU to the result (fused: nothing extra is stored). */
tide_tensor *tide_causal_conv1d(tide_tensor *x, tide_tensor *w, tide_tensor *cache, tide_tensor *cu_seqlens, int silu);
/* one causal-conv decoding step of R rows over their own histories, no gradient: x [R, C] or [R, 1, C] (one token a
   row), w [C, K]; caches[r] [1, K-1, C] or [K-1, C] (row r's previous K-1 inputs), contiguous, x's dtype, each row's
   own memory, advanced IN PLACE (shifted by one token, x[r] appended) -> out shaped as x. Row r's output is bitwise
   tide_causal_conv1d's for its token alone with caches[r] as the cache (and the history what that call's last
   K-1 inputs are), whatever R. */
tide_tensor *tide_conv_decode_rows(tide_tensor *x, tide_tensor *w, int R, tide_tensor **caches, int silu);
/* scale · x / sqrt(sum(x²) + eps) over the last dim (kda.md §1.3: eps on the SUM of squares) */
tide_tensor *tide_l2norm(tide_tensor *x, double eps, double scale);

/* ---- ops: MLA attention (spec/mla.md) ---------------------------------------------------------- */
/* causal attention of gated NoPE MLA (mla.md §1, §4, §5): q [B, Tq, H, dn + dr] (the rope slot last, not
   rotated), k_n [B, Tk, H, dn], k_r [B, Tk, dr] (one rope-slot key shared by every head; NULL when dr = 0),
   v [B, Tk, H, dv]; score = (q_n·k_n + q_r·k_r)·scale. Query i of a row sees key j iff j <= i + (Tk − Tq)
   and, with cu_seqlens (only when Tq = Tk; boundaries over the flattened B·T tokens as for tide_kda), j is
   in i's document. Tiled with an online softmax: no [Tq, Tk] buffer, memory linear in T. Returns o
   [B, Tq, H, dv]; the gradient of k_r is summed over heads. */
tide_tensor *tide_mla_attention(tide_tensor *q, tide_tensor *k_n, tide_tensor *k_r, tide_tensor *v, tide_tensor *cu_seqlens,
                                double scale);
/* tide_mla_attention of the keys and values expanded from the latent c [B, Tk, dc]: k_n^h = W_UK^h c, v^h =
   W_UV^h c, with w [H, dn + dv, dc] (each head's W_UK^h rows, then its W_UV^h rows: the kv up-projection's weight
   [H·(dn + dv), dc] viewed as [H, dn + dv, dc]); q [B, Tq, H, dn + dr], k_r [B, Tk, dr] or NULL, cu_seqlens over
   the keys, scale as there. The keys and values are expanded `chunk` keys at a time (chunk >= 1) and never
   exist whole, forward or backward (memory: the inputs, the output and one chunk's expansion); gradients reach q,
   c, k_r and w. The cpu backend has it (f32, f64). */
tide_tensor *tide_mla_latent_attention(tide_tensor *q, tide_tensor *c, tide_tensor *k_r, tide_tensor *w,
                                       tide_tensor *cu_seqlens, double scale, int64_t chunk);
/* one KDA decoding step of R rows over their own states (kda.md §3, §7), no gradient: q, k, g [R, H, dk], v
   [R, H, dv], beta [R, H] (one token per row); states[r] [1, H, dk, dv] or [H, dk, dv], contiguous, in the state
   dtype (f32 for bf16), each row's own memory, advanced IN PLACE -> o [R, H, dv]. Row r's output and new state are
   bitwise what tide_kda's recurrent path gives for its token alone (s0 = its state). */
tide_tensor *tide_kda_decode_rows(tide_tensor *q, tide_tensor *k, tide_tensor *v, tide_tensor *g, tide_tensor *beta,
                                  int R, tide_tensor **states);
/* one absorbed decoding step of R rows over their own latent caches (mla.md §6), no gradient: row r's new latent
   c_new[r] ([R, 1, dc] or [R, dc]; k_r: kr_new [R, 1, dr]) is written at position lens[r] of its buffers c_bufs[r]
   ([1, cap, dc] or [cap, dc], contiguous, cap > lens[r]; kr_bufs[r] likewise, both NULL when dr = 0), then its
   queries qt [R, H, dc], qr [R, H, dr] attend over the lens[r] + 1 cached tokens -> out [R, H, dc]. A row's
   result depends on its own inputs alone, in a fixed order, whatever R or the other rows' lengths. c_new and
   kr_new NULL: the buffers hold each row's new token at lens[r] already (nothing is written; rows may then share
   a buffer: the T queries of one sequence, the exact prefill of the decode path). */
tide_tensor *tide_mla_decode_rows(tide_tensor *qt, tide_tensor *qr, tide_tensor *c_new, tide_tensor *kr_new, int R,
                                  tide_tensor **c_bufs, tide_tensor **kr_bufs, const int64_t *lens, double scale);

/* ---- ops: varlen attention (spec/vision.md §3, §5) ---------------------------------------------- */
/* bidirectional (not causal) softmax attention over packed images: q, k, v [T, H, D] (one float dtype, one
   device), cu_seqlens int32/int64 [n + 1] from 0 to T, non-decreasing (a repeated boundary is an empty
   segment). Query i sees exactly the keys of its segment (block-diagonal mask), score q·k·scale (finite;
   the vision encoder uses D^-1/2). Tiled with an online softmax (the MLA kernels without the causal limit):
   no [T, T] buffer, memory linear in T. Returns o [T, H, D]; gradients for q, k and v. */
tide_tensor *tide_varlen_attention(tide_tensor *q, tide_tensor *k, tide_tensor *v, tide_tensor *cu_seqlens, double scale);

/* ---- ops: Attention Residuals (spec/attnres.md) --------------------------------------------------- */
/* the AttnRes mix (attnres.md §1) of n >= 1 sources of one shape [..., d] (same dtype and device), with the
   pseudo-query w [d] and the key-RMSNorm gain nu [d], per token:
     r_i = (mean_c v_i[c]² + eps)^-1/2,  s_i = r_i ((w ⊙ nu) · v_i),  p = softmax_i(s),  out = Σ_i p_i v_i
   (the values are the raw sources). eps >= 0; with eps = 0 an all-zero source has no score. One graph node
   with n + 2 inputs; the gradients of w and nu are summed over tokens (§4). Returns out [..., d]. */
tide_tensor *tide_attnres(int n, tide_tensor **sources, tide_tensor *w, tide_tensor *nu, double eps);

/* ---- ops: sparse MoE (spec/moe.md) --------------------------------------------------------------- */
/* SiTU-GLU (moe.md §6): h = k_gate tanh(g/k_gate) σ(g) ⊙ k_lin tanh(u/k_lin), σ on the uncapped g; |h| <= k_gate
   k_lin. K3: k_gate = 4, k_lin = 25; both > 0 (large values approach SwiGLU). g, u one shape. */
tide_tensor *tide_situ_glu(tide_tensor *g, tide_tensor *u, double k_gate, double k_lin);
/* the k largest entries over the last dim of x [..., C] (1 <= k <= C), descending; ties go to the lowest index
   (moe.md §2). values [..., k] (differentiable: the gradient goes to the selected positions), indices i64
   [..., k] (not differentiable). One graph node; returns 0 or -1. */
int tide_topk(tide_tensor *x, int k, tide_tensor **values, tide_tensor **indices);
/* the routed experts of a MoE layer as one node (moe.md §7, §8): x [m, d_in] (tokens, already in the latent
   width for LatentMoE), sel [m, k] int expert ids (not differentiable), p [m, k] routing weights, w_gate_up
   [n, 2·d_e, d_in] (per expert the gate rows, then the up rows; [out, in]), w_down [n, d_out, d_e]:
     u[t] = Σ_slot p[t, slot] · W_down[e] act(W_gate[e] x_t, W_up[e] x_t),  e = sel[t, slot],
   act = SiTU-GLU (k_gate, k_lin) or SwiGLU. Assignments are sorted stably by expert; the combine adds the
   slots in order (no atomics): bitwise reproducible. capacity_factor = 0: dropless; > 0: each expert keeps its
   first ceil(capacity_factor·m·k/n) assignments in (t, slot) order and the rest contribute 0; *dropped (may be
   NULL) gets the number dropped. The node saves the sort, the gate/up pre-activations and the expert outputs
   (the activation is recomputed in backward). Gradients: x, p, w_gate_up, w_down. Returns u [m, d_out]. */
enum { TIDE_MOE_SITU = 0, TIDE_MOE_SWIGLU = 1 };
tide_tensor *tide_moe_experts(tide_tensor *x, tide_tensor *sel, tide_tensor *p, tide_tensor *w_gate_up,
                              tide_tensor *w_down, int activation, double k_gate, double k_lin, double capacity_factor,
                              int64_t *dropped);
/* the same with the capacity given as a count of assignments per expert (0: dropless): expert parallelism's owner
   applies the whole expert-parallel batch's capacity to the rows that reached it (spec/moe.md §9) */
tide_tensor *tide_moe_experts_capacity(tide_tensor *x, tide_tensor *sel, tide_tensor *p, tide_tensor *w_gate_up,
                                       tide_tensor *w_down, int activation, double k_gate, double k_lin, int64_t capacity,
                                       int64_t *dropped);

/* ---- optimiser kernels (in place, no graph) -------------------------------------------------------- */
/* one AdamW update (optim.md §2); step = number of updates done before this one (0-based) */
int tide_adamw_step_(tide_tensor *param, const tide_tensor *grad, tide_tensor *m, tide_tensor *v,
                     double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step);
/* the same update, and nonfinite (an i32 tensor of one element on param's device) set to 1 when a stored value of
   param, m or v is a NaN or an infinity: tested in the update's own pass, never cleared, so one flag serves every
   parameter of a step and the step reads it once (the post-update guard, optim.md §2) */
int tide_adamw_step_checked_(tide_tensor *param, const tide_tensor *grad, tide_tensor *m, tide_tensor *v,
                             double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                             tide_tensor *nonfinite);

/* ---- files (engine/io: file.c, safetensors.c, shards.c; formats.md §1, §3, §6) ----------------- */
/* Small file-system helpers. Atomic writes go to "<path>.tmp", are fsynced, renamed over <path>, and
   the directory is fsynced, so a crash at any instant leaves either the old or the new file. */
int tide_file_write_atomic(const char *path, const void *bytes, size_t n);
int tide_file_write_text_atomic(const char *path, const char *text);  /* strlen(text) bytes */
/* streaming form of the same (large files written piece by piece); abort removes the .tmp file */
typedef struct tide_atomic_file tide_atomic_file;
tide_atomic_file *tide_atomic_open(const char *path);
int tide_atomic_write(tide_atomic_file *f, const void *bytes, size_t n);
int tide_atomic_commit(tide_atomic_file *f);               /* fsync, rename, fsync dir; frees f */
void tide_atomic_abort(tide_atomic_file *f);               /* frees f; NULL is fine */
int tide_mkdir_p(const char *path);                        /* like mkdir -p, mode 0755 */
int tide_path_exists(const char *path);                    /* 1 or 0 */
int tide_is_dir(const char *path);                         /* 1 or 0 */
int64_t tide_file_size(const char *path);                  /* -1 + error when it cannot be stat'ed */
int tide_fsync_dir(const char *dir);
/* rename(from, to) and fsync the directories of both (a directory may be renamed too) */
int tide_rename_atomic(const char *from, const char *to);
/* removes a file or a directory tree (symlinks are removed, not followed); a missing path is fine */
int tide_remove_tree(const char *path);
/* names in a directory (no "." / ".."), sorted bytewise, each followed by a NUL byte; *n = total bytes.
   Returns a buffer to free with tide_free (an empty directory gives a 1-byte buffer and *n = 0). */
char *tide_list_dir(const char *path, size_t *n);
/* opens path for reading when it is a regular file (or a link to one); a directory, FIFO, device or socket is
   refused without blocking, in one line: "<what> '<path>' is a FIFO (named pipe), not a regular file". Returns
   the descriptor (the caller closes it) with the size in *size (may be NULL), or -1 + error. Every reader of
   the engine opens its files through it. */
int tide_open_regular(const char *path, const char *what, int64_t *size);
/* the whole file, NUL-terminated (not counted in *n); max_bytes = 0 means no limit. Regular files only
   (tide_open_regular). Free with tide_free. */
char *tide_read_file(const char *path, size_t *n, size_t max_bytes);
/* the decompressed bytes of a single-member .gz file (engine/io/gunzip.c), NUL-terminated (not counted in *n);
   header, CRC-32 and size trailer checked; at most max_bytes out (0 = 256 MiB, at most 1 GiB). Free with tide_free. */
char *tide_gunzip_file(const char *path, size_t max_bytes, size_t *n);
void tide_free(void *p);
/* a text file as a u8 tensor [n] on the CPU (byte-level tokenizer input); an empty file is an error */
tide_tensor *tide_text_read_bytes(const char *path);

/* safetensors (formats.md §1). Writing: tensors in the given order, any dtype/device/layout; names
   unique and not "__metadata__"; metadata_json: a JSON object of string values, or NULL for none.
   The file is written atomically. */
int tide_safetensors_save(const char *path, int n, const char *const *names, tide_tensor *const *tensors,
                          const char *metadata_json);
/* Reading: the file is validated as hostile input when opened (header size and shape, JSON, dtypes,
   shapes, offsets, exact coverage of the data buffer); tensor bytes are read on demand by _get. */
typedef struct tide_safetensors tide_safetensors;
tide_safetensors *tide_safetensors_open(const char *path);
/* the same from bytes in memory (copied); label names the source in error messages */
tide_safetensors *tide_safetensors_open_memory(const void *bytes, size_t n, const char *label);
int tide_safetensors_count(const tide_safetensors *h);              /* tensors, in header order */
const char *tide_safetensors_name(const tide_safetensors *h, int i);  /* NULL + error when out of range */
int tide_safetensors_find(const tide_safetensors *h, const char *name);  /* index or -1 (no error set) */
const char *tide_safetensors_dtype(const tide_safetensors *h, int i);    /* safetensors name, "F32" */
/* shape into shape[0..8); returns ndim (may exceed 8: only the first 8 are written), -1 on error */
int tide_safetensors_shape(const tide_safetensors *h, int i, int64_t *shape);
/* a new tensor holding tensor i's bytes on `device`; dtypes tide lacks (F16, I8, BOOL, ...) are errors */
tide_tensor *tide_safetensors_get(const tide_safetensors *h, int i, int device);
const char *tide_safetensors_metadata(const tide_safetensors *h);    /* JSON text; "{}" when absent */
void tide_safetensors_close(tide_safetensors *h);                    /* NULL is fine */

/* llm.c token shards (formats.md §3): a 256 x int32 header (magic, version, count) then the tokens.
   width 2 writes GPT-2 shards (magic 20240520, version 1, uint16; every token must be < 65536),
   width 4 Llama-3 shards (magic 20240801, version 7, uint32). Atomic. */
int tide_shard_write(const char *path, const uint32_t *tokens, int64_t n, int width);
/* the same from a 1-D i32/i64 tensor on any device */
int tide_shard_write_tensor(const char *path, const tide_tensor *tokens, int width);
/* token count from a validated header (magic, version, file size = 1024 + count x width); -1 on error */
int64_t tide_shard_count(const char *path);
/* tokens [start, start + count) as an i32 tensor on the CPU; every token must be < vocab_size
   (vocab_size 0 skips that check). tide_shard_read reads them all. */
tide_tensor *tide_shard_read_range(const char *path, int64_t start, int64_t count, int64_t vocab_size);
tide_tensor *tide_shard_read(const char *path, int64_t vocab_size);
/* a headerless file of little-endian uint16 (width 2) or uint32 (width 4) tokens (nanoGPT .bin) */
tide_tensor *tide_raw_tokens_read(const char *path, int width, int64_t vocab_size);

/* ---- byte-level BPE tokenizers (engine/io/bpe*.c; formats.md §4) ---------------------------------- */
/* A HuggingFace tokenizer.json (model BPE, pre_tokenizer ByteLevel or Sequence [Split(GPT-2 or Llama-3 regex),
   ByteLevel], decoder ByteLevel, no normalizer), read as hostile input: every problem is a one-line error naming
   the file and the field. Encoding gives the ids the tokenizers library gives (added tokens are split out of
   the text; its post_processor, truncation and padding are not applied). One tokenizer serves one thread at a
   time; tide_bpe_encode_docs runs on all threads itself. */
typedef struct tide_bpe tide_bpe;
tide_bpe *tide_bpe_load(const char *path);
tide_bpe *tide_bpe_load_memory(const char *json, size_t n, const char *label);   /* label names it in errors */
void tide_bpe_free(tide_bpe *b);                                                   /* NULL is fine */
int64_t tide_bpe_vocab_size(const tide_bpe *b);            /* the largest id + 1 */
const char *tide_bpe_sha256(const tide_bpe *b);            /* hex SHA-256 of the file's bytes */
const char *tide_bpe_pretokenizer(const tide_bpe *b);      /* "gpt2", "llama3" or "none" */
const char *tide_bpe_json(const tide_bpe *b, size_t *n);   /* the file's bytes (what save writes) */
/* the id of a token string: an added token first, then model.vocab; -1 when there is none (no error set) */
int32_t tide_bpe_token_id(const tide_bpe *b, const char *token, size_t n);
const char *tide_bpe_token(const tide_bpe *b, int32_t id, size_t *n);   /* NULL + error for an unused id */
int tide_bpe_added_count(const tide_bpe *b);
int32_t tide_bpe_added(const tide_bpe *b, int i, int *special);         /* id of added token i (file order) */
/* the ids of text[0, n): their count (only the first cap are written to out), -1 + error */
int64_t tide_bpe_encode(tide_bpe *b, const char *text, size_t n, int32_t *out, int64_t cap);
/* the ids of documents text[offsets[d], offsets[d + 1]) for d < n_docs, each preceded by sep_id when sep_id >= 0,
   concatenated in one array (free with tide_free) of *n_out ids; doc_starts (n_docs + 1 entries, may be NULL)
   receives where each document's ids begin. split_special 1 splits the special added tokens out of the text as
   tide_bpe_encode does; 0 reads their names as text (training documents: a literal "<|endoftext|>" never becomes
   a document boundary). Documents (and long ones in chunks) are encoded on all threads. */
int32_t *tide_bpe_encode_docs(tide_bpe *b, const char *text, const int64_t *offsets, int64_t n_docs, int32_t sep_id,
                              int split_special, int64_t *doc_starts, int64_t *n_out);
/* the bytes of ids (the ByteLevel decoder; specials skipped when skip_special): their count (only the first cap
   are written), -1 + error for an id outside the vocabulary */
int64_t tide_bpe_decode(const tide_bpe *b, const int32_t *ids, int64_t n, int skip_special, char *out, int64_t cap);
/* hex SHA-256 of bytes into out (65 bytes with the NUL) */
int tide_sha256_hex(const void *bytes, size_t n, char *out);

/* byte-level BPE training (GPT-2 pre-tokenizer): count the pre-tokens of documents (all threads), then merge the
   most frequent adjacent pair (ties: the smaller ids) until the vocabulary has vocab_size ids or no pair occurs
   min_frequency times. Ids: 0-255 the bytes, then the special tokens (added tokens too), then the merges. */
typedef struct tide_bpe_trainer tide_bpe_trainer;
tide_bpe_trainer *tide_bpe_trainer_new(const char *const *specials, int n_specials);
int tide_bpe_trainer_add_docs(tide_bpe_trainer *t, const char *text, const int64_t *offsets, int64_t n_docs);
int64_t tide_bpe_trainer_words(const tide_bpe_trainer *t);       /* distinct pre-tokens counted so far */
int64_t tide_bpe_trainer_vocab_size(const tide_bpe_trainer *t);  /* ids so far */
/* up to max_merges more merges toward vocab_size: the number made (0: done), -1 + error */
int64_t tide_bpe_trainer_merge(tide_bpe_trainer *t, int64_t vocab_size, int64_t min_frequency, int64_t max_merges);
/* the trained tokenizer as tokenizer.json text (free with tide_free) */
char *tide_bpe_trainer_json(const tide_bpe_trainer *t, size_t *n);
void tide_bpe_trainer_free(tide_bpe_trainer *t);

/* the `field` string of every JSONL document in buf[0, n) (formats.md §5: one object per line, blank lines
   skipped, 64 MiB per line, depth 64; errors "<label>:<line>: ..."): the texts concatenated (free with tide_free),
   *offsets (n_docs + 1 entries, free with tide_free) where each begins. Lines are parsed on all threads. */
char *tide_jsonl_texts(const char *buf, size_t n, const char *field, const char *label, int64_t **offsets,
                       int64_t *n_docs);

/* ---- images (engine/io/image.c, vision.md §2): PNG and JPEG -> a u8 tensor [H, W, 3] on the CPU ------------- */
/* Hostile input: regular files only, at most 64 MiB; the header's size is checked before any pixel memory is
   allocated: each side <= max_side (0 = the default and hard cap, 16,384) and W x H <= 64 Mi pixels. Always
   8-bit RGB (alpha dropped, grey and palette expanded, 16-bit channels reduced to their high byte). Errors are
   one line naming the file (or label) and the reason. */
tide_tensor *tide_image_read(const char *path, int64_t max_side);
/* the same from bytes in memory (a JSONL/base64 image); label names the source in error messages */
tide_tensor *tide_image_decode_memory(const void *bytes, size_t n, const char *label, int64_t max_side);

/* ---- distributed (engine/dist/comm.c): MPI for CPU tensors when built with MPI ------------------------ */
/* Initialises MPI when the build has it and the process was started by mpirun (or MPI is otherwise
   requested); a single process without MPI is rank 0 of 1. Safe to call more than once. */
int tide_dist_init(void);
int tide_dist_rank(void);
int tide_dist_world_size(void);
/* in-place sum across ranks of a contiguous CPU float tensor, in rank order (((x_0 + x_1) + x_2) + ...: bitwise
   reproducible, and equal to accumulating the ranks' parts in order in one process); a no-op with one rank */
int tide_dist_allreduce_sum_(tide_tensor *t);
int tide_dist_reduce_to_last_(tide_tensor *t);   /* the rank-order sum on the last rank only (reduce-scatter's half) */
int tide_dist_reduce_to_last_group_(int group, tide_tensor *t);   /* the same over a process group */
/* the communicator of a device's tensors set up now (CUDA: NCCL bootstrapped over MPI; CPU: MPI itself); *world: its
   ranks. Without the backend's collectives (a build without NCCL) an error naming the device */
int tide_dist_device_init(int device, int *world);
/* every rank's `in` concatenated in rank order into out (world x in's elements; same dtype and device) */
int tide_dist_allgather_(tide_tensor *out, const tide_tensor *in);
/* all-to-all with per-rank counts (elements of the tensors' dtype): send_counts[r] elements of send, taken in rank
   order, go to rank r; recv_counts[r] from rank r land in recv in rank order (expert parallelism's token exchange) */
int tide_dist_alltoallv_(const tide_tensor *send, const int64_t *send_counts, tide_tensor *recv, const int64_t *recv_counts);
/* bytes this rank has handed to the network since the start (sends, and broadcasts at their root) */
int64_t tide_dist_bytes_sent(void);
/* in-place copy of root's tensor to every rank */
int tide_dist_broadcast_(tide_tensor *t, int root);
/* point to point: t's bytes to rank dst; rank src's bytes into t (contiguous CPU tensors of the same size) */
int tide_dist_send_(tide_tensor *t, int dst);
int tide_dist_recv_(tide_tensor *t, int src);
int tide_dist_barrier(void);
/* process groups (a layout's dp, ep and cp groups): a collective over the world, where the ranks passing the same
   color (>= 0) form one group, numbered in world order; returns the group's id (>= 1; 0 is the world) or -1. The
   *_group_ collectives run over one group, CPU tensors over MPI and device tensors over the device's communicator
   of the group (CUDA: one NCCL communicator a group, made on the group's first device collective). */
int tide_dist_group_split(int color);
int tide_dist_group_rank(int group);
int tide_dist_group_size(int group);
int tide_dist_group_member(int group, int rank);      /* the world rank of the group's rank */
int tide_dist_allreduce_sum_group_(int group, tide_tensor *t);
int tide_dist_allgather_group_(int group, tide_tensor *out, const tide_tensor *in);
int tide_dist_alltoallv_group_(int group, const tide_tensor *send, const int64_t *send_counts, tide_tensor *recv,
                               const int64_t *recv_counts);
/* the all-to-all as a differentiable op: rows of x (its first dim) to the group's ranks, send_rows[r] to rank r in
   rank order; recv_rows[r] rows arrive from rank r, stacked in rank order. Its gradient is the reverse exchange
   (expert parallelism's dispatch and combine, spec/moe.md §9) */
tide_tensor *tide_alltoallv(tide_tensor *x, int group, int n_ranks, const int64_t *send_rows, const int64_t *recv_rows);
/* 1 once tide_dist_init has joined a job of more than one rank (it never initialises MPI itself) */
int tide_dist_active(void);
/* ---- gradient buckets reduced while the backward runs (engine/dist/reducer.c; DESIGN.md §9) ----
   new(n, params, bucket_bytes): f32/f64 leaves of one device, in buckets of about bucket_bytes in reverse order (the
   backward finishes the last parameters first); arm(): the next backward reports each parameter's gradient as final
   when the last node that uses it has run, a full bucket is copied and summed over the ranks in rank order on a
   helper thread (CPU; a GPU's sums are queued on its side stream, in bucket order) while the backward goes on; finish(): every bucket left (parameters without a gradient count zeros) is
   summed, the thread joined, the sums written into the gradients (a missing one created). Every rank calls
   arm/finish once per step, whatever its loss. The sums are tide_dist_allreduce_sum_'s bit for bit.
   stats[5]: [0] seconds of reduction, [1] of it before the backward ended, [2] buckets, [3] 1 when a helper thread
   ran, [4] buckets whose gradients were all final before the backward ended (the rest filled at finish) */
typedef struct tide_reducer tide_reducer;
tide_reducer *tide_reducer_new(int n, tide_tensor **params, int64_t bucket_bytes);
int tide_reducer_arm(tide_reducer *r);
/* ZeRO-2: owner[i] the rank that keeps parameter i's sum (the buckets are then reduced to the last rank, which sends
   each owner its parameters' sums at finish; the others' gradients are dropped); NULL: all-reduce again */
int tide_reducer_set_owners(tide_reducer *r, const int *owner);
/* on: the backward itself exchanges with other process groups (expert and context parallelism), so the helper thread
   runs only where MPI gives MPI_THREAD_MULTIPLE (else finish sums the buckets: the same sums, no overlap) */
int tide_reducer_set_concurrent(tide_reducer *r, int on);
int tide_reducer_finish(tide_reducer *r, double *stats);
void tide_reducer_free(tide_reducer *r);
/* ends every rank of the job at once (MPI_Abort): a rank that failed, so the others do not wait on it */
void tide_dist_abort(int code);
void tide_dist_finalize(void);

/* ---- op registry (for tests, the REPL and tools) --------------------------------------------------- */
int tide_op_count(void);
const char *tide_op_name(int op);
/* the op profiler (tide.profile): per op, calls and self seconds (host wall time inside the op less the ops it ran
   itself; on CUDA the launch, the kernels run asynchronously) of its forwards, backwards and recompute replays, in
   that order in seconds[3] / calls[3]. Off by default; set returns the previous state */
int tide_profile_set(int on);
void tide_profile_reset(void);
int tide_profile_read(int op, double *seconds, int64_t *calls);

/* TIDE_CDEF_END */

#ifdef __cplusplus
}
#endif
#endif /* TIDE_H */

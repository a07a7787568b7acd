/*
 * internal.h — what engine files share and the public header does not show: storage, graph nodes,
 * the op registry, and small helpers for writing ops (DESIGN.md §4, §5).
 */
#ifndef TIDE_INTERNAL_H
#define TIDE_INTERNAL_H
#include <stdint.h>
#include <stddef.h>
#include "tide.h"
#include "../kernels/backend.h"

#define TIDE_MAX_DIMS 8

/* ---- storage --------------------------------------------------------------------------------- */
struct tide_storage {
    void *data;                   /* device pointer (64-byte aligned on the CPU) */
    size_t nbytes;                /* bytes requested */
    size_t capacity;              /* bytes of the cached block (size class) */
    int device;
    int refcount;
};

struct tide_storage *tide_storage_new(int device, size_t nbytes);   /* NULL + error on OOM */
void tide_storage_release(struct tide_storage *s);

/* allocator (alloc.c): raw blocks with accounting */
void *tide_alloc_block(int device, size_t nbytes, size_t *capacity);
void tide_free_block(int device, void *p, size_t capacity, size_t nbytes);
/* test hook: sentinel bytes around every block from now on, checked when the block is released (only before
   the first allocation; -1 + error after it). violations: how many released blocks had a sentinel changed,
   *last the message of the latest ("a 96-byte block on cpu was written outside its bounds: ...") */
int tide_alloc_guard_enable(void);
int64_t tide_alloc_guard_violations(const char **last);

/* ---- dispatch (dispatch.c) ----------------------------------------------------------------------- */
/* the backend table of a device; NULL + error when the device is unknown or not built */
const tide_backend *tide_backend_for(int device);
/* "cpu" or "cuda:N" into buf */
const char *tide_device_str(int device, char *buf, size_t n);
/* 0 when `device` has a backend whose entry at entry_offset is non-NULL; else -1 with the error
   "<op>: no <entry> kernel on the <backend> backend (device <dev>)" (or "<op>: <why the device has none>") */
int tide_kernel_missing(int device, size_t entry_offset, const char *entry, const char *op);
/* THE path from engine/ to a kernel: calls backend entry `entry` of `device` with the remaining arguments,
   or returns -1 (error set, see tide_kernel_missing) when the device has no such kernel. Every backend
   call in engine/ goes through it; TIDE_KERNEL_MISSING is its check, for the entries that return no status. */
#define TIDE_KERNEL_MISSING(device, entry, opname) \
    tide_kernel_missing((device), offsetof(tide_backend, entry), #entry, (opname))
#define TIDE_DISPATCH(device, entry, opname, ...) \
    (TIDE_KERNEL_MISSING(device, entry, opname) ? -1 : tide_backend_for(device)->entry(__VA_ARGS__))
/* test hook: route `device` to table bk (NULL restores the built-in table); tests use it to show that a
   missing kernel is reported, not jumped through */
int tide_backend_override(int device, const tide_backend *bk);
int tide_device_valid(int device);

/* tide_dist_allreduce_sum_group_ with a device tensor's receive buffer given (the reducer's side stream allocates
   nothing; engine/dist/comm.c) */
int tide_dist_allreduce_sum_scratch_(int group, tide_tensor *t, tide_tensor *scratch);

/* data pointer of a tensor (storage base + offset), for passing to kernels only */
void *tide_data(const tide_tensor *t);

/* ---- tensors (tensor.c) --------------------------------------------------------------------------- */
tide_tensor *tide_tensor_alloc_struct(void);                              /* refcount 1, zeroed */
/* a view of x's storage with the given geometry (no graph) */
tide_tensor *tide_view_of(const tide_tensor *x, int ndim, const int64_t *shape, const int64_t *stride,
                          int64_t offset);
tide_tensor *tide_empty_like(const tide_tensor *x);                       /* contiguous, same dtype/device */
void tide_contiguous_strides(int ndim, const int64_t *shape, int64_t *stride);
int64_t tide_shape_numel(int ndim, const int64_t *shape);
int tide_same_shape(const tide_tensor *a, const tide_tensor *b);
/* "[4, 64]" into buf */
const char *tide_shape_str(int ndim, const int64_t *shape, char *buf, size_t n);
/* the shape of tensor t into the char array buf, for messages */
#define SHAPE_STR(t, buf) tide_shape_str((t)->ndim, (t)->shape, buf, sizeof buf)
/* contiguous copy (no graph), or a new reference to x when already contiguous */
tide_tensor *tide_contiguous_nograd(tide_tensor *x);
int tide_is_float(int dtype);
int tide_is_int(int dtype);

/* ---- autograd graph (autograd.c) ------------------------------------------------------------------ */
/* a node's attributes: one named struct per op family (the op's public function fills it, forward and
   backward read it; a node copies it whole), plus one variable-length int list */
typedef struct tide_attrs {
    union {
        struct { int op, save_xy; double p; } unary;            /* TIDE_UN_*; backward needs x and y; scalar p */
        struct { int op; } binary;                               /* TIDE_BIN_* */
        struct { int dim; int64_t start, len, step; } slice;
        struct { int dim; } along;                               /* concat, split, index_select, gather, scatter_add */
        struct { int dtype, device; } to;                        /* to_dtype, to_device */
        struct { int keepdim; double scale; } sum;               /* scale 1 (sum) or 1 / count (mean); list: dims */
        struct { int op, dim, keepdim; } dimreduce;              /* TIDE_RED_* over one dim */
        struct { int ta, tb; } matmul;                           /* transposes */
        struct { double eps; } norm;                             /* rmsnorm, layernorm */
        struct { int dim, log; } softmax;
        /* denom and loss are written by the forward for the backward: the mean's divisor and the loss value */
        struct { int64_t ignore_index; int reduction; double denom, loss; } cross_entropy;
        struct { int64_t pos0; double theta; } rope;
        struct { int causal; double scale; } attention;
        struct { int path, has_s0; int64_t chunk; double lower_bound; } kda;           /* list: boundaries */
        struct { int form; int64_t H, D; double lower_bound; } kda_gate;
        struct { int silu, has_cache; } causal_conv1d;                                 /* list: boundaries */
        struct { double eps, scale; } l2norm;
        struct { int has_kr; double scale; } mla_attention;                            /* list: boundaries */
        struct { int has_kr; int64_t dn, chunk; double scale; } mla_latent;            /* list: boundaries */
        struct { int64_t R; int has_kr, appended; double scale; } mla_decode_rows;     /* list: lengths */
        struct { int64_t R; } kda_decode_rows;
        struct { int64_t R; int silu; } conv_decode_rows;
        struct { int n; double eps; } attnres;                                         /* n sources */
        struct { double k_gate, k_lin; } situ_glu;
        struct { int64_t k; } topk;
        struct { int activation; int64_t capacity; double k_gate, k_lin; } moe_experts; /* capacity -1: dropless */
    };
    int64_t *list;                /* variable-length int attribute (perm, sizes, shape); owned copy */
    int n_list;
} tide_attrs;

typedef struct tide_meta {
    int32_t dtype, device, ndim;
    int64_t shape[TIDE_MAX_DIMS];
} tide_meta;

typedef struct tide_region tide_region;

typedef struct tide_node {
    int op;
    int refcount;
    int64_t seq;                  /* creation order: reverse seq is a valid backward order */
    int n_in, n_out;
    tide_attrs attr;
    tide_meta *in_meta;           /* [n_in] */
    tide_meta *out_meta;          /* [n_out] */
    uint8_t *in_needs_grad;       /* [n_in] */
    tide_tensor **in;             /* [n_in] retained: leaves needing grad; external inputs of regions */
    struct tide_node **in_src;    /* [n_in] retained producer node, or NULL */
    int *in_src_idx;              /* [n_in] output index in the producer */
    tide_tensor **saved;          /* [n_saved] what backward needs (detached aliases); grows on demand:
                                     attnres saves one alias per source (spec/attnres.md §2: up to 2L + 1) */
    int n_saved, cap_saved;
    tide_tensor **out_grad;       /* [n_out] accumulators during backward */
    tide_tensor **replay_out;     /* [n_out] outputs recomputed by a region replay */
    tide_region *region;          /* recompute region, or NULL */
    int region_slot;
    int consumed;                 /* backward already ran through this node */
    int mark;                     /* traversal scratch */
    int no_saves;                 /* an op run that is not recorded: tide_node_save keeps nothing */
} tide_node;

/* op forward: computes out[0..n_out) (new references) from in[] and n->attr; may call tide_node_save
   to keep what backward needs. Runs with grad mode off. */
typedef int (*tide_forward_fn)(tide_node *n, tide_tensor **in, tide_tensor **out);
/* op backward: gin[i] = new reference to dL/d(in i), only where n->in_needs_grad[i] (else leave NULL).
   gout[k] is never NULL. Runs with grad mode off, so it may use public ops freely. */
typedef int (*tide_backward_fn)(tide_node *n, tide_tensor **gout, tide_tensor **gin);

typedef struct tide_op_def {
    const char *name;
    tide_forward_fn forward;
    tide_backward_fn backward;    /* NULL: not differentiable (outputs never require grad) */
} tide_op_def;

/* the op registry: one enum entry per public op, from the one list in ops/op_list.h (test-ops iterates it;
   registry.c holds the table) */
#include "ops/op_list.h"
#define TIDE_OP_ENUM_X(ID, name, fw, bw) TIDE_OP_##ID,
#define TIDE_OP_ENUM_N(ID, name, fw) TIDE_OP_##ID,
typedef enum { TIDE_OP_LIST(TIDE_OP_ENUM_X, TIDE_OP_ENUM_N) TIDE_OP_COUNT } tide_op_id;
#undef TIDE_OP_ENUM_X
#undef TIDE_OP_ENUM_N

/* the forward and backward of every listed op (repeats of a shared pair are compatible redeclarations) */
#define TIDE_OP_PROTO_X(ID, name, fw, bw) int tide_##fw##_forward(tide_node *, tide_tensor **, tide_tensor **); \
                                          int tide_##bw##_backward(tide_node *, tide_tensor **, tide_tensor **);
#define TIDE_OP_PROTO_N(ID, name, fw) int tide_##fw##_forward(tide_node *, tide_tensor **, tide_tensor **);
TIDE_OP_LIST(TIDE_OP_PROTO_X, TIDE_OP_PROTO_N)
#undef TIDE_OP_PROTO_X
#undef TIDE_OP_PROTO_N

extern const tide_op_def tide_op_defs[];   /* [TIDE_OP_COUNT] */
/* the name of a node's op, for messages */
#define TIDE_OP_NAME(node) (tide_op_defs[(node)->op].name)

/* run op `op` on inputs; records a node when grad mode is on and some input requires grad.
   out[] receives n_out new references. attr may be NULL. Returns 0 or -1 (error set). */
int tide_op_run(int op, int n_in, tide_tensor **in, int n_out, tide_tensor **out, const tide_attrs *attr);
/* single-output convenience: returns the output or NULL */
tide_tensor *tide_op_run1(int op, int n_in, tide_tensor **in, const tide_attrs *attr);
/* drop a reference to a node (iterative: freeing a long chain does not recurse) */
void tide_node_release_internal(tide_node *n);
/* keep t for backward (stored as a detached alias so saving an output makes no cycle). Saved tensors are
   read back by slot: each op names its slots (an enum beside its forward); t NULL keeps a slot empty, so an
   optional tensor has a fixed slot too */
int tide_node_save(tide_node *n, tide_tensor *t);

/* document boundaries for the sequence ops (kda, causal_conv1d, mla_attention): the int tensor cu (NULL =
   none; [n + 1] offsets over the flattened B·T tokens) validated and merged with every row start into
   at->list / at->n_list (malloc'd: the caller frees it after running the op) */
int tide_load_boundaries(const char *op, tide_tensor *cu, int64_t B, int64_t T, tide_attrs *at);

/* helpers for backward functions */
/* sum g down to the given shape (reverse of broadcasting); new reference */
tide_tensor *tide_sum_to_shape(tide_tensor *g, int ndim, const int64_t *shape);
/* y = y + x in place, elementwise, y contiguous and x of y's shape, dtype and device (any strides): the bits of
   tide_add(y, x) written into y, no graph recorded (autograd's gradient sums) */
int tide_add_into_(tide_tensor *y, const tide_tensor *x);

/* ---- RNG (rng.c) ----------------------------------------------------------------------------------- */
/* reserve n counters of the global Philox stream: returns the first offset, *seed gets the seed */
uint64_t tide_rng_take(uint64_t n, uint64_t *seed);

/* ---- errors ----------------------------------------------------------------------------------- */
/* tide_set_error is declared in backend.h; it returns -1 */
#define TIDE_CHECK(cond, ...) do { if (!(cond)) { tide_set_error(__VA_ARGS__); return NULL; } } while (0)
#define TIDE_CHECK_INT(cond, ...) do { if (!(cond)) { return tide_set_error(__VA_ARGS__); } } while (0)

/* argument checks used by every op: name the op and the argument */
int tide_check_tensor(const tide_tensor *t, const char *op, const char *arg);     /* non-NULL */
int tide_check_float(const tide_tensor *t, const char *op, const char *arg);      /* f32/f64/bf16 */
int tide_check_index_dtype(const tide_tensor *t, const char *op, const char *arg);  /* i32/i64 */
int tide_check_same_device(const tide_tensor *a, const tide_tensor *b, const char *op);
int tide_check_same_dtype(const tide_tensor *a, const tide_tensor *b, const char *op);
int tide_norm_dim(int dim, int ndim, const char *op, int *out);                   /* negative dims */
/* the n tensors' data differ (each row's own buffer, written in place by the op): an error naming two that share
   it, "<op>: <what>[i] and <what>[j] are the same memory: <need>"; O(n log n) */
int tide_check_distinct_data(tide_tensor *const *ts, int n, const char *op, const char *what, const char *need);

/* the gradient reducer's view of a backward (engine/dist/reducer.c): called on the backward's thread when a
   watched leaf (grad_slot > 0) has its final gradient of that backward */
typedef void (*tide_grad_ready_fn)(void *ctx, tide_tensor *leaf);
int tide_dist_thread_serialized(void);   /* comm.c: 1 when MPI may be called from a helper thread */
int tide_dist_thread_multiple(void);     /* comm.c: 1 when two threads may call MPI at once */
void tide_dist_set_polite(int on);       /* comm.c: this thread's chain waits sleep between tests, not spin */
void tide_set_grad_ready_hook(tide_grad_ready_fn fn, void *ctx);
#endif

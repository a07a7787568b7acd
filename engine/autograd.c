/*
 * autograd.c — the graph, backward, recompute regions, no-grad scopes (DESIGN.md §4).
 *
 * An op whose inputs require grad records a node: its op id, attributes, input/output metadata, the
 * producer node of each differentiable input (or the leaf tensor itself) and whatever its forward chose
 * to save. Nodes are numbered at creation, so walking the reachable nodes by decreasing number is a valid
 * reverse topological order. Backward frees each node's saved tensors and gradient buffers as soon as it
 * has run, which also makes a second backward through the same graph an error.
 *
 * Recompute regions: a node recorded inside a region keeps its external inputs (tensors made outside the
 * region, parameters) but neither its saved tensors nor the region's intermediate outputs. When backward
 * reaches the region it replays the region's forward from those inputs, then differentiates as usual.
 */
#include <stdlib.h>
#include <string.h>
#include "internal.h"

static int g_grad_enabled = 1;
static int64_t g_seq;
static int64_t g_live_nodes;
static int g_region_depth;
static tide_region *g_region;
static int g_epoch;

struct tide_region {
    int refcount;
    int n, cap;
    tide_node **nodes;            /* weak, in creation order; a freed node clears its slot */
    int replayed_epoch;
};

int tide_grad_enabled(void) { return g_grad_enabled; }
int tide_set_grad_enabled(int on) { int prev = g_grad_enabled; g_grad_enabled = on ? 1 : 0; return prev; }
int64_t tide_graph_live_nodes(void) { return g_live_nodes; }

/* ---- node lifetime ----------------------------------------------------------------------------- */
static void region_release(tide_region *r)
{
    if (!r || --r->refcount > 0) return;
    free(r->nodes);
    free(r);
}

static void node_clear_buffers(tide_node *n)
{
    for (int k = 0; k < n->n_saved; k++) tide_tensor_release(n->saved[k]);
    n->n_saved = 0;
    for (int k = 0; k < n->n_out; k++) {
        if (n->out_grad) { tide_tensor_release(n->out_grad[k]); n->out_grad[k] = NULL; }
        if (n->replay_out) { tide_tensor_release(n->replay_out[k]); n->replay_out[k] = NULL; }
    }
}

/* drop the links to inputs (after backward ran through the node, or when the node dies) */
static void node_drop_inputs(tide_node *n);

static tide_node **g_pending;
static int g_pending_n, g_pending_cap, g_draining;

static void node_destroy(tide_node *n)
{
    node_clear_buffers(n);
    node_drop_inputs(n);
    if (n->region) {
        if (n->region_slot >= 0 && n->region_slot < n->region->n) n->region->nodes[n->region_slot] = NULL;
        region_release(n->region);
    }
    free(n->attr.list);
    free(n->replay_out); free(n->saved);
    free(n);   /* the per-input / per-output arrays are in the node's block (node_new) */
    g_live_nodes--;
}

/* iterative release: dropping the last tensor of a long chain must not recurse once per node */
void tide_node_release_internal(tide_node *n)
{
    if (!n || --n->refcount > 0) return;
    if (g_pending_n == g_pending_cap) {
        int cap = g_pending_cap ? 2 * g_pending_cap : 64;
        tide_node **p = realloc(g_pending, (size_t)cap * sizeof *p);
        if (!p) { node_destroy(n); return; }     /* fall back to recursion rather than leak */
        g_pending = p;
        g_pending_cap = cap;
    }
    g_pending[g_pending_n++] = n;
    if (g_draining) return;
    g_draining = 1;
    while (g_pending_n > 0) node_destroy(g_pending[--g_pending_n]);
    g_draining = 0;
}

static void node_drop_inputs(tide_node *n)
{
    for (int i = 0; i < n->n_in; i++) {
        if (n->in) { tide_tensor_release(n->in[i]); n->in[i] = NULL; }
        if (n->in_src) { tide_node_release_internal(n->in_src[i]); n->in_src[i] = NULL; }
    }
}

/* a node and its per-input / per-output arrays in one block (every op makes a node, recorded or not: one calloc and
   one free per op instead of eight) */
static size_t align8(size_t x) { return (x + 7) & ~(size_t)7; }

static tide_node *node_new(int op, int n_in, int n_out, const tide_attrs *attr)
{
    size_t ni = (size_t)n_in + 1, no = (size_t)n_out + 1;
    size_t o_in_meta = align8(sizeof(tide_node)), o_out_meta = o_in_meta + align8(ni * sizeof(tide_meta));
    size_t o_in = o_out_meta + align8(no * sizeof(tide_meta)), o_in_src = o_in + align8(ni * sizeof(tide_tensor *));
    size_t o_out_grad = o_in_src + align8(ni * sizeof(tide_node *));
    size_t o_in_src_idx = o_out_grad + align8(no * sizeof(tide_tensor *)), o_needs = o_in_src_idx + align8(ni * sizeof(int));
    char *block = calloc(1, o_needs + ni);
    if (!block) { tide_set_error("out of memory allocating a graph node"); return NULL; }
    tide_node *n = (tide_node *)block;
    n->in_meta = (tide_meta *)(block + o_in_meta);
    n->out_meta = (tide_meta *)(block + o_out_meta);
    n->in = (tide_tensor **)(block + o_in);
    n->in_src = (tide_node **)(block + o_in_src);
    n->out_grad = (tide_tensor **)(block + o_out_grad);
    n->in_src_idx = (int *)(block + o_in_src_idx);
    n->in_needs_grad = (uint8_t *)(block + o_needs);
    n->op = op;
    n->n_in = n_in;
    n->n_out = n_out;
    n->region_slot = -1;
    if (attr) {
        n->attr = *attr;
        n->attr.list = NULL;
        if (attr->n_list > 0) {
            n->attr.list = malloc((size_t)attr->n_list * sizeof(int64_t));
            if (!n->attr.list) { free(block); tide_set_error("out of memory"); return NULL; }
            memcpy(n->attr.list, attr->list, (size_t)attr->n_list * sizeof(int64_t));
        }
    }
    g_live_nodes++;
    return n;
}

static void set_meta(tide_meta *m, const tide_tensor *t)
{
    m->dtype = t->dtype;
    m->device = t->device;
    m->ndim = t->ndim;
    for (int i = 0; i < t->ndim; i++) m->shape[i] = t->shape[i];
}

int tide_node_save(tide_node *n, tide_tensor *t)
{
    if (n->no_saves) return 0;   /* not recorded: no backward will read it (only backward functions read saved) */
    if (n->n_saved == n->cap_saved) {
        int cap = n->cap_saved ? 2 * n->cap_saved : 8;
        tide_tensor **p = realloc(n->saved, (size_t)cap * sizeof *p);
        if (!p) return tide_set_error("%s: out of memory saving tensors for backward", tide_op_defs[n->op].name);
        n->saved = p;
        n->cap_saved = cap;
    }
    tide_tensor *a = t ? tide_view_of(t, t->ndim, t->shape, t->stride, t->offset) : NULL;
    if (t && !a) return -1;
    n->saved[n->n_saved++] = a;
    return 0;
}

/* ---- running ops --------------------------------------------------------------------------------- */
static int region_add(tide_region *r, tide_node *n)
{
    if (r->n == r->cap) {
        int cap = r->cap ? 2 * r->cap : 64;
        tide_node **p = realloc(r->nodes, (size_t)cap * sizeof *p);
        if (!p) return tide_set_error("out of memory growing a recompute region");
        r->nodes = p;
        r->cap = cap;
    }
    n->region_slot = r->n;
    r->nodes[r->n++] = n;
    n->region = r;
    r->refcount++;
    return 0;
}

/* ---- the op profiler (tide_profile_*) ---------------------------------------------------------------
   Per op and kind (forward, backward, recompute replay): calls and self time, the host wall time inside the call
   less the time of the ops it ran itself (a backward that runs matmuls counts the rest of its own work; the
   matmuls count as matmul). The engine's ops run on the thread that drives it, so plain statics do. */
enum { PROF_FWD, PROF_BWD, PROF_REPLAY, PROF_KINDS };
enum { PROF_DEPTH = 64 };
static int g_prof;
static double g_prof_self[TIDE_OP_COUNT][PROF_KINDS];
static int64_t g_prof_calls[TIDE_OP_COUNT][PROF_KINDS];
static double g_prof_child[PROF_DEPTH];
static int g_prof_depth;

static double prof_begin(void)
{
    if (g_prof_depth < PROF_DEPTH) g_prof_child[g_prof_depth] = 0;
    g_prof_depth++;
    return tide_time_now();
}

static void prof_end(int op, int kind, double t0)
{
    double el = tide_time_now() - t0;
    g_prof_depth--;
    double child = g_prof_depth < PROF_DEPTH ? g_prof_child[g_prof_depth] : 0;
    g_prof_self[op][kind] += el - child;
    g_prof_calls[op][kind]++;
    if (g_prof_depth > 0 && g_prof_depth - 1 < PROF_DEPTH) g_prof_child[g_prof_depth - 1] += el;
}

int tide_profile_set(int on)
{
    int prev = g_prof;
    g_prof = on != 0;
    return prev;
}

void tide_profile_reset(void)
{
    memset(g_prof_self, 0, sizeof g_prof_self);
    memset(g_prof_calls, 0, sizeof g_prof_calls);
}

int tide_profile_read(int op, double *seconds, int64_t *calls)
{
    if (op < 0 || op >= TIDE_OP_COUNT)
        return tide_set_error("profile_read: op %d out of range [0, %d)", op, TIDE_OP_COUNT);
    for (int k = 0; k < PROF_KINDS; k++) {
        if (seconds) seconds[k] = g_prof_self[op][k];
        if (calls) calls[k] = g_prof_calls[op][k];
    }
    return 0;
}

int tide_op_run(int op, int n_in, tide_tensor **in, int n_out, tide_tensor **out, const tide_attrs *attr)
{
    if (op < 0 || op >= TIDE_OP_COUNT) return tide_set_error("unknown op id %d", op);
    const tide_op_def *def = &tide_op_defs[op];
    int any_grad = 0;
    for (int i = 0; i < n_in; i++) {
        if (!in[i]) return tide_set_error("%s: input %d is NULL", def->name, i);
        if (in[i]->requires_grad) any_grad = 1;
    }
    int record = g_grad_enabled && def->backward && any_grad;
    tide_node *n = node_new(op, n_in, n_out, attr);
    if (!n) return -1;
    n->no_saves = !record;
    for (int k = 0; k < n_out; k++) out[k] = NULL;

    int prev = g_grad_enabled;
    g_grad_enabled = 0;
    int prof = g_prof;
    double t0 = prof ? prof_begin() : 0;
    int rc = def->forward(n, in, out);
    if (prof) prof_end(op, PROF_FWD, t0);
    g_grad_enabled = prev;
    if (rc) {
        for (int k = 0; k < n_out; k++) { tide_tensor_release(out[k]); out[k] = NULL; }
        node_destroy(n);
        return -1;
    }
    if (!record) { node_destroy(n); return 0; }

    n->seq = ++g_seq;
    for (int i = 0; i < n_in; i++) {
        tide_tensor *x = in[i];
        set_meta(&n->in_meta[i], x);
        n->in_needs_grad[i] = x->requires_grad && tide_is_float(x->dtype);
        int internal = g_region && x->node && x->node->region == g_region;
        if (n->in_needs_grad[i] && x->node) {
            n->in_src[i] = x->node;
            x->node->refcount++;
            n->in_src_idx[i] = x->out_index;
        } else if (n->in_needs_grad[i] || (g_region && !internal)) {
            n->in[i] = x;                               /* a leaf, or an external input of a region */
            tide_tensor_retain(x);
        }
        if (g_region && !internal && !n->in[i]) { n->in[i] = x; tide_tensor_retain(x); }
    }
    for (int k = 0; k < n_out; k++) {
        set_meta(&n->out_meta[k], out[k]);
        if (!tide_is_float(out[k]->dtype)) continue;
        out[k]->requires_grad = 1;
        out[k]->node = n;
        out[k]->out_index = k;
        n->refcount++;
    }
    if (g_region) {
        if (region_add(g_region, n)) {
            for (int k = 0; k < n_out; k++) { tide_tensor_release(out[k]); out[k] = NULL; }
            return -1;
        }
        for (int k = 0; k < n->n_saved; k++) tide_tensor_release(n->saved[k]);
        n->n_saved = 0;
    }
    if (n->refcount == 0) node_destroy(n);      /* no float output: nothing can carry its gradient */
    return 0;
}

tide_tensor *tide_op_run1(int op, int n_in, tide_tensor **in, const tide_attrs *attr)
{
    tide_tensor *out = NULL;
    if (tide_op_run(op, n_in, in, 1, &out, attr)) return NULL;
    return out;
}

/* ---- leaves, detach, grads -------------------------------------------------------------------------- */
int tide_set_requires_grad(tide_tensor *t, int flag)
{
    if (!t) return tide_set_error("requires_grad_: tensor is NULL");
    if (t->node)
        return tide_set_error("requires_grad_: only leaf tensors can change requires_grad (this one was made by %s; use detach())",
                              tide_op_defs[t->node->op].name);
    if (flag && !tide_is_float(t->dtype))
        return tide_set_error("requires_grad_: only float tensors can require grad, got %s", tide_dtype_name(t->dtype));
    t->requires_grad = flag ? 1 : 0;
    return 0;
}

tide_tensor *tide_detach(tide_tensor *t)
{
    if (!t) { tide_set_error("detach: tensor is NULL"); return NULL; }
    return tide_view_of(t, t->ndim, t->shape, t->stride, t->offset);
}

void tide_zero_grad(tide_tensor *t)
{
    if (!t) return;
    tide_tensor_release(t->grad);
    t->grad = NULL;
}

tide_tensor *tide_grad(tide_tensor *t)
{
    if (!t || !t->grad) return NULL;
    tide_tensor_retain(t->grad);
    return t->grad;
}

int tide_set_grad(tide_tensor *t, tide_tensor *g)
{
    if (!t) return tide_set_error("set_grad: tensor is NULL");
    if (g && !tide_same_shape(t, g)) {
        char a[128], b[128];
        return tide_set_error("set_grad: tensor is %s but grad is %s", tide_shape_str(t->ndim, t->shape, a, sizeof a),
                              tide_shape_str(g->ndim, g->shape, b, sizeof b));
    }
    tide_tensor_retain(g);
    tide_tensor_release(t->grad);
    t->grad = g;
    return 0;
}

int tide_recompute_begin(void)
{
    if (g_region_depth++ > 0) return 0;
    g_region = calloc(1, sizeof *g_region);
    if (!g_region) { g_region_depth--; return tide_set_error("out of memory starting a recompute region"); }
    g_region->refcount = 1;
    return 0;
}

int tide_recompute_end(void)
{
    if (g_region_depth <= 0) return tide_set_error("recompute_end: no recompute region is open");
    if (--g_region_depth > 0) return 0;
    region_release(g_region);
    g_region = NULL;
    return 0;
}

/* ---- backward ------------------------------------------------------------------------------------ */
static int check_grad_meta(const tide_tensor *g, const tide_meta *m, const char *op, int i)
{
    int ok = g->ndim == m->ndim && g->dtype == m->dtype && g->device == m->device;
    for (int d = 0; ok && d < m->ndim; d++) ok = g->shape[d] == m->shape[d];
    if (ok) return 0;
    char a[128], b[128];
    return tide_set_error("%s backward: gradient of input %d is %s %s but the input was %s %s", op, i,
                          tide_dtype_name(g->dtype), tide_shape_str(g->ndim, g->shape, a, sizeof a),
                          tide_dtype_name(m->dtype), tide_shape_str(m->ndim, m->shape, b, sizeof b));
}

/* acc += g, where acc may be NULL; takes a reference to g when it can. An acc held by nothing else (no other
   reference, no view of its storage, no graph node) is summed into in place: the bits of tide_add(acc, g), without
   a fresh tensor per sum (a tensor read by several ops gets one gradient sum per extra reader) */
static int accumulate(tide_tensor **acc, tide_tensor *g)
{
    if (!*acc) { tide_tensor_retain(g); *acc = g; return 0; }
    tide_tensor *a = *acc;
    /* (a's storage held once: g is neither a nor a view of it) */
    if (a->refcount == 1 && a->storage->refcount == 1 && !a->node && !g->node && tide_is_contiguous(a) &&
        tide_same_shape(a, g) && a->dtype == g->dtype && a->device == g->device)
        return tide_add_into_(a, g);
    tide_tensor *s = tide_add(*acc, g);
    if (!s) return -1;
    tide_tensor_release(*acc);
    *acc = s;
    return 0;
}

/* a leaf's .grad is owned exclusively (optimisers and clipping update it in place) */
static int accumulate_leaf(tide_tensor *leaf, tide_tensor *g)
{
    if (leaf->grad) return tide_axpy_(leaf->grad, 1.0, g);
    if (tide_is_contiguous(g) && g->refcount == 1 && g->storage->refcount == 1 && !g->node) {
        tide_tensor_retain(g);
        leaf->grad = g;
        return 0;
    }
    tide_tensor *c = tide_empty(g->dtype, g->ndim, g->shape, g->device);
    if (!c) return -1;
    if (tide_copy_(c, g)) { tide_tensor_release(c); return -1; }
    leaf->grad = c;
    return 0;
}

static int cmp_seq_desc(const void *a, const void *b)
{
    int64_t x = (*(tide_node *const *)a)->seq, y = (*(tide_node *const *)b)->seq;
    return x < y ? 1 : x > y ? -1 : 0;
}

static int replay_region(tide_region *r)
{
    for (int j = 0; j < r->n; j++) {
        tide_node *m = r->nodes[j];
        if (!m || m->consumed || m->mark != g_epoch) continue;
        tide_tensor *ins[64];
        tide_tensor **in = m->n_in <= 64 ? ins : malloc((size_t)m->n_in * sizeof *in);
        if (!in) return tide_set_error("out of memory replaying a recompute region");
        int rc = 0;
        for (int i = 0; i < m->n_in && !rc; i++) {
            if (m->in[i]) in[i] = m->in[i];
            else if (m->in_src[i] && m->in_src[i]->region == r && m->in_src[i]->replay_out)
                in[i] = m->in_src[i]->replay_out[m->in_src_idx[i]];
            else in[i] = NULL;
            if (!in[i]) rc = tide_set_error("recompute: %s lost input %d before its region was replayed", tide_op_defs[m->op].name, i);
        }
        if (!rc && !m->replay_out) {
            m->replay_out = calloc((size_t)m->n_out + 1, sizeof *m->replay_out);
            if (!m->replay_out) rc = tide_set_error("out of memory replaying a recompute region");
        }
        if (!rc) {
            int prof = g_prof;
            double t0 = prof ? prof_begin() : 0;
            rc = tide_op_defs[m->op].forward(m, in, m->replay_out);
            if (prof) prof_end(m->op, PROF_REPLAY, t0);
        }
        if (in != ins) free(in);
        if (rc) return -1;
    }
    r->replayed_epoch = g_epoch;
    return 0;
}

static tide_grad_ready_fn g_ready_fn;
static void *g_ready_ctx;
void tide_set_grad_ready_hook(tide_grad_ready_fn fn, void *ctx) { g_ready_fn = fn; g_ready_ctx = ctx; }

/* the watched leaves a node reads with a gradient (the reducer's parameters) */
static int watched_input(const tide_node *m, int i)
{
    return m->in_needs_grad[i] && !m->in_src[i] && m->in[i] && m->in[i]->grad_slot > 0;
}

int tide_backward(tide_tensor *loss, const tide_tensor *grad)
{
    if (!loss) return tide_set_error("backward: loss is NULL");
    if (!loss->requires_grad)
        return tide_set_error("backward: the loss does not require grad (nothing that requires grad reached it, or it was computed under no_grad)");
    tide_tensor *g0;
    if (grad) {
        if (!tide_same_shape(grad, loss)) {
            char a[128], b[128];
            return tide_set_error("backward: gradient is %s but the loss is %s", tide_shape_str(grad->ndim, grad->shape, a, sizeof a),
                                  tide_shape_str(loss->ndim, loss->shape, b, sizeof b));
        }
        g0 = tide_empty(loss->dtype, loss->ndim, loss->shape, loss->device);
        if (!g0 || tide_copy_(g0, grad)) { tide_tensor_release(g0); return -1; }
    } else {
        if (loss->numel != 1) {
            char a[128];
            return tide_set_error("backward: the loss has shape %s; reduce it to one element or pass a gradient",
                                  tide_shape_str(loss->ndim, loss->shape, a, sizeof a));
        }
        g0 = tide_ones(loss->dtype, loss->ndim, loss->shape, loss->device);
        if (!g0) return -1;
    }
    if (!loss->node) {
        int rc = accumulate_leaf(loss, g0);
        tide_tensor_release(g0);
        return rc;
    }

    /* collect the reachable nodes (retained for the duration: freeing inputs must not free them) */
    g_epoch++;
    int cap = 256, n = 0, top = 0, rc = 0;
    tide_node **nodes = malloc((size_t)cap * sizeof *nodes);
    tide_node **stack = malloc((size_t)cap * sizeof *stack);
    if (!nodes || !stack) { free(nodes); free(stack); tide_tensor_release(g0); return tide_set_error("backward: out of memory"); }
    stack[top++] = loss->node;
    loss->node->mark = g_epoch;
    while (top > 0) {
        tide_node *m = stack[--top];
        if (m->consumed) {
            rc = tide_set_error("backward: the graph through %s was already freed by an earlier backward", tide_op_defs[m->op].name);
        }
        if (n == cap) {
            cap *= 2;
            tide_node **p1 = realloc(nodes, (size_t)cap * sizeof *p1);
            if (p1) nodes = p1;
            tide_node **p2 = p1 ? realloc(stack, (size_t)cap * sizeof *p2) : NULL;
            if (p2) stack = p2;
            if (!p1 || !p2) { rc = tide_set_error("backward: out of memory"); break; }
        }
        nodes[n++] = m;
        m->refcount++;
        for (int i = 0; i < m->n_in; i++) {
            tide_node *s = m->in_src[i];
            if (s && s->mark != g_epoch) { s->mark = g_epoch; stack[top++] = s; }
        }
    }
    free(stack);
    if (!rc) qsort(nodes, (size_t)n, sizeof *nodes, cmp_seq_desc);
    /* a reducer watches leaves: count each one's uses in this graph, so that the node that runs its last use reports
       its gradient final */
    tide_grad_ready_fn ready = g_ready_fn;
    if (!rc && ready) {
        for (int j = 0; j < n; j++)
            for (int i = 0; i < nodes[j]->n_in; i++) if (watched_input(nodes[j], i)) nodes[j]->in[i]->grad_pending = 0;
        for (int j = 0; j < n; j++)
            for (int i = 0; i < nodes[j]->n_in; i++) if (watched_input(nodes[j], i)) nodes[j]->in[i]->grad_pending++;
    }

    int prev = g_grad_enabled;
    g_grad_enabled = 0;
    if (!rc) { loss->node->out_grad[loss->out_index] = g0; g0 = NULL; }
    for (int j = 0; j < n && !rc; j++) {
        tide_node *m = nodes[j];
        const tide_op_def *def = &tide_op_defs[m->op];
        int any = 0;
        for (int k = 0; k < m->n_out; k++) any |= m->out_grad[k] != NULL;
        if (any) {
            for (int k = 0; k < m->n_out && !rc; k++) {
                if (m->out_grad[k]) continue;
                tide_meta *om = &m->out_meta[k];
                m->out_grad[k] = tide_zeros(om->dtype, om->ndim, om->shape, om->device);
                if (!m->out_grad[k]) rc = -1;
            }
            if (!rc && m->region && m->region->replayed_epoch != g_epoch) rc = replay_region(m->region);
            tide_tensor *gins[64];
            tide_tensor **gin = m->n_in <= 64 ? gins : malloc((size_t)m->n_in * sizeof *gin);
            if (!gin) rc = tide_set_error("backward: out of memory");
            if (!rc) {
                for (int i = 0; i < m->n_in; i++) gin[i] = NULL;
                int prof = g_prof;
                double t0 = prof ? prof_begin() : 0;
                rc = def->backward(m, m->out_grad, gin);
                if (prof) prof_end(m->op, PROF_BWD, t0);
                for (int i = 0; i < m->n_in; i++) {
                    if (!gin[i]) continue;
                    if (!rc && m->in_needs_grad[i]) {
                        rc = check_grad_meta(gin[i], &m->in_meta[i], def->name, i);
                        if (!rc && m->in_src[i]) rc = accumulate(&m->in_src[i]->out_grad[m->in_src_idx[i]], gin[i]);
                        else if (!rc && m->in[i]) rc = accumulate_leaf(m->in[i], gin[i]);
                    }
                    tide_tensor_release(gin[i]);
                }
            }
            if (gin && gin != gins) free(gin);
        }
        if (!rc && ready)
            for (int i = 0; i < m->n_in; i++)
                if (watched_input(m, i) && --m->in[i]->grad_pending == 0) ready(g_ready_ctx, m->in[i]);
        node_clear_buffers(m);
        node_drop_inputs(m);
        m->consumed = 1;
    }
    g_grad_enabled = prev;
    for (int j = 0; j < n; j++) {
        if (rc) node_clear_buffers(nodes[j]);
        tide_node_release_internal(nodes[j]);
    }
    free(nodes);
    tide_tensor_release(g0);
    return rc;
}

/* ---- helpers for backward functions ------------------------------------------------------------------ */
tide_tensor *tide_sum_to_shape(tide_tensor *g, int ndim, const int64_t *shape)
{
    int same = g->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = g->shape[i] == shape[i];
    if (same) { tide_tensor_retain(g); return g; }
    int dims[TIDE_MAX_DIMS], nd = 0, lead = g->ndim - ndim;
    if (lead < 0) { tide_set_error("sum_to_shape: gradient has fewer dims than the input"); return NULL; }
    for (int i = 0; i < g->ndim; i++) {
        if (i < lead) dims[nd++] = i;
        else if (shape[i - lead] == 1 && g->shape[i] != 1) dims[nd++] = i;
    }
    tide_tensor *s = nd ? tide_sum(g, nd, dims, 1) : (tide_tensor_retain(g), g);
    if (!s) return NULL;
    tide_tensor *r = tide_reshape(s, ndim, shape);
    tide_tensor_release(s);
    return r;
}

/* layout.c — views and data movement: reshape, permute, slice, expand, contiguous, concat, split,
   index_select, gather, scatter_add, dtype and device conversion. */
#include <stdlib.h>
#include "../internal.h"

/* ---- reshape -------------------------------------------------------------------------------------------- */
int tide_reshape_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *x = tide_contiguous_nograd(in[0]);
    if (!x) return -1;
    int64_t st[TIDE_MAX_DIMS];
    tide_contiguous_strides(n->attr.n_list, n->attr.list, st);
    out[0] = tide_view_of(x, n->attr.n_list, n->attr.list, st, x->offset);
    tide_tensor_release(x);
    return out[0] ? 0 : -1;
}

int tide_reshape_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    gin[0] = tide_reshape(gout[0], n->in_meta[0].ndim, n->in_meta[0].shape);
    return gin[0] ? 0 : -1;
}

tide_tensor *tide_reshape(tide_tensor *x, int ndim, const int64_t *shape)
{
    if (tide_check_tensor(x, "reshape", "x")) return NULL;
    TIDE_CHECK(ndim >= 0 && ndim <= TIDE_MAX_DIMS, "reshape: ndim must be in [0, 8], got %d", ndim);
    int64_t s[TIDE_MAX_DIMS], known = 1;
    int infer = -1;
    for (int i = 0; i < ndim; i++) {
        s[i] = shape[i];
        if (s[i] == -1) {
            TIDE_CHECK(infer < 0, "reshape: only one dimension can be -1");
            infer = i;
        } else {
            TIDE_CHECK(s[i] >= 0, "reshape: shape[%d] = %lld is invalid", i, (long long)s[i]);
            known *= s[i];
        }
    }
    char a[128], b[128];
    if (infer >= 0) {
        TIDE_CHECK(known > 0 && x->numel % known == 0, "reshape: cannot reshape %s (%lld elements) into %s",
                   SHAPE_STR(x, a), (long long)x->numel, tide_shape_str(ndim, shape, b, sizeof b));
        s[infer] = x->numel / known;
        known *= s[infer];
    }
    TIDE_CHECK(known == x->numel, "reshape: cannot reshape %s (%lld elements) into %s (%lld elements)",
               SHAPE_STR(x, a), (long long)x->numel, tide_shape_str(ndim, s, b, sizeof b), (long long)known);
    tide_attrs at = {0};
    at.list = s;
    at.n_list = ndim;
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_RESHAPE, 1, in, &at);
}

/* ---- permute / transpose ----------------------------------------------------------------------------------- */
int tide_permute_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *x = in[0];
    int64_t shape[TIDE_MAX_DIMS], stride[TIDE_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) { shape[i] = x->shape[n->attr.list[i]]; stride[i] = x->stride[n->attr.list[i]]; }
    out[0] = tide_view_of(x, x->ndim, shape, stride, x->offset);
    return out[0] ? 0 : -1;
}

int tide_permute_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int inv[TIDE_MAX_DIMS];
    for (int i = 0; i < n->attr.n_list; i++) inv[n->attr.list[i]] = i;
    gin[0] = tide_permute(gout[0], n->attr.n_list, inv);
    return gin[0] ? 0 : -1;
}

tide_tensor *tide_permute(tide_tensor *x, int ndim, const int *perm)
{
    if (tide_check_tensor(x, "permute", "x")) return NULL;
    TIDE_CHECK(ndim == x->ndim, "permute: got %d dims for a tensor with %d dims", ndim, x->ndim);
    int64_t p[TIDE_MAX_DIMS];
    int seen[TIDE_MAX_DIMS] = {0};
    for (int i = 0; i < ndim; i++) {
        int d;
        if (tide_norm_dim(perm[i], ndim, "permute", &d)) return NULL;
        TIDE_CHECK(!seen[d], "permute: dim %d appears twice", perm[i]);
        seen[d] = 1;
        p[i] = d;
    }
    tide_attrs at = {0};
    at.list = p;
    at.n_list = ndim;
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_PERMUTE, 1, in, &at);
}

tide_tensor *tide_transpose(tide_tensor *x, int d0, int d1)
{
    if (tide_check_tensor(x, "transpose", "x")) return NULL;
    int a, b, perm[TIDE_MAX_DIMS];
    if (tide_norm_dim(d0, x->ndim, "transpose", &a) || tide_norm_dim(d1, x->ndim, "transpose", &b)) return NULL;
    for (int i = 0; i < x->ndim; i++) perm[i] = i;
    perm[a] = b;
    perm[b] = a;
    return tide_permute(x, x->ndim, perm);
}

/* ---- slice ------------------------------------------------------------------------------------------------- */
int tide_slice_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *x = in[0];
    int d = n->attr.slice.dim;
    int64_t start = n->attr.slice.start, len = n->attr.slice.len, step = n->attr.slice.step;
    int64_t shape[TIDE_MAX_DIMS], stride[TIDE_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) { shape[i] = x->shape[i]; stride[i] = x->stride[i]; }
    shape[d] = len;
    stride[d] = x->stride[d] * step;
    out[0] = tide_view_of(x, x->ndim, shape, stride, x->offset + start * x->stride[d]);
    return out[0] ? 0 : -1;
}

int tide_slice_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_meta *m = &n->in_meta[0];
    tide_tensor *g = tide_zeros(m->dtype, m->ndim, m->shape, m->device);
    if (!g) return -1;
    tide_tensor *view = NULL;
    tide_tensor *in[1] = {g};
    int rc = tide_slice_forward(n, in, &view);
    if (!rc) rc = tide_copy_(view, gout[0]);
    tide_tensor_release(view);
    if (rc) { tide_tensor_release(g); return -1; }
    gin[0] = g;
    return 0;
}

tide_tensor *tide_slice(tide_tensor *x, int dim, int64_t start, int64_t end, int64_t step)
{
    if (tide_check_tensor(x, "slice", "x")) return NULL;
    int d;
    if (tide_norm_dim(dim, x->ndim, "slice", &d)) return NULL;
    TIDE_CHECK(x->ndim > 0, "slice: cannot slice a scalar");
    int64_t size = x->shape[d];
    TIDE_CHECK(step >= 1, "slice: step must be >= 1, got %lld", (long long)step);
    TIDE_CHECK(start >= 0 && start <= size && end >= start && end <= size,
               "slice: range [%lld, %lld) is out of bounds for dim %d of size %lld", (long long)start, (long long)end, dim,
               (long long)size);
    tide_attrs at = {0};
    at.slice.dim = d;
    at.slice.start = start;
    at.slice.len = (end - start + step - 1) / step;
    at.slice.step = step;
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_SLICE, 1, in, &at);
}

/* the length of dim `dim` of the view t set to len in place, inside t's storage: a decoding cache's view of the filled
   part of its buffer grows by a token a step without a new view each step. Only a view that nothing else holds (one
   reference, no graph node, no gradient), so no other tensor sees its shape change. */
int tide_view_set_length(tide_tensor *t, int dim, int64_t len)
{
    if (tide_check_tensor(t, "view_set_length", "t")) return -1;
    int d;
    if (tide_norm_dim(dim, t->ndim, "view_set_length", &d)) return -1;
    if (t->node || t->requires_grad || t->refcount != 1)
        return tide_set_error("view_set_length: the tensor is %s; only a view without graph or other holders grows in "
                              "place", t->node || t->requires_grad ? "part of a graph" : "held elsewhere");
    if (len < 0) return tide_set_error("view_set_length: length %lld must be >= 0", (long long)len);
    int64_t numel = len, last = t->offset;
    for (int i = 0; i < t->ndim; i++) {
        int64_t n = i == d ? len : t->shape[i];
        if (i != d) numel *= n;
        if (n > 0) last += (n - 1) * t->stride[i];
    }
    int64_t cap = (int64_t)(t->storage->nbytes / tide_dtype_size(t->dtype));
    if (numel > 0 && (last >= cap || t->stride[d] < 0))
        return tide_set_error("view_set_length: length %lld of dim %d runs past the view's storage (%lld elements)",
                              (long long)len, dim, (long long)cap);
    t->shape[d] = len;
    t->numel = numel;
    return 0;
}

/* ---- contiguous ----------------------------------------------------------------------------------------------- */
int tide_contiguous_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *c = tide_empty(in[0]->dtype, in[0]->ndim, in[0]->shape, in[0]->device);
    if (!c) return -1;
    if (tide_copy_(c, in[0])) { tide_tensor_release(c); return -1; }
    out[0] = c;
    return 0;
}

int tide_identity_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor_retain(gout[0]);
    gin[0] = gout[0];
    return 0;
}

tide_tensor *tide_contiguous(tide_tensor *x)
{
    if (tide_check_tensor(x, "contiguous", "x")) return NULL;
    if (tide_is_contiguous(x)) { tide_tensor_retain(x); return x; }
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_CONTIGUOUS, 1, in, NULL);
}

/* ---- expand (broadcast view) ------------------------------------------------------------------------------------ */
int tide_expand_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *x = in[0];
    int nd = n->attr.n_list, lead = nd - x->ndim;
    int64_t stride[TIDE_MAX_DIMS];
    for (int i = 0; i < nd; i++) {
        int j = i - lead;
        stride[i] = (j >= 0 && x->shape[j] == n->attr.list[i]) ? x->stride[j] : 0;
    }
    out[0] = tide_view_of(x, nd, n->attr.list, stride, x->offset);
    return out[0] ? 0 : -1;
}

int tide_expand_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    gin[0] = tide_sum_to_shape(gout[0], n->in_meta[0].ndim, n->in_meta[0].shape);
    return gin[0] ? 0 : -1;
}

tide_tensor *tide_expand(tide_tensor *x, int ndim, const int64_t *shape)
{
    if (tide_check_tensor(x, "expand", "x")) return NULL;
    TIDE_CHECK(ndim >= x->ndim && ndim <= TIDE_MAX_DIMS, "expand: cannot expand %d dims to %d", x->ndim, ndim);
    int64_t s[TIDE_MAX_DIMS];
    char a[128], b[128];
    for (int i = 0; i < ndim; i++) {
        int j = i - (ndim - x->ndim);
        s[i] = shape[i] == -1 && j >= 0 ? x->shape[j] : shape[i];
        TIDE_CHECK(s[i] >= 0 && (j < 0 || x->shape[j] == s[i] || x->shape[j] == 1),
                   "expand: cannot expand %s to %s", SHAPE_STR(x, a), tide_shape_str(ndim, shape, b, sizeof b));
    }
    tide_attrs at = {0};
    at.list = s;
    at.n_list = ndim;
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_EXPAND, 1, in, &at);
}

/* ---- concat / split ------------------------------------------------------------------------------------------------ */
static tide_tensor *slice_nograd(tide_tensor *x, int d, int64_t start, int64_t len)
{
    int64_t shape[TIDE_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) shape[i] = x->shape[i];
    shape[d] = len;
    return tide_view_of(x, x->ndim, shape, x->stride, x->offset + start * x->stride[d]);
}

int tide_concat_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int d = n->attr.along.dim;
    int64_t shape[TIDE_MAX_DIMS];
    for (int i = 0; i < in[0]->ndim; i++) shape[i] = in[0]->shape[i];
    shape[d] = 0;
    for (int k = 0; k < n->n_in; k++) shape[d] += in[k]->shape[d];
    tide_tensor *o = tide_empty(in[0]->dtype, in[0]->ndim, shape, in[0]->device);
    if (!o) return -1;
    int64_t at = 0;
    for (int k = 0; k < n->n_in; k++) {
        tide_tensor *v = slice_nograd(o, d, at, in[k]->shape[d]);
        int rc = v ? tide_copy_(v, in[k]) : -1;
        tide_tensor_release(v);
        if (rc) { tide_tensor_release(o); return -1; }
        at += in[k]->shape[d];
    }
    out[0] = o;
    return 0;
}

int tide_concat_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int d = n->attr.along.dim;
    int64_t at = 0;
    for (int k = 0; k < n->n_in; k++) {
        int64_t len = n->in_meta[k].shape[d];
        if (n->in_needs_grad[k]) {
            gin[k] = slice_nograd(gout[0], d, at, len);
            if (!gin[k]) return -1;
        }
        at += len;
    }
    return 0;
}

tide_tensor *tide_concat(int n, tide_tensor **xs, int dim)
{
    TIDE_CHECK(n >= 1 && xs, "concat: need at least one tensor");
    for (int k = 0; k < n; k++) if (tide_check_tensor(xs[k], "concat", "xs[k]")) return NULL;
    int d;
    if (tide_norm_dim(dim, xs[0]->ndim, "concat", &d)) return NULL;
    char a[128], b[128];
    for (int k = 1; k < n; k++) {
        if (tide_check_same_device(xs[0], xs[k], "concat") || tide_check_same_dtype(xs[0], xs[k], "concat")) return NULL;
        int ok = xs[k]->ndim == xs[0]->ndim;
        for (int i = 0; ok && i < xs[0]->ndim; i++) ok = i == d || xs[k]->shape[i] == xs[0]->shape[i];
        TIDE_CHECK(ok, "concat: tensor %d is %s but tensor 0 is %s (all dims but %d must match)", k, SHAPE_STR(xs[k], a),
                   SHAPE_STR(xs[0], b), dim);
    }
    tide_attrs at = {0};
    at.along.dim = d;
    return tide_op_run1(TIDE_OP_CONCAT, n, xs, &at);
}

int tide_split_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int d = n->attr.along.dim;
    int64_t at = 0;
    for (int k = 0; k < n->n_out; k++) {
        out[k] = slice_nograd(in[0], d, at, n->attr.list[k]);
        if (!out[k]) return -1;
        at += n->attr.list[k];
    }
    return 0;
}

int tide_split_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_attrs at = {0};
    at.along.dim = n->attr.along.dim;
    tide_node tmp = {0};
    tmp.attr = at;
    tmp.n_in = n->n_out;
    return tide_concat_forward(&tmp, gout, &gin[0]);
}

int tide_split(tide_tensor *x, int dim, int n, const int64_t *sizes, tide_tensor **outs)
{
    if (tide_check_tensor(x, "split", "x")) return -1;
    int d;
    if (tide_norm_dim(dim, x->ndim, "split", &d)) return -1;
    TIDE_CHECK_INT(n >= 1 && sizes && outs, "split: need at least one part");
    int64_t total = 0;
    for (int k = 0; k < n; k++) {
        TIDE_CHECK_INT(sizes[k] >= 0, "split: size %d is negative (%lld)", k, (long long)sizes[k]);
        total += sizes[k];
    }
    TIDE_CHECK_INT(total == x->shape[d], "split: sizes add up to %lld but dim %d has size %lld", (long long)total, dim,
                   (long long)x->shape[d]);
    tide_attrs at = {0};
    at.along.dim = d;
    at.list = (int64_t *)sizes;
    at.n_list = n;
    tide_tensor *in[1] = {x};
    return tide_op_run(TIDE_OP_SPLIT, 1, in, n, outs, &at);
}

/* ---- index_select / gather / scatter_add ------------------------------------------------------------------------------- */
static void outer_inner(const tide_tensor *x, int d, int64_t *outer, int64_t *inner)
{
    *outer = 1;
    *inner = 1;
    for (int i = 0; i < d; i++) *outer *= x->shape[i];
    for (int i = d + 1; i < x->ndim; i++) *inner *= x->shape[i];
}

static int check_indices(const tide_tensor *idx, int64_t n, const char *op)
{
    if (idx->numel == 0) return 0;
    tide_tensor *c = tide_contiguous_nograd((tide_tensor *)idx);
    if (!c) return -1;
    int64_t bad = 0;
    int ok = 1;
    /* deferrable: index_select, gather and scatter_add read 0 and write nowhere out of range */
    int rc = TIDE_DISPATCH(c->device, check_index, op, op, tide_data(c), c->dtype, c->numel, n, 1, &bad, &ok);
    tide_tensor_release(c);
    if (rc) return -1;
    if (!ok) return tide_set_error("%s: index %lld is out of range [0, %lld)", op, (long long)bad, (long long)n);
    return 0;
}

int tide_index_select_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int d = n->attr.along.dim;
    tide_tensor *x = tide_contiguous_nograd(in[0]), *idx = x ? tide_contiguous_nograd(in[1]) : NULL;
    if (!idx) { tide_tensor_release(x); return -1; }
    int64_t outer, inner, shape[TIDE_MAX_DIMS];
    outer_inner(x, d, &outer, &inner);
    for (int i = 0; i < x->ndim; i++) shape[i] = x->shape[i];
    shape[d] = idx->numel;
    tide_tensor *o = tide_empty(x->dtype, x->ndim, shape, x->device);
    int rc = o ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(x->device, index_select, "index_select", x->dtype, tide_data(o), tide_data(x),
                           tide_data(idx), idx->dtype, outer, x->shape[d], inner, idx->numel);
    if (!rc) rc = tide_node_save(n, idx);
    tide_tensor_release(x); tide_tensor_release(idx);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_index_select_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int d = n->attr.along.dim;
    tide_meta *m = &n->in_meta[0];
    tide_tensor *idx = n->saved[0], *g = tide_contiguous_nograd(gout[0]);
    tide_tensor *gx = g ? tide_zeros(m->dtype, m->ndim, m->shape, m->device) : NULL;
    int rc = gx ? 0 : -1;
    if (!rc && g->numel > 0) {
        int64_t outer, inner;
        outer_inner(gx, d, &outer, &inner);
        rc = TIDE_DISPATCH(gx->device, index_add, "index_select", gx->dtype, tide_data(gx), tide_data(g),
                           tide_data(idx), idx->dtype, outer, m->shape[d], inner, idx->numel);
    }
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(gx); return -1; }
    gin[0] = gx;
    return 0;
}

tide_tensor *tide_index_select(tide_tensor *x, int dim, tide_tensor *index)
{
    if (tide_check_float(x, "index_select", "x") || tide_check_index_dtype(index, "index_select", "index") ||
        tide_check_same_device(x, index, "index_select")) return NULL;
    int d;
    if (tide_norm_dim(dim, x->ndim, "index_select", &d)) return NULL;
    TIDE_CHECK(index->ndim == 1, "index_select: index must be 1-D, got %d dims", index->ndim);
    if (check_indices(index, x->shape[d], "index_select")) return NULL;
    tide_attrs at = {0};
    at.along.dim = d;
    tide_tensor *in[2] = {x, index};
    return tide_op_run1(TIDE_OP_INDEX_SELECT, 2, in, &at);
}

static int check_gather_shapes(const tide_tensor *x, const tide_tensor *idx, int d, const char *op)
{
    char a[128], b[128];
    int ok = idx->ndim == x->ndim;
    for (int i = 0; ok && i < x->ndim; i++) ok = i == d || idx->shape[i] == x->shape[i];
    if (!ok)
        return tide_set_error("%s: index is %s but x is %s (all dims but %d must match)", op, SHAPE_STR(idx, a),
                              SHAPE_STR(x, b), d);
    return 0;
}

int tide_gather_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int d = n->attr.along.dim;
    tide_tensor *x = tide_contiguous_nograd(in[0]), *idx = x ? tide_contiguous_nograd(in[1]) : NULL;
    if (!idx) { tide_tensor_release(x); return -1; }
    int64_t outer, inner;
    outer_inner(x, d, &outer, &inner);
    tide_tensor *o = tide_empty(x->dtype, idx->ndim, idx->shape, x->device);
    int rc = o ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(x->device, gather, "gather", x->dtype, tide_data(o), tide_data(x), tide_data(idx),
                           idx->dtype, outer, x->shape[d], idx->shape[d], inner);
    if (!rc) rc = tide_node_save(n, idx);
    tide_tensor_release(x); tide_tensor_release(idx);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_gather_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int d = n->attr.along.dim;
    tide_meta *m = &n->in_meta[0];
    tide_tensor *idx = n->saved[0], *g = tide_contiguous_nograd(gout[0]);
    tide_tensor *gx = g ? tide_zeros(m->dtype, m->ndim, m->shape, m->device) : NULL;
    int rc = gx ? 0 : -1;
    if (!rc && g->numel > 0) {
        int64_t outer, inner;
        outer_inner(gx, d, &outer, &inner);
        rc = TIDE_DISPATCH(gx->device, scatter_add, "gather", gx->dtype, tide_data(gx), tide_data(g), tide_data(idx),
                           idx->dtype, outer, m->shape[d], idx->shape[d], inner);
    }
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(gx); return -1; }
    gin[0] = gx;
    return 0;
}

tide_tensor *tide_gather(tide_tensor *x, int dim, tide_tensor *index)
{
    if (tide_check_float(x, "gather", "x") || tide_check_index_dtype(index, "gather", "index") ||
        tide_check_same_device(x, index, "gather")) return NULL;
    int d;
    if (tide_norm_dim(dim, x->ndim, "gather", &d) || check_gather_shapes(x, index, d, "gather") ||
        check_indices(index, x->shape[d], "gather")) return NULL;
    tide_attrs at = {0};
    at.along.dim = d;
    tide_tensor *in[2] = {x, index};
    return tide_op_run1(TIDE_OP_GATHER, 2, in, &at);
}

int tide_scatter_add_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int d = n->attr.along.dim;
    tide_tensor *x = in[0], *idx = tide_contiguous_nograd(in[1]), *src = idx ? tide_contiguous_nograd(in[2]) : NULL;
    tide_tensor *o = src ? tide_empty(x->dtype, x->ndim, x->shape, x->device) : NULL;
    int rc = o ? tide_copy_(o, x) : -1;
    if (!rc && src->numel > 0) {
        int64_t outer, inner;
        outer_inner(x, d, &outer, &inner);
        rc = TIDE_DISPATCH(x->device, scatter_add, "scatter_add", x->dtype, tide_data(o), tide_data(src),
                           tide_data(idx), idx->dtype, outer, x->shape[d], idx->shape[d], inner);
    }
    if (!rc) rc = tide_node_save(n, idx);
    tide_tensor_release(idx); tide_tensor_release(src);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_scatter_add_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    if (n->in_needs_grad[0]) { tide_tensor_retain(gout[0]); gin[0] = gout[0]; }
    if (n->in_needs_grad[2]) {
        gin[2] = tide_gather(gout[0], n->attr.along.dim, n->saved[0]);
        if (!gin[2]) return -1;
    }
    return 0;
}

tide_tensor *tide_scatter_add(tide_tensor *x, int dim, tide_tensor *index, tide_tensor *src)
{
    if (tide_check_float(x, "scatter_add", "x") || tide_check_index_dtype(index, "scatter_add", "index") ||
        tide_check_float(src, "scatter_add", "src") || tide_check_same_device(x, index, "scatter_add") ||
        tide_check_same_device(x, src, "scatter_add") || tide_check_same_dtype(x, src, "scatter_add")) return NULL;
    int d;
    if (tide_norm_dim(dim, x->ndim, "scatter_add", &d) || check_gather_shapes(x, index, d, "scatter_add")) return NULL;
    char a[128], b[128];
    TIDE_CHECK(tide_same_shape(index, src), "scatter_add: index is %s but src is %s", SHAPE_STR(index, a), SHAPE_STR(src, b));
    if (check_indices(index, x->shape[d], "scatter_add")) return NULL;
    tide_attrs at = {0};
    at.along.dim = d;
    tide_tensor *in[3] = {x, index, src};
    return tide_op_run1(TIDE_OP_SCATTER_ADD, 3, in, &at);
}

/* ---- dtype and device conversion -------------------------------------------------------------------------------------- */
int tide_to_dtype_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *o = tide_empty(n->attr.to.dtype, in[0]->ndim, in[0]->shape, n->attr.to.device);
    if (!o) return -1;
    if (tide_copy_(o, in[0])) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_to_dtype_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_meta *m = &n->in_meta[0];
    tide_tensor *g = tide_empty(m->dtype, m->ndim, m->shape, m->device);
    if (!g) return -1;
    if (tide_copy_(g, gout[0])) { tide_tensor_release(g); return -1; }
    gin[0] = g;
    return 0;
}

tide_tensor *tide_to_dtype(tide_tensor *x, int dtype)
{
    if (tide_check_tensor(x, "to_dtype", "x")) return NULL;
    TIDE_CHECK(dtype >= 0 && dtype < TIDE_DTYPE_COUNT, "to_dtype: unknown dtype %d", dtype);
    tide_attrs at = {0};
    at.to.dtype = dtype;
    at.to.device = x->device;
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_TO_DTYPE, 1, in, &at);
}

tide_tensor *tide_to_device(tide_tensor *x, int device)
{
    if (tide_check_tensor(x, "to_device", "x")) return NULL;
    if (!tide_backend_for(device)) return NULL;
    tide_attrs at = {0};
    at.to.dtype = x->dtype;
    at.to.device = device;
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_TO_DEVICE, 1, in, &at);
}

/* reduce.c — sum and mean over any dims, max / argmax / logsumexp over one dim. */
#include "../internal.h"

/* shape of the result: reduced dims dropped, or kept as 1 */
static int reduced_shape(const tide_tensor *x, const uint8_t *red, int keepdim, int64_t *shape)
{
    int k = 0;
    for (int i = 0; i < x->ndim; i++) {
        if (!red[i]) shape[k++] = x->shape[i];
        else if (keepdim) shape[k++] = 1;
    }
    return k;
}

/* ---- sum / mean ------------------------------------------------------------------------------------------------ */
int tide_sum_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *x = in[0];
    uint8_t red[TIDE_MAX_DIMS] = {0};
    for (int k = 0; k < n->attr.n_list; k++) red[n->attr.list[k]] = 1;
    /* reduced dims forming one consecutive run of a contiguous tensor: reduce [outer, red, inner] in place */
    int first = -1, last = -1, run = 1;
    for (int i = 0; i < x->ndim; i++) if (red[i]) { if (first < 0) first = i; else if (i != last + 1) run = 0; last = i; }
    if (first >= 0 && run && tide_is_contiguous(x)) {
        int64_t o3 = 1, r3 = 1, i3 = 1, shape[TIDE_MAX_DIMS];
        for (int i = 0; i < x->ndim; i++) *(i < first ? &o3 : i <= last ? &r3 : &i3) *= x->shape[i];
        int nd = reduced_shape(x, red, n->attr.sum.keepdim, shape);
        tide_tensor *o = tide_empty(x->dtype, nd, shape, x->device);
        int rc = o ? 0 : -1;
        if (!rc && o->numel > 0) {
            if (r3 == 0) rc = tide_fill_(o, 0.0);
            else rc = TIDE_DISPATCH(x->device, reduce, TIDE_OP_NAME(n), TIDE_RED_SUM, x->dtype, tide_data(o),
                                    tide_data(x), o3, r3, i3);
        }
        if (!rc && n->attr.sum.scale != 1.0 && o->numel > 0) rc = tide_scale_(o, n->attr.sum.scale);   /* mean */
        if (rc) { tide_tensor_release(o); return -1; }
        out[0] = o;
        return 0;
    }
    /* otherwise move reduced dims last, make contiguous, reduce [outer, red, 1] */
    int perm[TIDE_MAX_DIMS], np = 0;
    int64_t outer = 1, r = 1;
    for (int i = 0; i < x->ndim; i++) if (!red[i]) { perm[np++] = i; outer *= x->shape[i]; }
    for (int i = 0; i < x->ndim; i++) if (red[i]) { perm[np++] = i; r *= x->shape[i]; }
    int64_t pshape[TIDE_MAX_DIMS], pstride[TIDE_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) { pshape[i] = x->shape[perm[i]]; pstride[i] = x->stride[perm[i]]; }
    tide_tensor *pv = tide_view_of(x, x->ndim, pshape, pstride, x->offset);
    tide_tensor *c = pv ? tide_contiguous_nograd(pv) : NULL;
    tide_tensor_release(pv);
    if (!c) return -1;
    int64_t shape[TIDE_MAX_DIMS];
    int nd = reduced_shape(x, red, n->attr.sum.keepdim, shape);
    tide_tensor *o = tide_empty(x->dtype, nd, shape, x->device);
    int rc = o ? 0 : -1;
    if (!rc && outer > 0) {
        if (r == 0) rc = tide_fill_(o, 0.0);
        else rc = TIDE_DISPATCH(x->device, reduce, TIDE_OP_NAME(n), TIDE_RED_SUM, x->dtype, tide_data(o), tide_data(c),
                                outer, r, 1);
    }
    if (!rc && n->attr.sum.scale != 1.0 && o->numel > 0) rc = tide_scale_(o, n->attr.sum.scale);   /* mean */
    tide_tensor_release(c);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_sum_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_meta *m = &n->in_meta[0];
    int64_t kshape[TIDE_MAX_DIMS];
    uint8_t red[TIDE_MAX_DIMS] = {0};
    for (int k = 0; k < n->attr.n_list; k++) red[n->attr.list[k]] = 1;
    for (int i = 0; i < m->ndim; i++) kshape[i] = red[i] ? 1 : m->shape[i];
    tide_tensor *g = tide_reshape(gout[0], m->ndim, kshape);
    tide_tensor *e = g ? tide_expand(g, m->ndim, m->shape) : NULL;
    tide_tensor *c = e ? tide_empty(m->dtype, m->ndim, m->shape, m->device) : NULL;
    int rc = c ? tide_copy_(c, e) : -1;
    if (!rc && n->attr.sum.scale != 1.0) rc = tide_scale_(c, n->attr.sum.scale);
    tide_tensor_release(g); tide_tensor_release(e);
    if (rc) { tide_tensor_release(c); return -1; }
    gin[0] = c;
    return 0;
}

static tide_tensor *sum_like(int op, tide_tensor *x, int n, const int *dims, int keepdim)
{
    const char *name = op == TIDE_OP_SUM ? "sum" : "mean";
    if (tide_check_float(x, name, "x")) return NULL;
    int64_t list[TIDE_MAX_DIMS];
    uint8_t seen[TIDE_MAX_DIMS] = {0};
    int nl = 0;
    TIDE_CHECK(n >= 0 && n <= TIDE_MAX_DIMS, "%s: %d dims given", name, n);
    if (n == 0) for (int i = 0; i < x->ndim; i++) list[nl++] = i;
    for (int k = 0; k < n; k++) {
        int d;
        if (tide_norm_dim(dims[k], x->ndim, name, &d)) return NULL;
        TIDE_CHECK(!seen[d], "%s: dim %d given twice", name, dims[k]);
        seen[d] = 1;
        list[nl++] = d;
    }
    int64_t count = 1;
    for (int k = 0; k < nl; k++) count *= x->shape[list[k]];
    tide_attrs at = {0};
    at.sum.keepdim = keepdim ? 1 : 0;
    at.sum.scale = op == TIDE_OP_MEAN ? (count > 0 ? 1.0 / (double)count : 0.0 / 0.0) : 1.0;
    at.list = list;
    at.n_list = nl;
    tide_tensor *in[1] = {x};
    return tide_op_run1(op, 1, in, &at);
}

tide_tensor *tide_sum(tide_tensor *x, int n, const int *dims, int keepdim) { return sum_like(TIDE_OP_SUM, x, n, dims, keepdim); }
tide_tensor *tide_mean(tide_tensor *x, int n, const int *dims, int keepdim) { return sum_like(TIDE_OP_MEAN, x, n, dims, keepdim); }

/* ---- max / argmax / logsumexp over one dim ------------------------------------------------------------------------ */
static void split3(const tide_tensor *x, int d, int64_t *outer, int64_t *red, int64_t *inner)
{
    *outer = 1; *inner = 1;
    for (int i = 0; i < d; i++) *outer *= x->shape[i];
    for (int i = d + 1; i < x->ndim; i++) *inner *= x->shape[i];
    *red = x->shape[d];
}

int tide_dimreduce_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int rop = n->attr.dimreduce.op, d = n->attr.dimreduce.dim, keep = n->attr.dimreduce.keepdim;
    tide_tensor *x = tide_contiguous_nograd(in[0]);
    if (!x) return -1;
    int64_t outer, red, inner, shape[TIDE_MAX_DIMS];
    split3(x, d, &outer, &red, &inner);
    uint8_t rmask[TIDE_MAX_DIMS] = {0};
    rmask[d] = 1;
    int nd = reduced_shape(x, rmask, keep, shape);
    tide_tensor *o = tide_empty(rop == TIDE_RED_ARGMAX ? TIDE_I64 : x->dtype, nd, shape, x->device);
    int rc = o ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(x->device, reduce, TIDE_OP_NAME(n), rop, x->dtype, tide_data(o), tide_data(x), outer, red,
                           inner);
    if (!rc && rop != TIDE_RED_ARGMAX) rc = tide_node_save(n, x) || tide_node_save(n, o);
    tide_tensor_release(x);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_dimreduce_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int rop = n->attr.dimreduce.op, d = n->attr.dimreduce.dim;
    tide_tensor *x = n->saved[0], *y = n->saved[1];
    int64_t outer, red, inner;
    split3(x, d, &outer, &red, &inner);
    if (rop == TIDE_RED_MAX) {
        tide_tensor *g = tide_contiguous_nograd(gout[0]), *gx = g ? tide_empty_like(x) : NULL;
        int rc = gx ? 0 : -1;
        if (!rc && x->numel > 0)
            rc = TIDE_DISPATCH(x->device, reduce_max_backward, TIDE_OP_NAME(n), x->dtype, tide_data(gx), tide_data(g),
                               tide_data(x), tide_data(y), outer, red, inner);
        tide_tensor_release(g);
        if (rc) { tide_tensor_release(gx); return -1; }
        gin[0] = gx;
        return 0;
    }
    /* logsumexp: gx = g * exp(x - y), with y and g broadcast along d */
    int64_t kshape[TIDE_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) kshape[i] = i == d ? 1 : x->shape[i];
    tide_tensor *yk = tide_reshape(y, x->ndim, kshape), *gk = yk ? tide_reshape(gout[0], x->ndim, kshape) : NULL;
    tide_tensor *df = gk ? tide_sub(x, yk) : NULL, *p = df ? tide_exp(df) : NULL, *gx = p ? tide_mul(p, gk) : NULL;
    tide_tensor_release(yk); tide_tensor_release(gk); tide_tensor_release(df); tide_tensor_release(p);
    gin[0] = gx;
    return gx ? 0 : -1;
}

static tide_tensor *dimreduce(int op, int rop, const char *name, tide_tensor *x, int dim, int keepdim)
{
    if (tide_check_float(x, name, "x")) return NULL;
    int d;
    if (tide_norm_dim(dim, x->ndim, name, &d)) return NULL;
    TIDE_CHECK(x->ndim > 0 && x->shape[d] > 0, "%s: cannot reduce an empty dim (dim %d has size 0)", name, dim);
    tide_attrs at = {0};
    at.dimreduce.op = rop;
    at.dimreduce.dim = d;
    at.dimreduce.keepdim = keepdim ? 1 : 0;
    tide_tensor *in[1] = {x};
    return tide_op_run1(op, 1, in, &at);
}

tide_tensor *tide_max(tide_tensor *x, int dim, int keepdim) { return dimreduce(TIDE_OP_MAX, TIDE_RED_MAX, "max", x, dim, keepdim); }
tide_tensor *tide_argmax(tide_tensor *x, int dim, int keepdim) { return dimreduce(TIDE_OP_ARGMAX, TIDE_RED_ARGMAX, "argmax", x, dim, keepdim); }
tide_tensor *tide_logsumexp(tide_tensor *x, int dim, int keepdim) { return dimreduce(TIDE_OP_LOGSUMEXP, TIDE_RED_LOGSUMEXP, "logsumexp", x, dim, keepdim); }

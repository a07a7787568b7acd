/* nn.c — fused neural-network ops with hand-written backward: embedding, RMSNorm, LayerNorm,
   (log-)softmax, cross-entropy, RoPE, causal softmax attention; and the AdamW update. */
#include <math.h>
#include "../internal.h"

#define SHAPE_STR(t, buf) tide_shape_str((t)->ndim, (t)->shape, buf, sizeof buf)

/* ---- embedding ------------------------------------------------------------------------------------------------ */
int tide_embedding_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *w = tide_contiguous_nograd(in[0]), *ids = w ? tide_contiguous_nograd(in[1]) : NULL;
    if (!ids) { tide_tensor_release(w); return -1; }
    int64_t shape[TIDE_MAX_DIMS];
    for (int i = 0; i < ids->ndim; i++) shape[i] = ids->shape[i];
    shape[ids->ndim] = w->shape[1];
    tide_tensor *o = tide_empty(w->dtype, ids->ndim + 1, shape, w->device);
    int rc = o ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(w->device, index_select, "embedding", w->dtype, tide_data(o), tide_data(w), tide_data(ids),
                           ids->dtype, 1, w->shape[0], w->shape[1], ids->numel);
    if (!rc) rc = tide_node_save(n, ids);
    tide_tensor_release(w); tide_tensor_release(ids);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_embedding_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_meta *m = &n->in_meta[0];
    tide_tensor *ids = n->saved[0], *g = tide_contiguous_nograd(gout[0]);
    tide_tensor *gw = g ? tide_zeros(m->dtype, m->ndim, m->shape, m->device) : NULL;
    int rc = gw ? 0 : -1;
    if (!rc && g->numel > 0)
        rc = TIDE_DISPATCH(gw->device, index_add, "embedding", gw->dtype, tide_data(gw), tide_data(g), tide_data(ids),
                           ids->dtype, 1, m->shape[0], m->shape[1], ids->numel);
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(gw); return -1; }
    gin[0] = gw;
    return 0;
}

tide_tensor *tide_embedding(tide_tensor *weight, tide_tensor *ids)
{
    if (tide_check_float(weight, "embedding", "weight") || tide_check_index_dtype(ids, "embedding", "ids") ||
        tide_check_same_device(weight, ids, "embedding")) return NULL;
    char a[128];
    TIDE_CHECK(weight->ndim == 2, "embedding: weight must be [V, d], got %s", SHAPE_STR(weight, a));
    TIDE_CHECK(ids->ndim < TIDE_MAX_DIMS, "embedding: ids have too many dims (%d)", ids->ndim);
    if (ids->numel > 0) {
        tide_tensor *c = tide_contiguous_nograd(ids);
        if (!c) return NULL;
        int64_t bad = 0;
        int ok = 1;
        int rc = TIDE_DISPATCH(c->device, check_index, "embedding", tide_data(c), c->dtype, c->numel, weight->shape[0],
                               &bad, &ok);
        tide_tensor_release(c);
        if (rc) return NULL;
        TIDE_CHECK(ok, "embedding: token id %lld is out of range for a vocabulary of %lld", (long long)bad,
                   (long long)weight->shape[0]);
    }
    tide_tensor *in[2] = {weight, ids};
    return tide_op_run1(TIDE_OP_EMBEDDING, 2, in, NULL);
}

/* ---- RMSNorm / LayerNorm over the last dim ---------------------------------------------------------------------- */
static int norm_check(tide_tensor *x, tide_tensor *w, tide_tensor *b, const char *op)
{
    if (tide_check_float(x, op, "x") || tide_check_float(w, op, "weight") || tide_check_same_device(x, w, op) ||
        tide_check_same_dtype(x, w, op)) return -1;
    char s1[128], s2[128];
    if (x->ndim < 1 || w->ndim != 1 || w->shape[0] != x->shape[x->ndim - 1])
        return tide_set_error("%s: weight is %s but x is %s (weight must be [last dim of x])", op, SHAPE_STR(w, s1),
                              SHAPE_STR(x, s2));
    if (b && (tide_check_float(b, op, "bias") || tide_check_same_dtype(x, b, op) || tide_check_same_device(x, b, op) ||
              !tide_same_shape(w, b)))
        return tide_last_error()[0] ? -1 : tide_set_error("%s: bias is %s but weight is %s", op, SHAPE_STR(b, s1), SHAPE_STR(w, s2));
    return 0;
}

int tide_rmsnorm_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *x = tide_contiguous_nograd(in[0]), *w = x ? tide_contiguous_nograd(in[1]) : NULL;
    if (!w) { tide_tensor_release(x); return -1; }
    int64_t C = x->shape[x->ndim - 1], N = C ? x->numel / C : 0;
    tide_tensor *o = tide_empty_like(x), *rstd = o ? tide_empty(x->dtype, 1, &N, x->device) : NULL;
    int rc = rstd ? 0 : -1;
    if (!rc && x->numel > 0)
        rc = TIDE_DISPATCH(x->device, rmsnorm, "rmsnorm", x->dtype, tide_data(o), tide_data(rstd), tide_data(x),
                           tide_data(w), N, C, n->attr.norm.eps);
    if (!rc) rc = tide_node_save(n, x) || tide_node_save(n, w) || tide_node_save(n, rstd);
    tide_tensor_release(x); tide_tensor_release(w); tide_tensor_release(rstd);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_rmsnorm_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *x = n->saved[0], *w = n->saved[1], *rstd = n->saved[2];
    int64_t C = x->shape[x->ndim - 1], N = C ? x->numel / C : 0;
    tide_tensor *g = tide_contiguous_nograd(gout[0]);
    tide_tensor *dx = g ? tide_empty_like(x) : NULL, *dw = dx ? tide_zeros(w->dtype, 1, &C, w->device) : NULL;
    int rc = dw ? 0 : -1;
    if (!rc && x->numel > 0)
        rc = TIDE_DISPATCH(x->device, rmsnorm_backward, "rmsnorm", x->dtype, tide_data(dx), tide_data(dw), tide_data(g),
                           tide_data(x), tide_data(w), tide_data(rstd), N, C);
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(dx); tide_tensor_release(dw); return -1; }
    gin[0] = dx;
    gin[1] = dw;
    return 0;
}

tide_tensor *tide_rmsnorm(tide_tensor *x, tide_tensor *weight, double eps)
{
    if (norm_check(x, weight, NULL, "rmsnorm")) return NULL;
    TIDE_CHECK(eps >= 0 && isfinite(eps), "rmsnorm: eps must be finite and >= 0, got %g", eps);
    tide_attrs at = {0};
    at.norm.eps = eps;
    tide_tensor *in[2] = {x, weight};
    return tide_op_run1(TIDE_OP_RMSNORM, 2, in, &at);
}

int tide_layernorm_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int has_b = n->n_in == 3;
    tide_tensor *x = tide_contiguous_nograd(in[0]), *w = x ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *b = (w && has_b) ? tide_contiguous_nograd(in[2]) : NULL;
    if (!w || (has_b && !b)) { tide_tensor_release(x); tide_tensor_release(w); return -1; }
    int64_t C = x->shape[x->ndim - 1], N = C ? x->numel / C : 0;
    tide_tensor *o = tide_empty_like(x), *mean = o ? tide_empty(x->dtype, 1, &N, x->device) : NULL;
    tide_tensor *rstd = mean ? tide_empty(x->dtype, 1, &N, x->device) : NULL;
    int rc = rstd ? 0 : -1;
    if (!rc && x->numel > 0)
        rc = TIDE_DISPATCH(x->device, layernorm, "layernorm", x->dtype, tide_data(o), tide_data(mean), tide_data(rstd),
                           tide_data(x), tide_data(w), b ? tide_data(b) : NULL, N, C, n->attr.norm.eps);
    if (!rc) rc = tide_node_save(n, x) || tide_node_save(n, w) || tide_node_save(n, mean) || tide_node_save(n, rstd);
    tide_tensor_release(x); tide_tensor_release(w); tide_tensor_release(b); tide_tensor_release(mean); tide_tensor_release(rstd);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_layernorm_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int has_b = n->n_in == 3;
    tide_tensor *x = n->saved[0], *w = n->saved[1], *mean = n->saved[2], *rstd = n->saved[3];
    int64_t C = x->shape[x->ndim - 1], N = C ? x->numel / C : 0;
    tide_tensor *g = tide_contiguous_nograd(gout[0]);
    tide_tensor *dx = g ? tide_empty_like(x) : NULL, *dw = dx ? tide_zeros(w->dtype, 1, &C, w->device) : NULL;
    tide_tensor *db = (dw && has_b) ? tide_zeros(w->dtype, 1, &C, w->device) : NULL;
    int rc = (dw && (!has_b || db)) ? 0 : -1;
    if (!rc && x->numel > 0)
        rc = TIDE_DISPATCH(x->device, layernorm_backward, "layernorm", x->dtype, tide_data(dx), tide_data(dw),
                           db ? tide_data(db) : NULL, tide_data(g), tide_data(x), tide_data(w), tide_data(mean),
                           tide_data(rstd), N, C);
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(dx); tide_tensor_release(dw); tide_tensor_release(db); return -1; }
    gin[0] = dx;
    gin[1] = dw;
    if (has_b) gin[2] = db;
    return 0;
}

tide_tensor *tide_layernorm(tide_tensor *x, tide_tensor *weight, tide_tensor *bias, double eps)
{
    if (norm_check(x, weight, bias, "layernorm")) return NULL;
    TIDE_CHECK(eps >= 0 && isfinite(eps), "layernorm: eps must be finite and >= 0, got %g", eps);
    tide_attrs at = {0};
    at.norm.eps = eps;
    tide_tensor *in[3] = {x, weight, bias};
    return tide_op_run1(TIDE_OP_LAYERNORM, bias ? 3 : 2, in, &at);
}

/* ---- softmax / log_softmax over any dim (the kernel works on the last dim; other dims are moved there) ----------- */
static tide_tensor *move_last(tide_tensor *x, int d)
{
    int64_t shape[TIDE_MAX_DIMS], stride[TIDE_MAX_DIMS];
    int k = 0;
    for (int i = 0; i < x->ndim; i++) if (i != d) { shape[k] = x->shape[i]; stride[k++] = x->stride[i]; }
    shape[k] = x->shape[d];
    stride[k] = x->stride[d];
    tide_tensor *v = tide_view_of(x, x->ndim, shape, stride, x->offset);
    tide_tensor *c = v ? tide_contiguous_nograd(v) : NULL;
    tide_tensor_release(v);
    return c;
}

/* inverse of move_last for a contiguous tensor: a view with the last dim back at d */
static tide_tensor *move_back(tide_tensor *y, int d)
{
    int64_t shape[TIDE_MAX_DIMS], stride[TIDE_MAX_DIMS];
    int last = y->ndim - 1, k = 0;
    for (int i = 0; i < y->ndim; i++) {
        if (i == d) { shape[i] = y->shape[last]; stride[i] = y->stride[last]; }
        else { shape[i] = y->shape[k]; stride[i] = y->stride[k]; k++; }
    }
    return tide_view_of(y, y->ndim, shape, stride, y->offset);
}

int tide_softmax_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int d = n->attr.softmax.dim, lg = n->attr.softmax.log;
    tide_tensor *x = move_last(in[0], d);
    if (!x) return -1;
    int64_t C = x->ndim ? x->shape[x->ndim - 1] : 1, N = C ? x->numel / C : 0;
    tide_tensor *y = tide_empty_like(x);
    int rc = y ? 0 : -1;
    if (!rc && x->numel > 0) rc = TIDE_DISPATCH(x->device, softmax, "softmax", x->dtype, tide_data(y), tide_data(x), N,
                                                C, lg);
    if (!rc) rc = tide_node_save(n, y);
    tide_tensor_release(x);
    if (!rc) { out[0] = move_back(y, d); rc = out[0] ? 0 : -1; }
    tide_tensor_release(y);
    return rc;
}

int tide_softmax_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int d = n->attr.softmax.dim, lg = n->attr.softmax.log;
    tide_tensor *y = n->saved[0];
    int64_t C = y->ndim ? y->shape[y->ndim - 1] : 1, N = C ? y->numel / C : 0;
    tide_tensor *g = move_last(gout[0], d), *dx = g ? tide_empty_like(y) : NULL;
    int rc = dx ? 0 : -1;
    if (!rc && y->numel > 0) rc = TIDE_DISPATCH(y->device, softmax_backward, "softmax", y->dtype, tide_data(dx),
                                                tide_data(g), tide_data(y), N, C, lg);
    tide_tensor_release(g);
    if (!rc) { gin[0] = move_back(dx, d); rc = gin[0] ? 0 : -1; }
    tide_tensor_release(dx);
    return rc;
}

static tide_tensor *softmax_like(int op, tide_tensor *x, int dim, int lg)
{
    const char *name = lg ? "log_softmax" : "softmax";
    if (tide_check_float(x, name, "x")) return NULL;
    int d;
    if (tide_norm_dim(dim, x->ndim, name, &d)) return NULL;
    TIDE_CHECK(x->ndim >= 1, "%s: x must have at least one dim", name);
    tide_attrs at = {0};
    at.softmax.dim = d;
    at.softmax.log = lg;
    tide_tensor *in[1] = {x};
    return tide_op_run1(op, 1, in, &at);
}

tide_tensor *tide_softmax(tide_tensor *x, int dim) { return softmax_like(TIDE_OP_SOFTMAX, x, dim, 0); }
tide_tensor *tide_log_softmax(tide_tensor *x, int dim) { return softmax_like(TIDE_OP_LOG_SOFTMAX, x, dim, 1); }

/* ---- cross-entropy ------------------------------------------------------------------------------------------------ */
/* saved slots (weights empty when not given) */
enum { CE_SAVED_LOGITS, CE_SAVED_LSE, CE_SAVED_TARGETS, CE_SAVED_WEIGHTS };

int tide_cross_entropy_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int red = n->attr.cross_entropy.reduction;
    tide_tensor *lg = tide_contiguous_nograd(in[0]), *t = lg ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *w = (t && n->n_in == 3) ? tide_contiguous_nograd(in[2]) : NULL;
    if (!t || (n->n_in == 3 && !w)) { tide_tensor_release(lg); tide_tensor_release(t); return -1; }
    int64_t N = lg->shape[0], V = lg->shape[1];
    tide_tensor *loss = tide_empty(lg->dtype, 1, &N, lg->device), *valid = loss ? tide_empty(lg->dtype, 1, &N, lg->device) : NULL;
    tide_tensor *lse = valid ? tide_empty(lg->dtype, 1, &N, lg->device) : NULL;
    tide_tensor *o = NULL;
    int rc = lse ? 0 : -1;
    if (!rc && N > 0)
        rc = TIDE_DISPATCH(lg->device, cross_entropy, "cross_entropy", lg->dtype, tide_data(loss), tide_data(valid),
                           tide_data(lse), tide_data(lg), tide_data(t), t->dtype, w ? tide_data(w) : NULL, N, V,
                           n->attr.cross_entropy.ignore_index);
    if (!rc && red == 2) { o = loss; tide_tensor_retain(o); }
    if (!rc && red != 2) {
        o = tide_sum(loss, 0, NULL, 0);
        double denom = 1.0;
        if (o && red == 0) {
            tide_tensor *s = tide_sum(valid, 0, NULL, 0);
            denom = s ? tide_item(s) : NAN;
            tide_tensor_release(s);
            if (isnan(denom)) rc = -1;
            else if (denom != 0) rc = tide_scale_(o, 1.0 / denom);   /* no unmasked token: the loss is 0 */
        }
        n->attr.cross_entropy.denom = denom;
        if (!o) rc = -1;
        else if (!rc && red == 0 && n->n_in == 3) n->attr.cross_entropy.loss = tide_item(o);   /* the weights' gradient needs L */
    }
    if (!rc) rc = tide_node_save(n, lg) || tide_node_save(n, lse) || tide_node_save(n, t) || tide_node_save(n, w);
    tide_tensor_release(lg); tide_tensor_release(t); tide_tensor_release(w);
    tide_tensor_release(loss); tide_tensor_release(valid); tide_tensor_release(lse);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_cross_entropy_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int red = n->attr.cross_entropy.reduction;
    tide_tensor *lg = n->saved[CE_SAVED_LOGITS], *lse = n->saved[CE_SAVED_LSE], *t = n->saved[CE_SAVED_TARGETS];
    tide_tensor *w = n->saved[CE_SAVED_WEIGHTS];
    int64_t N = lg->shape[0], V = lg->shape[1];
    tide_tensor *dloss;
    if (red == 2) dloss = tide_contiguous_nograd(gout[0]);
    else {
        double g = tide_item(gout[0]);
        if (isnan(g) && tide_last_error()[0]) return -1;
        double denom = n->attr.cross_entropy.denom;
        dloss = tide_full(lg->dtype, 1, &N, lg->device, red == 0 ? (denom != 0 ? g / denom : 0.0) : g);
    }
    tide_tensor *dl = dloss ? tide_empty_like(lg) : NULL;
    int rc = dl ? 0 : -1;
    if (!rc && N > 0)
        rc = TIDE_DISPATCH(lg->device, cross_entropy_backward, "cross_entropy", lg->dtype, tide_data(dl),
                           tide_data(dloss), tide_data(lg), tide_data(lse), tide_data(t), t->dtype,
                           w ? tide_data(w) : NULL, N, V, n->attr.cross_entropy.ignore_index);
    if (!rc && w && n->in_needs_grad[2]) {
        /* d/dw_n: per-token unweighted loss ce_n (0 where ignored), minus L for the mean, over its denominator */
        tide_tensor *ce = tide_empty(lg->dtype, 1, &N, lg->device), *ok = ce ? tide_empty(lg->dtype, 1, &N, lg->device) : NULL;
        tide_tensor *lse2 = ok ? tide_empty(lg->dtype, 1, &N, lg->device) : NULL, *gw = NULL;
        rc = lse2 ? 0 : -1;
        if (!rc && N > 0)
            rc = TIDE_DISPATCH(lg->device, cross_entropy, "cross_entropy", lg->dtype, tide_data(ce), tide_data(ok),
                               tide_data(lse2), tide_data(lg), tide_data(t), t->dtype, NULL, N, V,
                               n->attr.cross_entropy.ignore_index);
        if (!rc && red == 0) {
            double denom = n->attr.cross_entropy.denom, L = n->attr.cross_entropy.loss, g = tide_item(gout[0]);
            tide_tensor *shifted = tide_empty_like(ce);
            rc = shifted ? tide_copy_(shifted, ce) : -1;
            if (!rc) rc = tide_axpy_(shifted, -L, ok);
            if (!rc) gw = tide_mul_scalar(shifted, denom != 0 ? g / denom : 0.0);
            tide_tensor_release(shifted);
        } else if (!rc) {
            gw = red == 1 ? tide_mul_scalar(ce, tide_item(gout[0])) : tide_mul(ce, dloss);
        }
        if (!rc && !gw) rc = -1;
        tide_tensor_release(ce); tide_tensor_release(ok); tide_tensor_release(lse2);
        gin[2] = gw;
    }
    tide_tensor_release(dloss);
    if (rc) { tide_tensor_release(dl); return -1; }
    gin[0] = dl;
    return 0;
}

tide_tensor *tide_cross_entropy(tide_tensor *logits, tide_tensor *targets, tide_tensor *weights, int64_t ignore_index,
                                int reduction)
{
    if (tide_check_float(logits, "cross_entropy", "logits") || tide_check_index_dtype(targets, "cross_entropy", "targets") ||
        tide_check_same_device(logits, targets, "cross_entropy")) return NULL;
    char a[128], b[128];
    TIDE_CHECK(logits->ndim == 2, "cross_entropy: logits must be [N, V], got %s", SHAPE_STR(logits, a));
    TIDE_CHECK(targets->ndim == 1 && targets->shape[0] == logits->shape[0],
               "cross_entropy: targets are %s but logits are %s (targets must be [N])", SHAPE_STR(targets, a), SHAPE_STR(logits, b));
    if (weights) {
        if (tide_check_float(weights, "cross_entropy", "weights") || tide_check_same_dtype(logits, weights, "cross_entropy") ||
            tide_check_same_device(logits, weights, "cross_entropy")) return NULL;
        TIDE_CHECK(weights->ndim == 1 && weights->shape[0] == logits->shape[0],
                   "cross_entropy: weights are %s but logits are %s (weights must be [N])", SHAPE_STR(weights, a), SHAPE_STR(logits, b));
    }
    TIDE_CHECK(reduction >= 0 && reduction <= 2, "cross_entropy: reduction must be 0 (mean), 1 (sum) or 2 (none), got %d", reduction);
    tide_attrs at = {0};
    at.cross_entropy.ignore_index = ignore_index;
    at.cross_entropy.reduction = reduction;
    tide_tensor *in[3] = {logits, targets, weights};
    return tide_op_run1(TIDE_OP_CROSS_ENTROPY, weights ? 3 : 2, in, &at);
}

/* ---- RoPE ---------------------------------------------------------------------------------------------------------- */
static int rope_apply(tide_tensor *x, double theta, int64_t pos0, int inverse, tide_tensor **out)
{
    tide_tensor *c = tide_contiguous_nograd(x), *o = c ? tide_empty_like(c) : NULL;
    int rc = o ? 0 : -1;
    if (!rc && c->numel > 0)
        rc = TIDE_DISPATCH(c->device, rope, "rope", c->dtype, tide_data(o), tide_data(c), c->shape[0], c->shape[1],
                           c->shape[2], c->shape[3], theta, pos0, inverse);
    tide_tensor_release(c);
    if (rc) { tide_tensor_release(o); return -1; }
    *out = o;
    return 0;
}

int tide_rope_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    return rope_apply(in[0], n->attr.rope.theta, n->attr.rope.pos0, 0, &out[0]);
}

int tide_rope_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    return rope_apply(gout[0], n->attr.rope.theta, n->attr.rope.pos0, 1, &gin[0]);
}

tide_tensor *tide_rope(tide_tensor *x, double theta, int64_t pos0)
{
    if (tide_check_float(x, "rope", "x")) return NULL;
    char a[128];
    TIDE_CHECK(x->ndim == 4 && x->shape[3] % 2 == 0, "rope: x must be [B, T, H, D] with D even, got %s", SHAPE_STR(x, a));
    TIDE_CHECK(theta > 0 && isfinite(theta), "rope: theta must be positive, got %g", theta);
    TIDE_CHECK(pos0 >= 0, "rope: pos0 must be >= 0, got %lld", (long long)pos0);
    tide_attrs at = {0};
    at.rope.pos0 = pos0;
    at.rope.theta = theta;
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_ROPE, 1, in, &at);
}

/* ---- causal softmax attention ------------------------------------------------------------------------------------- */
int tide_attention_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *q = tide_contiguous_nograd(in[0]), *k = q ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *v = k ? tide_contiguous_nograd(in[2]) : NULL;
    if (!v) { tide_tensor_release(q); tide_tensor_release(k); return -1; }
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], Tk = k->shape[2], D = q->shape[3];
    int64_t lshape[3] = {B, H, Tq};
    tide_tensor *o = tide_empty_like(q), *lse = o ? tide_empty(q->dtype, 3, lshape, q->device) : NULL;
    int rc = lse ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(q->device, attention, "attention", q->dtype, tide_data(o), tide_data(lse), tide_data(q),
                           tide_data(k), tide_data(v), B * H, Tq, Tk, D, n->attr.attention.causal,
                           n->attr.attention.scale);
    if (!rc) rc = tide_node_save(n, q) || tide_node_save(n, k) || tide_node_save(n, v) || tide_node_save(n, o) || tide_node_save(n, lse);
    tide_tensor_release(q); tide_tensor_release(k); tide_tensor_release(v); tide_tensor_release(lse);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_attention_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *q = n->saved[0], *k = n->saved[1], *v = n->saved[2], *o = n->saved[3], *lse = n->saved[4];
    int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], Tk = k->shape[2], D = q->shape[3];
    tide_tensor *g = tide_contiguous_nograd(gout[0]);
    tide_tensor *dq = g ? tide_empty_like(q) : NULL, *dk = dq ? tide_empty_like(k) : NULL, *dv = dk ? tide_empty_like(v) : NULL;
    int rc = dv ? 0 : -1;
    if (!rc && q->numel > 0)
        rc = TIDE_DISPATCH(q->device, attention_backward, "attention", q->dtype, tide_data(dq), tide_data(dk),
                           tide_data(dv), tide_data(g), tide_data(q), tide_data(k), tide_data(v), tide_data(o),
                           tide_data(lse), B * H, Tq, Tk, D, n->attr.attention.causal, n->attr.attention.scale);
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(dq); tide_tensor_release(dk); tide_tensor_release(dv); return -1; }
    gin[0] = dq; gin[1] = dk; gin[2] = dv;
    return 0;
}

tide_tensor *tide_attention(tide_tensor *q, tide_tensor *k, tide_tensor *v, int causal, double scale)
{
    const char *op = "attention";
    if (tide_check_float(q, op, "q") || tide_check_float(k, op, "k") || tide_check_float(v, op, "v") ||
        tide_check_same_device(q, k, op) || tide_check_same_device(q, v, op) || tide_check_same_dtype(q, k, op) ||
        tide_check_same_dtype(q, v, op)) return NULL;
    char a[128], b[128], c[128];
    int ok = q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && tide_same_shape(k, v) && q->shape[0] == k->shape[0] &&
             q->shape[1] == k->shape[1] && q->shape[3] == k->shape[3];
    TIDE_CHECK(ok, "attention: q %s, k %s, v %s must be [B, H, Tq, D], [B, H, Tk, D], [B, H, Tk, D]", SHAPE_STR(q, a),
               SHAPE_STR(k, b), SHAPE_STR(v, c));
    TIDE_CHECK(!causal || q->shape[2] <= k->shape[2], "attention: causal attention needs Tq <= Tk, got %lld > %lld",
               (long long)q->shape[2], (long long)k->shape[2]);
    TIDE_CHECK(isfinite(scale), "attention: scale must be finite, got %g", scale);
    tide_attrs at = {0};
    at.attention.causal = causal ? 1 : 0;
    at.attention.scale = scale;
    tide_tensor *in[3] = {q, k, v};
    return tide_op_run1(TIDE_OP_ATTENTION, 3, in, &at);
}

/* ---- AdamW (in place, no graph) -------------------------------------------------------------------------------------- */
int tide_adamw_step_(tide_tensor *param, const tide_tensor *grad, tide_tensor *m, tide_tensor *v, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step)
{
    const char *op = "adamw";
    if (tide_check_float(param, op, "param") || tide_check_float(grad, op, "grad") || tide_check_float(m, op, "m") ||
        tide_check_float(v, op, "v")) return -1;
    char a[128], b[128];
    const tide_tensor *others[3] = {grad, m, v};
    const char *names[3] = {"grad", "m", "v"};
    for (int i = 0; i < 3; i++) {
        if (!tide_same_shape(param, others[i]))
            return tide_set_error("adamw: %s is %s but param is %s", names[i], SHAPE_STR(others[i], a), SHAPE_STR(param, b));
        if (tide_check_same_device(param, others[i], op)) return -1;
    }
    if (!tide_is_contiguous(param) || !tide_is_contiguous(m) || !tide_is_contiguous(v))
        return tide_set_error("adamw: param, m and v must be contiguous");
    if (m->dtype != param->dtype || v->dtype != param->dtype)
        return tide_set_error("adamw: m and v must have the param's dtype %s", tide_dtype_name(param->dtype));
    if (!(lr >= 0) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) || !(eps > 0) || !(weight_decay >= 0) || step < 0)
        return tide_set_error("adamw: invalid hyper-parameters lr=%g beta1=%g beta2=%g eps=%g weight_decay=%g step=%lld", lr, beta1,
                              beta2, eps, weight_decay, (long long)step);
    /* the update reads grad in place when it already has the param's layout; otherwise a converted copy */
    tide_tensor *g;
    int rc = 0;
    if (grad->dtype == param->dtype && tide_is_contiguous(grad)) {
        g = (tide_tensor *)grad;
        tide_tensor_retain(g);
    } else {
        g = tide_empty(param->dtype, param->ndim, param->shape, param->device);
        if (!g) return -1;
        rc = tide_copy_(g, grad);
    }
    double bc1 = 1.0 - pow(beta1, (double)(step + 1)), bc2 = 1.0 - pow(beta2, (double)(step + 1));
    if (!rc && param->numel > 0)
        rc = TIDE_DISPATCH(param->device, adamw, "adamw", param->dtype, tide_data(param), tide_data(g), tide_data(m),
                           tide_data(v), param->numel, lr, beta1, beta2, eps, weight_decay, bc1, bc2);
    tide_tensor_release(g);
    return rc;
}

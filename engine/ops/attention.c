/* attention.c — causal (or full) softmax attention on [B, H, T, D] as one node; the row log-sum-exp is saved so
   the backward recomputes the probabilities. */
#include <math.h>
#include "../internal.h"

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

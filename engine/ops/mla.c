/* mla.c — the attention of gated NoPE MLA as one op (spec/mla.md §1, §4, §5): per-head queries with the rope
   slot last (scored, never rotated), per-head no-position keys, one rope-slot key shared by every head, values;
   document-causal masking from cu_seqlens; tiled kernels with an online softmax (memory linear in T). The
   node saves its inputs, the output and the row log-sum-exp. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "../internal.h"

static int lse_dtype(int dtype) { return dtype == TIDE_BF16 ? TIDE_F32 : dtype; }

/* saved slots (k_r empty when the heads share no rotary key) */
enum { MLA_SAVED_Q, MLA_SAVED_KN, MLA_SAVED_V, MLA_SAVED_OUT, MLA_SAVED_LSE, MLA_SAVED_KR };

int tide_mla_attention_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int has_kr = n->attr.mla_attention.has_kr;
    tide_tensor *q = tide_contiguous_nograd(in[0]), *kn = q ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *kr = kn && has_kr ? tide_contiguous_nograd(in[2]) : NULL;
    tide_tensor *v = kn && (kr || !has_kr) ? tide_contiguous_nograd(in[2 + has_kr]) : NULL;
    if (!v) { tide_tensor_release(q); tide_tensor_release(kn); tide_tensor_release(kr); return -1; }
    int64_t B = q->shape[0], Tq = q->shape[1], H = q->shape[2], dqk = q->shape[3], Tk = kn->shape[1], dn = kn->shape[3];
    int64_t dv = v->shape[3], oshape[4] = {B, Tq, H, dv}, lshape[3] = {B, H, Tq};
    tide_tensor *o = tide_empty(q->dtype, 4, oshape, q->device);
    tide_tensor *lse = o ? tide_empty(lse_dtype(q->dtype), 3, lshape, q->device) : NULL;
    int rc = lse ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(q->device, mla_attention, "mla_attention", q->dtype, tide_data(o), tide_data(lse),
                           tide_data(q), tide_data(kn), kr ? tide_data(kr) : NULL, tide_data(v),
                           n->attr.n_list ? n->attr.list : NULL, n->attr.n_list ? n->attr.n_list - 1 : 0, B, Tq, Tk, H,
                           dn, dqk - dn, dv, n->attr.mla_attention.scale);
    if (!rc) rc = tide_node_save(n, q) || tide_node_save(n, kn) || tide_node_save(n, v) || tide_node_save(n, o) ||
                  tide_node_save(n, lse) || tide_node_save(n, kr);
    tide_tensor_release(q); tide_tensor_release(kn); tide_tensor_release(kr); tide_tensor_release(v); tide_tensor_release(lse);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_mla_attention_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int has_kr = n->attr.mla_attention.has_kr;
    tide_tensor *q = n->saved[MLA_SAVED_Q], *kn = n->saved[MLA_SAVED_KN], *v = n->saved[MLA_SAVED_V];
    tide_tensor *o = n->saved[MLA_SAVED_OUT], *lse = n->saved[MLA_SAVED_LSE], *kr = n->saved[MLA_SAVED_KR];
    int64_t B = q->shape[0], Tq = q->shape[1], H = q->shape[2], dqk = q->shape[3], Tk = kn->shape[1], dn = kn->shape[3];
    int64_t dv = v->shape[3];
    tide_tensor *g = tide_contiguous_nograd(gout[0]);
    /* inputs in order: q, k_n, [k_r], v */
    tide_tensor *src[4] = {q, kn, kr ? kr : v, v}, *grads[4] = {0};
    int n_in = 3 + has_kr, rc = g ? 0 : -1;
    for (int i = 0; i < n_in && !rc; i++)
        if (n->in_needs_grad[i] && !(grads[i] = tide_zeros(src[i]->dtype, src[i]->ndim, src[i]->shape, src[i]->device))) rc = -1;
    tide_tensor *gkr = has_kr ? grads[2] : NULL, *gv = grads[2 + has_kr];
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(q->device, mla_attention_backward, "mla_attention", q->dtype,
                           grads[0] ? tide_data(grads[0]) : NULL, grads[1] ? tide_data(grads[1]) : NULL,
                           gkr ? tide_data(gkr) : NULL, gv ? tide_data(gv) : NULL, tide_data(g), tide_data(q),
                           tide_data(kn), kr ? tide_data(kr) : NULL, tide_data(v), tide_data(o), tide_data(lse),
                           n->attr.n_list ? n->attr.list : NULL, n->attr.n_list ? n->attr.n_list - 1 : 0, B, Tq, Tk, H,
                           dn, dqk - dn, dv, n->attr.mla_attention.scale);
    tide_tensor_release(g);
    if (rc) { for (int i = 0; i < 4; i++) tide_tensor_release(grads[i]); return -1; }
    for (int i = 0; i < n_in; i++) gin[i] = grads[i];
    return 0;
}

tide_tensor *tide_mla_attention(tide_tensor *q, tide_tensor *k_n, tide_tensor *k_r, tide_tensor *v, tide_tensor *cu_seqlens,
                                double scale)
{
    const char *op = "mla_attention";
    if (tide_check_float(q, op, "q") || tide_check_float(k_n, op, "k_n") || tide_check_float(v, op, "v") ||
        tide_check_same_device(q, k_n, op) || tide_check_same_device(q, v, op) || tide_check_same_dtype(q, k_n, op) ||
        tide_check_same_dtype(q, v, op)) return NULL;
    char a[128], b[128], c[128], d[128];
    int ok = q->ndim == 4 && k_n->ndim == 4 && v->ndim == 4 && k_n->shape[0] == q->shape[0] && v->shape[0] == q->shape[0] &&
             k_n->shape[2] == q->shape[2] && v->shape[2] == q->shape[2] && v->shape[1] == k_n->shape[1] &&
             k_n->shape[3] <= q->shape[3];
    TIDE_CHECK(ok, "mla_attention: q %s, k_n %s, v %s must be [B, Tq, H, dn + dr], [B, Tk, H, dn], [B, Tk, H, dv]",
               SHAPE_STR(q, a), SHAPE_STR(k_n, b), SHAPE_STR(v, c));
    int64_t B = q->shape[0], Tq = q->shape[1], Tk = k_n->shape[1], dr = q->shape[3] - k_n->shape[3];
    if (k_r) {
        if (tide_check_float(k_r, op, "k_r") || tide_check_same_device(q, k_r, op) || tide_check_same_dtype(q, k_r, op)) return NULL;
        TIDE_CHECK(k_r->ndim == 3 && k_r->shape[0] == B && k_r->shape[1] == Tk && k_r->shape[2] == dr && dr > 0,
                   "mla_attention: k_r is %s but q %s and k_n %s need it [B, Tk, dr] = [%lld, %lld, %lld]", SHAPE_STR(k_r, a),
                   SHAPE_STR(q, b), SHAPE_STR(k_n, d), (long long)B, (long long)Tk, (long long)dr);
    } else {
        TIDE_CHECK(dr == 0, "mla_attention: q has %lld rope-slot dims (q %s, k_n %s) but k_r is NULL", (long long)dr, SHAPE_STR(q, a),
                   SHAPE_STR(k_n, b));
    }
    TIDE_CHECK(Tq <= Tk, "mla_attention: causal attention needs Tq <= Tk, got %lld > %lld", (long long)Tq, (long long)Tk);
    TIDE_CHECK(!cu_seqlens || Tq == Tk, "mla_attention: cu_seqlens needs Tq = Tk (a packed row), got %lld and %lld",
               (long long)Tq, (long long)Tk);
    TIDE_CHECK(isfinite(scale) && scale > 0, "mla_attention: scale must be positive and finite, got %g", scale);
    tide_attrs at = {0};
    at.mla_attention.has_kr = k_r != NULL;
    at.mla_attention.scale = scale;
    if (cu_seqlens && tide_load_boundaries(op, cu_seqlens, B, Tq, &at)) return NULL;
    tide_tensor *in[4] = {q, k_n, k_r ? k_r : v, v};
    tide_tensor *y = tide_op_run1(TIDE_OP_MLA_ATTENTION, k_r ? 4 : 3, in, &at);
    free(at.list);
    return y;
}

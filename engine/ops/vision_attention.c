/* vision_attention.c — varlen attention: bidirectional softmax attention over packed images, block-diagonal by
   cu_seqlens (spec/vision.md §3, §5). q, k, v [T, H, D]; query i sees exactly the keys of its segment. The kernels
   are the MLA ones (mla.md §4) without the causal limit: tiles of queries × keys with an online softmax, key tiles
   outside a query tile's segments skipped, no [T, T] buffer, memory linear in T. The node saves q, k, v, the output
   and the row log-sum-exp [H, T]; the boundaries live in the attribute list (empty segments dropped). */
#include <math.h>
#include <stdlib.h>
#include "../internal.h"

enum { VA_SAVED_Q, VA_SAVED_K, VA_SAVED_V, VA_SAVED_OUT, VA_SAVED_LSE };

static int va_lse_dtype(int dtype) { return dtype == TIDE_BF16 ? TIDE_F32 : dtype; }

int tide_varlen_attention_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *q = tide_contiguous_nograd(in[0]), *k = q ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *v = k ? tide_contiguous_nograd(in[2]) : NULL;
    if (!v) { tide_tensor_release(q); tide_tensor_release(k); return -1; }
    int64_t T = q->shape[0], H = q->shape[1], D = q->shape[2], lshape[2] = {H, T};
    tide_tensor *o = tide_empty_like(q), *lse = o ? tide_empty(va_lse_dtype(q->dtype), 2, lshape, q->device) : NULL;
    int rc = lse ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(q->device, varlen_attention, "varlen_attention", q->dtype, tide_data(o), tide_data(lse),
                           tide_data(q), tide_data(k), tide_data(v), n->attr.list, n->attr.n_list - 1, T, H, D,
                           n->attr.attention.scale);
    if (!rc) rc = tide_node_save(n, q) || tide_node_save(n, k) || tide_node_save(n, v) || tide_node_save(n, o) ||
                  tide_node_save(n, lse);
    tide_tensor_release(q); tide_tensor_release(k); tide_tensor_release(v); tide_tensor_release(lse);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_varlen_attention_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *q = n->saved[VA_SAVED_Q], *k = n->saved[VA_SAVED_K], *v = n->saved[VA_SAVED_V];
    tide_tensor *o = n->saved[VA_SAVED_OUT], *lse = n->saved[VA_SAVED_LSE];
    int64_t T = q->shape[0], H = q->shape[1], D = q->shape[2];
    tide_tensor *g = tide_contiguous_nograd(gout[0]), *src[3] = {q, k, v}, *grads[3] = {0};
    int rc = g ? 0 : -1;
    for (int i = 0; i < 3 && !rc; i++)
        if (n->in_needs_grad[i] && !(grads[i] = tide_empty_like(src[i]))) rc = -1;
    if (!rc && o->numel > 0 && (grads[0] || grads[1] || grads[2]))
        rc = TIDE_DISPATCH(q->device, varlen_attention_backward, "varlen_attention", q->dtype,
                           grads[0] ? tide_data(grads[0]) : NULL, grads[1] ? tide_data(grads[1]) : NULL,
                           grads[2] ? tide_data(grads[2]) : NULL, tide_data(g), tide_data(q), tide_data(k), tide_data(v),
                           tide_data(o), tide_data(lse), n->attr.list, n->attr.n_list - 1, T, H, D,
                           n->attr.attention.scale);
    tide_tensor_release(g);
    if (rc) { for (int i = 0; i < 3; i++) tide_tensor_release(grads[i]); return -1; }
    for (int i = 0; i < 3; i++) gin[i] = grads[i];
    return 0;
}

/* cu_seqlens (int [n + 1], from 0 to T, non-decreasing) into at->list without repeats (an empty segment adds
   nothing); the caller frees at->list */
static int va_load_boundaries(tide_tensor *cu, const tide_tensor *q, tide_attrs *at)
{
    char a[128], b[128];
    int64_t T = q->shape[0];
    if (tide_check_index_dtype(cu, "varlen_attention", "cu_seqlens")) return -1;
    TIDE_CHECK_INT(cu->ndim == 1 && cu->shape[0] >= 1,
                   "varlen_attention: cu_seqlens is %s but must be 1-D [n_images + 1] (q %s)", SHAPE_STR(cu, a),
                   SHAPE_STR(q, b));
    int64_t n = cu->shape[0];
    double *u = malloc((size_t)n * sizeof *u);
    int64_t *list = malloc((size_t)(n + 1) * sizeof *list), m = 0;   /* + 1: the T = 0 case below adds one */
    if (!u || !list) { free(u); free(list); return tide_set_error("varlen_attention: out of memory"); }
    int rc = tide_to_f64_buffer(cu, u, n);
    if (!rc && (u[0] != 0 || u[n - 1] != (double)T))
        rc = tide_set_error("varlen_attention: cu_seqlens %s runs from %.0f to %.0f but q %s needs 0 to T = %lld",
                            SHAPE_STR(cu, a), u[0], u[n - 1], SHAPE_STR(q, b), (long long)T);
    for (int64_t i = 1; i < n && !rc; i++)
        if (u[i] < u[i - 1])
            rc = tide_set_error("varlen_attention: cu_seqlens %s decreases at index %lld (%.0f then %.0f); boundaries "
                                "must not decrease", SHAPE_STR(cu, a), (long long)i, u[i - 1], u[i]);
    for (int64_t i = 0; i < n && !rc; i++)
        if (m == 0 || (int64_t)u[i] != list[m - 1]) list[m++] = (int64_t)u[i];
    if (!rc && m == 1) list[m++] = T;       /* T = 0: one empty segment, so n_seg >= 1 reaches the kernels */
    free(u);
    if (rc) { free(list); return -1; }
    at->list = list;
    at->n_list = (int)m;
    return 0;
}

tide_tensor *tide_varlen_attention(tide_tensor *q, tide_tensor *k, tide_tensor *v, tide_tensor *cu_seqlens, double scale)
{
    const char *op = "varlen_attention";
    if (tide_check_float(q, op, "q") || tide_check_float(k, op, "k") || tide_check_float(v, op, "v") ||
        tide_check_same_device(q, k, op) || tide_check_same_device(q, v, op) || tide_check_same_dtype(q, k, op) ||
        tide_check_same_dtype(q, v, op)) return NULL;
    char a[128], b[128], c[128];
    TIDE_CHECK(q->ndim == 3 && tide_same_shape(q, k) && tide_same_shape(q, v) && q->shape[1] >= 1 && q->shape[2] >= 1,
               "varlen_attention: q %s, k %s, v %s must all be [T, H, D] (H, D >= 1)", SHAPE_STR(q, a), SHAPE_STR(k, b),
               SHAPE_STR(v, c));
    TIDE_CHECK(cu_seqlens, "varlen_attention: cu_seqlens is NULL (q %s): give the image boundaries [0, L_1, ..., T]",
               SHAPE_STR(q, a));
    TIDE_CHECK(isfinite(scale), "varlen_attention: scale must be finite, got %g", scale);
    tide_attrs at = {0};
    at.attention.causal = 0;
    at.attention.scale = scale;
    if (va_load_boundaries(cu_seqlens, q, &at)) return NULL;
    tide_tensor *in[3] = {q, k, v};
    tide_tensor *y = tide_op_run1(TIDE_OP_VARLEN_ATTENTION, 3, in, &at);
    free(at.list);
    return y;
}

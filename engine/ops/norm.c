/* norm.c — RMSNorm and LayerNorm over the last dim, one fused node each with a hand-written backward. */
#include <math.h>
#include "../internal.h"

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

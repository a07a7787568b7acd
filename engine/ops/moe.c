/* moe.c — the ops of the sparse MoE layer (spec/moe.md): the SiTU-GLU activation (§6), top-k over the last dim
   (§2: the router's selection, ties to the lowest index) and the routed experts with dispatch and combine as one
   node (§7, §8). The experts node saves the sort (int64 route), the gate/up pre-activations and the expert
   outputs y in sorted order: y gives dp = du · y without a second down GEMM, the activation h is recomputed
   from the pre-activations (one elementwise pass) instead of being stored. */
#include <math.h>
#include <stdlib.h>
#include "../internal.h"

/* ---- SiTU-GLU (§6) ------------------------------------------------------------------------------------------ */
int tide_situ_glu_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *g = tide_contiguous_nograd(in[0]), *u = g ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *o = u ? tide_empty_like(g) : NULL;
    int rc = o ? 0 : -1;
    if (!rc && g->numel > 0) rc = TIDE_DISPATCH(in[0]->device, situ_glu, "situ_glu", g->dtype, tide_data(o),
                                                tide_data(g), tide_data(u), g->numel, n->attr.situ_glu.k_gate,
                                                n->attr.situ_glu.k_lin);
    if (!rc) rc = tide_node_save(n, g) || tide_node_save(n, u);
    tide_tensor_release(g); tide_tensor_release(u);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_situ_glu_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *g = n->saved[0], *u = n->saved[1];
    tide_tensor *d = tide_contiguous_nograd(gout[0]);
    tide_tensor *dg = d ? tide_empty_like(g) : NULL, *du = dg ? tide_empty_like(u) : NULL;
    int rc = du ? 0 : -1;
    if (!rc && g->numel > 0)
        rc = TIDE_DISPATCH(g->device, situ_glu_backward, "situ_glu", g->dtype, tide_data(dg), tide_data(du),
                           tide_data(d), tide_data(g), tide_data(u), g->numel, n->attr.situ_glu.k_gate,
                           n->attr.situ_glu.k_lin);
    tide_tensor_release(d);
    if (rc) { tide_tensor_release(dg); tide_tensor_release(du); return -1; }
    gin[0] = dg;
    gin[1] = du;
    return 0;
}

tide_tensor *tide_situ_glu(tide_tensor *g, tide_tensor *u, double k_gate, double k_lin)
{
    const char *op = "situ_glu";
    if (tide_check_float(g, op, "g") || tide_check_float(u, op, "u") || tide_check_same_device(g, u, op) ||
        tide_check_same_dtype(g, u, op)) return NULL;
    char a[128], b[128];
    TIDE_CHECK(tide_same_shape(g, u), "situ_glu: g is %s but u is %s: they need one shape", SHAPE_STR(g, a), SHAPE_STR(u, b));
    TIDE_CHECK(isfinite(k_gate) && k_gate > 0 && isfinite(k_lin) && k_lin > 0,
               "situ_glu: k_gate = %g and k_lin = %g must be positive and finite", k_gate, k_lin);
    tide_attrs at = {0};
    at.situ_glu.k_gate = k_gate;
    at.situ_glu.k_lin = k_lin;
    tide_tensor *in[2] = {g, u};
    return tide_op_run1(TIDE_OP_SITU_GLU, 2, in, &at);
}

/* ---- top-k over the last dim (§2) ------------------------------------------------------------------------------ */
int tide_topk_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *x = tide_contiguous_nograd(in[0]);
    if (!x) return -1;
    int64_t k = n->attr.topk.k, C = x->shape[x->ndim - 1], rows = C ? x->numel / C : 0, shape[TIDE_MAX_DIMS];
    for (int i = 0; i < x->ndim; i++) shape[i] = x->shape[i];
    shape[x->ndim - 1] = k;
    tide_tensor *v = tide_empty(x->dtype, x->ndim, shape, x->device);
    tide_tensor *id = v ? tide_empty(TIDE_I64, x->ndim, shape, x->device) : NULL;
    int rc = id ? 0 : -1;
    if (!rc && v->numel > 0) rc = TIDE_DISPATCH(x->device, topk, "topk", x->dtype, tide_data(v), tide_data(id),
                                                tide_data(x), rows, C, k);
    if (!rc) rc = tide_node_save(n, id);
    tide_tensor_release(x);
    if (rc) { tide_tensor_release(v); tide_tensor_release(id); return -1; }
    out[0] = v;
    out[1] = id;
    return 0;
}

/* the value gradient goes back to the selected positions (scatter along the last dim; indices are distinct) */
int tide_topk_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *id = n->saved[0];
    tide_meta *xm = &n->in_meta[0];
    int64_t C = xm->shape[xm->ndim - 1], k = n->attr.topk.k, rows = id->numel / (k ? k : 1);
    tide_tensor *g = tide_contiguous_nograd(gout[0]);
    tide_tensor *gx = g ? tide_zeros(xm->dtype, xm->ndim, xm->shape, xm->device) : NULL;
    int rc = gx ? 0 : -1;
    if (!rc && id->numel > 0) rc = TIDE_DISPATCH(xm->device, scatter_add, "topk", xm->dtype, tide_data(gx),
                                                 tide_data(g), tide_data(id), TIDE_I64, rows, C, k, 1);
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(gx); return -1; }
    gin[0] = gx;
    return 0;
}

int tide_topk(tide_tensor *x, int k, tide_tensor **values, tide_tensor **indices)
{
    const char *op = "topk";
    TIDE_CHECK_INT(values && indices, "topk: values and indices must be non-NULL output pointers");
    *values = *indices = NULL;
    if (tide_check_float(x, op, "x")) return -1;
    char a[128];
    TIDE_CHECK_INT(x->ndim >= 1, "topk: x must have at least one dim, got a scalar");
    int64_t C = x->shape[x->ndim - 1];
    TIDE_CHECK_INT(k >= 1 && k <= C, "topk: k = %d must be in [1, %lld] (the last dim of x %s)", k, (long long)C,
                   SHAPE_STR(x, a));
    tide_attrs at = {0};
    at.topk.k = k;
    tide_tensor *out[2];
    if (tide_op_run(TIDE_OP_TOPK, 1, &x, 2, out, &at)) return -1;
    *values = out[0];
    *indices = out[1];
    return 0;
}

/* ---- routed experts with dispatch and combine (§7, §8) --------------------------------------------------------- */
/* outputs: the combined expert outputs, and the count of (token, slot) rows the capacity dropped (int64 [1] on
   the host: the kernel counts them there) */
enum { MOE_OUT_Y, MOE_OUT_DROPPED };
enum { MOE_SAVED_X, MOE_SAVED_P, MOE_SAVED_W_GATE_UP, MOE_SAVED_W_DOWN, MOE_SAVED_ROUTE, MOE_SAVED_PRE, MOE_SAVED_Y,
       MOE_SAVED_OFFSETS };   /* offsets: the route's group offsets on the host (int64 [n + 1]), for the backward */

int tide_moe_experts_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *c[5] = {0};
    for (int i = 0; i < 5; i++)
        if (!(c[i] = tide_contiguous_nograd(in[i]))) { for (int j = 0; j < i; j++) tide_tensor_release(c[j]); return -1; }
    tide_tensor *x = c[0], *sel = c[1], *p = c[2], *wgu = c[3], *wd = c[4];
    int64_t m = x->shape[0], d_in = x->shape[1], k = sel->shape[1], ne = wgu->shape[0], d_e = wgu->shape[1] / 2;
    int64_t d_out = wd->shape[1], A = m * k;
    tide_tensor *o = tide_empty(x->dtype, 2, (int64_t[]){m, d_out}, x->device);
    tide_tensor *route = o ? tide_empty(TIDE_I64, 1, (int64_t[]){2 * A + ne + 1}, x->device) : NULL;
    tide_tensor *pre = route ? tide_empty(x->dtype, 2, (int64_t[]){A, 2 * d_e}, x->device) : NULL;
    tide_tensor *y = pre ? tide_empty(x->dtype, 2, (int64_t[]){A, d_out}, x->device) : NULL;
    /* the segment offsets on the host, for the backward only: a forward no backward will follow (not recorded) asks
       for none, which lets a device backend route a small batch without reading them back (cuda: no host sync) */
    tide_tensor *hoff = y && !n->no_saves ? tide_empty(TIDE_I64, 1, (int64_t[]){ne + 1}, TIDE_CPU) : NULL;
    int rc = y && (hoff || n->no_saves) ? 0 : -1;
    int64_t dropped = 0;
    if (!rc)
        rc = TIDE_DISPATCH(x->device, moe_experts, "moe_experts", x->dtype, tide_data(o), tide_data(route),
                           tide_data(pre), tide_data(y), tide_data(x), tide_data(sel), sel->dtype, tide_data(p),
                           tide_data(wgu), tide_data(wd), m, k, ne, d_in, d_e, d_out, n->attr.moe_experts.activation,
                           n->attr.moe_experts.k_gate, n->attr.moe_experts.k_lin, n->attr.moe_experts.capacity,
                           &dropped, hoff ? (int64_t *)tide_data(hoff) : NULL);
    tide_tensor *dr = rc ? NULL : tide_full(TIDE_I64, 1, (int64_t[]){1}, TIDE_CPU, (double)dropped);
    if (!dr) rc = -1;
    if (!rc) rc = tide_node_save(n, x) || tide_node_save(n, p) || tide_node_save(n, wgu) || tide_node_save(n, wd) ||
                  tide_node_save(n, route) || tide_node_save(n, pre) || tide_node_save(n, y) || tide_node_save(n, hoff);
    for (int i = 0; i < 5; i++) tide_tensor_release(c[i]);
    tide_tensor_release(route); tide_tensor_release(pre); tide_tensor_release(y); tide_tensor_release(hoff);
    if (rc) { tide_tensor_release(o); tide_tensor_release(dr); return -1; }
    out[MOE_OUT_Y] = o;
    out[MOE_OUT_DROPPED] = dr;
    return 0;
}

int tide_moe_experts_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *x = n->saved[MOE_SAVED_X], *p = n->saved[MOE_SAVED_P], *wgu = n->saved[MOE_SAVED_W_GATE_UP];
    tide_tensor *wd = n->saved[MOE_SAVED_W_DOWN], *route = n->saved[MOE_SAVED_ROUTE], *pre = n->saved[MOE_SAVED_PRE];
    tide_tensor *y = n->saved[MOE_SAVED_Y], *hoff = n->saved[MOE_SAVED_OFFSETS];
    int64_t m = x->shape[0], d_in = x->shape[1], k = p->shape[1], ne = wgu->shape[0], d_e = wgu->shape[1] / 2;
    int64_t d_out = wd->shape[1];
    tide_tensor *g = tide_contiguous_nograd(gout[MOE_OUT_Y]);
    /* inputs: x, sel, p, w_gate_up, w_down (sel has no gradient) */
    tide_tensor *src[5] = {x, NULL, p, wgu, wd}, *grads[5] = {0};
    int rc = g ? 0 : -1;
    for (int i = 0; i < 5 && !rc; i++)
        if (src[i] && n->in_needs_grad[i] && !(grads[i] = tide_empty_like(src[i]))) rc = -1;
#define GP(i) (grads[i] ? tide_data(grads[i]) : NULL)
    if (!rc)
        rc = TIDE_DISPATCH(x->device, moe_experts_backward, "moe_experts", x->dtype, GP(0), GP(2), GP(3), GP(4),
                           tide_data(g), tide_data(route), (const int64_t *)tide_data(hoff), tide_data(pre),
                           tide_data(y), tide_data(x), tide_data(p),
                           tide_data(wgu), tide_data(wd), m, k, ne, d_in, d_e, d_out, n->attr.moe_experts.activation,
                           n->attr.moe_experts.k_gate, n->attr.moe_experts.k_lin);
#undef GP
    tide_tensor_release(g);
    if (rc) { for (int i = 0; i < 5; i++) tide_tensor_release(grads[i]); return -1; }
    for (int i = 0; i < 5; i++) gin[i] = grads[i];
    return 0;
}

static tide_tensor *moe_experts(tide_tensor *x, tide_tensor *sel, tide_tensor *p, tide_tensor *w_gate_up, tide_tensor *w_down,
                                int activation, double k_gate, double k_lin, double capacity_factor, int64_t capacity,
                                int64_t *dropped)
{
    const char *op = "moe_experts";
    if (tide_check_float(x, op, "x") || tide_check_index_dtype(sel, op, "sel") || tide_check_float(p, op, "p") ||
        tide_check_float(w_gate_up, op, "w_gate_up") || tide_check_float(w_down, op, "w_down")) return NULL;
    tide_tensor *all[5] = {x, sel, p, w_gate_up, w_down};
    for (int i = 1; i < 5; i++) if (tide_check_same_device(x, all[i], op)) return NULL;
    if (tide_check_same_dtype(x, p, op) || tide_check_same_dtype(x, w_gate_up, op) || tide_check_same_dtype(x, w_down, op))
        return NULL;
    char a[128], b[128], c[128], d[128], e[128];
    int ok = x->ndim == 2 && sel->ndim == 2 && p->ndim == 2 && w_gate_up->ndim == 3 && w_down->ndim == 3;
    ok = ok && sel->shape[0] == x->shape[0] && tide_same_shape(sel, p) && sel->shape[1] >= 1 &&
         w_gate_up->shape[2] == x->shape[1] && w_gate_up->shape[1] % 2 == 0 && w_gate_up->shape[1] > 0 &&
         w_down->shape[0] == w_gate_up->shape[0] && w_down->shape[2] == w_gate_up->shape[1] / 2 && w_gate_up->shape[0] >= 1;
    TIDE_CHECK(ok, "moe_experts: x %s, sel %s, p %s, w_gate_up %s, w_down %s must be [m, d_in], [m, k], [m, k], "
               "[n, 2·d_e, d_in], [n, d_out, d_e]", SHAPE_STR(x, a), SHAPE_STR(sel, b), SHAPE_STR(p, c), SHAPE_STR(w_gate_up, d),
               SHAPE_STR(w_down, e));
    TIDE_CHECK(activation == TIDE_MOE_SITU || activation == TIDE_MOE_SWIGLU,
               "moe_experts: activation = %d must be TIDE_MOE_SITU (0) or TIDE_MOE_SWIGLU (1)", activation);
    TIDE_CHECK(activation != TIDE_MOE_SITU || (isfinite(k_gate) && k_gate > 0 && isfinite(k_lin) && k_lin > 0),
               "moe_experts: k_gate = %g and k_lin = %g must be positive and finite", k_gate, k_lin);
    TIDE_CHECK(isfinite(capacity_factor) && capacity_factor >= 0,
               "moe_experts: capacity_factor = %g must be 0 (dropless) or positive", capacity_factor);
    int64_t ne = w_gate_up->shape[0], A = sel->numel;
    /* every expert id in [0, n): the kernels index weights with them. Deferrable: the sort leaves an id outside
       [0, n) unrouted, so no kernel reads out of bounds (a device backend may report it at its next synchronisation) */
    tide_tensor *sc = tide_contiguous_nograd(sel);
    int64_t bad = 0;
    int good = 1;
    if (!sc) return NULL;
    int rc = A > 0 ? TIDE_DISPATCH(sel->device, check_index, "moe_experts", "moe_experts", tide_data(sc), sc->dtype, A,
                                   ne, 1, &bad, &good) : 0;
    tide_tensor_release(sc);
    if (rc) return NULL;
    TIDE_CHECK(good, "moe_experts: sel holds expert id %lld, outside [0, %lld) (w_gate_up %s)", (long long)bad, (long long)ne,
               SHAPE_STR(w_gate_up, a));
    tide_attrs at = {0};
    at.moe_experts.activation = activation;
    at.moe_experts.capacity = capacity > 0 ? capacity
                              : capacity_factor > 0 ? (int64_t)ceil(capacity_factor * (double)A / (double)ne) : -1;
    at.moe_experts.k_gate = k_gate;
    at.moe_experts.k_lin = k_lin;
    tide_tensor *out[2];
    if (tide_op_run(TIDE_OP_MOE_EXPERTS, 5, all, 2, out, &at)) return NULL;
    double nd = tide_item(out[MOE_OUT_DROPPED]);
    tide_tensor_release(out[MOE_OUT_DROPPED]);
    if (isnan(nd)) { tide_tensor_release(out[MOE_OUT_Y]); return NULL; }
    if (dropped) *dropped = (int64_t)nd;
    return out[MOE_OUT_Y];
}

tide_tensor *tide_moe_experts(tide_tensor *x, tide_tensor *sel, tide_tensor *p, tide_tensor *w_gate_up, tide_tensor *w_down,
                              int activation, double k_gate, double k_lin, double capacity_factor, int64_t *dropped)
{
    return moe_experts(x, sel, p, w_gate_up, w_down, activation, k_gate, k_lin, capacity_factor, 0, dropped);
}

tide_tensor *tide_moe_experts_capacity(tide_tensor *x, tide_tensor *sel, tide_tensor *p, tide_tensor *w_gate_up,
                                       tide_tensor *w_down, int activation, double k_gate, double k_lin, int64_t capacity,
                                       int64_t *dropped)
{
    TIDE_CHECK(capacity >= 0, "moe_experts: capacity = %lld must be 0 (dropless) or positive", (long long)capacity);
    return moe_experts(x, sel, p, w_gate_up, w_down, activation, k_gate, k_lin, 0.0, capacity, dropped);
}

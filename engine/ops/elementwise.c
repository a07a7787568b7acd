/* elementwise.c — broadcasting binary ops, scalar ops, unary activations, fused SwiGLU. */
#include "../internal.h"

/* ---- binary (add, sub, mul, div) with numpy broadcasting ---------------------------------------------- */
#define NAME_OF(ID, name) [TIDE_BIN_##ID] = #name,
static const char *const binary_names[] = {TIDE_BINARY_OPS(NAME_OF)};
#undef NAME_OF
_Static_assert(sizeof binary_names / sizeof binary_names[0] == TIDE_BIN_COUNT, "one name per binary op");

int tide_binary_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int op = n->attr.binary.op;
    tide_tensor *a = in[0], *b = in[1];
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    int64_t shape[TIDE_MAX_DIMS], sa[TIDE_MAX_DIMS], sb[TIDE_MAX_DIMS];
    for (int i = 0; i < nd; i++) {
        int ia = i - (nd - a->ndim), ib = i - (nd - b->ndim);
        int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
        if (da != db && da != 1 && db != 1) {
            char x[128], y[128];
            return tide_set_error("%s: shapes %s and %s do not broadcast (dim %d: %lld vs %lld)", binary_names[op],
                                  tide_shape_str(a->ndim, a->shape, x, sizeof x), tide_shape_str(b->ndim, b->shape, y, sizeof y),
                                  i, (long long)da, (long long)db);
        }
        shape[i] = da == 1 ? db : da;
        sa[i] = (ia >= 0 && da != 1) ? a->stride[ia] : 0;
        sb[i] = (ib >= 0 && db != 1) ? b->stride[ib] : 0;
    }
    tide_tensor *o = tide_empty(a->dtype, nd, shape, a->device);
    if (!o) return -1;
    if (o->numel > 0 && TIDE_DISPATCH(a->device, binary, binary_names[op], op, a->dtype, tide_data(o), tide_data(a), sa,
                                      tide_data(b), sb, nd, shape)) {
        tide_tensor_release(o);
        return -1;
    }
    out[0] = o;
    if (op == TIDE_BIN_MUL || op == TIDE_BIN_DIV) {
        if (tide_node_save(n, a) || tide_node_save(n, b)) return -1;
    }
    return 0;
}

static int reduce_into(tide_tensor *g, const tide_meta *m, tide_tensor **dst)
{
    *dst = tide_sum_to_shape(g, m->ndim, m->shape);
    return *dst ? 0 : -1;
}

int tide_binary_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int op = n->attr.binary.op;
    tide_tensor *g = gout[0], *t = NULL;
    int rc = 0;
    if (op == TIDE_BIN_ADD || op == TIDE_BIN_SUB) {
        if (n->in_needs_grad[0]) rc |= reduce_into(g, &n->in_meta[0], &gin[0]);
        if (n->in_needs_grad[1]) {
            if (op == TIDE_BIN_SUB) { t = tide_neg(g); if (!t) return -1; }
            rc |= reduce_into(t ? t : g, &n->in_meta[1], &gin[1]);
        }
    } else if (op == TIDE_BIN_MUL) {
        tide_tensor *a = n->saved[0], *b = n->saved[1];
        if (n->in_needs_grad[0]) { t = tide_mul(g, b); rc |= t ? reduce_into(t, &n->in_meta[0], &gin[0]) : -1; tide_tensor_release(t); t = NULL; }
        if (n->in_needs_grad[1]) { t = tide_mul(g, a); rc |= t ? reduce_into(t, &n->in_meta[1], &gin[1]) : -1; }
    } else {   /* div: d/da = g / b, d/db = -g a / b² */
        tide_tensor *a = n->saved[0], *b = n->saved[1];
        tide_tensor *gb = tide_div(g, b);
        if (!gb) return -1;
        if (n->in_needs_grad[0]) rc |= reduce_into(gb, &n->in_meta[0], &gin[0]);
        if (n->in_needs_grad[1]) {
            tide_tensor *q = tide_div(a, b), *p = q ? tide_mul(gb, q) : NULL;
            t = p ? tide_neg(p) : NULL;
            rc |= t ? reduce_into(t, &n->in_meta[1], &gin[1]) : -1;
            tide_tensor_release(q); tide_tensor_release(p);
        }
        tide_tensor_release(gb);
    }
    tide_tensor_release(t);
    return rc ? -1 : 0;
}

static tide_tensor *binary(int op_id, int bop, tide_tensor *a, tide_tensor *b)
{
    const char *name = binary_names[bop];
    if (tide_check_float(a, name, "a") || tide_check_float(b, name, "b") || tide_check_same_device(a, b, name) ||
        tide_check_same_dtype(a, b, name)) return NULL;
    tide_attrs at = {0};
    at.binary.op = bop;
    tide_tensor *in[2] = {a, b};
    return tide_op_run1(op_id, 2, in, &at);
}

tide_tensor *tide_add(tide_tensor *a, tide_tensor *b) { return binary(TIDE_OP_ADD, TIDE_BIN_ADD, a, b); }

int tide_add_into_(tide_tensor *y, const tide_tensor *x)
{
    if (!tide_is_contiguous(y) || !tide_same_shape(x, y) || x->dtype != y->dtype || x->device != y->device)
        return tide_set_error("add_into_: y must be contiguous and x of its shape, dtype and device");
    if (y->numel == 0) return 0;
    int64_t sy[TIDE_MAX_DIMS], sx[TIDE_MAX_DIMS];
    for (int i = 0; i < y->ndim; i++) {
        sy[i] = y->shape[i] == 1 ? 0 : y->stride[i];
        sx[i] = x->shape[i] == 1 ? 0 : x->stride[i];
    }
    /* the binary kernel with its output on its first operand: element i is read before it is written */
    return TIDE_DISPATCH(y->device, binary, "add", TIDE_BIN_ADD, y->dtype, tide_data(y), tide_data(y), sy,
                         tide_data(x), sx, y->ndim, y->shape);
}
tide_tensor *tide_sub(tide_tensor *a, tide_tensor *b) { return binary(TIDE_OP_SUB, TIDE_BIN_SUB, a, b); }
tide_tensor *tide_mul(tide_tensor *a, tide_tensor *b) { return binary(TIDE_OP_MUL, TIDE_BIN_MUL, a, b); }
tide_tensor *tide_div(tide_tensor *a, tide_tensor *b) { return binary(TIDE_OP_DIV, TIDE_BIN_DIV, a, b); }

/* ---- unary ops (activations and scalar ops) ----------------------------------------------------------- */
int tide_unary_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *x = tide_contiguous_nograd(in[0]);
    if (!x) return -1;
    tide_tensor *y = tide_empty_like(x);
    int rc = y ? 0 : -1;
    if (!rc && x->numel > 0)
        rc = TIDE_DISPATCH(x->device, unary, TIDE_OP_NAME(n), n->attr.unary.op, x->dtype, tide_data(y), tide_data(x),
                           x->numel, n->attr.unary.p);
    if (!rc && n->attr.unary.save_xy) rc = tide_node_save(n, x) || tide_node_save(n, y);
    tide_tensor_release(x);
    if (rc) { tide_tensor_release(y); return -1; }
    out[0] = y;
    return 0;
}

int tide_unary_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int op = n->attr.unary.op;
    if (op == TIDE_UN_NEG) { gin[0] = tide_neg(gout[0]); return gin[0] ? 0 : -1; }
    if (op == TIDE_UN_ADD_SCALAR) { tide_tensor_retain(gout[0]); gin[0] = gout[0]; return 0; }
    if (op == TIDE_UN_MUL_SCALAR) { gin[0] = tide_mul_scalar(gout[0], n->attr.unary.p); return gin[0] ? 0 : -1; }
    tide_tensor *g = tide_contiguous_nograd(gout[0]);
    if (!g) return -1;
    tide_tensor *x = n->saved[0], *y = n->saved[1];
    tide_tensor *gx = tide_empty_like(x);
    int rc = gx ? 0 : -1;
    if (!rc && x->numel > 0)
        rc = TIDE_DISPATCH(x->device, unary_backward, TIDE_OP_NAME(n), op, x->dtype, tide_data(gx), tide_data(g),
                           tide_data(x), tide_data(y), x->numel, n->attr.unary.p);
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(gx); return -1; }
    gin[0] = gx;
    return 0;
}

static tide_tensor *unary(int op_id, int uop, tide_tensor *x, double p)
{
    const char *name = tide_op_name(op_id);
    if (tide_check_float(x, name, "x")) return NULL;
    tide_attrs at = {0};
    at.unary.op = uop;
    at.unary.save_xy = !(uop == TIDE_UN_NEG || uop == TIDE_UN_ADD_SCALAR || uop == TIDE_UN_MUL_SCALAR);
    at.unary.p = p;
    tide_tensor *in[1] = {x};
    return tide_op_run1(op_id, 1, in, &at);
}

tide_tensor *tide_add_scalar(tide_tensor *x, double s) { return unary(TIDE_OP_ADD_SCALAR, TIDE_UN_ADD_SCALAR, x, s); }
tide_tensor *tide_mul_scalar(tide_tensor *x, double s) { return unary(TIDE_OP_MUL_SCALAR, TIDE_UN_MUL_SCALAR, x, s); }
tide_tensor *tide_pow_scalar(tide_tensor *x, double p) { return unary(TIDE_OP_POW_SCALAR, TIDE_UN_POW_SCALAR, x, p); }
tide_tensor *tide_neg(tide_tensor *x) { return unary(TIDE_OP_NEG, TIDE_UN_NEG, x, 0); }
tide_tensor *tide_exp(tide_tensor *x) { return unary(TIDE_OP_EXP, TIDE_UN_EXP, x, 0); }
tide_tensor *tide_log(tide_tensor *x) { return unary(TIDE_OP_LOG, TIDE_UN_LOG, x, 0); }
tide_tensor *tide_sqrt(tide_tensor *x) { return unary(TIDE_OP_SQRT, TIDE_UN_SQRT, x, 0); }
tide_tensor *tide_rsqrt(tide_tensor *x) { return unary(TIDE_OP_RSQRT, TIDE_UN_RSQRT, x, 0); }
tide_tensor *tide_tanh(tide_tensor *x) { return unary(TIDE_OP_TANH, TIDE_UN_TANH, x, 0); }
tide_tensor *tide_sigmoid(tide_tensor *x) { return unary(TIDE_OP_SIGMOID, TIDE_UN_SIGMOID, x, 0); }
tide_tensor *tide_silu(tide_tensor *x) { return unary(TIDE_OP_SILU, TIDE_UN_SILU, x, 0); }
tide_tensor *tide_gelu(tide_tensor *x) { return unary(TIDE_OP_GELU, TIDE_UN_GELU, x, 0); }
tide_tensor *tide_gelu_erf(tide_tensor *x) { return unary(TIDE_OP_GELU_ERF, TIDE_UN_GELU_ERF, x, 0); }
tide_tensor *tide_softplus(tide_tensor *x) { return unary(TIDE_OP_SOFTPLUS, TIDE_UN_SOFTPLUS, x, 0); }
tide_tensor *tide_relu(tide_tensor *x) { return unary(TIDE_OP_RELU, TIDE_UN_RELU, x, 0); }
tide_tensor *tide_abs(tide_tensor *x) { return unary(TIDE_OP_ABS, TIDE_UN_ABS, x, 0); }

/* ---- SwiGLU: silu(gate) * up in one pass ----------------------------------------------------------------- */
int tide_swiglu_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *g = tide_contiguous_nograd(in[0]), *u = g ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *o = u ? tide_empty_like(g) : NULL;
    int rc = o ? 0 : -1;
    if (!rc && g->numel > 0) rc = TIDE_DISPATCH(g->device, swiglu, "swiglu", g->dtype, tide_data(o), tide_data(g),
                                                tide_data(u), g->numel);
    if (!rc) rc = tide_node_save(n, g) || tide_node_save(n, u);
    tide_tensor_release(g); tide_tensor_release(u);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_swiglu_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *g = n->saved[0], *u = n->saved[1];
    tide_tensor *d = tide_contiguous_nograd(gout[0]);
    tide_tensor *dg = d ? tide_empty_like(g) : NULL, *du = dg ? tide_empty_like(u) : NULL;
    int rc = du ? 0 : -1;
    if (!rc && g->numel > 0)
        rc = TIDE_DISPATCH(g->device, swiglu_backward, "swiglu", g->dtype, tide_data(dg), tide_data(du), tide_data(d),
                                                           tide_data(g), tide_data(u), g->numel);
    tide_tensor_release(d);
    if (rc) { tide_tensor_release(dg); tide_tensor_release(du); return -1; }
    gin[0] = dg;
    gin[1] = du;
    return 0;
}

tide_tensor *tide_swiglu(tide_tensor *gate, tide_tensor *up)
{
    if (tide_check_float(gate, "swiglu", "gate") || tide_check_float(up, "swiglu", "up") ||
        tide_check_same_device(gate, up, "swiglu") || tide_check_same_dtype(gate, up, "swiglu")) return NULL;
    if (!tide_same_shape(gate, up)) {
        char a[128], b[128];
        tide_set_error("swiglu: gate is %s but up is %s", tide_shape_str(gate->ndim, gate->shape, a, sizeof a),
                       tide_shape_str(up->ndim, up->shape, b, sizeof b));
        return NULL;
    }
    tide_tensor *in[2] = {gate, up};
    return tide_op_run1(TIDE_OP_SWIGLU, 2, in, NULL);
}

/* softmax.c — softmax and log-softmax over any dim (the kernel works on the last dim; other dims are moved there). */
#include "../internal.h"

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

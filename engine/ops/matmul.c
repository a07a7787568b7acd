/* matmul.c — (batched) matrix products with transposes, through the backend GEMM (BLAS on the CPU). */
#include "../internal.h"

int tide_matmul_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int ta = n->attr.matmul.ta, tb = n->attr.matmul.tb;
    tide_tensor *a = tide_contiguous_nograd(in[0]), *b = a ? tide_contiguous_nograd(in[1]) : NULL;
    if (!b) { tide_tensor_release(a); return -1; }
    int an = a->ndim, bn = b->ndim;
    int64_t M = ta ? a->shape[an - 1] : a->shape[an - 2], K = ta ? a->shape[an - 2] : a->shape[an - 1];
    int64_t N = tb ? b->shape[bn - 2] : b->shape[bn - 1];
    const tide_tensor *big = an >= bn ? a : b;
    int64_t shape[TIDE_MAX_DIMS], batch = 1;
    int nd = big->ndim;
    for (int i = 0; i < nd - 2; i++) { shape[i] = big->shape[i]; batch *= big->shape[i]; }
    shape[nd - 2] = M;
    shape[nd - 1] = N;
    tide_tensor *c = tide_empty(a->dtype, nd, shape, a->device);
    int rc = c ? 0 : -1;
    if (!rc && c->numel > 0) {
        int64_t lda = a->shape[an - 1], ldb = b->shape[bn - 1];
        if (bn == 2 && !ta)          /* b shared: fold the batch into M, one GEMM */
            rc = TIDE_DISPATCH(a->device, gemm, "matmul", a->dtype, 0, tb, M * batch, N, K, 1.0, tide_data(a), lda,
                               tide_data(b), ldb, 0.0, tide_data(c), N);
        else
            rc = TIDE_DISPATCH(a->device, gemm_batched, "matmul", a->dtype, ta, tb, M, N, K, 1.0, tide_data(a), lda,
                               an == 2 ? 0 : M * K, tide_data(b), ldb, bn == 2 ? 0 : K * N, 0.0, tide_data(c), N, M * N,
                               batch);
    }
    if (!rc) rc = tide_node_save(n, a) || tide_node_save(n, b);
    tide_tensor_release(a); tide_tensor_release(b);
    if (rc) { tide_tensor_release(c); return -1; }
    out[0] = c;
    return 0;
}

/* sum a batched gradient down to a 2-D operand's shape */
static tide_tensor *fit(tide_tensor *g, const tide_meta *m)
{
    if (!g) return NULL;
    tide_tensor *r = tide_sum_to_shape(g, m->ndim, m->shape);
    tide_tensor_release(g);
    return r;
}

int tide_matmul_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int ta = n->attr.matmul.ta, tb = n->attr.matmul.tb;
    tide_tensor *a = n->saved[0], *b = n->saved[1], *g = gout[0];
    if (n->in_needs_grad[0]) {
        gin[0] = fit(ta ? tide_matmul(b, g, tb, 1) : tide_matmul(g, b, 0, !tb), &n->in_meta[0]);
        if (!gin[0]) return -1;
    }
    if (n->in_needs_grad[1] && b->ndim == 2 && a->ndim > 2 && !ta) {
        /* a Linear layer: fold the batch into the rows so dW is one GEMM, not a batched product
           followed by a sum over a [batch, out, in] temporary */
        int64_t K = a->shape[a->ndim - 1], N = g->shape[g->ndim - 1];
        tide_tensor *a2 = tide_reshape(a, 2, (int64_t[]){-1, K}), *g2 = a2 ? tide_reshape(g, 2, (int64_t[]){-1, N}) : NULL;
        gin[1] = g2 ? (tb ? tide_matmul(g2, a2, 1, 0) : tide_matmul(a2, g2, 1, 0)) : NULL;
        tide_tensor_release(a2); tide_tensor_release(g2);
        if (!gin[1]) return -1;
    } else if (n->in_needs_grad[1]) {
        gin[1] = fit(tb ? tide_matmul(g, a, 1, ta) : tide_matmul(a, g, !ta, 0), &n->in_meta[1]);
        if (!gin[1]) return -1;
    }
    return 0;
}

tide_tensor *tide_matmul(tide_tensor *a, tide_tensor *b, int ta, int tb)
{
    if (tide_check_float(a, "matmul", "a") || tide_check_float(b, "matmul", "b") || tide_check_same_device(a, b, "matmul") ||
        tide_check_same_dtype(a, b, "matmul")) return NULL;
    char x[128], y[128];
    TIDE_CHECK(a->ndim >= 2 && b->ndim >= 2, "matmul: a is %s and b is %s; both need at least 2 dims",
               tide_shape_str(a->ndim, a->shape, x, sizeof x), tide_shape_str(b->ndim, b->shape, y, sizeof y));
    int an = a->ndim, bn = b->ndim;
    int64_t K = ta ? a->shape[an - 2] : a->shape[an - 1], Kb = tb ? b->shape[bn - 1] : b->shape[bn - 2];
    TIDE_CHECK(K == Kb, "matmul: a is %s%s but b is %s%s: inner dimensions differ (%lld vs %lld)",
               tide_shape_str(an, a->shape, x, sizeof x), ta ? " (transposed)" : "", tide_shape_str(bn, b->shape, y, sizeof y),
               tb ? " (transposed)" : "", (long long)K, (long long)Kb);
    if (an > 2 && bn > 2) {
        int ok = an == bn;
        for (int i = 0; ok && i < an - 2; i++) ok = a->shape[i] == b->shape[i];
        TIDE_CHECK(ok, "matmul: batch dims of a %s and b %s differ (they must be equal, or one operand 2-D)",
                   tide_shape_str(an, a->shape, x, sizeof x), tide_shape_str(bn, b->shape, y, sizeof y));
    }
    tide_attrs at = {0};
    at.matmul.ta = ta ? 1 : 0;
    at.matmul.tb = tb ? 1 : 0;
    tide_tensor *in[2] = {a, b};
    return tide_op_run1(TIDE_OP_MATMUL, 2, in, &at);
}

/* ---- linear: y = x Wᵀ + b with W [out, in] (HuggingFace layout), b [out] optional, x [..., in] ----------------
   One GEMM: with a bias, C starts as the bias rows and the product is added onto them (beta 1), as BLAS addmm
   does, instead of a product followed by a broadcast add over a second [rows, out] tensor. The backward is the
   matmul's (dX = g W, dW = gᵀ X over the rows folded into one GEMM) and db = the column sums of g. */
static int64_t rows_of(const tide_tensor *x)
{
    int64_t m = 1;
    for (int i = 0; i < x->ndim - 1; i++) m *= x->shape[i];
    return m;
}

int tide_linear_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int has_b = n->n_in == 3;
    tide_tensor *x = tide_contiguous_nograd(in[0]), *w = x ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *b = (w && has_b) ? tide_contiguous_nograd(in[2]) : NULL;
    if (!w || (has_b && !b)) { tide_tensor_release(x); tide_tensor_release(w); return -1; }
    int64_t K = x->shape[x->ndim - 1], N = w->shape[0], M = rows_of(x), shape[TIDE_MAX_DIMS];
    for (int i = 0; i < x->ndim - 1; i++) shape[i] = x->shape[i];
    shape[x->ndim - 1] = N;
    tide_tensor *c = tide_empty(x->dtype, x->ndim, shape, x->device);
    int rc = c ? 0 : -1;
    if (!rc && c->numel > 0) {
        if (b)
            rc = TIDE_DISPATCH(x->device, copy, "linear", tide_data(c), c->dtype, (int64_t[]){N, 1}, tide_data(b),
                               b->dtype, (int64_t[]){0, 1}, 2, (int64_t[]){M, N});
        if (!rc)
            rc = TIDE_DISPATCH(x->device, gemm, "linear", x->dtype, 0, 1, M, N, K, 1.0, tide_data(x), K > 0 ? K : 1,
                               tide_data(w), K > 0 ? K : 1, b ? 1.0 : 0.0, tide_data(c), N);
    }
    if (!rc) rc = tide_node_save(n, x) || tide_node_save(n, w);
    tide_tensor_release(x); tide_tensor_release(w); tide_tensor_release(b);
    if (rc) { tide_tensor_release(c); return -1; }
    out[0] = c;
    return 0;
}

int tide_linear_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *x = n->saved[0], *w = n->saved[1];
    int64_t K = x->shape[x->ndim - 1], N = w->shape[0], M = rows_of(x);
    tide_tensor *g2 = tide_reshape(gout[0], 2, (int64_t[]){M, N});   /* the rows folded: one GEMM per gradient */
    if (!g2) return -1;
    int rc = 0;
    if (n->in_needs_grad[0]) {
        tide_tensor *dx = tide_matmul(g2, w, 0, 0);
        gin[0] = dx ? tide_reshape(dx, x->ndim, x->shape) : NULL;
        tide_tensor_release(dx);
        rc |= gin[0] ? 0 : -1;
    }
    if (!rc && n->in_needs_grad[1]) {
        tide_tensor *x2 = tide_reshape(x, 2, (int64_t[]){M, K});
        gin[1] = x2 ? tide_matmul(g2, x2, 1, 0) : NULL;
        tide_tensor_release(x2);
        rc |= gin[1] ? 0 : -1;
    }
    if (!rc && n->n_in == 3 && n->in_needs_grad[2]) {
        gin[2] = tide_sum(g2, 1, (int[]){0}, 0);
        rc |= gin[2] ? 0 : -1;
    }
    tide_tensor_release(g2);
    return rc;
}

tide_tensor *tide_linear(tide_tensor *x, tide_tensor *weight, tide_tensor *bias)
{
    if (tide_check_float(x, "linear", "x") || tide_check_float(weight, "linear", "weight") ||
        tide_check_same_device(x, weight, "linear") || tide_check_same_dtype(x, weight, "linear")) return NULL;
    if (bias && (tide_check_float(bias, "linear", "bias") || tide_check_same_device(x, bias, "linear") ||
                 tide_check_same_dtype(x, bias, "linear"))) return NULL;
    char s1[128], s2[128];
    TIDE_CHECK(x->ndim >= 1, "linear: x is a scalar; it needs at least 1 dim (the in_features)");
    TIDE_CHECK(weight->ndim == 2, "linear: weight is %s; it must be 2-D [out_features, in_features]",
               tide_shape_str(weight->ndim, weight->shape, s1, sizeof s1));
    TIDE_CHECK(weight->shape[1] == x->shape[x->ndim - 1],
               "linear: x is %s but weight is %s: in_features differ (%lld vs %lld)",
               tide_shape_str(x->ndim, x->shape, s1, sizeof s1), tide_shape_str(weight->ndim, weight->shape, s2, sizeof s2),
               (long long)x->shape[x->ndim - 1], (long long)weight->shape[1]);
    TIDE_CHECK(!bias || (bias->ndim == 1 && bias->shape[0] == weight->shape[0]),
               "linear: bias is %s but weight is %s (bias must be [out_features])",
               bias ? tide_shape_str(bias->ndim, bias->shape, s1, sizeof s1) : "", tide_shape_str(weight->ndim, weight->shape, s2, sizeof s2));
    tide_tensor *in[3] = {x, weight, bias};
    return tide_op_run1(TIDE_OP_LINEAR, bias ? 3 : 2, in, NULL);
}

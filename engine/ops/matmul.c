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

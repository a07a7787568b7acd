/* collective.c — collectives as differentiable ops (DESIGN.md §9): the all-to-all of expert parallelism's dispatch
   and combine (spec/moe.md §9). The exchange itself is engine/dist/comm.c's; the op records it in the graph so that
   the backward runs the reverse exchange. */
#include <stdlib.h>
#include <string.h>
#include "../internal.h"

/* attr.list: [group, P, send_rows[0..P), recv_rows[0..P)] */

/* rows of x to the ranks by send (P counts), rows from them by recv, into a new [Σ recv, ...] tensor */
static tide_tensor *exchange(tide_tensor *x, int group, int P, const int64_t *send, const int64_t *recv)
{
    int64_t row = 1, n_recv = 0;
    for (int i = 1; i < x->ndim; i++) row *= x->shape[i];
    for (int r = 0; r < P; r++) n_recv += recv[r];
    int64_t shape[TIDE_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
    shape[0] = n_recv;
    int64_t *counts = malloc(sizeof *counts * (size_t)(2 * P));
    tide_tensor *c = tide_contiguous_nograd(x);
    tide_tensor *o = counts && c ? tide_empty(x->dtype, x->ndim, shape, x->device) : NULL;
    if (!counts && c) tide_set_error("alltoallv: out of memory");
    int rc = o ? 0 : -1;
    if (!rc) {
        for (int r = 0; r < P; r++) { counts[r] = send[r] * row; counts[P + r] = recv[r] * row; }
        rc = tide_dist_alltoallv_group_(group, c, counts, o, counts + P);
    }
    free(counts);
    tide_tensor_release(c);
    if (rc) { tide_tensor_release(o); return NULL; }
    return o;
}

int tide_alltoallv_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    const int64_t *l = n->attr.list;
    int P = (int)l[1];
    out[0] = exchange(in[0], (int)l[0], P, l + 2, l + 2 + P);
    return out[0] ? 0 : -1;
}

int tide_alltoallv_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    const int64_t *l = n->attr.list;
    int P = (int)l[1];
    if (!n->in_needs_grad[0]) return 0;
    /* the reverse exchange: what came from rank r goes back to it */
    gin[0] = exchange(gout[0], (int)l[0], P, l + 2 + P, l + 2);
    return gin[0] ? 0 : -1;
}

tide_tensor *tide_alltoallv(tide_tensor *x, int group, int n_ranks, const int64_t *send_rows, const int64_t *recv_rows)
{
    TIDE_CHECK(x != NULL, "alltoallv: x is NULL");
    TIDE_CHECK(x->ndim >= 1, "alltoallv: x must have a row dim, got a scalar");
    TIDE_CHECK(send_rows && recv_rows, "alltoallv: NULL counts");
    int P = tide_dist_group_size(group);
    if (P < 0) return NULL;
    TIDE_CHECK(n_ranks == P, "alltoallv: %d counts given for a group of %d ranks", n_ranks, P);
    int64_t ns = 0;
    for (int r = 0; r < P; r++) {
        TIDE_CHECK(send_rows[r] >= 0 && recv_rows[r] >= 0, "alltoallv: negative row count for group rank %d", r);
        ns += send_rows[r];
    }
    char a[128];
    TIDE_CHECK(ns == x->shape[0], "alltoallv: the send counts sum to %lld rows, x %s has %lld", (long long)ns,
               SHAPE_STR(x, a), (long long)x->shape[0]);
    tide_attrs at = {0};
    at.n_list = 2 + 2 * P;
    at.list = malloc(sizeof(int64_t) * (size_t)at.n_list);
    TIDE_CHECK(at.list != NULL, "alltoallv: out of memory");
    at.list[0] = group;
    at.list[1] = P;
    memcpy(at.list + 2, send_rows, sizeof(int64_t) * (size_t)P);
    memcpy(at.list + 2 + P, recv_rows, sizeof(int64_t) * (size_t)P);
    tide_tensor *out = tide_op_run1(TIDE_OP_ALLTOALLV, 1, &x, &at);
    free(at.list);
    return out;
}

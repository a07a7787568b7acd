/* embedding.c — token embedding lookup (a row gather of the weight) with its scatter-add backward; ids are
   range-checked against the vocabulary before the kernel sees them. */
#include "../internal.h"

/* ---- embedding ------------------------------------------------------------------------------------------------ */
int tide_embedding_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *w = tide_contiguous_nograd(in[0]), *ids = w ? tide_contiguous_nograd(in[1]) : NULL;
    if (!ids) { tide_tensor_release(w); return -1; }
    int64_t shape[TIDE_MAX_DIMS];
    for (int i = 0; i < ids->ndim; i++) shape[i] = ids->shape[i];
    shape[ids->ndim] = w->shape[1];
    tide_tensor *o = tide_empty(w->dtype, ids->ndim + 1, shape, w->device);
    int rc = o ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(w->device, index_select, "embedding", w->dtype, tide_data(o), tide_data(w), tide_data(ids),
                           ids->dtype, 1, w->shape[0], w->shape[1], ids->numel);
    if (!rc) rc = tide_node_save(n, ids);
    tide_tensor_release(w); tide_tensor_release(ids);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_embedding_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_meta *m = &n->in_meta[0];
    tide_tensor *ids = n->saved[0], *g = tide_contiguous_nograd(gout[0]);
    tide_tensor *gw = g ? tide_zeros(m->dtype, m->ndim, m->shape, m->device) : NULL;
    int rc = gw ? 0 : -1;
    if (!rc && g->numel > 0)
        rc = TIDE_DISPATCH(gw->device, index_add, "embedding", gw->dtype, tide_data(gw), tide_data(g), tide_data(ids),
                           ids->dtype, 1, m->shape[0], m->shape[1], ids->numel);
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(gw); return -1; }
    gin[0] = gw;
    return 0;
}

tide_tensor *tide_embedding(tide_tensor *weight, tide_tensor *ids)
{
    if (tide_check_float(weight, "embedding", "weight") || tide_check_index_dtype(ids, "embedding", "ids") ||
        tide_check_same_device(weight, ids, "embedding")) return NULL;
    char a[128];
    TIDE_CHECK(weight->ndim == 2, "embedding: weight must be [V, d], got %s", SHAPE_STR(weight, a));
    TIDE_CHECK(ids->ndim < TIDE_MAX_DIMS, "embedding: ids have too many dims (%d)", ids->ndim);
    if (ids->numel > 0) {
        tide_tensor *c = tide_contiguous_nograd(ids);
        if (!c) return NULL;
        int64_t bad = 0;
        int ok = 1;
        /* deferrable: the lookup reads zeros for an id out of range (kernels/backend.h check_index) */
        int rc = TIDE_DISPATCH(c->device, check_index, "embedding", "embedding", tide_data(c), c->dtype, c->numel,
                               weight->shape[0], 1, &bad, &ok);
        tide_tensor_release(c);
        if (rc) return NULL;
        TIDE_CHECK(ok, "embedding: token id %lld is out of range for a vocabulary of %lld", (long long)bad,
                   (long long)weight->shape[0]);
    }
    tide_tensor *in[2] = {weight, ids};
    return tide_op_run1(TIDE_OP_EMBEDDING, 2, in, NULL);
}

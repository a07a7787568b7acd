/* loss.c — cross-entropy over logits [N, V] with ignore_index and optional per-token weights, fused with its
   log-sum-exp; reductions mean (over the unmasked tokens), sum and none. token_logprobs: the per-token log-prob of
   given tokens and the entropy over [..., V] logits (the RL objectives' input), fused the same way. */
#include <math.h>
#include "../internal.h"

/* ---- cross-entropy ------------------------------------------------------------------------------------------------ */
/* saved slots (weights empty when not given) */
enum { CE_SAVED_LOGITS, CE_SAVED_LSE, CE_SAVED_TARGETS, CE_SAVED_WEIGHTS };

int tide_cross_entropy_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int red = n->attr.cross_entropy.reduction;
    tide_tensor *lg = tide_contiguous_nograd(in[0]), *t = lg ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *w = (t && n->n_in == 3) ? tide_contiguous_nograd(in[2]) : NULL;
    if (!t || (n->n_in == 3 && !w)) { tide_tensor_release(lg); tide_tensor_release(t); return -1; }
    int64_t N = lg->shape[0], V = lg->shape[1];
    tide_tensor *loss = tide_empty(lg->dtype, 1, &N, lg->device), *valid = loss ? tide_empty(lg->dtype, 1, &N, lg->device) : NULL;
    tide_tensor *lse = valid ? tide_empty(lg->dtype, 1, &N, lg->device) : NULL;
    tide_tensor *o = NULL;
    int rc = lse ? 0 : -1;
    if (!rc && N > 0)
        rc = TIDE_DISPATCH(lg->device, cross_entropy, "cross_entropy", lg->dtype, tide_data(loss), tide_data(valid),
                           tide_data(lse), tide_data(lg), tide_data(t), t->dtype, w ? tide_data(w) : NULL, N, V,
                           n->attr.cross_entropy.ignore_index);
    if (!rc && red == 2) { o = loss; tide_tensor_retain(o); }
    if (!rc && red != 2) {
        o = tide_sum(loss, 0, NULL, 0);
        double denom = 1.0;
        if (o && red == 0) {
            tide_tensor *s = tide_sum(valid, 0, NULL, 0);
            denom = s ? tide_item(s) : NAN;
            tide_tensor_release(s);
            if (isnan(denom)) rc = -1;
            else if (denom != 0) rc = tide_scale_(o, 1.0 / denom);   /* no unmasked token: the loss is 0 */
        }
        n->attr.cross_entropy.denom = denom;
        if (!o) rc = -1;
        else if (!rc && red == 0 && n->n_in == 3) n->attr.cross_entropy.loss = tide_item(o);   /* the weights' gradient needs L */
    }
    if (!rc) rc = tide_node_save(n, lg) || tide_node_save(n, lse) || tide_node_save(n, t) || tide_node_save(n, w);
    tide_tensor_release(lg); tide_tensor_release(t); tide_tensor_release(w);
    tide_tensor_release(loss); tide_tensor_release(valid); tide_tensor_release(lse);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_cross_entropy_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int red = n->attr.cross_entropy.reduction;
    tide_tensor *lg = n->saved[CE_SAVED_LOGITS], *lse = n->saved[CE_SAVED_LSE], *t = n->saved[CE_SAVED_TARGETS];
    tide_tensor *w = n->saved[CE_SAVED_WEIGHTS];
    int64_t N = lg->shape[0], V = lg->shape[1];
    tide_tensor *dloss;
    if (red == 2) dloss = tide_contiguous_nograd(gout[0]);
    else {
        double g = tide_item(gout[0]);
        if (isnan(g) && tide_last_error()[0]) return -1;
        double denom = n->attr.cross_entropy.denom;
        dloss = tide_full(lg->dtype, 1, &N, lg->device, red == 0 ? (denom != 0 ? g / denom : 0.0) : g);
    }
    tide_tensor *dl = dloss ? tide_empty_like(lg) : NULL;
    int rc = dl ? 0 : -1;
    if (!rc && N > 0)
        rc = TIDE_DISPATCH(lg->device, cross_entropy_backward, "cross_entropy", lg->dtype, tide_data(dl),
                           tide_data(dloss), tide_data(lg), tide_data(lse), tide_data(t), t->dtype,
                           w ? tide_data(w) : NULL, N, V, n->attr.cross_entropy.ignore_index);
    if (!rc && w && n->in_needs_grad[2]) {
        /* d/dw_n: per-token unweighted loss ce_n (0 where ignored), minus L for the mean, over its denominator */
        tide_tensor *ce = tide_empty(lg->dtype, 1, &N, lg->device), *ok = ce ? tide_empty(lg->dtype, 1, &N, lg->device) : NULL;
        tide_tensor *lse2 = ok ? tide_empty(lg->dtype, 1, &N, lg->device) : NULL, *gw = NULL;
        rc = lse2 ? 0 : -1;
        if (!rc && N > 0)
            rc = TIDE_DISPATCH(lg->device, cross_entropy, "cross_entropy", lg->dtype, tide_data(ce), tide_data(ok),
                               tide_data(lse2), tide_data(lg), tide_data(t), t->dtype, NULL, N, V,
                               n->attr.cross_entropy.ignore_index);
        if (!rc && red == 0) {
            double denom = n->attr.cross_entropy.denom, L = n->attr.cross_entropy.loss, g = tide_item(gout[0]);
            tide_tensor *shifted = tide_empty_like(ce);
            rc = shifted ? tide_copy_(shifted, ce) : -1;
            if (!rc) rc = tide_axpy_(shifted, -L, ok);
            if (!rc) gw = tide_mul_scalar(shifted, denom != 0 ? g / denom : 0.0);
            tide_tensor_release(shifted);
        } else if (!rc) {
            gw = red == 1 ? tide_mul_scalar(ce, tide_item(gout[0])) : tide_mul(ce, dloss);
        }
        if (!rc && !gw) rc = -1;
        tide_tensor_release(ce); tide_tensor_release(ok); tide_tensor_release(lse2);
        gin[2] = gw;
    }
    tide_tensor_release(dloss);
    if (rc) { tide_tensor_release(dl); return -1; }
    gin[0] = dl;
    return 0;
}

tide_tensor *tide_cross_entropy(tide_tensor *logits, tide_tensor *targets, tide_tensor *weights, int64_t ignore_index,
                                int reduction)
{
    if (tide_check_float(logits, "cross_entropy", "logits") || tide_check_index_dtype(targets, "cross_entropy", "targets") ||
        tide_check_same_device(logits, targets, "cross_entropy")) return NULL;
    char a[128], b[128];
    TIDE_CHECK(logits->ndim == 2, "cross_entropy: logits must be [N, V], got %s", SHAPE_STR(logits, a));
    TIDE_CHECK(targets->ndim == 1 && targets->shape[0] == logits->shape[0],
               "cross_entropy: targets are %s but logits are %s (targets must be [N])", SHAPE_STR(targets, a), SHAPE_STR(logits, b));
    if (weights) {
        if (tide_check_float(weights, "cross_entropy", "weights") || tide_check_same_dtype(logits, weights, "cross_entropy") ||
            tide_check_same_device(logits, weights, "cross_entropy")) return NULL;
        TIDE_CHECK(weights->ndim == 1 && weights->shape[0] == logits->shape[0],
                   "cross_entropy: weights are %s but logits are %s (weights must be [N])", SHAPE_STR(weights, a), SHAPE_STR(logits, b));
    }
    TIDE_CHECK(reduction >= 0 && reduction <= 2, "cross_entropy: reduction must be 0 (mean), 1 (sum) or 2 (none), got %d", reduction);
    tide_attrs at = {0};
    at.cross_entropy.ignore_index = ignore_index;
    at.cross_entropy.reduction = reduction;
    tide_tensor *in[3] = {logits, targets, weights};
    return tide_op_run1(TIDE_OP_CROSS_ENTROPY, weights ? 3 : 2, in, &at);
}

/* ---- token_logprobs: per-token log-prob of the given token and the entropy, one fused row pass ------------------- */
/* outputs logp and entropy (targets' shape); saved: the logits, the per-row lse and entropy, the targets. The outputs
   and stats are f32 for bf16 logits (importance ratios exp(logp - logp_old) need more than bf16's 8 bits) */
enum { TLP_OUT_LOGP, TLP_OUT_ENTROPY };
enum { TLP_SAVED_LOGITS, TLP_SAVED_LSE, TLP_SAVED_ENTROPY, TLP_SAVED_TARGETS };

static int token_logprobs_stat_dtype(int dtype) { return dtype == TIDE_BF16 ? TIDE_F32 : dtype; }

int tide_token_logprobs_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *lg = tide_contiguous_nograd(in[0]), *t = lg ? tide_contiguous_nograd(in[1]) : NULL;
    if (!t) { tide_tensor_release(lg); return -1; }
    int64_t V = lg->shape[lg->ndim - 1], N = t->numel;
    int sdt = token_logprobs_stat_dtype(lg->dtype);
    tide_tensor *logp = tide_empty(sdt, t->ndim, t->shape, lg->device);
    tide_tensor *ent = logp ? tide_empty(sdt, t->ndim, t->shape, lg->device) : NULL;
    tide_tensor *lse = ent ? tide_empty(sdt, 1, &N, lg->device) : NULL;
    int rc = lse ? 0 : -1;
    if (!rc && N > 0)
        rc = TIDE_DISPATCH(lg->device, token_logprobs, "token_logprobs", lg->dtype, tide_data(logp), tide_data(ent),
                           tide_data(lse), tide_data(lg), tide_data(t), t->dtype, N, V,
                           n->attr.cross_entropy.ignore_index);
    if (!rc) rc = tide_node_save(n, lg) || tide_node_save(n, lse) || tide_node_save(n, ent) || tide_node_save(n, t);
    tide_tensor_release(lg); tide_tensor_release(t); tide_tensor_release(lse);
    if (rc) { tide_tensor_release(logp); tide_tensor_release(ent); return -1; }
    out[TLP_OUT_LOGP] = logp;
    out[TLP_OUT_ENTROPY] = ent;
    return 0;
}

/* d logits = dlogp (onehot(t) - p) - dentropy p (log p + H) per row; an unused output's gradient is zeros */
int tide_token_logprobs_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *lg = n->saved[TLP_SAVED_LOGITS], *lse = n->saved[TLP_SAVED_LSE], *ent = n->saved[TLP_SAVED_ENTROPY];
    tide_tensor *t = n->saved[TLP_SAVED_TARGETS];
    int64_t V = lg->shape[lg->ndim - 1], N = t->numel;
    int sdt = token_logprobs_stat_dtype(lg->dtype);
    tide_tensor *glp = gout[TLP_OUT_LOGP]->dtype == sdt ? tide_contiguous_nograd(gout[TLP_OUT_LOGP])
                                                        : tide_to_dtype(gout[TLP_OUT_LOGP], sdt);
    tide_tensor *gh = !glp ? NULL : gout[TLP_OUT_ENTROPY]->dtype == sdt ? tide_contiguous_nograd(gout[TLP_OUT_ENTROPY])
                                                                          : tide_to_dtype(gout[TLP_OUT_ENTROPY], sdt);
    tide_tensor *dl = gh ? tide_empty_like(lg) : NULL;
    int rc = dl ? 0 : -1;
    if (!rc && N > 0)
        rc = TIDE_DISPATCH(lg->device, token_logprobs_backward, "token_logprobs", lg->dtype, tide_data(dl),
                           tide_data(glp), tide_data(gh), tide_data(lg), tide_data(lse), tide_data(ent), tide_data(t),
                           t->dtype, N, V, n->attr.cross_entropy.ignore_index);
    tide_tensor_release(glp); tide_tensor_release(gh);
    if (rc) { tide_tensor_release(dl); return -1; }
    gin[0] = dl;
    return 0;
}

int tide_token_logprobs(tide_tensor *logits, tide_tensor *targets, int64_t ignore_index, tide_tensor **logp,
                        tide_tensor **entropy)
{
    const char *op = "token_logprobs";
    TIDE_CHECK_INT(logp && entropy, "token_logprobs: logp and entropy must be non-NULL output pointers");
    *logp = *entropy = NULL;
    if (tide_check_float(logits, op, "logits") || tide_check_index_dtype(targets, op, "targets") ||
        tide_check_same_device(logits, targets, op)) return -1;
    char a[128], b[128];
    int lead_ok = logits->ndim >= 1 && targets->ndim == logits->ndim - 1;
    for (int i = 0; lead_ok && i < targets->ndim; i++) lead_ok = targets->shape[i] == logits->shape[i];
    TIDE_CHECK_INT(lead_ok, "token_logprobs: targets are %s but logits are %s (logits must be [..., V] with targets [...])",
                   SHAPE_STR(targets, a), SHAPE_STR(logits, b));
    TIDE_CHECK_INT(logits->shape[logits->ndim - 1] > 0, "token_logprobs: logits are %s: the vocabulary (last dim) is empty",
                   SHAPE_STR(logits, a));
    tide_attrs at = {0};
    at.cross_entropy.ignore_index = ignore_index;   /* the loss family's attributes: only ignore_index is read */
    tide_tensor *in[2] = {logits, targets}, *out[2];
    if (tide_op_run(TIDE_OP_TOKEN_LOGPROBS, 2, in, 2, out, &at)) return -1;
    *logp = out[TLP_OUT_LOGP];
    *entropy = out[TLP_OUT_ENTROPY];
    return 0;
}

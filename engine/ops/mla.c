/* mla.c — the attention of gated NoPE MLA as one op (spec/mla.md §1, §4, §5): per-head queries with the rope
   slot last (scored, never rotated), per-head no-position keys, one rope-slot key shared by every head, values;
   document-causal masking from cu_seqlens; tiled kernels with an online softmax (memory linear in T). The
   node saves its inputs, the output and the row log-sum-exp. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../internal.h"

static int lse_dtype(int dtype) { return dtype == TIDE_BF16 ? TIDE_F32 : dtype; }

/* saved slots (k_r empty when the heads share no rotary key) */
enum { MLA_SAVED_Q, MLA_SAVED_KN, MLA_SAVED_V, MLA_SAVED_OUT, MLA_SAVED_LSE, MLA_SAVED_KR };

int tide_mla_attention_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int has_kr = n->attr.mla_attention.has_kr;
    tide_tensor *q = tide_contiguous_nograd(in[0]), *kn = q ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *kr = kn && has_kr ? tide_contiguous_nograd(in[2]) : NULL;
    tide_tensor *v = kn && (kr || !has_kr) ? tide_contiguous_nograd(in[2 + has_kr]) : NULL;
    if (!v) { tide_tensor_release(q); tide_tensor_release(kn); tide_tensor_release(kr); return -1; }
    int64_t B = q->shape[0], Tq = q->shape[1], H = q->shape[2], dqk = q->shape[3], Tk = kn->shape[1], dn = kn->shape[3];
    int64_t dv = v->shape[3], oshape[4] = {B, Tq, H, dv}, lshape[3] = {B, H, Tq};
    tide_tensor *o = tide_empty(q->dtype, 4, oshape, q->device);
    tide_tensor *lse = o ? tide_empty(lse_dtype(q->dtype), 3, lshape, q->device) : NULL;
    int rc = lse ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(q->device, mla_attention, "mla_attention", q->dtype, tide_data(o), tide_data(lse),
                           tide_data(q), tide_data(kn), kr ? tide_data(kr) : NULL, tide_data(v),
                           n->attr.n_list ? n->attr.list : NULL, n->attr.n_list ? n->attr.n_list - 1 : 0, B, Tq, Tk, H,
                           dn, dqk - dn, dv, n->attr.mla_attention.scale);
    if (!rc) rc = tide_node_save(n, q) || tide_node_save(n, kn) || tide_node_save(n, v) || tide_node_save(n, o) ||
                  tide_node_save(n, lse) || tide_node_save(n, kr);
    tide_tensor_release(q); tide_tensor_release(kn); tide_tensor_release(kr); tide_tensor_release(v); tide_tensor_release(lse);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_mla_attention_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int has_kr = n->attr.mla_attention.has_kr;
    tide_tensor *q = n->saved[MLA_SAVED_Q], *kn = n->saved[MLA_SAVED_KN], *v = n->saved[MLA_SAVED_V];
    tide_tensor *o = n->saved[MLA_SAVED_OUT], *lse = n->saved[MLA_SAVED_LSE], *kr = n->saved[MLA_SAVED_KR];
    int64_t B = q->shape[0], Tq = q->shape[1], H = q->shape[2], dqk = q->shape[3], Tk = kn->shape[1], dn = kn->shape[3];
    int64_t dv = v->shape[3];
    tide_tensor *g = tide_contiguous_nograd(gout[0]);
    /* inputs in order: q, k_n, [k_r], v */
    tide_tensor *src[4] = {q, kn, kr ? kr : v, v}, *grads[4] = {0};
    int n_in = 3 + has_kr, rc = g ? 0 : -1;
    for (int i = 0; i < n_in && !rc; i++)
        if (n->in_needs_grad[i] && !(grads[i] = tide_zeros(src[i]->dtype, src[i]->ndim, src[i]->shape, src[i]->device))) rc = -1;
    tide_tensor *gkr = has_kr ? grads[2] : NULL, *gv = grads[2 + has_kr];
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(q->device, mla_attention_backward, "mla_attention", q->dtype,
                           grads[0] ? tide_data(grads[0]) : NULL, grads[1] ? tide_data(grads[1]) : NULL,
                           gkr ? tide_data(gkr) : NULL, gv ? tide_data(gv) : NULL, tide_data(g), tide_data(q),
                           tide_data(kn), kr ? tide_data(kr) : NULL, tide_data(v), tide_data(o), tide_data(lse),
                           n->attr.n_list ? n->attr.list : NULL, n->attr.n_list ? n->attr.n_list - 1 : 0, B, Tq, Tk, H,
                           dn, dqk - dn, dv, n->attr.mla_attention.scale);
    tide_tensor_release(g);
    if (rc) { for (int i = 0; i < 4; i++) tide_tensor_release(grads[i]); return -1; }
    for (int i = 0; i < n_in; i++) gin[i] = grads[i];
    return 0;
}

tide_tensor *tide_mla_attention(tide_tensor *q, tide_tensor *k_n, tide_tensor *k_r, tide_tensor *v, tide_tensor *cu_seqlens,
                                double scale)
{
    const char *op = "mla_attention";
    if (tide_check_float(q, op, "q") || tide_check_float(k_n, op, "k_n") || tide_check_float(v, op, "v") ||
        tide_check_same_device(q, k_n, op) || tide_check_same_device(q, v, op) || tide_check_same_dtype(q, k_n, op) ||
        tide_check_same_dtype(q, v, op)) return NULL;
    char a[128], b[128], c[128], d[128];
    int ok = q->ndim == 4 && k_n->ndim == 4 && v->ndim == 4 && k_n->shape[0] == q->shape[0] && v->shape[0] == q->shape[0] &&
             k_n->shape[2] == q->shape[2] && v->shape[2] == q->shape[2] && v->shape[1] == k_n->shape[1] &&
             k_n->shape[3] <= q->shape[3];
    TIDE_CHECK(ok, "mla_attention: q %s, k_n %s, v %s must be [B, Tq, H, dn + dr], [B, Tk, H, dn], [B, Tk, H, dv]",
               SHAPE_STR(q, a), SHAPE_STR(k_n, b), SHAPE_STR(v, c));
    int64_t B = q->shape[0], Tq = q->shape[1], Tk = k_n->shape[1], dr = q->shape[3] - k_n->shape[3];
    if (k_r) {
        if (tide_check_float(k_r, op, "k_r") || tide_check_same_device(q, k_r, op) || tide_check_same_dtype(q, k_r, op)) return NULL;
        TIDE_CHECK(k_r->ndim == 3 && k_r->shape[0] == B && k_r->shape[1] == Tk && k_r->shape[2] == dr && dr > 0,
                   "mla_attention: k_r is %s but q %s and k_n %s need it [B, Tk, dr] = [%lld, %lld, %lld]", SHAPE_STR(k_r, a),
                   SHAPE_STR(q, b), SHAPE_STR(k_n, d), (long long)B, (long long)Tk, (long long)dr);
    } else {
        TIDE_CHECK(dr == 0, "mla_attention: q has %lld rope-slot dims (q %s, k_n %s) but k_r is NULL", (long long)dr, SHAPE_STR(q, a),
                   SHAPE_STR(k_n, b));
    }
    TIDE_CHECK(Tq <= Tk, "mla_attention: causal attention needs Tq <= Tk, got %lld > %lld", (long long)Tq, (long long)Tk);
    TIDE_CHECK(isfinite(scale) && scale > 0, "mla_attention: scale must be positive and finite, got %g", scale);
    tide_attrs at = {0};
    at.mla_attention.has_kr = k_r != NULL;
    at.mla_attention.scale = scale;
    /* the boundaries are over the keys (B·Tk): with Tq < Tk the queries are each row's last Tq tokens (a context-
       parallel slice against the gathered prefix, long_context.md §5) */
    if (cu_seqlens && tide_load_boundaries(op, cu_seqlens, B, Tk, &at)) return NULL;
    tide_tensor *in[4] = {q, k_n, k_r ? k_r : v, v};
    tide_tensor *y = tide_op_run1(TIDE_OP_MLA_ATTENTION, k_r ? 4 : 3, in, &at);
    free(at.list);
    return y;
}

/* ---- mla_attention read from the latent: keys and values expanded a chunk at a time --------------------------- */

/* saved slots (k_r empty when the heads share no rotary key) */
enum { MLAL_SAVED_Q, MLAL_SAVED_C, MLAL_SAVED_W, MLAL_SAVED_OUT, MLAL_SAVED_LSE, MLAL_SAVED_KR };

int tide_mla_latent_attention_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int has_kr = n->attr.mla_latent.has_kr;
    tide_tensor *q = tide_contiguous_nograd(in[0]), *c = q ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *kr = c && has_kr ? tide_contiguous_nograd(in[2]) : NULL;
    tide_tensor *w = c && (kr || !has_kr) ? tide_contiguous_nograd(in[2 + has_kr]) : NULL;
    if (!w) { tide_tensor_release(q); tide_tensor_release(c); tide_tensor_release(kr); return -1; }
    int64_t B = q->shape[0], Tq = q->shape[1], H = q->shape[2], dqk = q->shape[3], Tk = c->shape[1], dc = c->shape[2];
    int64_t dn = n->attr.mla_latent.dn, dv = w->shape[1] - dn, oshape[4] = {B, Tq, H, dv}, lshape[3] = {B, H, Tq};
    tide_tensor *o = tide_empty(q->dtype, 4, oshape, q->device);
    tide_tensor *lse = o ? tide_empty(lse_dtype(q->dtype), 3, lshape, q->device) : NULL;
    int rc = lse ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(q->device, mla_latent_attention, "mla_latent_attention", q->dtype, tide_data(o),
                           tide_data(lse), tide_data(q), tide_data(c), kr ? tide_data(kr) : NULL, tide_data(w),
                           n->attr.n_list ? n->attr.list : NULL, n->attr.n_list ? n->attr.n_list - 1 : 0, B, Tq, Tk, H,
                           dn, dqk - dn, dv, dc, n->attr.mla_latent.chunk, n->attr.mla_latent.scale);
    if (!rc) rc = tide_node_save(n, q) || tide_node_save(n, c) || tide_node_save(n, w) || tide_node_save(n, o) ||
                  tide_node_save(n, lse) || tide_node_save(n, kr);
    tide_tensor_release(q); tide_tensor_release(c); tide_tensor_release(kr); tide_tensor_release(w); tide_tensor_release(lse);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_mla_latent_attention_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int has_kr = n->attr.mla_latent.has_kr;
    tide_tensor *q = n->saved[MLAL_SAVED_Q], *c = n->saved[MLAL_SAVED_C], *w = n->saved[MLAL_SAVED_W];
    tide_tensor *o = n->saved[MLAL_SAVED_OUT], *lse = n->saved[MLAL_SAVED_LSE], *kr = n->saved[MLAL_SAVED_KR];
    int64_t B = q->shape[0], Tq = q->shape[1], H = q->shape[2], dqk = q->shape[3], Tk = c->shape[1], dc = c->shape[2];
    int64_t dn = n->attr.mla_latent.dn, dv = w->shape[1] - dn;
    tide_tensor *g = tide_contiguous_nograd(gout[0]);
    /* inputs in order: q, c, [k_r], w */
    tide_tensor *src[4] = {q, c, kr ? kr : w, w}, *grads[4] = {0};
    int n_in = 3 + has_kr, rc = g ? 0 : -1;
    for (int i = 0; i < n_in && !rc; i++)
        if (n->in_needs_grad[i] && !(grads[i] = tide_zeros(src[i]->dtype, src[i]->ndim, src[i]->shape, src[i]->device))) rc = -1;
    tide_tensor *gkr = has_kr ? grads[2] : NULL, *gw = grads[2 + has_kr];
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(q->device, mla_latent_attention_backward, "mla_latent_attention", q->dtype,
                           grads[0] ? tide_data(grads[0]) : NULL, grads[1] ? tide_data(grads[1]) : NULL,
                           gkr ? tide_data(gkr) : NULL, gw ? tide_data(gw) : NULL, tide_data(g), tide_data(q),
                           tide_data(c), kr ? tide_data(kr) : NULL, tide_data(w), tide_data(o), tide_data(lse),
                           n->attr.n_list ? n->attr.list : NULL, n->attr.n_list ? n->attr.n_list - 1 : 0, B, Tq, Tk, H,
                           dn, dqk - dn, dv, dc, n->attr.mla_latent.chunk, n->attr.mla_latent.scale);
    tide_tensor_release(g);
    if (rc) { for (int i = 0; i < 4; i++) tide_tensor_release(grads[i]); return -1; }
    for (int i = 0; i < n_in; i++) gin[i] = grads[i];
    return 0;
}

tide_tensor *tide_mla_latent_attention(tide_tensor *q, tide_tensor *c, tide_tensor *k_r, tide_tensor *w,
                                       tide_tensor *cu_seqlens, double scale, int64_t chunk)
{
    const char *op = "mla_latent_attention";
    if (tide_check_float(q, op, "q") || tide_check_float(c, op, "c") || tide_check_float(w, op, "w") ||
        tide_check_same_device(q, c, op) || tide_check_same_device(q, w, op) || tide_check_same_dtype(q, c, op) ||
        tide_check_same_dtype(q, w, op)) return NULL;
    char a[128], b[128], d[128], e[128];
    int64_t dr = k_r && k_r->ndim == 3 ? k_r->shape[2] : 0;
    int ok = q->ndim == 4 && c->ndim == 3 && w->ndim == 3 && c->shape[0] == q->shape[0] && w->shape[0] == q->shape[2] &&
             w->shape[2] == c->shape[2] && q->shape[3] > dr && w->shape[1] > q->shape[3] - dr;
    TIDE_CHECK(ok, "mla_latent_attention: q %s, c %s, w %s must be [B, Tq, H, dn + dr], [B, Tk, dc], [H, dn + dv, dc] "
               "(dn, dv >= 1)", SHAPE_STR(q, a), SHAPE_STR(c, b), SHAPE_STR(w, d));
    int64_t B = q->shape[0], Tq = q->shape[1], H = q->shape[2], Tk = c->shape[1], dn = q->shape[3] - dr;
    if (k_r) {
        if (tide_check_float(k_r, op, "k_r") || tide_check_same_device(q, k_r, op) || tide_check_same_dtype(q, k_r, op)) return NULL;
        TIDE_CHECK(k_r->ndim == 3 && k_r->shape[0] == B && k_r->shape[1] == Tk && dr > 0,
                   "mla_latent_attention: k_r is %s but c %s needs it [B, Tk, dr] = [%lld, %lld, dr]", SHAPE_STR(k_r, a),
                   SHAPE_STR(c, e), (long long)B, (long long)Tk);
    }
    TIDE_CHECK(Tq <= Tk, "mla_latent_attention: causal attention needs Tq <= Tk, got %lld > %lld", (long long)Tq,
               (long long)Tk);
    TIDE_CHECK(isfinite(scale) && scale > 0, "mla_latent_attention: scale must be positive and finite, got %g", scale);
    TIDE_CHECK(chunk >= 1, "mla_latent_attention: chunk must be at least 1 key, got %lld", (long long)chunk);
    /* the expansion's GEMMs take 32-bit sizes */
    TIDE_CHECK(H * w->shape[1] <= INT32_MAX && c->shape[2] <= INT32_MAX && chunk <= INT32_MAX &&
               H * w->shape[1] * (chunk < Tk ? chunk : Tk) <= INT32_MAX,
               "mla_latent_attention: H·(dn + dv) = %lld with a chunk of %lld keys is beyond 32-bit GEMM sizes",
               (long long)(H * w->shape[1]), (long long)chunk);
    tide_attrs at = {0};
    at.mla_latent.has_kr = k_r != NULL;
    at.mla_latent.dn = dn;
    at.mla_latent.chunk = chunk;
    at.mla_latent.scale = scale;
    if (cu_seqlens && tide_load_boundaries(op, cu_seqlens, B, Tk, &at)) return NULL;
    tide_tensor *in[4] = {q, c, k_r ? k_r : w, w};
    tide_tensor *y = tide_op_run1(TIDE_OP_MLA_LATENT_ATTENTION, k_r ? 4 : 3, in, &at);
    free(at.list);
    return y;
}

/* ---- one decoding step of R rows over their own latent caches (no gradient) ------------------------------------ */

/* inputs: qt, qr (or qt again when dr = 0), c_new (or qt again when appended), kr_new (or c_new), then the R
   latent buffers, then the R rope-key buffers (only with dr > 0); list: the R cached lengths */
int tide_mla_decode_rows_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int64_t R = n->attr.mla_decode_rows.R;
    int has_kr = n->attr.mla_decode_rows.has_kr, fresh = !n->attr.mla_decode_rows.appended;
    tide_tensor *qt = tide_contiguous_nograd(in[0]), *qr = qt && has_kr ? tide_contiguous_nograd(in[1]) : NULL;
    tide_tensor *cn = qt && (qr || !has_kr) && fresh ? tide_contiguous_nograd(in[2]) : NULL;
    tide_tensor *kn = cn && has_kr ? tide_contiguous_nograd(in[3]) : NULL;
    void **cb = malloc((size_t)(2 * R) * sizeof *cb);
    int rc = qt && (qr || !has_kr) && (!fresh || (cn && (kn || !has_kr))) && cb
                 ? 0 : tide_set_error("mla_decode_rows: out of memory");
    tide_tensor *o = NULL;
    if (!rc) {
        for (int64_t r = 0; r < R; r++) {
            cb[r] = tide_data(in[4 + r]);
            cb[R + r] = has_kr ? tide_data(in[4 + R + r]) : NULL;
        }
        int64_t H = qt->shape[1], dc = qt->shape[2], dr = has_kr ? qr->shape[2] : 0, shape[3] = {R, H, dc};
        o = tide_empty(qt->dtype, 3, shape, qt->device);
        rc = o ? 0 : -1;
        if (!rc && o->numel > 0)
            rc = TIDE_DISPATCH(qt->device, mla_decode_rows, "mla_decode_rows", qt->dtype, tide_data(o), tide_data(qt),
                               qr ? tide_data(qr) : NULL, cn ? tide_data(cn) : NULL, kn ? tide_data(kn) : NULL, cb,
                               has_kr ? cb + R : NULL, n->attr.list, R, H, dc, dr, n->attr.mla_decode_rows.scale);
    }
    free(cb);
    tide_tensor_release(qt); tide_tensor_release(qr); tide_tensor_release(cn); tide_tensor_release(kn);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

/* a buffer of row r: [1, cap, w] or [cap, w], contiguous, same dtype and device as qt, room for one more token
   (its name, "c_bufs[r]", formatted only for an error: an exact prefill checks thousands of rows a call) */
static int check_row_buffer(const tide_tensor *buf, const tide_tensor *qt, int r, const char *what, int64_t w,
                            int64_t len)
{
    const char *op = "mla_decode_rows";
    char a[128], e[48];
#define ROW_NAME (snprintf(e, sizeof e, "%s[%d]", what, r), e)
    if (!buf) return tide_set_error("mla_decode_rows: %s is NULL", ROW_NAME);
    if (!tide_is_float(buf->dtype)) return tide_check_float(buf, op, ROW_NAME);
    if (tide_check_same_device(qt, buf, op) || tide_check_same_dtype(qt, buf, op)) return -1;
    int nd = buf->ndim;
    int ok = (nd == 2 || (nd == 3 && buf->shape[0] == 1)) && buf->shape[nd - 1] == w;
    if (!ok) return tide_set_error("mla_decode_rows: %s is %s but must be [1, cap, %lld] or [cap, %lld]", ROW_NAME,
                                   SHAPE_STR(buf, a), (long long)w, (long long)w);
    if (!tide_is_contiguous(buf)) return tide_set_error("mla_decode_rows: %s must be contiguous", ROW_NAME);
    int64_t cap = buf->shape[nd - 2];
    if (len < 0 || len >= cap)
        return tide_set_error("mla_decode_rows: row %d has %lld cached tokens but %s holds %lld: no room for one more",
                              r, (long long)len, ROW_NAME, (long long)cap);
#undef ROW_NAME
    return 0;
}

tide_tensor *tide_mla_decode_rows(tide_tensor *qt, tide_tensor *qr, tide_tensor *c_new, tide_tensor *kr_new, int R,
                                  tide_tensor **c_bufs, tide_tensor **kr_bufs, const int64_t *lens, double scale)
{
    const char *op = "mla_decode_rows";
    char a[128], b[128];
    TIDE_CHECK(R >= 1 && c_bufs && lens, "mla_decode_rows: needs R >= 1 rows with their buffers and lengths, got R = %d", R);
    if (tide_check_float(qt, op, "qt")) return NULL;
    TIDE_CHECK(qt->ndim == 3 && qt->shape[0] == R, "mla_decode_rows: qt is %s but must be [R, H, dc] with R = %d",
               SHAPE_STR(qt, a), R);
    int64_t H = qt->shape[1], dc = qt->shape[2];
    int appended = c_new == NULL, ok;
    if (!appended) {
        if (tide_check_float(c_new, op, "c_new") || tide_check_same_device(qt, c_new, op) ||
            tide_check_same_dtype(qt, c_new, op)) return NULL;
        ok = (c_new->ndim == 3 && c_new->shape[0] == R && c_new->shape[1] == 1 && c_new->shape[2] == dc) ||
             (c_new->ndim == 2 && c_new->shape[0] == R && c_new->shape[1] == dc);
        TIDE_CHECK(ok, "mla_decode_rows: c_new is %s but qt %s needs it [R, 1, dc] = [%d, 1, %lld]",
                   SHAPE_STR(c_new, a), SHAPE_STR(qt, b), R, (long long)dc);
    }
    int64_t dr = 0;
    TIDE_CHECK((qr == NULL) == (kr_bufs == NULL) && (appended ? kr_new == NULL : (qr == NULL) == (kr_new == NULL)),
               appended ? "mla_decode_rows: without c_new (the buffers hold the new tokens), qr and kr_bufs go together "
                          "and kr_new must be NULL"
                        : "mla_decode_rows: qr, kr_new and kr_bufs go together (all given or all NULL)");
    if (qr) {
        if (tide_check_float(qr, op, "qr") || tide_check_same_device(qt, qr, op) || tide_check_same_dtype(qt, qr, op))
            return NULL;
        TIDE_CHECK(qr->ndim == 3 && qr->shape[0] == R && qr->shape[1] == H && qr->shape[2] >= 1,
                   "mla_decode_rows: qr is %s but qt %s needs it [R, H, dr] = [%d, %lld, dr]", SHAPE_STR(qr, a),
                   SHAPE_STR(qt, b), R, (long long)H);
        dr = qr->shape[2];
        if (!appended) {
            if (tide_check_float(kr_new, op, "kr_new") || tide_check_same_device(qt, kr_new, op) ||
                tide_check_same_dtype(qt, kr_new, op)) return NULL;
            ok = (kr_new->ndim == 3 && kr_new->shape[0] == R && kr_new->shape[1] == 1 && kr_new->shape[2] == dr) ||
                 (kr_new->ndim == 2 && kr_new->shape[0] == R && kr_new->shape[1] == dr);
            TIDE_CHECK(ok, "mla_decode_rows: kr_new is %s but must be [R, 1, dr] = [%d, 1, %lld]", SHAPE_STR(kr_new, a),
                       R, (long long)dr);
        }
    }
    TIDE_CHECK(isfinite(scale) && scale > 0, "mla_decode_rows: scale must be positive and finite, got %g", scale);
    for (int r = 0; r < R; r++) {
        if (check_row_buffer(c_bufs[r], qt, r, "c_bufs", dc, lens[r])) return NULL;
        if (qr && check_row_buffer(kr_bufs[r], qt, r, "kr_bufs", dr, lens[r])) return NULL;
    }
    int n_in = 4 + R * (qr ? 2 : 1);
    tide_tensor **in = malloc((size_t)n_in * sizeof *in);
    tide_attrs at = {0};
    at.list = malloc((size_t)R * sizeof *at.list);
    if (!in || !at.list) { free(in); free(at.list); TIDE_CHECK(0, "mla_decode_rows: out of memory for %d rows", R); }
    in[0] = qt;
    in[1] = qr ? qr : qt;
    in[2] = c_new ? c_new : qt;
    in[3] = kr_new ? kr_new : in[2];
    for (int r = 0; r < R; r++) {
        in[4 + r] = c_bufs[r];
        if (qr) in[4 + R + r] = kr_bufs[r];
        at.list[r] = lens[r];
    }
    at.n_list = R;
    at.mla_decode_rows.R = R;
    at.mla_decode_rows.has_kr = qr != NULL;
    at.mla_decode_rows.appended = appended;
    at.mla_decode_rows.scale = scale;
    tide_tensor *y = tide_op_run1(TIDE_OP_MLA_DECODE_ROWS, n_in, in, &at);
    free(in);
    free(at.list);
    return y;
}

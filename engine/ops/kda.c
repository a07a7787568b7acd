/* kda.c — the Kimi Delta Attention op family (spec/kda.md): the kernel op `kda` (one node, two outputs:
   o and the final state), the decay gate `kda_gate`, the short causal convolution `causal_conv1d` (SiLU
   fused) and `l2norm`. Document boundaries (cu_seqlens) are read to the host once, merged with the row
   starts and kept as the node's list attribute, so a recompute replay needs no tensor for them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "../internal.h"

static void release_all(tide_tensor **t, int n)
{
    for (int i = 0; i < n; i++) { tide_tensor_release(t[i]); t[i] = NULL; }
}

/* contiguous copies of in[0..n) (NULL stays NULL); -1 and nothing held on failure */
static int contiguous_all(tide_tensor **in, int n, tide_tensor **out)
{
    for (int i = 0; i < n; i++) {
        out[i] = in[i] ? tide_contiguous_nograd(in[i]) : NULL;
        if (in[i] && !out[i]) { release_all(out, i); return -1; }
    }
    return 0;
}

/* ---- kda ---------------------------------------------------------------------------------------------------- */
static int kda_state_dtype(int dtype) { return dtype == TIDE_BF16 ? TIDE_F32 : dtype; }

/* saved: the inputs in their order (s0 empty when not given), then the backend's state checkpoints (or empty) */
enum { KDA_SAVED_Q, KDA_SAVED_K, KDA_SAVED_V, KDA_SAVED_G, KDA_SAVED_BETA, KDA_SAVED_S0, KDA_SAVED_CKPT };

/* the backend's chunk start-state checkpoints for the backward (backend.h: kda_ckpt_chunks) of a node with state
   width dv: *ck a new tensor, or NULL when the backend or the path keeps none or no backward will run; -1 when it
   cannot be allocated */
static int kda_ckpt_alloc(const tide_node *n, const tide_backend *bk, int64_t H, int64_t dk, int64_t dv, int dtype,
                          int device, tide_tensor **ck)
{
    *ck = NULL;
    int64_t chunk = n->attr.kda.chunk;
    /* none for a forward no backward follows (not recorded): they would be written and dropped */
    if (bk->kda_ckpt_chunks <= 0 || n->attr.kda.path == TIDE_KDA_RECURRENT || n->no_saves) return 0;
    int64_t n_ck = 0;
    for (int sg = 0; sg + 1 < n->attr.n_list; sg++) {
        int64_t nch = (n->attr.list[sg + 1] - n->attr.list[sg] + chunk - 1) / chunk;
        n_ck += (nch + bk->kda_ckpt_chunks - 1) / bk->kda_ckpt_chunks;
    }
    int64_t cshape[4] = {n_ck, H, dk, dv};
    *ck = tide_empty(dtype, 4, cshape, device);
    return *ck ? 0 : -1;
}

int tide_kda_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *c[6] = {0};
    int has_s0 = n->attr.kda.has_s0;
    if (contiguous_all(in, 5 + has_s0, c)) return -1;
    tide_tensor *q = c[0], *v = c[2];
    int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], dv = v->shape[3];
    int64_t oshape[4] = {B, T, H, dv}, sshape[4] = {B, H, dk, dv};
    tide_tensor *o = tide_empty(q->dtype, 4, oshape, q->device);
    tide_tensor *s = o ? tide_empty(kda_state_dtype(q->dtype), 4, sshape, q->device) : NULL;
    const tide_backend *bk = tide_backend_for(q->device);
    int path = n->attr.kda.path;
    int64_t chunk = n->attr.kda.chunk;
    tide_tensor *ck = NULL;
    int rc = s && !kda_ckpt_alloc(n, bk, H, dk, dv, s->dtype, q->device, &ck) ? 0 : -1;
    if (!rc)
        rc = TIDE_DISPATCH(q->device, kda, "kda", q->dtype, tide_data(o), tide_data(s), tide_data(q), tide_data(c[1]),
                           tide_data(v), tide_data(c[3]), tide_data(c[4]), has_s0 ? tide_data(c[5]) : NULL,
                           n->attr.list, n->attr.n_list - 1, B, T, H, dk, dv, path, chunk, n->attr.kda.lower_bound,
                           ck ? tide_data(ck) : NULL);
    for (int i = KDA_SAVED_Q; i <= KDA_SAVED_S0 && !rc; i++) rc = tide_node_save(n, c[i]);
    if (!rc) rc = tide_node_save(n, ck);
    release_all(c, 6);
    tide_tensor_release(ck);
    if (rc) { tide_tensor_release(o); tide_tensor_release(s); return -1; }
    out[0] = o;
    out[1] = s;
    return 0;
}

int tide_kda_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int has_s0 = n->attr.kda.has_s0;
    tide_tensor **sv = n->saved, *q = sv[KDA_SAVED_Q], *v = sv[KDA_SAVED_V], *ck = sv[KDA_SAVED_CKPT];
    int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], dv = v->shape[3];
    tide_tensor *go = tide_contiguous_nograd(gout[0]), *gs = go ? tide_contiguous_nograd(gout[1]) : NULL;
    tide_tensor *g[6] = {0};
    int rc = gs ? 0 : -1;
    for (int i = 0; i < 5 + has_s0 && !rc; i++)
        if (n->in_needs_grad[i] && !(g[i] = tide_empty_like(sv[i]))) rc = -1;
    if (!rc)
        rc = TIDE_DISPATCH(q->device, kda_backward, "kda", q->dtype, g[0] ? tide_data(g[0]) : NULL,
                           g[1] ? tide_data(g[1]) : NULL, g[2] ? tide_data(g[2]) : NULL, g[3] ? tide_data(g[3]) : NULL,
                           g[4] ? tide_data(g[4]) : NULL, g[5] ? tide_data(g[5]) : NULL, tide_data(go), tide_data(gs),
                           tide_data(q), tide_data(sv[KDA_SAVED_K]), tide_data(v), tide_data(sv[KDA_SAVED_G]),
                           tide_data(sv[KDA_SAVED_BETA]), has_s0 ? tide_data(sv[KDA_SAVED_S0]) : NULL, n->attr.list,
                           n->attr.n_list - 1, B, T, H, dk, dv, n->attr.kda.path, n->attr.kda.chunk,
                           n->attr.kda.lower_bound, ck ? tide_data(ck) : NULL);
    tide_tensor_release(go);
    tide_tensor_release(gs);
    if (rc) { release_all(g, 6); return -1; }
    for (int i = 0; i < 5 + has_s0; i++) gin[i] = g[i];
    return 0;
}

/* the checks of the kda ops' inputs (s0 may be NULL) and their attributes, set in *at */
static int kda_check(const char *op, tide_tensor *q, tide_tensor *k, tide_tensor *v, tide_tensor *g, tide_tensor *beta,
                     tide_tensor *s0, int path, int chunk, double lower_bound, tide_attrs *at)
{
    tide_tensor *x[5] = {q, k, v, g, beta};
    const char *names[5] = {"q", "k", "v", "g", "beta"};
    for (int i = 0; i < 5; i++)
        if (tide_check_float(x[i], op, names[i]) || tide_check_same_device(q, x[i], op) || tide_check_same_dtype(q, x[i], op))
            return -1;
    char a[128], b[128], c[128], d[128], e[128];
    int ok = q->ndim == 4 && tide_same_shape(q, k) && tide_same_shape(q, g) && v->ndim == 4 && beta->ndim == 3;
    for (int i = 0; ok && i < 3; i++) ok = v->shape[i] == q->shape[i] && beta->shape[i] == q->shape[i];
    if (!ok)
        return tide_set_error("%s: q %s, k %s, g %s, v %s, beta %s must be [B, T, H, dk] x3, [B, T, H, dv], [B, T, H]",
                              op, SHAPE_STR(q, a), SHAPE_STR(k, b), SHAPE_STR(g, c), SHAPE_STR(v, d), SHAPE_STR(beta, e));
    int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], dv = v->shape[3];
    if (B < 1 || T < 1 || H < 1 || dk < 1 || dv < 1) return tide_set_error("%s: empty input %s", op, SHAPE_STR(q, a));
    if (s0) {
        if (tide_check_float(s0, op, "s0") || tide_check_same_device(q, s0, op)) return -1;
        int64_t want[4] = {B, H, dk, dv};
        if (s0->ndim != 4 || memcmp(s0->shape, want, sizeof want))
            return tide_set_error("%s: s0 is %s but must be [B, H, dk, dv] = %s", op, SHAPE_STR(s0, a), tide_shape_str(4, want, b, sizeof b));
        if (s0->dtype != kda_state_dtype(q->dtype))
            return tide_set_error("%s: s0 is %s but the state of %s inputs is %s", op, tide_dtype_name(s0->dtype),
                                  tide_dtype_name(q->dtype), tide_dtype_name(kda_state_dtype(q->dtype)));
    }
    if (path < TIDE_KDA_CHUNK || path > TIDE_KDA_RECURRENT)
        return tide_set_error("%s: path must be 0 (chunk), 1 (chunk_safe) or 2 (recurrent), got %d", op, path);
    if (path != TIDE_KDA_RECURRENT && (chunk < 1 || chunk > 1024))
        return tide_set_error("%s: chunk must be in [1, 1024], got %d", op, chunk);
    double limit = q->dtype == TIDE_F64 ? 700.0 : 80.0;   /* exp(±G) normal: f32/bf16 80 nats, f64 700 */
    if (path == TIDE_KDA_CHUNK && !(lower_bound < 0 && (double)chunk * -lower_bound <= limit))
        return tide_set_error("%s: the chunk path needs a lower bound lb < 0 with chunk·|lb| <= %g for %s so that exp(±G) "
                              "stay normal floats (kda.md §5), got lb = %g with chunk %d", op, limit, tide_dtype_name(q->dtype),
                              lower_bound, chunk);
    (void)T;
    at->kda.path = path;
    at->kda.chunk = chunk;
    at->kda.has_s0 = s0 != NULL;
    at->kda.lower_bound = lower_bound;
    return 0;
}

/* ---- kda_pairs: each row's (h_ext | M), nothing but the inputs kept for the backward ------------------------------ */

/* vz = [v | 0] [B, T, H, dv + dk] and s0 = [0 | I] [B, H, dk, dv + dk] (the state dtype): the kernel's state columns
   evolve independently, so from s0 its final state is [h_ext | M] (long_context.md §5) */
static int kda_pairs_inputs(const tide_tensor *v, int64_t dk, int sdtype, tide_tensor **vz, tide_tensor **s0)
{
    int64_t B = v->shape[0], T = v->shape[1], H = v->shape[2], dv = v->shape[3], W = dv + dk;
    int64_t zs[4] = {B, T, H, W}, ss[4] = {B, H, dk, W}, st[4];
    *s0 = NULL;
    *vz = tide_zeros(v->dtype, 4, zs, v->device);
    if (!*vz) return -1;
    tide_contiguous_strides(4, zs, st);
    tide_tensor *view = tide_view_of(*vz, 4, v->shape, st, 0);
    int rc = view ? tide_copy_(view, v) : -1;
    tide_tensor_release(view);
    double *eye = rc ? NULL : calloc((size_t)(B * H * dk * W), sizeof *eye);
    if (!rc && !eye) rc = tide_set_error("kda_pairs: out of memory");
    if (!rc) {
        for (int64_t bh = 0; bh < B * H; bh++)
            for (int64_t i = 0; i < dk; i++) eye[(bh * dk + i) * W + dv + i] = 1;
        *s0 = tide_from_f64(sdtype, 4, ss, v->device, eye);
        if (!*s0) rc = -1;
    }
    free(eye);
    if (rc) { tide_tensor_release(*vz); *vz = NULL; }
    return rc;
}

/* the pairs kernel call: o (scratch) and s [B, H, dk, dv + dk] from vz, s0; ck filled when given */
static int kda_pairs_run(const tide_node *n, tide_tensor **c, tide_tensor *vz, tide_tensor *s0, tide_tensor *s,
                         tide_tensor *ck)
{
    tide_tensor *q = c[0];
    int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], W = vz->shape[3];
    int64_t oshape[4] = {B, T, H, W};
    tide_tensor *o = tide_empty(q->dtype, 4, oshape, q->device);
    int rc = o ? TIDE_DISPATCH(q->device, kda, "kda_pairs", q->dtype, tide_data(o), tide_data(s), tide_data(q),
                               tide_data(c[1]), tide_data(vz), tide_data(c[3]), tide_data(c[4]), tide_data(s0),
                               n->attr.list, n->attr.n_list - 1, B, T, H, dk, W, n->attr.kda.path, n->attr.kda.chunk,
                               n->attr.kda.lower_bound, ck ? tide_data(ck) : NULL)
               : -1;
    tide_tensor_release(o);
    return rc;
}

int tide_kda_pairs_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *c[5] = {0}, *vz = NULL, *s0 = NULL, *s = NULL, *ck = NULL;
    if (contiguous_all(in, 5, c)) return -1;
    tide_tensor *q = c[0];
    int64_t B = q->shape[0], H = q->shape[2], dk = q->shape[3], W = c[2]->shape[3] + dk, sshape[4] = {B, H, dk, W};
    int sd = kda_state_dtype(q->dtype);
    int rc = kda_pairs_inputs(c[2], dk, sd, &vz, &s0);
    if (!rc && !(s = tide_empty(sd, 4, sshape, q->device))) rc = -1;
    if (!rc) rc = kda_ckpt_alloc(n, tide_backend_for(q->device), H, dk, W, sd, q->device, &ck);
    if (!rc) rc = kda_pairs_run(n, c, vz, s0, s, ck);
    for (int i = 0; i < 5 && !rc; i++) rc = tide_node_save(n, c[i]);
    release_all(c, 5);
    tide_tensor_release(vz); tide_tensor_release(s0); tide_tensor_release(ck);
    if (rc) { tide_tensor_release(s); return -1; }
    out[0] = s;
    return 0;
}

/* the pairs' gradient: the inputs widened again and, when the backend keeps state checkpoints, the call rerun to
   write them; then the kernel's backward with no output gradient and the pairs' gradient as the final state's */
int tide_kda_pairs_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor **c = n->saved, *q = c[0], *v = c[2];
    int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], dk = q->shape[3], dv = v->shape[3], W = dv + dk;
    int64_t oshape[4] = {B, T, H, W}, sshape[4] = {B, H, dk, W};
    int sd = kda_state_dtype(q->dtype);
    tide_tensor *vz = NULL, *s0 = NULL, *ck = NULL, *s = NULL, *go = NULL, *g[5] = {0}, *gvz = NULL;
    tide_tensor *gs = tide_contiguous_nograd(gout[0]);
    int rc = gs ? kda_pairs_inputs(v, dk, sd, &vz, &s0) : -1;
    if (!rc) rc = kda_ckpt_alloc(n, tide_backend_for(q->device), H, dk, W, sd, q->device, &ck);
    if (!rc && ck) {
        s = tide_empty(sd, 4, sshape, q->device);
        rc = s ? kda_pairs_run(n, c, vz, s0, s, ck) : -1;
    }
    if (!rc && !(go = tide_zeros(q->dtype, 4, oshape, q->device))) rc = -1;
    for (int i = 0; i < 5 && !rc; i++)
        if (n->in_needs_grad[i] && i != 2 && !(g[i] = tide_empty_like(c[i]))) rc = -1;
    if (!rc && n->in_needs_grad[2] && !(gvz = tide_empty_like(vz))) rc = -1;
    if (!rc)
        rc = TIDE_DISPATCH(q->device, kda_backward, "kda_pairs", q->dtype, g[0] ? tide_data(g[0]) : NULL,
                           g[1] ? tide_data(g[1]) : NULL, gvz ? tide_data(gvz) : NULL, g[3] ? tide_data(g[3]) : NULL,
                           g[4] ? tide_data(g[4]) : NULL, NULL, tide_data(go), tide_data(gs), tide_data(q),
                           tide_data(c[1]), tide_data(vz), tide_data(c[3]), tide_data(c[4]), tide_data(s0),
                           n->attr.list, n->attr.n_list - 1, B, T, H, dk, W, n->attr.kda.path, n->attr.kda.chunk,
                           n->attr.kda.lower_bound, ck ? tide_data(ck) : NULL);
    if (!rc && gvz) {
        /* the gradient of v: the first dv columns of vz's */
        int64_t st[4];
        tide_contiguous_strides(4, oshape, st);
        tide_tensor *view = tide_view_of(gvz, 4, v->shape, st, 0);
        g[2] = view ? tide_contiguous_nograd(view) : NULL;
        tide_tensor_release(view);
        if (!g[2]) rc = -1;
    }
    tide_tensor_release(gs); tide_tensor_release(vz); tide_tensor_release(s0); tide_tensor_release(ck);
    tide_tensor_release(s); tide_tensor_release(go); tide_tensor_release(gvz);
    if (rc) { release_all(g, 5); return -1; }
    for (int i = 0; i < 5; i++) gin[i] = g[i];
    return 0;
}

tide_tensor *tide_kda_pairs(tide_tensor *q, tide_tensor *k, tide_tensor *v, tide_tensor *g, tide_tensor *beta,
                            tide_tensor *cu_seqlens, int path, int chunk, double lower_bound)
{
    tide_attrs at = {0};
    if (kda_check("kda_pairs", q, k, v, g, beta, NULL, path, chunk, lower_bound, &at)) return NULL;
    if (tide_load_boundaries("kda_pairs", cu_seqlens, q->shape[0], q->shape[1], &at)) return NULL;
    tide_tensor *in[5] = {q, k, v, g, beta};
    tide_tensor *y = tide_op_run1(TIDE_OP_KDA_PAIRS, 5, in, &at);
    free(at.list);
    return y;
}

/* ---- one decoding step of R rows over their own states (no gradient) ------------------------------------------ */

/* inputs: q, k, v, g, beta ([R, H, ·]), then the R states, written in place */
int tide_kda_decode_rows_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int64_t R = n->attr.kda_decode_rows.R;
    tide_tensor *c[5] = {0};
    void **sp = malloc((size_t)R * sizeof *sp);
    if (!sp || contiguous_all(in, 5, c)) { free(sp); return sp ? -1 : tide_set_error("kda_decode_rows: out of memory"); }
    for (int64_t r = 0; r < R; r++) sp[r] = tide_data(in[5 + r]);
    tide_tensor *q = c[0], *v = c[2];
    int64_t H = q->shape[1], dk = q->shape[2], dv = v->shape[2], shape[3] = {R, H, dv};
    tide_tensor *o = tide_empty(q->dtype, 3, shape, q->device);
    int rc = o ? 0 : -1;
    if (!rc)
        rc = TIDE_DISPATCH(q->device, kda_decode_rows, "kda_decode_rows", q->dtype, tide_data(o), tide_data(q),
                           tide_data(c[1]), tide_data(v), tide_data(c[3]), tide_data(c[4]), sp, R, H, dk, dv);
    free(sp);
    release_all(c, 5);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

tide_tensor *tide_kda_decode_rows(tide_tensor *q, tide_tensor *k, tide_tensor *v, tide_tensor *g, tide_tensor *beta,
                                  int R, tide_tensor **states)
{
    const char *op = "kda_decode_rows";
    char a[128], b[128], c[128], d[128], e[128];
    TIDE_CHECK(R >= 1 && states, "kda_decode_rows: needs R >= 1 rows with their states, got R = %d", R);
    tide_tensor *x[5] = {q, k, v, g, beta};
    const char *names[5] = {"q", "k", "v", "g", "beta"};
    for (int i = 0; i < 5; i++)
        if (tide_check_float(x[i], op, names[i]) || tide_check_same_device(q, x[i], op) || tide_check_same_dtype(q, x[i], op))
            return NULL;
    int ok = q->ndim == 3 && q->shape[0] == R && tide_same_shape(q, k) && tide_same_shape(q, g) && v->ndim == 3 &&
             v->shape[0] == R && v->shape[1] == q->shape[1] && beta->ndim == 2 && beta->shape[0] == R &&
             beta->shape[1] == q->shape[1];
    TIDE_CHECK(ok, "kda_decode_rows: q %s, k %s, g %s, v %s, beta %s must be [R, H, dk] x3, [R, H, dv], [R, H] with R = %d",
               SHAPE_STR(q, a), SHAPE_STR(k, b), SHAPE_STR(g, c), SHAPE_STR(v, d), SHAPE_STR(beta, e), R);
    int64_t H = q->shape[1], dk = q->shape[2], dv = v->shape[2];
    TIDE_CHECK(H >= 1 && dk >= 1 && dv >= 1, "kda_decode_rows: empty input %s", SHAPE_STR(q, a));
    int sd = kda_state_dtype(q->dtype);
    for (int r = 0; r < R; r++) {
        const tide_tensor *s = states[r];
        TIDE_CHECK(s, "kda_decode_rows: states[%d] is NULL", r);
        if (tide_check_same_device(q, s, op)) return NULL;
        int nd = s->ndim;
        ok = (nd == 3 || (nd == 4 && s->shape[0] == 1)) && s->shape[nd - 3] == H && s->shape[nd - 2] == dk &&
             s->shape[nd - 1] == dv;
        TIDE_CHECK(ok, "kda_decode_rows: states[%d] is %s but must be [1, H, dk, dv] or [H, dk, dv] = [%lld, %lld, %lld]",
                   r, SHAPE_STR(s, a), (long long)H, (long long)dk, (long long)dv);
        TIDE_CHECK(s->dtype == sd, "kda_decode_rows: states[%d] is %s but the state of %s inputs is %s", r,
                   tide_dtype_name(s->dtype), tide_dtype_name(q->dtype), tide_dtype_name(sd));
        TIDE_CHECK(tide_is_contiguous(s), "kda_decode_rows: states[%d] must be contiguous (it is updated in place)", r);
    }
    if (tide_check_distinct_data(states, R, op, "states", "each row needs its own state")) return NULL;
    tide_tensor **in = malloc((size_t)(5 + R) * sizeof *in);
    TIDE_CHECK(in, "kda_decode_rows: out of memory for %d rows", R);
    for (int i = 0; i < 5; i++) in[i] = x[i];
    for (int r = 0; r < R; r++) in[5 + r] = states[r];
    tide_attrs at = {0};
    at.kda_decode_rows.R = R;
    tide_tensor *y = tide_op_run1(TIDE_OP_KDA_DECODE_ROWS, 5 + R, in, &at);
    free(in);
    return y;
}

int tide_kda(tide_tensor *q, tide_tensor *k, tide_tensor *v, tide_tensor *g, tide_tensor *beta, tide_tensor *s0,
             tide_tensor *cu_seqlens, int path, int chunk, double lower_bound, tide_tensor **o, tide_tensor **state)
{
    const char *op = "kda";
    if (!o || !state) return tide_set_error("kda: o and state output pointers are required");
    *o = *state = NULL;
    tide_attrs at = {0};
    if (kda_check(op, q, k, v, g, beta, s0, path, chunk, lower_bound, &at)) return -1;
    if (tide_load_boundaries(op, cu_seqlens, q->shape[0], q->shape[1], &at)) return -1;
    tide_tensor *in[6] = {q, k, v, g, beta, s0}, *out[2] = {0};
    int rc = tide_op_run(TIDE_OP_KDA, s0 ? 6 : 5, in, 2, out, &at);
    free(at.list);
    if (rc) return -1;
    *o = out[0];
    *state = out[1];
    return 0;
}

/* ---- kda_gate ------------------------------------------------------------------------------------------------ */
int tide_kda_gate_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *c[3];
    if (contiguous_all(in, 3, c)) return -1;
    int64_t H = n->attr.kda_gate.H, D = n->attr.kda_gate.D, N = c[0]->numel / (H * D);
    tide_tensor *g = tide_empty_like(c[0]);
    int rc = g ? 0 : -1;
    if (!rc && N > 0)
        rc = TIDE_DISPATCH(c[0]->device, kda_gate, "kda_gate", c[0]->dtype, tide_data(g), tide_data(c[0]),
                           tide_data(c[1]), tide_data(c[2]), N, H, D, n->attr.kda_gate.lower_bound,
                           n->attr.kda_gate.form);
    for (int i = 0; i < 3 && !rc; i++) rc = tide_node_save(n, c[i]);
    release_all(c, 3);
    if (rc) { tide_tensor_release(g); return -1; }
    out[0] = g;
    return 0;
}

int tide_kda_gate_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *z = n->saved[0], *A = n->saved[1], *b = n->saved[2];
    int64_t H = n->attr.kda_gate.H, D = n->attr.kda_gate.D, N = z->numel / (H * D);
    tide_tensor *gg = tide_contiguous_nograd(gout[0]), *g[3] = {0};
    int rc = gg ? 0 : -1;
    tide_tensor *src[3] = {z, A, b};
    for (int i = 0; i < 3 && !rc; i++)
        if (n->in_needs_grad[i] && !(g[i] = (N > 0 ? tide_empty_like(src[i]) : tide_zeros(src[i]->dtype, src[i]->ndim, src[i]->shape, src[i]->device))))
            rc = -1;
    if (!rc && N > 0)
        rc = TIDE_DISPATCH(z->device, kda_gate_backward, "kda_gate", z->dtype, g[0] ? tide_data(g[0]) : NULL,
                           g[1] ? tide_data(g[1]) : NULL, g[2] ? tide_data(g[2]) : NULL, tide_data(gg), tide_data(z),
                           tide_data(A), tide_data(b), N, H, D, n->attr.kda_gate.lower_bound, n->attr.kda_gate.form);
    tide_tensor_release(gg);
    if (rc) { release_all(g, 3); return -1; }
    for (int i = 0; i < 3; i++) gin[i] = g[i];
    return 0;
}

tide_tensor *tide_kda_gate(tide_tensor *z, tide_tensor *A_log, tide_tensor *dt_bias, double lower_bound, int form)
{
    const char *op = "kda_gate";
    if (tide_check_float(z, op, "z") || tide_check_float(A_log, op, "A_log") || tide_check_float(dt_bias, op, "dt_bias") ||
        tide_check_same_device(z, A_log, op) || tide_check_same_device(z, dt_bias, op) || tide_check_same_dtype(z, A_log, op) ||
        tide_check_same_dtype(z, dt_bias, op)) return NULL;
    char a[128], b[128], c[128];
    TIDE_CHECK(z->ndim >= 2, "kda_gate: z must be [..., H, D], got %s", SHAPE_STR(z, a));
    int64_t H = z->shape[z->ndim - 2], D = z->shape[z->ndim - 1];
    int ok = A_log->ndim == 1 && A_log->shape[0] == H &&
             ((dt_bias->ndim == 1 && dt_bias->shape[0] == H * D) ||
              (dt_bias->ndim == 2 && dt_bias->shape[0] == H && dt_bias->shape[1] == D));
    TIDE_CHECK(ok, "kda_gate: z %s, A_log %s, dt_bias %s must be [..., H, D], [H], [H, D] or [H·D]", SHAPE_STR(z, a),
               SHAPE_STR(A_log, b), SHAPE_STR(dt_bias, c));
    TIDE_CHECK(H > 0 && D > 0, "kda_gate: empty head dims in z %s", SHAPE_STR(z, a));
    TIDE_CHECK(form == TIDE_KDA_GATE_BOUNDED || form == TIDE_KDA_GATE_SOFTPLUS,
               "kda_gate: form must be 0 (lower-bounded) or 1 (softplus), got %d", form);
    TIDE_CHECK(form != TIDE_KDA_GATE_BOUNDED || (lower_bound < 0 && isfinite(lower_bound)),
               "kda_gate: the lower bound must be negative and finite, got %g", lower_bound);
    tide_attrs at = {0};
    at.kda_gate.form = form;
    at.kda_gate.H = H;
    at.kda_gate.D = D;
    at.kda_gate.lower_bound = lower_bound;
    tide_tensor *in[3] = {z, A_log, dt_bias};
    return tide_op_run1(TIDE_OP_KDA_GATE, 3, in, &at);
}

/* ---- causal_conv1d ------------------------------------------------------------------------------------------ */
/* saved: the inputs in their order (cache empty when not given) */
enum { CONV_SAVED_X, CONV_SAVED_W, CONV_SAVED_CACHE };

int tide_causal_conv1d_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int has_cache = n->attr.causal_conv1d.has_cache;
    tide_tensor *c[3] = {0};
    if (contiguous_all(in, 2 + has_cache, c)) return -1;
    tide_tensor *x = c[0];
    int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = c[1]->shape[1];
    tide_tensor *y = tide_empty_like(x);
    int rc = y ? 0 : -1;
    if (!rc)
        rc = TIDE_DISPATCH(x->device, causal_conv1d, "causal_conv1d", x->dtype, tide_data(y), tide_data(x),
                           tide_data(c[1]), has_cache ? tide_data(c[2]) : NULL, n->attr.list, n->attr.n_list - 1, B, T,
                           C, K, n->attr.causal_conv1d.silu);
    for (int i = CONV_SAVED_X; i <= CONV_SAVED_CACHE && !rc; i++) rc = tide_node_save(n, c[i]);
    release_all(c, 3);
    if (rc) { tide_tensor_release(y); return -1; }
    out[0] = y;
    return 0;
}

int tide_causal_conv1d_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    int has_cache = n->attr.causal_conv1d.has_cache;
    tide_tensor *x = n->saved[CONV_SAVED_X], *w = n->saved[CONV_SAVED_W], *cache = n->saved[CONV_SAVED_CACHE];
    int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[1];
    tide_tensor *go = tide_contiguous_nograd(gout[0]), *g[3] = {0};
    int rc = go ? 0 : -1;
    for (int i = 0; i < 2 + has_cache && !rc; i++)
        if (n->in_needs_grad[i] && !(g[i] = tide_empty_like(n->saved[i]))) rc = -1;
    if (!rc)
        rc = TIDE_DISPATCH(x->device, causal_conv1d_backward, "causal_conv1d", x->dtype, g[0] ? tide_data(g[0]) : NULL,
                           g[1] ? tide_data(g[1]) : NULL, g[2] ? tide_data(g[2]) : NULL, tide_data(go), tide_data(x),
                           tide_data(w), cache ? tide_data(cache) : NULL, n->attr.list, n->attr.n_list - 1, B, T, C, K,
                           n->attr.causal_conv1d.silu);
    tide_tensor_release(go);
    if (rc) { release_all(g, 3); return -1; }
    for (int i = 0; i < 2 + has_cache; i++) gin[i] = g[i];
    return 0;
}

tide_tensor *tide_causal_conv1d(tide_tensor *x, tide_tensor *w, tide_tensor *cache, tide_tensor *cu_seqlens, int silu)
{
    const char *op = "causal_conv1d";
    if (tide_check_float(x, op, "x") || tide_check_float(w, op, "w") || tide_check_same_device(x, w, op) ||
        tide_check_same_dtype(x, w, op)) return NULL;
    char a[128], b[128];
    TIDE_CHECK(x->ndim == 3 && x->shape[0] > 0 && x->shape[1] > 0, "causal_conv1d: x must be [B, T, C] with B, T >= 1, got %s",
               SHAPE_STR(x, a));
    TIDE_CHECK(w->ndim == 2 && w->shape[0] == x->shape[2] && w->shape[1] >= 1,
               "causal_conv1d: w is %s but must be [C, K] with C = %lld (the channels of x)", SHAPE_STR(w, a),
               (long long)x->shape[2]);
    int64_t B = x->shape[0], T = x->shape[1], C = x->shape[2], K = w->shape[1];
    if (cache) {
        if (tide_check_float(cache, op, "cache") || tide_check_same_device(x, cache, op) || tide_check_same_dtype(x, cache, op))
            return NULL;
        int64_t want[3] = {B, K - 1, C};
        TIDE_CHECK(cache->ndim == 3 && !memcmp(cache->shape, want, sizeof want),
                   "causal_conv1d: cache is %s but must be [B, K-1, C] = %s", SHAPE_STR(cache, a), tide_shape_str(3, want, b, sizeof b));
    }
    tide_attrs at = {0};
    at.causal_conv1d.silu = silu ? 1 : 0;
    at.causal_conv1d.has_cache = cache != NULL;
    if (tide_load_boundaries(op, cu_seqlens, B, T, &at)) return NULL;
    tide_tensor *in[3] = {x, w, cache};
    tide_tensor *y = tide_op_run1(TIDE_OP_CAUSAL_CONV1D, cache ? 3 : 2, in, &at);
    free(at.list);
    return y;
}

/* ---- one causal-conv decoding step of R rows over their own histories (no gradient) ---------------------------- */

/* inputs: x, w, then the R histories, written in place */
int tide_conv_decode_rows_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    int64_t R = n->attr.conv_decode_rows.R;
    tide_tensor *c[2] = {0};
    void **hp = malloc((size_t)R * sizeof *hp);
    if (!hp || contiguous_all(in, 2, c)) { free(hp); return hp ? -1 : tide_set_error("conv_decode_rows: out of memory"); }
    for (int64_t r = 0; r < R; r++) hp[r] = tide_data(in[2 + r]);
    tide_tensor *x = c[0];
    int64_t C = x->shape[x->ndim - 1], K = c[1]->shape[1];
    tide_tensor *y = tide_empty_like(x);
    int rc = y ? 0 : -1;
    if (!rc)
        rc = TIDE_DISPATCH(x->device, conv_decode_rows, "conv_decode_rows", x->dtype, tide_data(y), tide_data(x),
                           tide_data(c[1]), hp, R, C, K, n->attr.conv_decode_rows.silu);
    free(hp);
    release_all(c, 2);
    if (rc) { tide_tensor_release(y); return -1; }
    out[0] = y;
    return 0;
}

tide_tensor *tide_conv_decode_rows(tide_tensor *x, tide_tensor *w, int R, tide_tensor **caches, int silu)
{
    const char *op = "conv_decode_rows";
    char a[128], b[128];
    TIDE_CHECK(R >= 1 && caches, "conv_decode_rows: needs R >= 1 rows with their histories, got R = %d", R);
    if (tide_check_float(x, op, "x") || tide_check_float(w, op, "w") || tide_check_same_device(x, w, op) ||
        tide_check_same_dtype(x, w, op)) return NULL;
    int ok = (x->ndim == 2 || (x->ndim == 3 && x->shape[1] == 1)) && x->shape[0] == R && x->shape[x->ndim - 1] >= 1;
    TIDE_CHECK(ok, "conv_decode_rows: x is %s but must be [R, C] or [R, 1, C] with R = %d, C >= 1", SHAPE_STR(x, a), R);
    int64_t C = x->shape[x->ndim - 1];
    TIDE_CHECK(w->ndim == 2 && w->shape[0] == C && w->shape[1] >= 1,
               "conv_decode_rows: w is %s but must be [C, K] with C = %lld (the channels of x)", SHAPE_STR(w, a),
               (long long)C);
    int64_t K = w->shape[1];
    for (int r = 0; r < R; r++) {
        const tide_tensor *h = caches[r];
        TIDE_CHECK(h, "conv_decode_rows: caches[%d] is NULL", r);
        if (tide_check_same_device(x, h, op) || tide_check_same_dtype(x, h, op)) return NULL;
        int nd = h->ndim;
        int64_t want[2] = {K - 1, C};
        ok = (nd == 2 || (nd == 3 && h->shape[0] == 1)) && h->shape[nd - 2] == K - 1 && h->shape[nd - 1] == C;
        TIDE_CHECK(ok, "conv_decode_rows: caches[%d] is %s but must be [1, K-1, C] or [K-1, C] = %s", r, SHAPE_STR(h, a),
                   tide_shape_str(2, want, b, sizeof b));
        TIDE_CHECK(tide_is_contiguous(h), "conv_decode_rows: caches[%d] must be contiguous (it is updated in place)", r);
    }
    if (K > 1 && tide_check_distinct_data(caches, R, op, "caches", "each row needs its own history")) return NULL;
    tide_tensor **in = malloc((size_t)(2 + R) * sizeof *in);
    TIDE_CHECK(in, "conv_decode_rows: out of memory for %d rows", R);
    in[0] = x;
    in[1] = w;
    for (int r = 0; r < R; r++) in[2 + r] = caches[r];
    tide_attrs at = {0};
    at.conv_decode_rows.R = R;
    at.conv_decode_rows.silu = silu ? 1 : 0;
    tide_tensor *y = tide_op_run1(TIDE_OP_CONV_DECODE_ROWS, 2 + R, in, &at);
    free(in);
    return y;
}

/* ---- l2norm ----------------------------------------------------------------------------------------------- */
/* scale·x/sqrt(Σx² + eps) = (scale/√C) · rmsnorm(x; eps/C): it runs on the RMSNorm kernels without a weight. */
int tide_l2norm_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *x = tide_contiguous_nograd(in[0]);
    if (!x) return -1;
    int64_t C = x->shape[x->ndim - 1], N = C > 0 ? x->numel / C : 0;
    tide_tensor *y = tide_empty_like(x), *rstd = y ? tide_empty(x->dtype, 1, &N, x->device) : NULL;
    int rc = rstd ? 0 : -1;
    if (!rc && x->numel > 0) {
        rc = TIDE_DISPATCH(x->device, rmsnorm, "l2norm", x->dtype, tide_data(y), tide_data(rstd), tide_data(x), NULL, N,
                           C, n->attr.l2norm.eps / (double)C);
        if (!rc) rc = TIDE_DISPATCH(x->device, unary, "l2norm", TIDE_UN_MUL_SCALAR, x->dtype, tide_data(y),
                                    tide_data(y), y->numel, n->attr.l2norm.scale / sqrt((double)C));
    }
    if (!rc) rc = tide_node_save(n, x) || tide_node_save(n, rstd);
    tide_tensor_release(x);
    tide_tensor_release(rstd);
    if (rc) { tide_tensor_release(y); return -1; }
    out[0] = y;
    return 0;
}

int tide_l2norm_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    tide_tensor *x = n->saved[0], *rstd = n->saved[1];
    int64_t C = x->shape[x->ndim - 1], N = C > 0 ? x->numel / C : 0;
    tide_tensor *g = tide_contiguous_nograd(gout[0]), *gs = g ? tide_empty_like(g) : NULL, *dx = gs ? tide_empty_like(x) : NULL;
    int rc = dx ? 0 : -1;
    if (!rc && x->numel > 0) {
        rc = TIDE_DISPATCH(x->device, unary, "l2norm", TIDE_UN_MUL_SCALAR, x->dtype, tide_data(gs), tide_data(g),
                           g->numel, n->attr.l2norm.scale / sqrt((double)C));
        if (!rc) rc = TIDE_DISPATCH(x->device, rmsnorm_backward, "l2norm", x->dtype, tide_data(dx), NULL, tide_data(gs),
                                    tide_data(x), NULL, tide_data(rstd), N, C);
    }
    tide_tensor_release(g);
    tide_tensor_release(gs);
    if (rc) { tide_tensor_release(dx); return -1; }
    gin[0] = dx;
    return 0;
}

tide_tensor *tide_l2norm(tide_tensor *x, double eps, double scale)
{
    if (tide_check_float(x, "l2norm", "x")) return NULL;
    char a[128];
    TIDE_CHECK(x->ndim >= 1 && x->shape[x->ndim - 1] > 0, "l2norm: x must have a non-empty last dim, got %s", SHAPE_STR(x, a));
    TIDE_CHECK(eps >= 0 && isfinite(eps), "l2norm: eps must be >= 0 and finite, got %g", eps);
    TIDE_CHECK(isfinite(scale), "l2norm: scale must be finite, got %g", scale);
    tide_attrs at = {0};
    at.l2norm.eps = eps;
    at.l2norm.scale = scale;
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_L2NORM, 1, in, &at);
}

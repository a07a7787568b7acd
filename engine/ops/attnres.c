/* attnres.c — the Attention Residuals mix (spec/attnres.md §1, §4) as one graph node: inputs are the n
   sources, then w and nu; the output is the softmax-weighted sum of the RAW sources. The node saves the
   sources as aliases (no copies), w, nu and the per-row stats [2, n, rows] (probabilities, then the RMS
   factors r_i); the backward recomputes the scores from them. attr: attnres {n, eps}. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "../internal.h"

/* the stats are kept in fp32 for bf16 sources (the mix runs in fp32, §1) */
static int stats_dtype(int dtype) { return dtype == TIDE_BF16 ? TIDE_F32 : dtype; }

static void release_all(tide_tensor **t, int n)
{
    for (int i = 0; i < n; i++) { tide_tensor_release(t[i]); t[i] = NULL; }
}

/* saved: the stats, then the inputs in their order (n sources, w, nu) */
enum { ATTNRES_SAVED_STATS, ATTNRES_SAVED_INPUTS };

int tide_attnres_forward(tide_node *nd, tide_tensor **in, tide_tensor **out)
{
    int n = nd->attr.attnres.n;
    tide_tensor **c = calloc((size_t)n + 2, sizeof *c);
    const void **src = malloc((size_t)n * sizeof *src);
    tide_tensor *o = NULL, *stats = NULL;
    int rc = c && src ? 0 : tide_set_error("attnres: out of memory for %d sources", n);
    for (int i = 0; i < n + 2 && !rc; i++)
        if (!(c[i] = tide_contiguous_nograd(in[i]))) rc = -1;
    int64_t d = 0, rows = 0;
    if (!rc) {
        d = c[0]->shape[c[0]->ndim - 1];
        rows = c[0]->numel / d;
        int64_t sshape[3] = {2, n, rows};
        o = tide_empty_like(c[0]);
        stats = o ? tide_empty(stats_dtype(c[0]->dtype), 3, sshape, c[0]->device) : NULL;
        if (!stats) rc = -1;
    }
    if (!rc && rows > 0) {
        for (int i = 0; i < n; i++) src[i] = tide_data(c[i]);
        rc = TIDE_DISPATCH(c[0]->device, attnres, "attnres", c[0]->dtype, tide_data(o), tide_data(stats), src, n, rows,
                           d, tide_data(c[n]), tide_data(c[n + 1]), nd->attr.attnres.eps);
    }
    if (!rc) rc = tide_node_save(nd, stats);
    for (int i = 0; i < n + 2 && !rc; i++) rc = tide_node_save(nd, c[i]);
    if (c) release_all(c, n + 2);
    free(c);
    free(src);
    tide_tensor_release(stats);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_attnres_backward(tide_node *nd, tide_tensor **gout, tide_tensor **gin)
{
    int n = nd->attr.attnres.n;
    tide_tensor *stats = nd->saved[ATTNRES_SAVED_STATS], **sv = nd->saved + ATTNRES_SAVED_INPUTS, *w = sv[n], *nu = sv[n + 1];
    int64_t d = sv[0]->shape[sv[0]->ndim - 1], rows = sv[0]->numel / d;
    tide_tensor *go = tide_contiguous_nograd(gout[0]);
    tide_tensor **g = calloc((size_t)n + 2, sizeof *g);
    const void **src = malloc((size_t)n * sizeof *src);
    void **gsrc = malloc((size_t)n * sizeof *gsrc);
    int rc = go && g && src && gsrc ? 0 : -1;
    if (rc && go) tide_set_error("attnres backward: out of memory for %d sources", n);
    /* empty rows: the sums over rows of gw, gnu are zeros */
    for (int i = 0; i < n + 2 && !rc; i++)
        if (nd->in_needs_grad[i] &&
            !(g[i] = rows > 0 ? tide_empty_like(sv[i]) : tide_zeros(sv[i]->dtype, sv[i]->ndim, sv[i]->shape, sv[i]->device)))
            rc = -1;
    if (!rc && rows > 0) {
        for (int i = 0; i < n; i++) {
            src[i] = tide_data(sv[i]);
            gsrc[i] = g[i] ? tide_data(g[i]) : NULL;
        }
        rc = TIDE_DISPATCH(sv[0]->device, attnres_backward, "attnres", sv[0]->dtype, gsrc,
                           g[n] ? tide_data(g[n]) : NULL, g[n + 1] ? tide_data(g[n + 1]) : NULL, tide_data(go), src,
                           tide_data(stats), n, rows, d, tide_data(w), tide_data(nu));
    }
    tide_tensor_release(go);
    free(src);
    free(gsrc);
    if (!g) return -1;
    if (rc) { release_all(g, n + 2); free(g); return -1; }
    for (int i = 0; i < n + 2; i++) gin[i] = g[i];
    free(g);
    return 0;
}

tide_tensor *tide_attnres(int n, tide_tensor **sources, tide_tensor *w, tide_tensor *nu, double eps)
{
    const char *op = "attnres";
    TIDE_CHECK(n >= 1 && sources, "attnres: needs at least one source, got n = %d%s", n, sources ? "" : " (sources is NULL)");
    char a[128], b[128], e[64];
    for (int i = 0; i < n; i++)   /* the name formatted only for an error */
        if (!sources[i] || !tide_is_float(sources[i]->dtype)) {
            snprintf(e, sizeof e, "source %d", i);
            tide_check_float(sources[i], op, e);
            return NULL;
        }
    tide_tensor *v0 = sources[0];
    TIDE_CHECK(v0->ndim >= 1 && v0->shape[v0->ndim - 1] >= 1, "attnres: sources must be [..., d] with d >= 1, got %s",
               SHAPE_STR(v0, a));
    for (int i = 1; i < n; i++) {
        if (tide_check_same_device(v0, sources[i], op) || tide_check_same_dtype(v0, sources[i], op)) return NULL;
        TIDE_CHECK(tide_same_shape(v0, sources[i]), "attnres: source %d is %s but source 0 is %s: all sources need one shape",
                   i, SHAPE_STR(sources[i], a), SHAPE_STR(v0, b));
    }
    int64_t d = v0->shape[v0->ndim - 1];
    if (tide_check_float(w, op, "w") || tide_check_float(nu, op, "nu") || tide_check_same_device(v0, w, op) ||
        tide_check_same_device(v0, nu, op) || tide_check_same_dtype(v0, w, op) || tide_check_same_dtype(v0, nu, op))
        return NULL;
    TIDE_CHECK(w->ndim == 1 && w->shape[0] == d && nu->ndim == 1 && nu->shape[0] == d,
               "attnres: w is %s and nu is %s but both must be [d] = [%lld] (the last dim of the sources)", SHAPE_STR(w, a),
               SHAPE_STR(nu, b), (long long)d);
    TIDE_CHECK(eps >= 0 && isfinite(eps), "attnres: eps must be finite and >= 0, got %g", eps);
    tide_tensor **in = malloc(((size_t)n + 2) * sizeof *in);
    TIDE_CHECK(in, "attnres: out of memory for %d sources", n);
    for (int i = 0; i < n; i++) in[i] = sources[i];
    in[n] = w;
    in[n + 1] = nu;
    tide_attrs at = {0};
    at.attnres.n = n;
    at.attnres.eps = eps;
    tide_tensor *out = tide_op_run1(TIDE_OP_ATTNRES, n + 2, in, &at);
    free(in);
    return out;
}

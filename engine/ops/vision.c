/* vision.c — the position ops of the ViT encoder (spec/vision.md §4): 2D RoPE in the MoonViT adjacent-pair
   layout, whose backward is the inverse rotation, and the bicubic resampling of the learnable position table to
   each image's grid, whose backward applies the transposed weights. */
#include <math.h>
#include <stdlib.h>
#include "../internal.h"

/* vision.md §4: "Table limit 512 × 512 positions" */
#define ROPE2D_MAX_POS 512
/* a bound on one image's grid side, far above any budget (MoonViT: ~64 patches a side), so h·w·d cannot overflow */
#define POS_INTERP_MAX_SIDE 65536
/* the grids travel in the node's int list (an int count) */
#define POS_INTERP_MAX_IMAGES (1 << 24)

/* ---- rope2d ---------------------------------------------------------------------------------------------------- */
enum { ROPE2D_SAVED_POS };

static int rope2d_apply(tide_tensor *x, tide_tensor *pos, double theta, int inverse, tide_tensor **out)
{
    tide_tensor *c = tide_contiguous_nograd(x), *o = c ? tide_empty_like(c) : NULL;
    int rc = o ? 0 : -1;
    if (!rc && c->numel > 0)
        rc = TIDE_DISPATCH(c->device, rope2d, "rope2d", c->dtype, tide_data(o), tide_data(c), tide_data(pos), pos->dtype,
                           c->shape[0], c->shape[1], c->shape[2], theta, inverse);
    tide_tensor_release(c);
    if (rc) { tide_tensor_release(o); return -1; }
    *out = o;
    return 0;
}

int tide_rope2d_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *pos = tide_contiguous_nograd(in[1]);
    if (!pos) return -1;
    int rc = rope2d_apply(in[0], pos, n->attr.rope.theta, 0, &out[0]);
    if (!rc) rc = tide_node_save(n, pos);
    tide_tensor_release(pos);
    return rc;
}

/* a rotation's transpose is the rotation by −φ; positions get no gradient */
int tide_rope2d_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    return rope2d_apply(gout[0], n->saved[ROPE2D_SAVED_POS], n->attr.rope.theta, 1, &gin[0]);
}

tide_tensor *tide_rope2d(tide_tensor *x, tide_tensor *pos, double theta)
{
    if (tide_check_float(x, "rope2d", "x") || tide_check_index_dtype(pos, "rope2d", "pos")) return NULL;
    char a[128], b[128];
    TIDE_CHECK(x->ndim == 3 && x->shape[2] % 4 == 0 && x->shape[2] > 0,
               "rope2d: x must be [T, H, head_dim] with head_dim a multiple of 4, got %s", SHAPE_STR(x, a));
    TIDE_CHECK(pos->ndim == 2 && pos->shape[0] == x->shape[0] && pos->shape[1] == 2,
               "rope2d: pos must be [T, 2] (row, col) with T = %lld (x is %s), got %s", (long long)x->shape[0],
               SHAPE_STR(x, a), SHAPE_STR(pos, b));
    TIDE_CHECK(theta > 0 && isfinite(theta), "rope2d: theta must be positive, got %g", theta);
    /* the kernel reads pos on x's device */
    tide_tensor *p = pos->device == x->device ? (tide_tensor_retain(pos), pos) : tide_to_device(pos, x->device);
    tide_tensor *pc = p ? tide_contiguous_nograd(p) : NULL;
    tide_tensor_release(p);
    if (!pc) return NULL;
    if (pc->numel > 0) {
        int64_t bad = 0;
        int ok = 1;
        if (TIDE_DISPATCH(pc->device, check_index, "rope2d", "rope2d", tide_data(pc), pc->dtype, pc->numel, ROPE2D_MAX_POS,
                          0, &bad, &ok)) { tide_tensor_release(pc); return NULL; }
        if (!ok) {
            tide_tensor_release(pc);
            tide_set_error("rope2d: position %lld in pos %s is outside [0, %d) (the 2D RoPE table limit, vision.md §4)",
                           (long long)bad, SHAPE_STR(pos, b), ROPE2D_MAX_POS);
            return NULL;
        }
    }
    tide_attrs at = {0};
    at.rope.theta = theta;   /* the rope attributes; pos0 unused */
    tide_tensor *in[2] = {x, pc};
    tide_tensor *y = tide_op_run1(TIDE_OP_ROPE2D, 2, in, &at);
    tide_tensor_release(pc);
    return y;
}

/* ---- pos_interp ------------------------------------------------------------------------------------------------ */
/* attr.list: the grids (h_0, w_0, h_1, w_1, ...) */
static int64_t grids_tokens(const tide_node *n)
{
    int64_t L = 0;
    for (int i = 0; i + 1 < n->attr.n_list; i += 2) L += n->attr.list[i] * n->attr.list[i + 1];
    return L;
}

int tide_pos_interp_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    tide_tensor *t = tide_contiguous_nograd(in[0]);
    if (!t) return -1;
    int64_t shape[2] = {grids_tokens(n), t->shape[2]};
    tide_tensor *o = tide_empty(t->dtype, 2, shape, t->device);
    int rc = o ? 0 : -1;
    if (!rc && o->numel > 0)
        rc = TIDE_DISPATCH(t->device, pos_interp, "pos_interp", t->dtype, tide_data(o), tide_data(t), n->attr.list,
                           n->attr.n_list / 2, t->shape[0], t->shape[1], t->shape[2]);
    tide_tensor_release(t);
    if (rc) { tide_tensor_release(o); return -1; }
    out[0] = o;
    return 0;
}

int tide_pos_interp_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    const tide_meta *m = &n->in_meta[0];
    tide_tensor *g = tide_contiguous_nograd(gout[0]);
    tide_tensor *gt = g ? tide_empty(m->dtype, 3, m->shape, m->device) : NULL;
    int rc = gt ? 0 : -1;
    if (!rc && gt->numel > 0)
        rc = TIDE_DISPATCH(gt->device, pos_interp_backward, "pos_interp", gt->dtype, tide_data(gt), tide_data(g),
                           n->attr.list, n->attr.n_list / 2, m->shape[0], m->shape[1], m->shape[2]);
    tide_tensor_release(g);
    if (rc) { tide_tensor_release(gt); return -1; }
    gin[0] = gt;
    return 0;
}

tide_tensor *tide_pos_interp(tide_tensor *table, tide_tensor *grids)
{
    if (tide_check_float(table, "pos_interp", "table") || tide_check_index_dtype(grids, "pos_interp", "grids"))
        return NULL;
    char a[128], b[128];
    TIDE_CHECK(table->ndim == 3 && table->shape[0] > 0 && table->shape[1] > 0,
               "pos_interp: table must be [G, G, d], got %s", SHAPE_STR(table, a));
    TIDE_CHECK(grids->ndim == 2 && grids->shape[1] == 2, "pos_interp: grids must be [n, 2] (h, w) per image, got %s",
               SHAPE_STR(grids, b));
    int64_t n = grids->shape[0];
    TIDE_CHECK(n <= POS_INTERP_MAX_IMAGES, "pos_interp: grids %s has more than %d images", SHAPE_STR(grids, b),
               POS_INTERP_MAX_IMAGES);
    tide_attrs at = {0};
    if (n > 0) {
        double *v = malloc((size_t)(2 * n) * sizeof *v);
        at.list = malloc((size_t)(2 * n) * sizeof *at.list);
        if (!v || !at.list) { free(v); free(at.list); tide_set_error("pos_interp: out of memory"); return NULL; }
        if (tide_to_f64_buffer(grids, v, 2 * n)) { free(v); free(at.list); return NULL; }
        for (int64_t i = 0; i < 2 * n; i++) {
            if (!(v[i] >= 1 && v[i] <= POS_INTERP_MAX_SIDE)) {
                tide_set_error("pos_interp: image %lld of grids %s has %s %g, expected 1 .. %d", (long long)(i / 2),
                               SHAPE_STR(grids, b), i % 2 ? "w" : "h", v[i], POS_INTERP_MAX_SIDE);
                free(v); free(at.list);
                return NULL;
            }
            at.list[i] = (int64_t)v[i];
        }
        free(v);
        at.n_list = (int)(2 * n);
    }
    tide_tensor *in[1] = {table};
    tide_tensor *y = tide_op_run1(TIDE_OP_POS_INTERP, 1, in, &at);
    free(at.list);
    return y;
}

/* rope.c — rotary position embedding on [B, T, H, D]; the backward is the inverse rotation. */
#include <math.h>
#include "../internal.h"

/* ---- RoPE ---------------------------------------------------------------------------------------------------------- */
static int rope_apply(tide_tensor *x, double theta, int64_t pos0, int inverse, tide_tensor **out)
{
    tide_tensor *c = tide_contiguous_nograd(x), *o = c ? tide_empty_like(c) : NULL;
    int rc = o ? 0 : -1;
    if (!rc && c->numel > 0)
        rc = TIDE_DISPATCH(c->device, rope, "rope", c->dtype, tide_data(o), tide_data(c), c->shape[0], c->shape[1],
                           c->shape[2], c->shape[3], theta, pos0, inverse);
    tide_tensor_release(c);
    if (rc) { tide_tensor_release(o); return -1; }
    *out = o;
    return 0;
}

int tide_rope_forward(tide_node *n, tide_tensor **in, tide_tensor **out)
{
    return rope_apply(in[0], n->attr.rope.theta, n->attr.rope.pos0, 0, &out[0]);
}

int tide_rope_backward(tide_node *n, tide_tensor **gout, tide_tensor **gin)
{
    return rope_apply(gout[0], n->attr.rope.theta, n->attr.rope.pos0, 1, &gin[0]);
}

tide_tensor *tide_rope(tide_tensor *x, double theta, int64_t pos0)
{
    if (tide_check_float(x, "rope", "x")) return NULL;
    char a[128];
    TIDE_CHECK(x->ndim == 4 && x->shape[3] % 2 == 0, "rope: x must be [B, T, H, D] with D even, got %s", SHAPE_STR(x, a));
    TIDE_CHECK(theta > 0 && isfinite(theta), "rope: theta must be positive, got %g", theta);
    TIDE_CHECK(pos0 >= 0, "rope: pos0 must be >= 0, got %lld", (long long)pos0);
    tide_attrs at = {0};
    at.rope.pos0 = pos0;
    at.rope.theta = theta;
    tide_tensor *in[1] = {x};
    return tide_op_run1(TIDE_OP_ROPE, 1, in, &at);
}

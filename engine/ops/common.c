/* common.c — argument checks shared by every op (errors name the op, the argument and the values). */
#include <stdio.h>
#include "../internal.h"

int tide_check_tensor(const tide_tensor *t, const char *op, const char *arg)
{
    return t ? 0 : tide_set_error("%s: %s is NULL", op, arg);
}

int tide_check_float(const tide_tensor *t, const char *op, const char *arg)
{
    if (tide_check_tensor(t, op, arg)) return -1;
    if (!tide_is_float(t->dtype))
        return tide_set_error("%s: %s must be a float tensor (f32, f64, bf16), got %s", op, arg, tide_dtype_name(t->dtype));
    return 0;
}

int tide_check_index_dtype(const tide_tensor *t, const char *op, const char *arg)
{
    if (tide_check_tensor(t, op, arg)) return -1;
    if (t->dtype != TIDE_I32 && t->dtype != TIDE_I64)
        return tide_set_error("%s: %s must be an i32 or i64 tensor, got %s", op, arg, tide_dtype_name(t->dtype));
    return 0;
}

static const char *dev_name(int d, char *buf, size_t n)
{
    if (d == 0) snprintf(buf, n, "cpu"); else snprintf(buf, n, "cuda:%d", d - 1);
    return buf;
}

int tide_check_same_device(const tide_tensor *a, const tide_tensor *b, const char *op)
{
    if (a->device == b->device) return 0;
    char x[32], y[32];
    return tide_set_error("%s: tensors are on different devices (%s and %s)", op, dev_name(a->device, x, sizeof x),
                          dev_name(b->device, y, sizeof y));
}

int tide_check_same_dtype(const tide_tensor *a, const tide_tensor *b, const char *op)
{
    if (a->dtype == b->dtype) return 0;
    return tide_set_error("%s: dtypes differ (%s and %s)", op, tide_dtype_name(a->dtype), tide_dtype_name(b->dtype));
}

int tide_norm_dim(int dim, int ndim, const char *op, int *out)
{
    int d = dim < 0 ? dim + ndim : dim;
    if (d < 0 || d >= (ndim > 0 ? ndim : 1))
        return tide_set_error("%s: dim %d is out of range for a tensor with %d dims", op, dim, ndim);
    *out = d;
    return 0;
}

int tide_op_count(void) { return TIDE_OP_COUNT; }
const char *tide_op_name(int op) { return op >= 0 && op < TIDE_OP_COUNT ? tide_op_defs[op].name : NULL; }

/* common.c — argument checks shared by every op (errors name the op, the argument and the values). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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

int tide_check_same_device(const tide_tensor *a, const tide_tensor *b, const char *op)
{
    if (a->device == b->device) return 0;
    char x[32], y[32];
    return tide_set_error("%s: tensors are on different devices (%s and %s)", op, tide_device_str(a->device, x, sizeof x),
                          tide_device_str(b->device, y, sizeof y));
}

typedef struct { uintptr_t p; int i; } data_at;

static int by_data(const void *a, const void *b)
{
    const data_at *x = a, *y = b;
    return x->p != y->p ? (x->p < y->p ? -1 : 1) : (x->i > y->i) - (x->i < y->i);
}

int tide_check_distinct_data(tide_tensor *const *ts, int n, const char *op, const char *what, const char *need)
{
    if (n < 2) return 0;
    data_at *a = malloc((size_t)n * sizeof *a);
    if (!a) return tide_set_error("%s: out of memory for %d %s", op, n, what);
    for (int i = 0; i < n; i++) a[i] = (data_at){(uintptr_t)tide_data(ts[i]), i};
    qsort(a, (size_t)n, sizeof *a, by_data);
    int rc = 0;
    for (int k = 1; k < n && !rc; k++)
        if (a[k].p == a[k - 1].p)
            rc = tide_set_error("%s: %s[%d] and %s[%d] are the same memory: %s", op, what, a[k - 1].i, what, a[k].i, need);
    free(a);
    return rc;
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

/* the segment boundaries over B·T flattened tokens: the user's cu_seqlens (validated) merged with every
   row start, into at->list / at->n_list (malloc'd: the caller frees it after running the op) */
int tide_load_boundaries(const char *op, tide_tensor *cu, int64_t B, int64_t T, tide_attrs *at)
{
    int64_t n_user = 0;
    double *u = NULL;
    if (cu) {
        char a[128];
        if (!tide_is_int(cu->dtype) || cu->ndim != 1 || cu->shape[0] < 2)
            return tide_set_error("%s: cu_seqlens must be a 1-D integer tensor [n_docs + 1], got %s %s", op,
                                  tide_dtype_name(cu->dtype), tide_shape_str(cu->ndim, cu->shape, a, sizeof a));
        n_user = cu->shape[0];
        u = malloc((size_t)n_user * sizeof *u);
        if (!u) return tide_set_error("%s: out of memory", op);
        if (tide_to_f64_buffer(cu, u, n_user)) { free(u); return -1; }
        if (u[0] != 0 || u[n_user - 1] != (double)(B * T)) {
            int rc = tide_set_error("%s: cu_seqlens must start at 0 and end at B·T = %lld, got %g .. %g", op,
                                    (long long)(B * T), u[0], u[n_user - 1]);
            free(u);
            return rc;
        }
        for (int64_t i = 1; i < n_user; i++)
            if (!(u[i] > u[i - 1])) {
                int rc = tide_set_error("%s: cu_seqlens must be strictly increasing, got %g then %g at index %lld", op,
                                        u[i - 1], u[i], (long long)i);
                free(u);
                return rc;
            }
    }
    int64_t *list = malloc((size_t)(n_user + B + 1) * sizeof *list), n = 0;
    if (!list) { free(u); return tide_set_error("%s: out of memory", op); }
    int64_t iu = 0;
    for (int64_t b = 0; b <= B; b++) {
        int64_t rs = b * T;
        while (iu < n_user && (int64_t)u[iu] < rs) list[n++] = (int64_t)u[iu++];
        if (iu < n_user && (int64_t)u[iu] == rs) iu++;
        list[n++] = rs;
    }
    free(u);
    at->list = list;
    at->n_list = (int)n;
    return 0;
}

/*
 * tensor.c — tensors, storage, creation, explicit copies and in-place updates (DESIGN.md §3).
 * Nothing here reads tensor bytes: every data movement goes through the device's kernel table.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"

static int64_t g_live_tensors;

/* ---- dtypes ------------------------------------------------------------------------------------- */
/* sized by their initialisers: a dtype added to tide.h without a name and a size here fails the build */
static const char *const dtype_names[] = {[TIDE_F32] = "f32", [TIDE_F64] = "f64", [TIDE_BF16] = "bf16",
                                          [TIDE_I32] = "i32", [TIDE_I64] = "i64", [TIDE_U8] = "u8"};
static const size_t dtype_sizes[] = {[TIDE_F32] = 4, [TIDE_F64] = 8, [TIDE_BF16] = 2,
                                     [TIDE_I32] = 4, [TIDE_I64] = 8, [TIDE_U8] = 1};
_Static_assert(sizeof dtype_names / sizeof dtype_names[0] == TIDE_DTYPE_COUNT, "a name for every dtype");
_Static_assert(sizeof dtype_sizes / sizeof dtype_sizes[0] == TIDE_DTYPE_COUNT, "a size for every dtype");

const char *tide_dtype_name(int dtype) { return dtype >= 0 && dtype < TIDE_DTYPE_COUNT ? dtype_names[dtype] : NULL; }
size_t tide_dtype_size(int dtype) { return dtype >= 0 && dtype < TIDE_DTYPE_COUNT ? dtype_sizes[dtype] : 0; }
int tide_dtype_from_name(const char *name)
{
    if (!name) return -1;
    for (int i = 0; i < TIDE_DTYPE_COUNT; i++) if (!strcmp(name, dtype_names[i])) return i;
    if (!strcmp(name, "float32")) return TIDE_F32;
    if (!strcmp(name, "float64")) return TIDE_F64;
    if (!strcmp(name, "bfloat16")) return TIDE_BF16;
    if (!strcmp(name, "int32")) return TIDE_I32;
    if (!strcmp(name, "int64")) return TIDE_I64;
    if (!strcmp(name, "uint8")) return TIDE_U8;
    return -1;
}
int tide_is_float(int dtype) { return dtype == TIDE_F32 || dtype == TIDE_F64 || dtype == TIDE_BF16; }
int tide_is_int(int dtype) { return dtype == TIDE_I32 || dtype == TIDE_I64 || dtype == TIDE_U8; }

/* ---- devices ------------------------------------------------------------------------------------ */
static int check_device(int device, const char *op)
{
    if (!tide_backend_for(device)) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s: %s", op, tide_last_error());
        tide_set_error_str(msg);
        return -1;
    }
    return 0;
}

/* ---- storage ------------------------------------------------------------------------------------ */
struct tide_storage *tide_storage_new(int device, size_t nbytes)
{
    struct tide_storage *s = calloc(1, sizeof *s);
    if (!s) { tide_set_error("out of memory allocating a storage header"); return NULL; }
    s->data = tide_alloc_block(device, nbytes, &s->capacity);
    if (!s->data) { free(s); return NULL; }
    s->nbytes = nbytes;
    s->device = device;
    s->refcount = 1;
    return s;
}

void tide_storage_release(struct tide_storage *s)
{
    if (!s || --s->refcount > 0) return;
    tide_free_block(s->device, s->data, s->capacity, s->nbytes ? s->nbytes : 1);
    free(s);
}

void *tide_data(const tide_tensor *t)
{
    return (char *)t->storage->data + t->offset * (int64_t)tide_dtype_size(t->dtype);
}

const void *tide_tensor_storage_id(const tide_tensor *t) { return t && t->storage ? t->storage->data : NULL; }

/* ---- tensor structs ----------------------------------------------------------------------------- */
tide_tensor *tide_tensor_alloc_struct(void)
{
    tide_tensor *t = calloc(1, sizeof *t);
    if (!t) { tide_set_error("out of memory allocating a tensor header"); return NULL; }
    t->refcount = 1;
    g_live_tensors++;
    return t;
}

int64_t tide_live_tensors(void) { return g_live_tensors; }

void tide_tensor_retain(tide_tensor *t) { if (t) t->refcount++; }

void tide_tensor_release(tide_tensor *t)
{
    if (!t || --t->refcount > 0) return;
    tide_storage_release(t->storage);
    tide_tensor_release(t->grad);
    if (t->node) tide_node_release_internal(t->node);
    g_live_tensors--;
    free(t);
}

void tide_contiguous_strides(int ndim, const int64_t *shape, int64_t *stride)
{
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) { stride[i] = s; s *= shape[i] > 0 ? shape[i] : 1; }
}

int64_t tide_shape_numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    return n;
}

int tide_is_contiguous(const tide_tensor *t)
{
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

int64_t tide_tensor_nbytes(const tide_tensor *t) { return t->numel * (int64_t)tide_dtype_size(t->dtype); }

int tide_same_shape(const tide_tensor *a, const tide_tensor *b)
{
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++) if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

const char *tide_shape_str(int ndim, const int64_t *shape, char *buf, size_t n)
{
    size_t k = 0;
    k += snprintf(buf + k, n - k, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

static int check_shape(const char *op, int dtype, int ndim, const int64_t *shape)
{
    if (dtype < 0 || dtype >= TIDE_DTYPE_COUNT) return tide_set_error("%s: unknown dtype %d", op, dtype);
    if (ndim < 0 || ndim > TIDE_MAX_DIMS)
        return tide_set_error("%s: ndim must be in [0, %d], got %d", op, TIDE_MAX_DIMS, ndim);
    if (ndim > 0 && !shape) return tide_set_error("%s: shape is NULL", op);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return tide_set_error("%s: shape[%d] = %lld is negative", op, i, (long long)shape[i]);
        if (shape[i] > 0 && n > INT64_MAX / 16 / shape[i])
            return tide_set_error("%s: shape is too large (element count overflows)", op);
        n *= shape[i];
    }
    return 0;
}

tide_tensor *tide_empty(int dtype, int ndim, const int64_t *shape, int device)
{
    if (check_shape("empty", dtype, ndim, shape) || check_device(device, "empty")) return NULL;
    tide_tensor *t = tide_tensor_alloc_struct();
    if (!t) return NULL;
    t->dtype = dtype;
    t->device = device;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    tide_contiguous_strides(ndim, shape, t->stride);
    t->numel = tide_shape_numel(ndim, shape);
    t->storage = tide_storage_new(device, (size_t)t->numel * tide_dtype_size(dtype));
    if (!t->storage) { g_live_tensors--; free(t); return NULL; }
    return t;
}

tide_tensor *tide_empty_like(const tide_tensor *x) { return tide_empty(x->dtype, x->ndim, x->shape, x->device); }

tide_tensor *tide_view_of(const tide_tensor *x, int ndim, const int64_t *shape, const int64_t *stride,
                          int64_t offset)
{
    tide_tensor *t = tide_tensor_alloc_struct();
    if (!t) return NULL;
    t->dtype = x->dtype;
    t->device = x->device;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) { t->shape[i] = shape[i]; t->stride[i] = stride[i]; }
    t->numel = tide_shape_numel(ndim, shape);
    t->offset = offset;
    t->storage = x->storage;
    t->storage->refcount++;
    return t;
}

tide_tensor *tide_full(int dtype, int ndim, const int64_t *shape, int device, double value)
{
    tide_tensor *t = tide_empty(dtype, ndim, shape, device);
    if (!t) return NULL;
    if (tide_fill_(t, value)) { tide_tensor_release(t); return NULL; }
    return t;
}
tide_tensor *tide_zeros(int dtype, int ndim, const int64_t *shape, int device) { return tide_full(dtype, ndim, shape, device, 0.0); }
tide_tensor *tide_ones(int dtype, int ndim, const int64_t *shape, int device) { return tide_full(dtype, ndim, shape, device, 1.0); }

tide_tensor *tide_from_f64(int dtype, int ndim, const int64_t *shape, int device, const double *values)
{
    if (check_shape("from_table", dtype, ndim, shape)) return NULL;
    int64_t n = tide_shape_numel(ndim, shape);
    if (n > 0 && !values) { tide_set_error("from_table: values is NULL"); return NULL; }
    if (tide_is_int(dtype)) {
        for (int64_t i = 0; i < n; i++) {
            double v = values[i];
            if (v != floor(v) || !isfinite(v)) {
                tide_set_error("from_table: value %g at index %lld is not an integer (dtype %s)", v,
                               (long long)i, tide_dtype_name(dtype));
                return NULL;
            }
            if (dtype == TIDE_U8 && (v < 0 || v > 255)) {
                tide_set_error("from_table: value %g at index %lld does not fit u8", v, (long long)i);
                return NULL;
            }
            if (dtype == TIDE_I32 && (v < -2147483648.0 || v > 2147483647.0)) {
                tide_set_error("from_table: value %g at index %lld does not fit i32", v, (long long)i);
                return NULL;
            }
        }
    }
    /* stage as f64 on the CPU, then convert with the copy kernel on the target device */
    int64_t st[TIDE_MAX_DIMS];
    tide_contiguous_strides(ndim, shape, st);
    tide_tensor *src = tide_empty(TIDE_F64, ndim, shape, TIDE_CPU);
    if (!src) return NULL;
    if (n > 0 && tide_cpu_backend.memcpy_h2d(tide_data(src), values, (size_t)n * 8)) { tide_tensor_release(src); return NULL; }
    tide_tensor *t = tide_empty(dtype, ndim, shape, device);
    if (!t) { tide_tensor_release(src); return NULL; }
    if (tide_copy_(t, src)) { tide_tensor_release(src); tide_tensor_release(t); return NULL; }
    tide_tensor_release(src);
    return t;
}

tide_tensor *tide_from_bytes(int dtype, int ndim, const int64_t *shape, int device, const void *bytes, size_t nbytes)
{
    if (check_shape("from_bytes", dtype, ndim, shape)) return NULL;
    size_t need = (size_t)tide_shape_numel(ndim, shape) * tide_dtype_size(dtype);
    if (nbytes != need) {
        char b[128];
        tide_set_error("from_bytes: %s %s needs %zu bytes, got %zu", tide_dtype_name(dtype),
                       tide_shape_str(ndim, shape, b, sizeof b), need, nbytes);
        return NULL;
    }
    tide_tensor *t = tide_empty(dtype, ndim, shape, device);
    if (!t) return NULL;
    if (need > 0 && tide_write_bytes(t, bytes, need)) { tide_tensor_release(t); return NULL; }
    return t;
}

tide_tensor *tide_arange(int dtype, double start, double end, double step, int device)
{
    if (step == 0 || !isfinite(start) || !isfinite(end) || !isfinite(step)) {
        tide_set_error("arange: need finite start, end and a non-zero step (got %g, %g, %g)", start, end, step);
        return NULL;
    }
    double cnt = ceil((end - start) / step);
    int64_t n = cnt > 0 ? (int64_t)cnt : 0;
    if (n > ((int64_t)1 << 40)) { tide_set_error("arange: %lld elements is too many", (long long)n); return NULL; }
    double *v = malloc((size_t)(n ? n : 1) * sizeof(double));
    if (!v) { tide_set_error("arange: out of memory"); return NULL; }
    for (int64_t i = 0; i < n; i++) v[i] = start + (double)i * step;
    tide_tensor *t = tide_from_f64(dtype, 1, &n, device, v);
    free(v);
    return t;
}

/* ---- copies ------------------------------------------------------------------------------------- */
int tide_read_bytes(const tide_tensor *t, void *out, size_t nbytes)
{
    if (!t) return tide_set_error("read_bytes: tensor is NULL");
    if (nbytes != (size_t)tide_tensor_nbytes(t))
        return tide_set_error("read_bytes: tensor holds %lld bytes, buffer is %zu", (long long)tide_tensor_nbytes(t), nbytes);
    if (nbytes == 0) return 0;
    tide_tensor *c = tide_contiguous_nograd((tide_tensor *)t);
    if (!c) return -1;
    int rc = TIDE_DISPATCH(c->device, memcpy_d2h, "read_bytes", out, tide_data(c), nbytes);
    tide_tensor_release(c);
    return rc;
}

int tide_write_bytes(tide_tensor *t, const void *bytes, size_t nbytes)
{
    if (!t) return tide_set_error("write_bytes: tensor is NULL");
    if (!tide_is_contiguous(t)) return tide_set_error("write_bytes: tensor must be contiguous");
    if (nbytes != (size_t)tide_tensor_nbytes(t))
        return tide_set_error("write_bytes: tensor holds %lld bytes, buffer is %zu", (long long)tide_tensor_nbytes(t), nbytes);
    if (nbytes == 0) return 0;
    return TIDE_DISPATCH(t->device, memcpy_h2d, "write_bytes", tide_data(t), bytes, nbytes);
}

/* ---- floats handed to a front end ------------------------------------------------------------------
 * Every double the engine writes for a front end is canonical: a NaN becomes the one quiet NaN (+NaN, the
 * bits 0x7FF8000000000000). LuaJIT keeps its values in the NaN space of a double, and some GC64 builds pass an
 * FFI double with an unusual payload (0xFFEC0001 words, all ones) to Lua unchanged, where it reads as nil, a
 * string or a pointer: a NaN weight then crashed the interpreter instead of tripping the non-finite guard. */
static double canon_f64(double v) { return isnan(v) ? (double)NAN : v; }

void tide_canon_f64_buffer(double *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++) p[i] = canon_f64(p[i]);
}
double tide_canon_f64(const double *p, int64_t i) { return canon_f64(p[i]); }
double tide_canon_f32(const float *p, int64_t i) { return canon_f64((double)p[i]); }

int tide_to_f64_buffer(const tide_tensor *t, double *out, int64_t n)
{
    if (!t) return tide_set_error("to_table: tensor is NULL");
    if (n != t->numel) return tide_set_error("to_table: tensor has %lld elements, buffer %lld", (long long)t->numel, (long long)n);
    if (n == 0) return 0;
    tide_tensor *c = tide_empty(TIDE_F64, t->ndim, t->shape, TIDE_CPU);
    if (!c) return -1;
    int rc = tide_copy_(c, t);
    if (!rc) {
        memcpy(out, c->storage->data, (size_t)n * 8);   /* CPU f64 staging buffer we own */
        tide_canon_f64_buffer(out, n);
    }
    tide_tensor_release(c);
    return rc;
}

double tide_item(const tide_tensor *t)
{
    if (!t) { tide_set_error("item: tensor is NULL"); return NAN; }
    if (t->numel != 1) {
        char b[128];
        tide_set_error("item: tensor must have exactly one element, shape is %s", tide_shape_str(t->ndim, t->shape, b, sizeof b));
        return NAN;
    }
    double v = NAN;
    if (tide_to_f64_buffer(t, &v, 1)) return NAN;
    return v;
}

/* copy between devices goes through a contiguous host staging tensor */
int tide_copy_(tide_tensor *dst, const tide_tensor *src)
{
    if (!dst || !src) return tide_set_error("copy_: tensor is NULL");
    if (!tide_same_shape(dst, src)) {
        char a[128], b[128];
        return tide_set_error("copy_: dst is %s but src is %s", tide_shape_str(dst->ndim, dst->shape, a, sizeof a),
                              tide_shape_str(src->ndim, src->shape, b, sizeof b));
    }
    if (dst->numel == 0) return 0;
    if (dst->device == src->device) {
        return TIDE_DISPATCH(dst->device, copy, "copy_", tide_data(dst), dst->dtype, dst->stride, tide_data(src),
                             src->dtype, src->stride, dst->ndim, dst->shape);
    }
    /* cross-device: make src contiguous on its device, move bytes, convert on the destination */
    tide_tensor *c = tide_contiguous_nograd((tide_tensor *)src);
    if (!c) return -1;
    tide_tensor *stage = tide_empty(src->dtype, src->ndim, src->shape, dst->device);
    if (!stage) { tide_tensor_release(c); return -1; }
    size_t nb = (size_t)tide_tensor_nbytes(c);
    int rc;
    if (c->device == TIDE_CPU) {
        rc = TIDE_DISPATCH(dst->device, memcpy_h2d, "copy_", tide_data(stage), tide_data(c), nb);
    } else if (dst->device == TIDE_CPU) {
        rc = TIDE_DISPATCH(c->device, memcpy_d2h, "copy_", tide_data(stage), tide_data(c), nb);
    } else {   /* device to device through the host */
        void *h = malloc(nb);
        rc = h ? TIDE_DISPATCH(c->device, memcpy_d2h, "copy_", h, tide_data(c),
                               nb) : tide_set_error("copy_: out of memory");
        if (!rc) rc = TIDE_DISPATCH(dst->device, memcpy_h2d, "copy_", tide_data(stage), h, nb);
        free(h);
    }
    if (!rc) rc = tide_copy_(dst, stage);
    tide_tensor_release(stage);
    tide_tensor_release(c);
    return rc;
}

tide_tensor *tide_contiguous_nograd(tide_tensor *x)
{
    if (tide_is_contiguous(x)) { tide_tensor_retain(x); return x; }
    tide_tensor *c = tide_empty(x->dtype, x->ndim, x->shape, x->device);
    if (!c) return NULL;
    if (tide_copy_(c, x)) { tide_tensor_release(c); return NULL; }
    return c;
}

/* ---- in-place updates --------------------------------------------------------------------------- */
static int inplace_target(tide_tensor *t, const char *op, int need_float)
{
    if (!t) return tide_set_error("%s: tensor is NULL", op);
    if (need_float && !tide_is_float(t->dtype))
        return tide_set_error("%s: needs a float tensor, got %s", op, tide_dtype_name(t->dtype));
    return tide_backend_for(t->device) ? 0 : -1;
}

/* run f on a contiguous version of t and write back when t is a strided view */
typedef int (*inplace_fn)(tide_tensor *c, void *ctx);
static int apply_inplace(tide_tensor *t, inplace_fn f, void *ctx)
{
    if (tide_is_contiguous(t)) return f(t, ctx);
    tide_tensor *c = tide_contiguous_nograd(t);
    if (!c) return -1;
    int rc = f(c, ctx);
    if (!rc) rc = tide_copy_(t, c);
    tide_tensor_release(c);
    return rc;
}

static int do_fill(tide_tensor *c, void *ctx)
{
    return TIDE_DISPATCH(c->device, fill, "fill_", tide_data(c), c->dtype, c->numel, *(double *)ctx);
}
int tide_fill_(tide_tensor *t, double value)
{
    if (inplace_target(t, "fill_", 0)) return -1;
    if (t->numel == 0) return 0;
    return apply_inplace(t, do_fill, &value);
}

typedef struct { int normal; double a, b; uint64_t seed, offset; } rand_ctx;
static int do_rand(tide_tensor *c, void *ctx)
{
    rand_ctx *r = ctx;
    if (r->normal) return TIDE_DISPATCH(c->device, randn, "randn_", tide_data(c), c->dtype, c->numel, r->seed,
                                        r->offset, r->a, r->b);
    return TIDE_DISPATCH(c->device, rand, "rand_", tide_data(c), c->dtype, c->numel, r->seed, r->offset, r->a, r->b);
}
static int rand_fill(tide_tensor *t, int normal, double a, double b)
{
    if (inplace_target(t, normal ? "randn_" : "rand_", 1)) return -1;
    rand_ctx r = {normal, a, b, 0, 0};
    r.offset = tide_rng_take((uint64_t)t->numel, &r.seed);
    if (t->numel == 0) return 0;
    return apply_inplace(t, do_rand, &r);
}
int tide_randn_(tide_tensor *t, double mean, double std) { return rand_fill(t, 1, mean, std); }
int tide_rand_(tide_tensor *t, double lo, double hi) { return rand_fill(t, 0, lo, hi); }

tide_tensor *tide_randn(int dtype, int ndim, const int64_t *shape, int device, double mean, double std)
{
    tide_tensor *t = tide_empty(dtype, ndim, shape, device);
    if (t && tide_randn_(t, mean, std)) { tide_tensor_release(t); return NULL; }
    return t;
}
tide_tensor *tide_rand(int dtype, int ndim, const int64_t *shape, int device, double lo, double hi)
{
    tide_tensor *t = tide_empty(dtype, ndim, shape, device);
    if (t && tide_rand_(t, lo, hi)) { tide_tensor_release(t); return NULL; }
    return t;
}

static int do_scale(tide_tensor *c, void *ctx)
{
    return TIDE_DISPATCH(c->device, unary, "scale_", TIDE_UN_MUL_SCALAR, c->dtype, tide_data(c), tide_data(c), c->numel,
                         *(double *)ctx);
}
int tide_scale_(tide_tensor *t, double s)
{
    if (inplace_target(t, "scale_", 1)) return -1;
    if (t->numel == 0) return 0;
    return apply_inplace(t, do_scale, &s);
}

typedef struct { double a; tide_tensor *x; } axpy_ctx;
static int do_axpy(tide_tensor *c, void *ctx)
{
    axpy_ctx *a = ctx;
    return TIDE_DISPATCH(c->device, axpy, "axpy_", c->dtype, tide_data(c), a->a, tide_data(a->x), c->numel);
}
int tide_axpy_(tide_tensor *y, double a, const tide_tensor *x)
{
    if (inplace_target(y, "axpy_", 1)) return -1;
    if (!x) return tide_set_error("axpy_: x is NULL");
    if (!tide_same_shape(x, y)) {
        char s1[128], s2[128];
        return tide_set_error("axpy_: y is %s but x is %s", tide_shape_str(y->ndim, y->shape, s1, sizeof s1),
                              tide_shape_str(x->ndim, x->shape, s2, sizeof s2));
    }
    if (y->numel == 0) return 0;
    /* x as it is when it is already contiguous on y's device in y's dtype and shares no storage with y (a gradient
       added into a leaf's, at every micro-batch after the first), else brought there by a copy */
    tide_tensor *xc;
    int rc = 0;
    if (tide_is_contiguous(x) && x->dtype == y->dtype && x->device == y->device && x->storage != y->storage) {
        xc = (tide_tensor *)x;
        tide_tensor_retain(xc);
    } else {
        xc = tide_empty(y->dtype, y->ndim, y->shape, y->device);
        if (!xc) return -1;
        rc = tide_copy_(xc, x);
    }
    axpy_ctx ctx = {a, xc};
    if (!rc) rc = apply_inplace(y, do_axpy, &ctx);
    tide_tensor_release(xc);
    return rc;
}

int tide_sum_squares(const tide_tensor *t, double *out)
{
    if (inplace_target((tide_tensor *)t, "sum_squares", 1)) return -1;
    *out = 0;
    if (t->numel == 0) return 0;
    tide_tensor *c = tide_contiguous_nograd((tide_tensor *)t);
    if (!c) return -1;
    int rc = TIDE_DISPATCH(c->device, sum_squares, "sum_squares", c->dtype, tide_data(c), c->numel, out);
    tide_tensor_release(c);
    *out = canon_f64(*out);
    return rc;
}

int tide_all_finite(const tide_tensor *t)
{
    if (!t) return tide_set_error("all_finite: tensor is NULL");
    if (!tide_is_float(t->dtype) || t->numel == 0) return 1;
    tide_tensor *c = tide_contiguous_nograd((tide_tensor *)t);
    if (!c) return -1;
    int ok = 0;
    int rc = TIDE_DISPATCH(c->device, all_finite, "all_finite", c->dtype, tide_data(c), c->numel, &ok);
    tide_tensor_release(c);
    return rc ? -1 : ok;
}

/* the tensors of one device (in list order) in one backend call; non-contiguous ones through a copy */
static int first_nonfinite_on(int device, tide_tensor *const *ts, int n, int *first)
{
    int *dtypes = malloc((size_t)n * sizeof *dtypes), *where = malloc((size_t)n * sizeof *where);
    const void **ptrs = malloc((size_t)n * sizeof *ptrs);
    int64_t *lens = malloc((size_t)n * sizeof *lens);
    tide_tensor **held = calloc((size_t)n, sizeof *held);
    int rc = -1, m = 0, found = n;
    if (!dtypes || !where || !ptrs || !lens || !held) {
        tide_set_error("first_nonfinite: out of memory for %d tensors", n);
        goto done;
    }
    for (int i = 0; i < n; i++) {
        const tide_tensor *t = ts[i];
        if (!t || t->device != device || !tide_is_float(t->dtype) || t->numel == 0) continue;
        if (!(held[m] = tide_contiguous_nograd((tide_tensor *)t))) goto done;
        dtypes[m] = t->dtype, ptrs[m] = tide_data(held[m]), lens[m] = t->numel, where[m++] = i;
    }
    int k = m;
    if (m && TIDE_DISPATCH(device, first_nonfinite, "first_nonfinite", m, dtypes, ptrs, lens, &k)) goto done;
    if (k < m) found = where[k];
    rc = 0;
done:
    for (int i = 0; held && i < m; i++) tide_tensor_release(held[i]);
    free(dtypes), free(where), free(ptrs), free(lens), free(held);
    *first = found;
    return rc;
}

int tide_first_nonfinite(tide_tensor *const *ts, int n, int *first)
{
    if (!first) return tide_set_error("first_nonfinite: first is NULL");
    *first = n;
    if (n < 0 || (n > 0 && !ts)) return tide_set_error("first_nonfinite: %d tensors at %p", n, (const void *)ts);
    /* one call per distinct device (a process sees a handful); the smallest index wins */
    int devs[16], nd = 0;
    for (int i = 0; i < n; i++) {
        if (!ts[i]) continue;
        int d = 0;
        while (d < nd && devs[d] != ts[i]->device) d++;
        if (d < nd) continue;
        if (nd == 16) return tide_set_error("first_nonfinite: tensors on more than 16 devices");
        devs[nd++] = ts[i]->device;
    }
    for (int d = 0; d < nd; d++) {
        int f = n;
        if (first_nonfinite_on(devs[d], ts, n, &f)) return -1;
        if (f < *first) *first = f;
    }
    return 0;
}

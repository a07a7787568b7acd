/*
 * reduce.c — reductions over the middle axis of a contiguous [outer, red, inner] buffer -> [outer, inner]
 * (sum, max, argmax, logsumexp) and the gradient of max; and the whole-buffer sum of squares and finiteness check
 * (kernels/backend.h).
 *
 * Work is cut into items (o, block of up to RED_BLOCK inner positions). An item walks r in order and
 * reads RED_BLOCK neighbouring elements per r, so inner > 1 stays cache friendly, and each output is
 * produced by one thread in a fixed order: results do not depend on the thread count.
 * Sums accumulate in double. Max treats NaN as the largest value, so a NaN in a row propagates.
 */
#include <stdlib.h>
#include <tgmath.h>
#include "cpu.h"

#define RED_BLOCK 64
#define PAR_MIN 32768

/* v replaces the running max m when larger, or when v is the first NaN */
#define BEATS(v, m) ((v) > (m) || ((v) != (v) && (m) == (m)))

#define REDUCE_KERNELS(T)                                                                          \
    static void reduce_item_##T(int op, void *out, const T *x, int64_t o, int64_t i0, int len,     \
                                int64_t red, int64_t inner)                                        \
    {                                                                                              \
        const T *base = x + o * red * inner + i0;                                                  \
        T m[RED_BLOCK];                                                                            \
        int64_t arg[RED_BLOCK];                                                                    \
        double acc[RED_BLOCK];                                                                     \
        if (op == TIDE_RED_SUM) {                                                                  \
            for (int j = 0; j < len; j++) acc[j] = 0.0;                                            \
            for (int64_t r = 0; r < red; r++)                                                      \
                for (int j = 0; j < len; j++) acc[j] += (double)base[r * inner + j];               \
            T *y = (T *)out + o * inner + i0;                                                      \
            for (int j = 0; j < len; j++) y[j] = (T)acc[j];                                        \
            return;                                                                                \
        }                                                                                          \
        /* max / argmax / logsumexp all start from the first-max scan (red >= 1 here) */           \
        for (int j = 0; j < len; j++) { m[j] = base[j]; arg[j] = 0; }                              \
        for (int64_t r = 1; r < red; r++)                                                          \
            for (int j = 0; j < len; j++) {                                                        \
                T v = base[r * inner + j];                                                         \
                if (BEATS(v, m[j])) { m[j] = v; arg[j] = r; }                                      \
            }                                                                                      \
        if (op == TIDE_RED_MAX) {                                                                  \
            T *y = (T *)out + o * inner + i0;                                                      \
            for (int j = 0; j < len; j++) y[j] = m[j];                                             \
        } else if (op == TIDE_RED_ARGMAX) {                                                        \
            int64_t *y = (int64_t *)out + o * inner + i0;                                          \
            for (int j = 0; j < len; j++) y[j] = arg[j];                                           \
        } else {                                                                                   \
            /* logsumexp = m + log sum exp(x - m); m = ±inf or NaN is the answer itself */         \
            for (int j = 0; j < len; j++) acc[j] = 0.0;                                            \
            for (int64_t r = 0; r < red; r++)                                                      \
                for (int j = 0; j < len; j++)                                                      \
                    acc[j] += (double)exp(base[r * inner + j] - m[j]);                             \
            T *y = (T *)out + o * inner + i0;                                                      \
            for (int j = 0; j < len; j++)                                                          \
                y[j] = isfinite(m[j]) ? (T)((double)m[j] + log(acc[j])) : m[j];                    \
        }                                                                                          \
    }                                                                                              \
    /* gx = gy at the first r attaining the max (same scan as reduce), 0 elsewhere */              \
    static void max_backward_item_##T(T *gx, const T *gy, const T *x, int64_t o, int64_t i0,       \
                                      int len, int64_t red, int64_t inner)                         \
    {                                                                                              \
        const T *base = x + o * red * inner + i0;                                                  \
        T *gbase = gx + o * red * inner + i0;                                                      \
        T m[RED_BLOCK];                                                                            \
        int64_t arg[RED_BLOCK];                                                                    \
        for (int j = 0; j < len; j++) { m[j] = base[j]; arg[j] = 0; }                              \
        for (int64_t r = 1; r < red; r++)                                                          \
            for (int j = 0; j < len; j++) {                                                        \
                T v = base[r * inner + j];                                                         \
                if (BEATS(v, m[j])) { m[j] = v; arg[j] = r; }                                      \
            }                                                                                      \
        const T *g = gy + o * inner + i0;                                                          \
        for (int64_t r = 0; r < red; r++)                                                          \
            for (int j = 0; j < len; j++) gbase[r * inner + j] = r == arg[j] ? g[j] : (T)0;        \
    }

REDUCE_KERNELS(float)
REDUCE_KERNELS(double)

#define NAME_OF(ID, name) [TIDE_RED_##ID] = #name,
static const char *const reduce_names[] = {TIDE_REDUCE_OPS(NAME_OF)};
#undef NAME_OF
_Static_assert(sizeof reduce_names / sizeof reduce_names[0] == TIDE_RED_COUNT, "one name per reduce op");

static int check_sizes(const char *what, int64_t outer, int64_t red, int64_t inner)
{
    if (outer < 0 || red < 0 || inner < 0)
        return tide_set_error("%s: sizes outer = %lld, red = %lld, inner = %lld must be >= 0", what,
                              (long long)outer, (long long)red, (long long)inner);
    return 0;
}

int tide_cpu_reduce(int op, int dtype, void *out, const void *x, int64_t outer, int64_t red, int64_t inner)
{
    if (op < 0 || op >= TIDE_RED_COUNT)
        return tide_set_error("reduce: op %d out of range [0, %d)", op, TIDE_RED_COUNT);
    const char *name = reduce_names[op];
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("reduce %s: dtype %s not supported on cpu (expected f32 or f64)", name, tide_cpu_dtype_str(dtype));
    if (check_sizes("reduce", outer, red, inner)) return -1;
    int64_t n_out = outer * inner;
    if (red == 0) {
        /* the empty sum is 0 and the empty logsumexp is log 0 = -inf; an empty max has no value */
        if (op == TIDE_RED_MAX || op == TIDE_RED_ARGMAX)
            return tide_set_error("reduce %s: the reduced axis is empty (red = 0)", name);
        double v = op == TIDE_RED_SUM ? 0.0 : -INFINITY;
        for (int64_t k = 0; k < n_out; k++) {
            if (dtype == TIDE_F32) ((float *)out)[k] = (float)v;
            else ((double *)out)[k] = v;
        }
        return 0;
    }
    if (op == TIDE_RED_SUM && inner == 1) {
        /* a sum over each contiguous row (the last dim): one plain loop per row instead of an item of one position;
           the same sum (in double, r in order) as reduce_item's. A router's [2048, 2] weight sum took 35 us */
        #pragma omp parallel for if(outer * red > PAR_MIN) schedule(static)
        for (int64_t o = 0; o < outer; o++) {
            double acc = 0.0;
            if (dtype == TIDE_F32) {
                const float *xr = (const float *)x + o * red;
                for (int64_t r = 0; r < red; r++) acc += (double)xr[r];
                ((float *)out)[o] = (float)acc;
            } else {
                const double *xr = (const double *)x + o * red;
                for (int64_t r = 0; r < red; r++) acc += xr[r];
                ((double *)out)[o] = acc;
            }
        }
        return 0;
    }
    int64_t nblk = (inner + RED_BLOCK - 1) / RED_BLOCK;
    #pragma omp parallel for if(outer * red * inner > PAR_MIN) schedule(static)
    for (int64_t w = 0; w < outer * nblk; w++) {
        int64_t o = w / nblk, i0 = (w % nblk) * RED_BLOCK;
        int len = (int)(inner - i0 < RED_BLOCK ? inner - i0 : RED_BLOCK);
        if (dtype == TIDE_F32) reduce_item_float(op, out, x, o, i0, len, red, inner);
        else reduce_item_double(op, out, x, o, i0, len, red, inner);
    }
    return 0;
}

int tide_cpu_reduce_max_backward(int dtype, void *gx, const void *gy, const void *x, const void *y,
                                 int64_t outer, int64_t red, int64_t inner)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("reduce_max_backward: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    if (check_sizes("reduce_max_backward", outer, red, inner)) return -1;
    if (red == 0) return 0;
    int64_t nblk = (inner + RED_BLOCK - 1) / RED_BLOCK;
    #pragma omp parallel for if(outer * red * inner > PAR_MIN) schedule(static)
    for (int64_t w = 0; w < outer * nblk; w++) {
        int64_t o = w / nblk, i0 = (w % nblk) * RED_BLOCK;
        int len = (int)(inner - i0 < RED_BLOCK ? inner - i0 : RED_BLOCK);
        if (dtype == TIDE_F32) max_backward_item_float(gx, gy, x, o, i0, len, red, inner);
        else max_backward_item_double(gx, gy, x, o, i0, len, red, inner);
    }
    return 0;
}

/* ---- whole-buffer reductions: sum of squares (gradient norms) and finiteness --------------------------- */

/* Partial sums over fixed blocks, added in block order: the result does not depend on the thread
   count, so a gradient norm (and every step that uses it) is reproducible across machines. */
#define SSQ_MAX_BLOCKS 256
#define SSQ_MIN_BLOCK 4096

int tide_cpu_sum_squares(int dtype, const void *x, int64_t n, double *out)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("sum_squares: dtype %s not supported on cpu (expected f32, f64 or bf16)", tide_cpu_dtype_str(dtype));
    if (n < 0) return tide_set_error("sum_squares: n = %lld must be >= 0", (long long)n);
    int64_t blk = (n + SSQ_MAX_BLOCKS - 1) / SSQ_MAX_BLOCKS;
    if (blk < SSQ_MIN_BLOCK) blk = SSQ_MIN_BLOCK;
    int64_t nblk = (n + blk - 1) / blk;
    double part[SSQ_MAX_BLOCKS];
    #pragma omp parallel for if(n > PAR_MIN) schedule(static)
    for (int64_t k = 0; k < nblk; k++) {
        int64_t i0 = k * blk, i1 = i0 + blk < n ? i0 + blk : n;
        double acc = 0.0;
        if (dtype == TIDE_F32) {
            const float *p = x;
            for (int64_t i = i0; i < i1; i++) acc += (double)p[i] * (double)p[i];
        } else if (dtype == TIDE_F64) {
            const double *p = x;
            for (int64_t i = i0; i < i1; i++) acc += p[i] * p[i];
        } else {
            const uint16_t *p = x;
            for (int64_t i = i0; i < i1; i++) { double v = tide_cpu_bf16_to_f32(p[i]); acc += v * v; }
        }
        part[k] = acc;
    }
    double s = 0.0;
    for (int64_t k = 0; k < nblk; k++) s += part[k];
    *out = s;
    return 0;
}

int tide_cpu_all_finite(int dtype, const void *x, int64_t n, int *out)
{
    int ok = 1;
    switch (dtype) {
    case TIDE_F32: {
        const float *p = x;
        #pragma omp parallel for if(n > PAR_MIN) reduction(&&:ok) schedule(static)
        for (int64_t i = 0; i < n; i++) ok = ok && isfinite(p[i]);
        break;
    }
    case TIDE_F64: {
        const double *p = x;
        #pragma omp parallel for if(n > PAR_MIN) reduction(&&:ok) schedule(static)
        for (int64_t i = 0; i < n; i++) ok = ok && isfinite(p[i]);
        break;
    }
    case TIDE_BF16: {
        /* exponent bits all ones = inf or NaN */
        const uint16_t *p = x;
        #pragma omp parallel for if(n > PAR_MIN) reduction(&&:ok) schedule(static)
        for (int64_t i = 0; i < n; i++) ok = ok && (p[i] & 0x7f80u) != 0x7f80u;
        break;
    }
    case TIDE_I32: case TIDE_I64: case TIDE_U8:
        break;   /* integers are always finite */
    default:
        return tide_set_error("all_finite: dtype %d is not a tide dtype", dtype);
    }
    *out = ok;
    return 0;
}

/* ---- first non-finite buffer of many ------------------------------------------------------------
   The buffers are cut into chunks of FN_CHUNK elements and the chunks of all of them are shared by the
   threads at once (a model's many small weights cost one parallel region, not one each). The test is on
   the bits: an all-ones exponent is an infinity or a NaN, whatever the payload. */
#define FN_CHUNK 65536

static int chunk_nonfinite(int dtype, const void *x, int64_t off, int64_t len)
{
    int bad = 0;
    switch (dtype) {
    case TIDE_F32: {
        const uint32_t *p = (const uint32_t *)x + off;
        for (int64_t i = 0; i < len; i++) bad |= (p[i] & 0x7f800000u) == 0x7f800000u;
        break;
    }
    case TIDE_F64: {
        const uint64_t *p = (const uint64_t *)x + off;
        for (int64_t i = 0; i < len; i++) bad |= (p[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
        break;
    }
    case TIDE_BF16: {
        const uint16_t *p = (const uint16_t *)x + off;
        for (int64_t i = 0; i < len; i++) bad |= (p[i] & 0x7f80u) == 0x7f80u;
        break;
    }
    default:
        break;   /* integers are always finite */
    }
    return bad;
}

int tide_cpu_first_nonfinite(int n, const int *dtypes, const void *const *ptrs, const int64_t *lens, int *first)
{
    if (n < 0) return tide_set_error("first_nonfinite: n = %d must be >= 0", n);
    int64_t nchunks = 0;
    for (int i = 0; i < n; i++) {
        if (lens[i] < 0) return tide_set_error("first_nonfinite: buffer %d has %lld elements", i, (long long)lens[i]);
        if (dtypes[i] != TIDE_F32 && dtypes[i] != TIDE_F64 && dtypes[i] != TIDE_BF16 && dtypes[i] != TIDE_I32 &&
            dtypes[i] != TIDE_I64 && dtypes[i] != TIDE_U8)
            return tide_set_error("first_nonfinite: buffer %d: dtype %d is not a tide dtype", i, dtypes[i]);
        if (lens[i] > 0 && !ptrs[i]) return tide_set_error("first_nonfinite: buffer %d is NULL", i);
        nchunks += (lens[i] + FN_CHUNK - 1) / FN_CHUNK;
    }
    /* chunk c of the whole list: buffer idx[c], elements [off[c], off[c] + FN_CHUNK) */
    int *idx = malloc((size_t)(nchunks ? nchunks : 1) * sizeof *idx);
    int64_t *off = malloc((size_t)(nchunks ? nchunks : 1) * sizeof *off);
    if (!idx || !off) {
        free(idx);
        free(off);
        return tide_set_error("first_nonfinite: out of memory for %lld chunks", (long long)nchunks);
    }
    int64_t c = 0;
    for (int i = 0; i < n; i++)
        for (int64_t o = 0; o < lens[i]; o += FN_CHUNK) idx[c] = i, off[c++] = o;
    int best = n;
    #pragma omp parallel for if(nchunks > 1) schedule(dynamic, 4) reduction(min : best)
    for (int64_t k = 0; k < nchunks; k++) {
        int i = idx[k];
        if (i >= best) continue;   /* an earlier buffer already failed in this thread */
        int64_t len = lens[i] - off[k] < FN_CHUNK ? lens[i] - off[k] : FN_CHUNK;
        if (chunk_nonfinite(dtypes[i], ptrs[i], off[k], len)) best = i;
    }
    free(idx);
    free(off);
    *first = best;
    return 0;
}

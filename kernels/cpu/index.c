/*
 * index.c — index_select / index_add (rows of a middle axis), gather / scatter_add (per element along
 * a middle axis) and the index range check (kernels/backend.h).
 *
 * Every index is checked before anything is written, so a bad index leaves the output untouched.
 * The accumulating kernels (index_add, scatter_add) give each output element to one thread and add
 * in index order: duplicate indices are safe and the sums do not depend on the thread count.
 */
#include <string.h>
#include "cpu.h"

#define PAR_MIN 32768
#define ADD_BLOCK 256       /* inner elements per work item in index_add */

static inline int64_t idx_at(const void *idx, int idx_dtype, int64_t k)
{
    return idx_dtype == TIDE_I32 ? (int64_t)((const int32_t *)idx)[k] : ((const int64_t *)idx)[k];
}

static int check_idx_dtype(const char *what, int idx_dtype)
{
    if (idx_dtype != TIDE_I32 && idx_dtype != TIDE_I64)
        return tide_set_error("%s: index dtype %s not supported (expected i32 or i64)", what, tide_cpu_dtype_str(idx_dtype));
    return 0;
}

/* first position k with idx[k] outside [0, n), or -1 */
static int64_t first_bad(const void *idx, int idx_dtype, int64_t count, int64_t n)
{
    for (int64_t k = 0; k < count; k++) {
        int64_t v = idx_at(idx, idx_dtype, k);
        if (v < 0 || v >= n) return k;
    }
    return -1;
}

static int check_range(const char *what, const void *idx, int idx_dtype, int64_t count, int64_t n)
{
    int64_t k = first_bad(idx, idx_dtype, count, n);
    if (k >= 0)
        return tide_set_error("%s: index %lld (at position %lld) is out of range [0, %lld)", what,
                              (long long)idx_at(idx, idx_dtype, k), (long long)k, (long long)n);
    return 0;
}

static int check_sizes(const char *what, int64_t a, int64_t b, int64_t c, int64_t d)
{
    if (a < 0 || b < 0 || c < 0 || d < 0)
        return tide_set_error("%s: sizes %lld, %lld, %lld, %lld must be >= 0", what, (long long)a, (long long)b,
                              (long long)c, (long long)d);
    return 0;
}

int tide_cpu_check_index(const char *what, const void *idx, int idx_dtype, int64_t count, int64_t n, int defer,
                         int64_t *bad, int *ok)
{
    (void)what;
    (void)defer;   /* always answered here */
    if (check_idx_dtype("check_index", idx_dtype)) return -1;
    int64_t k = first_bad(idx, idx_dtype, count, n);
    *ok = k < 0;
    if (k >= 0 && bad) *bad = idx_at(idx, idx_dtype, k);
    return 0;
}

/* ---- index_select: out[o, j, :] = x[o, idx[j], :] (any dtype: rows are moved as bytes) --------------- */

int tide_cpu_index_select(int dtype, void *out, const void *x, const void *idx, int idx_dtype,
                          int64_t outer, int64_t n_src, int64_t inner, int64_t n_idx)
{
    size_t esz = tide_dtype_size(dtype);
    if (!esz) return tide_set_error("index_select: dtype %d is not a tide dtype", dtype);
    if (check_idx_dtype("index_select", idx_dtype) || check_sizes("index_select", outer, n_src, inner, n_idx) ||
        check_range("index_select", idx, idx_dtype, n_idx, n_src))
        return -1;
    size_t row = (size_t)inner * esz;
    #pragma omp parallel for if(outer * n_idx * inner > PAR_MIN) schedule(static)
    for (int64_t w = 0; w < outer * n_idx; w++) {
        int64_t o = w / n_idx, j = w % n_idx;
        int64_t src_row = o * n_src + idx_at(idx, idx_dtype, j);
        memcpy((char *)out + (size_t)w * row, (const char *)x + (size_t)src_row * row, row);
    }
    return 0;
}

/* ---- index_add: gx[o, idx[j], :] += gy[o, j, :] ------------------------------------------------------- */

#define INDEX_ADD(T)                                                                               \
    static void index_add_##T(T *gx, const T *gy, const void *idx, int idx_dtype, int64_t outer,   \
                              int64_t n_dst, int64_t inner, int64_t n_idx)                         \
    {                                                                                              \
        /* items are (o, block of inner); each walks j in order, so no two threads share a sum */  \
        int64_t nblk = (inner + ADD_BLOCK - 1) / ADD_BLOCK;                                        \
        _Pragma("omp parallel for if(outer * n_idx * inner > PAR_MIN) schedule(static)")           \
        for (int64_t w = 0; w < outer * nblk; w++) {                                               \
            int64_t o = w / nblk, i0 = (w % nblk) * ADD_BLOCK;                                     \
            int64_t i1 = i0 + ADD_BLOCK < inner ? i0 + ADD_BLOCK : inner;                          \
            for (int64_t j = 0; j < n_idx; j++) {                                                  \
                T *dst = gx + (o * n_dst + idx_at(idx, idx_dtype, j)) * inner;                     \
                const T *src = gy + (o * n_idx + j) * inner;                                       \
                for (int64_t i = i0; i < i1; i++) dst[i] += src[i];                                \
            }                                                                                      \
        }                                                                                          \
    }

INDEX_ADD(float)
INDEX_ADD(double)

int tide_cpu_index_add(int dtype, void *gx, const void *gy, const void *idx, int idx_dtype,
                       int64_t outer, int64_t n_dst, int64_t inner, int64_t n_idx)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("index_add: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    if (check_idx_dtype("index_add", idx_dtype) || check_sizes("index_add", outer, n_dst, inner, n_idx) ||
        check_range("index_add", idx, idx_dtype, n_idx, n_dst))
        return -1;
    if (dtype == TIDE_F32) index_add_float(gx, gy, idx, idx_dtype, outer, n_dst, inner, n_idx);
    else index_add_double(gx, gy, idx, idx_dtype, outer, n_dst, inner, n_idx);
    return 0;
}

/* ---- gather: out[o, j, i] = x[o, idx[o, j, i], i] (any dtype) ----------------------------------------- */

#define GATHER(T)                                                                                  \
    static void gather_##T(T *out, const T *x, const void *idx, int idx_dtype, int64_t outer,      \
                           int64_t n_x, int64_t n_idx, int64_t inner)                              \
    {                                                                                              \
        _Pragma("omp parallel for if(outer * n_idx * inner > PAR_MIN) schedule(static)")           \
        for (int64_t w = 0; w < outer * n_idx; w++) {                                              \
            int64_t o = w / n_idx;                                                                 \
            for (int64_t i = 0; i < inner; i++) {                                                  \
                int64_t k = w * inner + i;                                                         \
                out[k] = x[(o * n_x + idx_at(idx, idx_dtype, k)) * inner + i];                     \
            }                                                                                      \
        }                                                                                          \
    }

GATHER(uint8_t)
GATHER(uint16_t)
GATHER(uint32_t)
GATHER(uint64_t)

int tide_cpu_gather(int dtype, void *out, const void *x, const void *idx, int idx_dtype,
                    int64_t outer, int64_t n_x, int64_t n_idx, int64_t inner)
{
    size_t esz = tide_dtype_size(dtype);
    if (!esz) return tide_set_error("gather: dtype %d is not a tide dtype", dtype);
    if (check_idx_dtype("gather", idx_dtype) || check_sizes("gather", outer, n_x, n_idx, inner) ||
        check_range("gather", idx, idx_dtype, outer * n_idx * inner, n_x))
        return -1;
    switch (esz) {
    case 1: gather_uint8_t(out, x, idx, idx_dtype, outer, n_x, n_idx, inner); break;
    case 2: gather_uint16_t(out, x, idx, idx_dtype, outer, n_x, n_idx, inner); break;
    case 4: gather_uint32_t(out, x, idx, idx_dtype, outer, n_x, n_idx, inner); break;
    default: gather_uint64_t(out, x, idx, idx_dtype, outer, n_x, n_idx, inner); break;
    }
    return 0;
}

/* ---- scatter_add: out[o, idx[o, j, i], i] += src[o, j, i] ---------------------------------------------- */

#define SCATTER_ADD(T)                                                                             \
    static void scatter_add_##T(T *out, const T *src, const void *idx, int idx_dtype,              \
                                int64_t outer, int64_t n_out, int64_t n_idx, int64_t inner)        \
    {                                                                                              \
        /* items are (o, i) columns: all writes of a column stay in one thread, in j order */      \
        _Pragma("omp parallel for if(outer * n_idx * inner > PAR_MIN) schedule(static)")           \
        for (int64_t w = 0; w < outer * inner; w++) {                                              \
            int64_t o = w / inner, i = w % inner;                                                  \
            for (int64_t j = 0; j < n_idx; j++) {                                                  \
                int64_t k = (o * n_idx + j) * inner + i;                                           \
                out[(o * n_out + idx_at(idx, idx_dtype, k)) * inner + i] += src[k];                \
            }                                                                                      \
        }                                                                                          \
    }

SCATTER_ADD(float)
SCATTER_ADD(double)

int tide_cpu_scatter_add(int dtype, void *out, const void *src, const void *idx, int idx_dtype,
                         int64_t outer, int64_t n_out, int64_t n_idx, int64_t inner)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("scatter_add: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    if (check_idx_dtype("scatter_add", idx_dtype) || check_sizes("scatter_add", outer, n_out, n_idx, inner) ||
        check_range("scatter_add", idx, idx_dtype, outer * n_idx * inner, n_out))
        return -1;
    if (dtype == TIDE_F32) scatter_add_float(out, src, idx, idx_dtype, outer, n_out, n_idx, inner);
    else scatter_add_double(out, src, idx, idx_dtype, outer, n_out, n_idx, inner);
    return 0;
}

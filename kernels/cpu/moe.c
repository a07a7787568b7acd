/*
 * moe.c — the sparse MoE kernels (spec/moe.md): SiTU-GLU (§6), top-k over the last dim (§2: ties go to the
 * lowest index), and the dropless grouped expert FFN with dispatch and combine (§8).
 *
 * moe_experts: a stable counting sort of the m·k assignments (t, slot) by expert (ties by t, then slot) gives
 * route = [perm (m·k) | pos (m·k) | offsets (n + 1)]: perm[r] = the assignment at sorted row r, pos[a] = the
 * sorted row of assignment a (−1 when dropped by the capacity), offsets = segment starts of the kept rows.
 * Per expert segment two BLAS products (gate/up, down) with the activation between; the combine walks each
 * token's slots in order with an accumulator in the compute type (no scatter, no atomics).
 *
 * Bitwise independent of the thread count: a threaded OpenBLAS product is not (its threads split the output
 * and the edge micro-kernels round differently, so 1 and 2 threads differ in the last bit). Every product here
 * is therefore cut into tiles whose bounds depend only on the sizes (TILE_ROWS rows of a segment; for the
 * weight gradients, which reduce over the segment's rows, TILE_ROWS output rows with all the segment's rows in
 * one call), and each tile is one BLAS call made inside an active OpenMP region, where the OpenMP build of
 * OpenBLAS runs single-threaded (it checks omp_in_parallel()). Tiles are spread over the threads; which thread
 * runs a tile does not change its bits. The regions carry no if() clause: an inactive one (a team of one) would
 * let BLAS thread again when more than one thread is configured.
 */
/* GCC keeps a loop with a float compare-and-select scalar under -ftrapping-math (the default): the f32 SiTU-GLU
   on fastmath.h would not vectorise; tide never reads the floating-point exception flags.
   Before the includes, so that fastmath.h's functions carry the same options and inline */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
/* the activations' loops are compute-bound (two tanh and a sigmoid an element): 512-bit vectors where AVX-512 exists
   (GCC prefers 256 by default; the same arithmetic in every lane) */
#if defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif
#endif

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu.h"
#include "fastmath.h"
#include <omp.h>

/* rows per tile; a tile's bits depend on it, so it is a constant, never derived from the thread count */
#define TILE_ROWS 512
/* the products whose outputs (pre and y, dX) are at least this large write in the tile scratch and stream the
   tiles out; smaller outputs stay in the caches for their readers, and the products write them in place */
#define MOE_STREAM_MIN ((size_t)16 << 20)

static inline int64_t idx_at(const void *p, int dt, int64_t i)
{
    return dt == TIDE_I64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

/* ---- SiTU-GLU (moe.md §6): h = k1 tanh(g/k1) σ(g) · k2 tanh(u/k2), σ on the uncapped g ------------------- */
/* f32 through fastmath.h's vectorising sigmoid_f32 / tanh_f32 (libm's expf/tanhf are a call per element); f64 on
   libm */
static inline double sigmoid_f64(double x)
{   /* overflow-safe: exp of a non-positive number only */
    if (x >= 0) return 1.0 / (1.0 + exp(-x));
    double e = exp(x);
    return e / (1.0 + e);
}

#define SITU(T, SIG, TANH)                                                                                  \
    static inline T sig_##T(T x) { return SIG(x); }                                                         \
    static inline T TANH_##T(T x) { return TANH(x); }                                                       \
    static inline T situ_h_##T(T g, T u, T k1, T k2) { return k1 * TANH(g / k1) * sig_##T(g) * (k2 * TANH(u / k2)); } \
    /* the standalone op (F.situ_glu, nn.MLP's FFN) step by step as its unfused form                          \
       ((tanh(g·(1/k1))·k1)·σ(g))·(tanh(u·(1/k2))·k2) rounds, and its gradient as autograd's chain of those     \
       ops (each product rounded, 1 − t² as the tanh backward writes it, g's two paths added last), so the      \
       fused node gives the unfused form's bits */                                                           \
    static inline T situ_op_h_##T(T g, T u, T i1, T k1, T i2, T k2)                                        \
    {                                                                                                       \
        T a = TANH(g * i1) * k1 * sig_##T(g), b = TANH(u * i2) * k2;                                        \
        return a * b;                                                                                       \
    }                                                                                                       \
    /* g's two paths are returned apart (dg_tanh, dg_sig): the caller adds them in a separate loop, so neither  \
       product is contracted into that sum (the unfused form rounds both before autograd adds them) */         \
    static inline void situ_op_grad_##T(T d, T g, T u, T i1, T k1, T i2, T k2, T *dg_tanh, T *dg_sig, T *du)  \
    {                                                                                                       \
        T tg = TANH(g * i1), s = sig_##T(g), tu = TANH(u * i2);                                             \
        T a3 = tg * k1, a4 = a3 * s, b3 = tu * k2;                                                          \
        T da4 = d * b3, db3 = d * a4;                                                                       \
        *du = db3 * k2 * ((T)1 - tu * tu) * i2;                                                             \
        T da3 = da4 * s, ds = da4 * a3;                                                                     \
        *dg_sig = ds * s * ((T)1 - s);                                                                      \
        *dg_tanh = da3 * k1 * ((T)1 - tg * tg) * i1;                                                        \
    }                                                                                                       \
    static inline T swiglu_h_##T(T g, T u) { return g * sig_##T(g) * u; }                                   \
    static inline void swiglu_grad_##T(T d, T g, T u, T *dg, T *du)                                         \
    {                                                                                                       \
        T s = sig_##T(g);                                                                                   \
        *dg = d * u * s * ((T)1 + g * ((T)1 - s));                                                          \
        *du = d * g * s;                                                                                    \
    }

SITU(float, sigmoid_f32, tanh_f32)
SITU(double, sigmoid_f64, tanh)

#define SITU_BLOCK 256   /* elements a backward pass keeps g's sigmoid path of, before adding it */
#define SITU_KERNELS(T)                                                                                     \
    static void situ_fw_##T(T *out, const T *g, const T *u, int64_t n, double k1, double k2)                \
    {                                                                                                       \
        T i1 = (T)(1.0 / k1), i2 = (T)(1.0 / k2), f1 = (T)k1, f2 = (T)k2;                                   \
        _Pragma("omp parallel for if(n > TIDE_OMP_MIN_MATH) schedule(static)")                                          \
        for (int64_t i = 0; i < n; i++) out[i] = situ_op_h_##T(g[i], u[i], i1, f1, i2, f2);                 \
    }                                                                                                       \
    static void situ_bw_##T(T *dg, T *du, const T *d, const T *g, const T *u, int64_t n, double k1, double k2) \
    {                                                                                                       \
        T i1 = (T)(1.0 / k1), i2 = (T)(1.0 / k2), f1 = (T)k1, f2 = (T)k2;                                   \
        int64_t nb = (n + SITU_BLOCK - 1) / SITU_BLOCK;                                                     \
        _Pragma("omp parallel for if(n > TIDE_OMP_MIN_MATH) schedule(static)")                                          \
        for (int64_t b = 0; b < nb; b++) {                                                                  \
            int64_t i0 = b * SITU_BLOCK, m = n - i0 < SITU_BLOCK ? n - i0 : SITU_BLOCK;                     \
            T sg[SITU_BLOCK];                                                                               \
            for (int64_t j = 0; j < m; j++)                                                                 \
                situ_op_grad_##T(d[i0 + j], g[i0 + j], u[i0 + j], i1, f1, i2, f2, &dg[i0 + j], &sg[j], &du[i0 + j]); \
            for (int64_t j = 0; j < m; j++) dg[i0 + j] += sg[j];                                            \
        }                                                                                                   \
    }
SITU_KERNELS(float)
SITU_KERNELS(double)

int tide_cpu_situ_glu(int dtype, void *out, const void *g, const void *u, int64_t n, double k_gate, double k_lin)
{
    switch (dtype) {
    case TIDE_F32: situ_fw_float(out, g, u, n, k_gate, k_lin); return 0;
    case TIDE_F64: situ_fw_double(out, g, u, n, k_gate, k_lin); return 0;
    default: return tide_set_error("situ_glu: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    }
}

int tide_cpu_situ_glu_backward(int dtype, void *dg, void *du, const void *dout, const void *g, const void *u, int64_t n,
                               double k_gate, double k_lin)
{
    switch (dtype) {
    case TIDE_F32: situ_bw_float(dg, du, dout, g, u, n, k_gate, k_lin); return 0;
    case TIDE_F64: situ_bw_double(dg, du, dout, g, u, n, k_gate, k_lin); return 0;
    default: return tide_set_error("situ_glu_backward: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    }
}

/* ---- top-k over the last dim: descending, ties to the lowest index (moe.md §2) --------------------------- */
#define TOPK(T)                                                                                             \
    static void topk_##T(T *val, int64_t *ind, const T *x, int64_t rows, int64_t C, int64_t k)              \
    {                                                                                                       \
        _Pragma("omp parallel for if(rows * C > TIDE_OMP_MIN) schedule(static)")                                   \
        for (int64_t r = 0; r < rows; r++) {                                                                \
            const T *xr = x + r * C;                                                                        \
            T *v = val + r * k;                                                                             \
            int64_t *id = ind + r * k, have = 0;                                                            \
            for (int64_t c = 0; c < C; c++) {                                                               \
                T xc = xr[c];                                                                               \
                /* strictly greater displaces: an equal value found later (higher index) stays behind */   \
                if (have == k && !(xc > v[k - 1])) continue;                                                \
                int64_t j = have < k ? have++ : k - 1;                                                      \
                while (j > 0 && xc > v[j - 1]) { v[j] = v[j - 1]; id[j] = id[j - 1]; j--; }                 \
                v[j] = xc;                                                                                  \
                id[j] = c;                                                                                  \
            }                                                                                               \
        }                                                                                                   \
    }
TOPK(float)
TOPK(double)

int tide_cpu_topk(int dtype, void *values, int64_t *indices, const void *x, int64_t rows, int64_t C, int64_t k)
{
    switch (dtype) {
    case TIDE_F32: topk_float(values, indices, x, rows, C, k); return 0;
    case TIDE_F64: topk_double(values, indices, x, rows, C, k); return 0;
    default: return tide_set_error("topk: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    }
}

/* ---- routing: stable counting sort by expert (moe.md §8 step 1), capacity applied in sort order ---------- */
static int64_t build_route(int64_t *route, const void *sel, int sel_dtype, int64_t m, int64_t k, int64_t n, int64_t cap)
{
    int64_t A = m * k, *perm = route, *pos = route + A, *off = route + 2 * A;
    int64_t *count = calloc((size_t)n + 1, sizeof *count), dropped = 0;
    if (!count) return -1;
    for (int64_t a = 0; a < A; a++) count[idx_at(sel, sel_dtype, a)]++;
    off[0] = 0;
    for (int64_t e = 0; e < n; e++) {
        int64_t kept = cap >= 0 && count[e] > cap ? cap : count[e];
        dropped += count[e] - kept;
        off[e + 1] = off[e] + kept;
        count[e] = 0;                          /* reused as the running fill of each segment */
    }
    for (int64_t a = 0; a < A; a++) {        /* ascending a = (t, slot) order: the sort is stable */
        int64_t e = idx_at(sel, sel_dtype, a), r = off[e] + count[e];
        if (r < off[e + 1]) { perm[r] = a; pos[a] = r; count[e]++; }
        else pos[a] = -1;
    }
    for (int64_t r = off[n]; r < A; r++) perm[r] = -1;
    free(count);
    return dropped;
}

static int gemm(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, const void *B,
                int64_t ldb, void *C, int64_t ldc)
{
    return tide_cpu_gemm(dtype, ta, tb, M, N, K, 1.0, A, lda, B, ldb, 0.0, C, ldc);
}

/* the sorted rows [r0, r0 + rows) into dst [rows, d]: dst[r − r0] = x[t(perm[r])]; serial: called per tile, inside
   the tiles' parallel region, so a tile's rows are gathered just before its product reads them */
static void gather_rows(size_t es, char *dst, const char *x, const int64_t *perm, int64_t r0, int64_t rows, int64_t k,
                        int64_t d)
{
    size_t row = (size_t)d * es;
    for (int64_t r = 0; r < rows; r++) memcpy(dst + (size_t)r * row, x + (size_t)(perm[r0 + r] / k) * row, row);
}

/* the most threads the next parallel region can have: per-thread scratch comes as this many blocks, indexed by
   omp_get_thread_num(). A tile's gathered rows and intermediates go to its thread's block, which the thread's next
   tile reuses while it is still in the cache, instead of a fresh part of one large buffer whose every line is a
   miss on first write */
static int team_size(void)
{
    int t = omp_get_max_threads();
    return t > 0 ? t : 1;
}

/* h [R, de] from pre [R, 2 de] (gate | up); serial: called per tile, inside the tiles' parallel region. The
   activation is chosen outside the loops, so each inner loop is one function over a row (it vectorises) */
#define ACT(T)                                                                                              \
    static void act_fw_##T(T *h, const T *pre, int64_t R, int64_t de, int act, T k1, T k2)                  \
    {                                                                                                       \
        for (int64_t r = 0; r < R; r++) {                                                                   \
            const T *g = pre + r * 2 * de, *u = g + de;                                                     \
            T *hr = h + r * de;                                                                             \
            if (act == TIDE_MOE_SITU)                                                                       \
                for (int64_t j = 0; j < de; j++) hr[j] = situ_h_##T(g[j], u[j], k1, k2);                    \
            else                                                                                            \
                for (int64_t j = 0; j < de; j++) hr[j] = swiglu_h_##T(g[j], u[j]);                          \
        }                                                                                                   \
    }                                                                                                       \
    /* act_fw and act_bw in one pass over pre (the expert backward): h (for the weight gradient) and dpre, one    \
       σ and one tanh pair per element; the expressions of situ_h / situ_grad and swiglu_h / swiglu_grad, so the \
       same bits. One row per call with restrict parameters: GCC vectorises the six streams only so */         \
    static void situ_fb_row_##T(T *restrict hr, T *restrict dg, T *restrict du, const T *restrict d,         \
                                const T *restrict g, const T *restrict u, int64_t de, T k1, T k2)           \
    {                                                                                                       \
        for (int64_t j = 0; j < de; j++) {                                                                  \
            T tg = TANH_##T(g[j] / k1), s = sig_##T(g[j]), tu = TANH_##T(u[j] / k2);                        \
            T pg = k1 * tg * s, pu = k2 * tu;                                                               \
            hr[j] = pg * pu;                                                                                \
            dg[j] = d[j] * ((((T)1 - tg * tg) * s + k1 * tg * s * ((T)1 - s)) * pu);                         \
            du[j] = d[j] * (pg * ((T)1 - tu * tu));                                                         \
        }                                                                                                   \
    }                                                                                                       \
    static void swiglu_fb_row_##T(T *restrict hr, T *restrict dg, T *restrict du, const T *restrict d,       \
                                  const T *restrict g, const T *restrict u, int64_t de)                     \
    {                                                                                                       \
        for (int64_t j = 0; j < de; j++) {                                                                  \
            T s = sig_##T(g[j]);                                                                            \
            hr[j] = g[j] * s * u[j];                                                                        \
            dg[j] = d[j] * u[j] * s * ((T)1 + g[j] * ((T)1 - s));                                           \
            du[j] = d[j] * g[j] * s;                                                                        \
        }                                                                                                   \
    }                                                                                                       \
    static void act_fb_##T(T *h, T *dpre, const T *dh, const T *pre, int64_t R, int64_t de, int act, T k1,   \
                           T k2)                                                                            \
    {                                                                                                       \
        for (int64_t r = 0; r < R; r++) {                                                                   \
            const T *g = pre + r * 2 * de, *u = g + de, *d = dh + r * de;                                   \
            T *hr = h + r * de, *dg = dpre + r * 2 * de, *du = dg + de;                                     \
            if (act == TIDE_MOE_SITU) situ_fb_row_##T(hr, dg, du, d, g, u, de, k1, k2);                     \
            else swiglu_fb_row_##T(hr, dg, du, d, g, u, de);                                                \
        }                                                                                                   \
    }
ACT(float)
ACT(double)

/* combine (§8 step 3): out[t] = Σ_slot p[t, slot] Y[pos(t, slot)], slots in order, dropped ones skipped. Each
   element's sum is the same sequence of adds from 0 as an element-by-element loop; the slot loop is outside, so
   the channel loop is a plain vector update */
#define COMBINE(T)                                                                                          \
    static void combine_##T(T *out, const T *y, const T *p, const int64_t *pos, int64_t m, int64_t k,        \
                            int64_t d)                                                                      \
    {                                                                                                       \
        _Pragma("omp parallel for if(m * d > TIDE_OMP_MIN) schedule(static)")                                      \
        for (int64_t t = 0; t < m; t++) {                                                                   \
            T *o = out + t * d;                                                                             \
            for (int64_t c = 0; c < d; c++) o[c] = 0;                                                       \
            for (int64_t s = 0; s < k; s++) {                                                               \
                int64_t r = pos[t * k + s];                                                                 \
                if (r < 0) continue;                                                                        \
                const T ps = p[t * k + s], *yr = y + r * d;                                                 \
                for (int64_t c = 0; c < d; c++) o[c] += ps * yr[c];                                         \
            }                                                                                               \
        }                                                                                                   \
    }
COMBINE(float)
COMBINE(double)

static size_t esz(int dtype) { return dtype == TIDE_F32 ? sizeof(float) : sizeof(double); }

/* a row tile: sorted rows [r0, r0 + rows) of expert e's segment */
typedef struct { int64_t e, r0, rows; } row_tile;

/* the row tiles of every segment in order, TILE_ROWS rows each (a segment's last one shorter); NULL when out of
   memory */
static row_tile *row_tiles(const int64_t *off, int64_t n, int64_t *count)
{
    int64_t c = 0;
    for (int64_t e = 0; e < n; e++) c += (off[e + 1] - off[e] + TILE_ROWS - 1) / TILE_ROWS;
    row_tile *t = malloc((size_t)(c > 0 ? c : 1) * sizeof *t);
    if (!t) return NULL;
    c = 0;
    for (int64_t e = 0; e < n; e++)
        for (int64_t r = off[e]; r < off[e + 1]; r += TILE_ROWS)
            t[c++] = (row_tile){e, r, off[e + 1] - r < TILE_ROWS ? off[e + 1] - r : TILE_ROWS};
    *count = c;
    return t;
}

/* the tiles' BLAS calls run on worker threads, whose error messages the caller would not see: check the one
   limit a product could fail on (the 32-bit BLAS integer, gemm.c) here, on the calling thread */
static int check_blas_range(const char *op, int64_t R, int64_t d_in, int64_t d_e, int64_t d_out)
{
    if (R > INT_MAX || d_in > INT_MAX || 2 * d_e > INT_MAX || d_out > INT_MAX)
        return tide_set_error("%s: %lld rows, d_in = %lld, 2·d_e = %lld or d_out = %lld exceed the BLAS integer "
                              "range %d", op, (long long)R, (long long)d_in, (long long)(2 * d_e), (long long)d_out,
                              INT_MAX);
    return 0;
}

int tide_cpu_moe_experts(int dtype, void *out, int64_t *route, void *pre, void *y, const void *x, const void *sel,
                         int sel_dtype, const void *p, const void *w_gate_up, const void *w_down, int64_t m, int64_t k,
                         int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate, double k_lin,
                         int64_t capacity, int64_t *dropped, int64_t *host_off)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("moe_experts: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    int64_t A = m * k, nd = build_route(route, sel, sel_dtype, m, k, n, capacity);
    if (nd < 0) return tide_set_error("moe_experts: out of memory (%lld experts)", (long long)n);
    const int64_t *perm = route, *pos = route + A, *off = route + 2 * A;
    int64_t R = off[n], nt = 0;
    if (host_off) memcpy(host_off, off, (size_t)(n + 1) * sizeof(int64_t));
    if (check_blas_range("moe_experts", R, d_in, d_e, d_out)) return -1;
    size_t es = esz(dtype);
    /* a tile's gathered rows, pre, h and y: its thread's block of engine scratch (cached blocks, so a training step
       does not fault fresh pages in). When the saved pre and y are MOE_STREAM_MIN or more, the products write them
       there, in the cache (OpenBLAS zeroes C before a beta = 0 product: on the saved tensors that read every line
       from memory first), and the tile streams them out with non-temporal stores; smaller ones are written in place */
    size_t each = ((size_t)TILE_ROWS * (size_t)(d_in + d_e + 2 * d_e + d_out) * es + 63) & ~(size_t)63;
    char *blk = tide_scratch_alloc(TIDE_CPU_DEVICE, (size_t)team_size() * each);
    row_tile *tl = blk ? row_tiles(off, n, &nt) : NULL;
    if (!blk || !tl) {
        tide_scratch_free(TIDE_CPU_DEVICE, blk);
        return tide_set_error("moe_experts: out of memory for %lld rows", (long long)R);
    }
    int failed = 0, stream = (size_t)R * (size_t)(2 * d_e + d_out) * es >= MOE_STREAM_MIN;
    /* §8 step 2 per row tile: gather, gate/up, activation, down; each tile one single-threaded BLAS call per
       product */
#pragma omp parallel for schedule(dynamic, 1) reduction(|| : failed)
    for (int64_t i = 0; i < nt; i++) {
        int64_t e = tl[i].e, r0 = tl[i].r0, rows = tl[i].rows;
        char *xg = blk + (size_t)omp_get_thread_num() * each, *he = xg + (size_t)(rows * d_in) * es;
        char *pe = he + (size_t)(rows * d_e) * es, *ye = pe + (size_t)(rows * 2 * d_e) * es;
        char *pd = (char *)pre + (size_t)(r0 * 2 * d_e) * es, *yd = (char *)y + (size_t)(r0 * d_out) * es;
        if (!stream) pe = pd, ye = yd;
        gather_rows(es, xg, x, perm, r0, rows, k, d_in);
        if (gemm(dtype, 0, 1, rows, 2 * d_e, d_in, xg, d_in,
                 (const char *)w_gate_up + (size_t)(e * 2 * d_e * d_in) * es, d_in, pe, 2 * d_e)) { failed = 1; continue; }
        if (dtype == TIDE_F32) act_fw_float((float *)he, (const float *)pe, rows, d_e, act, (float)k_gate, (float)k_lin);
        else act_fw_double((double *)he, (const double *)pe, rows, d_e, act, k_gate, k_lin);
        if (gemm(dtype, 0, 1, rows, d_out, d_e, he, d_e, (const char *)w_down + (size_t)(e * d_out * d_e) * es, d_e,
                 ye, d_out)) { failed = 1; continue; }
        if (stream) {
            tide_cpu_copy_stream(pd, pe, (size_t)(rows * 2 * d_e) * es);
            tide_cpu_copy_stream(yd, ye, (size_t)(rows * d_out) * es);
        }
    }
    int rc = failed ? tide_set_error("moe_experts: an expert product failed (%lld rows, d_in = %lld, d_e = %lld, "
                                     "d_out = %lld)", (long long)R, (long long)d_in, (long long)d_e, (long long)d_out) : 0;
    if (!rc) {
        if (dtype == TIDE_F32) combine_float(out, y, p, pos, m, k, d_out);
        else combine_double(out, y, p, pos, m, k, d_out);
    }
    tide_scratch_free(TIDE_CPU_DEVICE, blk);
    free(tl);
    if (dropped) *dropped = nd;
    return rc;
}

/* dy_rows: rows whose dot products advance together, and the channels of their products buffered at a time */
#define DY_GROUP 8
#define DY_CHUNK 64

/* backward through the same permutation (§8): dY = p ⊙ du (gathered), dp = du · Y, then per segment
   dh = dY Wd, dWd = dYᵀ h, dpre = act'(dh), dWgu = dpreᵀ X, dX = dpre Wgu; dx[t] = Σ_slot dX[pos(t, slot)] in
   slot order. dWgu / dWd are overwritten (experts with no rows get 0). */
#define MOE_BW(T)                                                                                           \
    /* sorted rows [r0, r0 + rows): dY rows into dst [rows, d], dst[r − r0] = p[a] du[t], and, when dp,        \
       dp[a] = du[t] · Y[r] (a = perm[r], t = a/k): each dot product the sum of the rounded products in channel  \
       order from 0. The du rows are a gather from memory: the next group's are prefetched while this group's     \
       are read. A row's sum is one chain of dependent adds; DY_GROUP rows' chains advance together (their        \
       products first, in a separate loop through a buffer, so no add is contracted with its product). Serial:  \
       called per tile, inside the tiles' parallel region */                                                   \
    static void dy_rows_##T(T *dst, T *dp, const T *du, const T *y, const T *p, const int64_t *perm, int64_t r0, \
                            int64_t rows, int64_t k, int64_t d)                                             \
    {                                                                                                       \
        T prod[DY_GROUP * DY_CHUNK];                                                                        \
        for (int64_t g0 = r0; g0 < r0 + rows; g0 += DY_GROUP) {                                             \
            int64_t ng = r0 + rows - g0 < DY_GROUP ? r0 + rows - g0 : DY_GROUP;                             \
            for (int64_t r = g0 + DY_GROUP; r < g0 + DY_GROUP + ng && r < r0 + rows; r++)                   \
                tide_cpu_prefetch_bytes(du + (perm[r] / k) * d, (size_t)d * sizeof(T));                                \
            for (int64_t j = 0; j < ng; j++) {                                                              \
                int64_t a = perm[g0 + j];                                                                   \
                const T *dur = du + (a / k) * d;                                                            \
                T *dy = dst + (g0 + j - r0) * d;                                                            \
                for (int64_t c = 0; c < d; c++) dy[c] = p[a] * dur[c];                                      \
            }                                                                                               \
            if (!dp) continue;                                                                              \
            T acc[DY_GROUP] = {0};                                                                          \
            for (int64_t j = ng; j < DY_GROUP; j++)   /* a short last group: its idle chains add zeros */     \
                for (int64_t c = 0; c < DY_CHUNK; c++) prod[j * DY_CHUNK + c] = 0;                          \
            for (int64_t c0 = 0; c0 < d; c0 += DY_CHUNK) {                                                  \
                int64_t nc = d - c0 < DY_CHUNK ? d - c0 : DY_CHUNK;                                         \
                for (int64_t j = 0; j < ng; j++) {                                                          \
                    const T *dur = du + (perm[g0 + j] / k) * d + c0, *yr = y + (g0 + j) * d + c0;           \
                    T *pr = prod + j * DY_CHUNK;                                                            \
                    for (int64_t c = 0; c < nc; c++) pr[c] = dur[c] * yr[c];                                \
                }                                                                                           \
                for (int64_t c = 0; c < nc; c++)                                                            \
                    for (int64_t j = 0; j < DY_GROUP; j++) acc[j] += prod[j * DY_CHUNK + c];                \
            }                                                                                               \
            for (int64_t j = 0; j < ng; j++) dp[perm[g0 + j]] = acc[j];                                     \
        }                                                                                                   \
    }                                                                                                       \
    static void dx_rows_##T(T *dx, const T *dxg, const int64_t *pos, int64_t m, int64_t k, int64_t d)        \
    {                                                                                                       \
        _Pragma("omp parallel for if(m * d > TIDE_OMP_MIN) schedule(static)")                                      \
        for (int64_t t = 0; t < m; t++) {                                                                   \
            T *o = dx + t * d;                                                                              \
            for (int64_t c = 0; c < d; c++) o[c] = 0;                                                       \
            for (int64_t s = 0; s < k; s++) {                                                               \
                int64_t r = pos[t * k + s];                                                                 \
                if (r < 0) continue;                                                                        \
                const T *xr = dxg + r * d;                                                                  \
                for (int64_t c = 0; c < d; c++) o[c] += xr[c];                                              \
            }                                                                                               \
        }                                                                                                   \
    }
MOE_BW(float)
MOE_BW(double)

/* one backward call's operands, shared by its work items */
typedef struct {
    int dtype, act, stream;   /* stream: the dX tiles go to dxg through the tile scratch (dxg >= MOE_STREAM_MIN) */
    size_t es;
    double k_gate, k_lin;
    int64_t k, d_in, d_e, d_out, td, tg;   /* td, tg: output tiles of dWd and of dWgu (0 when not wanted) */
    const int64_t *perm, *off;
    const void *du, *pre, *y, *x, *p, *w_gate_up, *w_down;
    void *dp, *dw_gate_up, *dw_down;
    char *dxg;                             /* dX [R, d_in], shared; NULL when dx is not wanted */
} moe_bw;

/* the per-row intermediates of a run of one segment's rows, row 0 = the run's first row, rows contiguous (what the
   weight gradients read) */
typedef struct { char *xg, *dy, *h, *dpre; } bw_rows;

/* the widths of bw_rows, in elements per row, and the run of `rows` rows from `base` */
static int64_t bw_width(const moe_bw *b) { return b->d_in + b->d_out + b->d_e + 2 * b->d_e; }

/* a thread's tile scratch, reused tile after tile (so in the cache): dh [TILE_ROWS, d_e] and the dX tile
   [TILE_ROWS, d_in], which is streamed to the shared dxg from there */
static size_t bw_tmp_bytes(const moe_bw *b)
{
    return ((size_t)TILE_ROWS * (size_t)(b->d_e + b->d_in) * b->es + 63) & ~(size_t)63;
}
static bw_rows bw_carve(const moe_bw *b, char *base, int64_t rows)
{
    bw_rows w;
    w.xg = base;
    w.dy = w.xg + (size_t)(rows * b->d_in) * b->es;
    w.h = w.dy + (size_t)(rows * b->d_out) * b->es;
    w.dpre = w.h + (size_t)(rows * b->d_e) * b->es;
    return w;
}

/* a run's row q */
static bw_rows bw_at(const moe_bw *b, bw_rows w, int64_t q)
{
    w.xg += (size_t)(q * b->d_in) * b->es;
    w.dy += (size_t)(q * b->d_out) * b->es;
    w.h += (size_t)(q * b->d_e) * b->es;
    w.dpre += (size_t)(q * 2 * b->d_e) * b->es;
    return w;
}

/* row tile [r0, r0 + rows) of expert e into w (at the tile's first row): the gathered x and dY rows (and dp),
   dh = dY Wd (into tmp), then h (recomputed) and dpre = act'(dh) in one pass, dX = dpre Wgu (into tmp, then
   streamed to the shared dxg) */
static int bw_tile(const moe_bw *b, int64_t e, int64_t r0, int64_t rows, bw_rows w, char *tmp)
{
    size_t es = b->es;
    int64_t d_in = b->d_in, d_e = b->d_e, d_out = b->d_out;
    gather_rows(es, w.xg, b->x, b->perm, r0, rows, b->k, d_in);
    if (b->dtype == TIDE_F32) dy_rows_float((float *)w.dy, b->dp, b->du, b->y, b->p, b->perm, r0, rows, b->k, d_out);
    else dy_rows_double((double *)w.dy, b->dp, b->du, b->y, b->p, b->perm, r0, rows, b->k, d_out);
    const char *wgu = (const char *)b->w_gate_up + (size_t)(e * 2 * d_e * d_in) * es;
    const char *wd = (const char *)b->w_down + (size_t)(e * d_out * d_e) * es;
    char *dh = tmp, *dxd = b->dxg + (size_t)(r0 * d_in) * es, *dxt = b->stream ? tmp + (size_t)(TILE_ROWS * d_e) * es : dxd;
    if (gemm(b->dtype, 0, 0, rows, d_e, d_out, w.dy, d_out, wd, d_e, dh, d_e)) return -1;
    if (b->dtype == TIDE_F32)
        act_fb_float((float *)w.h, (float *)w.dpre, (const float *)dh, (const float *)b->pre + r0 * 2 * d_e, rows,
                     d_e, b->act, (float)b->k_gate, (float)b->k_lin);
    else
        act_fb_double((double *)w.h, (double *)w.dpre, (const double *)dh, (const double *)b->pre + r0 * 2 * d_e,
                      rows, d_e, b->act, b->k_gate, b->k_lin);
    if (!b->dxg) return 0;
    if (gemm(b->dtype, 0, 0, rows, d_in, 2 * d_e, w.dpre, 2 * d_e, wgu, d_in, dxt, d_in)) return -1;
    if (b->stream) tide_cpu_copy_stream(dxd, dxt, (size_t)(rows * d_in) * es);
    return 0;
}

/* output tile j (of td + tg) of expert e's weight gradients, which reduce over the segment's cnt rows (w holds
   them from its first): TILE_ROWS output rows of dWd (j < td), then of dWgu, each with the whole segment as K in
   one call, so no partial sums are ever combined. cnt = 0: the products have K = 0 and write zeros (gemm.c): an
   idle expert gets 0 */
static int bw_weights(const moe_bw *b, int64_t e, int64_t j, int64_t cnt, bw_rows w)
{
    size_t es = b->es;
    int64_t d_in = b->d_in, d_e = b->d_e, d_out = b->d_out, td = b->td;
    int64_t o0 = (j < td ? j : j - td) * TILE_ROWS, M = j < td ? d_out : 2 * d_e;
    int64_t rows = M - o0 < TILE_ROWS ? M - o0 : TILE_ROWS;
    if (j < td)   /* dWd[o0 + ·] = dY[:, o0 + ·]ᵀ h */
        return gemm(b->dtype, 1, 0, rows, d_e, cnt, w.dy + (size_t)o0 * es, d_out, w.h, d_e,
                    (char *)b->dw_down + (size_t)(e * d_out * d_e + o0 * d_e) * es, d_e);
    /* dWgu[o0 + ·] = dpre[:, o0 + ·]ᵀ X */
    return gemm(b->dtype, 1, 0, rows, d_in, cnt, w.dpre + (size_t)o0 * es, 2 * d_e, w.xg, d_in,
                (char *)b->dw_gate_up + (size_t)(e * 2 * d_e * d_in + o0 * d_in) * es, d_in);
}

/* The work, in one of two forms; both run the same products on the same rows, so they give the same bits.
   By expert: an item is one expert, its row tiles and then its weight gradients, on one thread, whose block of
     scratch holds the segment's intermediates: the thread's next expert reuses the block while it is still in
     the cache, and the weight gradients read rows just written. The items go largest segment first, so the
     last ones are short. Chosen when there are experts enough to keep the threads busy (n >= 4 threads) and
     the blocks cost no more than one shared buffer would (threads x the largest segment <= all rows).
   By tile (otherwise: few experts for the threads, or a skewed routing): one shared buffer and one queue,
     first the row tiles, then the weight-gradient tiles; a weight-gradient item waits until its expert's row
     tiles are done (left[e] = 0). The tiles were taken before it and no tile waits, so the wait ends; as the
     items go in expert order it is rare. One parallel region: no barrier and no idle tail between the phases.
   Returns 0, or -1 (a product failed, or out of memory: *oom set). */
static int bw_by_expert(const moe_bw *b, int64_t n, int64_t rmax, int nthr, int *oom)
{
    const int64_t *off = b->off;
    size_t each = (((size_t)(rmax > 0 ? rmax : 1) * (size_t)bw_width(b) * b->es + 63) & ~(size_t)63) + bw_tmp_bytes(b);
    char *blk = tide_scratch_alloc(TIDE_CPU_DEVICE, (size_t)nthr * each);
    int64_t *order = malloc((size_t)(n > 0 ? n : 1) * sizeof *order);
    if (!blk || !order) {
        tide_scratch_free(TIDE_CPU_DEVICE, blk);
        free(order);
        *oom = 1;
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {          /* insertion sort: rows descending, ties by expert id */
        int64_t c = off[i + 1] - off[i], j = i;
        while (j > 0 && off[order[j - 1] + 1] - off[order[j - 1]] < c) { order[j] = order[j - 1]; j--; }
        order[j] = i;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(|| : failed)
    for (int64_t i = 0; i < n; i++) {
        int64_t e = order[i], s0 = off[e], cnt = off[e + 1] - s0;
        char *mine = blk + (size_t)omp_get_thread_num() * each, *tmp = mine + each - bw_tmp_bytes(b);
        bw_rows w = bw_carve(b, mine, rmax);
        int bad = 0;
        for (int64_t r0 = s0; r0 < s0 + cnt && !bad; r0 += TILE_ROWS)
            bad = bw_tile(b, e, r0, s0 + cnt - r0 < TILE_ROWS ? s0 + cnt - r0 : TILE_ROWS, bw_at(b, w, r0 - s0), tmp);
        for (int64_t j = 0; j < b->td + b->tg && !bad; j++) bad = bw_weights(b, e, j, cnt, w);
        if (bad) failed = 1;
    }
    tide_scratch_free(TIDE_CPU_DEVICE, blk);
    free(order);
    return failed ? -1 : 0;
}

static int bw_by_tile(const moe_bw *b, int64_t n, int64_t R, int *oom)
{
    const int64_t *off = b->off;
    int64_t nt = 0, per = b->td + b->tg, next = 0;
    size_t rows_bytes = ((size_t)(R > 0 ? R : 1) * (size_t)bw_width(b) * b->es + 63) & ~(size_t)63;
    char *buf = tide_scratch_alloc(TIDE_CPU_DEVICE, rows_bytes + (size_t)team_size() * bw_tmp_bytes(b));
    row_tile *tl = buf ? row_tiles(off, n, &nt) : NULL;
    int64_t *left = tl ? calloc((size_t)(n > 0 ? n : 1), sizeof *left) : NULL;
    if (!left) {
        tide_scratch_free(TIDE_CPU_DEVICE, buf);
        free(tl);
        *oom = 1;
        return -1;
    }
    bw_rows all = bw_carve(b, buf, R > 0 ? R : 1);
    int64_t n_items = nt + n * per;
    int failed = 0;
    for (int64_t i = 0; i < nt; i++) left[tl[i].e]++;
#pragma omp parallel
    for (;;) {
        int64_t i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
        if (i >= n_items) break;
        if (i < nt) {
            int64_t e = tl[i].e;
            char *tmp = buf + rows_bytes + (size_t)omp_get_thread_num() * bw_tmp_bytes(b);
            if (bw_tile(b, e, tl[i].r0, tl[i].rows, bw_at(b, all, tl[i].r0), tmp))
                __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
            __atomic_fetch_sub(&left[e], 1, __ATOMIC_RELEASE);
            continue;
        }
        int64_t e = (i - nt) / per;
        while (__atomic_load_n(&left[e], __ATOMIC_ACQUIRE) > 0) tide_cpu_relax();
        if (__atomic_load_n(&failed, __ATOMIC_RELAXED)) continue;
        if (bw_weights(b, e, (i - nt) % per, off[e + 1] - off[e], bw_at(b, all, off[e])))
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    }
    tide_scratch_free(TIDE_CPU_DEVICE, buf);
    free(tl);
    free(left);
    return failed ? -1 : 0;
}

int tide_cpu_moe_experts_backward(int dtype, void *dx, void *dp, void *dw_gate_up, void *dw_down, const void *du,
                                  const int64_t *route, const int64_t *host_off, const void *pre, const void *y,
                                  const void *x, const void *p, const void *w_gate_up, const void *w_down, int64_t m,
                                  int64_t k, int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act,
                                  double k_gate, double k_lin)
{
    (void)host_off;   /* the route is in host memory already */
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("moe_experts_backward: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    int64_t A = m * k;
    const int64_t *perm = route, *pos = route + A, *off = route + 2 * A;
    int64_t R = off[n];
    if (check_blas_range("moe_experts_backward", R, d_in, d_e, d_out)) return -1;
    size_t es = esz(dtype);
    /* dX rows, shared by all the work (dx sums a token's slots over experts) */
    char *dxg = dx ? tide_scratch_alloc(TIDE_CPU_DEVICE, (size_t)(R > 0 ? R : 1) * (size_t)d_in * es) : NULL;
    if (dx && !dxg) return tide_set_error("moe_experts_backward: out of memory for %lld rows", (long long)R);
    moe_bw b = {
        .dtype = dtype, .act = act, .es = es, .k_gate = k_gate, .k_lin = k_lin, .k = k, .d_in = d_in, .d_e = d_e,
        .d_out = d_out, .stream = (size_t)R * (size_t)d_in * es >= MOE_STREAM_MIN, .td = dw_down ? (d_out + TILE_ROWS - 1) / TILE_ROWS : 0,
        .tg = dw_gate_up ? (2 * d_e + TILE_ROWS - 1) / TILE_ROWS : 0, .perm = perm, .off = off, .du = du,
        .pre = pre, .y = y, .x = x, .p = p, .w_gate_up = w_gate_up, .w_down = w_down, .dp = dp,
        .dw_gate_up = dw_gate_up, .dw_down = dw_down, .dxg = dxg,
    };
    /* a dropped assignment has no sorted row (no tile writes its dp): its weight's gradient is 0 */
    if (dp)
        for (int64_t a = 0; a < A; a++)
            if (pos[a] < 0) memset((char *)dp + (size_t)a * es, 0, es);
    int64_t rmax = 0;
    for (int64_t e = 0; e < n; e++) rmax = off[e + 1] - off[e] > rmax ? off[e + 1] - off[e] : rmax;
    int nthr = team_size(), oom = 0;
    int rc = n >= 4 * (int64_t)nthr && nthr * rmax <= R ? bw_by_expert(&b, n, rmax, nthr, &oom)
                                                        : bw_by_tile(&b, n, R, &oom);
    if (rc)
        rc = oom ? tide_set_error("moe_experts_backward: out of memory for %lld rows", (long long)R)
                 : tide_set_error("moe_experts_backward: an expert product failed (%lld rows, d_in = %lld, d_e = "
                                  "%lld, d_out = %lld)", (long long)R, (long long)d_in, (long long)d_e, (long long)d_out);
    if (!rc && dx) {
        if (dtype == TIDE_F32) dx_rows_float(dx, (const float *)dxg, pos, m, k, d_in);
        else dx_rows_double(dx, (const double *)dxg, pos, m, k, d_in);
    }
    tide_scratch_free(TIDE_CPU_DEVICE, dxg);
    return rc;
}

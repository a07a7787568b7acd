/*
 * mla.c — causal attention of gated NoPE MLA on the CPU (kernels/backend.h: mla_attention; spec/mla.md §4,
 * §5): tiled, online softmax, document-causal masks from segment boundaries, the shared rope-slot key's
 * gradient summed over heads in a fixed order. float32 and float64. varlen_attention (spec/vision.md §3, §5),
 * bidirectional inside each segment, runs through BLAS (varlen_impl.h); the same tiled kernels, not causal,
 * take what BLAS's 32-bit sizes cannot (varlen_path below chooses).
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cblas.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include "cpu.h"
#include "fastmath.h"

#define T float
#define SFX f32
#define EXP exp_f32
#define GEMM cblas_sgemm
#include "mla_impl.h"
#include "varlen_impl.h"
#include "mla_decode_impl.h"
#include "mla_latent_impl.h"
#undef T
#undef SFX
#undef EXP
#undef GEMM
#define T double
#define SFX f64
#define EXP exp
#define GEMM cblas_dgemm
#include "mla_impl.h"
#include "varlen_impl.h"
#include "mla_decode_impl.h"
#include "mla_latent_impl.h"
#undef T
#undef SFX
#undef EXP
#undef GEMM

/* start[p] = flattened index of the segment start of token p, or NULL when cu is NULL; with end, also
   end[p] = the segment's end (one past its last token) */
static int segment_bounds(const int64_t *cu, int64_t n_seg, int64_t n, int64_t **out, int64_t **end)
{
    *out = NULL;
    if (end) *end = NULL;
    if (!cu) return 0;
    int64_t *s = malloc((size_t)(n > 0 ? n : 1) * sizeof *s), *e = end ? malloc((size_t)(n > 0 ? n : 1) * sizeof *e) : NULL;
    if (!s || (end && !e)) { free(s); free(e); return tide_set_error("%s: out of memory", end ? "varlen_attention" : "mla_attention"); }
    for (int64_t g = 0; g < n_seg; g++)
        for (int64_t p = cu[g]; p < cu[g + 1]; p++) {
            s[p] = cu[g];
            if (e) e[p] = cu[g + 1];
        }
    *out = s;
    if (end) *end = e;
    return 0;
}

static int check(const char *op, int dtype, const int64_t *cu, int64_t Tq, int64_t Tk)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s is not supported on the cpu backend (f32, f64)", op, tide_cpu_dtype_str(dtype));
    if (cu && Tq > Tk) return tide_set_error("%s: document boundaries need Tq <= Tk, got %lld and %lld", op, (long long)Tq, (long long)Tk);
    return 0;
}

/* the causal kernels' per-query starts with documents over the KEYS (cu over B·Tk; query i of row b is key
   position i + Tk − Tq, the last query on the last key): start[b·Tq + i] = b·Tq + (the key-row index where that
   key's document starts), the form key_range reads; NULL when cu is NULL. */
static int query_starts(const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk, int64_t **out)
{
    *out = NULL;
    if (!cu) return 0;
    int64_t n = B * Tq, off = Tk - Tq;
    int64_t *s = malloc((size_t)(n > 0 ? n : 1) * sizeof *s);
    if (!s) return tide_set_error("mla_attention: out of memory");
    for (int64_t g = 0; g < n_seg; g++)
        for (int64_t p = cu[g]; p < cu[g + 1]; p++) {
            int64_t b = p / Tk, i = p - b * Tk - off;       /* segments never cross a row start (load_boundaries) */
            if (i >= 0) s[b * Tq + i] = b * Tq + (cu[g] - b * Tk);
        }
    *out = s;
    return 0;
}

int tide_cpu_mla_attention(int dtype, void *out, void *lse, const void *q, const void *kn, const void *kr, const void *v,
                           const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn,
                           int64_t dr, int64_t dv, double scale)
{
    int64_t *start;
    if (check("mla_attention", dtype, cu, Tq, Tk) || query_starts(cu, n_seg, B, Tq, Tk, &start)) return -1;
    int rc = dtype == TIDE_F32 ? forward_f32(out, lse, q, kn, kr, v, start, NULL, B, Tq, Tk, H, dn, dr, dv, Tk - Tq, scale)
                               : forward_f64(out, lse, q, kn, kr, v, start, NULL, B, Tq, Tk, H, dn, dr, dv, Tk - Tq, scale);
    free(start);
    return rc;
}

int tide_cpu_mla_attention_backward(int dtype, void *gq, void *gkn, void *gkr, void *gv, const void *gout, const void *q,
                                    const void *kn, const void *kr, const void *v, const void *out, const void *lse,
                                    const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                                    int64_t dn, int64_t dr, int64_t dv, double scale)
{
    int64_t *start;
    if (check("mla_attention backward", dtype, cu, Tq, Tk) || query_starts(cu, n_seg, B, Tq, Tk, &start)) return -1;
    int rc = dtype == TIDE_F32
                 ? backward_f32(gq, gkn, gkr, gv, gout, q, kn, kr, v, out, lse, start, NULL, B, Tq, Tk, H, dn, dr, dv,
                                Tk - Tq, scale)
                 : backward_f64(gq, gkn, gkr, gv, gout, q, kn, kr, v, out, lse, start, NULL, B, Tq, Tk, H, dn, dr, dv,
                                Tk - Tq, scale);
    free(start);
    return rc;
}

/* ---- mla_latent_attention: the keys and values expanded from the latent a chunk at a time (mla_latent_impl.h) ---- */

int tide_cpu_mla_latent_attention(int dtype, void *out, void *lse, const void *q, const void *c, const void *kr,
                                  const void *w, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk,
                                  int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc, int64_t chunk, double scale)
{
    int64_t *start;
    if (check("mla_latent_attention", dtype, cu, Tq, Tk) || query_starts(cu, n_seg, B, Tq, Tk, &start)) return -1;
    int rc = dtype == TIDE_F32
                 ? latent_forward_f32(out, lse, q, c, kr, w, start, B, Tq, Tk, H, dn, dr, dv, dc, chunk, scale)
                 : latent_forward_f64(out, lse, q, c, kr, w, start, B, Tq, Tk, H, dn, dr, dv, dc, chunk, scale);
    free(start);
    return rc;
}

int tide_cpu_mla_latent_attention_backward(int dtype, void *gq, void *gc, void *gkr, void *gw, const void *gout,
                                           const void *q, const void *c, const void *kr, const void *w, const void *out,
                                           const void *lse, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq,
                                           int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc,
                                           int64_t chunk, double scale)
{
    int64_t *start;
    if (check("mla_latent_attention backward", dtype, cu, Tq, Tk) || query_starts(cu, n_seg, B, Tq, Tk, &start))
        return -1;
    int rc = dtype == TIDE_F32 ? latent_backward_f32(gq, gc, gkr, gw, gout, q, c, kr, w, out, lse, start, B, Tq, Tk, H,
                                                     dn, dr, dv, dc, chunk, scale)
                               : latent_backward_f64(gq, gc, gkr, gw, gout, q, c, kr, w, out, lse, start, B, Tq, Tk, H,
                                                     dn, dr, dv, dc, chunk, scale);
    free(start);
    return rc;
}

/* ---- varlen_attention: one packed row [T, H, D], bidirectional inside each segment (vision.md §3, §5) ---- */

static int varlen_check(const char *op, int dtype, const int64_t *cu, int64_t n_seg, int64_t T)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s is not supported on the cpu backend (f32, f64)", op, tide_cpu_dtype_str(dtype));
    if (!cu || n_seg < 0 || cu[0] != 0 || cu[n_seg] != T)
        return tide_set_error("%s: cu_seqlens must run from 0 to T = %lld", op, (long long)T);
    for (int64_t g = 0; g < n_seg; g++)
        if (cu[g + 1] < cu[g])
            return tide_set_error("%s: cu_seqlens decreases at %lld (%lld then %lld)", op, (long long)g,
                                  (long long)cu[g], (long long)cu[g + 1]);
    return 0;
}

/* longest first, ties in segment order */
static int by_length_desc(const void *a, const void *b)
{
    const int64_t *x = a, *y = b;
    return x[0] != y[0] ? (x[0] < y[0] ? 1 : -1) : (x[1] > y[1]) - (x[1] < y[1]);
}

/* the one place the path is chosen: 1 = BLAS (order = the non-empty segments longest first, Lmax the longest),
   0 = tiled, -1 = out of memory. BLAS takes every segment its 32-bit sizes reach: its scratch per thread,
   2 · VL_BQ · Lmax values, is linear in the segment and at most 128 / (H·D) of one input per thread; the tiled
   kernels (a tile of scratch, 5x slower) remain for H·D or a segment beyond INT_MAX */
static int varlen_path(const int64_t *cu, int64_t n_seg, int64_t H, int64_t D, int64_t **order, int64_t *n_order,
                       int64_t *Lmax)
{
    *order = NULL;
    *n_order = *Lmax = 0;
    for (int64_t g = 0; g < n_seg; g++)
        if (cu[g + 1] - cu[g] > *Lmax) *Lmax = cu[g + 1] - cu[g];
    if (H < 1 || D < 1 || H * D > INT_MAX || *Lmax > INT_MAX) return 0;
    int64_t *pair = malloc((size_t)(n_seg > 0 ? n_seg : 1) * 2 * sizeof *pair);
    if (!pair) return tide_set_error("varlen_attention: out of memory for %lld segments", (long long)n_seg);
    int64_t n = 0;
    for (int64_t g = 0; g < n_seg; g++)
        if (cu[g + 1] > cu[g]) {
            pair[2 * n] = cu[g + 1] - cu[g];
            pair[2 * n + 1] = g;
            n++;
        }
    qsort(pair, (size_t)n, 2 * sizeof *pair, by_length_desc);
    for (int64_t o = 0; o < n; o++) pair[o] = pair[2 * o + 1];
    *order = pair;
    *n_order = n;
    return 1;
}

int tide_cpu_varlen_attention(int dtype, void *out, void *lse, const void *q, const void *k, const void *v,
                              const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale)
{
    if (varlen_check("varlen_attention", dtype, cu, n_seg, T)) return -1;
    int64_t *order, n_order, Lmax;
    int path = varlen_path(cu, n_seg, H, D, &order, &n_order, &Lmax);
    if (path < 0) return -1;
    if (path == 1) {
        int rc = dtype == TIDE_F32 ? vl_forward_f32(out, lse, q, k, v, cu, order, n_order, Lmax, T, H, D, scale)
                                   : vl_forward_f64(out, lse, q, k, v, cu, order, n_order, Lmax, T, H, D, scale);
        free(order);
        return rc;
    }
    int64_t *start, *end;
    if (segment_bounds(cu, n_seg, T, &start, &end)) return -1;
    int rc = dtype == TIDE_F32 ? forward_f32(out, lse, q, k, NULL, v, start, end, 1, T, T, H, D, 0, D, 0, scale)
                               : forward_f64(out, lse, q, k, NULL, v, start, end, 1, T, T, H, D, 0, D, 0, scale);
    free(start);
    free(end);
    return rc;
}

int tide_cpu_varlen_attention_backward(int dtype, void *gq, void *gk, void *gv, const void *gout, const void *q,
                                       const void *k, const void *v, const void *out, const void *lse, const int64_t *cu,
                                       int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale)
{
    if (varlen_check("varlen_attention backward", dtype, cu, n_seg, T)) return -1;
    int64_t *order, n_order, Lmax;
    int path = varlen_path(cu, n_seg, H, D, &order, &n_order, &Lmax);
    if (path < 0) return -1;
    if (path == 1) {
        int rc = dtype == TIDE_F32
                     ? vl_backward_f32(gq, gk, gv, gout, q, k, v, out, lse, cu, order, n_order, Lmax, T, H, D, scale)
                     : vl_backward_f64(gq, gk, gv, gout, q, k, v, out, lse, cu, order, n_order, Lmax, T, H, D, scale);
        free(order);
        return rc;
    }
    int64_t *start, *end;
    if (segment_bounds(cu, n_seg, T, &start, &end)) return -1;
    int rc = dtype == TIDE_F32
                 ? backward_f32(gq, gk, NULL, gv, gout, q, k, NULL, v, out, lse, start, end, 1, T, T, H, D, 0, D, 0, scale)
                 : backward_f64(gq, gk, NULL, gv, gout, q, k, NULL, v, out, lse, start, end, 1, T, T, H, D, 0, D, 0, scale);
    free(start);
    free(end);
    return rc;
}

int tide_cpu_mla_decode_rows(int dtype, void *out, const void *qt, const void *qr, const void *c_new, const void *kr_new,
                             void *const *c_bufs, void *const *kr_bufs, const int64_t *lens, int64_t R, int64_t H,
                             int64_t dc, int64_t dr, double scale)
{
    if (check("mla_decode_rows", dtype, NULL, 0, 0)) return -1;
    return dtype == TIDE_F32 ? decode_rows_f32(out, qt, qr, c_new, kr_new, c_bufs, kr_bufs, lens, R, H, dc, dr, scale)
                             : decode_rows_f64(out, qt, qr, c_new, kr_new, c_bufs, kr_bufs, lens, R, H, dc, dr, scale);
}

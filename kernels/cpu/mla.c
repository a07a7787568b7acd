/*
 * mla.c — causal attention of gated NoPE MLA on the CPU (kernels/backend.h: mla_attention; spec/mla.md §4,
 * §5): tiled, online softmax, document-causal masks from segment boundaries, the shared rope-slot key's
 * gradient summed over heads in a fixed order. float32 and float64. The same kernels, not causal inside
 * each segment, are varlen_attention (spec/vision.md §3, §5).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu.h"
#include "fastmath.h"

#define T float
#define SFX f32
#define EXP exp_f32
#include "mla_impl.h"
#undef T
#undef SFX
#undef EXP
#define T double
#define SFX f64
#define EXP exp
#include "mla_impl.h"
#undef T
#undef SFX
#undef EXP

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

static int segment_starts(const int64_t *cu, int64_t n_seg, int64_t n, int64_t **out)
{
    return segment_bounds(cu, n_seg, n, out, NULL);
}

static int check(const char *op, int dtype, const int64_t *cu, int64_t Tq, int64_t Tk)
{
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s is not supported on the cpu backend (f32, f64)", op, tide_cpu_dtype_str(dtype));
    if (cu && Tq != Tk) return tide_set_error("%s: document boundaries need Tq = Tk, got %lld and %lld", op, (long long)Tq, (long long)Tk);
    return 0;
}

int tide_cpu_mla_attention(int dtype, void *out, void *lse, const void *q, const void *kn, const void *kr, const void *v,
                           const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn,
                           int64_t dr, int64_t dv, double scale)
{
    int64_t *start;
    if (check("mla_attention", dtype, cu, Tq, Tk) || segment_starts(cu, n_seg, B * Tq, &start)) return -1;
    int rc = dtype == TIDE_F32 ? forward_f32(out, lse, q, kn, kr, v, start, NULL, B, Tq, Tk, H, dn, dr, dv, scale)
                               : forward_f64(out, lse, q, kn, kr, v, start, NULL, B, Tq, Tk, H, dn, dr, dv, scale);
    free(start);
    return rc;
}

int tide_cpu_mla_attention_backward(int dtype, void *gq, void *gkn, void *gkr, void *gv, const void *gout, const void *q,
                                    const void *kn, const void *kr, const void *v, const void *out, const void *lse,
                                    const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                                    int64_t dn, int64_t dr, int64_t dv, double scale)
{
    int64_t *start;
    if (check("mla_attention backward", dtype, cu, Tq, Tk) || segment_starts(cu, n_seg, B * Tq, &start)) return -1;
    int rc = dtype == TIDE_F32
                 ? backward_f32(gq, gkn, gkr, gv, gout, q, kn, kr, v, out, lse, start, NULL, B, Tq, Tk, H, dn, dr, dv, scale)
                 : backward_f64(gq, gkn, gkr, gv, gout, q, kn, kr, v, out, lse, start, NULL, B, Tq, Tk, H, dn, dr, dv, scale);
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

int tide_cpu_varlen_attention(int dtype, void *out, void *lse, const void *q, const void *k, const void *v,
                              const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale)
{
    int64_t *start, *end;
    if (varlen_check("varlen_attention", dtype, cu, n_seg, T) || segment_bounds(cu, n_seg, T, &start, &end)) return -1;
    int rc = dtype == TIDE_F32 ? forward_f32(out, lse, q, k, NULL, v, start, end, 1, T, T, H, D, 0, D, scale)
                               : forward_f64(out, lse, q, k, NULL, v, start, end, 1, T, T, H, D, 0, D, scale);
    free(start);
    free(end);
    return rc;
}

int tide_cpu_varlen_attention_backward(int dtype, void *gq, void *gk, void *gv, const void *gout, const void *q,
                                       const void *k, const void *v, const void *out, const void *lse, const int64_t *cu,
                                       int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale)
{
    int64_t *start, *end;
    if (varlen_check("varlen_attention backward", dtype, cu, n_seg, T) || segment_bounds(cu, n_seg, T, &start, &end))
        return -1;
    int rc = dtype == TIDE_F32
                 ? backward_f32(gq, gk, NULL, gv, gout, q, k, NULL, v, out, lse, start, end, 1, T, T, H, D, 0, D, scale)
                 : backward_f64(gq, gk, NULL, gv, gout, q, k, NULL, v, out, lse, start, end, 1, T, T, H, D, 0, D, scale);
    free(start);
    free(end);
    return rc;
}

/*
 * mla.c — causal attention of gated NoPE MLA on the CPU (kernels/backend.h: mla_attention; spec/mla.md §4,
 * §5): tiled, online softmax, document-causal masks from segment boundaries, the shared rope-slot key's
 * gradient summed over heads in a fixed order. float32 and float64.
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

/* start[p] = flattened index of the segment start of token p, or NULL when cu is NULL */
static int segment_starts(const int64_t *cu, int64_t n_seg, int64_t n, int64_t **out)
{
    *out = NULL;
    if (!cu) return 0;
    int64_t *s = malloc((size_t)(n > 0 ? n : 1) * sizeof *s);
    if (!s) return tide_set_error("mla_attention: out of memory");
    for (int64_t g = 0; g < n_seg; g++)
        for (int64_t p = cu[g]; p < cu[g + 1]; p++) s[p] = cu[g];
    *out = s;
    return 0;
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
    int rc = dtype == TIDE_F32 ? forward_f32(out, lse, q, kn, kr, v, start, B, Tq, Tk, H, dn, dr, dv, scale)
                               : forward_f64(out, lse, q, kn, kr, v, start, B, Tq, Tk, H, dn, dr, dv, scale);
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
                 ? backward_f32(gq, gkn, gkr, gv, gout, q, kn, kr, v, out, lse, start, B, Tq, Tk, H, dn, dr, dv, scale)
                 : backward_f64(gq, gkn, gkr, gv, gout, q, kn, kr, v, out, lse, start, B, Tq, Tk, H, dn, dr, dv, scale);
    free(start);
    return rc;
}

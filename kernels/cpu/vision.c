/*
 * vision.c — the ViT position kernels (spec/vision.md §4; kernels/backend.h documents the entries).
 *
 * rope2d: complex slot j of a head rotates the adjacent pair (x[2j], x[2j+1]) by φ = p · θ^(−4⌊j/2⌋/hd), p = col
 * for even j and row for odd j (MoonViT's layout). Angles, cosines and sines in double, once per distinct position
 * value (a table [max p + 1, hd/2, 2]) when positions are small and repeat, else once per token, for all heads.
 * Each pair is read before it is written, so out may alias x.
 *
 * pos_interp: PyTorch's bicubic upsample (aten upsample_bicubic2d, align_corners = False, sizes given so the scale
 * is in/out): source index s = (o + 0.5)·in/out − 0.5 (not clamped for cubic), i0 = min(⌊s⌋, in − 1),
 * t = clamp(s − i0, 0, 1), taps i0 − 1 .. i0 + 2 clamped to [0, in − 1] with Keys' weights (a = −0.75); the value
 * is Σ_j wy_j Σ_i wx_i table[y_j, x_i] (x inner, as aten). Weights and sums in double. An image on the table's
 * own grid is a memcpy (oracle 6: bitwise). The backward is the transpose, separable and gather-form: per
 * image, tmp[oy, gx] = Σ_{ox → gx} wx · dout[oy, ox], then acc[gy, gx] += Σ_{oy → gy} wy · tmp[oy, gx], every
 * sum in a fixed order (taps listed by output index), images in order: bitwise reproducible, no atomics.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "cpu.h"

/* ---- rope2d ---------------------------------------------------------------------------------------------------- */
/* tab (when not NULL): cos, sin of sign · p · freq[j/2] for every position value p in [0, np) and slot j,
   [np, half, 2], so the angles are computed once per distinct row or column value rather than once per token (the
   same doubles either way: the results do not depend on which path ran) */
#define DEFINE_ROPE2D(T, SFX)                                                                                      \
static void rope2d_##SFX(T *out, const T *x, const void *pos, int pos64, const double *freq, const double *tab,  \
                         int64_t Tn, int64_t H, int64_t hd, double sign)                                         \
{                                                                                                                  \
    int64_t half = hd / 2;                                                                                         \
    _Pragma("omp parallel for if(Tn * H * hd > TIDE_OMP_MIN)")                                                     \
    for (int64_t t = 0; t < Tn; t++) {                                                                             \
        int64_t prow = pos64 ? ((const int64_t *)pos)[2 * t] : ((const int32_t *)pos)[2 * t];                      \
        int64_t pcol = pos64 ? ((const int64_t *)pos)[2 * t + 1] : ((const int32_t *)pos)[2 * t + 1];              \
        double row = (double)prow, col = (double)pcol;                                                            \
        double cs[2 * 256];   /* hd/2 <= 256 slots on the stack; larger heads use the loop below */              \
        int64_t nslot = half < 256 ? half : 256;                                                                   \
        if (tab) {                                                                                                 \
            const double *tr = tab + prow * half * 2, *tc = tab + pcol * half * 2;                                 \
            for (int64_t j = 0; j < nslot; j++) {                                                                  \
                const double *src = j % 2 ? tr : tc;                                                               \
                cs[2 * j] = src[2 * j];                                                                            \
                cs[2 * j + 1] = src[2 * j + 1];                                                                    \
            }                                                                                                      \
        } else {                                                                                                   \
            for (int64_t j = 0; j < nslot; j++) {                                                                  \
                double phi = sign * (j % 2 ? row : col) * freq[j / 2];                                             \
                cs[2 * j] = cos(phi);                                                                              \
                cs[2 * j + 1] = sin(phi);                                                                          \
            }                                                                                                      \
        }                                                                                                          \
        for (int64_t h = 0; h < H; h++) {                                                                          \
            const T *xr = x + (t * H + h) * hd;                                                                    \
            T *yr = out + (t * H + h) * hd;                                                                        \
            for (int64_t j = 0; j < half; j++) {                                                                   \
                double c, s;                                                                                       \
                if (j < nslot) { c = cs[2 * j]; s = cs[2 * j + 1]; }                                               \
                else { double phi = sign * (j % 2 ? row : col) * freq[j / 2]; c = cos(phi); s = sin(phi); }       \
                double a = (double)xr[2 * j], b = (double)xr[2 * j + 1];                                           \
                yr[2 * j] = (T)(a * c - b * s);                                                                    \
                yr[2 * j + 1] = (T)(a * s + b * c);                                                                \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
}

DEFINE_ROPE2D(float, f32)
DEFINE_ROPE2D(double, f64)

int tide_cpu_rope2d(int dtype, void *out, const void *x, const void *pos, int pos_dtype, int64_t T, int64_t H,
                    int64_t hd, double theta, int inverse)
{
    if (T < 0 || H < 0 || hd <= 0 || hd % 4 != 0)
        return tide_set_error("rope2d: sizes T=%lld H=%lld head_dim=%lld (expected head_dim a positive multiple of 4)",
                              (long long)T, (long long)H, (long long)hd);
    if (!(theta > 0.0)) return tide_set_error("rope2d: theta must be positive, got %g", theta);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("rope2d: dtype %s not supported on cpu (expected f32 or f64)", tide_cpu_dtype_str(dtype));
    if (pos_dtype != TIDE_I32 && pos_dtype != TIDE_I64)
        return tide_set_error("rope2d: pos dtype %s not supported (i32, i64)", tide_cpu_dtype_str(pos_dtype));
    if (T * H == 0) return 0;
    int64_t nf = hd / 4;
    double *freq = malloc((size_t)nf * sizeof *freq);
    if (!freq) return tide_set_error("rope2d: out of memory");
    for (int64_t i = 0; i < nf; i++) freq[i] = pow(theta, -4.0 * (double)i / (double)hd);
    double sign = inverse ? -1.0 : 1.0;
    /* the angle table, when every position is in [0, 4096) and there are fewer distinct values than tokens */
    int pos64 = pos_dtype == TIDE_I64;
    int64_t lo = INT64_MAX, hi = INT64_MIN, half = hd / 2;
    for (int64_t i = 0; i < 2 * T; i++) {
        int64_t p = pos64 ? ((const int64_t *)pos)[i] : ((const int32_t *)pos)[i];
        lo = p < lo ? p : lo;
        hi = p > hi ? p : hi;
    }
    double *tab = NULL;
    if (lo >= 0 && hi < 4096 && hi + 1 < T) {
        int64_t nslot = half < 256 ? half : 256;
        tab = malloc((size_t)(hi + 1) * (size_t)half * 2 * sizeof *tab);
        for (int64_t p = 0; tab && p <= hi; p++)
            for (int64_t j = 0; j < nslot; j++) {
                double phi = sign * (double)p * freq[j / 2];
                tab[(p * half + j) * 2] = cos(phi);
                tab[(p * half + j) * 2 + 1] = sin(phi);
            }
    }
    if (dtype == TIDE_F32) rope2d_f32(out, x, pos, pos64, freq, tab, T, H, hd, sign);
    else rope2d_f64(out, x, pos, pos64, freq, tab, T, H, hd, sign);
    free(tab);
    free(freq);
    return 0;
}

/* ---- pos_interp ------------------------------------------------------------------------------------------------ */
/* the 4 taps of output index o on an axis resampled from n_in to n_out (aten's HelperInterpCubic) */
static void cubic_taps(int64_t o, int64_t n_in, int64_t n_out, int64_t idx[4], double w[4])
{
    const double A = -0.75;
    double scale = (double)n_in / (double)n_out;
    double s = scale * ((double)o + 0.5) - 0.5;
    int64_t i0 = (int64_t)floor(s);
    if (i0 > n_in - 1) i0 = n_in - 1;
    double t = s - (double)i0;
    t = t < 0 ? 0 : t > 1 ? 1 : t;
    double x1 = t + 1.0, x2 = 1.0 - t, x3 = x2 + 1.0;   /* aten's order of operations */
    w[0] = ((A * x1 - 5.0 * A) * x1 + 8.0 * A) * x1 - 4.0 * A;
    w[1] = ((A + 2.0) * t - (A + 3.0)) * t * t + 1.0;
    w[2] = ((A + 2.0) * x2 - (A + 3.0)) * x2 * x2 + 1.0;
    w[3] = ((A * x3 - 5.0 * A) * x3 + 8.0 * A) * x3 - 4.0 * A;
    for (int k = 0; k < 4; k++) {
        int64_t i = i0 - 1 + k;
        idx[k] = i < 0 ? 0 : i > n_in - 1 ? n_in - 1 : i;
    }
}

#define DEFINE_POS_INTERP(T, SFX)                                                                                  \
static void pos_interp_image_##SFX(T *out, const T *tab, int64_t Gh, int64_t Gw, int64_t d, int64_t h, int64_t w, \
                                   const int64_t *iy, const double *wy, const int64_t *ix, const double *wx)     \
{                                                                                                                  \
    (void)Gh;                                                                                                      \
    _Pragma("omp parallel for if(h * w * d * 16 > TIDE_OMP_MIN)")                                                 \
    for (int64_t k = 0; k < h * w; k++) {                                                                          \
        int64_t oy = k / w, ox = k % w;                                                                            \
        const T *r[4][4];                                                                                          \
        for (int j = 0; j < 4; j++)                                                                                \
            for (int i = 0; i < 4; i++) r[j][i] = tab + (iy[4 * oy + j] * Gw + ix[4 * ox + i]) * d;               \
        const double *a = wy + 4 * oy, *b = wx + 4 * ox;                                                           \
        T *o = out + k * d;                                                                                        \
        for (int64_t c = 0; c < d; c++) {                                                                          \
            double acc = 0;                                                                                        \
            for (int j = 0; j < 4; j++) {                                                                          \
                double v = b[0] * (double)r[j][0][c] + b[1] * (double)r[j][1][c] + b[2] * (double)r[j][2][c] +    \
                           b[3] * (double)r[j][3][c];                                                              \
                acc += a[j] * v;                                                                                   \
            }                                                                                                      \
            o[c] = (T)acc;                                                                                         \
        }                                                                                                          \
    }                                                                                                              \
}

DEFINE_POS_INTERP(float, f32)
DEFINE_POS_INTERP(double, f64)

static int check_pos_interp(const char *what, int dtype, const int64_t *grids, int64_t n, int64_t Gh, int64_t Gw,
                            int64_t d, int64_t *max_side)
{
    if (n < 0 || Gh < 1 || Gw < 1 || d < 0)
        return tide_set_error("%s: sizes n=%lld G=%lldx%lld d=%lld", what, (long long)n, (long long)Gh, (long long)Gw,
                              (long long)d);
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s not supported on cpu (expected f32 or f64)", what, tide_cpu_dtype_str(dtype));
    int64_t m = 1;
    for (int64_t i = 0; i < 2 * n; i++) {
        if (grids[i] < 1) return tide_set_error("%s: image %lld has a grid side %lld", what, (long long)(i / 2), (long long)grids[i]);
        if (grids[i] > m) m = grids[i];
    }
    *max_side = m;
    return 0;
}

int tide_cpu_pos_interp(int dtype, void *out, const void *table, const int64_t *grids, int64_t n, int64_t Gh,
                        int64_t Gw, int64_t d)
{
    int64_t m = 0;
    if (check_pos_interp("pos_interp", dtype, grids, n, Gh, Gw, d, &m)) return -1;
    size_t es = dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    int64_t *iy = malloc((size_t)(8 * m) * sizeof *iy);
    double *wy = malloc((size_t)(8 * m) * sizeof *wy);
    if (!iy || !wy) { free(iy); free(wy); return tide_set_error("pos_interp: out of memory"); }
    int64_t *ix = iy + 4 * m;
    double *wx = wy + 4 * m;
    char *o = out;
    for (int64_t g = 0; g < n; g++) {
        int64_t h = grids[2 * g], w = grids[2 * g + 1];
        if (h == Gh && w == Gw) {
            memcpy(o, table, (size_t)(h * w * d) * es);
        } else {
            for (int64_t y = 0; y < h; y++) cubic_taps(y, Gh, h, iy + 4 * y, wy + 4 * y);
            for (int64_t x = 0; x < w; x++) cubic_taps(x, Gw, w, ix + 4 * x, wx + 4 * x);
            if (dtype == TIDE_F32) pos_interp_image_f32((float *)o, table, Gh, Gw, d, h, w, iy, wy, ix, wx);
            else pos_interp_image_f64((double *)o, table, Gh, Gw, d, h, w, iy, wy, ix, wx);
        }
        o += (size_t)(h * w * d) * es;
    }
    free(iy); free(wy);
    return 0;
}

/* the transposed taps of one axis: for each table index g, the (output index, weight) pairs that read it, in
   output order; zero weights left out (an exact 0 contributes nothing but would carry a NaN of dout) */
typedef struct { int64_t *start, *o; double *w; } taps_t;

static int transpose_taps(taps_t *tt, int64_t n_in, int64_t n_out)
{
    tt->start = calloc((size_t)(n_in + 1), sizeof *tt->start);
    tt->o = malloc((size_t)(4 * n_out) * sizeof *tt->o);
    tt->w = malloc((size_t)(4 * n_out) * sizeof *tt->w);
    if (!tt->start || !tt->o || !tt->w) return -1;
    int64_t idx[4], *fill = calloc((size_t)n_in, sizeof *fill);
    double w[4];
    if (!fill) return -1;
    for (int64_t o = 0; o < n_out; o++) {
        cubic_taps(o, n_in, n_out, idx, w);
        for (int k = 0; k < 4; k++) if (w[k] != 0) tt->start[idx[k] + 1]++;
    }
    for (int64_t g = 0; g < n_in; g++) tt->start[g + 1] += tt->start[g];
    for (int64_t o = 0; o < n_out; o++) {
        cubic_taps(o, n_in, n_out, idx, w);
        for (int k = 0; k < 4; k++)
            if (w[k] != 0) {
                int64_t at = tt->start[idx[k]] + fill[idx[k]]++;
                tt->o[at] = o;
                tt->w[at] = w[k];
            }
    }
    free(fill);
    return 0;
}

static void free_taps(taps_t *tt) { free(tt->start); free(tt->o); free(tt->w); }

static inline double ld(int dtype, const void *p, int64_t i)
{
    return dtype == TIDE_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

int tide_cpu_pos_interp_backward(int dtype, void *dtable, const void *dout, const int64_t *grids, int64_t n,
                                 int64_t Gh, int64_t Gw, int64_t d)
{
    int64_t m = 0;
    if (check_pos_interp("pos_interp backward", dtype, grids, n, Gh, Gw, d, &m)) return -1;
    int64_t cells = Gh * Gw * d;
    double *acc = calloc((size_t)(cells > 0 ? cells : 1), sizeof *acc);
    double *tmp = malloc((size_t)(m * Gw * d > 0 ? m * Gw * d : 1) * sizeof *tmp);
    if (!acc || !tmp) { free(acc); free(tmp); return tide_set_error("pos_interp backward: out of memory"); }
    int rc = 0;
    int64_t off = 0;   /* the image's first token */
    for (int64_t g = 0; g < n && !rc; g++) {
        int64_t h = grids[2 * g], w = grids[2 * g + 1];
        if (h == Gh && w == Gw) {
            _Pragma("omp parallel for if(cells > TIDE_OMP_MIN)")
            for (int64_t e = 0; e < cells; e++) acc[e] += ld(dtype, dout, off * d + e);
            off += h * w;
            continue;
        }
        taps_t ty = {0}, tx = {0};
        if (transpose_taps(&ty, Gh, h) || transpose_taps(&tx, Gw, w)) {
            rc = tide_set_error("pos_interp backward: out of memory");
        } else {
            /* along x: tmp[oy, gx, :] = Σ wx · dout[oy, ox, :] */
            _Pragma("omp parallel for if(h * Gw * d > TIDE_OMP_MIN)")
            for (int64_t k = 0; k < h * Gw; k++) {
                int64_t oy = k / Gw, gx = k % Gw;
                double *t = tmp + k * d;
                for (int64_t c = 0; c < d; c++) t[c] = 0;
                for (int64_t e = tx.start[gx]; e < tx.start[gx + 1]; e++) {
                    int64_t src = (off + oy * w + tx.o[e]) * d;
                    double wt = tx.w[e];
                    for (int64_t c = 0; c < d; c++) t[c] += wt * ld(dtype, dout, src + c);
                }
            }
            /* along y: acc[gy, gx, :] += Σ wy · tmp[oy, gx, :] */
            _Pragma("omp parallel for if(cells > TIDE_OMP_MIN)")
            for (int64_t k = 0; k < Gh * Gw; k++) {
                int64_t gy = k / Gw, gx = k % Gw;
                double *a = acc + k * d;
                for (int64_t e = ty.start[gy]; e < ty.start[gy + 1]; e++) {
                    const double *t = tmp + (ty.o[e] * Gw + gx) * d;
                    double wt = ty.w[e];
                    for (int64_t c = 0; c < d; c++) a[c] += wt * t[c];
                }
            }
        }
        free_taps(&ty); free_taps(&tx);
        off += h * w;
    }
    if (!rc) {
        if (dtype == TIDE_F32) for (int64_t e = 0; e < cells; e++) ((float *)dtable)[e] = (float)acc[e];
        else memcpy(dtable, acc, (size_t)cells * sizeof *acc);
    }
    free(acc); free(tmp);
    return rc;
}

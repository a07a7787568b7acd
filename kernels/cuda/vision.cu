/*
 * vision.cu — the ViT position kernels (spec/vision.md §4), the CUDA twins of kernels/cpu/vision.c (which says
 * the formulas): 2D RoPE in MoonViT's adjacent-pair layout, and the bicubic resampling of the position table
 * (PyTorch's bicubic, align_corners = False, a = −0.75) with its transpose.
 *
 * rope2d: one thread per (token, head, slot); the angle, its cosine and sine in double (positions < 512, but the
 * f64 path must match the CPU to rounding), the pair rotated in double. out may alias x.
 * pos_interp forward: one thread per (token, channel) of an image, 16 taps in double; one launch per image, an
 * image on the table's own grid is a device copy (bitwise). backward, gather form without atomics: the transposed
 * taps of each axis (for every table index, the output indices reading it, in output order) are built on the host;
 * per image, stage x: tmp[oy, gx, c] = Σ wx · dout[oy, ox, c]; stage y: acc[gy, gx, c] += Σ wy · tmp[oy, gx, c],
 * each cell owned by one thread and the images added in order (stream order), so the result is bitwise
 * reproducible. tmp and acc are double; acc is converted to the storage type at the end.
 */
#include "common.cuh"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- rope2d ---------------------------------------------------------------------------------------------------- */
template <typename T> __global__ void rope2d_kernel(T *out, const T *x, const void *pos, int pos64, int64_t H,
                                                    int64_t half, int64_t hd, double theta, double sign,
                                                    int64_t npairs)
{
    TIDE_GRID_LOOP(k, npairs) {
        int64_t j = k % half, row = k / half;   /* row = (t, h) */
        int64_t t = row / H;
        double p = (double)tide_ld_index(pos, pos64, 2 * t + (j % 2 ? 0 : 1));   /* col for even slots, row for odd */
        double phi = sign * p * pow(theta, -4.0 * (double)(j / 2) / (double)hd);
        double sn, c;
        sincos(phi, &sn, &c);
        int64_t base = row * hd + 2 * j;
        double a = (double)tide_ld(x, base), b = (double)tide_ld(x, base + 1);
        out[base] = tide_from_f64<T>(a * c - b * sn);
        out[base + 1] = tide_from_f64<T>(a * sn + b * c);
    }
}

int tide_cuda_rope2d(int dtype, void *out, const void *x, const void *pos, int pos_dtype, int64_t T, int64_t H,
                     int64_t hd, double theta, int inverse)
{
    if (T < 0 || H < 0 || hd <= 0 || hd % 4 != 0)
        return tide_set_error("rope2d: sizes T=%lld H=%lld head_dim=%lld (expected head_dim a positive multiple of 4)",
                              (long long)T, (long long)H, (long long)hd);
    if (!(theta > 0.0)) return tide_set_error("rope2d: theta must be positive, got %g", theta);
    if (tide_cuda_check_index_dtype(pos_dtype, "rope2d pos")) return -1;
    int64_t half = hd / 2, npairs = T * H * half;
    if (npairs == 0) return 0;
    TIDE_STREAM(s);
    double sign = inverse ? -1.0 : 1.0;
    int p64 = pos_dtype == TIDE_I64;
    TIDE_FLOAT_DISPATCH(dtype, "rope2d", {
        rope2d_kernel<T><<<tide_blocks(npairs), TIDE_THREADS, 0, s>>>((T *)out, (const T *)x, pos, p64, H, half, hd, theta,
                                                                       sign, npairs);
        TIDE_CU_LAUNCH("rope2d kernel");
    });
    return 0;
}

/* ---- pos_interp ------------------------------------------------------------------------------------------------ */
/* the 4 taps of output index o on an axis resampled from n_in to n_out (kernels/cpu/vision.c: cubic_taps) */
__host__ __device__ static inline void cubic_taps(int64_t o, int64_t n_in, int64_t n_out, int64_t idx[4], double w[4])
{
    const double A = -0.75;
    double scale = (double)n_in / (double)n_out;
    double s = scale * ((double)o + 0.5) - 0.5;
    int64_t i0 = (int64_t)floor(s);
    if (i0 > n_in - 1) i0 = n_in - 1;
    double t = s - (double)i0;
    t = t < 0 ? 0 : t > 1 ? 1 : t;
    double x1 = t + 1.0, x2 = 1.0 - t, x3 = x2 + 1.0;
    w[0] = ((A * x1 - 5.0 * A) * x1 + 8.0 * A) * x1 - 4.0 * A;
    w[1] = ((A + 2.0) * t - (A + 3.0)) * t * t + 1.0;
    w[2] = ((A + 2.0) * x2 - (A + 3.0)) * x2 * x2 + 1.0;
    w[3] = ((A * x3 - 5.0 * A) * x3 + 8.0 * A) * x3 - 4.0 * A;
    for (int k = 0; k < 4; k++) {
        int64_t i = i0 - 1 + k;
        idx[k] = i < 0 ? 0 : i > n_in - 1 ? n_in - 1 : i;
    }
}

template <typename T> __global__ void pos_interp_kernel(T *out, const T *tab, int64_t Gh, int64_t Gw, int64_t d,
                                                        int64_t h, int64_t w)
{
    TIDE_GRID_LOOP(k, h * w * d) {
        int64_t c = k % d, tok = k / d, oy = tok / w, ox = tok % w;
        int64_t iy[4], ix[4];
        double wy[4], wx[4];
        cubic_taps(oy, Gh, h, iy, wy);
        cubic_taps(ox, Gw, w, ix, wx);
        double acc = 0;
        for (int j = 0; j < 4; j++) {
            const T *r = tab + iy[j] * Gw * d + c;
            double v = wx[0] * (double)tide_ld(r, ix[0] * d) + wx[1] * (double)tide_ld(r, ix[1] * d) +
                       wx[2] * (double)tide_ld(r, ix[2] * d) + wx[3] * (double)tide_ld(r, ix[3] * d);
            acc += wy[j] * v;
        }
        out[k] = tide_from_f64<T>(acc);
    }
}

static int check_pos_interp(const char *what, const int64_t *grids, int64_t n, int64_t Gh, int64_t Gw, int64_t d,
                            int64_t *max_side)
{
    if (n < 0 || Gh < 1 || Gw < 1 || d < 0)
        return tide_set_error("%s: sizes n=%lld G=%lldx%lld d=%lld", what, (long long)n, (long long)Gh, (long long)Gw,
                              (long long)d);
    int64_t m = 1;
    for (int64_t i = 0; i < 2 * n; i++) {
        if (grids[i] < 1)
            return tide_set_error("%s: image %lld has a grid side %lld", what, (long long)(i / 2), (long long)grids[i]);
        if (grids[i] > m) m = grids[i];
    }
    *max_side = m;
    return 0;
}

int tide_cuda_pos_interp(int dtype, void *out, const void *table, const int64_t *grids, int64_t n, int64_t Gh,
                         int64_t Gw, int64_t d)
{
    int64_t m = 0;
    if (check_pos_interp("pos_interp", grids, n, Gh, Gw, d, &m)) return -1;
    TIDE_STREAM(s);
    TIDE_FLOAT_DISPATCH(dtype, "pos_interp", {
        T *o = (T *)out;
        for (int64_t g = 0; g < n; g++) {
            int64_t h = grids[2 * g], w = grids[2 * g + 1], cnt = h * w * d;
            if (cnt == 0) continue;
            if (h == Gh && w == Gw) {
                TIDE_CU(cudaMemcpyAsync(o, table, (size_t)cnt * sizeof(T), cudaMemcpyDeviceToDevice, s), "pos_interp copy");
            } else {
                pos_interp_kernel<T><<<tide_blocks(cnt), TIDE_THREADS, 0, s>>>(o, (const T *)table, Gh, Gw, d, h, w);
                TIDE_CU_LAUNCH("pos_interp kernel");
            }
            o += cnt;
        }
    });
    return 0;
}

/* the transposed taps of one axis into host arrays: start [n_in + 1], then (o, w) pairs in output order;
   exact-zero weights left out (as on the CPU) */
static void transpose_taps(int64_t n_in, int64_t n_out, int64_t *start, int64_t *os, double *ws, int64_t *fill)
{
    int64_t idx[4];
    double w[4];
    memset(start, 0, (size_t)(n_in + 1) * sizeof *start);
    memset(fill, 0, (size_t)n_in * sizeof *fill);
    for (int64_t o = 0; o < n_out; o++) {
        cubic_taps(o, n_in, n_out, idx, w);
        for (int k = 0; k < 4; k++) if (w[k] != 0) start[idx[k] + 1]++;
    }
    for (int64_t g = 0; g < n_in; g++) start[g + 1] += start[g];
    for (int64_t o = 0; o < n_out; o++) {
        cubic_taps(o, n_in, n_out, idx, w);
        for (int k = 0; k < 4; k++)
            if (w[k] != 0) {
                int64_t at = start[idx[k]] + fill[idx[k]]++;
                os[at] = o;
                ws[at] = w[k];
            }
    }
}

/* stage x of one image: tmp[oy, gx, c] = Σ_{(ox, w) of gx} w · dout[oy, ox, c] */
template <typename T> __global__ void pos_interp_bwd_x(double *tmp, const T *dout, const int64_t *start,
                                                       const int64_t *os, const double *ws, int64_t Gw, int64_t d,
                                                       int64_t h, int64_t w)
{
    TIDE_GRID_LOOP(k, h * Gw * d) {
        int64_t c = k % d, cell = k / d, oy = cell / Gw, gx = cell % Gw;
        double a = 0;
        for (int64_t e = start[gx]; e < start[gx + 1]; e++) a += ws[e] * (double)tide_ld(dout, (oy * w + os[e]) * d + c);
        tmp[k] = a;
    }
}

/* stage y: acc[gy, gx, c] += Σ_{(oy, w) of gy} w · tmp[oy, gx, c]; identity images add dout itself (tmp = NULL) */
template <typename T> __global__ void pos_interp_bwd_y(double *acc, const double *tmp, const T *dout,
                                                       const int64_t *start, const int64_t *os, const double *ws,
                                                       int64_t Gh, int64_t Gw, int64_t d)
{
    TIDE_GRID_LOOP(k, Gh * Gw * d) {
        if (!tmp) {
            acc[k] += (double)tide_ld(dout, k);
            continue;
        }
        int64_t c = k % d, cell = k / d, gy = cell / Gw, gx = cell % Gw;
        double a = acc[k];
        for (int64_t e = start[gy]; e < start[gy + 1]; e++) a += ws[e] * tmp[(os[e] * Gw + gx) * d + c];
        acc[k] = a;
    }
}

template <typename T> __global__ void pos_interp_store(T *dtable, const double *acc, int64_t n)
{
    TIDE_GRID_LOOP(k, n) dtable[k] = tide_from_f64<T>(acc[k]);
}

int tide_cuda_pos_interp_backward(int dtype, void *dtable, const void *dout, const int64_t *grids, int64_t n,
                                  int64_t Gh, int64_t Gw, int64_t d)
{
    int64_t m = 0;
    if (check_pos_interp("pos_interp backward", grids, n, Gh, Gw, d, &m)) return -1;
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("pos_interp backward: dtype %s is not supported on the cuda backend (f32, f64, bf16)",
                              tide_cuda_dtype_str(dtype));
    int64_t cells = Gh * Gw * d;
    if (cells == 0) return 0;
    TIDE_STREAM(s);
    /* every image's transposed taps in one host block, uploaded once: per image [start_y | start_x | o_y | o_x]
       (int64) and [w_y | w_x] (double) */
    int64_t ni = 0, nw = 0;
    for (int64_t g = 0; g < n; g++) {
        ni += (Gh + 1) + (Gw + 1) + 4 * grids[2 * g] + 4 * grids[2 * g + 1];
        nw += 4 * grids[2 * g] + 4 * grids[2 * g + 1];
    }
    size_t ibytes = (size_t)ni * sizeof(int64_t), wbytes = (size_t)nw * sizeof(double);
    char *host = (char *)malloc(ibytes + wbytes + 1);
    int64_t *fill = (int64_t *)malloc((size_t)(Gh > Gw ? Gh : Gw) * sizeof(int64_t));
    if (!host || !fill) {
        free(host); free(fill);
        return tide_set_error("pos_interp backward: out of memory for the tap tables");
    }
    int64_t *hi = (int64_t *)host;
    double *hw = (double *)(host + ibytes);
    {
        int64_t pi = 0, pw = 0;
        for (int64_t g = 0; g < n; g++) {
            int64_t h = grids[2 * g], w = grids[2 * g + 1];
            int64_t *sy = hi + pi, *sx = sy + Gh + 1, *oy = sx + Gw + 1, *ox = oy + 4 * h;
            transpose_taps(Gh, h, sy, oy, hw + pw, fill);
            transpose_taps(Gw, w, sx, ox, hw + pw + 4 * h, fill);
            pi += (Gh + 1) + (Gw + 1) + 4 * h + 4 * w;
            pw += 4 * h + 4 * w;
        }
    }
    free(fill);
    char *dev = NULL;
    double *acc = NULL, *tmp = NULL;
    size_t tbytes = (size_t)(m * Gw * d) * sizeof(double);
    cudaError_t e = tide_cuda_alloc((void **)&dev, ibytes + wbytes + 1, s);
    if (e == cudaSuccess) e = tide_cuda_alloc((void **)&acc, (size_t)cells * sizeof(double), s);
    if (e == cudaSuccess) e = tide_cuda_alloc((void **)&tmp, tbytes, s);
    if (e == cudaSuccess) e = tide_cuda_upload(dev, host, ibytes + wbytes, s);
    if (e == cudaSuccess) e = cudaMemsetAsync(acc, 0, (size_t)cells * sizeof(double), s);
    /* a pageable source: the copy has left host memory when cudaMemcpyAsync returns */
    free(host);
    if (e == cudaSuccess) {
        const int64_t *di = (const int64_t *)dev;
        const double *dw = (const double *)(dev + ibytes);
        int64_t pi = 0, pw = 0, off = 0;
        switch (dtype) {
#define POS_INTERP_BWD_CASE(DT, T)                                                                                      \
        case DT:                                                                                                        \
            for (int64_t g = 0; g < n && e == cudaSuccess; g++) {                                                       \
                int64_t h = grids[2 * g], w = grids[2 * g + 1];                                                         \
                const int64_t *sy = di + pi, *sx = sy + Gh + 1, *oy = sx + Gw + 1, *ox = oy + 4 * h;                    \
                const double *wy = dw + pw, *wx = wy + 4 * h;                                                           \
                const T *go = (const T *)dout + off * d;                                                                \
                if (h == Gh && w == Gw) {                                                                               \
                    pos_interp_bwd_y<T><<<tide_blocks(cells), TIDE_THREADS, 0, s>>>(acc, (const double *)NULL, go, sy, oy, wy, Gh, Gw, d); \
                } else {                                                                                                \
                    pos_interp_bwd_x<T><<<tide_blocks(h * Gw * d), TIDE_THREADS, 0, s>>>(tmp, go, sx, ox, wx, Gw, d, h, w); \
                    pos_interp_bwd_y<T><<<tide_blocks(cells), TIDE_THREADS, 0, s>>>(acc, tmp, go, sy, oy, wy, Gh, Gw, d); \
                }                                                                                                       \
                e = cudaGetLastError();                                                                                 \
                pi += (Gh + 1) + (Gw + 1) + 4 * h + 4 * w;                                                              \
                pw += 4 * h + 4 * w;                                                                                    \
                off += h * w;                                                                                           \
            }                                                                                                           \
            if (e == cudaSuccess) {                                                                                     \
                pos_interp_store<T><<<tide_blocks(cells), TIDE_THREADS, 0, s>>>((T *)dtable, acc, cells);               \
                e = cudaGetLastError();                                                                                 \
            }                                                                                                           \
            break;
        POS_INTERP_BWD_CASE(TIDE_F32, float)
        POS_INTERP_BWD_CASE(TIDE_F64, double)
        POS_INTERP_BWD_CASE(TIDE_BF16, __nv_bfloat16)
#undef POS_INTERP_BWD_CASE
        }
    }
    tide_cuda_release(dev, s);
    tide_cuda_release(acc, s);
    tide_cuda_release(tmp, s);
    if (e != cudaSuccess) return tide_set_error("cuda pos_interp backward: %s", cudaGetErrorString(e));
    return 0;
}

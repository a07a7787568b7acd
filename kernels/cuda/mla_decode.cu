/*
 * mla_decode.cu — one absorbed MLA decoding step of R rows over their own latent caches on the GPU (kernels/backend.h:
 * mla_decode_rows; spec/mla.md §6). The CPU kernel is kernels/cpu/mla_decode_impl.h.
 *
 * Two launches on the engine's stream: a tiny kernel appends each row's new latent (and k_r) at position lens[r] of
 * its buffers, then one block per (row, head) attends over the row's lens[r] + 1 tokens. Stream order makes every
 * head of a row see the appended token, so no block races another for it.
 *
 * A block walks its tokens in tiles of DEC_BT with an online softmax (running max m and sum l, the output
 * accumulator rescaled when m grows): no per-row [L] buffer, so a row may hold millions of tokens. A warp owns a
 * fixed set of a tile's tokens (score: lanes over the dims, then a butterfly sum); warp 0 takes the tile's max and
 * sum; each thread owns fixed latent dims of the accumulator. Every sum runs in an order fixed by the shapes, so the
 * result is deterministic (no atomics). bf16: storage only, arithmetic in fp32.
 */
#include "common.cuh"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define DEC_NT 256                /* threads per attention block (8 warps) */
#define DEC_BT 64                 /* tokens per tile: two per lane of warp 0 */
#define DEC_APPEND_NT 256

/* the device copy of the host arrays: R latent buffers, R k_r buffers (NULL when dr = 0), R lengths */
struct dec_rows {
    void *const *c;
    void *const *kr;
    const int64_t *lens;
};

template <typename T>
__global__ void __launch_bounds__(DEC_APPEND_NT) dec_append_kernel(dec_rows rows, const T *c_new, const T *kr_new,
                                                                   int64_t dc, int64_t dr)
{
    int64_t r = blockIdx.x, L = rows.lens[r];
    T *c = (T *)rows.c[r] + L * dc;
    for (int64_t j = threadIdx.x; j < dc; j += blockDim.x) c[j] = c_new[r * dc + j];
    if (dr == 0) return;
    T *kr = (T *)rows.kr[r] + L * dr;
    for (int64_t j = threadIdx.x; j < dr; j += blockDim.x) kr[j] = kr_new[r * dr + j];
}

/* shared memory (arithmetic type A): q [dc + dr], acc [dc], the tile's scores then probabilities [DEC_BT], and
   warp 0's (alpha, l) of the tile. The sums' order depends on the row's own length and the head dims alone, so a
   row's result does not depend on R or on the other rows. */
template <typename T>
__global__ void __launch_bounds__(DEC_NT) dec_attend_kernel(T *out, const T *qt, const T *qr, dec_rows rows, int64_t H,
                                                            int64_t dc, int64_t dr, TIDE_ACC(T) scale)
{
    typedef TIDE_ACC(T) A;
    extern __shared__ double dec_smem[];   /* double: aligned for any A */
    A *q = (A *)dec_smem, *acc = q + dc + dr, *p = acc + dc, *stat = p + DEC_BT;
    int64_t rh = blockIdx.x, r = rh / H, L = rows.lens[r] + 1;
    const T *c = (const T *)rows.c[r], *kr = dr ? (const T *)rows.kr[r] : NULL;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int64_t j = threadIdx.x; j < dc; j += blockDim.x) {
        q[j] = tide_ld(qt, rh * dc + j);
        acc[j] = A(0);
    }
    for (int64_t j = threadIdx.x; j < dr; j += blockDim.x) q[dc + j] = tide_ld(qr, rh * dr + j);
    __syncthreads();
    A m = A(-INFINITY), l = A(0);   /* warp 0's running max and sum */
    for (int64_t t0 = 0; t0 < L; t0 += DEC_BT) {
        int n = (int)(L - t0 < DEC_BT ? L - t0 : DEC_BT);
        for (int i = warp; i < n; i += nw) {
            const T *ct = c + (t0 + i) * dc;
            A v = A(0);
            for (int64_t j = lane; j < dc; j += 32) v += q[j] * tide_ld(ct, j);
            if (dr) {
                const T *kt = kr + (t0 + i) * dr;
                for (int64_t j = lane; j < dr; j += 32) v += q[dc + j] * tide_ld(kt, j);
            }
            v = tide_warp_reduce(v, tide_sum_op());
            if (lane == 0) p[i] = v * scale;
        }
        __syncthreads();
        if (warp == 0) {
            A s0 = lane < n ? p[lane] : A(-INFINITY), s1 = lane + 32 < n ? p[lane + 32] : A(-INFINITY);
            A mt = tide_warp_reduce(tide_max_op()(s0, s1), tide_max_op());
            A mn = tide_max_op()(m, mt);
            /* the first tile: alpha = exp(-inf) = 0 scales the zero accumulator */
            A alpha = m == A(-INFINITY) ? A(0) : exp(m - mn);
            A e0 = lane < n ? exp(s0 - mn) : A(0), e1 = lane + 32 < n ? exp(s1 - mn) : A(0);
            if (lane < n) p[lane] = e0;
            if (lane + 32 < n) p[lane + 32] = e1;
            l = l * alpha + tide_warp_reduce(e0 + e1, tide_sum_op());
            m = mn;
            if (lane == 0) {
                stat[0] = alpha;
                stat[1] = l;
            }
        }
        __syncthreads();
        A alpha = stat[0];
        for (int64_t j = threadIdx.x; j < dc; j += blockDim.x) {
            A a = acc[j] * alpha;
            const T *cj = c + t0 * dc + j;
            for (int i = 0; i < n; i++) a += p[i] * tide_ld(cj, (int64_t)i * dc);
            acc[j] = a;
        }
        __syncthreads();   /* p and stat are rewritten by the next tile */
    }
    A inv = A(1) / stat[1];
    for (int64_t j = threadIdx.x; j < dc; j += blockDim.x) tide_st(out, rh * dc + j, acc[j] * inv);
}

static size_t dec_smem_bytes(int64_t dc, int64_t dr, size_t es)
{
    return (size_t)(2 * dc + dr + DEC_BT + 2) * es;
}

template <typename T>
static int dec_typed(void *out, const void *qt, const void *qr, const void *c_new, const void *kr_new,
                     const dec_rows &rows, int64_t R, int64_t H, int64_t dc, int64_t dr, double scale, cudaStream_t s)
{
    typedef TIDE_ACC(T) A;
    if (c_new) {   /* NULL: the buffers hold the new tokens already */
        dec_append_kernel<T><<<(unsigned)R, DEC_APPEND_NT, 0, s>>>(rows, (const T *)c_new, (const T *)kr_new, dc, dr);
        TIDE_CU_LAUNCH("mla_decode_rows append kernel");
    }
    size_t bytes = dec_smem_bytes(dc, dr, sizeof(A));
    dec_attend_kernel<T><<<(unsigned)(R * H), DEC_NT, bytes, s>>>((T *)out, (const T *)qt, (const T *)qr, rows, H, dc,
                                                                   dr, (A)scale);
    TIDE_CU_LAUNCH("mla_decode_rows attention kernel");
    return 0;
}

int tide_cuda_mla_decode_rows(int dtype, void *out, const void *qt, const void *qr, const void *c_new, const void *kr_new,
                              void *const *c_bufs, void *const *kr_bufs, const int64_t *lens, int64_t R, int64_t H,
                              int64_t dc, int64_t dr, double scale)
{
    const char *what = "mla_decode_rows";
    if (dtype != TIDE_F32 && dtype != TIDE_F64 && dtype != TIDE_BF16)
        return tide_set_error("%s: dtype %s is not supported on the cuda backend (f32, f64, bf16)", what,
                              tide_cuda_dtype_str(dtype));
    if (R < 1 || H < 1 || dc < 1 || dr < 0 || R > INT_MAX || R * H > INT_MAX)
        return tide_set_error("%s: bad sizes R %lld H %lld dc %lld dr %lld (R, H, dc >= 1, dr >= 0, R·H <= %d)", what,
                              (long long)R, (long long)H, (long long)dc, (long long)dr, INT_MAX);
    if (!c_bufs || !lens || (dr > 0 && (!kr_bufs || !qr || (c_new && !kr_new))))
        return tide_set_error("%s: c_bufs or lens is NULL, or dr = %lld without qr, kr_new and kr_bufs", what,
                              (long long)dr);
    for (int64_t r = 0; r < R; r++)
        if (lens[r] < 0 || !c_bufs[r] || (dr > 0 && !kr_bufs[r]))
            return tide_set_error("%s: row %lld has length %lld (expected >= 0) or a NULL buffer", what, (long long)r,
                                  (long long)lens[r]);
    size_t es = dtype == TIDE_F64 ? sizeof(double) : sizeof(float);
    if (dec_smem_bytes(dc, dr, es) > 48 * 1024)
        return tide_set_error("%s: dc %lld + dr %lld need %zu bytes of shared memory per block; the kernel takes at most "
                              "49152", what, (long long)dc, (long long)dr, dec_smem_bytes(dc, dr, es));
    TIDE_STREAM(s);
    /* one upload of the host arrays: [c pointers R][k_r pointers R][lengths R] */
    size_t n = (size_t)(3 * R) * sizeof(int64_t);
    void **h = (void **)malloc(n);
    if (!h) return tide_set_error("%s: out of memory for %lld rows", what, (long long)R);
    for (int64_t r = 0; r < R; r++) {
        h[r] = c_bufs[r];
        h[R + r] = dr > 0 ? kr_bufs[r] : NULL;
    }
    memcpy(h + 2 * R, lens, (size_t)R * sizeof(int64_t));
    void *d = NULL;
    cudaError_t e = tide_cuda_alloc(&d, n, s);
    /* staged (tide_cuda_upload): h may go */
    if (e == cudaSuccess) e = tide_cuda_upload(d, h, n, s);
    free(h);
    int rc = e == cudaSuccess ? 0 : tide_set_error("cuda %s row upload (%zu bytes): %s", what, n, cudaGetErrorString(e));
    dec_rows rows = {(void *const *)d, (void *const *)d + R, (const int64_t *)((void *const *)d + 2 * R)};
    if (!rc) {
        switch (dtype) {
        case TIDE_F32: rc = dec_typed<float>(out, qt, qr, c_new, kr_new, rows, R, H, dc, dr, scale, s); break;
        case TIDE_F64: rc = dec_typed<double>(out, qt, qr, c_new, kr_new, rows, R, H, dc, dr, scale, s); break;
        default: rc = dec_typed<__nv_bfloat16>(out, qt, qr, c_new, kr_new, rows, R, H, dc, dr, scale, s); break;
        }
    }
    tide_cuda_release(d, s);
    return rc;
}

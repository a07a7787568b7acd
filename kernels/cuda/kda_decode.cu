/*
 * kda_decode.cu — one KDA decoding step of R rows over their own states on the GPU (kernels/backend.h:
 * kda_decode_rows; spec/kda.md §3, §7). The CPU kernel is kda_decode_rows in kernels/cpu/kda_impl.h.
 *
 * One block per (row, head). Thread j owns column j of the head's state S (dk x dv, fp32, in place in the row's own
 * buffer): the decay, the error Sᵀk, the rank-1 write and the read Sᵀq of a column touch that column alone, so no
 * barrier guards S and every sum runs over i in order (deterministic, no atomics). bf16: storage only.
 */
#include "common.cuh"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define KDEC_NT 128               /* threads per block: columns j, j + 128, ... */

template <typename T> struct kdec_args {
    T *o;
    const T *q, *k, *v, *g, *beta;
    float *const *states;         /* device array of R state pointers */
    int H, dk, dv;
};

template <typename T> __global__ void __launch_bounds__(KDEC_NT) kdec_kernel(kdec_args<T> a)
{
    extern __shared__ __align__(16) float kdec_smem[];
    const int H = a.H, dk = a.dk, dv = a.dv;
    const int r = blockIdx.x / H, h = blockIdx.x % H;
    float *kv = kdec_smem, *qv = kv + dk, *av = qv + dk;
    const int64_t base = (int64_t)r * H + h;
    for (int i = threadIdx.x; i < dk; i += KDEC_NT) {
        kv[i] = tide_ld(a.k, base * dk + i);
        qv[i] = tide_ld(a.q, base * dk + i);
        av[i] = expf(tide_ld(a.g, base * dk + i));
    }
    __syncthreads();
    const float b = tide_ld(a.beta, base);
    float *S = a.states[r] + (int64_t)h * dk * dv;
    for (int j = threadIdx.x; j < dv; j += KDEC_NT) {
        /* S ← diag(α) S and Sᵀk against the decayed state, then u = β (v − Sᵀk) */
        float e = 0.f;
        for (int i = 0; i < dk; i++) {
            float s = S[(int64_t)i * dv + j] * av[i];
            S[(int64_t)i * dv + j] = s;
            e += s * kv[i];
        }
        const float u = b * (tide_ld(a.v, base * dv + j) - e);
        /* S ← S + k uᵀ and o = Sᵀ q */
        float o = 0.f;
        for (int i = 0; i < dk; i++) {
            float s = S[(int64_t)i * dv + j] + kv[i] * u;
            S[(int64_t)i * dv + j] = s;
            o += s * qv[i];
        }
        tide_st(a.o, base * dv + j, o);
    }
}

template <typename T>
static int kdec_typed(void *o, const void *q, const void *k, const void *v, const void *g, const void *beta,
                      float *const *states_d, int64_t R, int64_t H, int64_t dk, int64_t dv, cudaStream_t s)
{
    kdec_args<T> a = {(T *)o, (const T *)q, (const T *)k, (const T *)v, (const T *)g, (const T *)beta, states_d,
                      (int)H, (int)dk, (int)dv};
    size_t bytes = (size_t)(3 * dk) * sizeof(float);
    kdec_kernel<T><<<(unsigned)(R * H), KDEC_NT, bytes, s>>>(a);
    TIDE_CU_LAUNCH("kda_decode_rows kernel");
    return 0;
}

int tide_cuda_kda_decode_rows(int dtype, void *o, const void *q, const void *k, const void *v, const void *g,
                              const void *beta, void *const *states, int64_t R, int64_t H, int64_t dk, int64_t dv)
{
    const char *what = "kda_decode_rows";
    if (dtype != TIDE_F32 && dtype != TIDE_BF16)
        return tide_set_error("%s: dtype %s is not supported on the cuda backend (f32, bf16)", what,
                              tide_cuda_dtype_str(dtype));
    if (R < 1 || H < 1 || dk < 1 || dv < 1 || R * H > INT_MAX || dk > 4096)
        return tide_set_error("%s: bad sizes R %lld H %lld dk %lld dv %lld (>= 1, R·H <= %d, dk <= 4096)", what,
                              (long long)R, (long long)H, (long long)dk, (long long)dv, INT_MAX);
    if (!states) return tide_set_error("%s: states is NULL", what);
    for (int64_t r = 0; r < R; r++)
        if (!states[r]) return tide_set_error("%s: row %lld has a NULL state", what, (long long)r);
    TIDE_STREAM(s);
    /* one upload of the R state pointers */
    size_t n = (size_t)R * sizeof(void *);
    void *d = NULL;
    cudaError_t e = tide_cuda_alloc(&d, n, s);
    /* staged (tide_cuda_upload) */
    if (e == cudaSuccess) e = tide_cuda_upload(d, states, n, s);
    int rc = e == cudaSuccess ? 0 : tide_set_error("cuda %s state upload (%zu bytes): %s", what, n, cudaGetErrorString(e));
    if (!rc) {
        if (dtype == TIDE_F32) rc = kdec_typed<float>(o, q, k, v, g, beta, (float *const *)d, R, H, dk, dv, s);
        else rc = kdec_typed<__nv_bfloat16>(o, q, k, v, g, beta, (float *const *)d, R, H, dk, dv, s);
    }
    tide_cuda_release(d, s);
    return rc;
}

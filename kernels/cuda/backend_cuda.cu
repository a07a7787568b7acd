/*
 * backend_cuda.cu — the CUDA backend table (kernels/backend.h), process state (stream, cuBLAS handle,
 * scratch), raw device memory, copies and runtime information.
 *
 * Memory is stream-ordered (cudaMallocAsync / cudaFreeAsync on the process stream, from the device's default
 * pool, which keeps what is freed mapped: the release threshold is the pool's whole size); the engine's caching
 * allocator (engine/alloc.c) keeps blocks above this. Kernel scratch (tide_cuda_alloc) is taken from the engine's
 * allocator too, so it is counted, limited and retried like a tensor. A raw allocation that fails trims the
 * pool (memory freed to it but not yet returned to the driver) and tries once more.
 */
#include "common.cuh"
#include "tide.h"
#include <mutex>
#include "defer_impl.h"   /* the deferred checks' host side, defined once here */
#include <stdio.h>
#include <string.h>

/* the kernels' C++ symbols stay inside libtide (hidden visibility); these three are the backend's
   C interface */
#define TIDE_CUDA_EXPORT __attribute__((visibility("default")))

namespace {

struct cuda_state {
    cudaError_t err;              /* first failure while setting up, cudaSuccess otherwise */
    const char *what;
    cudaStream_t stream;
    int sm_count;
    int pools;                    /* stream-ordered allocation supported (cudaMallocAsync) */
};

cuda_state make_state()
{
    cuda_state st = {cudaSuccess, "", 0, 0, 0};
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n < 1) e = cudaErrorNoDevice;
    if (e == cudaSuccess) e = cudaSetDevice(0);
    if (e != cudaSuccess) {
        cudaGetLastError();
        st.err = e;
        st.what = "device";
        return st;
    }
    e = cudaStreamCreateWithFlags(&st.stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        cudaGetLastError();
        st.err = e;
        st.what = "stream create";
        return st;
    }
    if (cudaDeviceGetAttribute(&st.sm_count, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || st.sm_count < 1) {
        cudaGetLastError();
        st.sm_count = 108;
    }
    if (cudaDeviceGetAttribute(&st.pools, cudaDevAttrMemoryPoolsSupported, 0) != cudaSuccess) {
        cudaGetLastError();
        st.pools = 0;
    }
    /* keep freed memory mapped in the pool across synchronisations (a release threshold of "all"), so the
       multi-GB temporaries of long sequences are not unmapped and remapped at every call; what the engine
       frees is handed back to the driver only when an allocation fails (tide_cuda_raw_alloc) */
    cudaMemPool_t pool;
    if (st.pools && cudaDeviceGetDefaultMemPool(&pool, 0) == cudaSuccess) {
        uint64_t keep = UINT64_MAX;
        if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) cudaGetLastError();
    } else {
        cudaGetLastError();
    }
    return st;
}

cuda_state &state()
{
    static cuda_state st = make_state();  /* thread-safe one-time initialisation */
    return st;
}

struct blas_state {
    cublasStatus_t err;
    cublasHandle_t handle;
};

blas_state make_blas()
{
    blas_state b = {CUBLAS_STATUS_SUCCESS, 0};
    b.err = cublasCreate(&b.handle);
    if (b.err == CUBLAS_STATUS_SUCCESS) b.err = cublasSetStream(b.handle, state().stream);
    /* plain fp32 arithmetic for f32 GEMMs (no TF32), so results match the CPU backend closely; and no reduced-
       precision reductions: a split-K bf16 GEMM (a large-K weight gradient) sums its partial products in fp32,
       not in the output type */
    if (b.err == CUBLAS_STATUS_SUCCESS)
        b.err = cublasSetMathMode(b.handle, (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                                           CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    return b;
}

struct scratch_state {
    cudaError_t err;
    tide_cuda_scratch *p;
};

scratch_state make_scratch()
{
    scratch_state s = {cudaSuccess, 0};
    s.err = cudaMalloc((void **)&s.p, sizeof(tide_cuda_scratch));
    /* the deferred record starts clean (all ones) */
    if (s.err == cudaSuccess) s.err = cudaMemset(&s.p->defer_key, 0xff, sizeof s.p->defer_key);
    if (s.err != cudaSuccess) cudaGetLastError();
    return s;
}

}  // namespace

int tide_cuda_get_stream(cudaStream_t *out)
{
    cuda_state &st = state();
    if (st.err != cudaSuccess) return tide_set_error("cuda %s: %s", st.what, cudaGetErrorString(st.err));
    *out = st.stream;
    return 0;
}

int tide_cuda_get_cublas(cublasHandle_t *out)
{
    cudaStream_t s = 0;
    if (tide_cuda_get_stream(&s)) return -1;
    static blas_state b = make_blas();
    TIDE_CUBLAS(b.err, "cublas init");
    *out = b.handle;
    return 0;
}

int tide_cuda_get_scratch(tide_cuda_scratch **out)
{
    cudaStream_t s = 0;
    if (tide_cuda_get_stream(&s)) return -1;
    static scratch_state sc = make_scratch();
    TIDE_CU(sc.err, "scratch alloc");
    *out = sc.p;
    return 0;
}

/* stream-ordered where the device supports it; plain cudaMalloc / cudaFree otherwise (cudaFree waits
   for the device, so a buffer still used by queued work is never freed early). On failure the pool's unused
   memory goes back to the driver (after the stream drains, so nothing queued still uses it) and the
   allocation is tried once more. */
static cudaError_t tide_cuda_raw_alloc(void **p, size_t nbytes, cudaStream_t s)
{
    *p = NULL;
    const int pools = state().pools;
    cudaError_t e = pools ? cudaMallocAsync(p, nbytes ? nbytes : 1, s) : cudaMalloc(p, nbytes ? nbytes : 1);
    if (e == cudaSuccess) return e;
    cudaGetLastError();                         /* out-of-memory is not sticky: clear it */
    cudaMemPool_t pool;
    if (!pools || cudaStreamSynchronize(s) != cudaSuccess || cudaDeviceGetDefaultMemPool(&pool, 0) != cudaSuccess ||
        cudaMemPoolTrimTo(pool, 0) != cudaSuccess) {
        cudaGetLastError();
        return e;
    }
    e = cudaMallocAsync(p, nbytes ? nbytes : 1, s);
    if (e != cudaSuccess) cudaGetLastError();
    return e;
}

static void tide_cuda_raw_release(void *p, cudaStream_t s)
{
    if (!p) return;
    cudaError_t e = state().pools ? cudaFreeAsync(p, s) : cudaFree(p);
    if (e != cudaSuccess) cudaGetLastError();
}

/* ---- uploads of small host tables: a ring of pinned slots, each reused once the copy behind it has run ---- */
#define TIDE_UPLOAD_SLOTS 64
#define TIDE_UPLOAD_SLOT_BYTES ((size_t)64 << 10)

namespace {
struct upload_ring {
    std::mutex mu;
    int ready;                    /* 1: pinned ring in use; -1: unavailable (uploads go pageable) */
    char *buf;
    cudaEvent_t ev[TIDE_UPLOAD_SLOTS];
    int used[TIDE_UPLOAD_SLOTS];
    int next;
};
upload_ring g_ring;

int ring_init(void)
{
    if (cudaHostAlloc((void **)&g_ring.buf, TIDE_UPLOAD_SLOTS * TIDE_UPLOAD_SLOT_BYTES, cudaHostAllocDefault) !=
        cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    for (int i = 0; i < TIDE_UPLOAD_SLOTS; i++)
        if (cudaEventCreateWithFlags(&g_ring.ev[i], cudaEventDisableTiming) != cudaSuccess) {
            cudaGetLastError();
            return -1;
        }
    return 1;
}
}  // namespace

cudaError_t tide_cuda_upload(void *dst, const void *src, size_t n, cudaStream_t s)
{
    if (n == 0) return cudaSuccess;
    std::lock_guard<std::mutex> lock(g_ring.mu);
    if (!g_ring.ready) g_ring.ready = ring_init();
    if (g_ring.ready < 0 || n > TIDE_UPLOAD_SLOT_BYTES) return cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s);
    int k = g_ring.next;
    g_ring.next = (k + 1) % TIDE_UPLOAD_SLOTS;
    cudaError_t e = g_ring.used[k] ? cudaEventSynchronize(g_ring.ev[k]) : cudaSuccess;   /* its last copy has run */
    char *slot = g_ring.buf + (size_t)k * TIDE_UPLOAD_SLOT_BYTES;
    if (e == cudaSuccess) {
        memcpy(slot, src, n);
        e = cudaMemcpyAsync(dst, slot, n, cudaMemcpyHostToDevice, s);
    }
    if (e == cudaSuccess) e = cudaEventRecord(g_ring.ev[k], s);
    g_ring.used[k] = e == cudaSuccess;
    return e;
}

/* kernel scratch: from the engine's allocator (backend.h tide_scratch_alloc), so it reuses cached blocks, counts in
   the statistics and the limit, and is retried after the cache is emptied; blocks are stream-ordered on the one
   process stream, so a block freed here is reused only by later work on that stream */
cudaError_t tide_cuda_alloc(void **p, size_t nbytes, cudaStream_t)
{
    *p = tide_scratch_alloc(TIDE_CUDA0, nbytes);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

void tide_cuda_release(void *p, cudaStream_t)
{
    tide_scratch_free(TIDE_CUDA0, p);
}

int tide_cuda_sm_count(void)
{
    cuda_state &st = state();
    return st.sm_count > 0 ? st.sm_count : 108;
}

/* ---- memory ----------------------------------------------------------------------------------- */

static void *tide_cuda_malloc(size_t nbytes)
{
    cudaStream_t s = 0;
    if (tide_cuda_get_stream(&s)) return NULL;
    void *p = NULL;
    cudaError_t e = tide_cuda_raw_alloc(&p, nbytes, s);
    if (e != cudaSuccess) {
        tide_set_error("cuda malloc of %zu bytes: %s", nbytes, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void tide_cuda_free(void *p)
{
    cudaStream_t s = 0;
    if (!p || tide_cuda_get_stream(&s)) return;
    tide_cuda_raw_release(p, s);
}

/* the host buffer may be reused as soon as we return, so the copy completes first */
static int tide_cuda_memcpy_h2d(void *dst, const void *src, size_t n)
{
    if (n == 0) return 0;
    TIDE_STREAM(s);
    TIDE_CU(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s), "memcpy host to device");
    TIDE_CU(cudaStreamSynchronize(s), "memcpy host to device (synchronize)");
    return 0;
}

static int tide_cuda_memcpy_d2h(void *dst, const void *src, size_t n)
{
    if (n == 0) return 0;
    TIDE_STREAM(s);
    TIDE_CU(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s), "memcpy device to host");
    TIDE_CU(cudaStreamSynchronize(s), "memcpy device to host (synchronize)");
    return tide_cuda_deferred_report();   /* what the kernels before found, now that the host reads (common.cuh) */
}

static int tide_cuda_memcpy_d2d(void *dst, const void *src, size_t n)
{
    if (n == 0 || dst == src) return 0;
    TIDE_STREAM(s);
    TIDE_CU(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s), "memcpy device to device");
    return 0;
}

static int tide_cuda_synchronize(void)
{
    TIDE_STREAM(s);
    TIDE_CU(cudaStreamSynchronize(s), "synchronize");
    return tide_cuda_deferred_report();
}

/* ---- runtime information ---------------------------------------------------------------------- */

/* the count cannot change during a process, and the engine asks on every device lookup */
extern "C" TIDE_CUDA_EXPORT int tide_cuda_runtime_device_count(void)
{
    static int count = [] {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess) {
            cudaGetLastError();
            return 0;
        }
        return n;
    }();
    return count;
}

extern "C" TIDE_CUDA_EXPORT const char *tide_cuda_runtime_info(void)
{
    static char buf[512];
    static std::once_flag once;
    std::call_once(once, [] {
        int rt = 0, drv = 0, n = 0;
        cudaRuntimeGetVersion(&rt);
        cudaDriverGetVersion(&drv);
        int len = snprintf(buf, sizeof buf, "cuda runtime %d.%d", rt / 1000, (rt % 1000) / 10);
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess) {
            cudaGetLastError();
            snprintf(buf + len, sizeof buf - len, ", no usable device (%s)", cudaGetErrorString(e));
            return;
        }
        len += snprintf(buf + len, sizeof buf - len, ", driver %d.%d, %d device%s", drv / 1000,
                        (drv % 1000) / 10, n, n == 1 ? "" : "s");
        cudaDeviceProp p;
        if (n > 0 && cudaGetDeviceProperties(&p, 0) == cudaSuccess)
            snprintf(buf + len, sizeof buf - len, "; cuda:0 %s (sm_%d%d, %d SMs, %.1f GiB)", p.name, p.major,
                     p.minor, p.multiProcessorCount, (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
        else
            cudaGetLastError();
    });
    return buf;
}

/* free and total bytes of a device (cudaMemGetInfo reports the current device: switched to it and back) */
extern "C" TIDE_CUDA_EXPORT int tide_cuda_runtime_mem_info(int device, int64_t *free_bytes, int64_t *total_bytes)
{
    int old = 0;
    TIDE_CU(cudaGetDevice(&old), "device memory");
    if (old != device) TIDE_CU(cudaSetDevice(device), "device memory");
    size_t fr = 0, tot = 0;
    cudaError_t e = cudaMemGetInfo(&fr, &tot);
    if (old != device) cudaSetDevice(old);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return tide_set_error("device memory: cudaMemGetInfo on cuda:%d failed: %s", device, cudaGetErrorString(e));
    }
    *free_bytes = (int64_t)fr;
    *total_bytes = (int64_t)tot;
    return 0;
}

/* ---- the table --------------------------------------------------------------------------------
   Filled field by field (C++17 has no designated initialisers); this runs during static
   initialisation and touches no CUDA state. Entries left NULL report "not implemented". */

static tide_backend make_table()
{
    tide_backend t;
    memset(&t, 0, sizeof t);
    t.name = "cuda";
    t.malloc = tide_cuda_malloc;
    t.free = tide_cuda_free;
    t.memcpy_h2d = tide_cuda_memcpy_h2d;
    t.memcpy_d2h = tide_cuda_memcpy_d2h;
    t.memcpy_d2d = tide_cuda_memcpy_d2d;
    t.synchronize = tide_cuda_synchronize;
    t.fill = tide_cuda_fill;
    t.copy = tide_cuda_copy;
    t.randn = tide_cuda_randn;
    t.rand = tide_cuda_rand;
    t.unary = tide_cuda_unary;
    t.unary_backward = tide_cuda_unary_backward;
    t.binary = tide_cuda_binary;
    t.swiglu = tide_cuda_swiglu;
    t.swiglu_backward = tide_cuda_swiglu_backward;
    t.axpy = tide_cuda_axpy;
    t.sum_squares = tide_cuda_sum_squares;
    t.all_finite = tide_cuda_all_finite;
    t.first_nonfinite = tide_cuda_first_nonfinite;
    t.reduce = tide_cuda_reduce;
    t.reduce_max_backward = tide_cuda_reduce_max_backward;
    t.gemm = tide_cuda_gemm;
    t.gemm_batched = tide_cuda_gemm_batched;
    t.index_select = tide_cuda_index_select;
    t.index_add = tide_cuda_index_add;
    t.gather = tide_cuda_gather;
    t.scatter_add = tide_cuda_scatter_add;
    t.check_index = tide_cuda_check_index;
    t.rmsnorm = tide_cuda_rmsnorm;
    t.rmsnorm_backward = tide_cuda_rmsnorm_backward;
    t.layernorm = tide_cuda_layernorm;
    t.layernorm_backward = tide_cuda_layernorm_backward;
    t.softmax = tide_cuda_softmax;
    t.softmax_backward = tide_cuda_softmax_backward;
    t.cross_entropy = tide_cuda_cross_entropy;
    t.cross_entropy_backward = tide_cuda_cross_entropy_backward;
    t.token_logprobs = tide_cuda_token_logprobs;
    t.token_logprobs_backward = tide_cuda_token_logprobs_backward;
    t.rope = tide_cuda_rope;
    t.rope2d = tide_cuda_rope2d;
    t.pos_interp = tide_cuda_pos_interp;
    t.pos_interp_backward = tide_cuda_pos_interp_backward;
    t.attention = tide_cuda_attention;
    t.attention_backward = tide_cuda_attention_backward;
    t.kda = tide_cuda_kda;
    t.kda_backward = tide_cuda_kda_backward;
    t.kda_ckpt_chunks = TIDE_KDA_CUDA_CKPT_CHUNKS;
    t.kda_decode_rows = tide_cuda_kda_decode_rows;
    t.kda_gate = tide_cuda_kda_gate;
    t.kda_gate_backward = tide_cuda_kda_gate_backward;
    t.causal_conv1d = tide_cuda_causal_conv1d;
    t.causal_conv1d_backward = tide_cuda_causal_conv1d_backward;
    t.conv_decode_rows = tide_cuda_conv_decode_rows;
    t.mla_attention = tide_cuda_mla_attention;
    t.mla_attention_backward = tide_cuda_mla_attention_backward;
    t.mla_latent_attention = tide_cuda_mla_latent_attention;
    t.mla_latent_attention_backward = tide_cuda_mla_latent_attention_backward;
    t.mla_decode_rows = tide_cuda_mla_decode_rows;
    t.varlen_attention = tide_cuda_varlen_attention;
    t.varlen_attention_backward = tide_cuda_varlen_attention_backward;
    t.attnres = tide_cuda_attnres;
    t.attnres_backward = tide_cuda_attnres_backward;
    t.situ_glu = tide_cuda_situ_glu;
    t.situ_glu_backward = tide_cuda_situ_glu_backward;
    t.topk = tide_cuda_topk;
    t.moe_experts = tide_cuda_moe_experts;
    t.moe_experts_backward = tide_cuda_moe_experts_backward;
    t.adamw = tide_cuda_adamw;
    tide_cuda_dist_entries(&t);   /* NCCL collectives (nccl_comm.cu), when built with NCCL and MPI */
    return t;
}

extern "C" TIDE_CUDA_EXPORT const tide_backend tide_cuda_backend = make_table();

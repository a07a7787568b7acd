/*
 * cpu.h — the CPU backend's kernels: one function per entry of tide_backend (kernels/backend.h),
 * named tide_cpu_<entry> with exactly the entry's signature. C11 + OpenMP + BLAS; float32 and float64.
 */
#ifndef TIDE_CPU_H
#define TIDE_CPU_H
#include <string.h>
#include "../backend.h"

/* the CPU's device id in the engine's allocator (engine/tide.h TIDE_CPU): kernel scratch of more than a few pages
   comes from tide_scratch_alloc(TIDE_CPU_DEVICE, ·) on the calling thread, outside parallel regions */
#define TIDE_CPU_DEVICE 0

void * tide_cpu_malloc(size_t nbytes);   /* 64-byte aligned */
void tide_cpu_free(void *p);

/* Threads that sum into one shared array, each over its own range of columns, must not write the same 64-byte
   line: the line then moves between the cores at every row (a kernel's whole inner loop stalls on it). With the
   array 64-byte aligned (tide_cpu_malloc) and the offsets of its parts multiples of TIDE_CPU_PAD8 doubles,
   tide_cpu_column_range splits C columns in whole lines of 8 doubles. Which thread sums a column does not change
   the sum (each column is one thread's chain over the rows in order). */
#define TIDE_CPU_PAD8(n) (((n) + 7) / 8 * 8)
static inline void tide_cpu_column_range(int64_t C, int tid, int nth, int64_t *c0, int64_t *c1)
{
    int64_t lines = (C + 7) / 8, l0 = lines * tid / nth, l1 = lines * (tid + 1) / nth;
    *c0 = l0 * 8 < C ? l0 * 8 : C;
    *c1 = l1 * 8 < C ? l1 * 8 : C;
}
int tide_cpu_memcpy_h2d(void *dst, const void *src, size_t n);
int tide_cpu_memcpy_d2h(void *dst, const void *src, size_t n);
int tide_cpu_memcpy_d2d(void *dst, const void *src, size_t n);
int tide_cpu_synchronize(void);
int tide_cpu_fill(void *out, int dtype, int64_t n, double value);
/* zero M rows of `row_bytes` bytes each, `ld_bytes` apart: a region of TIDE_CPU_ZERO_STREAM_MIN bytes or more gets
   non-temporal stores (elementwise.c), which skip reading each line before its write */
void tide_cpu_zero_rows(void *p, int64_t M, size_t row_bytes, size_t ld_bytes);
#define TIDE_CPU_ZERO_STREAM_MIN ((size_t)4 << 20)
/* the lines of [p, p + bytes) into the cache ahead of a read (a row gathered from memory) */
static inline void tide_cpu_prefetch_bytes(const void *p, size_t bytes)
{
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}
/* copy n bytes from src (in cache) to dst (not) with non-temporal stores, then a store fence; serial (a caller
   inside a parallel region copies its own part) */
void tide_cpu_copy_stream(void *dst, const void *src, size_t n);
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
/* one 64-byte line from src to dst (64-byte aligned) with non-temporal stores; the caller fences */
static inline void tide_cpu_stream_line(void *dst, const void *src)
{
#if defined(__AVX512F__)
    _mm512_stream_si512(dst, _mm512_loadu_si512(src));
#else
    _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
    _mm256_stream_si256((__m256i *)dst + 1, _mm256_loadu_si256((const __m256i *)src + 1));
#endif
}
#endif
int tide_cpu_copy(void *out, int odtype, const int64_t *ostride, const void *x, int xdtype, const int64_t *xstride, int ndim, const int64_t *shape);
int tide_cpu_randn(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b);
int tide_cpu_rand(void *out, int dtype, int64_t n, uint64_t seed, uint64_t offset, double a, double b);
int tide_cpu_unary(int op, int dtype, void *y, const void *x, int64_t n, double p);
int tide_cpu_unary_backward(int op, int dtype, void *gx, const void *gy, const void *x, const void *y, int64_t n, double p);
int tide_cpu_binary(int op, int dtype, void *out, const void *a, const int64_t *sa, const void *b, const int64_t *sb, int ndim, const int64_t *shape);
int tide_cpu_swiglu(int dtype, void *out, const void *g, const void *u, int64_t n);
int tide_cpu_swiglu_backward(int dtype, void *dg, void *du, const void *dout, const void *g, const void *u, int64_t n);
int tide_cpu_axpy(int dtype, void *y, double a, const void *x, int64_t n);
int tide_cpu_sum_squares(int dtype, const void *x, int64_t n, double *out);
int tide_cpu_all_finite(int dtype, const void *x, int64_t n, int *out);
int tide_cpu_first_nonfinite(int n, const int *dtypes, const void *const *ptrs, const int64_t *lens, int *first);
int tide_cpu_reduce(int op, int dtype, void *out, const void *x, int64_t outer, int64_t red, int64_t inner);
int tide_cpu_reduce_max_backward(int dtype, void *gx, const void *gy, const void *x, const void *y, int64_t outer, int64_t red, int64_t inner);
/* batch-invariant products (gemm.c): returns the previous value */
int tide_cpu_set_batch_invariant(int on);
int tide_cpu_batch_invariant(void);
int tide_cpu_gemm(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc);
int tide_cpu_gemm_batched(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb, double beta, void *C, int64_t ldc, int64_t sc, int64_t batch);
int tide_cpu_index_select(int dtype, void *out, const void *x, const void *idx, int idx_dtype, int64_t outer, int64_t n_src, int64_t inner, int64_t n_idx);
int tide_cpu_index_add(int dtype, void *gx, const void *gy, const void *idx, int idx_dtype, int64_t outer, int64_t n_dst, int64_t inner, int64_t n_idx);
int tide_cpu_gather(int dtype, void *out, const void *x, const void *idx, int idx_dtype, int64_t outer, int64_t n_x, int64_t n_idx, int64_t inner);
int tide_cpu_scatter_add(int dtype, void *out, const void *src, const void *idx, int idx_dtype, int64_t outer, int64_t n_out, int64_t n_idx, int64_t inner);
int tide_cpu_check_index(const char *what, const void *idx, int idx_dtype, int64_t count, int64_t n, int defer,
                         int64_t *bad, int *ok);
int tide_cpu_rmsnorm(int dtype, void *out, void *rstd, const void *x, const void *w, int64_t N, int64_t C, double eps);
int tide_cpu_rmsnorm_backward(int dtype, void *dx, void *dw, const void *dout, const void *x, const void *w, const void *rstd, int64_t N, int64_t C);
int tide_cpu_layernorm(int dtype, void *out, void *mean, void *rstd, const void *x, const void *w, const void *b, int64_t N, int64_t C, double eps);
int tide_cpu_layernorm_backward(int dtype, void *dx, void *dw, void *db, const void *dout, const void *x, const void *w, const void *mean, const void *rstd, int64_t N, int64_t C);
int tide_cpu_softmax(int dtype, void *y, const void *x, int64_t N, int64_t C, int log);
int tide_cpu_softmax_backward(int dtype, void *dx, const void *dy, const void *y, int64_t N, int64_t C, int log);
int tide_cpu_cross_entropy(int dtype, void *loss, void *valid, void *lse, const void *logits, const void *targets, int tdtype, const void *weights, int64_t N, int64_t V, int64_t ignore);
int tide_cpu_cross_entropy_backward(int dtype, void *dlogits, const void *dloss, const void *logits, const void *lse, const void *targets, int tdtype, const void *weights, int64_t N, int64_t V, int64_t ignore);
int tide_cpu_token_logprobs(int dtype, void *logp, void *entropy, void *lse, const void *logits, const void *targets, int tdtype, int64_t N, int64_t V, int64_t ignore);
int tide_cpu_token_logprobs_backward(int dtype, void *dlogits, const void *dlogp, const void *dentropy, const void *logits, const void *lse, const void *entropy, const void *targets, int tdtype, int64_t N, int64_t V, int64_t ignore);
int tide_cpu_rope(int dtype, void *out, const void *x, int64_t B, int64_t T, int64_t H, int64_t D, double theta, int64_t pos0, int inverse);
int tide_cpu_rope2d(int dtype, void *out, const void *x, const void *pos, int pos_dtype, int64_t T, int64_t H, int64_t hd, double theta, int inverse);
int tide_cpu_pos_interp(int dtype, void *out, const void *table, const int64_t *grids, int64_t n, int64_t Gh, int64_t Gw, int64_t d);
int tide_cpu_pos_interp_backward(int dtype, void *dtable, const void *dout, const int64_t *grids, int64_t n, int64_t Gh, int64_t Gw, int64_t d);
int tide_cpu_attention(int dtype, void *out, void *lse, const void *q, const void *k, const void *v, int64_t BH, int64_t Tq, int64_t Tk, int64_t D, int causal, double scale);
int tide_cpu_attention_backward(int dtype, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k, const void *v, const void *out, const void *lse, int64_t BH, int64_t Tq, int64_t Tk, int64_t D, int causal, double scale);
/* x86 MXCSR FTZ + DAZ for the calling thread (subnormal inputs and results read and written as zero), returning the
   previous register for tide_cpu_restore_denormals; no-ops elsewhere. Kernels whose products decay to subnormals
   (the KDA state) set it per thread: x86 runs about 100x slower on them. */
#if defined(__SSE2__)
#include <xmmintrin.h>
static inline unsigned int tide_cpu_flush_denormals(void)
{
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);          /* FTZ (bit 15) | DAZ (bit 6) */
    return csr;
}
static inline void tide_cpu_restore_denormals(unsigned int csr) { _mm_setcsr(csr); }
#else
static inline unsigned int tide_cpu_flush_denormals(void) { return 0; }
static inline void tide_cpu_restore_denormals(unsigned int csr) { (void)csr; }
#endif

int tide_cpu_kda(int dtype, void *o, void *s_out, const void *q, const void *k, const void *v, const void *g, const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk, double lb, void *ckpt);
int tide_cpu_kda_backward(int dtype, void *gq, void *gk, void *gv, void *gg, void *gbeta, void *gs0, const void *gout, const void *gs_out, const void *q, const void *k, const void *v, const void *g, const void *beta, const void *s0, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, int path, int64_t chunk, double lb, const void *ckpt);
int tide_cpu_kda_decode_rows(int dtype, void *o, const void *q, const void *k, const void *v, const void *g, const void *beta, void *const *states, int64_t R, int64_t H, int64_t dk, int64_t dv);
int tide_cpu_kda_gate(int dtype, void *g, const void *z, const void *A_log, const void *dt_bias, int64_t N, int64_t H, int64_t D, double lb, int form);
int tide_cpu_kda_gate_backward(int dtype, void *gz, void *gA, void *gb, const void *gg, const void *z, const void *A_log, const void *dt_bias, int64_t N, int64_t H, int64_t D, double lb, int form);
int tide_cpu_causal_conv1d(int dtype, void *out, const void *x, const void *w, const void *cache, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T, int64_t C, int64_t K, int silu);
int tide_cpu_conv_decode_rows(int dtype, void *out, const void *x, const void *w, void *const *caches, int64_t R, int64_t C, int64_t K, int silu);
int tide_cpu_causal_conv1d_backward(int dtype, void *gx, void *gw, void *gcache, const void *gout, const void *x, const void *w, const void *cache, const int64_t *cu, int64_t n_seg, int64_t B, int64_t T, int64_t C, int64_t K, int silu);
int tide_cpu_mla_attention(int dtype, void *out, void *lse, const void *q, const void *kn, const void *kr, const void *v, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, double scale);
int tide_cpu_mla_latent_attention(int dtype, void *out, void *lse, const void *q, const void *c, const void *kr, const void *w, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc, int64_t chunk, double scale);
int tide_cpu_mla_latent_attention_backward(int dtype, void *gq, void *gc, void *gkr, void *gw, const void *gout, const void *q, const void *c, const void *kr, const void *w, const void *out, const void *lse, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc, int64_t chunk, double scale);
int tide_cpu_mla_decode_rows(int dtype, void *out, const void *qt, const void *qr, const void *c_new, const void *kr_new, void *const *c_bufs, void *const *kr_bufs, const int64_t *lens, int64_t R, int64_t H, int64_t dc, int64_t dr, double scale);
int tide_cpu_mla_attention_backward(int dtype, void *gq, void *gkn, void *gkr, void *gv, const void *gout, const void *q, const void *kn, const void *kr, const void *v, const void *out, const void *lse, const int64_t *cu, int64_t n_seg, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, double scale);
int tide_cpu_varlen_attention(int dtype, void *out, void *lse, const void *q, const void *k, const void *v, const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale);
int tide_cpu_varlen_attention_backward(int dtype, void *gq, void *gk, void *gv, const void *gout, const void *q, const void *k, const void *v, const void *out, const void *lse, const int64_t *cu, int64_t n_seg, int64_t T, int64_t H, int64_t D, double scale);
int tide_cpu_attnres(int dtype, void *out, void *stats, const void *const *srcs, int64_t n, int64_t rows, int64_t d, const void *w, const void *nu, double eps);
int tide_cpu_attnres_backward(int dtype, void *const *gsrcs, void *gw, void *gnu, const void *gout, const void *const *srcs, const void *stats, int64_t n, int64_t rows, int64_t d, const void *w, const void *nu);
int tide_cpu_situ_glu(int dtype, void *out, const void *g, const void *u, int64_t n, double k_gate, double k_lin);
int tide_cpu_situ_glu_backward(int dtype, void *dg, void *du, const void *dout, const void *g, const void *u, int64_t n, double k_gate, double k_lin);
int tide_cpu_topk(int dtype, void *values, int64_t *indices, const void *x, int64_t rows, int64_t C, int64_t k);
int tide_cpu_moe_experts(int dtype, void *out, int64_t *route, void *pre, void *y, const void *x, const void *sel, int sel_dtype, const void *p, const void *w_gate_up, const void *w_down, int64_t m, int64_t k, int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate, double k_lin, int64_t capacity, int64_t *dropped, int64_t *host_off);
int tide_cpu_moe_experts_backward(int dtype, void *dx, void *dp, void *dw_gate_up, void *dw_down, const void *du, const int64_t *route, const int64_t *host_off, const void *pre, const void *y, const void *x, const void *p, const void *w_gate_up, const void *w_down, int64_t m, int64_t k, int64_t n, int64_t d_in, int64_t d_e, int64_t d_out, int act, double k_gate, double k_lin);
int tide_cpu_adamw(int dtype, void *p, const void *g, void *m, void *v, int *nonfinite, int64_t n, double lr, double beta1, double beta2, double eps, double wd, double bc1, double bc2);

/* bf16 is the upper half of an IEEE float32 */
static inline float tide_cpu_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bf16, round to nearest, ties to even; a NaN stays a (quiet) NaN instead of rounding into infinity */
static inline uint16_t tide_cpu_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* the dtype's name for a kernel's error message ("unknown" for an id outside the enum) */
static inline const char *tide_cpu_dtype_str(int dtype)
{
    const char *s = tide_dtype_name(dtype);
    return s ? s : "unknown";
}

/* OpenMP loops run in parallel only when a call does enough work that starting and ending the team (a few us on
   2 cores) costs less than the second thread saves: about 5-10 us of one core's work. How many elements that is
   depends on the work per element, so each kernel's `if` clause names its cost class (crossovers measured by
   bench/omp_threshold.lua, 1 thread against 2 with every loop forced parallel; bench/results/omp_threshold.md):
     TIDE_OMP_MIN       elements of a few flops that stream (gathers, copies, column sums, cross-entropy rows): 16,384
     TIDE_OMP_MIN_ROW   elements of row reductions and normalisations in double (RMSNorm, LayerNorm, RoPE): 3,072
     TIDE_OMP_MIN_MATH  elements with an exponential or a chain of double fused multiply-adds each (the causal
                        convolution's SiLU in double, softmax, AttnRes, SiTU, attention scores): 1,536; a kernel
                        scales it by its own work per counted element (softmax a quarter, AttnRes 4x)
     TIDE_OMP_MIN_FMA   multiply-adds of a product on the engine's own GEMM kernels (K <= 96): 786,432
   Macros, so that they expand inside _Pragma("omp ... if(...)"). tide_cpu_omp_scale multiplies them all: 1, or
   TIDE_OMP_SCALE at load (0: every loop parallel; the benchmark's measuring knob). */
extern double tide_cpu_omp_scale;
#define TIDE_OMP_MIN ((int64_t)(16384 * tide_cpu_omp_scale))
#define TIDE_OMP_MIN_ROW ((int64_t)(3072 * tide_cpu_omp_scale))
#define TIDE_OMP_MIN_MATH ((int64_t)(1536 * tide_cpu_omp_scale))
#define TIDE_OMP_MIN_FMA ((int64_t)(786432 * tide_cpu_omp_scale))

/* one step of a spin-wait on another thread of the same region (a hint to the core; a no-op elsewhere) */
static inline void tide_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* chunks per KDA state checkpoint (kda.c: also the backward's recompute block) */
#define TIDE_KDA_CPU_CKPT_CHUNKS 16

/* threads used by OpenMP loops and BLAS (set together so they never compete for cores) */
void tide_cpu_set_threads(int n);
int tide_cpu_get_threads(void);
const char *tide_cpu_blas_info(void);
const char *tide_cpu_blas_core_choice(const char *detected, int avx512, int avx2_fma, int avx);
const char *tide_cpu_blas_core_hint(void);

/* test hook (kda.c): (I + A)⁻¹ of a strictly lower-triangular c x c matrix, f64 only; method 0 = forward
   substitution (the kernel's), 1 = the nilpotent product (I − A)(I + A²)(I + A⁴)… */
int tide_cpu_kda_unit_lower_inverse(int dtype, void *M, const void *A, int64_t c, int method);
#endif

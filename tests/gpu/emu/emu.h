// emu.h — host emulation of the small part of CUDA that kda.cu / conv.cu use, so the kernels can run (slowly)
// on a machine without a GPU. Every CUDA thread of a block is a ucontext fiber; one runs at a time and
// switches at barriers; the run order between barriers is shuffled, so a missing __syncthreads shows up as
// wrong results. Warp-level ops (__syncwarp, shuffles, __match_any_sync, wmma) are warp barriers; wmma checks its
// alignment rules. A barrier some threads never reach (divergence) aborts. Shared memory starts as NaN.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <climits>
#include <vector>
#include <algorithm>
#include <random>
#include <functional>
#include <math.h>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim, gridDim;

#include <ucontext.h>
namespace emu {
enum { RUN, BAR_BLOCK, BAR_WARP, DONE };
struct Th {
    ucontext_t ctx;
    int state;
    int tid;
};
extern std::vector<Th> *ths;
extern ucontext_t sched_ctx;
extern void *dyn_smem;
extern int smem_limit;
extern int my_tid;
extern double xch[1024];
extern std::mt19937 rng;
extern std::function<void()> body;
extern std::vector<char *> stacks;
const size_t STACK = 256 * 1024;

inline void yield_to_sched(int st)
{
    Th &t = (*ths)[my_tid];
    t.state = st;
    swapcontext(&t.ctx, &sched_ctx);
}
inline void syncthreads() { yield_to_sched(BAR_BLOCK); }
inline void syncwarp() { yield_to_sched(BAR_WARP); }

inline void fiber_main()
{
    body();
    yield_to_sched(DONE);
}

inline void set_idx(int tid)
{
    my_tid = tid;
    unsigned nx = blockDim.x, ny = blockDim.y;
    threadIdx.x = tid % nx;
    threadIdx.y = (tid / nx) % ny;
    threadIdx.z = tid / (nx * ny);
}

inline void run_block(int nthreads)
{
    std::vector<Th> v(nthreads);
    ths = &v;
    while ((int)stacks.size() < nthreads) stacks.push_back((char *)malloc(STACK));
    for (int i = 0; i < nthreads; i++) {
        v[i].tid = i;
        v[i].state = RUN;
        getcontext(&v[i].ctx);
        v[i].ctx.uc_stack.ss_sp = stacks[i];
        v[i].ctx.uc_stack.ss_size = STACK;
        v[i].ctx.uc_link = nullptr;
        makecontext(&v[i].ctx, fiber_main, 0);
    }
    int alive = nthreads;
    std::vector<int> order;
    while (alive > 0) {
        order.clear();
        for (int i = 0; i < nthreads; i++)
            if (v[i].state == RUN) order.push_back(i);
        if (order.empty()) {
            bool released = false;
            for (int w0 = 0; w0 < nthreads; w0 += 32) {
                int at_w = 0, live = 0;
                for (int i = w0; i < w0 + 32 && i < nthreads; i++) {
                    if (v[i].state != DONE) live++;
                    if (v[i].state == BAR_WARP) at_w++;
                }
                if (at_w > 0 && at_w == live) {
                    for (int i = w0; i < w0 + 32 && i < nthreads; i++)
                        if (v[i].state == BAR_WARP) v[i].state = RUN;
                    released = true;
                }
            }
            if (!released) {
                int at_b = 0, live = 0;
                for (int i = 0; i < nthreads; i++) {
                    if (v[i].state != DONE) live++;
                    if (v[i].state == BAR_BLOCK) at_b++;
                }
                if (at_b == live) {
                    for (int i = 0; i < nthreads; i++)
                        if (v[i].state == BAR_BLOCK) v[i].state = RUN;
                    released = true;
                }
            }
            if (!released) {
                fprintf(stderr, "emu: deadlock in block (%u,%u): states", blockIdx.x, blockIdx.y);
                for (int i = 0; i < nthreads; i++) fprintf(stderr, " %d", v[i].state);
                fprintf(stderr, "\n");
                abort();
            }
            continue;
        }
        std::shuffle(order.begin(), order.end(), rng);
        for (int i : order) {
            set_idx(i);
            swapcontext(&sched_ctx, &v[i].ctx);
            if (v[i].state == DONE) alive--;
        }
    }
}

template <class F> struct Launch {
    dim3 g, b;
    size_t sm;
    F f;
    template <class... A> void operator()(A... args)
    {
        body = [&]() { f(args...); };
        gridDim = g;
        blockDim = b;
        int nt = b.x * b.y * b.z;
        if (sm > (size_t)smem_limit) {
            fprintf(stderr, "emu: launch with %zu bytes of dynamic smem > limit %d\n", sm, smem_limit);
            abort();
        }
        for (unsigned z = 0; z < g.z; z++)
            for (unsigned y = 0; y < g.y; y++)
                for (unsigned x = 0; x < g.x; x++) {
                    blockIdx.x = x;
                    blockIdx.y = y;
                    blockIdx.z = z;
                    dyn_smem = sm ? aligned_alloc(128, (sm + 127) / 128 * 128) : nullptr;
                    if (sm) memset(dyn_smem, 0xff, sm);   // NaN everywhere: uninitialised reads show
                    run_block(nt);
                    free(dyn_smem);
                    dyn_smem = nullptr;
                }
    }
};
template <class F> Launch<F> launch(dim3 g, dim3 b, size_t sm, cudaStream_t, F f) { return Launch<F>{g, b, sm, f}; }

inline cudaError_t memcpy_async(void *d, const void *s, size_t n)
{
    memcpy(d, s, n);
    return cudaSuccess;
}
inline void memset_2d(void *p, size_t pitch, int v, size_t w, size_t h)
{
    for (size_t r = 0; r < h; r++) memset((char *)p + r * pitch, v, w);
}
}  // namespace emu

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::syncwarp(); }
template <class V> inline V __shfl_xor_sync(unsigned, V v, int o)
{
    int t = emu::my_tid;
    emu::xch[t] = (double)v;
    emu::syncwarp();
    V r = (V)emu::xch[(t & ~31) | ((t & 31) ^ o)];
    emu::syncwarp();
    return r;
}
// every lane of the warp with the same value: the lanes' values meet in xch between two warp barriers
inline unsigned __match_any_sync(unsigned, int v)
{
    int t = emu::my_tid, w0 = t & ~31, nt = (int)(blockDim.x * blockDim.y * blockDim.z);
    emu::xch[t] = (double)v;
    emu::syncwarp();
    unsigned m = 0;
    for (int l = 0; l < 32 && w0 + l < nt; l++)
        if (emu::xch[w0 + l] == (double)v) m |= 1u << l;
    emu::syncwarp();
    return m;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v)
{
    unsigned long long old = *p;
    if (v < old) *p = v;
    return old;
}
inline int atomicOr(int *p, int v)
{
    int old = *p;
    *p = old | v;
    return old;
}

// ---- wmma ------------------------------------------------------------------------------------------
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class L = void> struct fragment {
    float x[256];
};
inline void chk(const void *p, unsigned ldm, int esz)
{
    if (((uintptr_t)p) % 32 != 0 || (ldm * esz) % 16 != 0) {
        fprintf(stderr, "emu wmma: misaligned pointer %p or ldm %u\n", p, ldm);
        abort();
    }
}
template <class U, class T, class L> inline void fill_fragment(fragment<U, 16, 16, 16, T, L> &f, float v)
{
    for (int i = 0; i < 256; i++) f.x[i] = v;
}
template <class U, class L> inline void load_matrix_sync(fragment<U, 16, 16, 16, __nv_bfloat16, L> &f, const __nv_bfloat16 *p, unsigned ldm)
{
    chk(p, ldm, 2);
    emu::syncwarp();
    bool col = std::is_same<L, col_major>::value;
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) f.x[r * 16 + c] = __bfloat162float(col ? p[c * ldm + r] : p[r * ldm + c]);
    emu::syncwarp();
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float, void> &f, const float *p, unsigned ldm, layout_t l)
{
    chk(p, ldm, 4);
    emu::syncwarp();
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) f.x[r * 16 + c] = l == mem_col_major ? p[c * ldm + r] : p[r * ldm + c];
    emu::syncwarp();
}
inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float, void> &f, unsigned ldm, layout_t l)
{
    chk(p, ldm, 4);
    emu::syncwarp();
    if ((emu::my_tid & 31) == 0)
        for (int r = 0; r < 16; r++)
            for (int c = 0; c < 16; c++) (l == mem_col_major ? p[c * ldm + r] : p[r * ldm + c]) = f.x[r * 16 + c];
    emu::syncwarp();
}
template <class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float, void> &d, const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA> &a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB> &b,
                     const fragment<accumulator, 16, 16, 16, float, void> &c)
{
    emu::syncwarp();
    float out[256];
    for (int r = 0; r < 16; r++)
        for (int n = 0; n < 16; n++) {
            float s = c.x[r * 16 + n];
            for (int k = 0; k < 16; k++) s += a.x[r * 16 + k] * b.x[k * 16 + n];
            out[r * 16 + n] = s;
        }
    memcpy(d.x, out, sizeof out);
    emu::syncwarp();
}
}  // namespace wmma
}  // namespace nvcuda

// ---- runtime calls the kernels' host code makes ----------------------------------------------------
#define cudaMemcpyAsync(d, s, n, k, st) emu::memcpy_async((d), (s), (n))
#define cudaMemsetAsync(p, v, n, st) (memset((p), (v), (n)), cudaSuccess)
#define cudaMemset2DAsync(p, pitch, v, w, h, st) (emu::memset_2d((p), (pitch), (v), (w), (h)), cudaSuccess)
#define cudaStreamSynchronize(s) cudaSuccess
#define cudaGetLastError() cudaSuccess
#define cudaGetErrorString(e) "emu error"
#define cudaFuncSetAttribute(...) cudaSuccess
#define cudaGetDevice(p) (*(p) = 0, cudaSuccess)
#define cudaDeviceGetAttribute(p, a, d) (*(p) = emu::smem_limit, cudaSuccess)

// emu.h — host emulation of the small part of CUDA that kda.cu / conv.cu use, so the kernels can run (slowly)
// on a machine without a GPU. Every CUDA thread of a block is a ucontext fiber; one runs at a time and
// switches at barriers; the run order between barriers is shuffled, so a missing __syncthreads shows up as
// wrong results. Warp-level ops (__syncwarp, shuffles, __match_any_sync, wmma) are warp barriers; wmma checks its
// alignment rules. A barrier some threads never reach (divergence) aborts. Shared memory starts as NaN.
// A launch is held to the device's limits (block and grid dimensions; static + dynamic shared memory against 48 KiB
// or the kernel's cudaFuncSetAttribute limit; registers x threads from ptxas's report, kernel_resources.h, which
// run.sh / run_one.sh generate from the build): a launch a GPU would refuse aborts with one line.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdarg>
#include <cmath>
#include <climits>
#include <vector>
#include <algorithm>
#include <random>
#include <functional>
#include <map>
#include <string>
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

// ptxas's registers and static shared memory per kernel (the most over the target architectures), by demangled name
struct kres {
    const char *name;
    int regs, smem;
};
#include "kernel_resources.h"   // emu_kernel_resources[], emu_kernel_resources_n: generated (kernel_resources.py)

// a kernel's name as the report spells it ("attnres_fwd_kernel<float, 16>"), from the compiler's own text
inline std::string demangled_spelling(std::string s)
{
    static const char *from[] = {"long long unsigned int", "long unsigned int", "short unsigned int", "long long int",
                                 "long int", "short int"};
    static const char *to[] = {"unsigned long long", "unsigned long", "unsigned short", "long long", "long", "short"};
    for (int i = 0; i < 6; i++)
        for (size_t at; (at = s.find(from[i])) != std::string::npos;) s.replace(at, strlen(from[i]), to[i]);
    return s;
}
template <auto F> const char *kname()
{
    static std::string n;
    if (n.empty()) {
        std::string p = __PRETTY_FUNCTION__;
        size_t a = p.find("F = ") + 4, e = p.rfind(']');
        n = demangled_spelling(p.substr(a, e - a));
    }
    return n.c_str();
}
inline const kres *find_kres(const char *name)
{
    for (int i = 0; i < emu_kernel_resources_n; i++)
        if (!strcmp(emu_kernel_resources[i].name, name)) return &emu_kernel_resources[i];
    return nullptr;
}
// the dynamic shared memory each kernel was allowed with cudaFuncSetAttribute (none: 48 KiB less its static)
extern std::map<const void *, int> smem_optin;
template <class F> cudaError_t func_set_attr(F f, cudaFuncAttribute attr, int v)
{
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) smem_optin[(const void *)f] = v;
    return cudaSuccess;
}

[[noreturn]] inline void refuse(const char *name, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "emu: launch of %s refused: ", name);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

// what a GPU would refuse at the launch of `name` (grid g, block b, sm bytes of dynamic shared memory)
inline void check_launch(const char *name, const void *fn, dim3 g, dim3 b, size_t sm)
{
    long long nt = (long long)b.x * b.y * b.z;
    if (nt < 1 || nt > 1024 || b.x > 1024 || b.y > 1024 || b.z > 64)
        refuse(name, "block %u x %u x %u = %lld threads (at most 1,024; x, y <= 1,024, z <= 64)", b.x, b.y, b.z, nt);
    if (g.x < 1 || g.x > 2147483647u || g.y < 1 || g.y > 65535 || g.z < 1 || g.z > 65535)
        refuse(name, "grid %u x %u x %u (x <= 2^31 - 1, y, z <= 65,535)", g.x, g.y, g.z);
    if (sm > (size_t)smem_limit)
        refuse(name, "%zu bytes of dynamic shared memory > the device's %d", sm, smem_limit);
    const kres *r = find_kres(name);
    if (!r && emu_kernel_resources_n > 0)
        refuse(name, "not in ptxas's report (kernel_resources.h is older than the sources: rebuild libtide_cuda)");
    int st = r ? r->smem : 0;
    auto it = smem_optin.find(fn);
    if (it == smem_optin.end()) {
        if (st + sm > 48 * 1024)
            refuse(name, "%d static + %zu dynamic bytes of shared memory > 48 KiB without cudaFuncSetAttribute", st, sm);
    } else {
        if (sm > (size_t)it->second)
            refuse(name, "%zu bytes of dynamic shared memory > the %d its cudaFuncSetAttribute allowed", sm, it->second);
        if (st + it->second > smem_limit)
            refuse(name, "%d static + %d opted-in dynamic bytes of shared memory > the device's %d", st, it->second,
                   smem_limit);
    }
    if (r) {
        long long warps = (nt + 31) / 32, alloc = warps * ((r->regs * 32 + 255) / 256 * 256);
        if (alloc > 65536)
            refuse(name, "%d registers x %lld threads = %lld (allocated %lld) > 65,536 registers per block", r->regs, nt,
                   (long long)r->regs * nt, alloc);
    }
}

template <class F> struct Launch {
    dim3 g, b;
    size_t sm;
    F f;
    const char *name;
    template <class... A> void operator()(A... args)
    {
        body = [&]() { f(args...); };
        gridDim = g;
        blockDim = b;
        int nt = b.x * b.y * b.z;
        check_launch(name, (const void *)f, g, b, sm);
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
template <class F> Launch<F> launch(dim3 g, dim3 b, size_t sm, cudaStream_t, F f, const char *name)
{
    return Launch<F>{g, b, sm, f, name};
}

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
namespace emu { inline int n_syncs = 0; }   // stream synchronisations the host code asked for
#define cudaStreamSynchronize(s) (emu::n_syncs++, cudaSuccess)
#define cudaGetLastError() cudaSuccess
#define cudaGetErrorString(e) "emu error"
#define cudaFuncSetAttribute(...) emu::func_set_attr(__VA_ARGS__)
#define cudaGetDevice(p) (*(p) = 0, cudaSuccess)
#define cudaDeviceGetAttribute(p, a, d) (*(p) = emu::smem_limit, cudaSuccess)

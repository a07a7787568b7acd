// emu_host.h — the definitions every emulator harness shares: the emulator's globals (emu.h declares them) and
// host stand-ins for the engine functions the .cu files call (errors, dtypes, stream, scratch, allocation).
// Included once per harness program, after emu.h and common.cuh.
#pragma once
#include <cstdarg>
#include <map>
namespace emu {
std::vector<Th> *ths;
ucontext_t sched_ctx;
int my_tid;
std::vector<char *> stacks;
void *dyn_smem;
int smem_limit = 232448;   // sm_90 opt-in
std::map<const void *, int> smem_optin;
double xch[1024];
std::mt19937 rng(12345);
std::function<void()> body;
// the blocks tide_cuda_alloc handed out: what stands for device memory where a stand-in must tell (cuBLAS's pointer
// arrays); the harnesses' own vectors play device tensors and are not in it
std::map<const char *, size_t> device_blocks;
bool is_device(const void *p, size_t n)
{
    auto it = device_blocks.upper_bound((const char *)p);
    if (it == device_blocks.begin()) return false;
    --it;
    return (const char *)p + n <= it->first + it->second;
}
}  // namespace emu

// a kernel's static shared memory: the emulator's __shared__ arrays are host statics, so it reports none
#ifndef cudaFuncGetAttributes
#define cudaFuncGetAttributes(a, f) (memset((a), 0, sizeof *(a)), cudaSuccess)
#endif

static char err_buf[2048];
int tide_set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_buf, sizeof err_buf, fmt, ap);
    va_end(ap);
    return -1;
}
const char *tide_dtype_name(int d)
{
    static const char *n[] = {"f32", "f64", "bf16", "i32", "i64", "u8"};
    return d >= 0 && d < 6 ? n[d] : NULL;
}
size_t tide_dtype_size(int d)
{
    static const size_t s[] = {4, 8, 2, 4, 8, 1};
    return d >= 0 && d < 6 ? s[d] : 0;
}
int tide_cuda_get_stream(cudaStream_t *out)
{
    *out = 0;
    return 0;
}
static tide_cuda_scratch the_scratch = [] {
    tide_cuda_scratch s;
    memset(&s, 0, sizeof s);
    s.defer_key = ~0ull;   // the deferred record starts clean, as backend_cuda.cu's make_scratch leaves it
    return s;
}();
int tide_cuda_get_scratch(tide_cuda_scratch **out)
{
    *out = &the_scratch;
    return 0;
}
namespace emu {
size_t live_bytes, peak_bytes;   // what tide_cuda_alloc has out, and its most since a harness reset peak_bytes
}
cudaError_t tide_cuda_alloc(void **p, size_t n, cudaStream_t)
{
    *p = malloc(n ? n : 1);
    memset(*p, 0xff, n);   // NaN: unwritten reads show
    emu::device_blocks[(const char *)*p] = n;
    emu::live_bytes += n;
    if (emu::live_bytes > emu::peak_bytes) emu::peak_bytes = emu::live_bytes;
    return cudaSuccess;
}
void tide_cuda_release(void *p, cudaStream_t)
{
    if (!p) return;
    auto it = emu::device_blocks.find((const char *)p);
    if (it != emu::device_blocks.end()) {
        emu::live_bytes -= it->second;
        emu::device_blocks.erase(it);
    }
    free(p);
}
int emu_sm_count = 2;   // what the kernels see as the device's SM count (the memory table sets a real one)
int tide_cuda_sm_count(void) { return emu_sm_count; }
cudaError_t tide_cuda_upload(void *d, const void *s, size_t n, cudaStream_t) { return cudaMemcpyAsync(d, s, n, cudaMemcpyHostToDevice, 0); }

// the deferred checks' host side (common.cuh), as the real backend has it
#include "defer_impl.h"

// host_data.h — host-side data helpers of the emulator checks that test f32, f64 and bf16 kernels against the cpu
// kernels (loss.cpp, optim.cpp, vision.cpp, mla_decode.cpp): the dtype id and name of a device element type, vectors
// of doubles to and from device element vectors, and the comparison every check makes. Included after common.cuh
// (tide_from_f64) and emu_host.h.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

typedef std::vector<double> vd;

// the cpu kernel's storage of a dtype: float, double, or the bf16 bits (the same bytes as __nv_bfloat16)
template <class T> static constexpr int dtype_of()
{
    return std::is_same<T, float>::value ? TIDE_F32 : std::is_same<T, double>::value ? TIDE_F64 : TIDE_BF16;
}
template <class T> static const char *name_of()
{
    return dtype_of<T>() == TIDE_F32 ? "f32" : dtype_of<T>() == TIDE_F64 ? "f64" : "bf16";
}
template <class T> static std::vector<T> to_dev(const vd &x)
{
    std::vector<T> o(x.size());
    for (size_t i = 0; i < x.size(); i++) o[i] = tide_from_f64<T>(x[i]);
    return o;
}
template <class T> static vd from_dev(const std::vector<T> &x)
{
    vd o(x.size());
    for (size_t i = 0; i < x.size(); i++) {
        if constexpr (std::is_same<T, __nv_bfloat16>::value) o[i] = __bfloat162float(x[i]);
        else o[i] = (double)x[i];
    }
    return o;
}

// the cpu kernels' buffers: the reference runs in f32 for bf16 inputs (already rounded to bf16), else in the same
// dtype
template <class T> static int cpu_dtype() { return dtype_of<T>() == TIDE_BF16 ? TIDE_F32 : dtype_of<T>(); }
static std::vector<char> cpu_buf(int dtype, const vd &x)
{
    std::vector<char> b(x.size() * (dtype == TIDE_F64 ? 8 : 4));
    for (size_t i = 0; i < x.size(); i++) {
        if (dtype == TIDE_F64) ((double *)b.data())[i] = x[i];
        else ((float *)b.data())[i] = (float)x[i];
    }
    return b;
}
static vd cpu_vals(int dtype, const std::vector<char> &b)
{
    size_t n = b.size() / (dtype == TIDE_F64 ? 8 : 4);
    vd o(n);
    for (size_t i = 0; i < n; i++) o[i] = dtype == TIDE_F64 ? ((const double *)b.data())[i] : ((const float *)b.data())[i];
    return o;
}

// the checks' tally and one comparison: max|got − ref| / max|ref| <= tol, sizes equal, every value finite
static int n_fail = 0, n_pass = 0;
static void check(const std::string &name, const vd &got, const vd &ref, double tol)
{
    double mx = 0, e = 0;
    int nonfin = 0;
    for (size_t i = 0; i < ref.size(); i++) mx = std::max(mx, std::fabs(ref[i]));
    for (size_t i = 0; i < ref.size() && i < got.size(); i++) {
        if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) { nonfin++; continue; }
        e = std::max(e, std::fabs(got[i] - ref[i]));
    }
    double rel = mx > 0 ? e / mx : e;
    bool ok = nonfin == 0 && rel <= tol && got.size() == ref.size();
    printf("  %-58s %s max|ref| %.3g  err/max %.2e (tol %.1e)%s\n", name.c_str(), ok ? "ok  " : "FAIL", mx, rel, tol,
           nonfin ? "  NONFINITE" : "");
    if (ok) n_pass++;
    else n_fail++;
}

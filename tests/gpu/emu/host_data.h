// host_data.h — host-side data helpers of the emulator checks that test f32, f64 and bf16 kernels against the cpu
// kernels (loss.cpp, optim.cpp, vision.cpp): the dtype id and name of a device element type, and vectors of doubles
// to and from device element vectors. Included after common.cuh (tide_from_f64) and emu_host.h.
#pragma once
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

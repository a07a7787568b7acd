// kda_decode.cpp — runs the real kernels/cuda/kda_decode.cu under the host emulator (emu.h) against the cpu kernel
// (kda_decode_rows in kernels/cpu/kda_impl.h, spec/kda.md §3, §7): R rows advance their own fp32 states in place by
// one token. dv below, at and above the 128 threads of a block, dk not a multiple of 32. out and every row's state:
// f32 within 1e-6 of max|cpu|; bf16 (inputs rounded to bf16, the cpu in f32): the fp32 states 1e-6, out (rounded to
// bf16) 1/128.
// Usage: tests/gpu/emu/run_one.sh kda_decode (EMU_SEED=n reorders threads).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <string>

#include "emu_host.h"
#include "host_data.h"

#include "kda_decode_emu.inc"

static std::mt19937_64 gen(11);
static double randn()
{
    std::normal_distribution<double> d(0.0, 1.0);
    return d(gen);
}
static double unif() { return std::uniform_real_distribution<double>(0.0, 1.0)(gen); }
static double bfr(double x) { return (double)__bfloat162float(__float2bfloat16((float)x)); }

template <class T> static void kdec_case(int64_t R, int64_t H, int64_t dk, int64_t dv)
{
    const bool bf = dtype_of<T>() == TIDE_BF16;
    auto rnd = [&](int64_t n, double sc) {
        vd v(n);
        for (auto &x : v) x = bf ? bfr(sc * randn()) : sc * randn();
        return v;
    };
    vd q = rnd(R * H * dk, 1.0 / std::sqrt((double)dk)), k = rnd(R * H * dk, 1.0 / std::sqrt((double)dk));
    vd v = rnd(R * H * dv, 1.0), g(R * H * dk), b(R * H);
    for (auto &x : g) x = bf ? bfr(std::log(0.5 + 0.5 * unif())) : std::log(0.5 + 0.5 * unif());
    for (auto &x : b) x = bf ? bfr(1.0 / (1.0 + std::exp(-randn()))) : 1.0 / (1.0 + std::exp(-randn()));
    std::vector<vd> s(R);
    for (auto &x : s) { x.resize(H * dk * dv); for (auto &y : x) y = 0.5 * randn(); }
    std::string what = std::string("kda_decode_rows ") + name_of<T>() + " R " + std::to_string(R) + " H " +
                       std::to_string(H) + " dk " + std::to_string(dk) + " dv " + std::to_string(dv);
    std::vector<T> qd = to_dev<T>(q), kd = to_dev<T>(k), vdv = to_dev<T>(v), gd = to_dev<T>(g), bd = to_dev<T>(b);
    std::vector<T> od = to_dev<T>(vd(R * H * dv, NAN));
    std::vector<std::vector<float>> sd(R);
    std::vector<void *> sp(R);
    for (int64_t r = 0; r < R; r++) {
        sd[r] = to_dev<float>(s[r]);
        sp[r] = sd[r].data();
    }
    if (tide_cuda_kda_decode_rows(dtype_of<T>(), od.data(), qd.data(), kd.data(), vdv.data(), gd.data(), bd.data(),
                                  sp.data(), R, H, dk, dv)) {
        printf("  %s: failed: %s\n", what.c_str(), err_buf);
        n_fail++;
        return;
    }
    int cd = cpu_dtype<T>();
    std::vector<char> cq = cpu_buf(cd, q), ck = cpu_buf(cd, k), cv = cpu_buf(cd, v), cg = cpu_buf(cd, g), cb = cpu_buf(cd, b);
    std::vector<char> co = cpu_buf(cd, vd(R * H * dv, 0.0));
    std::vector<std::vector<char>> cs(R);
    for (int64_t r = 0; r < R; r++) {
        cs[r] = cpu_buf(TIDE_F32, s[r]);
        sp[r] = cs[r].data();
    }
    if (tide_cpu_backend.kda_decode_rows(cd, co.data(), cq.data(), ck.data(), cv.data(), cg.data(), cb.data(), sp.data(),
                                         R, H, dk, dv)) {
        printf("  %s: cpu failed\n", what.c_str());
        n_fail++;
        return;
    }
    check(what + " out", from_dev(od), cpu_vals(cd, co), bf ? 1.0 / 128 : 1e-6);   /* bf16 out: rounded */
    vd gs, ref;
    for (int64_t r = 0; r < R; r++) {
        vd a = from_dev(sd[r]), c = cpu_vals(TIDE_F32, cs[r]);
        gs.insert(gs.end(), a.begin(), a.end());
        ref.insert(ref.end(), c.begin(), c.end());
    }
    check(what + " states", gs, ref, 1e-6);
}

int main()
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    printf("kda_decode_rows (cuda under the emulator vs the cpu kernel)\n");
    kdec_case<float>(3, 2, 16, 16);
    kdec_case<float>(2, 2, 40, 128);
    kdec_case<float>(2, 1, 8, 200);
    kdec_case<__nv_bfloat16>(3, 2, 32, 64);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

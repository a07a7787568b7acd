// optim.cpp — runs the real kernels/cuda/optim.cu (AdamW) under the host emulator (emu.h) against the cpu kernel
// (kernels/cpu/optim.c, spec/optim.md §2): three updates in f32, f64 and bf16, one block and a grid-stride loop
// (20,011 elements over 64 blocks: threads take two elements), both sides in double (f64 within 1e-12 of max|cpu|,
// f32 within 1e-6, bf16 within 1/128); and the non-finite flag both kernels set in the update's own pass: 0 after
// clean updates, 1 on both after a NaN (any payload) or an infinity planted in p, g, m or v at the first, a middle
// or the last element, after lr 1e300 (f32 weights overflow when stored) and after a 1e30 f32 gradient (only v
// overflows). Usage: tests/gpu/emu/run_one.sh optim (EMU_SEED=n reorders threads).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <cstring>
#include <string>

#include "emu_host.h"
#include "host_data.h"

#include "optim_emu.inc"

extern "C" int tide_cpu_adamw(int dtype, void *p, const void *g, void *m, void *v, int *nonfinite, int64_t n,
                              double lr, double beta1, double beta2, double eps, double wd, double bc1, double bc2);

static std::mt19937_64 gen(14);
static double randn()
{
    std::normal_distribution<double> d(0.0, 1.0);
    return d(gen);
}


static void check_true(const std::string &name, bool ok)
{
    printf("  %-58s %s\n", name.c_str(), ok ? "ok" : "FAIL");
    if (ok) n_pass++;
    else n_fail++;
}

// one optimiser state on both sides
template <class T> struct State {
    std::vector<T> p, g, m, v;     // the emulated device
    std::vector<T> cp, cg, cm, cv; // the cpu kernel
};
template <class T> static State<T> make(int64_t n)
{
    vd p(n), g(n);
    for (int64_t i = 0; i < n; i++) p[i] = randn(), g[i] = randn();
    State<T> s{to_dev<T>(p), to_dev<T>(g), std::vector<T>(n, tide_from_f64<T>(0.0)), std::vector<T>(n, tide_from_f64<T>(0.0))};
    s.cp = s.p, s.cg = s.g, s.cm = s.m, s.cv = s.v;
    return s;
}
// one update on both sides; returns the two flags (each starts at 0)
template <class T> static std::pair<int, int> update(State<T> &s, int64_t t, double lr)
{
    const double b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    double bc1 = 1 - std::pow(b1, (double)(t + 1)), bc2 = 1 - std::pow(b2, (double)(t + 1));
    int64_t n = (int64_t)s.p.size();
    int fg = 0, fc = 0;
    if (tide_cuda_adamw(dtype_of<T>(), s.p.data(), s.g.data(), s.m.data(), s.v.data(), &fg, n, lr, b1, b2, eps, wd, bc1,
                        bc2) ||
        tide_cpu_adamw(dtype_of<T>(), s.cp.data(), s.cg.data(), s.cm.data(), s.cv.data(), &fc, n, lr, b1, b2, eps, wd,
                       bc1, bc2)) {
        printf("  adamw: %s\n", err_buf);
        return {-1, -1};
    }
    return {fg, fc};
}

template <class T> static void plant(std::vector<T> &x, int64_t i, uint64_t bits) { memcpy(&x[i], &bits, sizeof(T)); }

// the non-finite classes as raw bits of T: quiet and signalling NaNs of both signs, odd payloads, both infinities
template <class T> static std::vector<uint64_t> bad_bits()
{
    if constexpr (std::is_same<T, double>::value)
        return {0x7ff8000000000000ull, 0xfff8000000000000ull, 0x7ff0000000000001ull, 0xfffd800020000000ull,
                0xffffffffffffffffull, 0x7ff0000000000000ull, 0xfff0000000000000ull};
    else if constexpr (std::is_same<T, float>::value)
        return {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffec0001u, 0xffffffffu, 0x7f800000u, 0xff800000u};
    else
        return {0x7fc0u, 0xffc0u, 0x7f81u, 0xffecu, 0xffffu, 0x7f80u, 0xff80u};
}

template <class T> static void adamw_case(int64_t n, double tol)
{
    std::string tag = std::string(name_of<T>()) + " n " + std::to_string(n);
    State<T> s = make<T>(n);
    bool clean = true;
    for (int64_t t = 0; t < 3; t++) {
        auto f = update(s, t, 1e-2);
        clean = clean && f.first == 0 && f.second == 0;
    }
    check(tag + ": p after 3 updates", from_dev(s.p), from_dev(s.cp), tol);
    check(tag + ": m", from_dev(s.m), from_dev(s.cm), tol);
    check(tag + ": v", from_dev(s.v), from_dev(s.cv), tol);
    check_true(tag + ": clean updates leave both flags 0", clean);
    // every class, in each of p, g, m, v, at the first, a middle and the last element
    const int64_t where[3] = {0, n / 2, n - 1};
    int missed = 0, cases = 0;
    for (uint64_t bits : bad_bits<T>())
        for (int64_t at : where)
            for (int in = 0; in < 4; in++) {
                State<T> b = s;
                std::vector<T> *dev[4] = {&b.p, &b.g, &b.m, &b.v}, *cpu[4] = {&b.cp, &b.cg, &b.cm, &b.cv};
                plant(*dev[in], at, bits), plant(*cpu[in], at, bits);
                auto f = update(b, 3, 1e-2);
                cases++;
                if (f.first != 1 || f.second != 1) missed++;
            }
    check_true(tag + ": " + std::to_string(cases) + " planted values flagged on both (missed " + std::to_string(missed) +
                   ")",
               missed == 0);
}

int main()
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    printf("adamw (cuda under the emulator vs the cpu kernel)\n");
    adamw_case<float>(1000, 1e-6);
    adamw_case<float>(20011, 1e-6);
    adamw_case<double>(1000, 1e-12);
    adamw_case<__nv_bfloat16>(1000, 1.0 / 128);
    // finite inputs whose stored results are not
    State<float> s = make<float>(3000);
    auto f = update(s, 0, 1e300);
    check_true("f32 lr 1e300: the weights overflow, both flags 1", f.first == 1 && f.second == 1);
    s = make<float>(3000);
    s.g[1234] = s.cg[1234] = 1e30f;
    f = update(s, 0, 1e-2);
    check_true("f32 gradient 1e30: only v overflows, both flags 1",
               f.first == 1 && f.second == 1 && std::isfinite(s.p[1234]) && !std::isfinite(s.v[1234]));
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

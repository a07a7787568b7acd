// vision.cpp — runs the real kernels/cuda/vision.cu under the host emulator (emu.h) against the cpu kernels
// (kernels/cpu/vision.c, spec/vision.md §4): rope2d forward and inverse (i32 and i64 positions, head_dim 72 and 16),
// pos_interp forward (upsample, downsample, non-square, 1x1, the native grid: bitwise a copy) and its gather-form
// backward (tap tables built on the host, stage x then stage y per image, images in order). Both sides compute in
// double: f64 within 1e-13 of max|cpu|, f32 within 1e-6; bf16 (inputs rounded to bf16 on both sides, the cpu in f32)
// within 1/128 (one bf16 step of the output scale). Usage: tests/gpu/emu/run_one.sh vision (EMU_SEED=n reorders threads).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <string>

#include "emu_host.h"
#include "host_data.h"

#include "vision_emu.inc"

static std::mt19937_64 gen(5);
static double randn()
{
    std::normal_distribution<double> d(0.0, 1.0);
    return d(gen);
}
static double bfr(double x) { return (double)__bfloat162float(__float2bfloat16((float)x)); }

static void check_true(const std::string &name, bool ok)
{
    printf("  %-58s %s\n", name.c_str(), ok ? "ok" : "FAIL");
    if (ok) n_pass++;
    else n_fail++;
}


template <class T> static void rope2d_case(int64_t Tn, int64_t H, int64_t hd, bool pos64, double tol)
{
    const bool bf = dtype_of<T>() == TIDE_BF16;
    int64_t n = Tn * H * hd;
    vd x(n);
    for (auto &v : x) v = bf ? bfr(randn()) : randn();
    std::vector<int64_t> p64(2 * Tn);
    std::vector<int32_t> p32(2 * Tn);
    for (int64_t i = 0; i < 2 * Tn; i++) p64[i] = p32[i] = (int32_t)(gen() % 512);
    const void *pos = pos64 ? (const void *)p64.data() : (const void *)p32.data();
    int pdt = pos64 ? TIDE_I64 : TIDE_I32;
    for (int inverse = 0; inverse < 2; inverse++) {
        std::vector<T> xd = to_dev<T>(x), od = to_dev<T>(vd(n, NAN));
        char what[160];
        snprintf(what, sizeof what, "rope2d %s [%lld,%lld,%lld] %s pos%s", name_of<T>(), (long long)Tn, (long long)H,
                 (long long)hd, pos64 ? "i64" : "i32", inverse ? " inverse" : "");
        if (tide_cuda_rope2d(dtype_of<T>(), od.data(), xd.data(), pos, pdt, Tn, H, hd, 10000.0, inverse)) {
            printf("  %s: failed: %s\n", what, err_buf);
            n_fail++;
            continue;
        }
        int cd = cpu_dtype<T>();
        std::vector<char> cx = cpu_buf(cd, x), co(cx.size());
        tide_cpu_backend.rope2d(cd, co.data(), cx.data(), pos, pdt, Tn, H, hd, 10000.0, inverse);
        check(what, from_dev(od), cpu_vals(cd, co), tol);
    }
}

template <class T> static void pos_interp_case(const char *label, int64_t Gh, int64_t Gw, int64_t d,
                                               std::vector<int64_t> grids, double tol)
{
    const bool bf = dtype_of<T>() == TIDE_BF16;
    int64_t n = (int64_t)grids.size() / 2, L = 0;
    for (int64_t i = 0; i < n; i++) L += grids[2 * i] * grids[2 * i + 1];
    vd tab(Gh * Gw * d), go(L * d);
    for (auto &v : tab) v = bf ? bfr(randn()) : randn();
    for (auto &v : go) v = bf ? bfr(randn()) : randn();
    std::string what = std::string("pos_interp ") + name_of<T>() + " " + label;
    std::vector<T> td = to_dev<T>(tab), od = to_dev<T>(vd(L * d, NAN)), gd = to_dev<T>(go), dt = to_dev<T>(vd(tab.size(), NAN));
    if (tide_cuda_pos_interp(dtype_of<T>(), od.data(), td.data(), grids.data(), n, Gh, Gw, d) ||
        tide_cuda_pos_interp_backward(dtype_of<T>(), dt.data(), gd.data(), grids.data(), n, Gh, Gw, d)) {
        printf("  %s: failed: %s\n", what.c_str(), err_buf);
        n_fail++;
        return;
    }
    int cd = cpu_dtype<T>();
    std::vector<char> ct = cpu_buf(cd, tab), cg = cpu_buf(cd, go), co(cg.size()), cdt(ct.size());
    tide_cpu_backend.pos_interp(cd, co.data(), ct.data(), grids.data(), n, Gh, Gw, d);
    tide_cpu_backend.pos_interp_backward(cd, cdt.data(), cg.data(), grids.data(), n, Gh, Gw, d);
    check(what + " forward", from_dev(od), cpu_vals(cd, co), tol);
    check(what + " dtable", from_dev(dt), cpu_vals(cd, cdt), tol);
    // oracle 6: an image on the table's own grid is the table, bitwise
    int64_t off = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t h = grids[2 * i], w = grids[2 * i + 1];
        if (h == Gh && w == Gw) check_true(what + " native grid bitwise", !memcmp(od.data() + off * d, td.data(), td.size() * sizeof(T)));
        off += h * w;
    }
}

int main()
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    printf("rope2d (cuda under the emulator vs the cpu kernel)\n");
    rope2d_case<float>(9, 3, 72, true, 1e-6);
    rope2d_case<float>(13, 2, 16, false, 1e-6);
    rope2d_case<double>(9, 3, 72, true, 1e-13);
    rope2d_case<double>(5, 1, 16, false, 1e-13);
    rope2d_case<__nv_bfloat16>(9, 3, 72, true, 1.0 / 128);
    printf("pos_interp (forward and backward)\n");
    pos_interp_case<float>("[8,8,5] to 13x5, 8x8, 1x1, 3x17, 2x2", 8, 8, 5, {13, 5, 8, 8, 1, 1, 3, 17, 2, 2}, 1e-6);
    pos_interp_case<double>("[8,8,5] to 13x5, 8x8, 1x1, 3x17, 2x2", 8, 8, 5, {13, 5, 8, 8, 1, 1, 3, 17, 2, 2}, 1e-13);
    pos_interp_case<double>("[4,6,3] to 9x2, 4x6, 20x20", 4, 6, 3, {9, 2, 4, 6, 20, 20}, 1e-13);
    pos_interp_case<float>("[16,16,40] to 32x24 (upsample)", 16, 16, 40, {32, 24}, 1e-6);
    pos_interp_case<__nv_bfloat16>("[8,8,5] to 13x5, 8x8, 1x1", 8, 8, 5, {13, 5, 8, 8, 1, 1}, 1.0 / 128);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

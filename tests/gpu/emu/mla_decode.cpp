// mla_decode.cpp — runs the real kernels/cuda/mla_decode.cu under the host emulator (emu.h) against the cpu kernel
// (kernels/cpu/mla_decode_impl.h, spec/mla.md §6): R rows of different lengths append their new latent (and k_r) at
// lens[r] of their own buffers, then attend over the lens[r] + 1 tokens. Lengths around the 64-token tile (L = 1,
// 64, 65, 129), dc not a multiple of 32, dr = 0 and dr > 0. out: f64 within 1e-13 of max|cpu|, f32 1e-6, bf16
// (inputs rounded to bf16, the cpu in f32) 1/128; the buffers, three spare tokens past each row's end included, must
// equal the cpu's bitwise; the appended form (c_new NULL) writes nothing. Usage: tests/gpu/emu/run_one.sh mla_decode (EMU_SEED=n reorders threads).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <string>

#include "emu_host.h"
#include "host_data.h"

#include "mla_decode_emu.inc"

static std::mt19937_64 gen(7);
static double randn()
{
    std::normal_distribution<double> d(0.0, 1.0);
    return d(gen);
}
static double bfr(double x) { return (double)__bfloat162float(__float2bfloat16((float)x)); }



template <class T>
static void decode_case(int64_t H, int64_t dc, int64_t dr, std::vector<int64_t> lens, double tol, bool appended = false)
{
    const bool bf = dtype_of<T>() == TIDE_BF16;
    int64_t R = (int64_t)lens.size();
    auto rnd = [&](int64_t n) {
        vd v(n);
        for (auto &x : v) x = bf ? bfr(randn()) : randn();
        return v;
    };
    vd qt = rnd(R * H * dc), qr = rnd(R * H * dr), cn = rnd(R * dc), kn = rnd(R * dr);
    std::vector<vd> cb(R), kb(R);
    for (int64_t r = 0; r < R; r++) {
        cb[r] = rnd((lens[r] + 4) * dc);
        kb[r] = rnd((lens[r] + 4) * dr);
    }
    std::string what = std::string("mla_decode_rows ") + name_of<T>() + " H " + std::to_string(H) + " dc " +
                       std::to_string(dc) + " dr " + std::to_string(dr) + (appended ? " appended" : "") + " lens";
    for (int64_t L : lens) what += " " + std::to_string(L);
    std::vector<T> qtd = to_dev<T>(qt), qrd = to_dev<T>(qr), cnd = to_dev<T>(cn), knd = to_dev<T>(kn);
    std::vector<T> od = to_dev<T>(vd(R * H * dc, NAN));
    std::vector<std::vector<T>> cbd(R), kbd(R);
    std::vector<void *> cp(R), kp(R);
    for (int64_t r = 0; r < R; r++) {
        cbd[r] = to_dev<T>(cb[r]);
        kbd[r] = to_dev<T>(kb[r]);
        cp[r] = cbd[r].data();
        kp[r] = dr ? kbd[r].data() : nullptr;
    }
    if (tide_cuda_mla_decode_rows(dtype_of<T>(), od.data(), qtd.data(),
                                  dr ? qrd.data() : nullptr, appended ? nullptr : cnd.data(),
                                  dr && !appended ? knd.data() : nullptr, cp.data(),
                                  dr ? kp.data() : nullptr, lens.data(), R, H, dc, dr, 1.0 / std::sqrt((double)(dc + dr)))) {
        printf("  %s: failed: %s\n", what.c_str(), err_buf);
        n_fail++;
        return;
    }
    int cd = cpu_dtype<T>();
    std::vector<char> cqt = cpu_buf(cd, qt), cqr = cpu_buf(cd, qr), ccn = cpu_buf(cd, cn), ckn = cpu_buf(cd, kn);
    std::vector<char> co(cpu_buf(cd, vd(R * H * dc, 0.0)));
    std::vector<std::vector<char>> ccb(R), ckb(R);
    for (int64_t r = 0; r < R; r++) {
        ccb[r] = cpu_buf(cd, cb[r]);
        ckb[r] = cpu_buf(cd, kb[r]);
        cp[r] = ccb[r].data();
        kp[r] = dr ? ckb[r].data() : nullptr;
    }
    if (tide_cpu_backend.mla_decode_rows(cd, co.data(), cqt.data(), dr ? cqr.data() : nullptr,
                                         appended ? nullptr : ccn.data(), dr && !appended ? ckn.data() : nullptr, cp.data(), dr ? kp.data() : nullptr, lens.data(), R,
                                         H, dc, dr, 1.0 / std::sqrt((double)(dc + dr)))) {
        printf("  %s: cpu failed\n", what.c_str());
        n_fail++;
        return;
    }
    check(what + " out", from_dev(od), cpu_vals(cd, co), tol);
    vd gb, cbv;
    for (int64_t r = 0; r < R; r++) {
        vd g = from_dev(cbd[r]), c = cpu_vals(cd, ccb[r]);
        gb.insert(gb.end(), g.begin(), g.end());
        cbv.insert(cbv.end(), c.begin(), c.end());
        if (!dr) continue;
        g = from_dev(kbd[r]);
        c = cpu_vals(cd, ckb[r]);
        gb.insert(gb.end(), g.begin(), g.end());
        cbv.insert(cbv.end(), c.begin(), c.end());
    }
    check(what + " buffers", gb, cbv, 0.0);
}

int main()
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    printf("mla_decode_rows (cuda under the emulator vs the cpu kernel)\n");
    decode_case<float>(3, 80, 32, {0, 63, 64, 128}, 1e-6);
    decode_case<float>(2, 64, 0, {5, 200}, 1e-6);
    decode_case<double>(2, 80, 32, {0, 129, 64}, 1e-13);
    decode_case<double>(1, 520, 0, {70, 1}, 1e-13);
    decode_case<__nv_bfloat16>(2, 128, 64, {0, 64, 100}, 1.0 / 128);
    decode_case<float>(2, 80, 16, {40, 41, 42}, 1e-6, true);     /* c_new NULL: the buffers hold the tokens */
    decode_case<double>(2, 64, 0, {0, 65}, 1e-13, true);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

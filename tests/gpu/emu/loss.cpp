// loss.cpp — runs the real kernels/cuda/loss.cu (token_logprobs forward and backward, and cross_entropy) under the
// host emulator (emu.h) against the cpu kernels (kernels/cpu/loss.c): f32 and f64 on both sides; bf16 on the
// emulated device against the cpu f32 kernel on the same bf16-rounded logits. Rows of V = 5 (one warp, most threads
// idle), 300 and 3001 (a block of 1024 threads looping), logits N(0, 3) with a -inf logit in one row, i64 and i32
// targets with ignored rows; the backward with both upstream gradients, and with dentropy absent (NULL). Tolerances
// relative to max|cpu|: f64 1e-12 (measured 3e-15), f32 1e-6 (measured 2e-7: the cpu f32 path uses exp_f32, the
// device expf), bf16 outputs 1e-6 (f32 arithmetic on both sides; measured 7e-8), bf16 gradient 1/128 (stored in bf16;
// measured 1.2e-3). A target outside [0, V) is an error on
// both. Usage: tests/gpu/emu/run_one.sh loss (EMU_SEED=n reorders threads).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <cstring>
#include <string>

#include "emu_host.h"
#include "host_data.h"

#include "loss_emu.inc"

extern "C" int tide_cpu_token_logprobs(int dtype, void *logp, void *entropy, void *lse, const void *logits,
                                       const void *targets, int tdtype, int64_t N, int64_t V, int64_t ignore);
extern "C" int tide_cpu_token_logprobs_backward(int dtype, void *dlogits, const void *dlogp, const void *dentropy,
                                                const void *logits, const void *lse, const void *entropy,
                                                const void *targets, int tdtype, int64_t N, int64_t V, int64_t ignore);
extern "C" int tide_cpu_cross_entropy(int dtype, void *loss, void *valid, void *lse, const void *logits,
                                      const void *targets, int tdtype, const void *weights, int64_t N, int64_t V,
                                      int64_t ignore);
extern "C" int tide_cpu_cross_entropy_backward(int dtype, void *dlogits, const void *dloss, const void *logits,
                                               const void *lse, const void *targets, int tdtype, const void *weights,
                                               int64_t N, int64_t V, int64_t ignore);

static std::mt19937_64 gen(17);
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

// the device side in T (stats in its accumulation type A), the cpu side in C (float for bf16)
template <class T> static void token_logprobs_case(int64_t N, int64_t V, bool t64, double tol, double gtol)
{
    typedef typename tide_tr<T>::A A;
    typedef typename std::conditional<std::is_same<T, __nv_bfloat16>::value, float, T>::type C;
    std::string tag = std::string("token_logprobs ") + name_of<T>() + " [" + std::to_string(N) + "," +
                      std::to_string(V) + "] " + (t64 ? "i64" : "i32");
    vd x(N * V), t(N), glp(N), gh(N);
    for (auto &v : x) v = 3 * randn();
    x[V > 1 ? 1 : 0] = -INFINITY;                                   // a masked token in row 0 (not its target)
    for (int64_t n = 0; n < N; n++) {
        t[n] = n % 4 == 2 ? -100 : (double)((n * 7919 + 3) % V);
        if (n == 0 && V > 1 && t[n] == 1) t[n] = 0;
        glp[n] = randn(), gh[n] = randn();
    }
    std::vector<T> xd = to_dev<T>(x);
    vd xr = from_dev(xd);                                            // the values the device sees
    std::vector<C> xc(N * V);
    for (int64_t i = 0; i < N * V; i++) xc[i] = (C)xr[i];
    std::vector<int64_t> t8(N);
    std::vector<int32_t> t4(N);
    for (int64_t n = 0; n < N; n++) t8[n] = (int64_t)t[n], t4[n] = (int32_t)t[n];
    const void *tp = t64 ? (const void *)t8.data() : (const void *)t4.data();
    int td = t64 ? TIDE_I64 : TIDE_I32, cdt = std::is_same<C, float>::value ? TIDE_F32 : TIDE_F64;
    std::vector<A> lp(N), h(N), lse(N);
    std::vector<C> clp(N), ch(N), clse(N);
    if (tide_cuda_token_logprobs(dtype_of<T>(), lp.data(), h.data(), lse.data(), xd.data(), tp, td, N, V, -100) ||
        tide_cpu_token_logprobs(cdt, clp.data(), ch.data(), clse.data(), xc.data(), tp, td, N, V, -100)) {
        check_true(tag + ": forward ran (" + err_buf + ")", false);
        return;
    }
    check(tag + ": logp", from_dev(lp), from_dev(clp), tol);
    check(tag + ": entropy", from_dev(h), from_dev(ch), tol);
    check(tag + ": lse", from_dev(lse), from_dev(clse), tol);
    bool zeros = true;
    for (int64_t n = 0; n < N; n++)
        if (t[n] == -100) zeros = zeros && lp[n] == A(0) && h[n] == A(0);
    check_true(tag + ": ignored rows give logp 0, entropy 0", zeros);
    for (int pass = 0; pass < 2; pass++) {
        std::vector<A> dlp(N), dh(N);
        std::vector<C> cdlp(N), cdh(N);
        for (int64_t n = 0; n < N; n++) dlp[n] = (A)glp[n], dh[n] = (A)gh[n], cdlp[n] = (C)glp[n], cdh[n] = (C)gh[n];
        std::vector<T> dx(N * V);
        std::vector<C> cdx(N * V);
        const void *de = pass ? nullptr : (const void *)dh.data(), *cde = pass ? nullptr : (const void *)cdh.data();
        if (tide_cuda_token_logprobs_backward(dtype_of<T>(), dx.data(), dlp.data(), de, xd.data(), lse.data(), h.data(),
                                              tp, td, N, V, -100) ||
            tide_cpu_token_logprobs_backward(cdt, cdx.data(), cdlp.data(), cde, xc.data(), clse.data(), ch.data(), tp,
                                             td, N, V, -100)) {
            check_true(tag + ": backward ran (" + err_buf + ")", false);
            return;
        }
        vd g = from_dev(dx), cg = from_dev(cdx);
        check(tag + (pass ? ": dlogits, dentropy absent" : ": dlogits from dlogp and dentropy"), g, cg, gtol);
        bool row0 = g[1] == 0 && cg[1] == 0, ign = true;                // the -inf logit and the ignored rows: 0
        for (int64_t n = 0; n < N; n++)
            if (t[n] == -100)
                for (int64_t v = 0; v < V; v++) ign = ign && g[n * V + v] == 0;
        if (V > 1 && pass == 0) check_true(tag + ": zero gradient at the -inf logit and on ignored rows", row0 && ign);
    }
}

template <class T> static void cross_entropy_case(int64_t N, int64_t V, double tol)
{
    std::string tag = std::string("cross_entropy ") + name_of<T>() + " [" + std::to_string(N) + "," +
                      std::to_string(V) + "]";
    vd x(N * V);
    for (auto &v : x) v = 2 * randn();
    std::vector<int64_t> t(N);
    std::vector<T> w(N), dl(N);
    for (int64_t n = 0; n < N; n++) {
        t[n] = n % 3 == 1 ? -100 : (n * 31 + 1) % V;
        w[n] = (T)(0.5 + 0.1 * (double)n), dl[n] = (T)randn();
    }
    std::vector<T> xd = to_dev<T>(x), l(N), ok(N), lse(N), cl(N), cok(N), clse(N), dx(N * V), cdx(N * V);
    if (tide_cuda_cross_entropy(dtype_of<T>(), l.data(), ok.data(), lse.data(), xd.data(), t.data(), TIDE_I64, w.data(),
                                N, V, -100) ||
        tide_cpu_cross_entropy(dtype_of<T>(), cl.data(), cok.data(), clse.data(), xd.data(), t.data(), TIDE_I64,
                               w.data(), N, V, -100) ||
        tide_cuda_cross_entropy_backward(dtype_of<T>(), dx.data(), dl.data(), xd.data(), lse.data(), t.data(), TIDE_I64,
                                         w.data(), N, V, -100) ||
        tide_cpu_cross_entropy_backward(dtype_of<T>(), cdx.data(), dl.data(), xd.data(), clse.data(), t.data(),
                                        TIDE_I64, w.data(), N, V, -100)) {
        check_true(tag + ": ran (" + err_buf + ")", false);
        return;
    }
    check(tag + ": loss", from_dev(l), from_dev(cl), tol);
    check(tag + ": valid", from_dev(ok), from_dev(cok), tol);
    check(tag + ": dlogits", from_dev(dx), from_dev(cdx), tol);
}

int main()
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    printf("token_logprobs and cross_entropy (cuda under the emulator vs the cpu kernels)\n");
    token_logprobs_case<double>(6, 5, true, 1e-12, 1e-12);
    token_logprobs_case<double>(9, 300, false, 1e-12, 1e-12);
    token_logprobs_case<double>(5, 3001, true, 1e-12, 1e-12);
    token_logprobs_case<float>(9, 300, true, 1e-6, 1e-6);
    token_logprobs_case<float>(5, 3001, false, 1e-6, 1e-6);
    token_logprobs_case<__nv_bfloat16>(9, 300, true, 1e-6, 1.0 / 128);
    cross_entropy_case<double>(7, 300, 1e-12);
    cross_entropy_case<float>(7, 300, 1e-6);
    // a target outside [0, V): an error naming the row on both; on the GPU recorded on the device and reported at
    // the next synchronisation (the deferred record, common.cuh): the call itself returns 0
    {
        std::vector<float> x(3 * 5, 0.5f), lp(3), h(3), lse(3);
        std::vector<int64_t> t = {1, 7, 2};
        int rg = tide_cuda_token_logprobs(TIDE_F32, lp.data(), h.data(), lse.data(), x.data(), t.data(), TIDE_I64, 3, 5,
                                          -100);
        int rep = tide_cuda_deferred_report();
        std::string eg = err_buf;
        int rc = tide_cpu_token_logprobs(TIDE_F32, lp.data(), h.data(), lse.data(), x.data(), t.data(), TIDE_I64, 3, 5,
                                         -100);
        check_true("token_logprobs target 7 of V 5 at row 1: an error on both (" + eg + ")",
                   !rg && rep && rc && eg.find("target 7 at row 1") != std::string::npos);
        check_true("the record is clean after its report", tide_cuda_deferred_report() == 0);
        // two bad calls: the earlier one is reported (its first row), with its own op and value
        std::vector<int32_t> t1 = {4, 2, 9}, t2 = {-3, 1, 1};
        std::vector<float> l3(3), v3(3);
        int r1 = tide_cuda_cross_entropy(TIDE_F32, l3.data(), v3.data(), lse.data(), x.data(), t1.data(), TIDE_I32,
                                         nullptr, 3, 5, -100);
        int r2 = tide_cuda_token_logprobs(TIDE_F32, lp.data(), h.data(), lse.data(), x.data(), t2.data(), TIDE_I32, 3, 5,
                                          -100);
        rep = tide_cuda_deferred_report();
        eg = err_buf;
        check_true("of two bad calls the first is reported: " + eg,
                   !r1 && !r2 && rep && eg.find("cross_entropy: target 9 at row 2") != std::string::npos &&
                       tide_cuda_deferred_report() == 0);
        // a clean call after them leaves nothing to report
        std::vector<int64_t> ok = {0, 4, -100};
        r1 = tide_cuda_cross_entropy(TIDE_F32, l3.data(), v3.data(), lse.data(), x.data(), ok.data(), TIDE_I64, nullptr,
                                     3, 5, -100);
        check_true("a clean call: nothing reported", !r1 && tide_cuda_deferred_report() == 0);
    }
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

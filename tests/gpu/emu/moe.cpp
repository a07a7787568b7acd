// moe.cpp — runs the real kernels/cuda/moe.cu under the host emulator (emu.h) against the cpu kernels (spec/moe.md
// §6, §2, §8): SiTU-GLU and its backward, top-k (exact), and moe_experts forward/backward: the routing (perm, pos,
// offsets) must equal the cpu's exactly, the outputs and gradients within 1e-5 of max|cpu| (f32: the products
// differ only in summation order). cuBLAS cannot run here: tide_cuda_gemm is a plain host loop (fp32 accumulate),
// so what is checked is everything around the GEMMs. Usage: tests/gpu/emu/run_moe.sh (EMU_SEED=n reorders threads).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <string>

#include "emu_host.h"

// the stand-in for cuBLAS: C = op(A) op(B) (alpha 1, beta 0 only: what moe.cu asks), fp32/fp64 accumulate
int tide_cuda_gemm(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A, int64_t lda,
                   const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    if (alpha != 1.0 || beta != 0.0) return tide_set_error("emu gemm: only alpha 1, beta 0");
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = 0;
            for (int64_t k = 0; k < K; k++) {
                int64_t ia = ta ? k * lda + i : i * lda + k, ib = tb ? j * ldb + k : k * ldb + j;
                if (dtype == TIDE_F32) acc += (double)((const float *)A)[ia] * ((const float *)B)[ib];
                else acc += ((const double *)A)[ia] * ((const double *)B)[ib];
            }
            if (dtype == TIDE_F32) ((float *)C)[i * ldc + j] = (float)acc;
            else ((double *)C)[i * ldc + j] = acc;
        }
    return 0;
}

#include "moe_emu.inc"

typedef std::vector<double> vd;
static std::mt19937_64 gen(17);
static float randn()
{
    std::normal_distribution<double> d(0.0, 1.0);
    return (float)d(gen);
}
static int n_fail = 0, n_pass = 0;
static void check(const char *name, const std::vector<float> &got, const std::vector<float> &ref, double tol)
{
    double mx = 0, e = 0;
    int nonfin = 0;
    for (size_t i = 0; i < ref.size(); i++) mx = std::max(mx, (double)std::fabs(ref[i]));
    for (size_t i = 0; i < ref.size(); i++) {
        if (!std::isfinite(got[i])) { nonfin++; continue; }
        e = std::max(e, (double)std::fabs(got[i] - ref[i]));
    }
    double rel = mx > 0 ? e / mx : e;
    bool ok = nonfin == 0 && rel <= tol && got.size() == ref.size();
    printf("  %-34s %s err/max %.2e (tol %.1e)%s\n", name, ok ? "ok  " : "FAIL", rel, tol, nonfin ? "  NONFINITE" : "");
    if (ok) n_pass++; else n_fail++;
}
static void check_exact(const char *name, bool ok)
{
    printf("  %-34s %s\n", name, ok ? "ok  " : "FAIL");
    if (ok) n_pass++; else n_fail++;
}
static std::vector<float> rv(size_t n, float s = 1)
{
    std::vector<float> v(n);
    for (auto &x : v) x = s * randn();
    return v;
}

static void run_moe(const char *name, int64_t m, int64_t k, int64_t n, int64_t din, int64_t de, int64_t dout, int act,
                    double cf, int full_expert)
{
    printf("%s: m %lld k %lld n %lld, d %lld/%lld/%lld, %s, capacity %g\n", name, (long long)m, (long long)k, (long long)n,
           (long long)din, (long long)de, (long long)dout, act ? "swiglu" : "situ", cf);
    int64_t A = m * k, cap = cf > 0 ? (int64_t)ceil(cf * (double)A / (double)n) : -1;
    std::vector<int64_t> sel(A);
    for (int64_t a = 0; a < A; a++) sel[a] = full_expert >= 0 && a % k == 0 ? full_expert : (int64_t)(gen() % (uint64_t)(n > 2 ? n - 2 : n));
    auto x = rv(m * din), wgu = rv(n * 2 * de * din, 0.3f), wd = rv(n * dout * de, 0.3f), du = rv(m * dout);
    std::vector<float> p(A);
    for (auto &v : p) v = 0.1f + 0.9f * (float)(gen() % 1000) / 1000.0f;
    // cpu
    std::vector<int64_t> rc(2 * A + n + 1);
    std::vector<float> oc(m * dout), prc(A * 2 * de), yc(A * dout), dxc(m * din), dpc(A), dwguc(wgu.size()), dwdc(wd.size());
    int64_t dropc = -1, dropg = -2;
    tide_cpu_backend.moe_experts(TIDE_F32, oc.data(), rc.data(), prc.data(), yc.data(), x.data(), sel.data(), TIDE_I64, p.data(),
                                 wgu.data(), wd.data(), m, k, n, din, de, dout, act, 1.5, 2.0, cap, &dropc);
    tide_cpu_backend.moe_experts_backward(TIDE_F32, dxc.data(), dpc.data(), dwguc.data(), dwdc.data(), du.data(), rc.data(),
                                          prc.data(), yc.data(), x.data(), p.data(), wgu.data(), wd.data(), m, k, n, din, de,
                                          dout, act, 1.5, 2.0);
    // emulated cuda, outputs poisoned with NaN
    std::vector<int64_t> rg(2 * A + n + 1, -7);
    std::vector<float> og(m * dout, NAN), prg(A * 2 * de, NAN), yg(A * dout, NAN), dxg(m * din, NAN), dpg(A, NAN),
        dwgug(wgu.size(), NAN), dwdg(wd.size(), NAN);
    if (tide_cuda_moe_experts(TIDE_F32, og.data(), rg.data(), prg.data(), yg.data(), x.data(), sel.data(), TIDE_I64, p.data(),
                              wgu.data(), wd.data(), m, k, n, din, de, dout, act, 1.5, 2.0, cap, &dropg) ||
        tide_cuda_moe_experts_backward(TIDE_F32, dxg.data(), dpg.data(), dwgug.data(), dwdg.data(), du.data(), rg.data(),
                                       prg.data(), yg.data(), x.data(), p.data(), wgu.data(), wd.data(), m, k, n, din, de, dout,
                                       act, 1.5, 2.0)) {
        printf("  failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    check_exact("route (perm | pos | offsets) == cpu", rg == rc);
    check_exact("dropped count == cpu", dropg == dropc);
    int64_t R = rc[2 * A + n];
    check("out", og, oc, 1e-5);
    check("pre (kept rows)", std::vector<float>(prg.begin(), prg.begin() + R * 2 * de),
          std::vector<float>(prc.begin(), prc.begin() + R * 2 * de), 1e-5);
    check("dx", dxg, dxc, 1e-5);
    check("dp", dpg, dpc, 1e-5);
    check("dw_gate_up", dwgug, dwguc, 1e-5);
    check("dw_down", dwdg, dwdc, 1e-5);
}

int main()
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    {
        printf("situ_glu and topk\n");
        int64_t N = 300;
        auto g = rv(N, 3), u = rv(N, 3), d = rv(N);
        std::vector<float> hc(N), hg(N, NAN), dgc(N), duc(N), dgg(N, NAN), dug(N, NAN);
        tide_cpu_backend.situ_glu(TIDE_F32, hc.data(), g.data(), u.data(), N, 1.5, 2.0);
        tide_cpu_backend.situ_glu_backward(TIDE_F32, dgc.data(), duc.data(), d.data(), g.data(), u.data(), N, 1.5, 2.0);
        tide_cuda_situ_glu(TIDE_F32, hg.data(), g.data(), u.data(), N, 1.5, 2.0);
        tide_cuda_situ_glu_backward(TIDE_F32, dgg.data(), dug.data(), d.data(), g.data(), u.data(), N, 1.5, 2.0);
        check("situ_glu", hg, hc, 1e-6);
        check("situ_glu dg", dgg, dgc, 1e-6);
        check("situ_glu du", dug, duc, 1e-6);
        int64_t rows = 41, C = 13, kk = 4;
        auto x = rv(rows * C);
        for (int64_t c = 0; c < C; c += 3) x[5 * C + c] = 1.0f;   // ties in row 5
        std::vector<float> vc(rows * kk), vg(rows * kk, NAN);
        std::vector<int64_t> ic(rows * kk), ig(rows * kk, -1);
        tide_cpu_backend.topk(TIDE_F32, vc.data(), ic.data(), x.data(), rows, C, kk);
        tide_cuda_topk(TIDE_F32, vg.data(), ig.data(), x.data(), rows, C, kk);
        check_exact("topk values and indices == cpu", vc == vg && ic == ig);
    }
    run_moe("dropless, one expert in every token, two idle", 29, 2, 8, 12, 8, 10, TIDE_MOE_SITU, 0, 3);
    run_moe("swiglu, k 3", 17, 3, 5, 7, 6, 9, TIDE_MOE_SWIGLU, 0, -1);
    run_moe("capacity 0.75", 31, 2, 6, 8, 5, 7, TIDE_MOE_SITU, 0.75, 1);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

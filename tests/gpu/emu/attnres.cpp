// attnres.cpp — runs the real kernels/cuda/attnres.cu under the host emulator (emu.h) against an fp64 reference
// of spec/attnres.md §1 and §4 (itself checked by central differences on the first case) and against the cpu
// kernel. The CUDA forward is the online-softmax form, the cpu one the direct form: their agreement in f32 is
// attnres.md oracle 5 (<= 1e-6 of max|out|). Usage: tests/gpu/emu/run_one.sh attnres (EMU_SEED=n reorders threads).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <string>

#include "emu_host.h"

#include "attnres_emu.inc"

typedef std::vector<double> vd;
static std::mt19937_64 gen(11);
static double randn()
{
    std::normal_distribution<double> d(0.0, 1.0);
    return d(gen);
}
static double bfr(double x) { return (double)__bfloat162float(__float2bfloat16((float)x)); }

template <class T> static std::vector<T> to_dev(const vd &x)
{
    std::vector<T> o(x.size());
    for (size_t i = 0; i < x.size(); i++) {
        if constexpr (std::is_same<T, float>::value) o[i] = (float)x[i];
        else o[i] = __float2bfloat16((float)x[i]);
    }
    return o;
}
template <class T> static vd from_dev(const std::vector<T> &x)
{
    vd o(x.size());
    for (size_t i = 0; i < x.size(); i++) {
        if constexpr (std::is_same<T, float>::value) o[i] = x[i];
        else o[i] = __bfloat162float(x[i]);
    }
    return o;
}

static int n_fail = 0, n_pass = 0;
// err / max|ref| <= tol, every value finite
static void check(const char *name, const vd &got, const vd &ref, double tol)
{
    double mx = 0, e = 0;
    size_t worst = 0;
    int nonfin = 0;
    for (size_t i = 0; i < ref.size(); i++) mx = std::max(mx, std::fabs(ref[i]));
    for (size_t i = 0; i < ref.size(); i++) {
        if (!std::isfinite(got[i])) {
            nonfin++;
            continue;
        }
        double d = std::fabs(got[i] - ref[i]);
        if (d > e) {
            e = d;
            worst = i;
        }
    }
    double rel = mx > 0 ? e / mx : e;
    bool ok = nonfin == 0 && rel <= tol && got.size() == ref.size();
    printf("  %-30s %s max|ref| %.3g  err/max %.2e (tol %.1e)%s", name, ok ? "ok  " : "FAIL", mx, rel, tol,
           nonfin ? "  NONFINITE" : "");
    if (!ok && ref.size()) printf("  worst [%zu] got %.6g ref %.6g", worst, got[worst], ref[worst]);
    printf("\n");
    if (ok) n_pass++;
    else n_fail++;
}

// ---- fp64 reference (attnres.md §1, §4) -----------------------------------------------------------------
struct Prob {
    int n;
    int64_t rows, d;
    double eps;
    std::vector<vd> v;   // n sources [rows, d]
    vd w, nu;
};

static void ref_forward(const Prob &p, vd &out, vd &P, vd &R)
{
    int64_t rows = p.rows, d = p.d;
    out.assign(rows * d, 0);
    P.assign(p.n * rows, 0);
    R.assign(p.n * rows, 0);
    for (int64_t t = 0; t < rows; t++) {
        vd s(p.n);
        double m = -INFINITY, z = 0;
        for (int i = 0; i < p.n; i++) {
            double ss = 0, dot = 0;
            for (int64_t c = 0; c < d; c++) {
                double x = p.v[i][t * d + c];
                ss += x * x;
                dot += p.w[c] * p.nu[c] * x;
            }
            R[i * rows + t] = 1 / std::sqrt(ss / d + p.eps);
            s[i] = R[i * rows + t] * dot;
            m = std::max(m, s[i]);
        }
        for (int i = 0; i < p.n; i++) z += std::exp(s[i] - m);
        for (int i = 0; i < p.n; i++) {
            P[i * rows + t] = std::exp(s[i] - m) / z;
            for (int64_t c = 0; c < d; c++) out[t * d + c] += P[i * rows + t] * p.v[i][t * d + c];
        }
    }
}

// §4 written out: dv_i, dw, dν from dout
static void ref_backward(const Prob &p, const vd &go, std::vector<vd> &gv, vd &gw, vd &gnu)
{
    int64_t rows = p.rows, d = p.d;
    vd out, P, R;
    ref_forward(p, out, P, R);
    gv.assign(p.n, vd(rows * d));
    gw.assign(d, 0);
    gnu.assign(d, 0);
    for (int64_t t = 0; t < rows; t++) {
        vd dp(p.n), s(p.n);
        double G = 0;
        for (int i = 0; i < p.n; i++) {
            double e = 0, dot = 0;
            for (int64_t c = 0; c < d; c++) {
                e += go[t * d + c] * p.v[i][t * d + c];
                dot += p.w[c] * p.nu[c] * p.v[i][t * d + c];
            }
            dp[i] = e;
            s[i] = R[i * rows + t] * dot;
            G += P[i * rows + t] * e;
        }
        for (int i = 0; i < p.n; i++) {
            double pi = P[i * rows + t], r = R[i * rows + t], ds = pi * (dp[i] - G);
            for (int64_t c = 0; c < d; c++) {
                double x = p.v[i][t * d + c], a = p.w[c] * p.nu[c];
                gv[i][t * d + c] = pi * go[t * d + c] + ds * (r * a - s[i] * r * r * x / d);
                gw[c] += ds * r * p.nu[c] * x;
                gnu[c] += ds * r * p.w[c] * x;
            }
        }
    }
}

static Prob make(int n, int64_t rows, int64_t d, double wscale, bool bf16)
{
    Prob p{n, rows, d, 1e-5, {}, {}, {}};
    auto rnd = [&](double sc) { return bf16 ? bfr(sc * randn()) : sc * randn(); };
    for (int i = 0; i < n; i++) {
        vd x(rows * d);
        for (auto &y : x) y = rnd(0.5 + 0.25 * i);
        p.v.push_back(x);
    }
    p.w.resize(d);
    p.nu.resize(d);
    for (auto &y : p.w) y = rnd(wscale);
    for (auto &y : p.nu) y = bf16 ? bfr(1 + 0.2 * randn()) : 1 + 0.2 * randn();
    return p;
}

// the reference adjoint against central differences of Σ out ⊙ go (h = 1e-6) on a small problem (oracle 2)
static void check_reference(const Prob &p0, const vd &go)
{
    std::vector<vd> gv;
    vd gw, gnu;
    ref_backward(p0, go, gv, gw, gnu);
    auto loss = [&](const Prob &q) {
        vd out, P, R;
        ref_forward(q, out, P, R);
        double l = 0;
        for (size_t k = 0; k < out.size(); k++) l += out[k] * go[k];
        return l;
    };
    double worst = 0;
    for (int which = 0; which <= p0.n + 1; which++) {
        Prob q = p0;
        vd &x = which < p0.n ? q.v[which] : which == p0.n ? q.w : q.nu;
        const vd &g = which < p0.n ? gv[which] : which == p0.n ? gw : gnu;
        for (size_t k = 0; k < x.size(); k++) {
            double x0 = x[k];
            x[k] = x0 + 1e-6;
            double lp = loss(q);
            x[k] = x0 - 1e-6;
            double lm = loss(q);
            x[k] = x0;
            worst = std::max(worst, std::fabs((lp - lm) / 2e-6 - g[k]));
        }
    }
    bool ok = worst <= 1e-8;
    printf("  %-30s %s max error %.2e (tol 1e-8)\n", "reference adjoint vs differences", ok ? "ok  " : "FAIL", worst);
    if (ok) n_pass++;
    else n_fail++;
}

template <class T>
static void run_case(const char *name, int n, int64_t rows, int64_t d, double wscale, double tol, double gtol)
{
    const bool bf16 = sizeof(T) == 2;
    const int dtype = bf16 ? TIDE_BF16 : TIDE_F32;
    printf("%s [%s, n %d, rows %lld, d %lld]\n", name, bf16 ? "bf16" : "f32", n, (long long)rows, (long long)d);
    Prob p = make(n, rows, d, wscale, bf16);
    vd go(rows * d);
    for (auto &y : go) y = bf16 ? bfr(randn()) : randn();
    vd out, P, R;
    ref_forward(p, out, P, R);
    std::vector<vd> rgv;
    vd rgw, rgnu;
    ref_backward(p, go, rgv, rgw, rgnu);

    std::vector<std::vector<T>> vdv;
    std::vector<const void *> src;
    for (int i = 0; i < n; i++) vdv.push_back(to_dev<T>(p.v[i]));
    for (int i = 0; i < n; i++) src.push_back(vdv[i].data());
    auto wd = to_dev<T>(p.w), nd = to_dev<T>(p.nu), god = to_dev<T>(go);
    std::vector<T> o = to_dev<T>(vd(rows * d, NAN));
    std::vector<float> stats(2 * n * rows, NAN);
    if (tide_cuda_attnres(dtype, o.data(), stats.data(), src.data(), n, rows, d, wd.data(), nd.data(), p.eps)) {
        printf("  failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    check("out", from_dev(o), out, tol);
    check("p (stats)", vd(stats.begin(), stats.begin() + n * rows), P, tol);
    check("r (stats)", vd(stats.begin() + n * rows, stats.end()), R, tol);
    // every source's gradient but the last (NULL: not wanted, must be skipped)
    std::vector<std::vector<T>> gvd;
    std::vector<void *> gsrc;
    for (int i = 0; i < n; i++) gvd.push_back(to_dev<T>(vd(rows * d, NAN)));
    for (int i = 0; i < n; i++) gsrc.push_back(i == n - 1 && n > 1 ? nullptr : gvd[i].data());
    std::vector<T> gw = to_dev<T>(vd(d, NAN)), gnu = to_dev<T>(vd(d, NAN));
    if (tide_cuda_attnres_backward(dtype, gsrc.data(), gw.data(), gnu.data(), god.data(), src.data(), stats.data(), n, rows,
                                   d, wd.data(), nd.data())) {
        printf("  backward failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    for (int i = 0; i < n; i++) {
        if (!gsrc[i]) continue;
        char what[32];
        snprintf(what, sizeof what, "dv_%d", i);
        check(what, from_dev(gvd[i]), rgv[i], gtol);
    }
    check("dw", from_dev(gw), rgw, gtol);
    check("dnu", from_dev(gnu), rgnu, gtol);
    if (bf16) return;
    // oracle 5: the online form (cuda) == the direct form (cpu), f32
    std::vector<float> co(rows * d), cst(2 * n * rows), cgw(d), cgn(d);
    std::vector<std::vector<float>> cgv(n, std::vector<float>(rows * d));
    std::vector<void *> cg;
    for (int i = 0; i < n; i++) cg.push_back(cgv[i].data());
    tide_cpu_backend.attnres(TIDE_F32, co.data(), cst.data(), src.data(), n, rows, d, wd.data(), nd.data(), p.eps);
    tide_cpu_backend.attnres_backward(TIDE_F32, cg.data(), cgw.data(), cgn.data(), god.data(), src.data(), cst.data(), n,
                                      rows, d, wd.data(), nd.data());
    check("online (cuda) vs direct (cpu) out", from_dev(o), vd(co.begin(), co.end()), 1e-6);
    check("cuda vs cpu p", vd(stats.begin(), stats.end()), vd(cst.begin(), cst.end()), 1e-6);
    check("cuda vs cpu dw", from_dev(gw), vd(cgw.begin(), cgw.end()), 1e-5);
    check("cuda vs cpu dv_0", from_dev(gvd[0]), vd(cgv[0].begin(), cgv[0].end()), 1e-5);
}

int main()
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    {
        printf("the fp64 reference\n");
        Prob p = make(3, 2, 6, 1.0, false);
        vd go(2 * 6);
        for (auto &y : go) y = randn();
        check_reference(p, go);
    }
    // d 40: 32 threads x 2 channels; d 300: 96 threads x 4 (a partial warp row); d 7: mostly idle lanes
    run_case<float>("attnres small", 3, 5, 40, 0.5, 1e-5, 1e-5);
    run_case<float>("attnres one source", 1, 4, 7, 1.0, 1e-6, 1e-5);
    run_case<float>("attnres block sizes", 9, 3, 300, 0.2, 1e-5, 1e-5);
    run_case<float>("attnres full sizes", 17, 2, 64, 0.5, 1e-5, 1e-5);
    run_case<float>("attnres wide", 2, 1, 5000, 0.05, 1e-5, 1e-5);
    run_case<float>("attnres k3 width (7,168: 448 threads x 16)", 2, 1, 7168, 0.05, 1e-5, 1e-5);
    run_case<float>("attnres widest (16,384: 512 threads x 32)", 2, 1, 16384, 0.01, 1e-5, 1e-5);
    run_case<float>("attnres many rows", 3, 70, 16, 1.0, 1e-5, 1e-5);
    // bf16 storage, fp32 math: one bf16 step of the output scale (2^-7), gradients 2^-6
    run_case<__nv_bfloat16>("attnres bf16", 3, 5, 40, 0.5, 1.0 / 128, 1.0 / 64);
    run_case<__nv_bfloat16>("attnres bf16 block sizes", 9, 3, 300, 0.2, 1.0 / 128, 1.0 / 64);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

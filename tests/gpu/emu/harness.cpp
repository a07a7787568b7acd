// harness.cpp — runs the real kernels/cuda/kda.cu, conv.cu, mla.cu and attention.cu under the host emulator (emu.h)
// against fp64 references (the recurrence of kda.md §3, naive MLA attention (mla_cases.h), and their adjoints,
// themselves checked by central differences; softmax attention against the cpu kernel in f64 (attention_cases.h))
// and against the cpu kernels; mla.cu's latent path with gemm.cu over a cuBLAS stand-in (emu_cublas.h) against the
// cpu kernel in f64 and f32 (mla_latent_cases.h). Usage:
// tests/gpu/emu/run.sh [gate|conv|kdasmall|kda16|kda64|kda128|kdackpt|kdasplit|kdamem|bound|mlasmall|mlaedge|mla64|mla128|mlalatent|varlen|attnsmall|attn64]...
// Env: NO_CPU=1 skips the cpu cross-check, EMU_SEED=n reorders the emulated threads, KDA_LAYOUT=1 and
// MLA_LAYOUT=1 print the shared-memory sizes (MLA: the tiles each kernel picks at sm_80 and sm_90 limits).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <string>

#include "emu_host.h"
#include "emu_cublas.h"

#include "kda_emu.inc"
#include "conv_emu.inc"
#include "gemm_emu.inc"
#define MLA_DKV_TARGET_BLOCKS 6   // small: short test sequences reach both the one- and several-head-group dk_r paths
#include "mla_emu.inc"
#define ATTN_ROWS_PER_LAUNCH 2   // small: a few batch rows reach the split into several launches
#include "attention_emu.inc"

// ---- helpers -------------------------------------------------------------------------------------------
typedef std::vector<double> vd;
static std::mt19937_64 gen(7);
static double randn()
{
    std::normal_distribution<double> d(0.0, 1.0);
    return d(gen);
}
static double unif() { return std::uniform_real_distribution<double>(0.0, 1.0)(gen); }
static double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }
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
static vd fvec(const std::vector<float> &x) { return vd(x.begin(), x.end()); }

static int n_fail = 0, n_pass = 0;
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
    bool ok = nonfin == 0 && rel <= tol;
    printf("  %-34s %s max|ref| %.3g  err/max %.2e (tol %.1e)%s", name, ok ? "ok  " : "FAIL", mx, rel, tol,
           nonfin ? "  NONFINITE" : "");
    if (!ok && ref.size()) printf("  worst [%zu] got %.6g ref %.6g", worst, got[worst], ref[worst]);
    printf("\n");
    if (ok) n_pass++;
    else n_fail++;
}

// ---- KDA fp64 reference: the recurrence of kda.md §3 and its adjoint -----------------------------------
struct KdaProb {
    int B, T, H, dk, dv;
    std::vector<int64_t> cu;   // boundaries incl. row starts
    vd q, k, v, g, beta, s0;   // s0 may be empty
};
struct Seg {
    int64_t a, e, b;
    bool first, last;
};
static std::vector<Seg> segs(const KdaProb &p)
{
    std::vector<Seg> s;
    for (size_t i = 0; i + 1 < p.cu.size(); i++) {
        int64_t a = p.cu[i], e = p.cu[i + 1];
        if (e == a) continue;
        int64_t b = a / p.T;
        s.push_back({a, e, b, a == b * p.T, e == (b + 1) * p.T});
    }
    return s;
}

static void ref_forward(const KdaProb &p, vd &o, vd &sout, std::vector<vd> *states = nullptr)
{
    int H = p.H, dk = p.dk, dv = p.dv;
    o.assign((size_t)p.B * p.T * H * dv, 0);
    sout.assign((size_t)p.B * H * dk * dv, 0);
    if (states) states->assign((size_t)p.B * p.T * H, vd());
    for (const Seg &sg : segs(p))
        for (int h = 0; h < H; h++) {
            vd S((size_t)dk * dv, 0.0);
            if (sg.first && !p.s0.empty())
                for (int i = 0; i < dk * dv; i++) S[i] = p.s0[((size_t)sg.b * H + h) * dk * dv + i];
            for (int64_t n = sg.a; n < sg.e; n++) {
                size_t bk = ((size_t)n * H + h) * dk, bv = ((size_t)n * H + h) * dv;
                if (states) (*states)[(size_t)n * H + h] = S;   // state before the token
                for (int i = 0; i < dk; i++)
                    for (int j = 0; j < dv; j++) S[i * dv + j] *= std::exp(p.g[bk + i]);
                double bt = p.beta[(size_t)n * H + h];
                vd u(dv);
                for (int j = 0; j < dv; j++) {
                    double e = 0;
                    for (int i = 0; i < dk; i++) e += S[i * dv + j] * p.k[bk + i];
                    u[j] = bt * (p.v[bv + j] - e);
                }
                for (int i = 0; i < dk; i++)
                    for (int j = 0; j < dv; j++) S[i * dv + j] += p.k[bk + i] * u[j];
                for (int j = 0; j < dv; j++) {
                    double s = 0;
                    for (int i = 0; i < dk; i++) s += S[i * dv + j] * p.q[bk + i];
                    o[bv + j] = s;
                }
            }
            if (sg.last)
                for (int i = 0; i < dk * dv; i++) sout[((size_t)sg.b * H + h) * dk * dv + i] = S[i];
        }
}

struct KdaGrad {
    vd q, k, v, g, beta, s0;
};
static KdaGrad ref_backward(const KdaProb &p, const vd &go, const vd &gso)
{
    int H = p.H, dk = p.dk, dv = p.dv;
    vd o, so;
    std::vector<vd> st;
    ref_forward(p, o, so, &st);
    KdaGrad r;
    r.q.assign(p.q.size(), 0);
    r.k.assign(p.k.size(), 0);
    r.g.assign(p.g.size(), 0);
    r.v.assign(p.v.size(), 0);
    r.beta.assign(p.beta.size(), 0);
    r.s0.assign((size_t)p.B * H * dk * dv, 0);
    for (const Seg &sg : segs(p))
        for (int h = 0; h < H; h++) {
            vd dS((size_t)dk * dv, 0.0);
            if (sg.last)
                for (int i = 0; i < dk * dv; i++) dS[i] = gso[((size_t)sg.b * H + h) * dk * dv + i];
            for (int64_t n = sg.e - 1; n >= sg.a; n--) {
                size_t bk = ((size_t)n * H + h) * dk, bv = ((size_t)n * H + h) * dv, bh = (size_t)n * H + h;
                const vd &Sp = st[bh];
                vd Sa((size_t)dk * dv), al(dk);
                for (int i = 0; i < dk; i++) al[i] = std::exp(p.g[bk + i]);
                for (int i = 0; i < dk; i++)
                    for (int j = 0; j < dv; j++) Sa[i * dv + j] = Sp[i * dv + j] * al[i];
                double bt = p.beta[bh];
                vd e(dv), u(dv);
                for (int j = 0; j < dv; j++) {
                    double s = 0;
                    for (int i = 0; i < dk; i++) s += Sa[i * dv + j] * p.k[bk + i];
                    e[j] = s;
                    u[j] = bt * (p.v[bv + j] - s);
                }
                vd S((size_t)dk * dv);
                for (int i = 0; i < dk; i++)
                    for (int j = 0; j < dv; j++) S[i * dv + j] = Sa[i * dv + j] + p.k[bk + i] * u[j];
                // o = Sᵀq
                for (int i = 0; i < dk; i++) {
                    double s = 0;
                    for (int j = 0; j < dv; j++) {
                        dS[i * dv + j] += p.q[bk + i] * go[bv + j];
                        s += S[i * dv + j] * go[bv + j];
                    }
                    r.q[bk + i] = s;
                }
                // S = Sa + k uᵀ
                vd du(dv, 0.0);
                for (int i = 0; i < dk; i++) {
                    double s = 0;
                    for (int j = 0; j < dv; j++) {
                        s += dS[i * dv + j] * u[j];
                        du[j] += dS[i * dv + j] * p.k[bk + i];
                    }
                    r.k[bk + i] = s;
                }
                // u = β(v − e)
                double db = 0;
                vd de(dv);
                for (int j = 0; j < dv; j++) {
                    db += du[j] * (p.v[bv + j] - e[j]);
                    r.v[bv + j] = bt * du[j];
                    de[j] = -bt * du[j];
                }
                r.beta[bh] = db;
                // e = Saᵀ k: dSa = dS + k deᵀ; dk += Sa de
                for (int i = 0; i < dk; i++) {
                    double s = 0;
                    for (int j = 0; j < dv; j++) {
                        s += Sa[i * dv + j] * de[j];
                        dS[i * dv + j] += p.k[bk + i] * de[j];
                    }
                    r.k[bk + i] += s;
                }
                // Sa = diag(α) Sp
                for (int i = 0; i < dk; i++) {
                    double s = 0;
                    for (int j = 0; j < dv; j++) {
                        s += dS[i * dv + j] * Sp[i * dv + j];
                        dS[i * dv + j] *= al[i];
                    }
                    r.g[bk + i] = s * al[i];
                }
            }
            if (sg.first)
                for (int i = 0; i < dk * dv; i++) r.s0[((size_t)sg.b * H + h) * dk * dv + i] = dS[i];
        }
    return r;
}

static double kda_loss(const KdaProb &p, const vd &ro, const vd &rs)
{
    vd o, so;
    ref_forward(p, o, so);
    double l = 0;
    for (size_t i = 0; i < o.size(); i++) l += o[i] * ro[i];
    for (size_t i = 0; i < so.size(); i++) l += so[i] * rs[i];
    return l;
}

static KdaProb make_prob(int B, int T, int H, int dk, int dv, std::vector<int64_t> docs, double lb, bool softplus_gate,
                         bool bf16)
{
    KdaProb p;
    p.B = B;
    p.T = T;
    p.H = H;
    p.dk = dk;
    p.dv = dv;
    // boundaries: row starts plus docs (offsets inside rows, flattened)
    std::vector<int64_t> c;
    for (int b = 0; b <= B; b++) c.push_back((int64_t)b * T);
    for (int64_t d : docs) c.push_back(d);
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
    p.cu = c;
    size_t N = (size_t)B * T * H;
    p.q.resize(N * dk);
    p.k.resize(N * dk);
    p.g.resize(N * dk);
    p.v.resize(N * dv);
    p.beta.resize(N);
    for (size_t n = 0; n < N; n++) {
        double sq = 0, sk = 0;
        for (int i = 0; i < dk; i++) {
            p.q[n * dk + i] = randn();
            p.k[n * dk + i] = randn();
            sq += p.q[n * dk + i] * p.q[n * dk + i];
            sk += p.k[n * dk + i] * p.k[n * dk + i];
        }
        for (int i = 0; i < dk; i++) {
            p.q[n * dk + i] /= std::sqrt(sq + 1e-6) * std::sqrt((double)dk);
            p.k[n * dk + i] /= std::sqrt(sk + 1e-6);
        }
        for (int i = 0; i < dk; i++) {
            double z = 2 * randn();
            p.g[n * dk + i] = softplus_gate ? -std::log1p(std::exp(z)) * (unif() < 0.05 ? 40.0 : 1.0) : lb * sig(z);
        }
        for (int j = 0; j < dv; j++) p.v[n * dv + j] = randn();
        p.beta[n] = sig(randn());
    }
    p.s0.resize((size_t)B * H * dk * dv);
    for (auto &x : p.s0) x = 0.5 * randn();
    if (bf16) {
        for (auto *x : {&p.q, &p.k, &p.g, &p.v, &p.beta})
            for (auto &y : *x) y = bfr(y);
    }
    return p;
}

template <class T>
static void run_kda_case(const char *name, KdaProb &p, int path, int chunk, double lb, double tol_o, double tol_g,
                         bool with_s0 = true, bool want_fd = false)
{
    printf("%s  [B %d T %d H %d dk %d dv %d, %zu segs, path %d chunk %d, %s]\n", name, p.B, p.T, p.H, p.dk, p.dv,
           p.cu.size() - 1, path, chunk, sizeof(T) == 2 ? "bf16" : "f32");
    if (!with_s0) p.s0.clear();
    int dtype = sizeof(T) == 2 ? TIDE_BF16 : TIDE_F32;
    auto q = to_dev<T>(p.q), k = to_dev<T>(p.k), v = to_dev<T>(p.v), g = to_dev<T>(p.g), be = to_dev<T>(p.beta);
    std::vector<float> s0(p.s0.begin(), p.s0.end());
    size_t No = (size_t)p.B * p.T * p.H * p.dv, Ns = (size_t)p.B * p.H * p.dk * p.dv;
    std::vector<T> o = to_dev<T>(vd(No, NAN));
    std::vector<float> so(Ns, NAN);
    int rc = tide_cuda_kda(dtype, o.data(), so.data(), q.data(), k.data(), v.data(), g.data(), be.data(),
                           with_s0 ? s0.data() : nullptr, p.cu.data(), (int64_t)p.cu.size() - 1, p.B, p.T, p.H, p.dk,
                           p.dv, path, chunk, lb, nullptr);
    if (rc) {
        printf("  forward failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    vd ro, rso;
    ref_forward(p, ro, rso);
    check("o", from_dev(o), ro, tol_o);
    check("state", fvec(so), rso, tol_o);
    // backward of sum(o ⊙ r) + sum(state ⊙ r2)
    vd r1(No), r2(Ns);
    for (auto &x : r1) x = randn();
    for (auto &x : r2) x = randn();
    if (sizeof(T) == 2 && !getenv("EXACT_R"))
        for (auto &x : r1) x = bfr(x);
    auto gout = to_dev<T>(r1);
    std::vector<float> gso(r2.begin(), r2.end());
    size_t Nk = (size_t)p.B * p.T * p.H * p.dk;
    std::vector<T> gq = to_dev<T>(vd(Nk, NAN)), gk = gq, gg = gq, gv = to_dev<T>(vd(No, NAN)),
                   gb = to_dev<T>(vd((size_t)p.B * p.T * p.H, NAN));
    std::vector<float> gs0(Ns, NAN);
    rc = tide_cuda_kda_backward(dtype, gq.data(), gk.data(), gv.data(), gg.data(), gb.data(), gs0.data(), gout.data(),
                                gso.data(), q.data(), k.data(), v.data(), g.data(), be.data(),
                                with_s0 ? s0.data() : nullptr, p.cu.data(), (int64_t)p.cu.size() - 1, p.B, p.T, p.H,
                                p.dk, p.dv, path, chunk, lb, nullptr);
    if (rc) {
        printf("  backward failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    KdaGrad rg = ref_backward(p, r1, r2);
    if (want_fd) {   // the reference adjoint against central differences
        KdaProb pp = p;
        double worst = 0;
        auto fd = [&](vd &x, const vd &an, const char *nm) {
            double m = 0, e = 0;
            for (size_t i = 0; i < x.size(); i++) {
                double x0 = x[i], hh = 1e-6;
                x[i] = x0 + hh;
                double lp = kda_loss(pp, r1, r2);
                x[i] = x0 - hh;
                double lm = kda_loss(pp, r1, r2);
                x[i] = x0;
                double d = (lp - lm) / (2 * hh);
                m = std::max(m, std::fabs(d));
                e = std::max(e, std::fabs(d - an[i]));
            }
            printf("  (reference adjoint vs central differences: d%s err/max %.1e)\n", nm, e / m);
            worst = std::max(worst, e / m);
        };
        fd(pp.q, rg.q, "q");
        fd(pp.k, rg.k, "k");
        fd(pp.v, rg.v, "v");
        fd(pp.g, rg.g, "g");
        fd(pp.beta, rg.beta, "beta");
        if (!pp.s0.empty()) fd(pp.s0, rg.s0, "s0");
        if (worst > 1e-6) n_fail++;
    }
    check("dq", from_dev(gq), rg.q, tol_g);
    check("dk", from_dev(gk), rg.k, tol_g);
    check("dv", from_dev(gv), rg.v, tol_g);
    check("dg", from_dev(gg), rg.g, tol_g);
    check("dbeta", from_dev(gb), rg.beta, tol_g);
    if (with_s0) check("ds0", fvec(gs0), rg.s0, tol_g);
    if (getenv("NO_CPU")) return;
    // the cpu kernels (the parity test's reference) against the same fp64 reference, f32 on the same values
    auto fq = to_dev<float>(p.q), fk = to_dev<float>(p.k), fv = to_dev<float>(p.v), fg = to_dev<float>(p.g),
         fb = to_dev<float>(p.beta);
    std::vector<float> co(No), cso(Ns), cgq(Nk), cgk(Nk), cgg(Nk), cgv(No), cgb((size_t)p.B * p.T * p.H), cgs0(Ns);
    std::vector<float> fgo(r1.begin(), r1.end());
    rc = tide_cpu_backend.kda(TIDE_F32, co.data(), cso.data(), fq.data(), fk.data(), fv.data(), fg.data(), fb.data(),
                              with_s0 ? s0.data() : nullptr, p.cu.data(), (int64_t)p.cu.size() - 1, p.B, p.T, p.H, p.dk,
                              p.dv, path, chunk, lb, nullptr);
    if (!rc)
        rc = tide_cpu_backend.kda_backward(TIDE_F32, cgq.data(), cgk.data(), cgv.data(), cgg.data(), cgb.data(),
                                           cgs0.data(), fgo.data(), gso.data(), fq.data(), fk.data(), fv.data(),
                                           fg.data(), fb.data(), with_s0 ? s0.data() : nullptr, p.cu.data(),
                                           (int64_t)p.cu.size() - 1, p.B, p.T, p.H, p.dk, p.dv, path, chunk, lb, nullptr);
    if (rc) {
        printf("  cpu kernel failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    check("cpu o", fvec(co), ro, 1e-5);
    check("cpu state", fvec(cso), rso, 1e-5);
    check("cpu dq", fvec(cgq), rg.q, 1e-5);
    check("cpu dk", fvec(cgk), rg.k, 1e-5);
    check("cpu dv", fvec(cgv), rg.v, 1e-5);
    check("cpu dg", fvec(cgg), rg.g, 1e-5);
    check("cpu dbeta", fvec(cgb), rg.beta, 1e-5);
    if (with_s0) check("cpu ds0", fvec(cgs0), rg.s0, 1e-5);
}

// ---- gate ----------------------------------------------------------------------------------------------
template <class T> static void run_gate(const char *name, int form, double zscale, double alog_v, double tol)
{
    int N = 37, H = 3, D = 8;
    double lb = -5;
    vd z((size_t)N * H * D), A(H), b((size_t)H * D);
    for (auto &x : z) x = zscale * randn();
    for (int h = 0; h < H; h++) A[h] = alog_v + 0.3 * randn();
    for (auto &x : b) x = randn();
    if (sizeof(T) == 2)
        for (auto *x : {&z, &A, &b})
            for (auto &y : *x) y = bfr(y);
    auto fwd = [&](const vd &zz, const vd &AA, const vd &bb) {
        vd g(zz.size());
        for (int n = 0; n < N; n++)
            for (int h = 0; h < H; h++)
                for (int d = 0; d < D; d++) {
                    size_t i = ((size_t)n * H + h) * D + d;
                    double x = zz[i] + bb[h * D + d], ea = std::exp(AA[h]);
                    g[i] = form == 0 ? lb * sig(ea * x) : -ea * (std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x))));
                }
        return g;
    };
    printf("%s [%s]\n", name, sizeof(T) == 2 ? "bf16" : "f32");
    int dtype = sizeof(T) == 2 ? TIDE_BF16 : TIDE_F32;
    auto zd = to_dev<T>(z), Ad = to_dev<T>(A), bd = to_dev<T>(b);
    std::vector<T> g = to_dev<T>(vd(z.size(), NAN));
    if (tide_cuda_kda_gate(dtype, g.data(), zd.data(), Ad.data(), bd.data(), N, H, D, lb, form)) {
        printf("  failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    vd gr = fwd(z, A, b);
    check("g", from_dev(g), gr, tol);
    vd r(z.size());
    for (auto &x : r) x = randn();
    if (sizeof(T) == 2)
        for (auto &x : r) x = bfr(x);
    auto rd = to_dev<T>(r);
    std::vector<T> gz = to_dev<T>(vd(z.size(), NAN)), gA = to_dev<T>(vd(H, NAN)), gb = to_dev<T>(vd(b.size(), NAN));
    if (tide_cuda_kda_gate_backward(dtype, gz.data(), gA.data(), gb.data(), rd.data(), zd.data(), Ad.data(), bd.data(), N,
                                    H, D, lb, form)) {
        printf("  backward failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    // analytic reference in double (kda.md §6), checked by central differences at moderate inputs
    vd rz(z.size()), rA(H, 0.0), rb(b.size(), 0.0);
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++)
            for (int d = 0; d < D; d++) {
                size_t i = ((size_t)n * H + h) * D + d;
                double x = z[i] + b[h * D + d], ea = std::exp(A[h]), dz, dA;
                if (form == 0) {
                    double u = ea * x, s = sig(u);
                    dz = lb * s * (1 - s) * ea;
                    dA = lb * s * (1 - s) * u;
                } else {
                    dz = -ea * sig(x);
                    dA = -ea * (std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x))));
                }
                rz[i] = r[i] * dz;
                rb[h * D + d] += r[i] * dz;
                rA[h] += r[i] * dA;
            }
    if (zscale < 10) {
        double e = 0, m = 0;
        for (int h = 0; h < H; h++) {
            vd Ap = A, Am = A;
            Ap[h] += 1e-6;
            Am[h] -= 1e-6;
            vd gp = fwd(z, Ap, b), gm = fwd(z, Am, b);
            double d = 0;
            for (size_t i = 0; i < gp.size(); i++) d += r[i] * (gp[i] - gm[i]) / 2e-6;
            e = std::max(e, std::fabs(d - rA[h]));
            m = std::max(m, std::fabs(d));
        }
        printf("  (reference dA vs central differences: %.1e)\n", e / m);
    }
    check("gz", from_dev(gz), rz, tol);
    check("gA", from_dev(gA), rA, tol * 4);
    check("gb", from_dev(gb), rb, tol * 4);
    if (sizeof(T) == 4) {
        std::vector<float> cg(z.size()), cz(z.size()), cA(H, 7.f), cb(b.size(), 7.f);   // 7: overwrite, not add
        auto fz = to_dev<float>(z), fA = to_dev<float>(A), fbb = to_dev<float>(b), fr = to_dev<float>(r);
        tide_cpu_backend.kda_gate(TIDE_F32, cg.data(), fz.data(), fA.data(), fbb.data(), N, H, D, lb, form);
        tide_cpu_backend.kda_gate_backward(TIDE_F32, cz.data(), cA.data(), cb.data(), fr.data(), fz.data(), fA.data(),
                                           fbb.data(), N, H, D, lb, form);
        check("cpu g", fvec(cg), gr, tol);
        check("cpu gz", fvec(cz), rz, tol);
        check("cpu gA", fvec(cA), rA, tol * 4);
        check("cpu gb", fvec(cb), rb, tol * 4);
    }
}

// ---- causal conv ---------------------------------------------------------------------------------------
template <class T> static void run_conv(const char *name, bool with_cache, int silu, double tol)
{
    int B = 2, T_ = 11, C = 6, K = 4;
    std::vector<int64_t> cu = {0, 4, 11, 13, 19, 22};   // row 1 = [11, 22): segments 11..13, 13..19, 19..22
    vd x((size_t)B * T_ * C), w((size_t)C * K), cache((size_t)B * (K - 1) * C);
    for (auto *v : {&x, &w, &cache})
        for (auto &y : *v) y = randn();
    if (sizeof(T) == 2)
        for (auto *v : {&x, &w, &cache})
            for (auto &y : *v) y = bfr(y);
    auto fwd = [&](const vd &xx, const vd &ww, const vd &cc, bool pre) {
        vd o(xx.size());
        for (int64_t n = 0; n < B * T_; n++) {
            int64_t s = 0;
            while (s + 1 < (int64_t)cu.size() - 1 && cu[s + 1] <= n) s++;
            int64_t ss = cu[s], b = n / T_;
            for (int c = 0; c < C; c++) {
                double a = 0;
                for (int j = 0; j < K; j++) {
                    int64_t p = n - K + 1 + j;
                    double xv = 0;
                    if (p >= ss) xv = xx[p * C + c];
                    else if (with_cache && ss == b * T_) xv = cc[(b * (K - 1) + (K - 1) + (p - ss)) * C + c];
                    a += ww[c * K + j] * xv;
                }
                o[n * C + c] = (silu && !pre) ? a * sig(a) : a;
            }
        }
        return o;
    };
    printf("%s [%s, cache %d, silu %d]\n", name, sizeof(T) == 2 ? "bf16" : "f32", with_cache, silu);
    int dtype = sizeof(T) == 2 ? TIDE_BF16 : TIDE_F32;
    auto xd = to_dev<T>(x), wd = to_dev<T>(w), cd = to_dev<T>(cache);
    std::vector<T> o = to_dev<T>(vd(x.size(), NAN));
    if (tide_cuda_causal_conv1d(dtype, o.data(), xd.data(), wd.data(), with_cache ? cd.data() : nullptr, cu.data(),
                                (int64_t)cu.size() - 1, B, T_, C, K, silu)) {
        printf("  failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    check("out", from_dev(o), fwd(x, w, cache, false), tol);
    vd r(x.size());
    for (auto &y : r) y = randn();
    if (sizeof(T) == 2)
        for (auto &y : r) y = bfr(y);
    auto rd = to_dev<T>(r);
    std::vector<T> gx = to_dev<T>(vd(x.size(), NAN)), gw = to_dev<T>(vd(w.size(), NAN)),
                   gc = to_dev<T>(vd(cache.size(), NAN));
    if (tide_cuda_causal_conv1d_backward(dtype, gx.data(), gw.data(), with_cache ? gc.data() : nullptr, rd.data(),
                                         xd.data(), wd.data(), with_cache ? cd.data() : nullptr, cu.data(),
                                         (int64_t)cu.size() - 1, B, T_, C, K, silu)) {
        printf("  backward failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    auto loss = [&](const vd &xx, const vd &ww, const vd &cc) {
        vd o2 = fwd(xx, ww, cc, false);
        double l = 0;
        for (size_t i = 0; i < o2.size(); i++) l += o2[i] * r[i];
        return l;
    };
    auto fdg = [&](int which) {
        vd xx = x, ww = w, cc = cache, gr;
        vd &t = which == 0 ? xx : which == 1 ? ww : cc;
        gr.resize(t.size());
        for (size_t i = 0; i < t.size(); i++) {
            double t0 = t[i];
            t[i] = t0 + 1e-6;
            double lp = loss(xx, ww, cc);
            t[i] = t0 - 1e-6;
            double lm = loss(xx, ww, cc);
            t[i] = t0;
            gr[i] = (lp - lm) / 2e-6;
        }
        return gr;
    };
    check("gx (vs central differences)", from_dev(gx), fdg(0), tol + 1e-7);
    check("gw (vs central differences)", from_dev(gw), fdg(1), tol + 1e-7);
    if (with_cache) check("gcache (vs central differences)", from_dev(gc), fdg(2), tol + 1e-7);
    if (sizeof(T) == 4) {
        std::vector<float> co(x.size()), cgx(x.size()), cgw(w.size(), 7.f), cgc(cache.size(), 7.f);
        auto fx = to_dev<float>(x), fw = to_dev<float>(w), fc = to_dev<float>(cache), fr = to_dev<float>(r);
        tide_cpu_backend.causal_conv1d(TIDE_F32, co.data(), fx.data(), fw.data(), with_cache ? fc.data() : nullptr,
                                       cu.data(), (int64_t)cu.size() - 1, B, T_, C, K, silu);
        tide_cpu_backend.causal_conv1d_backward(TIDE_F32, cgx.data(), cgw.data(), with_cache ? cgc.data() : nullptr,
                                                fr.data(), fx.data(), fw.data(), with_cache ? fc.data() : nullptr,
                                                cu.data(), (int64_t)cu.size() - 1, B, T_, C, K, silu);
        check("cpu out", fvec(co), fwd(x, w, cache, false), tol);
        check("cpu gx", fvec(cgx), fdg(0), tol + 1e-7);
        check("cpu gw", fvec(cgw), fdg(1), tol + 1e-7);
        if (with_cache) check("cpu gcache", fvec(cgc), fdg(2), tol + 1e-7);
    }
}

// one decoding step of R rows over their own histories (conv_decode_rows): out against the fp64 taps, each row's
// history shifted by one token with its input appended (exact), and the cpu kernel on the same values
template <class T> static void run_conv_rows(const char *name, int K, double tol)
{
    int R = 5, C = 7;
    vd x((size_t)R * C), w((size_t)C * K), h((size_t)R * (K - 1) * C);
    for (auto *v : {&x, &w, &h})
        for (auto &y : *v) y = sizeof(T) == 2 ? bfr(randn()) : (double)(float)randn();   // exact on the device
    printf("%s [%s, K %d]\n", name, sizeof(T) == 2 ? "bf16" : "f32", K);
    vd ref(x.size()), href(h.size());
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            double a = 0;
            for (int j = 0; j < K - 1; j++) a += w[c * K + j] * h[((size_t)r * (K - 1) + j) * C + c];
            a += w[c * K + K - 1] * x[r * C + c];
            ref[r * C + c] = a * sig(a);
            for (int j = 0; j < K - 1; j++)
                href[((size_t)r * (K - 1) + j) * C + c] = j + 1 < K - 1 ? h[((size_t)r * (K - 1) + j + 1) * C + c] : x[r * C + c];
        }
    int dtype = sizeof(T) == 2 ? TIDE_BF16 : TIDE_F32;
    auto xd = to_dev<T>(x), wd = to_dev<T>(w), hd = to_dev<T>(h);
    std::vector<T> o = to_dev<T>(vd(x.size(), NAN));
    std::vector<void *> hp(R);
    for (int r = 0; r < R; r++) hp[r] = hd.data() + (size_t)r * (K - 1) * C;
    if (tide_cuda_conv_decode_rows(dtype, o.data(), xd.data(), wd.data(), hp.data(), R, C, K, 1)) {
        printf("  failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    check("out", from_dev(o), ref, tol);
    check("histories", from_dev(hd), href, 0);
    if (sizeof(T) == 4) {
        std::vector<float> co(x.size());
        auto fx = to_dev<float>(x), fw = to_dev<float>(w), fh = to_dev<float>(h);
        for (int r = 0; r < R; r++) hp[r] = fh.data() + (size_t)r * (K - 1) * C;
        tide_cpu_backend.conv_decode_rows(TIDE_F32, co.data(), fx.data(), fw.data(), hp.data(), R, C, K, 1);
        check("cpu out", fvec(co), ref, tol);
        check("cpu histories", fvec(fh), href, 0);
    }
}

#include "mla_cases.h"
#include "mla_latent_cases.h"
#include "attention_cases.h"

// a KDA problem on the (emulated) device for the checkpoint, split and pre-pass checks: its inputs in T, sizes, the
// engine's checkpoint count (engine/ops/kda.c; none on the recurrent path) and random cotangents of o and the state
template <class T> struct KdaDev {
    int dtype;
    std::vector<T> q, k, v, g, be, gout;
    std::vector<float> s0, gso;
    size_t No, Ns, Nk;
    int64_t nseg, n_ck = 0;
    KdaDev(const char *name, const KdaProb &p, int path, int chunk, int nv = 0)
    {
        dtype = sizeof(T) == 2 ? TIDE_BF16 : TIDE_F32;
        printf("%s  [B %d T %d H %d dk %d dv %d, %zu segs, path %d chunk %d, %s", name, p.B, p.T, p.H, p.dk, p.dv,
               p.cu.size() - 1, path, chunk, sizeof(T) == 2 ? "bf16" : "f32");
        if (nv) printf(", %d column splits", nv);
        printf("]\n");
        q = to_dev<T>(p.q), k = to_dev<T>(p.k), v = to_dev<T>(p.v), g = to_dev<T>(p.g), be = to_dev<T>(p.beta);
        s0.assign(p.s0.begin(), p.s0.end());
        No = (size_t)p.B * p.T * p.H * p.dv, Ns = (size_t)p.B * p.H * p.dk * p.dv, Nk = (size_t)p.B * p.T * p.H * p.dk;
        nseg = (int64_t)p.cu.size() - 1;
        for (int64_t i = 0; i < nseg && path != TIDE_KDA_RECURRENT; i++)
            n_ck += ((p.cu[i + 1] - p.cu[i] + chunk - 1) / chunk + TIDE_KDA_CUDA_CKPT_CHUNKS - 1) / TIDE_KDA_CUDA_CKPT_CHUNKS;
        vd r1(No), r2(Ns);
        for (auto &x : r1) x = randn();
        for (auto &x : r2) x = randn();
        gout = to_dev<T>(r1);
        gso.assign(r2.begin(), r2.end());
    }
    struct Grads {
        std::vector<T> gq, gk, gv, gg, gb;
        std::vector<float> gs0;
    };
    // the backward into r (poisoned with NaN first), from the forward's checkpoints ckpt or its own (NULL)
    int backward(const KdaProb &p, Grads &r, int path, int chunk, const float *ckpt)
    {
        r.gq.assign(Nk, T(NAN));
        r.gk = r.gq;
        r.gg = r.gq;
        r.gv.assign(No, T(NAN));
        r.gb.assign((size_t)p.B * p.T * p.H, T(NAN));
        r.gs0.assign(Ns, NAN);
        return tide_cuda_kda_backward(dtype, r.gq.data(), r.gk.data(), r.gv.data(), r.gg.data(), r.gb.data(),
                                      r.gs0.data(), gout.data(), gso.data(), q.data(), k.data(), v.data(), g.data(),
                                      be.data(), s0.empty() ? nullptr : s0.data(), p.cu.data(), nseg, p.B, p.T, p.H,
                                      p.dk, p.dv, path, chunk, -5, ckpt);
    }
};

// ---- KDA checkpointed backward (issue: memory at long T) --------------------------------------------------
// The backward recomputes each block's chunk start states from a checkpoint. Every way of placing the
// checkpoints and grouping the segments must give the bits of the backward that keeps every chunk's start
// state (one block per segment: kda_bwd_ckpt_chunks above any segment's chunk count), and the device bytes it
// holds at its peak must be the ones kda_backward_bytes (the memory table's formula) gives.
template <class T>
static void run_kda_ckpt(const char *name, const KdaProb &p, int path, int chunk, unsigned which = 15)
{
    KdaDev<T> d(name, p, path, chunk);
    auto &q = d.q, &k = d.k, &v = d.v, &g = d.g, &be = d.be, &gout = d.gout;
    auto &gso = d.gso;
    const int dtype = d.dtype;
    const size_t No = d.No, Ns = d.Ns, Nk = d.Nk;
    const int64_t nseg = d.nseg, n_ck = d.n_ck;
    const float *s0p = d.s0.empty() ? nullptr : d.s0.data();
    std::vector<float> ck((size_t)n_ck * p.H * p.dk * p.dv, NAN), so(Ns);
    std::vector<T> o(No);
    if (tide_cuda_kda(dtype, o.data(), so.data(), q.data(), k.data(), v.data(), g.data(), be.data(), s0p, p.cu.data(),
                      nseg, p.B, p.T, p.H, p.dk, p.dv, path, chunk, -5, path == TIDE_KDA_RECURRENT ? nullptr : ck.data())) {
        printf("  forward failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    struct Out : KdaDev<T>::Grads {
        size_t peak, want;
        int blocks;
    };
    auto run = [&](int64_t every, int64_t budget, const float *ckpt, Out &r) {
        kda_bwd_ckpt_chunks = every;
        kda_bwd_budget = budget;
        kda_bwd_plan pl;
        int rc = kda_backward_plan("plan", p.cu.data(), nseg, p.B, p.T, p.H, p.dv, path, chunk, ckpt == nullptr, pl);
        size_t ckb = 0;
        r.want = rc ? 0 : kda_backward_bytes(pl, p.H, p.dk, p.dv, &ckb);
        r.blocks = rc ? 0 : (int)pl.maxblk;
        free(pl.seg);
        emu::peak_bytes = emu::live_bytes;
        size_t base = emu::live_bytes;
        if (!rc) rc = d.backward(p, r, path, chunk, ckpt);
        r.peak = emu::peak_bytes - base;
        kda_bwd_ckpt_chunks = TIDE_KDA_CUDA_CKPT_CHUNKS;
        kda_bwd_budget = 0;
        if (rc) printf("  backward failed: %s\n", err_buf);
        return rc;
    };
    auto same = [](const auto &a, const auto &b) { return a.size() == b.size() && !memcmp(a.data(), b.data(), a.size() * sizeof a[0]); };
    Out full;
    if (run((int64_t)1 << 40, (int64_t)1 << 40, nullptr, full)) {
        n_fail++;
        return;
    }
    struct Var {
        const char *what;
        int64_t every, budget;
        bool fwd;
    } vars[] = {{"checkpoint every chunk, a group per segment", 1, 1, false},
                {"every 2nd chunk, default groups", 2, 0, false},
                {"every 3rd chunk, groups of 4 slots", 3, 4, false},
                {"the forward's checkpoints", 0, 0, true}};
    for (int vi = 0; vi < 4; vi++) {
        const Var &vr = vars[vi];
        if ((vr.fwd && path == TIDE_KDA_RECURRENT) || !(which >> vi & 1)) continue;
        Out r;
        if (run(vr.every ? vr.every : TIDE_KDA_CUDA_CKPT_CHUNKS, vr.budget, vr.fwd ? ck.data() : nullptr, r)) {
            n_fail++;
            continue;
        }
        bool bits = same(r.gq, full.gq) && same(r.gk, full.gk) && same(r.gv, full.gv) && same(r.gg, full.gg) &&
                    same(r.gb, full.gb) && same(r.gs0, full.gs0);
        bool mem = r.peak == r.want;
        printf("  %-46s %s  %d blocks, peak %zu bytes (formula %zu; every state: %zu)\n", vr.what,
               bits && mem ? "ok  " : "FAIL", r.blocks, r.peak, r.want, full.peak);
        if (!bits) printf("    gradients differ from the backward over every chunk start state\n");
        if (bits && mem) n_pass++;
        else n_fail++;
    }
}

// ---- KDA column split (issue: too few blocks for the device) ------------------------------------------------
// A (segment, head) block split over dv / nv columns must leave the forward's bits (output, final state,
// checkpoints) unchanged, and its backward's dv and ds0 (per-column work); dq, dk, dg, dβ add the splits'
// partial sums, so they match the unsplit backward to rounding, and two runs match bit for bit.
template <class T>
static void run_kda_split(const char *name, const KdaProb &p, int path, int chunk, int nv, double tol)
{
    KdaDev<T> d(name, p, path, chunk, nv);
    auto &q = d.q, &k = d.k, &v = d.v, &g = d.g, &be = d.be;
    auto &s0 = d.s0;
    const int dtype = d.dtype;
    const size_t No = d.No, Ns = d.Ns;
    const int64_t nseg = d.nseg, n_ck = d.n_ck;
    struct Out : KdaDev<T>::Grads {
        std::vector<T> o;
        std::vector<float> so, ck;
    };
    auto run = [&](int split, Out &r) {
        kda_vsplit_force = split;
        r.o.assign(No, T(NAN));
        r.so.assign(Ns, NAN);
        r.ck.assign((size_t)n_ck * p.H * p.dk * p.dv, NAN);
        float *ck = path == TIDE_KDA_RECURRENT ? nullptr : r.ck.data();
        int rc = tide_cuda_kda(dtype, r.o.data(), r.so.data(), q.data(), k.data(), v.data(), g.data(), be.data(),
                               s0.data(), p.cu.data(), nseg, p.B, p.T, p.H, p.dk, p.dv, path, chunk, -5, ck);
        if (!rc) rc = d.backward(p, r, path, chunk, ck);
        kda_vsplit_force = 0;
        if (rc) printf("  failed: %s\n", err_buf);
        return rc;
    };
    auto same = [](const auto &a, const auto &b) { return a.size() == b.size() && !memcmp(a.data(), b.data(), a.size() * sizeof a[0]); };
    Out one, a, b;
    if (run(1, one) || run(nv, a) || run(nv, b)) {
        n_fail++;
        return;
    }
    auto verdict = [&](const char *what, bool ok) {
        printf("  %-46s %s\n", what, ok ? "ok" : "FAIL");
        if (ok) n_pass++;
        else n_fail++;
    };
    verdict("forward: output, state, checkpoints bitwise", same(one.o, a.o) && same(one.so, a.so) && same(one.ck, a.ck));
    verdict("backward: dv and ds0 bitwise", same(one.gv, a.gv) && same(one.gs0, a.gs0));
    verdict("backward: two split runs bitwise", same(a.gq, b.gq) && same(a.gk, b.gk) && same(a.gg, b.gg) &&
                                                    same(a.gb, b.gb) && same(a.gv, b.gv) && same(a.gs0, b.gs0));
    check("dq against the unsplit backward", from_dev(a.gq), from_dev(one.gq), tol);
    check("dk against the unsplit backward", from_dev(a.gk), from_dev(one.gk), tol);
    check("dg against the unsplit backward", from_dev(a.gg), from_dev(one.gg), tol);
    check("dbeta against the unsplit backward", from_dev(a.gb), from_dev(one.gb), tol);
}

// the backward's pre-pass (kda_intra_kernel: each chunk's Af, P, M in parallel, read by the sequential kernel) must
// give the bits of the backward that forms them in the sequential kernel
template <class T>
static void run_kda_intra(const char *name, const KdaProb &p, int path, int chunk, int nv, bool backward = true)
{
    KdaDev<T> d(name, p, path, chunk, nv);
    auto &q = d.q, &k = d.k, &v = d.v, &g = d.g, &be = d.be;
    auto &s0 = d.s0;
    const int dtype = d.dtype;
    const size_t No = d.No, Ns = d.Ns;
    const int64_t nseg = d.nseg;
    struct Out : KdaDev<T>::Grads {
        size_t peak, want;
    };
    auto run = [&](int off, Out &r) {
        if (off) setenv("TIDE_KDA_PREPASS", "0", 1);
        kda_vsplit_force = nv;
        kda_bwd_ckpt_chunks = 2;   // blocks of 2 chunks: the pre-pass runs per block, segments in groups
        kda_bwd_plan pl;
        int rc = kda_backward_plan("plan", p.cu.data(), nseg, p.B, p.T, p.H, p.dv, path, chunk, 1, pl);
        size_t ckb = 0;
        r.want = rc ? 0 : kda_backward_bytes(pl, p.H, p.dk, p.dv, &ckb);
        free(pl.seg);
        emu::peak_bytes = emu::live_bytes;
        size_t base = emu::live_bytes;
        if (!rc) rc = d.backward(p, r, path, chunk, nullptr);
        r.peak = emu::peak_bytes - base;
        unsetenv("TIDE_KDA_PREPASS");
        kda_vsplit_force = 0;
        kda_bwd_ckpt_chunks = TIDE_KDA_CUDA_CKPT_CHUNKS;
        if (rc) printf("  failed: %s\n", err_buf);
        return rc;
    };
    auto same = [](const auto &a, const auto &b) { return a.size() == b.size() && !memcmp(a.data(), b.data(), a.size() * sizeof a[0]); };
    // the training forward (checkpoints kept): in rounds behind the pre-pass, or in one launch
    if (path != TIDE_KDA_RECURRENT) {
        const int64_t n_ck = d.n_ck;
        std::vector<T> o1(No, T(NAN)), o2(No, T(NAN));
        std::vector<float> so1(Ns, NAN), so2(Ns, NAN), ck1((size_t)n_ck * p.H * p.dk * p.dv, NAN), ck2 = ck1;
        int rc = 0;
        for (int off = 0; off < 2 && !rc; off++) {
            if (off) setenv("TIDE_KDA_PREPASS", "0", 1);
            kda_vsplit_force = nv;
            rc = tide_cuda_kda(dtype, off ? o2.data() : o1.data(), off ? so2.data() : so1.data(), q.data(), k.data(),
                               v.data(), g.data(), be.data(), s0.data(), p.cu.data(), nseg, p.B, p.T, p.H, p.dk, p.dv,
                               path, chunk, -5, off ? ck2.data() : ck1.data());
            unsetenv("TIDE_KDA_PREPASS");
            kda_vsplit_force = 0;
        }
        bool ok = !rc && same(o1, o2) && same(so1, so2) && same(ck1, ck2);
        printf("  %-46s %s%s\n", "pre-pass forward: the same bits", ok ? "ok" : "FAIL", rc ? err_buf : "");
        if (ok) n_pass++;
        else n_fail++;
        // no checkpoints kept (no backward follows): the rounds pass their start states through one scratch slot per
        // segment; with the pre-pass and without (one launch): the same output and final states
        std::vector<T> o3(No, T(NAN)), o4(No, T(NAN));
        std::vector<float> so3(Ns, NAN), so4(Ns, NAN);
        for (int off = 0; off < 2 && !rc; off++) {
            if (off) setenv("TIDE_KDA_PREPASS", "0", 1);
            kda_vsplit_force = nv;
            rc = tide_cuda_kda(dtype, off ? o4.data() : o3.data(), off ? so4.data() : so3.data(), q.data(), k.data(),
                               v.data(), g.data(), be.data(), s0.data(), p.cu.data(), nseg, p.B, p.T, p.H, p.dk, p.dv,
                               path, chunk, -5, nullptr);
            unsetenv("TIDE_KDA_PREPASS");
            kda_vsplit_force = 0;
        }
        ok = !rc && same(o1, o3) && same(so1, so3) && same(o1, o4) && same(so1, so4);
        printf("  %-46s %s%s\n", "no checkpoints (rolling rounds): the same bits", ok ? "ok" : "FAIL", rc ? err_buf : "");
        if (ok) n_pass++;
        else n_fail++;
    }
    if (!backward) return;
    Out with, without;
    if (run(0, with) || run(1, without)) {
        n_fail++;
        return;
    }
    bool bits = same(with.gq, without.gq) && same(with.gk, without.gk) && same(with.gv, without.gv) &&
                same(with.gg, without.gg) && same(with.gb, without.gb) && same(with.gs0, without.gs0);
    bool mem = with.peak == with.want && without.peak == without.want && with.want > without.want;
    printf("  %-46s %s  peak %zu bytes (formula %zu; without the pre-pass %zu)\n", "pre-pass: the same bits",
           bits && mem ? "ok  " : "FAIL", with.peak, with.want, without.peak);
    if (bits && mem) n_pass++;
    else n_fail++;
}

// the split the host code chooses (launch.h tide_kda_vsplit): the device filled, >= 64 columns a block
static void kda_split_choice()
{
    struct {
        int64_t blocks, dv;
        int sms, want;
    } c[] = {{96, 128, 132, 2},  {96, 128, 108, 2}, {192, 128, 132, 1}, {4, 64, 132, 1},  {4, 128, 132, 2},
             {1, 256, 132, 4},   {48, 256, 132, 4}, {66, 256, 132, 2},  {96, 96, 132, 1},  {2, 16, 2, 1}};
    bool ok = true;
    for (auto &x : c) {
        int got = tide_kda_vsplit(x.blocks, x.dv, x.sms, 0);
        if (got != x.want) {
            printf("  tide_kda_vsplit(%lld blocks, dv %lld, %d SMs) = %d, expected %d\n", (long long)x.blocks,
                   (long long)x.dv, x.sms, got, x.want);
            ok = false;
        }
    }
    // TIDE_KDA_VSPLIT: a split that does not divide dv (or breaks its 16-column tiles) is refused by name
    KdaProb p = make_prob(1, 5, 1, 4, 16, {}, -5, false, false);
    auto q = to_dev<float>(p.q), k = to_dev<float>(p.k), v = to_dev<float>(p.v), g = to_dev<float>(p.g),
         be = to_dev<float>(p.beta);
    std::vector<float> o(p.v.size()), so((size_t)p.dk * p.dv);
    for (const char *bad : {"3", "2", "0", "x"}) {
        setenv("TIDE_KDA_VSPLIT", bad, 1);
        int rc = tide_cuda_kda(TIDE_F32, o.data(), so.data(), q.data(), k.data(), v.data(), g.data(), be.data(), nullptr,
                               p.cu.data(), 1, 1, p.T, 1, p.dk, p.dv, TIDE_KDA_CHUNK, 16, -5, nullptr);
        if (!rc || !strstr(err_buf, "TIDE_KDA_VSPLIT=")) {
            printf("  TIDE_KDA_VSPLIT=%s: %s\n", bad, rc ? err_buf : "accepted");
            ok = false;
        }
    }
    setenv("TIDE_KDA_VSPLIT", "1", 1);
    if (tide_cuda_kda(TIDE_F32, o.data(), so.data(), q.data(), k.data(), v.data(), g.data(), be.data(), nullptr,
                      p.cu.data(), 1, 1, p.T, 1, p.dk, p.dv, TIDE_KDA_CHUNK, 16, -5, nullptr)) {
        printf("  TIDE_KDA_VSPLIT=1 refused: %s\n", err_buf);
        ok = false;
    }
    unsetenv("TIDE_KDA_VSPLIT");
    // TIDE_KDA_PREPASS: 0 or 1, anything else refused by name (the training forward reads it)
    std::vector<float> ck((size_t)p.dk * p.dv);
    setenv("TIDE_KDA_PREPASS", "2", 1);
    if (!tide_cuda_kda(TIDE_F32, o.data(), so.data(), q.data(), k.data(), v.data(), g.data(), be.data(), nullptr,
                       p.cu.data(), 1, 1, p.T, 1, p.dk, p.dv, TIDE_KDA_CHUNK, 16, -5, ck.data()) ||
        !strstr(err_buf, "TIDE_KDA_PREPASS=2")) {
        printf("  TIDE_KDA_PREPASS=2: %s\n", err_buf);
        ok = false;
    }
    unsetenv("TIDE_KDA_PREPASS");
    printf("kda column split choice  %s\n", ok ? "ok" : "FAIL");
    if (ok) n_pass++;
    else n_fail++;
}

// the memory table (bench/results/kda_cuda_memory.md): one K3 KDA layer's backward at T = 8K .. 1M, B = 1,
// from kda_backward_plan / kda_backward_bytes, beside the earlier every-state buffer (chunks x H x dk x dv floats)
static void kda_memory_table()
{
    const int64_t H = 96, dk = 128, dv = 128, chunk = 16;
    const int sms = emu_sm_count;
    emu_sm_count = 132;   // an H100's SMs: the column split the backward would choose there (96 blocks: 2 splits)
    printf("| T | chunks | before: every start state | after: checkpoints (forward) | after: backward scratch | "
           "of it the column splits' partial sums | of it the pre-pass's chunk matrices | after: total | before/after |\n"
           "|---|---|---|---|---|---|---|---|---|\n");
    std::string json = "[";
    for (int64_t T : {8192LL, 65536LL, 262144LL, 1048576LL}) {
        int64_t cu[2] = {0, T};
        kda_bwd_plan pl;
        if (kda_backward_plan("table", cu, 1, 1, T, H, dv, TIDE_KDA_CHUNK, chunk, 0, pl)) {
            printf("plan failed: %s\n", err_buf);
            n_fail++;
            return;
        }
        size_t ckb = 0, bw = kda_backward_bytes(pl, H, dk, dv, &ckb), pb = kda_partial_bytes(pl, H, dk),
               ib = kda_intra_bytes(pl, H);
        int nv = pl.nv;
        free(pl.seg);
        int64_t nch = (T + KDA_CT - 1) / KDA_CT;
        double before = (double)nch * H * dk * dv * 4, after = (double)(ckb + bw);
        auto fmt = [](double b, char *o) {
            const char *u[] = {"B", "KiB", "MiB", "GiB"};
            int i = 0;
            while (b >= 1024 && i < 3) b /= 1024, i++;
            snprintf(o, 32, "%.4g %s", b, u[i]);
        };
        char a[32], b[32], c[32], d[32], e[32], f[32];
        fmt(before, a), fmt((double)ckb, b), fmt((double)bw, c), fmt(after, d), fmt((double)pb, e), fmt((double)ib, f);
        printf("| %lld | %lld | %s (%.0f KiB/token) | %s | %s | %s (%d splits) | %s | %s (%.2f KiB/token) | %.0fx |\n",
               (long long)T, (long long)nch, a, before / T / 1024, b, c, e, nv, f, d, after / T / 1024, before / after);
        json += std::string(json.size() > 1 ? "," : "") + "{\"T\": " + std::to_string(T) + ", \"chunks\": " +
                std::to_string(nch) + ", \"before_bytes\": " + std::to_string((long long)before) +
                ", \"ckpt_bytes\": " + std::to_string(ckb) + ", \"backward_scratch_bytes\": " + std::to_string(bw) +
                ", \"column_splits\": " + std::to_string(nv) + ", \"split_partial_bytes\": " + std::to_string(pb) + ", \"prepass_bytes\": " + std::to_string(ib) +
                ", \"after_bytes\": " + std::to_string((long long)after) + "}";
    }
    printf("json %s]\n", json.c_str());
    emu_sm_count = sms;
}

int main(int argc, char **argv)
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    std::string only;
    for (int i = 1; i < argc; i++) only += std::string(argv[i]) + " ";
    bool all = only.empty();
    auto want = [&](const char *s) { return all || only.find(std::string(s) + " ") != std::string::npos; };
    if (want("gate")) {
        run_gate<float>("gate bounded", 0, 1.0, 0.0, 1e-6);
        run_gate<float>("gate softplus", 1, 1.0, 0.0, 1e-6);
        run_gate<float>("gate bounded extreme", 0, 1e4, 5.0, 1e-6);
        run_gate<float>("gate softplus extreme", 1, 1e4, -5.0, 1e-6);
        run_gate<__nv_bfloat16>("gate bounded", 0, 1.0, 0.0, 1e-2);
    }
    if (want("conv")) {
        run_conv<float>("conv", true, 1, 1e-6);
        run_conv<float>("conv", false, 0, 1e-6);
        run_conv<float>("conv", true, 0, 1e-6);
        run_conv<__nv_bfloat16>("conv", true, 1, 1e-2);
        run_conv_rows<float>("conv_decode_rows", 4, 1e-6);
        run_conv_rows<float>("conv_decode_rows", 1, 1e-6);
        run_conv_rows<__nv_bfloat16>("conv_decode_rows", 4, 1e-2);
    }
    if (want("kdasmall")) {
        // tiny: the reference adjoint is checked by central differences too
        KdaProb p = make_prob(2, 9, 2, 5, 4, {3, 14}, -5, false, false);
        run_kda_case<float>("kda small chunk f32", p, TIDE_KDA_CHUNK, 16, -5, 1e-5, 1e-5, true, true);
        p = make_prob(2, 9, 2, 5, 4, {3, 14}, -5, true, false);
        run_kda_case<float>("kda small safe f32", p, TIDE_KDA_CHUNK_SAFE, 4, -INFINITY, 1e-5, 1e-5);
        run_kda_case<float>("kda small recurrent f32", p, TIDE_KDA_RECURRENT, 0, -INFINITY, 1e-5, 1e-5);
    }
    if (want("kda16")) {
        KdaProb p = make_prob(2, 37, 2, 16, 16, {5, 40, 60}, -5, false, false);
        run_kda_case<float>("kda chunk f32", p, TIDE_KDA_CHUNK, 16, -5, 1e-5, 1e-5);
        run_kda_case<float>("kda chunk f32 chunk 7", p, TIDE_KDA_CHUNK, 7, -5, 1e-5, 1e-5);
        run_kda_case<float>("kda safe f32 chunk 64, no s0", p, TIDE_KDA_CHUNK_SAFE, 64, -5, 1e-5, 1e-5, false);
        run_kda_case<float>("kda safe f32", p, TIDE_KDA_CHUNK_SAFE, 16, -5, 1e-5, 1e-5);
        run_kda_case<float>("kda recurrent f32", p, TIDE_KDA_RECURRENT, 0, -5, 1e-5, 1e-5);
        KdaProb pb = make_prob(2, 37, 2, 16, 32, {5, 40, 60}, -5, false, true);
        run_kda_case<__nv_bfloat16>("kda chunk bf16 (wmma)", pb, TIDE_KDA_CHUNK, 16, -5, 1.0 / 128, 1.0 / 64);
        run_kda_case<__nv_bfloat16>("kda recurrent bf16", pb, TIDE_KDA_RECURRENT, 0, -5, 1.0 / 128, 1.0 / 64);
        KdaProb ps = make_prob(1, 40, 2, 16, 16, {17}, -5, true, false);
        run_kda_case<float>("kda safe f32 softplus gate", ps, TIDE_KDA_CHUNK_SAFE, 16, -INFINITY, 1e-5, 1e-5);
        run_kda_case<float>("kda recurrent f32 softplus gate", ps, TIDE_KDA_RECURRENT, 0, -INFINITY, 1e-5, 1e-5);
    }
    if (want("kda64")) {
        KdaProb p = make_prob(1, 45, 2, 64, 64, {20}, -5, false, true);
        run_kda_case<__nv_bfloat16>("kda chunk bf16 64 (wmma)", p, TIDE_KDA_CHUNK, 16, -5, 1.0 / 128, 1.0 / 64);
        KdaProb pf = make_prob(1, 21, 1, 64, 48, {}, -5, false, false);
        run_kda_case<float>("kda chunk f32 64x48", pf, TIDE_KDA_CHUNK, 16, -5, 1e-5, 1e-5);
    }
    if (want("kda128")) {
        KdaProb p = make_prob(1, 20, 1, 128, 128, {}, -5, false, true);
        run_kda_case<__nv_bfloat16>("kda chunk bf16 128 (wmma)", p, TIDE_KDA_CHUNK, 16, -5, 1.0 / 128, 1.0 / 64);
        KdaProb pd = make_prob(2, 1, 2, 128, 128, {}, -5, false, false);
        run_kda_case<float>("kda recurrent T=1 decode", pd, TIDE_KDA_RECURRENT, 0, -5, 1e-5, 1e-5);
    }
    if (want("bound")) {
        KdaProb p = make_prob(1, 20, 1, 16, 16, {}, -5, false, false);
        p.g[(size_t)7 * 16 + 3] = -5.5;
        auto q = to_dev<float>(p.q), k = to_dev<float>(p.k), v = to_dev<float>(p.v), g = to_dev<float>(p.g),
             be = to_dev<float>(p.beta);
        std::vector<float> o(20 * 16), so(256);
        int rc = tide_cuda_kda(TIDE_F32, o.data(), so.data(), q.data(), k.data(), v.data(), g.data(), be.data(), nullptr,
                               p.cu.data(), 1, 1, 20, 1, 16, 16, TIDE_KDA_CHUNK, 16, -5, nullptr);
        // the check is deferred (common.cuh): the call returns, the next synchronisation reports
        int rep = tide_cuda_deferred_report();
        printf("bound check: rc %d, reported %d: %s\n", rc, rep, err_buf);
        if (!rc && rep && strstr(err_buf, "-5.5") && strstr(err_buf, "t 7,") && strstr(err_buf, "channel 3")) n_pass++;
        else n_fail++;
        p.g[(size_t)7 * 16 + 3] = -1;
        p.g[(size_t)9 * 16 + 1] = 0.25;
        p.g[(size_t)12 * 16 + 1] = -7;
        g = to_dev<float>(p.g);
        rc = tide_cuda_kda_backward(TIDE_F32, o.data(), o.data(), o.data(), o.data(), o.data(), so.data(), o.data(),
                                    nullptr, q.data(), k.data(), v.data(), g.data(), be.data(), nullptr, p.cu.data(), 1,
                                    1, 20, 1, 16, 16, TIDE_KDA_CHUNK, 16, -5, nullptr);
        rep = tide_cuda_deferred_report();
        printf("bound check (backward, g > 0 first): rc %d, reported %d: %s\n", rc, rep, err_buf);
        if (!rc && rep && strstr(err_buf, "0.25") && strstr(err_buf, "t 9,")) n_pass++;
        else n_fail++;
        rc = tide_cuda_kda(TIDE_F32, o.data(), so.data(), q.data(), k.data(), v.data(), g.data(), be.data(), nullptr,
                           p.cu.data(), 1, 1, 20, 1, 16, 16, TIDE_KDA_CHUNK, 16, -INFINITY, nullptr);
        rep = tide_cuda_deferred_report();
        printf("lb = -inf skips the check: rc %d, reported %d\n", rc, rep);
        if (!rc && !rep) n_pass++;
        else n_fail++;
    }
    if (want("kdackpt")) {
        // segments of 1 to 7 chunks, one row ending mid-chunk, s0 and final-state gradients
        KdaProb p = make_prob(2, 80, 2, 16, 16, {9, 57, 60, 100, 150}, -5, false, false);
        run_kda_ckpt<float>("kda checkpointed backward f32", p, TIDE_KDA_CHUNK, 16);
        run_kda_ckpt<float>("kda checkpointed backward f32 safe", p, TIDE_KDA_CHUNK_SAFE, 16, 4);
        run_kda_ckpt<float>("kda checkpointed backward f32 recurrent", p, TIDE_KDA_RECURRENT, 0, 4);
        KdaProb pb = make_prob(1, 100, 2, 16, 32, {33}, -5, false, true);
        run_kda_ckpt<__nv_bfloat16>("kda checkpointed backward bf16 (wmma)", pb, TIDE_KDA_CHUNK, 16);
        // long enough that the forward's own checkpoints (every 64 chunks of 2 tokens) come several per segment
        KdaProb pl = make_prob(1, 140, 1, 8, 8, {}, -5, false, false);
        run_kda_ckpt<float>("kda checkpointed backward, forward's checkpoints", pl, TIDE_KDA_CHUNK, 2, 8);
    }
    if (want("kdasplit")) {
        kda_split_choice();
        // segments of 1 to 2 chunks, a row ending mid-chunk; 2 and 4 splits of 16 columns
        KdaProb p = make_prob(2, 40, 1, 8, 16, {9, 50, 60}, -5, false, false);
        run_kda_split<float>("kda split f32", p, TIDE_KDA_CHUNK, 16, 2, 1e-6);
        run_kda_split<float>("kda split f32 safe", p, TIDE_KDA_CHUNK_SAFE, 16, 4, 1e-6);
        run_kda_split<float>("kda split f32 recurrent", p, TIDE_KDA_RECURRENT, 0, 2, 1e-6);
        KdaProb pb = make_prob(1, 40, 1, 16, 32, {23}, -5, false, true);
        run_kda_split<__nv_bfloat16>("kda split bf16 (wmma)", pb, TIDE_KDA_CHUNK, 16, 2, 1.0 / 128);
        // against the fp64 reference and the cpu, split (kda128's bf16 case splits by the device's choice)
        kda_vsplit_force = 4;
        KdaProb pr = make_prob(2, 37, 1, 8, 16, {5, 40, 60}, -5, false, false);
        run_kda_case<float>("kda chunk f32, 4 column splits", pr, TIDE_KDA_CHUNK, 7, -5, 1e-5, 1e-5);
        // the backward's pre-pass: its bits are the sequential kernel's, on every path, split or not
        run_kda_intra<float>("kda backward pre-pass f32", p, TIDE_KDA_CHUNK, 16, 1);
        run_kda_intra<float>("kda backward pre-pass f32 safe, 2 splits", p, TIDE_KDA_CHUNK_SAFE, 16, 2);
        run_kda_intra<float>("kda backward pre-pass f32 recurrent", p, TIDE_KDA_RECURRENT, 0, 1);
        run_kda_intra<__nv_bfloat16>("kda backward pre-pass bf16", pb, TIDE_KDA_CHUNK, 16, 1);
        // two rounds of the forward (chunk 2: 70 chunks of a 140-token row, blocks of 64), a short second row
        KdaProb pl2 = make_prob(2, 140, 1, 8, 8, {150}, -5, false, false);
        run_kda_intra<float>("kda pre-pass, forward rounds f32", pl2, TIDE_KDA_CHUNK, 2, 1, false);
        // four rounds (chunk 2: 200 chunks of a 400-token row), 2 column splits
        KdaProb pl4 = make_prob(1, 400, 1, 8, 16, {}, -5, false, false);
        run_kda_intra<float>("kda pre-pass, 4 forward rounds f32, 2 splits", pl4, TIDE_KDA_CHUNK, 2, 2, false);
        // the checkpointed backward's bits and its peak bytes (the partial buffer counted) with a split
        kda_vsplit_force = 2;
        run_kda_ckpt<float>("kda checkpointed backward f32, 2 column splits", p, TIDE_KDA_CHUNK, 16);
        kda_vsplit_force = 0;
    }
    if (want("kdamem")) kda_memory_table();
    run_mla(want);
    run_mla_latent(want);
    run_attention(want);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
// layout sizes, for the report
struct LayoutPrint {
    LayoutPrint()
    {
        if (!getenv("KDA_LAYOUT")) return;
        int dims[][2] = {{64, 64}, {128, 128}, {128, 64}, {256, 128}};
        for (auto &d : dims) {
            printf("dk %d dv %d: fwd fact %zu, fwd wmma %zu, fwd safe %zu, bwd fact %zu, bwd safe %zu, rec %zu bytes\n", d[0], d[1],
                   (size_t)kda_layout(d[0], d[1], 0, 0, 0).total * 4, (size_t)kda_layout(d[0], d[1], 0, 1, 0).total * 4,
                   (size_t)kda_layout(d[0], d[1], 1, 0, 0).total * 4, (size_t)kda_layout(d[0], d[1], 0, 0, 1).total * 4,
                   (size_t)kda_layout(d[0], d[1], 1, 0, 1).total * 4, kda_recurrent_smem(d[0], d[1]));
        }
    }
} layout_print;

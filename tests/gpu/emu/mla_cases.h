// mla_cases.h — the MLA attention cases of harness.cpp: kernels/cuda/mla.cu under emu.h against an fp64 naive
// reference (mla.md §1, §4, §5; its adjoint checked by central differences) and against the cpu kernel. The
// varlen group runs the same kernels bidirectional inside each segment (varlen_attention, vision.md §3, §5).
// Included by harness.cpp after its helpers (check, to_dev, from_dev, randn, bfr, err_buf, n_pass, n_fail).

struct MlaProb {
    int B, Tq, Tk, H, dn, dr, dv;
    std::vector<int64_t> cu;   // boundaries over B·T incl. row starts; empty: no documents
    vd q, kn, kr, v;
    double scale;
    bool bidir = false;        // varlen_attention: B 1, dr 0, dn = dv, every key of the query's segment visible
};

static MlaProb mla_make(int B, int Tq, int Tk, int H, int dn, int dr, int dv, std::vector<int64_t> docs, bool bf16)
{
    MlaProb p{B, Tq, Tk, H, dn, dr, dv, {}, {}, {}, {}, {}, 1.0 / std::sqrt((double)(dn + dr))};
    if (!docs.empty()) {
        for (int b = 0; b <= B; b++) p.cu.push_back((int64_t)b * Tk);   // boundaries over the keys
        for (int64_t d : docs) p.cu.push_back(d);
        std::sort(p.cu.begin(), p.cu.end());
        p.cu.erase(std::unique(p.cu.begin(), p.cu.end()), p.cu.end());
    }
    p.q.resize((size_t)B * Tq * H * (dn + dr));
    p.kn.resize((size_t)B * Tk * H * dn);
    p.kr.resize((size_t)B * Tk * dr);
    p.v.resize((size_t)B * Tk * H * dv);
    for (auto *x : {&p.q, &p.kn, &p.kr, &p.v})
        for (auto &y : *x) y = bf16 ? bfr(randn()) : randn();
    return p;
}

// first key query i of row b may see (its document start, row-relative; the documents are over the keys and
// query i is key i + Tk - Tq)
static int64_t mla_first_key(const MlaProb &p, int b, int i)
{
    if (p.cu.empty()) return 0;
    int64_t n = (int64_t)b * p.Tk + i + (p.Tk - p.Tq), s = 0;
    for (size_t k = 0; k + 1 < p.cu.size(); k++)
        if (p.cu[k] <= n) s = p.cu[k];
    return s - (int64_t)b * p.Tk;
}

// last key query i of row b may see: causal, or (bidir) its document's last token
static int64_t mla_last_key(const MlaProb &p, int b, int i)
{
    int64_t j1 = std::min<int64_t>(i + p.Tk - p.Tq, p.Tk - 1);
    if (!p.bidir) return j1;
    int64_t n = (int64_t)b * p.Tk + i + (p.Tk - p.Tq), e = p.Tk;
    for (size_t k = p.cu.size(); k-- > 0;)
        if (p.cu[k] > n) e = p.cu[k] - (int64_t)b * p.Tk;
    return std::min<int64_t>(e, p.Tk) - 1;
}

// probabilities P[b, h, i, j] (0 where not visible) and lse [B, H, Tq]
static void mla_ref_probs(const MlaProb &p, vd &P, vd &lse)
{
    int dq = p.dn + p.dr;
    P.assign((size_t)p.B * p.H * p.Tq * p.Tk, 0.0);
    lse.assign((size_t)p.B * p.H * p.Tq, -INFINITY);
    for (int b = 0; b < p.B; b++)
        for (int h = 0; h < p.H; h++)
            for (int i = 0; i < p.Tq; i++) {
                int64_t j0 = mla_first_key(p, b, i), j1 = mla_last_key(p, b, i);
                if (j1 < j0) continue;
                const double *q = &p.q[(((size_t)b * p.Tq + i) * p.H + h) * dq];
                double *row = &P[(((size_t)b * p.H + h) * p.Tq + i) * p.Tk];
                double m = -INFINITY;
                for (int64_t j = j0; j <= j1; j++) {
                    const double *kn = &p.kn[(((size_t)b * p.Tk + j) * p.H + h) * p.dn];
                    const double *kr = p.dr ? &p.kr[((size_t)b * p.Tk + j) * p.dr] : nullptr;
                    double s = 0;
                    for (int c = 0; c < p.dn; c++) s += q[c] * kn[c];
                    for (int c = 0; c < p.dr; c++) s += q[p.dn + c] * kr[c];
                    row[j] = s * p.scale;
                    m = std::max(m, row[j]);
                }
                double sum = 0;
                for (int64_t j = j0; j <= j1; j++) sum += std::exp(row[j] - m);
                for (int64_t j = j0; j <= j1; j++) row[j] = std::exp(row[j] - m) / sum;
                lse[((size_t)b * p.H + h) * p.Tq + i] = m + std::log(sum);
            }
}

static vd mla_ref_forward(const MlaProb &p, vd *lse_out = nullptr)
{
    vd P, lse;
    mla_ref_probs(p, P, lse);
    vd o((size_t)p.B * p.Tq * p.H * p.dv, 0.0);
    for (int b = 0; b < p.B; b++)
        for (int h = 0; h < p.H; h++)
            for (int i = 0; i < p.Tq; i++) {
                const double *row = &P[(((size_t)b * p.H + h) * p.Tq + i) * p.Tk];
                double *oo = &o[(((size_t)b * p.Tq + i) * p.H + h) * p.dv];
                for (int j = 0; j < p.Tk; j++)
                    if (row[j] != 0)
                        for (int c = 0; c < p.dv; c++) oo[c] += row[j] * p.v[(((size_t)b * p.Tk + j) * p.H + h) * p.dv + c];
            }
    if (lse_out) *lse_out = lse;
    return o;
}

struct MlaGrad {
    vd q, kn, kr, v;
};

// mla.md §4: dV = Pᵀ dO, dP = dO Vᵀ, dZ = P ⊙ (dP − D), dq = scale dZ k, dk = scale dZᵀ q, dk_r summed over heads
static MlaGrad mla_ref_backward(const MlaProb &p, const vd &go)
{
    int dq = p.dn + p.dr;
    vd P, lse;
    mla_ref_probs(p, P, lse);
    vd o = mla_ref_forward(p);
    MlaGrad g;
    g.q.assign(p.q.size(), 0);
    g.kn.assign(p.kn.size(), 0);
    g.kr.assign(p.kr.size(), 0);
    g.v.assign(p.v.size(), 0);
    for (int b = 0; b < p.B; b++)
        for (int h = 0; h < p.H; h++)
            for (int i = 0; i < p.Tq; i++) {
                size_t oi = (((size_t)b * p.Tq + i) * p.H + h);
                const double *dO = &go[oi * p.dv], *q = &p.q[oi * dq];
                double D = 0;
                for (int c = 0; c < p.dv; c++) D += dO[c] * o[oi * p.dv + c];
                const double *row = &P[(((size_t)b * p.H + h) * p.Tq + i) * p.Tk];
                for (int j = 0; j < p.Tk; j++) {
                    if (row[j] == 0) continue;
                    size_t kj = ((size_t)b * p.Tk + j) * p.H + h, rj = (size_t)b * p.Tk + j;
                    double dP = 0;
                    for (int c = 0; c < p.dv; c++) {
                        dP += dO[c] * p.v[kj * p.dv + c];
                        g.v[kj * p.dv + c] += row[j] * dO[c];
                    }
                    double dz = row[j] * (dP - D) * p.scale;
                    for (int c = 0; c < p.dn; c++) {
                        g.q[oi * dq + c] += dz * p.kn[kj * p.dn + c];
                        g.kn[kj * p.dn + c] += dz * q[c];
                    }
                    for (int c = 0; c < p.dr; c++) {
                        g.q[oi * dq + p.dn + c] += dz * p.kr[rj * p.dr + c];
                        g.kr[rj * p.dr + c] += dz * q[p.dn + c];
                    }
                }
            }
    return g;
}

// the reference adjoint against central differences of sum(o ⊙ r)
static void mla_ref_fd(MlaProb p, const char *name)
{
    vd r((size_t)p.B * p.Tq * p.H * p.dv);
    for (auto &x : r) x = randn();
    MlaGrad g = mla_ref_backward(p, r);
    auto loss = [&]() {
        vd o = mla_ref_forward(p);
        double l = 0;
        for (size_t i = 0; i < o.size(); i++) l += o[i] * r[i];
        return l;
    };
    double worst = 0;
    std::pair<vd *, vd *> xs[] = {{&p.q, &g.q}, {&p.kn, &g.kn}, {&p.kr, &g.kr}, {&p.v, &g.v}};
    for (auto &xg : xs) {
        vd &x = *xg.first;
        double m = 0, e = 0;
        for (size_t i = 0; i < x.size(); i++) {
            double x0 = x[i];
            x[i] = x0 + 1e-6;
            double lp = loss();
            x[i] = x0 - 1e-6;
            double lm = loss();
            x[i] = x0;
            double d = (lp - lm) / 2e-6;
            m = std::max(m, std::fabs(d));
            e = std::max(e, std::fabs(d - (*xg.second)[i]));
        }
        worst = std::max(worst, m > 0 ? e / m : e);
    }
    bool ok = worst < 1e-6;
    printf("  %-34s %s err/max %.1e (tol 1e-6)\n", name, ok ? "ok  " : "FAIL", worst);
    if (ok) n_pass++;
    else n_fail++;
}

// lse: the same -inf entries, the finite ones within tol of max|lse|
static void mla_check_lse(const char *name, const std::vector<float> &got, const vd &ref, double tol)
{
    vd g2, r2;
    int mism = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        if (std::isinf(ref[i]) || std::isinf(got[i])) {
            if (!(std::isinf(ref[i]) && got[i] == -INFINITY)) mism++;
            continue;
        }
        g2.push_back(got[i]);
        r2.push_back(ref[i]);
    }
    if (mism) {
        printf("  %-34s FAIL %d entries differ in being -inf\n", name, mism);
        n_fail++;
        return;
    }
    check(name, g2, r2, tol);
}

// shared memory limit that leaves only the smallest tiles (several query and key tiles on short sequences)
static int mla_small_tiles_limit(const MlaProb &p, bool bf16)
{
    int DQ = (p.dn + p.dr + 15) / 16 * 16, DV = (p.dv + 15) / 16 * 16, lim = 0;
    for (int kind : {MLA_FWD, MLA_DQ, MLA_DKV})
        lim = std::max(lim, mla_make_layout(kind, bf16, 16, 16, DQ, DV, kind == MLA_DKV ? p.dr : 0, p.bidir).total);
    return lim;
}

struct MlaOut {
    vd o, gq, gkn, gkr, gv;
    std::vector<float> lse;
};

// runs the cuda forward and backward (wanted gradients: bits 1 q, 2 kn, 4 kr, 8 v); rc != 0 on failure
template <class T> static int mla_run_cuda(const MlaProb &p, const vd &r, int want, MlaOut &res)
{
    int dtype = sizeof(T) == 2 ? TIDE_BF16 : TIDE_F32;
    auto q = to_dev<T>(p.q), kn = to_dev<T>(p.kn), kr = to_dev<T>(p.kr), v = to_dev<T>(p.v), go = to_dev<T>(r);
    const int64_t *cu = p.cu.empty() ? nullptr : p.cu.data();
    int64_t nseg = p.cu.empty() ? 0 : (int64_t)p.cu.size() - 1;
    size_t No = (size_t)p.B * p.Tq * p.H * p.dv;
    std::vector<T> o = to_dev<T>(vd(No, NAN));
    res.lse.assign((size_t)p.B * p.H * p.Tq, NAN);
    const T *krp = p.dr ? kr.data() : nullptr;
    if (p.bidir ? tide_cuda_varlen_attention(dtype, o.data(), res.lse.data(), q.data(), kn.data(), v.data(), cu, nseg,
                                             p.Tq, p.H, p.dn, p.scale)
                : tide_cuda_mla_attention(dtype, o.data(), res.lse.data(), q.data(), kn.data(), krp, v.data(), cu, nseg,
                                          p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv, p.scale)) {
        printf("  forward failed: %s\n", err_buf);
        return -1;
    }
    res.o = from_dev(o);
    std::vector<T> gq = to_dev<T>(vd(p.q.size(), NAN)), gkn = to_dev<T>(vd(p.kn.size(), NAN)),
                   gkr = to_dev<T>(vd(p.kr.size(), NAN)), gv = to_dev<T>(vd(p.v.size(), NAN));
    int brc = p.bidir
                  ? tide_cuda_varlen_attention_backward(dtype, want & 1 ? gq.data() : nullptr,
                                                        want & 2 ? gkn.data() : nullptr, want & 8 ? gv.data() : nullptr,
                                                        go.data(), q.data(), kn.data(), v.data(), o.data(),
                                                        res.lse.data(), cu, nseg, p.Tq, p.H, p.dn, p.scale)
                  : tide_cuda_mla_attention_backward(dtype, want & 1 ? gq.data() : nullptr, want & 2 ? gkn.data() : nullptr,
                                                     want & 4 ? gkr.data() : nullptr, want & 8 ? gv.data() : nullptr,
                                                     go.data(), q.data(), kn.data(), krp, v.data(), o.data(),
                                                     res.lse.data(), cu, nseg, p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv,
                                                     p.scale);
    if (brc) {
        printf("  backward failed: %s\n", err_buf);
        return -1;
    }
    res.gq = from_dev(gq);
    res.gkn = from_dev(gkn);
    res.gkr = from_dev(gkr);
    res.gv = from_dev(gv);
    return 0;
}

// the cpu kernel (f32) on the same values
static int mla_run_cpu(const MlaProb &p, const vd &r, MlaOut &res)
{
    auto q = to_dev<float>(p.q), kn = to_dev<float>(p.kn), kr = to_dev<float>(p.kr), v = to_dev<float>(p.v),
         go = to_dev<float>(r);
    const int64_t *cu = p.cu.empty() ? nullptr : p.cu.data();
    int64_t nseg = p.cu.empty() ? 0 : (int64_t)p.cu.size() - 1;
    std::vector<float> o((size_t)p.B * p.Tq * p.H * p.dv, NAN), gq(p.q.size(), NAN), gkn(p.kn.size(), NAN),
        gkr(p.kr.size(), NAN), gv(p.v.size(), NAN);
    res.lse.assign((size_t)p.B * p.H * p.Tq, NAN);
    const float *krp = p.dr ? kr.data() : nullptr;
    if (p.bidir) {
        if (tide_cpu_backend.varlen_attention(TIDE_F32, o.data(), res.lse.data(), q.data(), kn.data(), v.data(), cu, nseg,
                                              p.Tq, p.H, p.dn, p.scale) ||
            tide_cpu_backend.varlen_attention_backward(TIDE_F32, gq.data(), gkn.data(), gv.data(), go.data(), q.data(),
                                                       kn.data(), v.data(), o.data(), res.lse.data(), cu, nseg, p.Tq,
                                                       p.H, p.dn, p.scale)) {
            printf("  cpu kernel failed: %s\n", err_buf[0] ? err_buf : tide_last_error());
            return -1;
        }
    } else if (tide_cpu_backend.mla_attention(TIDE_F32, o.data(), res.lse.data(), q.data(), kn.data(), krp, v.data(), cu, nseg,
                                       p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv, p.scale) ||
        tide_cpu_backend.mla_attention_backward(TIDE_F32, gq.data(), gkn.data(), p.dr ? gkr.data() : nullptr, gv.data(),
                                                go.data(), q.data(), kn.data(), krp, v.data(), o.data(),
                                                res.lse.data(), cu, nseg, p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv,
                                                p.scale)) {
        printf("  cpu kernel failed: %s\n", err_buf[0] ? err_buf : tide_last_error());   // interposed or libtide's own
        return -1;
    }
    res.o = fvec(o);
    res.gq = fvec(gq);
    res.gkn = fvec(gkn);
    res.gkr = fvec(gkr);
    res.gv = fvec(gv);
    return 0;
}

static bool mla_no_cpu() { return getenv("NO_CPU") != nullptr; }

// limit: the device's shared memory per block; MLA_SMALL: just enough for the smallest tiles; 0: sm_90's
enum { MLA_SMALL = -1, MLA_SM80 = 166912 };
template <class T>
static void run_mla_case(const char *name, const MlaProb &p, double tol_o, double tol_g, int limit, int want = 15)
{
    bool bf16 = sizeof(T) == 2;
    int saved = emu::smem_limit;
    if (limit == MLA_SMALL) emu::smem_limit = mla_small_tiles_limit(p, bf16);
    else if (limit > 0) emu::smem_limit = limit;
    mla_layout Lf, Lq, Lk;
    mla_pick_layout("", MLA_FWD, bf16, p.dn, p.dr, p.dv, 0, &Lf, p.bidir);
    mla_pick_layout("", MLA_DQ, bf16, p.dn, p.dr, p.dv, 0, &Lq, p.bidir);
    mla_pick_layout("", MLA_DKV, bf16, p.dn, p.dr, p.dv, p.dr, &Lk, p.bidir);
    int64_t groups = 0, hpg = mla_head_groups(p.H, p.B, (p.Tk + Lk.BK - 1) / Lk.BK, (want & 4) && p.dr, &groups);
    printf("%s  [B %d Tq %d Tk %d H %d dn %d dr %d dv %d, %s, %s; tiles fwd %dx%d dq %dx%d dkv %dx%d, %lld head "
           "group(s) of %lld]\n", name, p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv, p.cu.empty() ? "no docs" : p.bidir ? "segments, bidirectional" : "docs",
           bf16 ? "bf16" : "f32", Lf.BQ, Lf.BK, Lq.BQ, Lq.BK, Lk.BQ, Lk.BK, (long long)groups, (long long)hpg);
    vd r((size_t)p.B * p.Tq * p.H * p.dv);
    for (auto &x : r) x = bf16 ? bfr(randn()) : randn();
    MlaOut got;
    int rc = mla_run_cuda<T>(p, r, want, got);
    emu::smem_limit = saved;
    if (rc) {
        n_fail++;
        return;
    }
    vd rlse, ro = mla_ref_forward(p, &rlse);
    MlaGrad rg = mla_ref_backward(p, r);
    check("o", got.o, ro, tol_o);
    mla_check_lse("lse", got.lse, rlse, 1e-6);
    if (want & 1) check("dq", got.gq, rg.q, tol_g);
    if (want & 2) check("dk_n", got.gkn, rg.kn, tol_g);
    if ((want & 4) && p.dr) check("dk_r (summed over heads)", got.gkr, rg.kr, tol_g);
    if (want & 8) check("dv", got.gv, rg.v, tol_g);
    if (mla_no_cpu() || want != 15) return;
    if (!tide_cpu_backend.mla_attention || !tide_cpu_backend.mla_attention_backward || !tide_cpu_backend.varlen_attention ||
        !tide_cpu_backend.varlen_attention_backward) {
        printf("  cpu kernel absent from tide_cpu_backend: FAIL (NO_CPU=1 skips the cross-check)\n");
        n_fail++;
        return;
    }
    MlaOut cpu;
    if (mla_run_cpu(p, r, cpu)) {
        n_fail++;
        return;
    }
    // the cpu kernel against fp64, then cuda against the cpu at the stated parity tolerances
    check("cpu o vs fp64", cpu.o, ro, 1e-5);
    mla_check_lse("cpu lse vs fp64", cpu.lse, rlse, 1e-6);
    check("cpu dq vs fp64", cpu.gq, rg.q, 1e-5);
    check("cpu dk_n vs fp64", cpu.gkn, rg.kn, 1e-5);
    if (p.dr) check("cpu dk_r vs fp64", cpu.gkr, rg.kr, 1e-5);
    check("cpu dv vs fp64", cpu.gv, rg.v, 1e-5);
    double po = bf16 ? 1.0 / 128 : 1e-4, pg = bf16 ? 1.0 / 64 : 1e-4;
    check("cuda o vs cpu", got.o, cpu.o, po);
    check("cuda dq vs cpu", got.gq, cpu.gq, pg);
    check("cuda dk_n vs cpu", got.gkn, cpu.gkn, pg);
    if (p.dr) check("cuda dk_r vs cpu", got.gkr, cpu.gkr, pg);
    check("cuda dv vs cpu", got.gv, cpu.gv, pg);
}

// two runs under different thread orders give bitwise equal gradients (no atomics, fixed summation order)
template <class T> static void run_mla_determinism(const char *name, const MlaProb &p)
{
    printf("%s  [%s]\n", name, sizeof(T) == 2 ? "bf16" : "f32");
    int saved = emu::smem_limit;
    emu::smem_limit = mla_small_tiles_limit(p, sizeof(T) == 2);
    vd r((size_t)p.B * p.Tq * p.H * p.dv);
    for (auto &x : r) x = randn();
    MlaOut a, b;
    emu::rng.seed(101);
    int rc = mla_run_cuda<T>(p, r, 15, a);
    emu::rng.seed(202);
    rc = rc || mla_run_cuda<T>(p, r, 15, b);
    emu::smem_limit = saved;
    bool same = !rc && a.o == b.o && a.gq == b.gq && a.gkn == b.gkn && a.gkr == b.gkr && a.gv == b.gv;
    printf("  %-34s %s\n", "bitwise equal across thread orders", same ? "ok" : "FAIL");
    if (same) n_pass++;
    else n_fail++;
}

// argument errors name the problem
static void mla_expect_error(const char *what, int rc, const char *needle)
{
    bool ok = rc != 0 && strstr(err_buf, needle);
    printf("  %-34s %s  (%s)\n", what, ok ? "ok  " : "FAIL", err_buf);
    if (ok) n_pass++;
    else n_fail++;
    err_buf[0] = 0;
}

static void run_mla_errors()
{
    printf("mla argument errors\n");
    std::vector<float> x(4096, 0.f), lse(64);
    std::vector<int64_t> cu = {0, 3, 8}, bad = {0, 5, 16};   // bad: [5, 16) crosses the start of row 1 (T = 8)
    float *p = x.data();
    mla_expect_error("documents with Tq > Tk",
                     tide_cuda_mla_attention(TIDE_F32, p, lse.data(), p, p, p, p, cu.data(), 2, 1, 9, 8, 1, 4, 4, 4, 0.5),
                     "need Tq <= Tk");
    mla_expect_error("dr > 0 with k_r NULL",
                     tide_cuda_mla_attention(TIDE_F32, p, lse.data(), p, p, nullptr, p, nullptr, 0, 1, 8, 8, 1, 4, 4, 4, 0.5),
                     "k_r is NULL but dr = 4");
    mla_expect_error("f64", tide_cuda_mla_attention(TIDE_F64, p, lse.data(), p, p, p, p, nullptr, 0, 1, 8, 8, 1, 4, 4, 4, 0.5),
                     "f64 is not implemented on the cuda backend");
    mla_expect_error("segment across a row start",
                     tide_cuda_mla_attention_backward(TIDE_F32, p, p, p, p, p, p, p, p, p, p, lse.data(), bad.data(), 2, 2,
                                                      8, 8, 1, 4, 4, 4, 0.5),
                     "crosses the start of row 1");
    int saved = emu::smem_limit;
    emu::smem_limit = 48 * 1024;
    mla_expect_error("head dims beyond shared memory",
                     tide_cuda_mla_attention(TIDE_F32, p, lse.data(), p, p, p, p, nullptr, 0, 1, 8, 8, 1, 512, 256, 512, 0.5),
                     "shared memory");
    emu::smem_limit = saved;
}

// the tiles and shared memory each kernel takes at a few head dims, on sm_80 and sm_90 limits (for the report)
static void mla_print_layouts()
{
    int dims[][3] = {{64, 32, 64}, {128, 64, 128}, {128, 128, 128}, {192, 64, 128}, {64, 0, 64}, {128, 0, 128}};
    int saved = emu::smem_limit;
    for (int limit : {163 * 1024, 227 * 1024})
        for (auto &d : dims)
            for (int bf16 = 0; bf16 < 2; bf16++) {
                emu::smem_limit = limit;
                printf("limit %d dn %d dr %d dv %d %s:", limit, d[0], d[1], d[2], bf16 ? "bf16" : "f32 ");
                const char *nm[] = {"fwd", "dq", "dkv"};
                for (int kind : {MLA_FWD, MLA_DQ, MLA_DKV}) {
                    mla_layout L;
                    if (mla_pick_layout("", kind, bf16, d[0], d[1], d[2], kind == MLA_DKV ? d[1] : 0, &L))
                        printf("  %s none", nm[kind]);
                    else
                        printf("  %s %dx%d %d B", nm[kind], L.BQ, L.BK, L.total);
                }
                printf("\n");
            }
    emu::smem_limit = saved;
}

static void run_mla(const std::function<bool(const char *)> &want)
{
    typedef __nv_bfloat16 bf;
    const double f32o = 1e-5, f32g = 1e-5, bfo = 1.0 / 128, bfg = 1.0 / 64;
    if (want("mlasmall")) {
        printf("mla reference adjoint vs central differences\n");
        mla_ref_fd(mla_make(2, 9, 9, 2, 3, 2, 3, {4, 13}, false), "docs, B 2, T 9");
        mla_ref_fd(mla_make(1, 3, 7, 2, 3, 2, 3, {}, false), "Tq 3 < Tk 7");
        MlaProb p = mla_make(2, 37, 37, 3, 16, 8, 16, {5, 50, 60}, false);
        run_mla_case<float>("mla f32 docs, small tiles", p, f32o, f32g, MLA_SMALL);
        run_mla_case<float>("mla f32 docs, default tiles", p, f32o, f32g, 0);
        MlaProb pb = mla_make(2, 37, 37, 3, 16, 8, 16, {5, 50, 60}, true);
        run_mla_case<bf>("mla bf16 docs, small tiles (wmma)", pb, bfo, bfg, MLA_SMALL);
        MlaProb pn = mla_make(1, 37, 37, 4, 16, 8, 16, {}, false);
        run_mla_case<float>("mla f32 no docs, small tiles", pn, f32o, f32g, MLA_SMALL);
    }
    if (want("mlaedge")) {
        MlaProb pd = mla_make(2, 1, 40, 2, 16, 8, 16, {}, false);
        run_mla_case<float>("mla f32 decode Tq 1", pd, f32o, f32g, 0);
        MlaProb pdb = mla_make(2, 1, 40, 2, 16, 8, 16, {}, true);
        run_mla_case<bf>("mla bf16 decode Tq 1", pdb, bfo, bfg, 0);
        MlaProb pa = mla_make(1, 20, 45, 2, 16, 8, 16, {}, false);
        run_mla_case<float>("mla f32 append Tq 20 < Tk 45", pa, f32o, f32g, MLA_SMALL);
        MlaProb pab = mla_make(1, 20, 45, 2, 16, 8, 16, {}, true);
        run_mla_case<bf>("mla bf16 append Tq 20 < Tk 45", pab, bfo, bfg, MLA_SMALL);
        // a context-parallel slice (long_context.md §5): documents over the keys, one starting inside the queries
        MlaProb pc = mla_make(2, 20, 45, 2, 16, 8, 16, {10, 33, 60, 80}, false);
        run_mla_case<float>("mla f32 CP slice Tq 20 < Tk 45, docs", pc, f32o, f32g, MLA_SMALL);
        MlaProb pcb = mla_make(2, 20, 45, 2, 16, 8, 16, {10, 33, 60, 80}, true);
        run_mla_case<bf>("mla bf16 CP slice Tq 20 < Tk 45, docs", pcb, bfo, bfg, MLA_SMALL);
        MlaProb pe = mla_make(1, 9, 5, 2, 16, 8, 16, {}, false);
        run_mla_case<float>("mla f32 Tq 9 > Tk 5 (4 see nothing)", pe, f32o, f32g, 0);
        MlaProb p0 = mla_make(2, 21, 21, 2, 16, 0, 16, {9, 30}, false);
        run_mla_case<float>("mla f32 dr 0, k_r NULL", p0, f32o, f32g, MLA_SMALL);
        MlaProb p0b = mla_make(2, 21, 21, 2, 16, 0, 16, {9, 30}, true);
        run_mla_case<bf>("mla bf16 dr 0, k_r NULL", p0b, bfo, bfg, MLA_SMALL);
        MlaProb pu = mla_make(2, 21, 21, 2, 16, 8, 16, {}, false);
        pu.cu = {0, 5, 5, 21, 21, 30, 42};   // empty documents, as repeated boundaries
        run_mla_case<float>("mla f32 empty documents", pu, f32o, f32g, MLA_SMALL);
        MlaProb po = mla_make(1, 30, 30, 2, 20, 12, 24, {11}, false);
        run_mla_case<float>("mla f32 dims 20+12, 24 (padded)", po, f32o, f32g, MLA_SMALL);
        MlaProb pob = mla_make(1, 30, 30, 2, 20, 12, 24, {11}, true);
        run_mla_case<bf>("mla bf16 dims 20+12, 24 (padded)", pob, bfo, bfg, MLA_SMALL);
        MlaProb pg = mla_make(1, 21, 21, 5, 16, 8, 16, {7}, false);
        run_mla_case<float>("mla f32 only dk_r wanted", pg, f32o, f32g, MLA_SMALL, 4);
        run_mla_case<float>("mla f32 dq and dv wanted", pg, f32o, f32g, MLA_SMALL, 9);
        run_mla_determinism<bf>("mla determinism", pg);
        run_mla_errors();
    }
    if (want("mla64")) {
        MlaProb p = mla_make(1, 70, 70, 2, 64, 32, 64, {17}, true);
        run_mla_case<bf>("mla bf16 tiny dims (wmma)", p, bfo, bfg, 0);
        MlaProb pf = mla_make(1, 40, 40, 2, 64, 32, 64, {17}, false);
        run_mla_case<float>("mla f32 tiny dims", pf, f32o, f32g, 0);
    }
    if (want("mla128")) {
        MlaProb p = mla_make(2, 130, 130, 3, 128, 64, 128, {30, 100, 190}, true);
        run_mla_case<bf>("mla bf16 K3 dims (wmma)", p, bfo, bfg, 0);
        MlaProb pf = mla_make(1, 70, 70, 2, 128, 64, 128, {30}, false);
        run_mla_case<float>("mla f32 K3 dims", pf, f32o, f32g, 0);
        MlaProb p8 = mla_make(1, 70, 70, 2, 128, 64, 128, {30}, true);
        run_mla_case<bf>("mla bf16 K3 dims, sm_80 shared memory", p8, bfo, bfg, MLA_SM80);
        MlaProb pd = mla_make(1, 1, 100, 3, 128, 64, 128, {}, true);
        run_mla_case<bf>("mla bf16 K3 dims decode Tq 1", pd, bfo, bfg, 0);
    }
    if (want("varlen")) {
        // varlen_attention (vision.md §3, §5): the same kernels with bidir, one packed row, segments of 1 token,
        // segments longer than a tile, empty segments, head dims not multiples of 16 (MoonViT's 72)
        auto vl = [](int T, int H, int D, std::vector<int64_t> cu, bool bf16) {
            MlaProb p = mla_make(1, T, T, H, D, 0, D, {}, bf16);
            p.cu = cu;
            p.bidir = true;
            return p;
        };
        printf("varlen reference adjoint vs central differences\n");
        mla_ref_fd(vl(9, 2, 3, {0, 4, 5, 9}, false), "bidir, segments 4, 1, 4");
        MlaProb p = vl(37, 3, 16, {0, 1, 20, 37}, false);
        run_mla_case<float>("varlen f32 segments 1, 19, 17, small tiles", p, f32o, f32g, MLA_SMALL);
        run_mla_case<float>("varlen f32 segments 1, 19, 17, default tiles", p, f32o, f32g, 0);
        MlaProb pb = vl(37, 3, 16, {0, 1, 20, 37}, true);
        run_mla_case<bf>("varlen bf16 segments 1, 19, 17, small tiles", pb, bfo, bfg, MLA_SMALL);
        MlaProb pl = vl(150, 2, 16, {0, 1, 71, 150}, false);
        run_mla_case<float>("varlen f32 segments 1, 70, 79 (> a tile)", pl, f32o, f32g, 0);
        MlaProb plb = vl(150, 2, 16, {0, 1, 71, 150}, true);
        run_mla_case<bf>("varlen bf16 segments 1, 70, 79 (> a tile)", plb, bfo, bfg, 0);
        MlaProb pu = vl(30, 2, 16, {0, 5, 5, 21, 21, 30}, false);
        run_mla_case<float>("varlen f32 empty segments", pu, f32o, f32g, MLA_SMALL);
        MlaProb pm = vl(40, 2, 72, {0, 13, 40}, false);
        run_mla_case<float>("varlen f32 D 72 (MoonViT, padded)", pm, f32o, f32g, MLA_SMALL);
        MlaProb pmb = vl(40, 2, 72, {0, 13, 40}, true);
        run_mla_case<bf>("varlen bf16 D 72 (MoonViT, padded)", pmb, bfo, bfg, 0);
        MlaProb pg = vl(33, 3, 16, {0, 7, 33}, false);
        run_mla_case<float>("varlen f32 only dk wanted", pg, f32o, f32g, MLA_SMALL, 2);
        run_mla_case<float>("varlen f32 dq and dv wanted", pg, f32o, f32g, MLA_SMALL, 9);
        run_mla_determinism<bf>("varlen determinism", vl(33, 3, 16, {0, 7, 33}, true));
        printf("varlen argument errors\n");
        std::vector<float> x(4096, 0.f), lse(64);
        std::vector<int64_t> dec = {0, 6, 4, 8};
        mla_expect_error("cu_seqlens NULL", tide_cuda_varlen_attention(TIDE_F32, x.data(), lse.data(), x.data(), x.data(),
                                                                       x.data(), nullptr, 0, 8, 1, 4, 0.5),
                         "cu_seqlens is NULL");
        mla_expect_error("cu_seqlens decreasing",
                         tide_cuda_varlen_attention(TIDE_F32, x.data(), lse.data(), x.data(), x.data(), x.data(),
                                                    dec.data(), 3, 8, 1, 4, 0.5),
                         "decreases at 1");
    }
    if (getenv("MLA_LAYOUT")) mla_print_layouts();
}

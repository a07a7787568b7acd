// mla_latent_cases.h — the mla_latent_attention cases of harness.cpp (group mlalatent): kernels/cuda/mla.cu's latent
// path (the chunk expansion through the real gemm.cu over emu_cublas.h's cuBLAS, the flash kernels on each chunk,
// the log-sum-exp merge, the backward's fp32 sums) under emu.h against the cpu kernel of libtide
// (tide_cpu_mla_latent_attention): in f64 with one chunk as the reference, and in f32 with the case's own chunk as
// the parity check. Output, lse and the four gradients (q, c, k_r, w); chunks from 1 key to more than Tk (the
// query tiles a chunk cannot reach skipped; dk_r through one head group or several); documents over the keys, CP
// slices (Tq < Tk), dr = 0, f32 and bf16 (wmma); NULL gradients; the same bits under another thread order; argument
// errors. Included by harness.cpp after mla_cases.h.

struct LatProb {
    int B, Tq, Tk, H, dn, dr, dv, dc;
    std::vector<int64_t> cu;   // boundaries over B·Tk incl. row starts; empty: no documents
    vd q, c, kr, w;
    double scale;
};

static LatProb lat_make(int B, int Tq, int Tk, int H, int dn, int dr, int dv, int dc, std::vector<int64_t> docs, bool bf16)
{
    LatProb p{B, Tq, Tk, H, dn, dr, dv, dc, {}, {}, {}, {}, {}, 1.0 / std::sqrt((double)(dn + dr))};
    if (!docs.empty()) {
        for (int b = 0; b <= B; b++) p.cu.push_back((int64_t)b * Tk);
        for (int64_t d : docs) p.cu.push_back(d);
        std::sort(p.cu.begin(), p.cu.end());
        p.cu.erase(std::unique(p.cu.begin(), p.cu.end()), p.cu.end());
    }
    p.q.resize((size_t)B * Tq * H * (dn + dr));
    p.c.resize((size_t)B * Tk * dc);
    p.kr.resize((size_t)B * Tk * dr);
    p.w.resize((size_t)H * (dn + dv) * dc);
    double ws = 1.0 / std::sqrt((double)dc);   // expanded keys and values of unit size
    for (auto *x : {&p.q, &p.c, &p.kr, &p.w})
        for (auto &y : *x) {
            double v = randn() * (x == &p.w ? ws : 1.0);
            y = bf16 ? bfr(v) : v;
        }
    return p;
}

struct LatOut {
    vd o, lse, gq, gc, gkr, gw;
};

static int64_t lat_nseg(const LatProb &p) { return p.cu.empty() ? 0 : (int64_t)p.cu.size() - 1; }

// the cpu kernel's buffers (f32 or f64) to and from doubles
static std::vector<char> lat_buf(int dtype, const vd &x)
{
    std::vector<char> b(x.size() * (dtype == TIDE_F64 ? 8 : 4));
    for (size_t i = 0; i < x.size(); i++) {
        if (dtype == TIDE_F64) ((double *)b.data())[i] = x[i];
        else ((float *)b.data())[i] = (float)x[i];
    }
    return b;
}
static vd lat_vals(int dtype, const std::vector<char> &b)
{
    size_t n = b.size() / (dtype == TIDE_F64 ? 8 : 4);
    vd o(n);
    for (size_t i = 0; i < n; i++) o[i] = dtype == TIDE_F64 ? ((const double *)b.data())[i] : ((const float *)b.data())[i];
    return o;
}

// the cpu kernel in dtype (f32 or f64), chunk keys at a time
static int lat_run_cpu(const LatProb &p, const vd &r, int dtype, int64_t chunk, LatOut &res)
{
    auto q = lat_buf(dtype, p.q), c = lat_buf(dtype, p.c), kr = lat_buf(dtype, p.kr), w = lat_buf(dtype, p.w),
         go = lat_buf(dtype, r);
    size_t es = dtype == TIDE_F64 ? 8 : 4;
    std::vector<char> o((size_t)p.B * p.Tq * p.H * p.dv * es), lse((size_t)p.B * p.H * p.Tq * es), gq(q.size()),
        gc(c.size()), gkr(kr.size()), gw(w.size());
    const int64_t *cu = p.cu.empty() ? nullptr : p.cu.data();
    const void *krp = p.dr ? kr.data() : nullptr;
    if (tide_cpu_backend.mla_latent_attention(dtype, o.data(), lse.data(), q.data(), c.data(), krp, w.data(), cu,
                                              lat_nseg(p), p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv, p.dc, chunk, p.scale) ||
        tide_cpu_backend.mla_latent_attention_backward(dtype, gq.data(), gc.data(), p.dr ? gkr.data() : nullptr,
                                                       gw.data(), go.data(), q.data(), c.data(), krp, w.data(), o.data(),
                                                       lse.data(), cu, lat_nseg(p), p.B, p.Tq, p.Tk, p.H, p.dn, p.dr,
                                                       p.dv, p.dc, chunk, p.scale)) {
        printf("  cpu kernel failed: %s\n", err_buf[0] ? err_buf : tide_last_error());
        return -1;
    }
    res = {lat_vals(dtype, o), lat_vals(dtype, lse), lat_vals(dtype, gq), lat_vals(dtype, gc), lat_vals(dtype, gkr),
           lat_vals(dtype, gw)};
    return 0;
}

// the cuda path; want: the gradients to ask for (bits 1 q, 2 c, 4 k_r, 8 w; the others NULL)
template <class T> static int lat_run_cuda(const LatProb &p, const vd &r, int64_t chunk, int want, LatOut &res)
{
    int dtype = sizeof(T) == 2 ? TIDE_BF16 : TIDE_F32;
    auto q = to_dev<T>(p.q), c = to_dev<T>(p.c), kr = to_dev<T>(p.kr), w = to_dev<T>(p.w), go = to_dev<T>(r);
    std::vector<T> o = to_dev<T>(vd((size_t)p.B * p.Tq * p.H * p.dv, NAN));
    std::vector<float> lse((size_t)p.B * p.H * p.Tq, NAN);
    const int64_t *cu = p.cu.empty() ? nullptr : p.cu.data();
    const T *krp = p.dr ? kr.data() : nullptr;
    if (tide_cuda_mla_latent_attention(dtype, o.data(), lse.data(), q.data(), c.data(), krp, w.data(), cu, lat_nseg(p), p.B,
                                       p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv, p.dc, chunk, p.scale)) {
        printf("  forward failed: %s\n", err_buf);
        return -1;
    }
    std::vector<T> gq = to_dev<T>(vd(p.q.size(), NAN)), gc = to_dev<T>(vd(p.c.size(), NAN)),
                   gkr = to_dev<T>(vd(p.kr.size(), NAN)), gw = to_dev<T>(vd(p.w.size(), NAN));
    if (tide_cuda_mla_latent_attention_backward(dtype, want & 1 ? gq.data() : nullptr, want & 2 ? gc.data() : nullptr,
                                                want & 4 && p.dr ? gkr.data() : nullptr, want & 8 ? gw.data() : nullptr,
                                                go.data(), q.data(), c.data(), krp, w.data(), o.data(), lse.data(), cu,
                                                lat_nseg(p), p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv, p.dc, chunk,
                                                p.scale)) {
        printf("  backward failed: %s\n", err_buf);
        return -1;
    }
    res = {from_dev(o), fvec(lse), from_dev(gq), from_dev(gc), from_dev(gkr), from_dev(gw)};
    return 0;
}

// lse: the same -inf entries, the finite ones within tol of max|lse|
static void lat_check_lse(const char *name, const vd &got, const vd &ref, double tol)
{
    std::vector<float> g(got.begin(), got.end());
    mla_check_lse(name, g, ref, tol);
}

template <class T>
static void run_lat_case(const char *name, const LatProb &p, int64_t chunk, int limit, double tol_o, double tol_g)
{
    bool bf16 = sizeof(T) == 2;
    int saved = emu::smem_limit;
    if (limit == MLA_SMALL) {
        MlaProb m{p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv};
        emu::smem_limit = mla_small_tiles_limit(m, bf16);
    }
    mla_layout Lf, Lk;
    mla_pick_layout("", MLA_FWD, bf16, p.dn, p.dr, p.dv, 0, &Lf);
    mla_pick_layout("", MLA_DKV, bf16, p.dn, p.dr, p.dv, p.dr, &Lk);
    int64_t kc = std::min<int64_t>(chunk, p.Tk), last = p.Tk - (p.Tk - 1) / kc * kc, g0 = 0, g1 = 0;
    mla_head_groups(p.H, p.B, (kc + Lk.BK - 1) / Lk.BK, p.dr > 0, &g0);
    mla_head_groups(p.H, p.B, (last + Lk.BK - 1) / Lk.BK, p.dr > 0, &g1);
    printf("%s  [B %d Tq %d Tk %d H %d dn %d dr %d dv %d dc %d, %s, %s, chunk %lld (%lld chunks), query tiles of %d, "
           "head groups %lld, last chunk %lld]\n", name, p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv, p.dc,
           p.cu.empty() ? "no docs" : "docs", bf16 ? "bf16" : "f32", (long long)chunk, (long long)((p.Tk + kc - 1) / kc),
           Lf.BQ, (long long)g0, (long long)g1);
    vd r((size_t)p.B * p.Tq * p.H * p.dv);
    for (auto &x : r) x = bf16 ? bfr(randn()) : randn();
    LatOut got, ref, cpu;
    int rc = lat_run_cuda<T>(p, r, chunk, 15, got);
    emu::smem_limit = saved;
    if (rc || lat_run_cpu(p, r, TIDE_F64, p.Tk, ref) || lat_run_cpu(p, r, TIDE_F32, chunk, cpu)) {
        n_fail++;
        return;
    }
    check("o vs cpu f64", got.o, ref.o, tol_o);
    // bf16: the expansion itself is rounded to bf16 (k_n to 2^-9 of its size), so the scores are too
    lat_check_lse("lse vs cpu f64", got.lse, ref.lse, bf16 ? 1.0 / 256 : 1e-6);
    check("dq vs cpu f64", got.gq, ref.gq, tol_g);
    check("dc vs cpu f64", got.gc, ref.gc, tol_g);
    if (p.dr) check("dk_r vs cpu f64", got.gkr, ref.gkr, tol_g);
    check("dw vs cpu f64", got.gw, ref.gw, tol_g);
    double po = bf16 ? 1.0 / 128 : 1e-4, pg = bf16 ? 1.0 / 64 : 1e-4;   // the parity test's tolerances
    check("o vs cpu f32, same chunk", got.o, cpu.o, po);
    check("dq vs cpu f32, same chunk", got.gq, cpu.gq, pg);
    check("dc vs cpu f32, same chunk", got.gc, cpu.gc, pg);
    if (p.dr) check("dk_r vs cpu f32, same chunk", got.gkr, cpu.gkr, pg);
    check("dw vs cpu f32, same chunk", got.gw, cpu.gw, pg);
}

// each gradient asked alone (the others NULL) is bitwise what the run with all four gives
static void run_lat_alone(const char *name, const LatProb &p, int64_t chunk)
{
    printf("%s  [f32, chunk %lld]\n", name, (long long)chunk);
    int saved = emu::smem_limit;
    MlaProb m{p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv};
    emu::smem_limit = mla_small_tiles_limit(m, false);
    vd r((size_t)p.B * p.Tq * p.H * p.dv);
    for (auto &x : r) x = randn();
    LatOut all, one;
    int rc = lat_run_cuda<float>(p, r, chunk, 15, all);
    const char *nm[] = {"dq alone", "dc alone", "dk_r alone", "dw alone"};
    for (int bit = 0; bit < 4 && !rc; bit++) {
        if (bit == 2 && !p.dr) continue;
        rc = lat_run_cuda<float>(p, r, chunk, 1 << bit, one);
        const vd &a = bit == 0 ? all.gq : bit == 1 ? all.gc : bit == 2 ? all.gkr : all.gw;
        const vd &b = bit == 0 ? one.gq : bit == 1 ? one.gc : bit == 2 ? one.gkr : one.gw;
        bool same = !rc && memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
        printf("  %-34s %s\n", nm[bit], same ? "ok   (bitwise the same)" : "FAIL");
        if (same) n_pass++;
        else n_fail++;
    }
    emu::smem_limit = saved;
    if (rc) n_fail++;
}

// two runs under different thread orders give bitwise equal results (fixed summation orders, no atomics)
template <class T> static void run_lat_determinism(const char *name, const LatProb &p, int64_t chunk)
{
    printf("%s  [%s, chunk %lld]\n", name, sizeof(T) == 2 ? "bf16" : "f32", (long long)chunk);
    int saved = emu::smem_limit;
    MlaProb m{p.B, p.Tq, p.Tk, p.H, p.dn, p.dr, p.dv};
    emu::smem_limit = mla_small_tiles_limit(m, sizeof(T) == 2);
    vd r((size_t)p.B * p.Tq * p.H * p.dv);
    for (auto &x : r) x = randn();
    LatOut a, b;
    emu::rng.seed(101);
    int rc = lat_run_cuda<T>(p, r, chunk, 15, a);
    emu::rng.seed(202);
    rc = rc || lat_run_cuda<T>(p, r, chunk, 15, b);
    emu::smem_limit = saved;
    auto eq = [](const vd &x, const vd &y) { return x.size() == y.size() && !memcmp(x.data(), y.data(), x.size() * sizeof(double)); };
    bool same = !rc && eq(a.o, b.o) && eq(a.lse, b.lse) && eq(a.gq, b.gq) && eq(a.gc, b.gc) && eq(a.gkr, b.gkr) &&
                eq(a.gw, b.gw);
    printf("  %-34s %s\n", "bitwise equal across thread orders", same ? "ok" : "FAIL");
    if (same) n_pass++;
    else n_fail++;
}

static void run_lat_errors()
{
    printf("mla_latent argument errors\n");
    std::vector<float> x(4096, 0.f), lse(64);
    std::vector<int64_t> bad = {0, 5, 16};   // [5, 16) crosses the start of row 1 (Tk = 8)
    float *p = x.data();
    mla_expect_error("f64", tide_cuda_mla_latent_attention(TIDE_F64, p, lse.data(), p, p, p, p, nullptr, 0, 1, 8, 8, 1, 4,
                                                           4, 4, 8, 3, 0.5),
                     "f64 is not implemented on the cuda backend");
    mla_expect_error("chunk 0", tide_cuda_mla_latent_attention(TIDE_F32, p, lse.data(), p, p, p, p, nullptr, 0, 1, 8, 8, 1,
                                                               4, 4, 4, 8, 0, 0.5),
                     "chunk must be at least 1 key, got 0");
    mla_expect_error("dr > 0 with k_r NULL",
                     tide_cuda_mla_latent_attention(TIDE_F32, p, lse.data(), p, p, nullptr, p, nullptr, 0, 1, 8, 8, 1, 4,
                                                    4, 4, 8, 3, 0.5),
                     "k_r is NULL but dr = 4");
    mla_expect_error("segment across a row start",
                     tide_cuda_mla_latent_attention_backward(TIDE_F32, p, p, p, p, p, p, p, p, p, p, lse.data(),
                                                             bad.data(), 2, 2, 8, 8, 1, 4, 4, 4, 8, 3, 0.5),
                     "crosses the start of row 1");
}

static void run_mla_latent(const std::function<bool(const char *)> &want)
{
    if (!want("mlalatent")) return;
    typedef __nv_bfloat16 bf;
    if (!tide_cpu_backend.mla_latent_attention || !tide_cpu_backend.mla_latent_attention_backward) {
        printf("mla_latent: cpu kernel absent from tide_cpu_backend: FAIL\n");
        n_fail++;
        return;
    }
    const double f32 = 1e-5, bfo = 1.0 / 128, bfg = 1.0 / 64;
    // a context-parallel slice (long_context.md §5): the queries are the last Tq of Tk keys, documents over the keys
    // (one starting inside the queries, one inside the first chunk); the dk_r head groups: 2 (MLA_DKV_TARGET_BLOCKS)
    LatProb pc = lat_make(2, 13, 29, 2, 16, 8, 16, 24, {6, 20, 40, 51}, false);
    run_lat_case<float>("mla_latent f32 CP slice Tq 13 < Tk 29, docs, chunk 3", pc, 3, MLA_SMALL, f32, f32);
    run_lat_case<float>("mla_latent f32 CP slice, docs, one chunk > Tk", pc, 64, 0, f32, f32);
    run_lat_case<float>("mla_latent f32 CP slice, docs, chunk 20 (2 tiles + 9)", pc, 20, MLA_SMALL, f32, f32);
    // chunks of 48 and 12 keys in key tiles of 16: dk_r straight into gk_r (one head group: 3 tiles x 2 rows reach
    // MLA_DKV_TARGET_BLOCKS) for the first, through the group partials for the second (kbase 48)
    LatProb pg = lat_make(2, 30, 60, 2, 16, 8, 16, 24, {25, 70, 100}, false);
    run_lat_case<float>("mla_latent f32 CP slice Tq 30 < Tk 60, chunk 48", pg, 48, MLA_SMALL, f32, f32);
    LatProb p1 = lat_make(1, 5, 11, 3, 16, 8, 16, 20, {4}, false);
    run_lat_case<float>("mla_latent f32 chunk 1, Tq 5 < Tk 11, docs", p1, 1, MLA_SMALL, f32, f32);
    // Tq = Tk = 40 in query tiles of 16: the later chunks skip the tiles before them and merge from there on (chunk 8:
    // the first query that sees the chunk is the first of its tile)
    LatProb p0 = lat_make(2, 40, 40, 2, 16, 0, 16, 24, {7, 23, 61}, false);
    run_lat_case<float>("mla_latent f32 dr 0 (k_r NULL), Tq = Tk 40, chunk 8", p0, 8, MLA_SMALL, f32, f32);
    LatProb pe = lat_make(1, 9, 5, 2, 16, 8, 16, 16, {}, false);
    run_lat_case<float>("mla_latent f32 Tq 9 > Tk 5 (4 see nothing), chunk 2", pe, 2, 0, f32, f32);
    LatProb pb = lat_make(2, 13, 29, 2, 16, 8, 16, 24, {6, 20, 40, 51}, true);
    run_lat_case<bf>("mla_latent bf16 CP slice, docs, chunk 3 (wmma)", pb, 3, MLA_SMALL, bfo, bfg);
    run_lat_case<bf>("mla_latent bf16 CP slice, docs, one chunk > Tk", pb, 64, 0, bfo, bfg);
    LatProb pb0 = lat_make(1, 40, 40, 2, 16, 0, 16, 24, {7}, true);
    run_lat_case<bf>("mla_latent bf16 dr 0 (k_r NULL), Tq = Tk 40, chunk 7", pb0, 7, MLA_SMALL, bfo, bfg);
    LatProb po = lat_make(1, 20, 30, 2, 20, 12, 24, 36, {11}, false);
    run_lat_case<float>("mla_latent f32 dims 20+12, 24 (padded), chunk 4", po, 4, MLA_SMALL, f32, f32);
    LatProb pob = lat_make(1, 20, 30, 2, 20, 12, 24, 36, {11}, true);
    run_lat_case<bf>("mla_latent bf16 dims 20+12, 24 (padded), chunk 6", pob, 6, MLA_SMALL, bfo, bfg);
    run_lat_alone("mla_latent NULL gradients", pc, 3);
    run_lat_determinism<bf>("mla_latent determinism", pb, 3);
    run_lat_errors();
}

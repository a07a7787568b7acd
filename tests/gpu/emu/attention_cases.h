// attention_cases.h — the softmax attention cases of harness.cpp: kernels/cuda/attention.cu (on mla.cu's flash
// kernels) under emu.h against the cpu kernel in f64 (kernels/cpu/attention.c; test-ops checks its gradients by
// central differences) and in f32. Included by harness.cpp after mla_cases.h (check, to_dev, from_dev, randn, bfr,
// err_buf, mla_small_tiles_limit, n_pass, n_fail).

struct AttnProb {
    int BH, Tq, Tk, D, causal;
    vd q, k, v;
    double scale;
};

static AttnProb attn_make(int BH, int Tq, int Tk, int D, int causal, bool bf16)
{
    AttnProb p{BH, Tq, Tk, D, causal, {}, {}, {}, 1.0 / std::sqrt((double)D)};
    p.q.resize((size_t)BH * Tq * D);
    p.k.resize((size_t)BH * Tk * D);
    p.v.resize((size_t)BH * Tk * D);
    for (auto *x : {&p.q, &p.k, &p.v})
        for (auto &y : *x) y = bf16 ? bfr(2.0 * randn()) : 2.0 * randn();   // scores of a few units: peaked rows
    return p;
}

struct AttnOut {
    vd o, lse, dq, dk, dv;
};

// the cpu kernel in f64 (the reference) or f32 on the same values
template <class T> static int attn_run_cpu(const AttnProb &p, const vd &r, AttnOut &res)
{
    int dtype = sizeof(T) == 8 ? TIDE_F64 : TIDE_F32;
    auto cv = [](const vd &x) { return std::vector<T>(x.begin(), x.end()); };
    auto back = [](const std::vector<T> &x) { return vd(x.begin(), x.end()); };
    std::vector<T> q = cv(p.q), k = cv(p.k), v = cv(p.v), go = cv(r), o(p.q.size(), NAN), lse((size_t)p.BH * p.Tq, NAN),
                   dq(p.q.size(), NAN), dk(p.k.size(), NAN), dv(p.v.size(), NAN);
    if (tide_cpu_backend.attention(dtype, o.data(), lse.data(), q.data(), k.data(), v.data(), p.BH, p.Tq, p.Tk, p.D,
                                   p.causal, p.scale) ||
        tide_cpu_backend.attention_backward(dtype, dq.data(), dk.data(), dv.data(), go.data(), q.data(), k.data(),
                                            v.data(), o.data(), lse.data(), p.BH, p.Tq, p.Tk, p.D, p.causal, p.scale)) {
        printf("  cpu kernel failed: %s\n", err_buf[0] ? err_buf : tide_last_error());
        return -1;
    }
    res = {back(o), back(lse), back(dq), back(dk), back(dv)};
    return 0;
}

// the cuda entries; lse has the storage type T, as the engine allocates it
template <class T> static int attn_run_cuda(const AttnProb &p, const vd &r, AttnOut &res)
{
    int dtype = sizeof(T) == 2 ? TIDE_BF16 : TIDE_F32;
    auto q = to_dev<T>(p.q), k = to_dev<T>(p.k), v = to_dev<T>(p.v), go = to_dev<T>(r);
    std::vector<T> o = to_dev<T>(vd(p.q.size(), NAN)), lse = to_dev<T>(vd((size_t)p.BH * p.Tq, NAN)),
                   dq = to_dev<T>(vd(p.q.size(), NAN)), dk = to_dev<T>(vd(p.k.size(), NAN)),
                   dv = to_dev<T>(vd(p.v.size(), NAN));
    if (tide_cuda_attention(dtype, o.data(), lse.data(), q.data(), k.data(), v.data(), p.BH, p.Tq, p.Tk, p.D, p.causal,
                            p.scale)) {
        printf("  forward failed: %s\n", err_buf);
        return -1;
    }
    if (tide_cuda_attention_backward(dtype, dq.data(), dk.data(), dv.data(), go.data(), q.data(), k.data(), v.data(),
                                     o.data(), lse.data(), p.BH, p.Tq, p.Tk, p.D, p.causal, p.scale)) {
        printf("  backward failed: %s\n", err_buf);
        return -1;
    }
    res = {from_dev(o), from_dev(lse), from_dev(dq), from_dev(dk), from_dev(dv)};
    return 0;
}

// limit (as for mla): MLA_SMALL leaves only the 16x16 tiles, so short sequences cross several query and key tiles;
// MLA_SM80 is sm_80's shared memory; 0 keeps sm_90's
template <class T> static void run_attn_case(const char *name, const AttnProb &p, double tol_o, double tol_g, int limit)
{
    bool bf16 = sizeof(T) == 2;
    printf("%s  [BH %d Tq %d Tk %d D %d, %s, %s, %s tiles]\n", name, p.BH, p.Tq, p.Tk, p.D,
           p.causal ? "causal" : "not causal", bf16 ? "bf16" : "f32",
           limit == MLA_SMALL ? "16x16" : limit == MLA_SM80 ? "sm_80" : "sm_90");
    vd r(p.q.size());
    for (auto &x : r) x = bf16 ? bfr(randn()) : randn();
    int saved = emu::smem_limit;
    if (limit == MLA_SMALL) {
        MlaProb shape{1, p.Tq, p.Tk, 1, p.D, 0, p.D};
        emu::smem_limit = mla_small_tiles_limit(shape, bf16);
    } else if (limit > 0) {
        emu::smem_limit = limit;
    }
    AttnOut got, ref, f32;
    int rc = attn_run_cuda<T>(p, r, got);
    emu::smem_limit = saved;
    if (rc || attn_run_cpu<double>(p, r, ref) || attn_run_cpu<float>(p, r, f32)) {
        n_fail++;
        return;
    }
    check("o vs cpu f64", got.o, ref.o, tol_o);
    // -inf where a query sees no key, on both sides
    vd gl, rl;
    int mism = 0;
    for (size_t i = 0; i < ref.lse.size(); i++) {
        if (std::isinf(ref.lse[i]) || std::isinf(got.lse[i])) {
            mism += !(ref.lse[i] == -INFINITY && got.lse[i] == -INFINITY);
            continue;
        }
        gl.push_back(got.lse[i]);
        rl.push_back(ref.lse[i]);
    }
    if (mism) {
        printf("  %-34s FAIL %d entries differ in being -inf\n", "lse", mism);
        n_fail++;
    } else {
        check("lse vs cpu f64", gl, rl, bf16 ? 1.0 / 256 : 1e-6);
    }
    check("dq vs cpu f64", got.dq, ref.dq, tol_g);
    check("dk vs cpu f64", got.dk, ref.dk, tol_g);
    check("dv vs cpu f64", got.dv, ref.dv, tol_g);
    if (bf16) return;
    // the parity test compares cuda with the cpu's f32 kernel: both within its tolerance (1e-4) of each other
    check("cuda o vs cpu f32", got.o, f32.o, 1e-5);
    check("cuda dq vs cpu f32", got.dq, f32.dq, 1e-4);
    check("cuda dk vs cpu f32", got.dk, f32.dk, 1e-4);
    check("cuda dv vs cpu f32", got.dv, f32.dv, 1e-4);
}

// two runs under different thread orders give bitwise equal results (no atomics)
template <class T> static void run_attn_determinism(const char *name, const AttnProb &p)
{
    printf("%s  [%s]\n", name, sizeof(T) == 2 ? "bf16" : "f32");
    vd r(p.q.size());
    for (auto &x : r) x = randn();
    AttnOut a, b;
    int saved = emu::smem_limit;
    MlaProb shape{1, p.Tq, p.Tk, 1, p.D, 0, p.D};
    emu::smem_limit = mla_small_tiles_limit(shape, sizeof(T) == 2);
    emu::rng.seed(303);
    int rc = attn_run_cuda<T>(p, r, a);
    emu::rng.seed(404);
    rc = rc || attn_run_cuda<T>(p, r, b);
    emu::smem_limit = saved;
    bool same = !rc && a.o == b.o && a.lse == b.lse && a.dq == b.dq && a.dk == b.dk && a.dv == b.dv;
    printf("  %-34s %s\n", "bitwise equal across thread orders", same ? "ok" : "FAIL");
    if (same) n_pass++;
    else n_fail++;
}

static void attn_expect_error(const char *what, int rc, const char *needle)
{
    bool ok = rc != 0 && strstr(err_buf, needle);
    printf("  %-34s %s  (%s)\n", what, ok ? "ok  " : "FAIL", err_buf);
    if (ok) n_pass++;
    else n_fail++;
    err_buf[0] = 0;
}

static void run_attention(const std::function<bool(const char *)> &want)
{
    typedef __nv_bfloat16 bf;
    const double f32o = 1e-5, f32g = 1e-5, bfo = 1.0 / 128, bfg = 1.0 / 64;
    if (want("attnsmall")) {
        // BH 5 over launches of 2 rows (ATTN_ROWS_PER_LAUNCH in harness.cpp): the batch split is exercised
        run_attn_case<float>("attention f32 causal", attn_make(5, 37, 37, 16, 1, false), f32o, f32g, MLA_SMALL);
        run_attn_case<float>("attention f32 not causal, Tq 20 < Tk 45", attn_make(2, 20, 45, 24, 0, false), f32o, f32g, MLA_SMALL);
        run_attn_case<float>("attention f32 causal, Tq 20 < Tk 45", attn_make(2, 20, 45, 24, 1, false), f32o, f32g, MLA_SMALL);
        run_attn_case<float>("attention f32 not causal, Tq 30 > Tk 7", attn_make(2, 30, 7, 16, 0, false), f32o, f32g, MLA_SMALL);
        run_attn_case<float>("attention f32 causal, Tq 9 > Tk 5 (4 see none)", attn_make(2, 9, 5, 16, 1, false), f32o,
                             f32g, 0);
        run_attn_case<bf>("attention bf16 causal (wmma)", attn_make(3, 37, 37, 16, 1, true), bfo, bfg, MLA_SMALL);
        run_attn_case<bf>("attention bf16 not causal, Tq 20 < Tk 45", attn_make(2, 20, 45, 24, 0, true), bfo, bfg, MLA_SMALL);
        run_attn_determinism<bf>("attention determinism", attn_make(3, 21, 21, 16, 1, true));
        printf("attention argument errors\n");
        std::vector<float> x(64, 0.f);
        float *p = x.data();
        attn_expect_error("f64", tide_cuda_attention(TIDE_F64, p, p, p, p, p, 1, 2, 2, 4, 1, 0.5),
                          "attention: f64 is not implemented on the cuda backend");
        attn_expect_error("i32", tide_cuda_attention_backward(TIDE_I32, p, p, p, p, p, p, p, p, p, 1, 2, 2, 4, 1, 0.5),
                          "attention_backward: dtype i32 is not supported");
        attn_expect_error("D 0", tide_cuda_attention(TIDE_F32, p, p, p, p, p, 1, 2, 2, 0, 1, 0.5), "bad sizes");
        int saved = emu::smem_limit;
        emu::smem_limit = 48 * 1024;
        attn_expect_error("D beyond shared memory", tide_cuda_attention(TIDE_F32, p, p, p, p, p, 1, 2, 2, 1024, 1, 0.5),
                          "head dim D 1024 needs");
        emu::smem_limit = saved;
    }
    if (want("attn64")) {
        // GPT-2 small's head dim, default tiles (64 x 64 at sm_90's shared memory)
        run_attn_case<bf>("attention bf16 D 64 causal (wmma)", attn_make(2, 70, 70, 64, 1, true), bfo, bfg, 0);
        run_attn_case<float>("attention f32 D 64 causal", attn_make(1, 70, 70, 64, 1, false), f32o, f32g, 0);
        run_attn_case<bf>("attention bf16 D 64 sm_80 shared memory", attn_make(1, 70, 70, 64, 0, true), bfo, bfg, MLA_SM80);
    }
}

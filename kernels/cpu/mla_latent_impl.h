/*
 * mla_latent_impl.h — MLA attention read from the latent (mla.c includes it after mla_impl.h with T, SFX, EXP and
 * GEMM = cblas_sgemm / cblas_dgemm defined): the keys and values of mla_attention are expanded from the latent ĉ
 * [B, Tk, dc] one chunk of keys at a time, k_n^h = W_UK^h ĉ and v^h = W_UV^h ĉ with W = [W_UK^h ; W_UV^h] [H, dn + dv,
 * dc] (one GEMM per row and chunk), so no [B, Tk, H, dn + dv] tensor exists: a chunk's expansion is scratch.
 *
 * forward: per chunk [k0, k0 + kc) the tiled kernel gives each query's output and log-sum-exp over the chunk's
 * visible keys (query i on key i + Tk − Tq − k0 of the chunk; its document start clipped to the chunk), merged into
 * the running output by the log-sum-exp rule: o = (e^{l1−m} o1 + e^{l2−m} o2) / (e^{l1−m} + e^{l2−m}), l = m +
 * log(e^{l1−m} + e^{l2−m}), m = max(l1, l2). backward (mla.md §4, with the whole row's output and lse): per chunk the
 * expansion again, the tiled backward's gradients of the chunk's keys and values and its share of gq (added in chunk
 * order), then gĉ of the chunk's rows = [gk_n^h | gv^h] W and gW += [gk_n^h | gv^h]ᵀ ĉ (rows, then chunks, in
 * order). The chunk's k_r rows are its gradient's rows.
 */
#define LCAT_(a, b) a##_##b
#define LCAT(a, b) LCAT_(a, b)
#define L(name) LCAT(name, SFX)

typedef struct {
    T *kv, *kn, *v, *kr;    /* one row's expansion [kc, H(dn + dv)]; the chunk's k_n, v, k_r of every row */
    int64_t *srel;          /* per query: b·Tq + its document start in the chunk (clipped to 0) */
} L(lchunk);

static void L(lchunk_free)(L(lchunk) *x)
{
    free(x->kv); free(x->kn); free(x->v); free(x->kr); free(x->srel);
}

static int L(lchunk_alloc)(L(lchunk) *x, int64_t B, int64_t Tq, int64_t Kc, int64_t H, int64_t dn, int64_t dr,
                           int64_t dv)
{
    memset(x, 0, sizeof *x);
    x->kv = malloc((size_t)(Kc * H * (dn + dv)) * sizeof(T));
    x->kn = malloc((size_t)(B * Kc * H * (dn > 0 ? dn : 1)) * sizeof(T));
    x->v = malloc((size_t)(B * Kc * H * dv) * sizeof(T));
    x->kr = dr ? malloc((size_t)(B * Kc * dr) * sizeof(T)) : NULL;
    x->srel = malloc((size_t)(B * Tq > 0 ? B * Tq : 1) * sizeof(int64_t));
    if (!x->kv || !x->kn || !x->v || (dr && !x->kr) || !x->srel) { L(lchunk_free)(x); return -1; }
    return 0;
}

/* the chunk [k0, k0 + kc) of every row: k_n [B, kc, H, dn], v [B, kc, H, dv], k_r [B, kc, dr], and the queries'
   clipped document starts */
static void L(lchunk_fill)(L(lchunk) *x, const T *c, const T *kr, const T *w, const int64_t *start, int64_t B,
                           int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc, int64_t k0,
                           int64_t kc)
{
    int64_t E = H * (dn + dv);
    for (int64_t b = 0; b < B; b++) {
        GEMM(CblasRowMajor, CblasNoTrans, CblasTrans, (int)kc, (int)E, (int)dc, 1, c + (b * Tk + k0) * dc, (int)dc, w,
             (int)dc, 0, x->kv, (int)E);
        for (int64_t jj = 0; jj < kc; jj++)
            for (int64_t h = 0; h < H; h++) {
                const T *src = x->kv + jj * E + h * (dn + dv);
                memcpy(x->kn + ((b * kc + jj) * H + h) * dn, src, (size_t)dn * sizeof(T));
                memcpy(x->v + ((b * kc + jj) * H + h) * dv, src + dn, (size_t)dv * sizeof(T));
            }
        if (dr) memcpy(x->kr + b * kc * dr, kr + (b * Tk + k0) * dr, (size_t)(kc * dr) * sizeof(T));
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < Tq; i++) {
            int64_t s = start ? start[b * Tq + i] - b * Tq - k0 : 0;
            x->srel[b * Tq + i] = b * Tq + (s > 0 ? s : 0);
        }
}

static int L(latent_forward)(T *out, T *lse, const T *q, const T *c, const T *kr, const T *w, const int64_t *start,
                             int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv,
                             int64_t dc, int64_t chunk, double scale)
{
    int64_t Kc = chunk < Tk ? chunk : Tk, n_o = B * Tq * H * dv, n_l = B * H * Tq;
    L(lchunk) x;
    T *oj = malloc((size_t)(n_o > 0 ? n_o : 1) * sizeof(T)), *lj = malloc((size_t)(n_l > 0 ? n_l : 1) * sizeof(T));
    if (!oj || !lj || L(lchunk_alloc)(&x, B, Tq, Kc, H, dn, dr, dv)) {
        free(oj); free(lj);
        return tide_set_error("mla_latent_attention: out of memory for a chunk of %lld keys", (long long)Kc);
    }
    for (int64_t i = 0; i < n_o; i++) out[i] = 0;
    for (int64_t i = 0; i < n_l; i++) lse[i] = (T)-INFINITY;
    int rc = 0;
    for (int64_t k0 = 0; k0 < Tk && !rc; k0 += Kc) {
        int64_t kc = Tk - k0 < Kc ? Tk - k0 : Kc;
        L(lchunk_fill)(&x, c, kr, w, start, B, Tq, Tk, H, dn, dr, dv, dc, k0, kc);
        rc = L(forward)(oj, lj, q, x.kn, x.kr, x.v, x.srel, NULL, B, Tq, kc, H, dn, dr, dv, Tk - Tq - k0, scale);
        if (rc) break;
        _Pragma("omp parallel for")
        for (int64_t t = 0; t < n_l; t++) {
            T l2 = lj[t];
            if (l2 == (T)-INFINITY) continue;
            int64_t b = t / (H * Tq), h = t / Tq % H, i = t % Tq;
            T *o = out + ((b * Tq + i) * H + h) * dv;
            const T *o2 = oj + ((b * Tq + i) * H + h) * dv;
            T l1 = lse[t];
            if (l1 == (T)-INFINITY) {
                for (int64_t e = 0; e < dv; e++) o[e] = o2[e];
                lse[t] = l2;
                continue;
            }
            T m = l1 > l2 ? l1 : l2, a1 = EXP(l1 - m), a2 = EXP(l2 - m), s = a1 + a2;
            T w1 = a1 / s, w2 = a2 / s;
            for (int64_t e = 0; e < dv; e++) o[e] = w1 * o[e] + w2 * o2[e];
            lse[t] = m + (T)log((double)s);
        }
    }
    L(lchunk_free)(&x);
    free(oj); free(lj);
    return rc;
}

static int L(latent_backward)(T *gq, T *gc, T *gkr, T *gw, const T *gout, const T *q, const T *c, const T *kr,
                              const T *w, const T *out, const T *lse, const int64_t *start, int64_t B, int64_t Tq,
                              int64_t Tk, int64_t H, int64_t dn, int64_t dr, int64_t dv, int64_t dc, int64_t chunk,
                              double scale)
{
    int64_t Kc = chunk < Tk ? chunk : Tk, E = H * (dn + dv), dqk = dn + dr, n_q = B * Tq * H * dqk;
    int need_kv = gc || gw;
    L(lchunk) x;
    T *gqj = gq ? malloc((size_t)(n_q > 0 ? n_q : 1) * sizeof(T)) : NULL;
    T *gkn = need_kv ? malloc((size_t)(B * Kc * H * (dn > 0 ? dn : 1)) * sizeof(T)) : NULL;
    T *gv = need_kv ? malloc((size_t)(B * Kc * H * dv) * sizeof(T)) : NULL;
    T *gkv = need_kv ? malloc((size_t)(Kc * E) * sizeof(T)) : NULL;
    T *gkrj = gkr && dr ? malloc((size_t)(B * Kc * dr) * sizeof(T)) : NULL;
    if ((gq && !gqj) || (need_kv && (!gkn || !gv || !gkv)) || (gkr && dr && !gkrj) ||
        L(lchunk_alloc)(&x, B, Tq, Kc, H, dn, dr, dv)) {
        free(gqj); free(gkn); free(gv); free(gkv); free(gkrj);
        return tide_set_error("mla_latent_attention backward: out of memory for a chunk of %lld keys", (long long)Kc);
    }
    if (gq) for (int64_t i = 0; i < n_q; i++) gq[i] = 0;
    if (gw) for (int64_t i = 0; i < E * dc; i++) gw[i] = 0;
    int rc = 0;
    for (int64_t k0 = 0; k0 < Tk && !rc; k0 += Kc) {
        int64_t kc = Tk - k0 < Kc ? Tk - k0 : Kc;
        L(lchunk_fill)(&x, c, kr, w, start, B, Tq, Tk, H, dn, dr, dv, dc, k0, kc);
        rc = L(backward)(gqj, gkn, gkrj, gv, gout, q, x.kn, x.kr, x.v, out, lse, x.srel, NULL, B, Tq, kc, H, dn, dr,
                         dv, Tk - Tq - k0, scale);
        if (rc) break;
        if (gq) {
            _Pragma("omp parallel for")
            for (int64_t i = 0; i < n_q; i++) gq[i] += gqj[i];
        }
        for (int64_t b = 0; b < B && need_kv; b++) {
            for (int64_t jj = 0; jj < kc; jj++)
                for (int64_t h = 0; h < H; h++) {
                    T *dst = gkv + jj * E + h * (dn + dv);
                    memcpy(dst, gkn + ((b * kc + jj) * H + h) * dn, (size_t)dn * sizeof(T));
                    memcpy(dst + dn, gv + ((b * kc + jj) * H + h) * dv, (size_t)dv * sizeof(T));
                }
            if (gc)
                GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)kc, (int)dc, (int)E, 1, gkv, (int)E, w, (int)dc, 0,
                     gc + (b * Tk + k0) * dc, (int)dc);
            if (gw)
                GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)E, (int)dc, (int)kc, 1, gkv, (int)E,
                     c + (b * Tk + k0) * dc, (int)dc, 1, gw, (int)dc);
        }
        if (gkrj)
            for (int64_t b = 0; b < B; b++)
                memcpy(gkr + (b * Tk + k0) * dr, gkrj + b * kc * dr, (size_t)(kc * dr) * sizeof(T));
    }
    L(lchunk_free)(&x);
    free(gqj); free(gkn); free(gv); free(gkv); free(gkrj);
    return rc;
}

#undef L
#undef LCAT
#undef LCAT_

/*
 * test-mla — the tiled MLA attention kernel against the definition (spec/mla.md oracles 3 and 6), at lengths
 * that span many 64 x 64 tiles, with documents whose boundaries fall inside tiles:
 *   1. forward == the plain softmax over the visible keys: float64 <= 1e-12, float32 <= 1e-5 of max|o|
 *      (T = 300 packed, Tq = 37 < Tk = 300, no rope slot; and T = 2048 in float32);
 *   2. backward: the directional derivative along random directions, by central differences in float64,
 *      equals <grad, direction> for q, k_n, k_r and v (rel <= 1e-8);
 *   3. causality: changing tokens after t leaves o_t bitwise unchanged; packing [doc A | doc B] gives doc B
 *      what doc B alone gives (<= 1e-12);
 *   4. mla_decode_rows (one decoding step of rows over their own latent caches): the new latents land at each
 *      row's length and nothing else in the buffers changes; the output equals the softmax attention over the
 *      row's lens + 1 tokens (float64 <= 1e-12, float32 <= 1e-5); each row alone gives its bits in the batch;
 *      with and without the rope slot; bad arguments are named.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "testutil.h"

static int g_fail, g_pass;
#define CHECK(cond, ...) do { if (cond) g_pass++; else { g_fail++; printf("  FAIL "); printf(__VA_ARGS__); printf("\n"); } } while (0)

static tide_tensor *randn(int dtype, int ndim, const int64_t *shape)
{
    tide_tensor *t = tide_randn(dtype, ndim, shape, 0, 0.0, 1.0);
    if (!t) { printf("randn failed: %s\n", tide_last_error()); exit(2); }
    return t;
}

/* doc[b*T + t] = document id of token t of row b from flattened boundaries (NULL: one per row) */
static void docs_of(int64_t *doc, const int64_t *cu, int n_cu, int64_t B, int64_t T)
{
    for (int64_t p = 0; p < B * T; p++) {
        int64_t d = p / T * 1000;
        for (int i = 1; cu && i < n_cu; i++)
            if (p >= cu[i]) d = p / T * 1000 + i;
        doc[p] = d;
    }
}

/* the definition, in double */
static void naive(const double *q, const double *kn, const double *kr, const double *v, int64_t B, int64_t Tq, int64_t Tk,
                  int64_t H, int64_t dn, int64_t dr, int64_t dv, double scale, const int64_t *doc, double *out)
{
    int64_t dqk = dn + dr;
    double *p = malloc((size_t)Tk * sizeof *p);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Tq; i++) {
                double m = -INFINITY, s = 0;
                for (int64_t j = 0; j < Tk; j++) {
                    if (j > i + (Tk - Tq) || (doc && doc[b * Tq + i] != doc[b * Tk + j])) { p[j] = -INFINITY; continue; }
                    double d = 0;
                    for (int64_t c = 0; c < dn; c++) d += q[((b * Tq + i) * H + h) * dqk + c] * kn[((b * Tk + j) * H + h) * dn + c];
                    for (int64_t c = 0; c < dr; c++) d += q[((b * Tq + i) * H + h) * dqk + dn + c] * kr[(b * Tk + j) * dr + c];
                    p[j] = d * scale;
                    m = fmax(m, p[j]);
                }
                for (int64_t j = 0; j < Tk; j++) { p[j] = p[j] == -INFINITY ? 0 : exp(p[j] - m); s += p[j]; }
                for (int64_t c = 0; c < dv; c++) {
                    double o = 0;
                    for (int64_t j = 0; j < Tk; j++) o += p[j] * v[((b * Tk + j) * H + h) * dv + c];
                    out[((b * Tq + i) * H + h) * dv + c] = o / s;
                }
            }
    free(p);
}

typedef struct {
    int64_t B, Tq, Tk, H, dn, dr, dv;
    const int64_t *cu;
    int n_cu;
} shape;

static tide_tensor *cu_tensor(const shape *s)
{
    if (!s->cu) return NULL;
    double v[16];
    for (int i = 0; i < s->n_cu; i++) v[i] = (double)s->cu[i];
    return tide_from_f64(TIDE_I64, 1, (int64_t[]){s->n_cu}, 0, v);
}

static void test_forward(const shape *s, int dtype, const char *what)
{
    tide_tensor *q = randn(TIDE_F64, 4, (int64_t[]){s->B, s->Tq, s->H, s->dn + s->dr});
    tide_tensor *kn = randn(TIDE_F64, 4, (int64_t[]){s->B, s->Tk, s->H, s->dn});
    tide_tensor *kr = s->dr ? randn(TIDE_F64, 3, (int64_t[]){s->B, s->Tk, s->dr}) : NULL;
    tide_tensor *v = randn(TIDE_F64, 4, (int64_t[]){s->B, s->Tk, s->H, s->dv});
    double scale = 1 / sqrt((double)(s->dn + s->dr));
    int64_t *doc = malloc((size_t)(s->B * s->Tq) * sizeof *doc);
    docs_of(doc, s->cu, s->n_cu, s->B, s->Tq);
    double *hq = host(q), *hkn = host(kn), *hkr = kr ? host(kr) : NULL, *hv = host(v);
    int64_t no = s->B * s->Tq * s->H * s->dv;
    double *ref = malloc((size_t)no * sizeof *ref);
    naive(hq, hkn, hkr, hv, s->B, s->Tq, s->Tk, s->H, s->dn, s->dr, s->dv, scale, s->cu ? doc : NULL, ref);
    tide_tensor *in[4] = {q, kn, kr, v};
    if (dtype != TIDE_F64)
        for (int i = 0; i < 4; i++)
            if (in[i]) { tide_tensor *c = tide_to_dtype(in[i], dtype); tide_tensor_release(in[i]); in[i] = c; }
    tide_tensor *cu = cu_tensor(s), *o = tide_mla_attention(in[0], in[1], in[2], in[3], cu, scale);
    double err = 0, mx = 0;
    if (o) {
        double *ho = host(o);
        for (int64_t i = 0; i < no; i++) { err = fmax(err, fabs(ho[i] - ref[i])); mx = fmax(mx, fabs(ref[i])); }
        free(ho);
    }
    double tol = dtype == TIDE_F64 ? 1e-12 : 1e-5 * mx;
    CHECK(o && err <= tol, "%s %s: tiled vs definition %.3g (tol %.3g)%s%s", what, tide_dtype_name(dtype), err, tol,
          o ? "" : ": ", o ? "" : tide_last_error());
    tide_tensor_release(o); tide_tensor_release(cu);
    for (int i = 0; i < 4; i++) tide_tensor_release(in[i]);
    free(doc); free(hq); free(hkn); free(hkr); free(hv); free(ref);
}

/* sum(o ⊙ r) for the current inputs */
static double loss_of(tide_tensor **in, tide_tensor *cu, double scale, const double *r)
{
    tide_tensor *o = tide_mla_attention(in[0], in[1], in[2], in[3], cu, scale);
    double *ho = host(o), L = 0;
    for (int64_t i = 0; i < o->numel; i++) L += ho[i] * r[i];
    free(ho);
    tide_tensor_release(o);
    return L;
}

static void test_backward(const shape *s, const char *what)
{
    int64_t shp[4][4] = {{s->B, s->Tq, s->H, s->dn + s->dr}, {s->B, s->Tk, s->H, s->dn}, {s->B, s->Tk, s->dr, 0},
                         {s->B, s->Tk, s->H, s->dv}};
    int nd[4] = {4, 4, 3, 4};
    const char *names[4] = {"q", "k_n", "k_r", "v"};
    tide_tensor *in[4];
    for (int i = 0; i < 4; i++) {
        in[i] = randn(TIDE_F64, nd[i], shp[i]);
        tide_set_requires_grad(in[i], 1);
    }
    double scale = 1 / sqrt((double)(s->dn + s->dr));
    tide_tensor *cu = cu_tensor(s);
    tide_tensor *o = tide_mla_attention(in[0], in[1], in[2], in[3], cu, scale);
    tide_tensor *r = randn(TIDE_F64, 4, o->shape);
    double *hr = host(r);
    tide_tensor *p = tide_mul(o, r), *L = tide_sum(p, 0, NULL, 0);
    int rc = tide_backward(L, NULL);
    tide_tensor_release(p); tide_tensor_release(L); tide_tensor_release(o); tide_tensor_release(r);
    CHECK(rc == 0, "%s: backward failed: %s", what, tide_last_error());
    int prev = tide_set_grad_enabled(0);
    for (int i = 0; i < 4 && rc == 0; i++) {
        double *x = host(in[i]), *g = host(in[i]->grad), worst = 0;
        int64_t n = in[i]->numel;
        for (int trial = 0; trial < 3; trial++) {
            tide_tensor *dt = randn(TIDE_F64, in[i]->ndim, in[i]->shape);
            double *d = host(dt), ana = 0, f[2];
            tide_tensor_release(dt);
            for (int64_t e = 0; e < n; e++) ana += g[e] * d[e];
            double *xp = malloc((size_t)n * sizeof *xp);
            for (int sgn = 0; sgn < 2; sgn++) {
                for (int64_t e = 0; e < n; e++) xp[e] = x[e] + (sgn ? -1e-6 : 1e-6) * d[e];
                tide_write_bytes(in[i], xp, (size_t)n * 8);
                f[sgn] = loss_of(in, cu, scale, hr);
            }
            tide_write_bytes(in[i], x, (size_t)n * 8);
            double num = (f[0] - f[1]) / 2e-6;
            worst = fmax(worst, fabs(num - ana) / (fabs(ana) + 1e-3));
            free(d); free(xp);
        }
        CHECK(worst <= 1e-7, "%s: d/d%s along random directions: relative error %.3g", what, names[i], worst);
        free(x); free(g);
    }
    tide_set_grad_enabled(prev);
    free(hr);
    tide_tensor_release(cu);
    for (int i = 0; i < 4; i++) tide_tensor_release(in[i]);
}

static void test_causality_and_packing(void)
{
    int64_t B = 1, T = 200, H = 2, dn = 8, dr = 4, dv = 6, t = 130;
    tide_tensor *q = randn(TIDE_F32, 4, (int64_t[]){B, T, H, dn + dr}), *kn = randn(TIDE_F32, 4, (int64_t[]){B, T, H, dn});
    tide_tensor *kr = randn(TIDE_F32, 3, (int64_t[]){B, T, dr}), *v = randn(TIDE_F32, 4, (int64_t[]){B, T, H, dv});
    tide_tensor *o1 = tide_mla_attention(q, kn, kr, v, NULL, 0.3);
    /* change every input after t */
    tide_tensor *in[4] = {q, kn, kr, v};
    for (int i = 0; i < 4; i++) {
        double *x = host(in[i]);
        int64_t per = in[i]->numel / T;
        float *xf = malloc((size_t)in[i]->numel * sizeof *xf);
        for (int64_t e = 0; e < in[i]->numel; e++) xf[e] = (float)(e >= (t + 1) * per ? x[e] * -3 + 1 : x[e]);
        tide_write_bytes(in[i], xf, (size_t)in[i]->numel * sizeof *xf);
        free(x); free(xf);
    }
    tide_tensor *o2 = tide_mla_attention(q, kn, kr, v, NULL, 0.3);
    double *a = host(o1), *b = host(o2);
    int same = 1;
    for (int64_t e = 0; e < (t + 1) * H * dv; e++) same &= a[e] == b[e];
    CHECK(same, "causality: outputs up to t = %lld changed when later tokens did", (long long)t);
    free(a); free(b);
    tide_tensor_release(o1); tide_tensor_release(o2);
    /* packed [A (0..77) | B (77..200)] vs B alone */
    tide_tensor *cu = tide_from_f64(TIDE_I64, 1, (int64_t[]){3}, 0, (double[]){0, 77, 200});
    tide_tensor *qd = tide_to_dtype(q, TIDE_F64), *knd = tide_to_dtype(kn, TIDE_F64), *krd = tide_to_dtype(kr, TIDE_F64);
    tide_tensor *vd = tide_to_dtype(v, TIDE_F64);
    tide_tensor *op = tide_mla_attention(qd, knd, krd, vd, cu, 0.3);
    tide_tensor *qb = tide_slice(qd, 1, 77, 200, 1), *knb = tide_slice(knd, 1, 77, 200, 1), *krb = tide_slice(krd, 1, 77, 200, 1);
    tide_tensor *vb = tide_slice(vd, 1, 77, 200, 1), *ob = tide_mla_attention(qb, knb, krb, vb, NULL, 0.3);
    double *hp = host(op), *hb = host(ob), err = 0;
    for (int64_t e = 0; e < ob->numel; e++) err = fmax(err, fabs(hp[77 * H * dv + e] - hb[e]));
    CHECK(err <= 1e-12, "packing: doc B inside the packed row vs alone: %.3g", err);
    free(hp); free(hb);
    tide_tensor *all[] = {cu, qd, knd, krd, vd, op, qb, knb, krb, vb, ob, q, kn, kr, v};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
}

/* ---- 4. mla_decode_rows ------------------------------------------------------------------------------------- */

static tide_tensor *clone(const tide_tensor *x)
{
    tide_tensor *y = tide_empty(x->dtype, x->ndim, x->shape, x->device);
    if (!y || tide_copy_(y, x)) { printf("clone failed: %s\n", tide_last_error()); exit(2); }
    return y;
}

static tide_tensor *decode_rows_run(int R, tide_tensor *qt, tide_tensor *qr, tide_tensor *cn, tide_tensor *kn,
                                    tide_tensor **cb, tide_tensor **kb, const int64_t *lens)
{
    return tide_mla_decode_rows(qt, qr, cn, kn, R, cb, qr ? kb : NULL, lens, 0.37);
}

static void test_decode_rows(int dtype, int64_t dr, int64_t H, const char *what)
{
    enum { R = 3, DC = 40 };   /* one full block of 32 latent dims and a partial one */
    const int64_t lens[R] = {5, 0, 37}, caps[R] = {8, 1 + 1, 40};
    tide_tensor *qt = randn(dtype, 3, (int64_t[]){R, H, DC}), *cn = randn(dtype, 3, (int64_t[]){R, 1, DC});
    tide_tensor *qr = dr ? randn(dtype, 3, (int64_t[]){R, H, dr}) : NULL, *kn = dr ? randn(dtype, 3, (int64_t[]){R, 1, dr}) : NULL;
    tide_tensor *cb[R], *kb[R], *cb1[R], *kb1[R];
    double *c0[R], *k0[R];
    for (int r = 0; r < R; r++) {
        cb[r] = randn(dtype, 3, (int64_t[]){1, caps[r], DC});
        cb1[r] = clone(cb[r]);
        c0[r] = host(cb[r]);
        kb[r] = kb1[r] = NULL;
        k0[r] = NULL;
        if (dr) { kb[r] = randn(dtype, 3, (int64_t[]){1, caps[r], dr}); kb1[r] = clone(kb[r]); k0[r] = host(kb[r]); }
    }
    tide_tensor *o = decode_rows_run(R, qt, qr, cn, kn, cb, kb, lens);
    CHECK(o && o->ndim == 3 && o->shape[0] == R && o->shape[1] == H && o->shape[2] == DC, "%s: out [R, H, dc] (%s)", what,
          o ? "ok" : tide_last_error());
    if (!o) return;
    double *hq = host(qt), *hc = host(cn), *hr = dr ? host(qr) : NULL, *hk = dr ? host(kn) : NULL, *ho = host(o);
    double err = 0, scale_o = 0, moved = 0;
    for (int r = 0; r < R; r++) {
        double *c1 = host(cb[r]), *k1 = dr ? host(kb[r]) : NULL;
        /* the buffers: the new token at lens[r], the rest as it was */
        for (int64_t t = 0; t < caps[r]; t++)
            for (int64_t j = 0; j < DC; j++) {
                double want = t == lens[r] ? hc[r * DC + j] : c0[r][t * DC + j];
                moved = fmax(moved, fabs(c1[t * DC + j] - want));
            }
        for (int64_t t = 0; dr && t < caps[r]; t++)
            for (int64_t j = 0; j < dr; j++) {
                double want = t == lens[r] ? hk[r * dr + j] : k0[r][t * dr + j];
                moved = fmax(moved, fabs(k1[t * dr + j] - want));
            }
        /* the definition over the lens + 1 tokens */
        int64_t L = lens[r] + 1;
        for (int h = 0; h < H; h++) {
            double *s = malloc((size_t)L * sizeof *s), m = -INFINITY, z = 0;
            for (int64_t t = 0; t < L; t++) {
                double v = 0;
                for (int64_t j = 0; j < DC; j++) v += hq[(r * H + h) * DC + j] * c1[t * DC + j];
                for (int64_t j = 0; j < dr; j++) v += hr[(r * H + h) * dr + j] * k1[t * dr + j];
                s[t] = 0.37 * v;
                m = fmax(m, s[t]);
            }
            for (int64_t t = 0; t < L; t++) z += exp(s[t] - m);
            for (int64_t j = 0; j < DC; j++) {
                double w = 0;
                for (int64_t t = 0; t < L; t++) w += exp(s[t] - m) / z * c1[t * DC + j];
                err = fmax(err, fabs(ho[(r * H + h) * DC + j] - w));
                scale_o = fmax(scale_o, fabs(w));
            }
            free(s);
        }
        free(c1); free(k1);
    }
    CHECK(moved == 0, "%s: the new latents land at each row's length, nothing else moves (max change %.3g)", what, moved);
    double tol = dtype == TIDE_F64 ? 1e-12 : 1e-5 * fmax(1, scale_o);
    CHECK(err <= tol, "%s: out vs the softmax attention over lens + 1 tokens: %.3g (tol %.3g)", what, err, tol);
    /* each row alone: its bits in the batch */
    int same = 1;
    for (int r = 0; r < R; r++) {
        tide_tensor *q1 = tide_slice(qt, 0, r, r + 1, 1), *c1 = tide_slice(cn, 0, r, r + 1, 1);
        tide_tensor *r1 = dr ? tide_slice(qr, 0, r, r + 1, 1) : NULL, *k1 = dr ? tide_slice(kn, 0, r, r + 1, 1) : NULL;
        tide_tensor *o1 = decode_rows_run(1, q1, r1, c1, k1, &cb1[r], &kb1[r], &lens[r]);
        double *h1 = o1 ? host(o1) : NULL;
        for (int64_t i = 0; h1 && i < H * DC; i++) same = same && h1[i] == ho[r * H * DC + i];
        if (!o1) same = 0;
        free(h1);
        tide_tensor_release(q1); tide_tensor_release(c1); tide_tensor_release(r1); tide_tensor_release(k1);
        tide_tensor_release(o1);
    }
    CHECK(same, "%s: each row alone gives its bits in the batch", what);
    /* bad arguments */
    const int64_t full[R] = {8, 0, 37};
    tide_tensor *bad = decode_rows_run(R, qt, qr, cn, kn, cb, kb, full);
    CHECK(!bad && strstr(tide_last_error(), "no room for one more"), "%s: a full buffer is named: %s", what, tide_last_error());
    bad = tide_mla_decode_rows(qt, qr, qt, kn, R, cb, dr ? kb : NULL, lens, 0.37);
    CHECK(!bad && strstr(tide_last_error(), "c_new is"), "%s: a wrong c_new shape is named: %s", what, tide_last_error());
    if (dr) {
        bad = tide_mla_decode_rows(qt, qr, cn, NULL, R, cb, kb, lens, 0.37);
        CHECK(!bad && strstr(tide_last_error(), "go together"), "%s: qr without kr_new is named: %s", what, tide_last_error());
    }
    free(hq); free(hc); free(hr); free(hk); free(ho);
    for (int r = 0; r < R; r++) {
        free(c0[r]); free(k0[r]);
        tide_tensor_release(cb[r]); tide_tensor_release(cb1[r]); tide_tensor_release(kb[r]); tide_tensor_release(kb1[r]);
    }
    tide_tensor_release(qt); tide_tensor_release(cn); tide_tensor_release(qr); tide_tensor_release(kn); tide_tensor_release(o);
}

/* the appended form (c_new NULL): T queries of one sequence share its buffer, which holds their latents already;
   query t attends over the first L0 + t + 1 tokens, bitwise what T one-token steps with fresh appends give */
static void test_decode_rows_appended(int dtype, int64_t dr, int T, int64_t H, int64_t L0, const char *what)
{
    enum { DC = 40, TMAX = 16 };
    const int64_t CAP = L0 + T + 2;
    tide_tensor *qt = randn(dtype, 3, (int64_t[]){T, H, DC}), *qr = dr ? randn(dtype, 3, (int64_t[]){T, H, dr}) : NULL;
    tide_tensor *buf = randn(dtype, 3, (int64_t[]){1, CAP, DC}), *kbuf = dr ? randn(dtype, 3, (int64_t[]){1, CAP, dr}) : NULL;
    tide_tensor *step_c = clone(buf), *step_k = dr ? clone(kbuf) : NULL;
    double *before = host(buf);
    tide_tensor *cb[TMAX], *kb[TMAX];
    int64_t lens[TMAX];
    if (T > TMAX) { printf("FAIL %s: T %d > %d\n", what, T, (int)TMAX); g_fail++; return; }
    for (int t = 0; t < T; t++) { cb[t] = buf; kb[t] = kbuf; lens[t] = L0 + t; }
    tide_tensor *o = tide_mla_decode_rows(qt, qr, NULL, NULL, T, cb, dr ? kb : NULL, lens, 0.37);
    CHECK(o != NULL, "%s: runs (%s)", what, o ? "ok" : tide_last_error());
    if (!o) return;
    double *ho = host(o), *after = host(buf);
    double moved = 0;
    for (int64_t i = 0; i < CAP * DC; i++) moved = fmax(moved, fabs(after[i] - before[i]));
    CHECK(moved == 0, "%s: nothing is written (max change %.3g)", what, moved);
    /* the same tokens as T steps that each append their own latent (taken from the filled buffer) */
    int same = 1;
    for (int t = 0; t < T; t++) {
        tide_tensor *q1 = tide_slice(qt, 0, t, t + 1, 1), *r1 = dr ? tide_slice(qr, 0, t, t + 1, 1) : NULL;
        tide_tensor *cs = tide_slice(buf, 1, L0 + t, L0 + t + 1, 1), *ks = dr ? tide_slice(kbuf, 1, L0 + t, L0 + t + 1, 1) : NULL;
        tide_tensor *c1 = clone(cs), *k1 = dr ? clone(ks) : NULL;
        tide_tensor_release(cs); tide_tensor_release(ks);
        int64_t len = L0 + t;
        tide_tensor *o1 = tide_mla_decode_rows(q1, r1, c1, k1, 1, &step_c, dr ? &step_k : NULL, &len, 0.37);
        double *h1 = o1 ? host(o1) : NULL;
        for (int64_t i = 0; h1 && i < H * DC; i++) same = same && h1[i] == ho[t * H * DC + i];
        if (!o1) same = 0;
        free(h1);
        tide_tensor_release(q1); tide_tensor_release(r1); tide_tensor_release(c1); tide_tensor_release(k1);
        tide_tensor_release(o1);
    }
    CHECK(same, "%s: the T queries over the shared buffer == T one-token steps, bitwise", what);
    if (dr) {
        tide_tensor *kn = randn(dtype, 3, (int64_t[]){T, 1, dr});
        tide_tensor *bad = tide_mla_decode_rows(qt, qr, NULL, kn, T, cb, kb, lens, 0.37);
        CHECK(!bad && strstr(tide_last_error(), "kr_new must be NULL"), "%s: kr_new without c_new is named: %s", what,
              tide_last_error());
        tide_tensor_release(kn);
    }
    free(ho); free(after); free(before);
    tide_tensor_release(qt); tide_tensor_release(qr); tide_tensor_release(buf); tide_tensor_release(kbuf);
    tide_tensor_release(step_c); tide_tensor_release(step_k); tide_tensor_release(o);
}

int main(void)
{
    tide_manual_seed(11);
    static const int64_t cu300[5] = {0, 70, 200, 300, 600};   /* B = 2, T = 300: boundaries inside tiles */
    shape packed = {2, 300, 300, 2, 8, 4, 6, cu300, 5};
    shape decode = {2, 37, 300, 3, 8, 4, 5, NULL, 0};
    shape norope = {1, 150, 150, 2, 6, 0, 4, NULL, 0};
    shape longf32 = {1, 2048, 2048, 1, 16, 8, 16, NULL, 0};
    test_forward(&packed, TIDE_F64, "T 300 packed");
    test_forward(&packed, TIDE_F32, "T 300 packed");
    test_forward(&decode, TIDE_F64, "Tq 37 < Tk 300");
    test_forward(&norope, TIDE_F64, "no rope slot");
    test_forward(&longf32, TIDE_F32, "T 2048");
    shape bpacked = {2, 150, 150, 2, 4, 2, 3, (const int64_t[]){0, 70, 150, 220, 300}, 5};
    shape bdecode = {1, 20, 140, 2, 4, 2, 3, NULL, 0};
    test_backward(&bpacked, "backward, T 150 packed");
    test_backward(&bdecode, "backward, Tq 20 < Tk 140");
    test_causality_and_packing();
    test_decode_rows(TIDE_F64, 3, 2, "decode_rows f64");
    test_decode_rows(TIDE_F32, 3, 2, "decode_rows f32");
    test_decode_rows(TIDE_F64, 0, 2, "decode_rows f64, no rope slot");
    /* dc and dr multiples of 8: the paired-head paths; 3 heads a pair and a single one, 5 heads a group of 4 and one */
    test_decode_rows(TIDE_F32, 16, 2, "decode_rows f32, 8-aligned, 2 heads");
    test_decode_rows(TIDE_F32, 16, 3, "decode_rows f32, 8-aligned, 3 heads");
    test_decode_rows(TIDE_F32, 8, 5, "decode_rows f32, 8-aligned, 5 heads");
    test_decode_rows_appended(TIDE_F32, 3, 5, 2, 6, "decode_rows appended f32");
    test_decode_rows_appended(TIDE_F64, 0, 5, 2, 6, "decode_rows appended f64, no rope slot");
    test_decode_rows_appended(TIDE_F32, 8, 5, 2, 6, "decode_rows appended f32, dc and dr multiples of 8");
    /* consecutive queries over one buffer run in pairs on the packed float path: pairs whose shorter row ends on a
       block (40 tokens), one short of a block (39: the longer row has one more full block) and inside one, a last
       single query, a head pair with a single head (3 heads) and a group of four with a group of one (5) */
    test_decode_rows_appended(TIDE_F32, 8, 9, 2, 37, "decode_rows appended f32, query pairs, 2 heads");
    test_decode_rows_appended(TIDE_F32, 16, 7, 3, 38, "decode_rows appended f32, query pairs, 3 heads");
    test_decode_rows_appended(TIDE_F32, 8, 6, 5, 21, "decode_rows appended f32, query pairs, 5 heads");
    if (tide_graph_live_nodes() != 0) { printf("FAIL %lld graph nodes leaked\n", (long long)tide_graph_live_nodes()); g_fail++; }
    if (tide_live_tensors() != 0) { printf("FAIL %lld tensors leaked\n", (long long)tide_live_tensors()); g_fail++; }
    printf("\n%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

/*
 * test-kda — the oracles of spec/kda.md for the CPU kernels and the kda op:
 *   1. the chunk form (C = 1, 4, 16, 64; ragged last chunk, packed documents, S₀ != 0) equals the token
 *      recurrence in float64 to 1e-12, forward and backward; the per-pair (safe) chunk form too;
 *      float32 chunk vs float64 to 1e-5 (relative to max|O|) at T = 4096, dk = dv = 64;
 *      the backward from the forward's state checkpoints equals the one that recomputes them (bitwise);
 *      the float32 chunk backward at dk = dv = 64 (whole-vector rows: the shuffle transposes, the streaming
 *      stores of the gradients) within 2e-5 of the float64 recurrence's gradients, relative to each one's
 *      largest value, and bitwise the same whether the outputs are 64-byte aligned or not;
 *   2. the nilpotent-product inverse equals forward substitution, and (I + A)⁻¹ ∈ [−1, 1] (2,000 chunks);
 *   3. decode == prefill, split sequences with the state carried == one pass, packed == separate;
 *   4. causality: inputs at positions >= P change nothing at positions < P, outputs or gradients,
 *      also with P inside the ragged last chunk (exact equality);
 *   5. the bound: the unbounded gate through the factorised dense path overflows (shown), the op refuses
 *      it, the safe path handles it; with g = lb = −5 everywhere the float32 dense path matches float64;
 *   6. extreme gate pre-activations (±1e4, A_log ±5) give finite values forward and backward;
 *   7. with g = 0, β = 1 and orthonormal keys, reading k_i returns v_i;
 *   8. the causal conv's forward and backward (each thread a range of channels) give the same bits on 1, 2 and 3
 *      threads, with documents, a cache, SiLU or not, f32 and f64.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"
#include "../../kernels/cpu/cpu.h"
#include "testutil.h"

static int g_fail, g_pass;
#define CHECK(cond, ...) do { if (cond) g_pass++; else { g_fail++; printf("  FAIL "); printf(__VA_ARGS__); printf("\n"); } } while (0)

/* ---- deterministic inputs ------------------------------------------------------------------------ */
static uint64_t g_rng = 0x243F6A8885A308D3ull;
static double urand(void)
{
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}
static double nrand(void)
{
    double u = urand(), v = urand();
    return sqrt(-2 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

typedef struct {
    int64_t B, T, H, dk, dv;
    double *q, *k, *v, *g, *beta, *s0;
} problem;

static double sigmoid(double x) { return 1 / (1 + exp(-x)); }

/* q, k L2-normalised per head (q scaled by dk^-1/2), g from the lower-bounded gate with lb = −5 */
static problem make(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, double gate_scale)
{
    problem p = {B, T, H, dk, dv, 0, 0, 0, 0, 0, 0};
    int64_t N = B * T * H;
    p.q = malloc((size_t)(N * dk) * 8); p.k = malloc((size_t)(N * dk) * 8); p.g = malloc((size_t)(N * dk) * 8);
    p.v = malloc((size_t)(N * dv) * 8); p.beta = malloc((size_t)N * 8); p.s0 = malloc((size_t)(B * H * dk * dv) * 8);
    for (int64_t r = 0; r < N; r++) {
        double nq = 0, nk = 0;
        for (int64_t i = 0; i < dk; i++) {
            p.q[r * dk + i] = nrand(); p.k[r * dk + i] = nrand();
            nq += p.q[r * dk + i] * p.q[r * dk + i]; nk += p.k[r * dk + i] * p.k[r * dk + i];
            p.g[r * dk + i] = -5 * sigmoid(gate_scale * nrand());
        }
        for (int64_t i = 0; i < dk; i++) { p.q[r * dk + i] /= sqrt(nq * dk); p.k[r * dk + i] /= sqrt(nk); }
        for (int64_t j = 0; j < dv; j++) p.v[r * dv + j] = nrand();
        p.beta[r] = urand();
    }
    for (int64_t i = 0; i < B * H * dk * dv; i++) p.s0[i] = 0.5 * nrand();
    return p;
}
static void drop(problem *p) { free(p->q); free(p->k); free(p->v); free(p->g); free(p->beta); free(p->s0); }

static float *to32(const double *x, int64_t n)
{
    float *y = malloc((size_t)n * sizeof *y);
    for (int64_t i = 0; i < n; i++) y[i] = (float)x[i];
    return y;
}

/* boundaries: row starts plus the given interior points (flattened, sorted, without 0 and B·T) */
static int64_t make_cu(int64_t *cu, int64_t B, int64_t T, const int64_t *inner, int n_inner)
{
    int64_t n = 0;
    cu[n++] = 0;
    for (int64_t b = 0; b < B; b++) {
        for (int i = 0; i < n_inner; i++)
            if (inner[i] > b * T && inner[i] < (b + 1) * T) cu[n++] = inner[i];
        cu[n++] = (b + 1) * T;
    }
    return n - 1;
}

/* forward (+ backward when gout) of the f64 kernel; grads: gq, gk, gv, gg, gbeta, gs0 */
typedef struct { double *o, *s, *gq, *gk, *gv, *gg, *gb, *gs0; } result;

static result run64(const problem *p, const int64_t *cu, int64_t n_seg, int path, int64_t C, const double *gout,
                    const double *gs_out)
{
    int64_t N = p->B * p->T * p->H, SZ = p->B * p->H * p->dk * p->dv;
    result r = {0};
    r.o = calloc((size_t)(N * p->dv), 8); r.s = calloc((size_t)SZ, 8);
    if (tide_cpu_kda(TIDE_F64, r.o, r.s, p->q, p->k, p->v, p->g, p->beta, p->s0, cu, n_seg, p->B, p->T, p->H, p->dk, p->dv,
                     path, C, -5.0, NULL)) { printf("  kda failed: %s\n", tide_last_error()); exit(2); }
    if (gout) {
        r.gq = calloc((size_t)(N * p->dk), 8); r.gk = calloc((size_t)(N * p->dk), 8); r.gg = calloc((size_t)(N * p->dk), 8);
        r.gv = calloc((size_t)(N * p->dv), 8); r.gb = calloc((size_t)N, 8); r.gs0 = calloc((size_t)SZ, 8);
        if (tide_cpu_kda_backward(TIDE_F64, r.gq, r.gk, r.gv, r.gg, r.gb, r.gs0, gout, gs_out, p->q, p->k, p->v, p->g, p->beta,
                                  p->s0, cu, n_seg, p->B, p->T, p->H, p->dk, p->dv, path, C, -5.0, NULL)) {
            printf("  kda backward failed: %s\n", tide_last_error());
            exit(2);
        }
    }
    return r;
}
static void drop_result(result *r)
{
    free(r->o); free(r->s); free(r->gq); free(r->gk); free(r->gv); free(r->gg); free(r->gb); free(r->gs0);
}

static double *randn_vec(int64_t n)
{
    double *x = malloc((size_t)n * 8);
    for (int64_t i = 0; i < n; i++) x[i] = nrand();
    return x;
}

/* ---- 1. chunk == recurrent ------------------------------------------------------------------------ */
static void test_chunk_equals_recurrent(void)
{
    problem p = make(2, 37, 2, 8, 6, 1.5);
    int64_t cu[16], inner[2] = {11, 37 + 20};
    int64_t n_seg = make_cu(cu, p.B, p.T, inner, 2);
    int64_t N = p.B * p.T * p.H;
    double *gout = randn_vec(N * p.dv), *gs = randn_vec(p.B * p.H * p.dk * p.dv);
    result ref = run64(&p, cu, n_seg, TIDE_KDA_RECURRENT, 0, gout, gs);
    int64_t Cs[4] = {1, 4, 16, 64};
    for (int path = TIDE_KDA_CHUNK; path <= TIDE_KDA_CHUNK_SAFE; path++)
        for (int c = 0; c < 4; c++) {
            result r = run64(&p, cu, n_seg, path, Cs[c], gout, gs);
            double eo = max_abs_diff(r.o, ref.o, N * p.dv), es = max_abs_diff(r.s, ref.s, p.B * p.H * p.dk * p.dv);
            double eg = fmax(fmax(max_abs_diff(r.gq, ref.gq, N * p.dk), max_abs_diff(r.gk, ref.gk, N * p.dk)),
                             fmax(max_abs_diff(r.gv, ref.gv, N * p.dv), max_abs_diff(r.gg, ref.gg, N * p.dk)));
            eg = fmax(eg, fmax(max_abs_diff(r.gb, ref.gb, N), max_abs_diff(r.gs0, ref.gs0, p.B * p.H * p.dk * p.dv)));
            CHECK(eo <= 1e-12 && es <= 1e-12, "%s C=%lld: |dO| %.3g |dS| %.3g vs the recurrence (want <= 1e-12)",
                  path == TIDE_KDA_CHUNK ? "chunk" : "chunk_safe", (long long)Cs[c], eo, es);
            CHECK(eg <= 1e-11, "%s C=%lld: gradients differ from the recurrence's by %.3g (want <= 1e-11)",
                  path == TIDE_KDA_CHUNK ? "chunk" : "chunk_safe", (long long)Cs[c], eg);
            drop_result(&r);
        }
    drop_result(&ref);
    free(gout); free(gs); drop(&p);
}

static void test_f32_vs_f64(void)
{
    problem p = make(1, 4096, 2, 64, 64, 1.5);
    int64_t cu[2] = {0, p.T}, N = p.T * p.H;
    result ref = run64(&p, cu, 1, TIDE_KDA_RECURRENT, 0, NULL, NULL);
    float *q = to32(p.q, N * 64), *k = to32(p.k, N * 64), *v = to32(p.v, N * 64), *g = to32(p.g, N * 64), *b = to32(p.beta, N);
    float *s0 = to32(p.s0, 2 * 64 * 64), *o = malloc((size_t)(N * 64) * 4), *s = malloc(2 * 64 * 64 * 4);
    int rc = tide_cpu_kda(TIDE_F32, o, s, q, k, v, g, b, s0, cu, 1, 1, p.T, 2, 64, 64, TIDE_KDA_CHUNK, 16, -5.0, NULL);
    double scale = 0, err = 0;
    for (int64_t i = 0; i < N * 64; i++) { scale = fmax(scale, fabs(ref.o[i])); err = fmax(err, fabs(o[i] - ref.o[i])); }
    CHECK(rc == 0 && err <= 1e-5 * scale, "f32 chunk vs f64 at T 4096: max error %.3g, 1e-5·max|O| = %.3g", err, 1e-5 * scale);
    free(q); free(k); free(v); free(g); free(b); free(s0); free(o); free(s);
    drop_result(&ref); drop(&p);
}

/* the float32 chunk backward where every row is whole vectors (dk = dv = 64): ragged last chunk, two documents,
   several recompute blocks; gradients against the float64 recurrence. Written once into 64-byte aligned
   buffers (the streaming-store path) and once into buffers one float off (plain stores): the same bits. */
static void test_f32_backward(void)
{
    problem p = make(1, 600, 2, 64, 64, 1.5);
    int64_t cu[4], inner[1] = {263};
    int64_t n_seg = make_cu(cu, p.B, p.T, inner, 1), N = p.T * p.H, SZ = p.H * 64 * 64;
    double *gout = randn_vec(N * 64), *gs = randn_vec(SZ);
    result ref = run64(&p, cu, n_seg, TIDE_KDA_RECURRENT, 0, gout, gs);
    float *q = to32(p.q, N * 64), *k = to32(p.k, N * 64), *v = to32(p.v, N * 64), *g = to32(p.g, N * 64);
    float *b = to32(p.beta, N), *s0 = to32(p.s0, SZ), *go = to32(gout, N * 64), *gso = to32(gs, SZ);
    int64_t sizes[6] = {N * 64, N * 64, N * 64, N * 64, N, SZ};
    const double *want[6] = {ref.gq, ref.gk, ref.gv, ref.gg, ref.gb, ref.gs0};
    const char *names[6] = {"gq", "gk", "gv", "gg", "gbeta", "gs0"};
    float *buf[2][6], *out[2][6];
    int rc = 0;
    for (int a = 0; a < 2; a++)
        for (int i = 0; i < 6; i++) {
            buf[a][i] = aligned_alloc(64, (size_t)((sizes[i] + 16 + 15) / 16 * 16) * 4);
            out[a][i] = buf[a][i] + a;     /* a = 1: one float past the alignment */
        }
    for (int a = 0; a < 2; a++)
        rc = rc || tide_cpu_kda_backward(TIDE_F32, out[a][0], out[a][1], out[a][2], out[a][3], out[a][4], out[a][5], go,
                                         gso, q, k, v, g, b, s0, cu, n_seg, 1, p.T, p.H, 64, 64, TIDE_KDA_CHUNK, 16,
                                         -5.0, NULL);
    CHECK(rc == 0, "f32 chunk backward failed: %s", tide_last_error());
    for (int i = 0; i < 6 && rc == 0; i++) {
        double scale = 0, err = 0;
        for (int64_t x = 0; x < sizes[i]; x++) {
            scale = fmax(scale, fabs(want[i][x]));
            err = fmax(err, fabs(out[0][i][x] - want[i][x]));
        }
        CHECK(err <= 2e-5 * scale, "f32 chunk backward %s vs the f64 recurrence: max error %.3g, 2e-5·max = %.3g", names[i],
              err, 2e-5 * scale);
        CHECK(!memcmp(out[0][i], out[1][i], (size_t)sizes[i] * 4), "f32 chunk backward %s: aligned and unaligned "
              "outputs differ", names[i]);
    }
    for (int a = 0; a < 2; a++)
        for (int i = 0; i < 6; i++) free(buf[a][i]);
    free(q); free(k); free(v); free(g); free(b); free(s0); free(go); free(gso); free(gout); free(gs);
    drop_result(&ref); drop(&p);
}

/* the backward reading the forward's state checkpoints equals the backward recomputing them, bitwise:
   several recompute blocks per segment (T = 600, C = 16, 16 chunks per checkpoint), packed documents */
static void test_checkpoints(void)
{
    problem p = make(2, 600, 2, 8, 6, 1.5);
    int64_t cu[8], inner[2] = {270, 600 + 333};
    int64_t n_seg = make_cu(cu, p.B, p.T, inner, 2), C = 16, KB = TIDE_KDA_CPU_CKPT_CHUNKS;
    int64_t N = p.B * p.T * p.H, SZ = p.dk * p.dv, n_ck = 0;
    for (int64_t sg = 0; sg < n_seg; sg++) n_ck += ((cu[sg + 1] - cu[sg] + C - 1) / C + KB - 1) / KB;
    double *gout = randn_vec(N * p.dv), *gs = randn_vec(p.B * p.H * SZ), *ck = malloc((size_t)(n_ck * p.H * SZ) * 8);
    result a = run64(&p, cu, n_seg, TIDE_KDA_CHUNK, C, gout, gs);
    double *o = malloc((size_t)(N * p.dv) * 8), *s = malloc((size_t)(p.B * p.H * SZ) * 8);
    double *g[6];
    int64_t sizes[6] = {N * p.dk, N * p.dk, N * p.dv, N * p.dk, N, p.B * p.H * SZ};
    for (int i = 0; i < 6; i++) g[i] = malloc((size_t)sizes[i] * 8);
    int rc = tide_cpu_kda(TIDE_F64, o, s, p.q, p.k, p.v, p.g, p.beta, p.s0, cu, n_seg, p.B, p.T, p.H, p.dk, p.dv,
                          TIDE_KDA_CHUNK, C, -5.0, ck);
    rc = rc || tide_cpu_kda_backward(TIDE_F64, g[0], g[1], g[2], g[3], g[4], g[5], gout, gs, p.q, p.k, p.v, p.g, p.beta,
                                     p.s0, cu, n_seg, p.B, p.T, p.H, p.dk, p.dv, TIDE_KDA_CHUNK, C, -5.0, ck);
    int same = rc == 0 && !memcmp(o, a.o, (size_t)(N * p.dv) * 8) && !memcmp(s, a.s, (size_t)(p.B * p.H * SZ) * 8);
    double *ref[6] = {a.gq, a.gk, a.gv, a.gg, a.gb, a.gs0};
    for (int i = 0; i < 6; i++) same = same && !memcmp(g[i], ref[i], (size_t)sizes[i] * 8);
    CHECK(same, "backward from the forward's %lld checkpoints differs from the recomputing backward (rc %d)", (long long)n_ck, rc);
    for (int i = 0; i < 6; i++) free(g[i]);
    free(o); free(s); free(ck); free(gout); free(gs);
    drop_result(&a); drop(&p);
}

/* ---- 2. the inverse ------------------------------------------------------------------------------- */
static void test_inverse(void)
{
    int64_t C = 16;
    double A[256], M0[256], M1[256], worst = 0, lo = 0, hi = 0;
    problem p = make(1, C, 1, 16, 1, 1.5);
    for (int trial = 0; trial < 2000; trial++) {
        /* a fresh chunk: L2-normed keys, β ~ U(0, 1), g from the bounded gate */
        problem c = make(1, C, 1, 16, 1, 2.0);
        double G[16 * 16];
        for (int64_t r = 0; r < C; r++)
            for (int64_t i = 0; i < 16; i++) G[r * 16 + i] = c.g[r * 16 + i] + (r ? G[(r - 1) * 16 + i] : 0);
        for (int64_t r = 0; r < C; r++)
            for (int64_t j = 0; j < C; j++) {
                double s = 0;
                if (j < r)
                    for (int64_t i = 0; i < 16; i++) s += c.k[r * 16 + i] * c.k[j * 16 + i] * exp(G[r * 16 + i] - G[j * 16 + i]);
                A[r * C + j] = c.beta[r] * s;
            }
        tide_cpu_kda_unit_lower_inverse(TIDE_F64, M0, A, C, 0);
        tide_cpu_kda_unit_lower_inverse(TIDE_F64, M1, A, C, 1);
        worst = fmax(worst, max_abs_diff(M0, M1, C * C));
        for (int64_t i = 0; i < C * C; i++) { lo = fmin(lo, M0[i]); hi = fmax(hi, M0[i]); }
        drop(&c);
    }
    drop(&p);
    CHECK(worst <= 1e-12, "nilpotent product vs forward substitution: %.3g (want <= 1e-12)", worst);
    CHECK(lo >= -1 && hi <= 1, "(I + A)^-1 entries over 2000 chunks in [%.6f, %.6f], want within [-1, 1]", lo, hi);
}

/* ---- 3. decode == prefill, split == one pass, packed == separate -------------------------------------- */
static void test_state_handover(void)
{
    problem p = make(1, 38, 2, 8, 6, 1.5);
    int64_t H = p.H, dk = p.dk, dv = p.dv, SZ = H * dk * dv;
    int64_t cu_full[2] = {0, 38};
    result full = run64(&p, cu_full, 1, TIDE_KDA_CHUNK, 16, NULL, NULL);
    /* prefill 37 tokens, then one recurrent step from the saved state */
    problem a = p; a.T = 37;
    int64_t cu_a[2] = {0, 37};
    result pre = run64(&a, cu_a, 1, TIDE_KDA_CHUNK, 16, NULL, NULL);
    problem s = p; s.T = 1;
    s.q += 37 * H * dk; s.k += 37 * H * dk; s.g += 37 * H * dk; s.v += 37 * H * dv; s.beta += 37 * H; s.s0 = pre.s;
    int64_t cu_s[2] = {0, 1};
    result step = run64(&s, cu_s, 1, TIDE_KDA_RECURRENT, 0, NULL, NULL);
    double e1 = max_abs_diff(step.o, full.o + 37 * H * dv, H * dv), e2 = max_abs_diff(step.s, full.s, SZ);
    CHECK(e1 <= 1e-12 && e2 <= 1e-12, "prefill 37 + decode 1 vs chunk over 38: |dO| %.3g |dS| %.3g", e1, e2);
    drop_result(&step);
    /* split at 5, 21, 30 with the state carried */
    int64_t cuts[5] = {0, 5, 21, 30, 38};
    double *S = malloc((size_t)SZ * 8), worst = 0;
    memcpy(S, p.s0, (size_t)SZ * 8);
    for (int i = 0; i < 4; i++) {
        problem q = p;
        int64_t t0 = cuts[i], n = cuts[i + 1] - cuts[i], cu[2] = {0, n};
        q.T = n; q.q += t0 * H * dk; q.k += t0 * H * dk; q.g += t0 * H * dk; q.v += t0 * H * dv; q.beta += t0 * H; q.s0 = S;
        result r = run64(&q, cu, 1, TIDE_KDA_CHUNK, 16, NULL, NULL);
        worst = fmax(worst, max_abs_diff(r.o, full.o + t0 * H * dv, n * H * dv));
        memcpy(S, r.s, (size_t)SZ * 8);
        drop_result(&r);
    }
    worst = fmax(worst, max_abs_diff(S, full.s, SZ));
    CHECK(worst <= 1e-12, "split at 5/21/30 with the state carried vs one pass: %.3g", worst);
    free(S);
    /* packed [A | B] (boundary at 17) vs B alone from a zero state */
    int64_t inner[1] = {17}, cu[4];
    int64_t n_seg = make_cu(cu, 1, 38, inner, 1);
    result packed = run64(&p, cu, n_seg, TIDE_KDA_CHUNK, 16, NULL, NULL);
    problem b = p; b.T = 21;
    b.q += 17 * H * dk; b.k += 17 * H * dk; b.g += 17 * H * dk; b.v += 17 * H * dv; b.beta += 17 * H; b.s0 = NULL;
    int64_t cu_b[2] = {0, 21};
    result alone = run64(&b, cu_b, 1, TIDE_KDA_CHUNK, 16, NULL, NULL);
    double e3 = max_abs_diff(alone.o, packed.o + 17 * H * dv, 21 * H * dv), e4 = max_abs_diff(alone.s, packed.s, SZ);
    CHECK(e3 <= 1e-12 && e4 <= 1e-12, "packed [A | B] vs B alone: |dO| %.3g |dS| %.3g", e3, e4);
    double leak = max_abs_diff(full.o + 17 * H * dv, alone.o, H * dv);
    CHECK(leak > 1e-3, "without the boundary, document A must reach B's first token (difference %.3g)", leak);
    drop_result(&alone); drop_result(&packed); drop_result(&pre); drop_result(&full); drop(&p);
}

/* ---- 4. causality inside the chunk path ----------------------------------------------------------- */
static void test_causality(int dtype)
{
    int64_t Ps[2] = {20, 34};      /* T = 37, C = 16: 34 falls in the ragged last chunk [32, 37) */
    for (int ip = 0; ip < 2; ip++) {
        int64_t P = Ps[ip];
        problem p = make(1, 37, 2, 8, 6, 1.5), x = make(1, 37, 2, 8, 6, 1.5);
        int64_t H = p.H, dk = p.dk, dv = p.dv, N = p.T * H, cu[2] = {0, 37};
        double *gout = randn_vec(N * dv);
        for (int64_t i = P * H * dv; i < N * dv; i++) gout[i] = 0;   /* a loss on positions < P only */
        result r[2];
        for (int v = 0; v < 2; v++) {
            problem *u = &p;
            if (v == 1) {       /* change every input at positions >= P */
                memcpy(p.q + P * H * dk, x.q + P * H * dk, (size_t)((N - P * H) * dk) * 8);
                memcpy(p.k + P * H * dk, x.k + P * H * dk, (size_t)((N - P * H) * dk) * 8);
                memcpy(p.g + P * H * dk, x.g + P * H * dk, (size_t)((N - P * H) * dk) * 8);
                memcpy(p.v + P * H * dv, x.v + P * H * dv, (size_t)((N - P * H) * dv) * 8);
                memcpy(p.beta + P * H, x.beta + P * H, (size_t)(N - P * H) * 8);
            }
            if (dtype == TIDE_F64) r[v] = run64(u, cu, 1, TIDE_KDA_CHUNK, 16, gout, NULL);
            else {
                /* float32: run the f32 kernel and widen the results */
                int64_t n4 = N * dk, n6 = N * dv, SZ = H * dk * dv;
                float *q = to32(u->q, n4), *k = to32(u->k, n4), *g = to32(u->g, n4), *vv = to32(u->v, n6), *b = to32(u->beta, N);
                float *s0 = to32(u->s0, SZ), *go = to32(gout, n6);
                float *o = calloc((size_t)n6, 4), *s = calloc((size_t)SZ, 4), *gq = calloc((size_t)n4, 4), *gk = calloc((size_t)n4, 4);
                float *gg = calloc((size_t)n4, 4), *gv = calloc((size_t)n6, 4), *gb = calloc((size_t)N, 4);
                tide_cpu_kda(TIDE_F32, o, s, q, k, vv, g, b, s0, cu, 1, 1, 37, H, dk, dv, TIDE_KDA_CHUNK, 16, -5.0, NULL);
                tide_cpu_kda_backward(TIDE_F32, gq, gk, gv, gg, gb, NULL, go, NULL, q, k, vv, g, b, s0, cu, 1, 1, 37, H, dk, dv,
                                      TIDE_KDA_CHUNK, 16, -5.0, NULL);
                result w = {0};
                w.o = malloc((size_t)n6 * 8); w.gv = malloc((size_t)n6 * 8); w.gq = malloc((size_t)n4 * 8);
                w.gk = malloc((size_t)n4 * 8); w.gg = malloc((size_t)n4 * 8); w.gb = malloc((size_t)N * 8);
                for (int64_t i = 0; i < n6; i++) { w.o[i] = o[i]; w.gv[i] = gv[i]; }
                for (int64_t i = 0; i < n4; i++) { w.gq[i] = gq[i]; w.gk[i] = gk[i]; w.gg[i] = gg[i]; }
                for (int64_t i = 0; i < N; i++) w.gb[i] = gb[i];
                r[v] = w;
                free(q); free(k); free(g); free(vv); free(b); free(s0); free(go); free(o); free(s); free(gq); free(gk);
                free(gg); free(gv); free(gb);
            }
        }
        int same = 1, zero = 1;
        for (int64_t i = 0; i < P * H * dv; i++) same &= r[0].o[i] == r[1].o[i] && r[0].gv[i] == r[1].gv[i];
        for (int64_t i = 0; i < P * H * dk; i++)
            same &= r[0].gq[i] == r[1].gq[i] && r[0].gk[i] == r[1].gk[i] && r[0].gg[i] == r[1].gg[i];
        for (int64_t i = 0; i < P * H; i++) same &= r[0].gb[i] == r[1].gb[i];
        for (int64_t i = P * H * dk; i < N * dk; i++) zero &= r[1].gq[i] == 0 && r[1].gk[i] == 0 && r[1].gg[i] == 0;
        for (int64_t i = P * H * dv; i < N * dv; i++) zero &= r[1].gv[i] == 0;
        CHECK(same, "%s causality at P = %lld: outputs or gradients before P changed", tide_dtype_name(dtype), (long long)P);
        CHECK(zero, "%s causality at P = %lld: a loss before P gave gradient at or after P", tide_dtype_name(dtype), (long long)P);
        drop_result(&r[0]); drop_result(&r[1]);
        free(gout); drop(&p); drop(&x);
    }
}

/* ---- 5. the bound ---------------------------------------------------------------------------------- */
static void test_bound(void)
{
    int64_t T = 32, H = 1, dk = 16, dv = 16, N = T * H, cu[2] = {0, 32};
    problem p = make(1, T, H, dk, dv, 1.5);
    free(p.s0);
    p.s0 = NULL;                    /* a zero initial state, as in the f32 calls below */
    /* the unbounded softplus gate with large pre-activations: g = −softplus(z), z ~ 20 ± 10 */
    for (int64_t i = 0; i < N * dk; i++) { double z = 20 + 10 * nrand(); p.g[i] = -(z > 30 ? z : log1p(exp(z))); }
    result ref = run64(&p, cu, 1, TIDE_KDA_RECURRENT, 0, NULL, NULL);
    float *q = to32(p.q, N * dk), *k = to32(p.k, N * dk), *v = to32(p.v, N * dv), *g = to32(p.g, N * dk), *b = to32(p.beta, N);
    float *o = malloc((size_t)(N * dv) * 4), *s = malloc((size_t)(dk * dv) * 4);
    /* lb = −inf switches the kernel's check off: the factorised path on an unbounded decay */
    tide_cpu_kda(TIDE_F32, o, s, q, k, v, g, b, NULL, cu, 1, 1, T, H, dk, dv, TIDE_KDA_CHUNK, 16, -INFINITY, NULL);
    int64_t bad = 0;
    for (int64_t i = 0; i < N * dv; i++) bad += !isfinite(o[i]);
    CHECK(bad > 0, "the unbounded gate through the factorised f32 path should overflow (non-finite outputs: %lld)", (long long)bad);
    printf("  unbounded gate through the dense f32 path: %lld of %lld outputs non-finite\n", (long long)bad, (long long)(N * dv));
    /* the same input through the op is refused with the reason */
    tide_tensor *tq = tide_from_f64(TIDE_F32, 4, (int64_t[]){1, T, H, dk}, 0, p.q);
    tide_tensor *tk = tide_from_f64(TIDE_F32, 4, (int64_t[]){1, T, H, dk}, 0, p.k);
    tide_tensor *tv = tide_from_f64(TIDE_F32, 4, (int64_t[]){1, T, H, dv}, 0, p.v);
    tide_tensor *tg = tide_from_f64(TIDE_F32, 4, (int64_t[]){1, T, H, dk}, 0, p.g);
    tide_tensor *tb = tide_from_f64(TIDE_F32, 3, (int64_t[]){1, T, H}, 0, p.beta);
    tide_tensor *oo = NULL, *ss = NULL;
    int rc = tide_kda(tq, tk, tv, tg, tb, NULL, NULL, TIDE_KDA_CHUNK, 16, -5.0, &oo, &ss);
    CHECK(rc != 0 && strstr(tide_last_error(), "outside [-5, 0]"), "the op must refuse g below the bound, got rc %d: %s", rc,
          tide_last_error());
    /* the safe path handles it: f32 matches the f64 recurrence */
    rc = tide_kda(tq, tk, tv, tg, tb, NULL, NULL, TIDE_KDA_CHUNK_SAFE, 16, 0.0, &oo, &ss);
    double err = 0, scale = 0;
    double *ov = malloc((size_t)(N * dv) * 8);
    if (!rc) tide_to_f64_buffer(oo, ov, N * dv);
    for (int64_t i = 0; i < N * dv; i++) { err = fmax(err, fabs(ov[i] - ref.o[i])); scale = fmax(scale, fabs(ref.o[i])); }
    CHECK(rc == 0 && err <= 1e-5 * fmax(scale, 1e-3), "chunk_safe f32 on the unbounded gate vs f64: %.3g", err);
    tide_tensor_release(oo); tide_tensor_release(ss);
    /* the bounded gate at its floor, g = −5 for every token and channel (|G| reaches 80 in a chunk) */
    for (int64_t i = 0; i < N * dk; i++) p.g[i] = -5.0;
    drop_result(&ref);
    ref = run64(&p, cu, 1, TIDE_KDA_RECURRENT, 0, NULL, NULL);
    free(g);
    g = to32(p.g, N * dk);
    rc = tide_cpu_kda(TIDE_F32, o, s, q, k, v, g, b, NULL, cu, 1, 1, T, H, dk, dv, TIDE_KDA_CHUNK, 16, -5.0, NULL);
    err = 0; scale = 0;
    for (int64_t i = 0; i < N * dv; i++) { err = fmax(err, fabs(o[i] - ref.o[i])); scale = fmax(scale, fabs(ref.o[i])); }
    /* At g = lb in every channel, q⊙Γ reaches |q|·e^{-80}: entries with |q| < 6.5e-4 fall below FLT_MIN and
       are flushed to zero inside the kernel (FTZ), losing their share of Q̂Ǩᵀ; measured ~5e-5 of max|O|.
       spec oracle 4 allows 2^-7 of max|O| for bf16 here; float32 is held to 2e-4. */
    CHECK(rc == 0 && err <= 2e-4 * scale, "bounded gate at g = -5 everywhere: f32 dense path vs f64 %.3g (scale %.3g)", err, scale);
    printf("  g = -5 everywhere, f32 dense path vs f64: %.3g of max|O|\n", err / scale);
    /* the op layer's own precondition on the bound: chunk·|lb| <= 80 */
    rc = tide_kda(tq, tk, tv, tg, tb, NULL, NULL, TIDE_KDA_CHUNK, 16, -6.0, &oo, &ss);
    CHECK(rc != 0 && strstr(tide_last_error(), "chunk·|lb| <= 80 for f32"), "lb -6 with chunk 16 must be refused: %s", tide_last_error());
    tide_tensor_release(tq); tide_tensor_release(tk); tide_tensor_release(tv); tide_tensor_release(tg); tide_tensor_release(tb);
    free(q); free(k); free(v); free(g); free(b); free(o); free(s); free(ov);
    drop_result(&ref); drop(&p);
}

/* ---- 6. extreme gate pre-activations through gate + kda, forward and backward ------------------------- */
static void test_extreme_gates(void)
{
    int64_t B = 1, T = 40, H = 2, D = 8, N = B * T * H * D;
    double *z = malloc((size_t)N * 8), A[2] = {-5, 5}, *bias = calloc((size_t)(H * D), 8);
    for (int64_t i = 0; i < N; i++) z[i] = (i % 3 == 0) ? 1e4 : (i % 3 == 1 ? -1e4 : 0.1 * nrand());
    problem p = make(B, T, H, D, D, 1.0);
    for (int form = 0; form < 2; form++) {
        tide_tensor *tz = tide_from_f64(TIDE_F32, 4, (int64_t[]){B, T, H, D}, 0, z);
        tide_tensor *tA = tide_from_f64(TIDE_F32, 1, (int64_t[]){H}, 0, A);
        tide_tensor *tb = tide_from_f64(TIDE_F32, 1, (int64_t[]){H * D}, 0, bias);
        tide_tensor *tq = tide_from_f64(TIDE_F32, 4, (int64_t[]){B, T, H, D}, 0, p.q);
        tide_tensor *tk = tide_from_f64(TIDE_F32, 4, (int64_t[]){B, T, H, D}, 0, p.k);
        tide_tensor *tv = tide_from_f64(TIDE_F32, 4, (int64_t[]){B, T, H, D}, 0, p.v);
        tide_tensor *tbe = tide_from_f64(TIDE_F32, 3, (int64_t[]){B, T, H}, 0, p.beta);
        tide_tensor *leaves[7] = {tz, tA, tb, tq, tk, tv, tbe};
        for (int i = 0; i < 7; i++) tide_set_requires_grad(leaves[i], 1);
        tide_tensor *g = tide_kda_gate(tz, tA, tb, -5.0, form);
        tide_tensor *o = NULL, *s = NULL;
        int rc = g ? tide_kda(tq, tk, tv, g, tbe, NULL, NULL, form ? TIDE_KDA_CHUNK_SAFE : TIDE_KDA_CHUNK, 16, -5.0, &o, &s) : -1;
        int finite = rc == 0, in_range = 1;
        if (!rc) {
            double *gv = malloc((size_t)N * 8), *ov = malloc((size_t)(B * T * H * D) * 8);
            tide_to_f64_buffer(g, gv, N);
            tide_to_f64_buffer(o, ov, B * T * H * D);
            for (int64_t i = 0; i < N; i++) {
                finite &= isfinite(gv[i]);
                if (form == 0) in_range &= exp(gv[i]) >= exp(-5.0) * (1 - 1e-6) && exp(gv[i]) <= 1;
            }
            for (int64_t i = 0; i < B * T * H * D; i++) finite &= isfinite(ov[i]);
            tide_tensor *L1 = tide_sum(o, 0, NULL, 0), *L2 = tide_sum(s, 0, NULL, 0), *L = tide_add(L1, L2);
            rc = tide_backward(L, NULL);
            for (int i = 0; i < 7 && !rc; i++) {
                tide_tensor *gr = leaves[i]->grad;
                if (!gr) { finite = 0; continue; }
                double *b = malloc((size_t)gr->numel * 8);
                tide_to_f64_buffer(gr, b, gr->numel);
                for (int64_t e = 0; e < gr->numel; e++) finite &= isfinite(b[e]);
                free(b);
            }
            tide_tensor_release(L1); tide_tensor_release(L2); tide_tensor_release(L);
            free(gv); free(ov);
        }
        CHECK(rc == 0 && finite, "%s gate at ±1e4, A_log ±5: forward and backward finite (rc %d: %s)", form ? "softplus" : "bounded",
              rc, rc ? tide_last_error() : "");
        if (form == 0) CHECK(in_range, "bounded gate: alpha = exp(g) must lie in [e^-5, 1]");
        tide_tensor_release(g); tide_tensor_release(o); tide_tensor_release(s);
        for (int i = 0; i < 7; i++) tide_tensor_release(leaves[i]);
    }
    free(z); free(bias); drop(&p);
}

/* ---- 7. exact retrieval with orthonormal keys -------------------------------------------------------- */
static void test_retrieval(void)
{
    /* 4 writes (β = 1, g = 0) of v_i under key e_i, then 4 reads (β = 0) with q = e_i */
    int64_t T = 8, dk = 4, dv = 3, cu[2] = {0, 8};
    problem p = make(1, T, 1, dk, dv, 1.0);
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < dk; i++) {
            p.k[t * dk + i] = (t % 4 == i);
            p.q[t * dk + i] = (t % 4 == i);
            p.g[t * dk + i] = 0;
        }
        p.beta[t] = t < 4;
    }
    double *s0 = p.s0;
    p.s0 = NULL;
    for (int path = TIDE_KDA_CHUNK; path <= TIDE_KDA_RECURRENT; path++) {
        int64_t C = path == TIDE_KDA_RECURRENT ? 0 : 16;
        result r = run64(&p, cu, 1, path, C, NULL, NULL);
        double worst = 0;
        for (int64_t t = 4; t < 8; t++) worst = fmax(worst, max_abs_diff(r.o + t * dv, p.v + (t - 4) * dv, dv));
        CHECK(worst <= 1e-12, "path %d: reading key e_i returns v_i (error %.3g)", path, worst);
        drop_result(&r);
    }
    p.s0 = s0;
    drop(&p);
}

/* 8: the causal conv is bitwise the same whatever the thread count */
static void test_conv_threads(void)
{
    enum { B = 3, T = 37, C = 72, K = 4 };
    const int64_t cu[6] = {0, 5, 37, 60, 74, 111};          /* rows of 37: documents across and inside rows */
    int differ = 0, failed = 0;
    for (int dt = 0; dt < 2; dt++)
        for (int silu = 0; silu < 2; silu++) {
            int dtype = dt ? TIDE_F64 : TIDE_F32;
            size_t es = dt ? sizeof(double) : sizeof(float), n = (size_t)B * T * C, nw = (size_t)C * K;
            size_t nc = (size_t)B * (K - 1) * C, sz[4] = {n, n, nw, nc};
            char *x = malloc(n * es), *w = malloc(nw * es), *cache = malloc(nc * es), *g = malloc(n * es);
            char *out[3][4];                                   /* per thread count: y, gx, gw, gcache */
            for (size_t i = 0; i < n; i++) {
                double a = 2 * nrand(), b = nrand();
                if (dt) { ((double *)x)[i] = a; ((double *)g)[i] = b; } else { ((float *)x)[i] = (float)a; ((float *)g)[i] = (float)b; }
            }
            for (size_t i = 0; i < nw; i++) { double a = 0.5 * nrand(); if (dt) ((double *)w)[i] = a; else ((float *)w)[i] = (float)a; }
            for (size_t i = 0; i < nc; i++) { double a = nrand(); if (dt) ((double *)cache)[i] = a; else ((float *)cache)[i] = (float)a; }
            for (int th = 1; th <= 3; th++) {
                for (int i = 0; i < 4; i++) out[th - 1][i] = malloc(sz[i] * es);
                tide_set_num_threads(th);
                failed |= tide_cpu_causal_conv1d(dtype, out[th - 1][0], x, w, cache, cu, 5, B, T, C, K, silu);
                failed |= tide_cpu_causal_conv1d_backward(dtype, out[th - 1][1], out[th - 1][2], out[th - 1][3], g, x, w,
                                                          cache, cu, 5, B, T, C, K, silu);
            }
            for (int th = 2; th <= 3; th++)
                for (int i = 0; i < 4; i++) differ += memcmp(out[0][i], out[th - 1][i], sz[i] * es) != 0;
            for (int th = 0; th < 3; th++) for (int i = 0; i < 4; i++) free(out[th][i]);
            free(x); free(w); free(cache); free(g);
        }
    tide_set_num_threads(0);
    CHECK(!failed, "conv on 1-3 threads: a kernel call failed: %s", tide_last_error());
    CHECK(differ == 0, "conv: %d outputs or gradients differ between 1, 2 and 3 threads", differ);
}

int main(void)
{
    tide_manual_seed(7);
    test_chunk_equals_recurrent();
    test_f32_vs_f64();
    test_f32_backward();
    test_checkpoints();
    test_inverse();
    test_state_handover();
    test_causality(TIDE_F64);
    test_causality(TIDE_F32);
    test_bound();
    test_extreme_gates();
    test_retrieval();
    test_conv_threads();
    if (tide_graph_live_nodes() != 0) { printf("FAIL %lld graph nodes leaked\n", (long long)tide_graph_live_nodes()); g_fail++; }
    if (tide_live_tensors() != 0) { printf("FAIL %lld tensors leaked\n", (long long)tide_live_tensors()); g_fail++; }
    printf("\n%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

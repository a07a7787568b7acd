/*
 * test-optim — the AdamW update's non-finite flag (tide_adamw_step_checked_, spec/optim.md §2): the step's
 * post-update guard reads one flag instead of the weights, so the flag must trip for every NaN payload and
 * infinity planted in a parameter, a gradient or a moment, for values that only overflow when stored (a huge lr, v of a
 * huge f32 gradient), at the first, a middle and the last element, with one thread and many; a clean update
 * leaves it 0 and its results are bit-identical to the unchecked update; once set it stays set. f32, f64, bf16.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "testutil.h"

static int g_fail, g_pass;

#define CHECK(cond, ...)                                                                            \
    do {                                                                                            \
        if (cond) g_pass++;                                                                         \
        else { g_fail++; printf("FAIL  "); printf(__VA_ARGS__); printf("\n"); }                     \
    } while (0)

static const double LR = 1e-2, B1 = 0.9, B2 = 0.95, EPS = 1e-8, WD = 0.1;

static const char *dt_name(int dt) { return dt == TIDE_F32 ? "f32" : dt == TIDE_F64 ? "f64" : "bf16"; }
static size_t dt_size(int dt) { return dt == TIDE_F64 ? 8 : dt == TIDE_F32 ? 4 : 2; }

/* the non-finite classes of each dtype as raw bits: quiet and signalling NaNs of both signs and odd payloads
   (the words that crashed LuaJIT, issue 14; as f64 the f32 NaN widened, 0xFFEC0001FFEC0001 being a finite double),
   and both infinities */
static const uint64_t BAD_F64[] = {0x7ff8000000000000ull, 0xfff8000000000000ull, 0x7ff0000000000001ull,
                                   0xfffd800020000000ull, 0xffffffffffffffffull, 0x7ff0000000000000ull,
                                   0xfff0000000000000ull};
static const uint64_t BAD_F32[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffec0001u, 0xffffffffu, 0x7f800000u,
                                   0xff800000u};
static const uint64_t BAD_BF16[] = {0x7fc0u, 0xffc0u, 0x7f81u, 0xffecu, 0xffffu, 0x7f80u, 0xff80u};
enum { NBAD = 7 };

static uint64_t bad_bits(int dt, int k) { return dt == TIDE_F64 ? BAD_F64[k] : dt == TIDE_F32 ? BAD_F32[k] : BAD_BF16[k]; }

/* t[i] = the raw bits (through the engine's byte copies: tests never touch tensor memory directly) */
static void plant(tide_tensor *t, int64_t i, uint64_t bits)
{
    size_t es = dt_size(t->dtype), nb = (size_t)t->numel * es;
    unsigned char *b = malloc(nb);
    if (!b || tide_read_bytes(t, b, nb)) { printf("plant: %s\n", tide_last_error()); exit(2); }
    memcpy(b + (size_t)i * es, &bits, es);   /* little-endian: the low bytes of bits */
    if (tide_write_bytes(t, b, nb)) { printf("plant: %s\n", tide_last_error()); exit(2); }
    free(b);
}

static int same_bytes(const tide_tensor *a, const tide_tensor *b)
{
    size_t nb = (size_t)tide_tensor_nbytes(a);
    unsigned char *x = malloc(nb), *y = malloc(nb);
    int same = x && y && !tide_read_bytes(a, x, nb) && !tide_read_bytes(b, y, nb) && !memcmp(x, y, nb);
    free(x), free(y);
    return same;
}

static tide_tensor *clone(const tide_tensor *t)
{
    tide_tensor *c = tide_empty(t->dtype, t->ndim, t->shape, t->device);
    if (!c || tide_copy_(c, t)) { printf("clone: %s\n", tide_last_error()); exit(2); }
    return c;
}

static int flag_value(const tide_tensor *flag) { return (int)tide_item(flag); }

/* one optimiser state: p, g, m, v of one dtype; m and v after a first update so none is zero */
typedef struct { tide_tensor *p, *g, *m, *v; } state;

static state make_state(int dt, int64_t n)
{
    int64_t s[1] = {n};
    state st = {tide_randn(dt, 1, s, TIDE_CPU, 0.0, 1.0), tide_randn(dt, 1, s, TIDE_CPU, 0.0, 1.0),
                tide_zeros(dt, 1, s, TIDE_CPU), tide_zeros(dt, 1, s, TIDE_CPU)};
    if (!st.p || !st.g || !st.m || !st.v || tide_adamw_step_(st.p, st.g, st.m, st.v, LR, B1, B2, EPS, WD, 0)) {
        printf("state: %s\n", tide_last_error());
        exit(2);
    }
    return st;
}
static state copy_state(const state *a) { state b = {clone(a->p), clone(a->g), clone(a->m), clone(a->v)}; return b; }
static void free_state(state *s)
{
    tide_tensor_release(s->p), tide_tensor_release(s->g), tide_tensor_release(s->m), tide_tensor_release(s->v);
}

static int step_checked(state *s, int64_t t, double lr, tide_tensor *flag)
{
    return tide_adamw_step_checked_(s->p, s->g, s->m, s->v, lr, B1, B2, EPS, WD, t, flag);
}

/* a clean update: the flag stays 0 and p, m, v are bit for bit those of the unchecked update (three steps) */
static void test_clean(int dt, int64_t n, tide_tensor *flag)
{
    state a = make_state(dt, n), b = copy_state(&a);
    tide_fill_(flag, 0);
    for (int64_t t = 1; t <= 3; t++) {
        int rc = step_checked(&a, t, LR, flag);
        CHECK(rc == 0, "%s n=%lld: checked update: %s", dt_name(dt), (long long)n, tide_last_error());
        tide_adamw_step_(b.p, b.g, b.m, b.v, LR, B1, B2, EPS, WD, t);
    }
    CHECK(flag_value(flag) == 0, "%s n=%lld: a clean update set the flag", dt_name(dt), (long long)n);
    CHECK(same_bytes(a.p, b.p) && same_bytes(a.m, b.m) && same_bytes(a.v, b.v),
          "%s n=%lld: checked and unchecked updates differ", dt_name(dt), (long long)n);
    free_state(&a), free_state(&b);
}

/* every class at the first, a middle and the last element of the param, the gradient, m or v trips the flag (the
   kernel tests the stored p and v: a bad m reaches p in the same update) */
static void test_planted(int dt, int64_t n, tide_tensor *flag)
{
    state base = make_state(dt, n);
    int64_t where[3] = {0, n / 2, n - 1};
    const char *names[4] = {"param", "grad", "m", "v"};
    int missed = 0, cases = 0;
    for (int k = 0; k < NBAD; k++)
        for (int w = 0; w < 3; w++)
            for (int in = 0; in < 4; in++) {
                state s = copy_state(&base);
                tide_tensor *into[4] = {s.p, s.g, s.m, s.v};
                plant(into[in], where[w], bad_bits(dt, k));
                tide_fill_(flag, 0);
                int rc = step_checked(&s, 1, LR, flag);
                cases++;
                if (rc || flag_value(flag) != 1) {
                    missed++;
                    printf("  missed: %s n=%lld bits %llx at %lld in the %s (rc %d)\n", dt_name(dt), (long long)n,
                           (unsigned long long)bad_bits(dt, k), (long long)where[w], names[in], rc);
                }
                free_state(&s);
            }
    CHECK(missed == 0, "%s n=%lld: %d of %d planted non-finite values not flagged", dt_name(dt), (long long)n, missed,
          cases);
    free_state(&base);
}

/* finite inputs whose stored results are not: lr 1e300 overflows every f32 weight; a 1e30 f32 gradient makes only
   v (1e60 in double) infinite once stored, while the weight stays finite */
static void test_overflow(tide_tensor *flag)
{
    state s = make_state(TIDE_F32, 1000);
    tide_fill_(flag, 0);
    CHECK(step_checked(&s, 1, 1e300, flag) == 0 && flag_value(flag) == 1, "f32 lr 1e300: flag %d", flag_value(flag));
    free_state(&s);
    s = make_state(TIDE_F32, 1000);
    uint32_t big;
    float f = 1e30f;
    memcpy(&big, &f, sizeof big);
    plant(s.g, 500, big);
    tide_fill_(flag, 0);
    CHECK(step_checked(&s, 1, LR, flag) == 0 && flag_value(flag) == 1, "f32 v overflow: flag %d", flag_value(flag));
    CHECK(tide_all_finite(s.p) == 1 && tide_all_finite(s.v) == 0, "f32 v overflow: p stays finite, v does not");
    free_state(&s);
}

/* the flag is never cleared: one flag serves every parameter of a step */
static void test_sticky(tide_tensor *flag)
{
    state s = make_state(TIDE_F64, 64), c = make_state(TIDE_F64, 64);
    plant(s.g, 3, BAD_F64[0]);
    tide_fill_(flag, 0);
    step_checked(&s, 1, LR, flag);
    CHECK(step_checked(&c, 1, LR, flag) == 0 && flag_value(flag) == 1, "a clean update after a bad one cleared the flag");
    free_state(&s), free_state(&c);
}

/* one thread and many: the same bytes and the same flag */
static void test_threads(tide_tensor *flag)
{
    int nt = tide_num_threads();
    state a = make_state(TIDE_F32, 200003), b = copy_state(&a);
    plant(a.p, 150001, BAD_F32[3]), plant(b.p, 150001, BAD_F32[3]);
    tide_set_num_threads(1);
    tide_fill_(flag, 0);
    step_checked(&a, 1, LR, flag);
    int fa = flag_value(flag);
    tide_set_num_threads(nt > 1 ? nt : 4);
    tide_fill_(flag, 0);
    step_checked(&b, 1, LR, flag);
    int fb = flag_value(flag);
    tide_set_num_threads(nt);
    CHECK(fa == 1 && fb == 1, "threads: flags %d (1 thread) and %d (many)", fa, fb);
    CHECK(same_bytes(a.p, b.p) && same_bytes(a.m, b.m) && same_bytes(a.v, b.v), "threads: the updates differ");
    free_state(&a), free_state(&b);
}

/* bf16 on the CPU: the f64 update of the same bf16 values, rounded once per step */
static void test_bf16_values(void)
{
    enum { N = 257 };
    state h = make_state(TIDE_BF16, N);
    int64_t s[1] = {N};
    state d = {tide_empty(TIDE_F64, 1, s, TIDE_CPU), tide_empty(TIDE_F64, 1, s, TIDE_CPU),
               tide_empty(TIDE_F64, 1, s, TIDE_CPU), tide_empty(TIDE_F64, 1, s, TIDE_CPU)};
    tide_copy_(d.p, h.p), tide_copy_(d.g, h.g), tide_copy_(d.m, h.m), tide_copy_(d.v, h.v);
    for (int64_t t = 1; t <= 3; t++) {
        tide_adamw_step_(h.p, h.g, h.m, h.v, LR, B1, B2, EPS, WD, t);
        tide_adamw_step_(d.p, d.g, d.m, d.v, LR, B1, B2, EPS, WD, t);
    }
    double *hp = host(h.p), *dp = host(d.p), *hv = host(h.v), *dv = host(d.v);
    double ep = max_rel_diff(hp, dp, N), ev = max_rel_diff(hv, dv, N);
    CHECK(ep < 2e-2 && ev < 2e-2, "bf16 vs f64 after 3 steps: p %.3g, v %.3g (tolerance 2e-2)", ep, ev);
    free(hp), free(dp), free(hv), free(dv);
    free_state(&h), free_state(&d);
}

static void test_flag_checks(void)
{
    state s = make_state(TIDE_F32, 8);
    int64_t one[1] = {1};
    tide_tensor *f32flag = tide_zeros(TIDE_F32, 1, one, TIDE_CPU);
    CHECK(step_checked(&s, 1, LR, f32flag) != 0 && strstr(tide_last_error(), "adamw: nonfinite must be"),
          "an f32 flag is refused: %s", tide_last_error());
    CHECK(step_checked(&s, 1, LR, NULL) == 0, "a NULL flag: %s", tide_last_error());
    tide_tensor_release(f32flag);
    free_state(&s);
}

int main(void)
{
    tide_manual_seed(14);
    int64_t one[1] = {1};
    tide_tensor *flag = tide_zeros(TIDE_I32, 1, one, TIDE_CPU);
    if (!flag) { printf("flag: %s\n", tide_last_error()); return 1; }
    const int dts[3] = {TIDE_F32, TIDE_F64, TIDE_BF16};
    const int64_t ns[2] = {17, 100003};   /* one thread; above the kernel's parallel threshold */
    for (int d = 0; d < 3; d++)
        for (int k = 0; k < 2; k++) {
            test_clean(dts[d], ns[k], flag);
            test_planted(dts[d], ns[k], flag);
        }
    test_overflow(flag);
    test_sticky(flag);
    test_threads(flag);
    test_bf16_values();
    test_flag_checks();
    tide_tensor_release(flag);
    printf("test-optim: %d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

/*
 * test_kernels_cpu.c — the CPU kernels called directly on small buffers and compared with reference
 * loops written here: gemm (BLAS, batch-invariant, short-K, narrow and long-K kernels), unary (+ backward by central differences), binary broadcasting, reductions,
 * index ops, strided copy with dtype conversion, Philox streams, AdamW, threads.
 * Prints "N passed, M failed"; exits non-zero on any failure.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tide.h"
#include "cpu/cpu.h"
#include "philox.h"

static int n_pass, n_fail;

#define CHECK(cond, ...)                                                                        \
    do {                                                                                        \
        if (cond) n_pass++;                                                                     \
        else {                                                                                  \
            n_fail++;                                                                           \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                         \
            printf(__VA_ARGS__);                                                                \
            printf("\n");                                                                       \
        }                                                                                       \
    } while (0)

/* |got - want| <= atol + rtol |want| for all i; one check, reporting the worst element */
static void check_close(const char *what, const double *got, const double *want, int64_t n, double rtol,
                        double atol)
{
    int64_t worst = -1;
    double worst_err = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs(got[i] - want[i]);
        int bad = !(err <= atol + rtol * fabs(want[i])) && !(isinf(want[i]) && got[i] == want[i]);
        if (bad && (worst < 0 || err > worst_err || isnan(err))) { worst = i; worst_err = err; }
    }
    CHECK(worst < 0, "%s: element %lld is %.17g, expected %.17g", what, (long long)worst,
          worst >= 0 ? got[worst] : 0.0, worst >= 0 ? want[worst] : 0.0);
}

static void f32_to_f64(double *d, const float *f, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = f[i]; }
static void f64_to_f32(float *f, const double *d, int64_t n) { for (int64_t i = 0; i < n; i++) f[i] = (float)d[i]; }

/* deterministic test data in [lo, hi) */
static uint64_t lcg_state = 12345;
static double urand(double lo, double hi)
{
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (double)(lcg_state >> 11) * (1.0 / 9007199254740992.0);
}
static void fill_rand(double *x, int64_t n, double lo, double hi) { for (int64_t i = 0; i < n; i++) x[i] = urand(lo, hi); }

static int error_mentions(const char *a, const char *b)
{
    const char *e = tide_last_error();
    return e && strstr(e, a) && (!b || strstr(e, b));
}

/* ---- memory ------------------------------------------------------------------------------------- */

static void test_memory(void)
{
    void *p = tide_cpu_malloc(1000), *z = tide_cpu_malloc(0);
    CHECK(p && ((uintptr_t)p % 64) == 0, "malloc: %p is not 64-byte aligned", p);
    CHECK(z != NULL, "malloc(0) returned NULL");
    char src[16] = "abcdefghijklmno", dst[16] = { 0 }, back[16] = { 0 };
    CHECK(tide_cpu_memcpy_h2d(p, src, 16) == 0 && tide_cpu_memcpy_d2d((char *)p + 64, p, 16) == 0 &&
          tide_cpu_memcpy_d2h(dst, (char *)p + 64, 16) == 0 && memcmp(dst, src, 16) == 0,
          "memcpy h2d/d2d/d2h round trip");
    CHECK(tide_cpu_memcpy_d2h(back, dst, 0) == 0 && back[0] == 0, "memcpy of 0 bytes writes nothing");
    CHECK(tide_cpu_synchronize() == 0, "synchronize");
    tide_cpu_free(p);
    tide_cpu_free(z);
    tide_cpu_free(NULL);
}

/* ---- fill -------------------------------------------------------------------------------------- */

static void test_fill(void)
{
    float f[5]; double d[5]; uint16_t h[5]; int32_t i32[5]; int64_t i64[5]; uint8_t u8[6] = { 0 };
    CHECK(tide_cpu_fill(f, TIDE_F32, 5, 2.5) == 0 && f[0] == 2.5f && f[4] == 2.5f, "fill f32");
    CHECK(tide_cpu_fill(d, TIDE_F64, 5, -0.1) == 0 && d[0] == -0.1 && d[4] == -0.1, "fill f64");
    CHECK(tide_cpu_fill(h, TIDE_BF16, 5, 1.5) == 0 && h[0] == 0x3FC0 && h[4] == 0x3FC0, "fill bf16 1.5 -> 0x%04x", h[0]);
    /* ties round to even: 1 + 2^-8 lies halfway between 0x3F80 and 0x3F81 -> 0x3F80 (even) */
    tide_cpu_fill(h, TIDE_BF16, 1, 1.00390625);
    CHECK(h[0] == 0x3F80, "bf16 tie 1+2^-8 -> 0x%04x, expected 0x3f80", h[0]);
    /* 1 + 3*2^-8 lies halfway between 0x3F81 and 0x3F82 -> 0x3F82 (even) */
    tide_cpu_fill(h, TIDE_BF16, 1, 1.01171875);
    CHECK(h[0] == 0x3F82, "bf16 tie 1+3*2^-8 -> 0x%04x, expected 0x3f82", h[0]);
    tide_cpu_fill(h, TIDE_BF16, 1, 1.0 + 1.0 / 128 + 1.0 / 1024);   /* above the tie -> up */
    CHECK(h[0] == 0x3F81, "bf16 rounding up -> 0x%04x, expected 0x3f81", h[0]);
    CHECK(tide_cpu_fill(i32, TIDE_I32, 5, -3.7) == 0 && i32[0] == -3 && i32[4] == -3, "fill i32 -3.7 -> %d (toward zero)", i32[0]);
    CHECK(tide_cpu_fill(i64, TIDE_I64, 5, 1e12) == 0 && i64[4] == 1000000000000LL, "fill i64");
    CHECK(tide_cpu_fill(u8, TIDE_U8, 5, 7) == 0 && u8[0] == 7 && u8[4] == 7 && u8[5] == 0, "fill u8 (and no overrun)");
    CHECK(tide_cpu_fill(f, 17, 1, 0.0) != 0, "fill rejects dtype 17");
}

/* zeroing past the caches (tide_cpu_zero_rows: non-temporal stores from TIDE_CPU_ZERO_STREAM_MIN bytes): rows of
   every misalignment and a stride, the bytes between rows and around the region untouched; fill(0) of a large
   buffer at an odd address; fill(-0.0) keeps its sign bit (not the all-zero path) */
static void test_zero_rows(void)
{
    size_t big = TIDE_CPU_ZERO_STREAM_MIN + 4096;
    unsigned char *buf = malloc(big + 256);
    int bad = 0;
    for (int off = 0; off < 64; off += 13) {                 /* one contiguous region at offsets 0, 13, 26, 39, 52 */
        memset(buf, 0xA5, big + 256);
        size_t n = big - 3 * (size_t)off;
        tide_cpu_zero_rows(buf + 64 + off, 1, n, n);
        for (size_t i = 0; i < big + 256; i++) {
            int inside = i >= 64 + (size_t)off && i < 64 + (size_t)off + n;
            bad += inside ? buf[i] != 0 : buf[i] != 0xA5;
        }
    }
    CHECK(bad == 0, "zero_rows contiguous: %d bytes wrong (zero inside, untouched outside)", bad);
    /* 1,100 rows of 4,001 bytes, 4,107 apart: 4.4 MB (past the threshold), rows starting at every alignment */
    int64_t M = 1100;
    size_t row = 4001, ld = 4107;
    unsigned char *r = malloc((size_t)M * ld + 64);
    memset(r, 0xA5, (size_t)M * ld + 64);
    tide_cpu_zero_rows(r + 3, M, row, ld);
    bad = 0;
    for (size_t i = 0; i < (size_t)M * ld + 64; i++) {
        size_t j = i - 3;
        int inside = i >= 3 && j / ld < (size_t)M && j % ld < row;
        bad += inside ? r[i] != 0 : r[i] != 0xA5;
    }
    CHECK(bad == 0, "zero_rows strided: %d bytes wrong", bad);
    free(r);
    /* fill(0.0) of a big f32 buffer 4 bytes past alignment, and fill(-0.0) of the same */
    float *f = (float *)(buf + 4);
    int64_t n = (int64_t)(big / 4) - 2;
    memset(buf, 0xA5, big + 256);
    CHECK(tide_cpu_fill(f, TIDE_F32, n, 0.0) == 0, "fill big zero: %s", tide_last_error());
    bad = 0;
    for (int64_t i = 0; i < n; i++) bad += f[i] != 0.0f || signbit(f[i]);
    CHECK(bad == 0 && buf[3] == 0xA5 && buf[4 + 4 * n] == 0xA5, "fill big zero: %d elements wrong or bytes outside "
          "written", bad);
    tide_cpu_fill(f, TIDE_F32, n, -0.0);
    bad = 0;
    for (int64_t i = 0; i < n; i++) bad += f[i] != 0.0f || !signbit(f[i]);
    CHECK(bad == 0, "fill big -0.0: %d elements lost the sign", bad);
    free(buf);
}

/* tide_cpu_copy_stream (non-temporal stores, the MoE forward's saved tensors): every destination alignment and
   lengths with and without a tail, against the source byte for byte, nothing outside written */
static void test_copy_stream(void)
{
    size_t cap = 4096 + 512;
    unsigned char *src = malloc(cap), *dst = malloc(cap + 256);
    for (size_t i = 0; i < cap; i++) src[i] = (unsigned char)(i * 131 + 7);
    int bad = 0;
    size_t lens[] = {0, 1, 63, 64, 65, 200, 4096, 4096 + 37};
    for (int off = 0; off < 64; off++)
        for (size_t l = 0; l < sizeof lens / sizeof *lens; l++) {
            size_t n = lens[l];
            memset(dst, 0xA5, cap + 256);
            tide_cpu_copy_stream(dst + 64 + off, src + (off * 5) % 64, n);
            for (size_t i = 0; i < cap + 256; i++) {
                int inside = i >= 64 + (size_t)off && i < 64 + (size_t)off + n;
                bad += inside ? dst[i] != src[(off * 5) % 64 + i - 64 - off] : dst[i] != 0xA5;
            }
        }
    CHECK(bad == 0, "copy_stream: %d bytes wrong (the source inside, untouched outside)", bad);
    free(src);
    free(dst);
}

/* ---- copy -------------------------------------------------------------------------------------- */

static void store_any(void *p, int dt, int64_t i, double v)
{
    switch (dt) {
    case TIDE_F32: ((float *)p)[i] = (float)v; break;
    case TIDE_F64: ((double *)p)[i] = v; break;
    case TIDE_BF16: { float f = (float)v; uint32_t u; memcpy(&u, &f, 4); ((uint16_t *)p)[i] = (uint16_t)(u >> 16); break; }
    case TIDE_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case TIDE_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    default: ((uint8_t *)p)[i] = (uint8_t)v; break;
    }
}

static double load_any(const void *p, int dt, int64_t i)
{
    switch (dt) {
    case TIDE_F32: return ((const float *)p)[i];
    case TIDE_F64: return ((const double *)p)[i];
    case TIDE_BF16: { uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16; float f; memcpy(&f, &u, 4); return f; }
    case TIDE_I32: return ((const int32_t *)p)[i];
    case TIDE_I64: return (double)((const int64_t *)p)[i];
    default: return ((const uint8_t *)p)[i];
    }
}

static void test_copy(void)
{
    /* transpose: x [3, 4] f64 contiguous read through strides (1, 4) into out [4, 3] f32 */
    double x[12];
    for (int i = 0; i < 12; i++) x[i] = i * 0.5 - 2.0;
    float out[13];
    out[12] = 99.0f;
    int64_t shape[2] = { 4, 3 }, os[2] = { 3, 1 }, xs[2] = { 1, 4 };
    CHECK(tide_cpu_copy(out, TIDE_F32, os, x, TIDE_F64, xs, 2, shape) == 0, "copy transpose: %s", tide_last_error());
    int ok = 1;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) ok &= out[i * 3 + j] == (float)x[j * 4 + i];
    CHECK(ok && out[12] == 99.0f, "copy transpose f64 -> f32 values (and guard)");

    /* 3-D strided source (every other element of the last dim, a permuted middle) -> strided out */
    double src[2 * 3 * 8], dst[2 * 3 * 4 * 2], want[2 * 3 * 4 * 2];
    for (int i = 0; i < 48; i++) src[i] = i;
    for (int i = 0; i < 48; i++) dst[i] = want[i] = -1.0;
    int64_t sh3[3] = { 2, 3, 4 }, xs3[3] = { 24, 8, 2 }, os3[3] = { 24, 8, 2 };   /* out also every other */
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 4; c++) want[a * 24 + b * 8 + c * 2] = src[a * 24 + b * 8 + c * 2];
    CHECK(tide_cpu_copy(dst, TIDE_F64, os3, src, TIDE_F64, xs3, 3, sh3) == 0, "copy 3-D strided");
    check_close("copy 3-D strided (untouched gaps stay -1)", dst, want, 48, 0, 0);

    /* every dtype pair, through a broadcast source (stride 0) and a reversed-order output */
    const double vals[6] = { 0, 1, 2, 7, 100, 255 };
    int pairs_ok = 1;
    for (int sdt = 0; sdt < TIDE_DTYPE_COUNT; sdt++)
        for (int odt = 0; odt < TIDE_DTYPE_COUNT; odt++) {
            uint64_t sbuf[6], obuf[2 * 6];
            for (int i = 0; i < 6; i++) store_any(sbuf, sdt, i, vals[i]);
            int64_t sh[2] = { 2, 6 }, ss[2] = { 0, 1 }, ostr[2] = { 6, -1 };
            /* out[r, i] at base + 5 - i: last dim written backwards */
            char *obase = (char *)obuf + 5 * tide_dtype_size(odt);
            if (tide_cpu_copy(obase, odt, ostr, sbuf, sdt, ss, 2, sh) != 0) { pairs_ok = 0; continue; }
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < 6; i++)
                    if (load_any(obuf, odt, r * 6 + 5 - i) != vals[i]) {
                        if (pairs_ok) printf("  copy %s -> %s: element %d = %g, expected %g\n", tide_dtype_name(sdt),
                                             tide_dtype_name(odt), i, load_any(obuf, odt, r * 6 + 5 - i), vals[i]);
                        pairs_ok = 0;
                    }
        }
    CHECK(pairs_ok, "copy: all 36 dtype pairs with broadcast source and negative output stride");

    /* bf16 round trip of values exactly representable in bf16 */
    float rep[6] = { 1.5f, -2.75f, 0.0078125f, 65280.0f, -0.0f, 1.0f / 1024 };
    uint16_t hb[6];
    float back[6];
    int64_t s1[1] = { 1 }, n6[1] = { 6 };
    tide_cpu_copy(hb, TIDE_BF16, s1, rep, TIDE_F32, s1, 1, n6);
    tide_cpu_copy(back, TIDE_F32, s1, hb, TIDE_BF16, s1, 1, n6);
    CHECK(memcmp(back, rep, sizeof rep) == 0, "copy f32 -> bf16 -> f32 round trip is exact");
    CHECK(hb[0] == 0x3FC0 && hb[4] == 0x8000, "bf16 bits of 1.5 and -0: 0x%04x 0x%04x", hb[0], hb[4]);
    float nanv = NAN, infv = INFINITY;
    uint16_t hn, hi;
    int64_t n1[1] = { 1 };
    tide_cpu_copy(&hn, TIDE_BF16, s1, &nanv, TIDE_F32, s1, 1, n1);
    tide_cpu_copy(&hi, TIDE_BF16, s1, &infv, TIDE_F32, s1, 1, n1);
    CHECK((hn & 0x7F80) == 0x7F80 && (hn & 0x7F) != 0 && hi == 0x7F80, "bf16 NaN stays NaN (0x%04x), inf = 0x%04x", hn, hi);

    /* float -> int truncates toward zero; i64 -> i64 strided stays exact above 2^53 */
    double fv[4] = { -2.7, 2.7, -0.5, 300.9 };
    int32_t iv[4];
    int64_t n4[1] = { 4 };
    tide_cpu_copy(iv, TIDE_I32, s1, fv, TIDE_F64, s1, 1, n4);
    CHECK(iv[0] == -2 && iv[1] == 2 && iv[2] == 0 && iv[3] == 300, "copy f64 -> i32 toward zero: %d %d %d %d", iv[0], iv[1], iv[2], iv[3]);
    int64_t big[4] = { (1LL << 60) + 1, 0, -(1LL << 55) - 3, 0 }, bo[2];
    int64_t s2[1] = { 2 }, n2[1] = { 2 };
    tide_cpu_copy(bo, TIDE_I64, s1, big, TIDE_I64, s2, 1, n2);
    CHECK(bo[0] == big[0] && bo[1] == big[2], "copy i64 strided is exact");
    int32_t i32o[2];
    tide_cpu_copy(i32o, TIDE_I32, s1, big, TIDE_I64, s2, 1, n2);
    CHECK(i32o[0] == 1 && i32o[1] == -3, "copy i64 -> i32 keeps the low bits: %d %d", i32o[0], i32o[1]);

    /* scalar (ndim 0) and an empty shape */
    double one = 3.25; float onef = 0;
    CHECK(tide_cpu_copy(&onef, TIDE_F32, NULL, &one, TIDE_F64, NULL, 0, NULL) == 0 && onef == 3.25f, "copy scalar");
    int64_t zero_shape[2] = { 3, 0 }, zs[2] = { 0, 0 };
    CHECK(tide_cpu_copy(NULL, TIDE_F32, zs, NULL, TIDE_F32, zs, 2, zero_shape) == 0, "copy of an empty shape");

    /* a long contiguous f32 -> f64 copy is split over threads: compare with the scalar loop */
    int64_t n = 50000;
    float *lf = malloc(n * sizeof *lf);
    double *ld = malloc(n * sizeof *ld), *lw = malloc(n * sizeof *lw);
    for (int64_t i = 0; i < n; i++) { lf[i] = (float)urand(-1, 1); lw[i] = lf[i]; }
    int64_t nn[1] = { n };
    tide_cpu_copy(ld, TIDE_F64, s1, lf, TIDE_F32, s1, 1, nn);
    check_close("copy long f32 -> f64", ld, lw, n, 0, 0);
    free(lf); free(ld); free(lw);
}

/* ---- Philox random numbers ------------------------------------------------------------------------ */

static void test_random(void)
{
    int64_t n = 100000;
    double *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    float *f = malloc(n * sizeof *f);
    uint16_t *h = malloc(n * sizeof *h), *h2 = malloc(n * sizeof *h2);

    tide_cpu_randn(a, TIDE_F64, n, 42, 1000, 0.0, 1.0);
    tide_cpu_randn(b, TIDE_F64, n, 42, 1000, 0.0, 1.0);
    CHECK(memcmp(a, b, n * sizeof *a) == 0, "randn: same seed and offset give the same numbers");
    CHECK(a[7] == tide_philox_normal_at(42, 1007), "randn: element i uses counter offset + i");
    tide_cpu_randn(b, TIDE_F64, 10, 42, 1005, 0.0, 1.0);
    CHECK(b[0] == a[5] && b[9] == a[14], "randn: a later offset continues the same stream");
    tide_cpu_randn(b, TIDE_F64, 10, 43, 1000, 0.0, 1.0);
    CHECK(b[0] != a[0], "randn: another seed gives other numbers");

    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; i++) mean += a[i];
    mean /= n;
    for (int64_t i = 0; i < n; i++) var += (a[i] - mean) * (a[i] - mean);
    double sd = sqrt(var / (n - 1));
    CHECK(fabs(mean) < 0.02 && fabs(sd - 1.0) < 0.02, "randn: mean %g std %g of 1e5 samples", mean, sd);

    tide_cpu_randn(b, TIDE_F64, n, 42, 1000, 2.0, 3.0);
    int affine = 1;
    for (int64_t i = 0; i < n; i++) affine &= fabs(b[i] - (2.0 + 3.0 * a[i])) <= 1e-12 * (1 + fabs(b[i]));
    CHECK(affine, "randn: mean a, std b is a + b z");

    /* float32 and bf16 are the float64 stream rounded */
    tide_cpu_randn(f, TIDE_F32, n, 42, 1000, 0.0, 1.0);
    int f_ok = 1;
    for (int64_t i = 0; i < n; i++) f_ok &= f[i] == (float)a[i];
    CHECK(f_ok, "randn f32 = (float) of the f64 stream");
    tide_cpu_randn(h, TIDE_BF16, n, 42, 1000, 0.0, 1.0);
    int64_t s1[1] = { 1 }, nn[1] = { n };
    tide_cpu_copy(h2, TIDE_BF16, s1, f, TIDE_F32, s1, 1, nn);
    CHECK(memcmp(h, h2, n * sizeof *h) == 0, "randn bf16 = bf16 rounding of the f32 stream");

    tide_cpu_rand(a, TIDE_F64, n, 7, 0, -2.0, 4.0);
    double lo = 1e9, hi = -1e9;
    mean = 0;
    for (int64_t i = 0; i < n; i++) { mean += a[i]; lo = fmin(lo, a[i]); hi = fmax(hi, a[i]); }
    mean /= n;
    CHECK(lo >= -2.0 && hi < 4.0 && fabs(mean - 1.0) < 0.03, "rand [-2, 4): min %g max %g mean %g", lo, hi, mean);
    CHECK(a[3] == -2.0 + 6.0 * tide_philox_uniform_at(7, 3), "rand: a + (b - a) u");

    /* the stream does not depend on the thread count */
    int threads0 = tide_cpu_get_threads();
    tide_cpu_set_threads(1);
    tide_cpu_randn(a, TIDE_F64, n, 5, 11, 0.0, 1.0);
    tide_cpu_set_threads(2);
    tide_cpu_randn(b, TIDE_F64, n, 5, 11, 0.0, 1.0);
    tide_cpu_set_threads(threads0);
    CHECK(memcmp(a, b, n * sizeof *a) == 0, "randn: 1 thread and 2 threads give the same numbers");

    CHECK(tide_cpu_randn(a, TIDE_I32, 4, 1, 0, 0, 1) != 0 && error_mentions("randn", "i32"), "randn i32 rejected: %s", tide_last_error());
    free(a); free(b); free(f); free(h); free(h2);
}

/* ---- unary ------------------------------------------------------------------------------------- */

static double ref_unary(int op, double x, double p)
{
    double k = sqrt(2.0 / acos(-1.0));
    switch (op) {
    case TIDE_UN_NEG: return -x;
    case TIDE_UN_EXP: return exp(x);
    case TIDE_UN_LOG: return log(x);
    case TIDE_UN_SQRT: return sqrt(x);
    case TIDE_UN_RSQRT: return 1.0 / sqrt(x);
    case TIDE_UN_TANH: return tanh(x);
    case TIDE_UN_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case TIDE_UN_SILU: return x / (1.0 + exp(-x));
    case TIDE_UN_GELU: return 0.5 * x * (1.0 + tanh(k * (x + 0.044715 * x * x * x)));
    case TIDE_UN_GELU_ERF: return 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
    case TIDE_UN_SOFTPLUS: return log(1.0 + exp(x));
    case TIDE_UN_RELU: return x > 0 ? x : 0;
    case TIDE_UN_ABS: return fabs(x);
    case TIDE_UN_ADD_SCALAR: return x + p;
    case TIDE_UN_MUL_SCALAR: return x * p;
    default: return pow(x, p);
    }
}

static void test_unary(void)
{
#define NAME_OF(ID, name) [TIDE_UN_##ID] = #name,
    static const char *const names[] = {TIDE_UNARY_OPS(NAME_OF)};
#undef NAME_OF
    _Static_assert(sizeof names / sizeof names[0] == TIDE_UN_COUNT, "one name per unary op");
    enum { N = 40 };
    double x[N], y[N], want[N], gy[N], gx[N], num[N], yp[N], ym[N];
    float xf[N], yf[N], gyf[N], gxf[N];
    double yd[N], gxd[N];
    char what[96];
    for (int op = 0; op < TIDE_UN_COUNT; op++) {
        int positive = op == TIDE_UN_LOG || op == TIDE_UN_SQRT || op == TIDE_UN_RSQRT || op == TIDE_UN_POW_SCALAR;
        double p = op == TIDE_UN_POW_SCALAR ? 2.5 : op == TIDE_UN_ADD_SCALAR ? 0.75 : -1.25;
        for (int i = 0; i < N; i++) {
            x[i] = positive ? urand(0.2, 4.0) : urand(-4.0, 4.0);
            if (fabs(x[i]) < 0.05) x[i] = 0.3;   /* relu/abs kinks stay out of the difference quotient */
            gy[i] = urand(-2.0, 2.0);
            want[i] = ref_unary(op, x[i], p);
        }
        snprintf(what, sizeof what, "unary %s f64", names[op]);
        CHECK(tide_cpu_unary(op, TIDE_F64, y, x, N, p) == 0, "%s: %s", what, tide_last_error());
        check_close(what, y, want, N, 1e-12, 1e-14);

        /* float32 against the float64 reference */
        f64_to_f32(xf, x, N);
        for (int i = 0; i < N; i++) want[i] = ref_unary(op, xf[i], p);
        tide_cpu_unary(op, TIDE_F32, yf, xf, N, p);
        f32_to_f64(yd, yf, N);
        snprintf(what, sizeof what, "unary %s f32", names[op]);
        check_close(what, yd, want, N, 2e-6, 1e-6);

        /* in place: y aliases x */
        memcpy(yd, x, sizeof x);
        tide_cpu_unary(op, TIDE_F64, yd, yd, N, p);
        snprintf(what, sizeof what, "unary %s in place", names[op]);
        check_close(what, yd, y, N, 0, 0);

        /* backward against central differences: gx = gy (f(x+h) - f(x-h)) / 2h */
        double h = 1e-6, xp[N], xm[N];
        for (int i = 0; i < N; i++) { xp[i] = x[i] + h; xm[i] = x[i] - h; }
        tide_cpu_unary(op, TIDE_F64, yp, xp, N, p);
        tide_cpu_unary(op, TIDE_F64, ym, xm, N, p);
        for (int i = 0; i < N; i++) num[i] = gy[i] * (yp[i] - ym[i]) / (2 * h);
        snprintf(what, sizeof what, "unary_backward %s f64 vs central differences", names[op]);
        CHECK(tide_cpu_unary_backward(op, TIDE_F64, gx, gy, x, y, N, p) == 0, "%s: %s", what, tide_last_error());
        check_close(what, gx, num, N, 1e-6, 1e-6);

        /* float32 backward agrees with float64 backward */
        f64_to_f32(gyf, gy, N);
        tide_cpu_unary(op, TIDE_F32, yf, xf, N, p);
        tide_cpu_unary_backward(op, TIDE_F32, gxf, gyf, xf, yf, N, p);
        f32_to_f64(yd, gxf, N);
        for (int i = 0; i < N; i++) x[i] = xf[i], gy[i] = gyf[i];
        tide_cpu_unary(op, TIDE_F64, y, x, N, p);
        tide_cpu_unary_backward(op, TIDE_F64, gxd, gy, x, y, N, p);
        snprintf(what, sizeof what, "unary_backward %s f32 vs f64", names[op]);
        check_close(what, yd, gxd, N, 1e-5, 1e-5);
    }

    /* numerically hard inputs: large |x| must not overflow into inf or NaN */
    double big[4] = { -1000.0, 1000.0, -40.0, 40.0 }, out[4];
    tide_cpu_unary(TIDE_UN_SIGMOID, TIDE_F64, out, big, 4, 0);
    CHECK(out[0] == 0.0 && out[1] == 1.0 && out[2] > 0 && out[2] < 1e-17, "sigmoid(+-1000, -40) = %g %g %g", out[0], out[1], out[2]);
    tide_cpu_unary(TIDE_UN_SOFTPLUS, TIDE_F64, out, big, 4, 0);
    CHECK(out[0] == 0.0 && out[1] == 1000.0 && fabs(out[3] - 40.0) < 1e-15, "softplus(+-1000, 40) = %g %g %g", out[0], out[1], out[3]);
    tide_cpu_unary(TIDE_UN_SILU, TIDE_F64, out, big, 4, 0);
    CHECK(out[0] == 0.0 && out[1] == 1000.0, "silu(+-1000) = %g %g", out[0], out[1]);
    float bigf[2] = { -200.0f, 200.0f }, outf[2];
    tide_cpu_unary(TIDE_UN_SOFTPLUS, TIDE_F32, outf, bigf, 2, 0);
    CHECK(outf[0] == 0.0f && outf[1] == 200.0f, "softplus f32(+-200) = %g %g", outf[0], outf[1]);
    double g1[4] = { 1, 1, 1, 1 }, gb[4];
    tide_cpu_unary(TIDE_UN_SILU, TIDE_F64, out, big, 4, 0);
    tide_cpu_unary_backward(TIDE_UN_SILU, TIDE_F64, gb, g1, big, out, 4, 0);
    CHECK(gb[0] == 0.0 && gb[1] == 1.0, "silu'(+-1000) = %g %g", gb[0], gb[1]);

    CHECK(tide_cpu_unary(TIDE_UN_EXP, TIDE_I64, out, big, 4, 0) != 0 && error_mentions("exp", "i64"),
          "unary on i64 rejected: %s", tide_last_error());
    CHECK(tide_cpu_unary(TIDE_UN_COUNT, TIDE_F64, out, big, 4, 0) != 0, "unary op out of range rejected");
}

/* ---- binary, swiglu, axpy, sum_squares, all_finite ------------------------------------------------- */

static double ref_binary(int op, double a, double b)
{
    return op == TIDE_BIN_ADD ? a + b : op == TIDE_BIN_SUB ? a - b : op == TIDE_BIN_MUL ? a * b : a / b;
}

/* out[i0, i1, i2] = a op b over a 3-D shape with explicit strides */
static void binary_case(const char *label, int op, const int64_t *shape, const double *a, const int64_t *sa,
                        const double *b, const int64_t *sb)
{
    int64_t n = shape[0] * shape[1] * shape[2];
    double *want = malloc(n * sizeof *want), *got = malloc((n + 1) * sizeof *got);
    float *af = malloc(200 * sizeof *af), *bf = malloc(200 * sizeof *bf), *of = malloc(n * sizeof *of);
    int64_t k = 0;
    for (int64_t i = 0; i < shape[0]; i++)
        for (int64_t j = 0; j < shape[1]; j++)
            for (int64_t l = 0; l < shape[2]; l++, k++)
                want[k] = ref_binary(op, a[i * sa[0] + j * sa[1] + l * sa[2]], b[i * sb[0] + j * sb[1] + l * sb[2]]);
    got[n] = 12345.0;
    char what[96];
    snprintf(what, sizeof what, "binary op %d %s f64", op, label);
    CHECK(tide_cpu_binary(op, TIDE_F64, got, a, sa, b, sb, 3, shape) == 0, "%s: %s", what, tide_last_error());
    check_close(what, got, want, n, 1e-15, 0);
    CHECK(got[n] == 12345.0, "%s wrote past the output", what);
    f64_to_f32(af, a, 200);
    f64_to_f32(bf, b, 200);
    tide_cpu_binary(op, TIDE_F32, of, af, sa, bf, sb, 3, shape);
    f32_to_f64(got, of, n);
    snprintf(what, sizeof what, "binary op %d %s f32", op, label);
    check_close(what, got, want, n, 1e-6, 1e-6);
    free(want); free(got); free(af); free(bf); free(of);
}

static void test_binary(void)
{
    double a[200], b[200];
    fill_rand(a, 200, -3, 3);
    fill_rand(b, 200, 0.5, 3);    /* positive: division is well conditioned */
    for (int op = 0; op < TIDE_BIN_COUNT; op++) {
        int64_t sh[3] = { 2, 3, 4 };
        int64_t full[3] = { 12, 4, 1 };
        binary_case("same shape", op, sh, a, full, b, full);
        int64_t col[3] = { 0, 1, 0 };                         /* b [3, 1] broadcast to [2, 3, 4] */
        binary_case("b [3,1] broadcast", op, sh, a, full, b, col);
        int64_t row[3] = { 0, 0, 1 };                         /* a [4] broadcast, b full */
        binary_case("a [4] broadcast", op, sh, a, row, b, full);
        int64_t scal[3] = { 0, 0, 0 };
        binary_case("b scalar", op, sh, a, full, b, scal);
        binary_case("a scalar", op, sh, a, scal, b, full);
        int64_t tr[3] = { 1, 8, 2 };                          /* a a permuted, non-contiguous view */
        binary_case("a permuted", op, sh, a, tr, b, full);
    }
    /* a large flat and a large broadcast case cross the thread threshold */
    int64_t n = 3 * 40000;
    double *la = malloc(n * sizeof *la), *lb = malloc(40000 * sizeof *lb), *lo = malloc(n * sizeof *lo),
           *lw = malloc(n * sizeof *lw);
    fill_rand(la, n, -1, 1);
    fill_rand(lb, 40000, -1, 1);
    int64_t sh[2] = { 3, 40000 }, sa[2] = { 40000, 1 }, sb[2] = { 0, 1 };
    for (int64_t i = 0; i < n; i++) lw[i] = la[i] * lb[i % 40000];
    tide_cpu_binary(TIDE_BIN_MUL, TIDE_F64, lo, la, sa, lb, sb, 2, sh);
    check_close("binary mul, large row broadcast", lo, lw, n, 0, 0);
    int64_t s1[1] = { n }, one[1] = { 1 }, zero[1] = { 0 };
    for (int64_t i = 0; i < n; i++) lw[i] = la[i] - lb[0];
    tide_cpu_binary(TIDE_BIN_SUB, TIDE_F64, lo, la, one, lb, zero, 1, s1);
    check_close("binary sub, large scalar broadcast", lo, lw, n, 0, 0);
    free(la); free(lb); free(lo); free(lw);

    CHECK(tide_cpu_binary(TIDE_BIN_ADD, TIDE_I32, a, a, one, b, one, 1, one) != 0 && error_mentions("add", "i32"),
          "binary on i32 rejected: %s", tide_last_error());
}

static void test_misc_elementwise(void)
{
    enum { N = 30 };
    double g[N], u[N], out[N], want[N], dout[N], dg[N], du[N], ng[N], nu[N], op_[N], om[N];
    fill_rand(g, N, -5, 5);
    fill_rand(u, N, -2, 2);
    fill_rand(dout, N, -1, 1);
    for (int i = 0; i < N; i++) want[i] = g[i] / (1 + exp(-g[i])) * u[i];
    CHECK(tide_cpu_swiglu(TIDE_F64, out, g, u, N) == 0, "swiglu f64");
    check_close("swiglu f64", out, want, N, 1e-13, 1e-15);
    tide_cpu_swiglu_backward(TIDE_F64, dg, du, dout, g, u, N);
    double h = 1e-6, gp[N], gm[N], up[N], um[N];
    for (int i = 0; i < N; i++) { gp[i] = g[i] + h; gm[i] = g[i] - h; up[i] = u[i] + h; um[i] = u[i] - h; }
    tide_cpu_swiglu(TIDE_F64, op_, gp, u, N);
    tide_cpu_swiglu(TIDE_F64, om, gm, u, N);
    for (int i = 0; i < N; i++) ng[i] = dout[i] * (op_[i] - om[i]) / (2 * h);
    tide_cpu_swiglu(TIDE_F64, op_, g, up, N);
    tide_cpu_swiglu(TIDE_F64, om, g, um, N);
    for (int i = 0; i < N; i++) nu[i] = dout[i] * (op_[i] - om[i]) / (2 * h);
    check_close("swiglu_backward dg vs central differences", dg, ng, N, 1e-6, 1e-7);
    check_close("swiglu_backward du vs central differences", du, nu, N, 1e-6, 1e-7);
    float gf[N], uf[N], of[N];
    f64_to_f32(gf, g, N);
    f64_to_f32(uf, u, N);
    tide_cpu_swiglu(TIDE_F32, of, gf, uf, N);
    f32_to_f64(out, of, N);
    for (int i = 0; i < N; i++) want[i] = (double)gf[i] / (1 + exp(-(double)gf[i])) * uf[i];
    check_close("swiglu f32", out, want, N, 1e-5, 1e-6);

    double y[N], x[N];
    fill_rand(y, N, -1, 1);
    fill_rand(x, N, -1, 1);
    for (int i = 0; i < N; i++) want[i] = y[i] + 0.3 * x[i];
    tide_cpu_axpy(TIDE_F64, y, 0.3, x, N);
    check_close("axpy f64", y, want, N, 1e-15, 1e-16);
    float yf[N], xf[N];
    f64_to_f32(yf, want, N);
    f64_to_f32(xf, x, N);
    for (int i = 0; i < N; i++) want[i] = yf[i] + (double)(-2.0f) * xf[i];
    tide_cpu_axpy(TIDE_F32, yf, -2.0, xf, N);
    f32_to_f64(out, yf, N);
    check_close("axpy f32", out, want, N, 1e-6, 1e-6);

    /* sum of squares: double accumulation, identical for 1 and 2 threads */
    int64_t n = 200001;
    float *sf = malloc(n * sizeof *sf);
    double ref = 0;
    for (int64_t i = 0; i < n; i++) { sf[i] = (float)urand(-1, 1); ref += (double)sf[i] * sf[i]; }
    double s1 = 0, s2 = 0;
    int threads0 = tide_cpu_get_threads();
    tide_cpu_set_threads(1);
    CHECK(tide_cpu_sum_squares(TIDE_F32, sf, n, &s1) == 0, "sum_squares f32");
    tide_cpu_set_threads(2);
    tide_cpu_sum_squares(TIDE_F32, sf, n, &s2);
    tide_cpu_set_threads(threads0);
    CHECK(fabs(s1 - ref) <= 1e-12 * ref, "sum_squares f32 = %.17g, expected %.17g", s1, ref);
    CHECK(s1 == s2, "sum_squares: 1 thread %.17g, 2 threads %.17g", s1, s2);
    double dsq[3] = { 3, -4, 12 }, r = 0;
    tide_cpu_sum_squares(TIDE_F64, dsq, 3, &r);
    CHECK(r == 169.0, "sum_squares f64 = %g", r);
    uint16_t hsq[2] = { 0x3FC0, 0xC000 };   /* 1.5, -2 */
    tide_cpu_sum_squares(TIDE_BF16, hsq, 2, &r);
    CHECK(r == 6.25, "sum_squares bf16 = %g", r);
    tide_cpu_sum_squares(TIDE_F64, dsq, 0, &r);
    CHECK(r == 0.0, "sum_squares of nothing = %g", r);

    int fin = -1;
    tide_cpu_all_finite(TIDE_F32, sf, n, &fin);
    CHECK(fin == 1, "all_finite on finite data = %d", fin);
    sf[n - 3] = NAN;
    tide_cpu_all_finite(TIDE_F32, sf, n, &fin);
    CHECK(fin == 0, "all_finite sees a NaN = %d", fin);
    double dinf[3] = { 1, -INFINITY, 2 };
    tide_cpu_all_finite(TIDE_F64, dinf, 3, &fin);
    CHECK(fin == 0, "all_finite sees -inf = %d", fin);
    uint16_t hinf[2] = { 0x3F80, 0x7F80 };
    tide_cpu_all_finite(TIDE_BF16, hinf, 2, &fin);
    CHECK(fin == 0, "all_finite bf16 inf = %d", fin);
    tide_cpu_all_finite(TIDE_BF16, hinf, 1, &fin);
    CHECK(fin == 1, "all_finite bf16 1.0 = %d", fin);
    int32_t ints[2] = { 1, 2 };
    tide_cpu_all_finite(TIDE_I32, ints, 2, &fin);
    CHECK(fin == 1, "all_finite i32 = %d", fin);
    free(sf);
}

/* ---- reductions ---------------------------------------------------------------------------------- */

static void reduce_case(int outer, int red, int inner, int with_specials)
{
    int64_t n = (int64_t)outer * red * inner, m = (int64_t)outer * inner;
    double *x = malloc(n * sizeof *x), *got = malloc(m * sizeof *got), *want = malloc(m * sizeof *want);
    double *gy = malloc(m * sizeof *gy), *gx = malloc(n * sizeof *gx), *gw = malloc(n * sizeof *gw);
    int64_t *arg = malloc(m * sizeof *arg), *argw = malloc(m * sizeof *argw);
    float *xf = malloc(n * sizeof *xf), *gotf = malloc(m * sizeof *gotf);
    for (int64_t i = 0; i < n; i++) x[i] = (double)(int)urand(-4, 4);   /* integers: many ties */
    if (with_specials) {
        for (int r = 0; r < red; r++) x[(0 * red + r) * inner + 0] = -INFINITY;   /* an all -inf row */
        for (int r = 0; r < red; r++) x[(0 * red + r) * inner + 1] = 1000.0 + r;  /* exp would overflow */
    }
    char what[96];
    for (int op = 0; op < TIDE_RED_COUNT; op++) {
        for (int o = 0; o < outer; o++)
            for (int i = 0; i < inner; i++) {
                double s = 0, mx = -INFINITY;
                int64_t am = 0;
                for (int r = 0; r < red; r++) {
                    double v = x[((int64_t)o * red + r) * inner + i];
                    s += v;
                    if (r == 0 || v > mx) { mx = v; am = r; }
                }
                double lse = 0;
                for (int r = 0; r < red; r++) lse += exp(x[((int64_t)o * red + r) * inner + i] - mx);
                lse = isinf(mx) ? mx : mx + log(lse);
                double w = op == TIDE_RED_SUM ? s : op == TIDE_RED_MAX ? mx : op == TIDE_RED_ARGMAX ? (double)am : lse;
                want[(int64_t)o * inner + i] = w;
                argw[(int64_t)o * inner + i] = am;
            }
        snprintf(what, sizeof what, "reduce op %d [%d, %d, %d]", op, outer, red, inner);
        if (op == TIDE_RED_ARGMAX) {
            CHECK(tide_cpu_reduce(op, TIDE_F64, arg, x, outer, red, inner) == 0, "%s: %s", what, tide_last_error());
            CHECK(memcmp(arg, argw, m * sizeof *arg) == 0, "%s: argmax differs (first index of the max)", what);
        } else {
            CHECK(tide_cpu_reduce(op, TIDE_F64, got, x, outer, red, inner) == 0, "%s: %s", what, tide_last_error());
            check_close(what, got, want, m, 1e-14, 1e-14);
            f64_to_f32(xf, x, n);
            tide_cpu_reduce(op, TIDE_F32, gotf, xf, outer, red, inner);
            f32_to_f64(got, gotf, m);
            snprintf(what, sizeof what, "reduce op %d [%d, %d, %d] f32", op, outer, red, inner);
            check_close(what, got, want, m, 1e-6, 1e-6);
        }
    }
    /* max backward: the gradient goes to the first index attaining the max */
    fill_rand(gy, m, -1, 1);
    for (int64_t k = 0; k < n; k++) gw[k] = 0;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < inner; i++) gw[(o * red + argw[o * inner + i]) * inner + i] = gy[o * inner + i];
    for (int64_t k = 0; k < n; k++) gx[k] = 777;   /* every element must be written */
    tide_cpu_reduce(TIDE_RED_MAX, TIDE_F64, got, x, outer, red, inner);
    CHECK(tide_cpu_reduce_max_backward(TIDE_F64, gx, gy, x, got, outer, red, inner) == 0, "reduce_max_backward");
    snprintf(what, sizeof what, "reduce_max_backward [%d, %d, %d]", outer, red, inner);
    check_close(what, gx, gw, n, 0, 0);
    free(x); free(got); free(want); free(gy); free(gx); free(gw); free(arg); free(argw); free(xf); free(gotf);
}

static void test_reduce(void)
{
    reduce_case(3, 5, 4, 1);
    reduce_case(4, 7, 1, 0);
    reduce_case(2, 3, 70, 1);      /* inner crosses the 64-wide block */
    reduce_case(1, 9, 1, 0);
    reduce_case(40, 50, 20, 0);    /* crosses the thread threshold */

    /* f32 sums accumulate in double: 1e8 + many ones would stall in float */
    int64_t n = 4097;
    float *x = malloc(n * sizeof *x);
    x[0] = 16777216.0f;   /* 2^24: adding 1.0f to it in float gives 2^24 again */
    for (int64_t i = 1; i < n; i++) x[i] = 1.0f;
    float s;
    tide_cpu_reduce(TIDE_RED_SUM, TIDE_F32, &s, x, 1, n, 1);
    CHECK(s == 16777216.0f + 4096.0f, "reduce sum f32 accumulates in double: %.1f", s);
    free(x);

    double lz, e[1] = { 0 };
    CHECK(tide_cpu_reduce(TIDE_RED_SUM, TIDE_F64, &lz, e, 1, 0, 1) == 0 && lz == 0.0, "sum over an empty axis = 0");
    CHECK(tide_cpu_reduce(TIDE_RED_LOGSUMEXP, TIDE_F64, &lz, e, 1, 0, 1) == 0 && isinf(lz) && lz < 0, "logsumexp over an empty axis = -inf");
    CHECK(tide_cpu_reduce(TIDE_RED_MAX, TIDE_F64, &lz, e, 1, 0, 1) != 0 && error_mentions("max", "empty"),
          "max over an empty axis fails: %s", tide_last_error());
    double nanrow[3] = { 1, NAN, 5 };
    int64_t am;
    tide_cpu_reduce(TIDE_RED_MAX, TIDE_F64, &lz, nanrow, 1, 3, 1);
    tide_cpu_reduce(TIDE_RED_ARGMAX, TIDE_F64, &am, nanrow, 1, 3, 1);
    CHECK(isnan(lz) && am == 1, "max propagates NaN (%g, argmax %lld)", lz, (long long)am);
    CHECK(tide_cpu_reduce(TIDE_RED_SUM, TIDE_BF16, &lz, e, 1, 1, 1) != 0 && error_mentions("sum", "bf16"),
          "reduce bf16 rejected: %s", tide_last_error());
}

/* ---- gemm -------------------------------------------------------------------------------------- */

/* C = alpha op(A) op(B) + beta C with the stored layouts of backend.h */
static void ref_gemm(int ta, int tb, int M, int N, int K, double alpha, const double *A, int lda, const double *B,
                     int ldb, double beta, double *C, int ldc)
{
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++)
                s += (ta ? A[k * lda + i] : A[i * lda + k]) * (tb ? B[j * ldb + k] : B[k * ldb + j]);
            C[i * ldc + j] = alpha * s + beta * C[i * ldc + j];
        }
}

static void test_gemm(void)
{
    enum { M = 5, N = 7, K = 3, PAD = 2, BATCH = 3 };
    double A[BATCH * 64], B[BATCH * 64], C[BATCH * 64], W[BATCH * 64];
    float Af[BATCH * 64], Bf[BATCH * 64], Cf[BATCH * 64];
    double Cd[BATCH * 64];
    char what[96];
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            int lda = (ta ? M : K) + PAD, ldb = (tb ? K : N) + PAD, ldc = N + PAD;
            int sa = 64, sc = 64;
            fill_rand(A, BATCH * 64, -1, 1);
            fill_rand(B, BATCH * 64, -1, 1);
            fill_rand(C, BATCH * 64, -1, 1);
            memcpy(W, C, sizeof C);
            ref_gemm(ta, tb, M, N, K, 0.7, A, lda, B, ldb, 0.3, W, ldc);
            snprintf(what, sizeof what, "gemm ta=%d tb=%d f64", ta, tb);
            CHECK(tide_cpu_gemm(TIDE_F64, ta, tb, M, N, K, 0.7, A, lda, B, ldb, 0.3, C, ldc) == 0, "%s: %s", what, tide_last_error());
            check_close(what, C, W, 64, 1e-12, 1e-12);   /* the padding columns must stay as they were */

            f64_to_f32(Af, A, BATCH * 64);
            f64_to_f32(Bf, B, BATCH * 64);
            fill_rand(C, BATCH * 64, -1, 1);
            f64_to_f32(Cf, C, BATCH * 64);
            f32_to_f64(A, Af, BATCH * 64);
            f32_to_f64(B, Bf, BATCH * 64);
            f32_to_f64(W, Cf, BATCH * 64);
            ref_gemm(ta, tb, M, N, K, 1.0, A, lda, B, ldb, 0.0, W, ldc);
            tide_cpu_gemm(TIDE_F32, ta, tb, M, N, K, 1.0, Af, lda, Bf, ldb, 0.0, Cf, ldc);
            f32_to_f64(Cd, Cf, BATCH * 64);
            snprintf(what, sizeof what, "gemm ta=%d tb=%d f32", ta, tb);
            check_close(what, Cd, W, 64, 1e-4, 1e-6);

            /* batched: A and C step by 64 elements; B shared (sb = 0) and per batch (sb = 64) */
            for (int sb = 0; sb <= 64; sb += 64) {
                fill_rand(C, BATCH * 64, -1, 1);
                memcpy(W, C, sizeof C);
                for (int b = 0; b < BATCH; b++)
                    ref_gemm(ta, tb, M, N, K, -1.5, A + b * sa, lda, B + b * sb, ldb, 1.0, W + b * sc, ldc);
                snprintf(what, sizeof what, "gemm_batched ta=%d tb=%d sb=%d f64", ta, tb, sb);
                CHECK(tide_cpu_gemm_batched(TIDE_F64, ta, tb, M, N, K, -1.5, A, lda, sa, B, ldb, sb, 1.0, C, ldc, sc,
                                            BATCH) == 0, "%s: %s", what, tide_last_error());
                check_close(what, C, W, BATCH * 64, 1e-12, 1e-12);
                f64_to_f32(Cf, W, BATCH * 64);   /* start from the same C, compare f32 with f64 */
                memcpy(C, W, sizeof C);
                f32_to_f64(W, Cf, BATCH * 64);
                for (int b = 0; b < BATCH; b++)
                    ref_gemm(ta, tb, M, N, K, 2.0, A + b * sa, lda, B + b * sb, ldb, 0.5, W + b * sc, ldc);
                tide_cpu_gemm_batched(TIDE_F32, ta, tb, M, N, K, 2.0, Af, lda, sa, Bf, ldb, sb, 0.5, Cf, ldc, sc, BATCH);
                f32_to_f64(Cd, Cf, BATCH * 64);
                snprintf(what, sizeof what, "gemm_batched ta=%d tb=%d sb=%d f32", ta, tb, sb);
                check_close(what, Cd, W, BATCH * 64, 1e-4, 1e-5);
            }
        }

    /* a bigger product (BLAS threads) against the triple loop */
    enum { BM = 64, BN = 48, BK = 80 };
    double *a = malloc(BM * BK * sizeof *a), *b = malloc(BK * BN * sizeof *b), *c = malloc(BM * BN * sizeof *c),
           *w = malloc(BM * BN * sizeof *w);
    fill_rand(a, BM * BK, -1, 1);
    fill_rand(b, BK * BN, -1, 1);
    for (int i = 0; i < BM * BN; i++) c[i] = w[i] = 0;
    ref_gemm(0, 1, BM, BN / 2, BK, 1.0, a, BK, b, BK, 0.0, w, BN);
    tide_cpu_gemm(TIDE_F64, 0, 1, BM, BN / 2, BK, 1.0, a, BK, b, BK, 0.0, c, BN);
    check_close("gemm 64x24x80 f64", c, w, BM * BN, 1e-12, 1e-12);
    free(a); free(b); free(c); free(w);

    /* K = 0: C = beta C; beta = 0 clears even NaN */
    double c0[4] = { 1, 2, NAN, 4 };
    CHECK(tide_cpu_gemm(TIDE_F64, 0, 0, 2, 2, 0, 1.0, A, 1, B, 2, 2.0, c0, 2) == 0 && c0[0] == 2 && c0[3] == 8,
          "gemm K = 0 scales C by beta: %g %g", c0[0], c0[3]);
    CHECK(tide_cpu_gemm(TIDE_F64, 0, 0, 2, 2, 0, 1.0, A, 1, B, 2, 0.0, c0, 2) == 0 && c0[2] == 0.0,
          "gemm K = 0, beta = 0 writes zeros (got %g)", c0[2]);
    CHECK(tide_cpu_gemm(TIDE_F32, 0, 0, 0, 3, 2, 1.0, Af, 2, Bf, 3, 0.0, Cf, 3) == 0, "gemm M = 0 is fine");
    CHECK(tide_cpu_gemm(TIDE_F64, 0, 0, -1, 2, 2, 1.0, A, 2, B, 2, 0.0, C, 2) != 0 && error_mentions("gemm", "M = -1"),
          "gemm M = -1 rejected: %s", tide_last_error());
    CHECK(tide_cpu_gemm(TIDE_F64, 0, 0, 2, 3, 4, 1.0, A, 3, B, 3, 0.0, C, 3) != 0 && error_mentions("lda = 3", NULL),
          "gemm lda < K rejected: %s", tide_last_error());
    CHECK(tide_cpu_gemm(TIDE_BF16, 0, 0, 2, 2, 2, 1.0, A, 2, B, 2, 0.0, C, 2) != 0 && error_mentions("bf16", NULL),
          "gemm bf16 rejected on cpu: %s", tide_last_error());
}

/* batch-invariant mode: the same reference checks, then every element is bitwise the fma chain over k in sequence
   (kernels/cpu/gemm.c), so a row of an M-row product equals that row alone: for every transpose, f32 and f64, M on
   both sides of the narrow path (fewer than 4 rows) and of the row tiles, N around the 32-column (16 for f64) panels
   and the narrow path's 8-column groups, ld > the row length, alpha and beta, and 1 or 2 threads */
#define DEFINE_INVARIANT_CASE(T, FMA, DT)                                                                       \
    static int invariant_case_##T(int ta, int tb, int M, int N, int K, double alpha, double beta, int *cases)  \
    {                                                                                                           \
        int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 1, bad = 0;                               \
        T *A = malloc(sizeof(T) * (size_t)((ta ? K : M) * lda)), *B = malloc(sizeof(T) * (size_t)((tb ? N : K) * ldb)); \
        T *C = malloc(sizeof(T) * (size_t)(M * ldc)), *C2 = malloc(sizeof(T) * (size_t)(M * ldc));              \
        T *C0 = malloc(sizeof(T) * (size_t)(M * ldc)), *row = malloc(sizeof(T) * (size_t)(N + 1));              \
        T *a1 = malloc(sizeof(T) * (size_t)K);                                                                  \
        for (int i = 0; i < (ta ? K : M) * lda; i++) A[i] = (T)(sin(0.7 * i + ta) * 3.1);                      \
        for (int i = 0; i < (tb ? N : K) * ldb; i++) B[i] = (T)(cos(1.3 * i + tb) * 1.7);                      \
        for (int i = 0; i < M * ldc; i++) C0[i] = (T)(0.25 * i - 3);                                            \
        memcpy(C, C0, sizeof(T) * (size_t)(M * ldc));                                                           \
        memcpy(C2, C0, sizeof(T) * (size_t)(M * ldc));                                                          \
        tide_cpu_set_threads(1);                                                                                \
        tide_cpu_gemm(DT, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);                                \
        tide_cpu_set_threads(2);                                                                                \
        tide_cpu_gemm(DT, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C2, ldc);                               \
        bad += memcmp(C, C2, sizeof(T) * (size_t)(M * ldc)) != 0;                                               \
        for (int i = 0; i < M; i++) {                                                                           \
            for (int k = 0; k < K; k++) a1[k] = ta ? A[k * lda + i] : A[i * lda + k];                           \
            for (int j = 0; j < N; j++) {                                                                       \
                T acc = 0;                                                                                      \
                for (int k = 0; k < K; k++) acc = FMA(a1[k], tb ? B[j * ldb + k] : B[k * ldb + j], acc);        \
                T v = (T)alpha * acc, want = beta == 0.0 ? v : FMA((T)beta, C0[i * ldc + j], v);                   \
                bad += memcmp(&want, &C[i * ldc + j], sizeof(T)) != 0;                                          \
                row[j] = C0[i * ldc + j];                                                                       \
            }                                                                                                   \
            /* row i alone, stored as a [1, K] row (or a [K, 1] column when transposed) */                      \
            tide_cpu_gemm(DT, ta, tb, 1, N, K, alpha, a1, ta ? 1 : K, B, ldb, beta, row, N);                    \
            bad += memcmp(row, C + i * ldc, sizeof(T) * (size_t)N) != 0;                                        \
            (*cases)++;                                                                                         \
        }                                                                                                       \
        free(A); free(B); free(C); free(C2); free(C0); free(row); free(a1);                                     \
        return bad;                                                                                             \
    }
DEFINE_INVARIANT_CASE(float, fmaf, TIDE_F32)
DEFINE_INVARIANT_CASE(double, fma, TIDE_F64)

static void test_gemm_invariant(int threads)
{
    CHECK(tide_cpu_set_batch_invariant(1) == 0 && tide_cpu_batch_invariant() == 1, "batch-invariant mode turns on");
    test_gemm();
    static const int Ks[] = { 1, 5, 16, 37, 64 }, Ns[] = { 1, 3, 9, 16, 31, 33, 70 }, Ms[] = { 1, 3, 4, 11 };
    int bad = 0, cases = 0;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int ki = 0; ki < 5; ki++)
                for (int ni = 0; ni < 7; ni++)
                    for (int mi = 0; mi < 4; mi++) {
                        int M = Ms[mi], N = Ns[ni], K = Ks[ki];
                        double alpha = ki % 2 ? 0.75 : 1.0, beta = ni % 3 == 1 ? -0.5 : 0.0;
                        bad += invariant_case_float(ta, tb, M, N, K, alpha, beta, &cases);
                        bad += invariant_case_double(ta, tb, M, N, K, alpha, beta, &cases);
                    }
    CHECK(bad == 0, "batch-invariant gemm: %d mismatches in %d rows (against the fma chain, the row alone or the "
          "other thread count)", bad, cases);
    tide_cpu_set_threads(threads);
    CHECK(tide_cpu_set_batch_invariant(0) == 1 && tide_cpu_batch_invariant() == 0, "batch-invariant mode turns off");
}

/* random A, B and C in [-1, 1), each held as f32 (Af, Bf, Cf) and as the same values in f64 (A, B, W) */
static void f32_operands(double *A, float *Af, size_t na, double *B, float *Bf, size_t nb, double *W, float *Cf,
                         size_t nc)
{
    fill_rand(A, (int64_t)na, -1, 1);
    fill_rand(B, (int64_t)nb, -1, 1);
    fill_rand(W, (int64_t)nc, -1, 1);
    f64_to_f32(Af, A, (int64_t)na);
    f64_to_f32(Bf, B, (int64_t)nb);
    f64_to_f32(Cf, W, (int64_t)nc);
    f32_to_f64(A, Af, (int64_t)na);
    f32_to_f64(B, Bf, (int64_t)nb);
    f32_to_f64(W, Cf, (int64_t)nc);
}

/* the default mode's short-K products (gemm.c own_is_faster: f32, A not transposed, K <= 96, M >= 256) run the
   fma-chain kernel: against the double triple loop, and bitwise the batch-invariant mode's result (the same
   kernel; OpenBLAS would round differently); K = 97 and a transposed A stay on BLAS (only the triple loop) */
static void test_gemm_short_k(void)
{
    static const int Ks[] = { 1, 17, 64, 96, 97 };
    enum { M = 300, N = 70, PAD = 3 };
    int bad = 0, differ = 0, cases = 0;
    for (int ki = 0; ki < 5; ki++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                int K = Ks[ki], lda = (ta ? M : K) + PAD, ldb = (tb ? K : N) + PAD, ldc = N + PAD;
                size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb, nc = (size_t)M * ldc;
                double *A = malloc(na * sizeof *A), *B = malloc(nb * sizeof *B), *W = malloc(nc * sizeof *W);
                float *Af = malloc(na * sizeof *Af), *Bf = malloc(nb * sizeof *Bf), *C1 = malloc(nc * sizeof *C1),
                      *C2 = malloc(nc * sizeof *C2);
                f32_operands(A, Af, na, B, Bf, nb, W, C1, nc);
                memcpy(C2, C1, nc * sizeof *C1);
                ref_gemm(ta, tb, M, N, K, 0.7, A, lda, B, ldb, 0.3, W, ldc);
                CHECK(tide_cpu_gemm(TIDE_F32, ta, tb, M, N, K, 0.7, Af, lda, Bf, ldb, 0.3, C1, ldc) == 0,
                      "short-K gemm: %s", tide_last_error());
                tide_cpu_set_batch_invariant(1);
                tide_cpu_gemm(TIDE_F32, ta, tb, M, N, K, 0.7, Af, lda, Bf, ldb, 0.3, C2, ldc);
                tide_cpu_set_batch_invariant(0);
                int own = !ta && K <= 96;
                for (size_t i = 0; i < nc; i++) {
                    double tol = 1e-5 * (1.0 + fabs(W[i])) * (K > 1 ? sqrt((double)K) : 1.0);
                    if (fabs((double)C1[i] - W[i]) > tol) bad++;
                    if (own && memcmp(&C1[i], &C2[i], sizeof(float)) != 0) differ++;
                }
                cases++;
                free(A); free(B); free(W); free(Af); free(Bf); free(C1); free(C2);
            }
    CHECK(bad == 0, "short-K gemm: %d elements off the double reference in %d products", bad, cases);
    CHECK(differ == 0, "short-K gemm (f32, K <= 96, M >= 256): %d elements differ from the batch-invariant kernel's "
          "bits (the default mode should run the same kernel)", differ);
}

/* one f32 product of an own kernel, C = 0.7 op(A) op(B) + 0.3 C on random operands with padded leading dimensions,
   run at 1, 2 and 3 threads: *bad counts elements off the double triple loop, *differ those whose bits change with the
   thread count. The float operands stay in *Af, *Bf for the caller's own checks (it frees them). */
static void gemm_threads_case(const char *what, int ta, int tb, int M, int N, int K, int lda, int ldb, float **Af,
                              float **Bf, int *bad, int *differ)
{
    int ldc = N + 3, threads0 = tide_cpu_get_threads();
    size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb, nc = (size_t)M * ldc;
    double *A = malloc(na * sizeof *A), *B = malloc(nb * sizeof *B), *W = malloc(nc * sizeof *W);
    float *C[3], *C0 = malloc(nc * sizeof *C0);
    *Af = malloc(na * sizeof **Af);
    *Bf = malloc(nb * sizeof **Bf);
    f32_operands(A, *Af, na, B, *Bf, nb, W, C0, nc);
    ref_gemm(ta, tb, M, N, K, 0.7, A, lda, B, ldb, 0.3, W, ldc);
    for (int th = 1; th <= 3; th++) {
        C[th - 1] = malloc(nc * sizeof *C0);
        memcpy(C[th - 1], C0, nc * sizeof *C0);
        tide_cpu_set_threads(th);
        CHECK(tide_cpu_gemm(TIDE_F32, ta, tb, M, N, K, 0.7, *Af, lda, *Bf, ldb, 0.3, C[th - 1], ldc) == 0, "%s: %s",
              what, tide_last_error());
    }
    tide_cpu_set_threads(threads0);
    for (size_t i = 0; i < nc; i++) {
        double tol = 1e-5 * (1.0 + fabs(W[i])) * sqrt((double)K);
        if (fabs((double)C[0][i] - W[i]) > tol) (*bad)++;
        if (memcmp(&C[0][i], &C[1][i], sizeof(float)) || memcmp(&C[0][i], &C[2][i], sizeof(float))) (*differ)++;
    }
    for (int t = 0; t < 3; t++) free(C[t]);
    free(A); free(B); free(W); free(C0);
}

/* few output columns (gemm.c gemm_narrow: f32, C = A Bᵀ, N <= 32, K >= 97): against the double triple loop, with
   padded leading dimensions, alpha and beta, K a multiple of 16 and not (the zero-padded last partial vector),
   M and N past and short of the 4 x 4 tile; then bitwise the same at 1, 2 and 3 threads, and a row computed
   alone bitwise the same row of the batch (each element's arithmetic depends on K alone) */
static void test_gemm_narrow(void)
{
    static const int shapes[][3] = { {1, 1, 97}, {3, 5, 100}, {4, 4, 112}, {37, 16, 256}, {70, 32, 130},
                                     {301, 17, 1000}, {2048, 16, 256} };
    int bad = 0, differ = 0, alone = 0, cases = 0;
    for (int si = 0; si < 7; si++) {
        int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2], lda = K + 5, ldb = K + 6;
        float *Af, *Bf;
        gemm_threads_case("narrow gemm", 0, 1, M, N, K, lda, ldb, &Af, &Bf, &bad, &differ);
        /* the last row alone, beta = 0 */
        float *row = malloc((size_t)N * sizeof *row);
        tide_cpu_gemm(TIDE_F32, 0, 1, 1, N, K, 1.0, Af + (size_t)(M - 1) * lda, lda, Bf, ldb, 0.0, row, N);
        float *full = malloc((size_t)M * N * sizeof *full);
        tide_cpu_gemm(TIDE_F32, 0, 1, M, N, K, 1.0, Af, lda, Bf, ldb, 0.0, full, N);
        alone += memcmp(row, full + (size_t)(M - 1) * N, (size_t)N * sizeof *row) != 0;
        cases++;
        free(row); free(full); free(Af); free(Bf);
    }
    CHECK(bad == 0, "narrow gemm (f32, N <= 32, K >= 97): %d elements off the double reference in %d products", bad, cases);
    CHECK(differ == 0, "narrow gemm: %d elements differ between 1, 2 and 3 threads", differ);
    CHECK(alone == 0, "narrow gemm: %d of %d products give their last row other bits than the row alone", alone, cases);
}

/* a long inner dimension (gemm.c gemm_long_k: f32, C = Aᵀ B, K >= 1,024, M N <= 32,768): against the double triple
   loop with padded leading dimensions, alpha and beta, M and N off the tile and the segment (K not a multiple of
   512), beta = 0 over NaN; bitwise the same at 1, 2 and 3 threads; the first columns of A alone give bitwise the
   same rows as within the wider product (each element's arithmetic depends on K alone) */
static void test_gemm_long_k(void)
{
    static const int shapes[][3] = { {64, 64, 1024}, {37, 70, 1100}, {8, 32, 1536}, {130, 17, 2049}, {5, 3, 1024},
                                      {320, 64, 4096} };
    int bad = 0, differ = 0, alone = 0, nan_kept = 0, cases = 0;
    for (int si = 0; si < 6; si++) {
        int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2], lda = M + 3, ldb = N + 4;
        float *Af, *Bf;
        gemm_threads_case("long-K gemm", 1, 0, M, N, K, lda, ldb, &Af, &Bf, &bad, &differ);
        /* beta = 0 over NaN; then the first half of A's columns alone (rows 0 .. M/2 of C) */
        float *full = malloc((size_t)M * N * sizeof *full), *part = malloc((size_t)M * N * sizeof *part);
        for (int64_t i = 0; i < (int64_t)M * N; i++) full[i] = part[i] = NAN;
        tide_cpu_gemm(TIDE_F32, 1, 0, M, N, K, 1.0, Af, lda, Bf, ldb, 0.0, full, N);
        for (int64_t i = 0; i < (int64_t)M * N; i++) nan_kept += isnan(full[i]);
        int Mh = M / 2 > 0 ? M / 2 : 1;
        tide_cpu_gemm(TIDE_F32, 1, 0, Mh, N, K, 1.0, Af, lda, Bf, ldb, 0.0, part, N);
        alone += memcmp(part, full, (size_t)Mh * N * sizeof *part) != 0;
        cases++;
        free(full); free(part); free(Af); free(Bf);
    }
    CHECK(bad == 0, "long-K gemm (f32, Aᵀ B, K >= 1024): %d elements off the double reference in %d products", bad, cases);
    CHECK(differ == 0, "long-K gemm: %d elements differ between 1, 2 and 3 threads", differ);
    CHECK(nan_kept == 0, "long-K gemm: beta = 0 kept %d NaN of C", nan_kept);
    CHECK(alone == 0, "long-K gemm: %d of %d products give their first rows other bits than the wider product", alone, cases);
}

/* the long-K product's arithmetic as gemm.c states it, element by element: per segment of 512 rows one fmaf chain over
   its rows in order from 0, the segments' partials summed in order, then alpha times the sum (beta = 0). Bitwise,
   so the kernel's blocking of rows and tiles (in L1-sized blocks, edge tiles on padded copies) never changes a bit */
static void test_gemm_long_k_chains(void)
{
    static const int shapes[][3] = { {64, 64, 4096}, {37, 70, 1100}, {130, 17, 2049}, {5, 48, 1536} };
    int differ = 0;
    for (int si = 0; si < 4; si++) {
        int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2], lda = M + 1, ldb = N + 2;
        float *A = malloc((size_t)K * lda * sizeof *A), *B = malloc((size_t)K * ldb * sizeof *B);
        float *C = malloc((size_t)M * N * sizeof *C);
        for (size_t i = 0; i < (size_t)K * lda; i++) A[i] = (float)urand(-1, 1);
        for (size_t i = 0; i < (size_t)K * ldb; i++) B[i] = (float)urand(-1, 1);
        tide_cpu_gemm(TIDE_F32, 1, 0, M, N, K, 0.7, A, lda, B, ldb, 0.0, C, N);
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                float sum = 0.0f;
                for (int k0 = 0; k0 < K; k0 += 512) {
                    float part = 0.0f;
                    for (int k = k0; k < K && k < k0 + 512; k++) part = fmaf(A[(size_t)k * lda + i], B[(size_t)k * ldb + j], part);
                    sum = k0 == 0 ? part : sum + part;
                }
                float want = 0.7f * sum;
                differ += memcmp(&want, &C[(size_t)i * N + j], sizeof want) != 0;
            }
        free(A); free(B); free(C);
    }
    CHECK(differ == 0, "long-K gemm: %d elements differ from the segment chains' stated arithmetic", differ);
}

/* beta = 0 on a C past the caches (gemm.c zeroes it with streaming stores and adds the product with beta 1): NaN in C
   does not survive, the padding columns stay as they were, the values match the double reference, and the bits equal
   the same product with beta = 1 onto a zeroed C (what OpenBLAS's own beta = 0 does) */
static void test_gemm_beta0_large(void)
{
    enum { M = 1100, N = 1000, K = 100, PAD = 3 };
    int lda = K, ldb = K, ldc = N + PAD;
    size_t na = (size_t)M * lda, nb = (size_t)N * ldb, nc = (size_t)M * ldc;
    double *A = malloc(na * sizeof *A), *B = malloc(nb * sizeof *B), *W = malloc(nc * sizeof *W);
    float *Af = malloc(na * sizeof *Af), *Bf = malloc(nb * sizeof *Bf), *C = malloc(nc * sizeof *C),
          *Z = malloc(nc * sizeof *Z);
    f32_operands(A, Af, na, B, Bf, nb, W, C, nc);
    ref_gemm(0, 1, M, N, K, 0.7, A, lda, B, ldb, 0.0, W, ldc);
    for (size_t i = 0; i < nc; i++) { C[i] = (i % ldc) < N ? NAN : -7.0f; Z[i] = (i % ldc) < N ? 0.0f : -7.0f; }
    CHECK(tide_cpu_gemm(TIDE_F32, 0, 1, M, N, K, 0.7, Af, lda, Bf, ldb, 0.0, C, ldc) == 0, "gemm beta 0: %s",
          tide_last_error());
    tide_cpu_gemm(TIDE_F32, 0, 1, M, N, K, 0.7, Af, lda, Bf, ldb, 1.0, Z, ldc);
    int bad = 0, pad = 0, differ = 0;
    for (size_t i = 0; i < nc; i++) {
        if ((i % ldc) >= N) { pad += C[i] != -7.0f; continue; }
        if (!(fabs((double)C[i] - W[i]) <= 1e-5 * (1.0 + fabs(W[i])) * 10.0)) bad++;
        differ += memcmp(&C[i], &Z[i], sizeof(float)) != 0;
    }
    CHECK(bad == 0, "gemm beta 0 on a large C: %d elements off the double reference (NaN kept?)", bad);
    CHECK(pad == 0, "gemm beta 0 on a large C: %d padding elements written", pad);
    CHECK(differ == 0, "gemm beta 0 on a large C: %d elements differ from beta 1 onto zeros", differ);
    free(A); free(B); free(W); free(Af); free(Bf); free(C); free(Z);
}

/* ---- index ops ---------------------------------------------------------------------------------- */

static void test_index(void)
{
    enum { OUT = 2, NSRC = 5, IN = 3, NIDX = 4 };
    double x[OUT * NSRC * IN], out[OUT * NIDX * IN + 1], want[OUT * NIDX * IN];
    for (int i = 0; i < OUT * NSRC * IN; i++) x[i] = i + 0.5;
    int32_t idx32[NIDX] = { 4, 0, 4, 2 };
    int64_t idx64[NIDX] = { 4, 0, 4, 2 };
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < NIDX; j++)
            for (int i = 0; i < IN; i++) want[(o * NIDX + j) * IN + i] = x[(o * NSRC + idx32[j]) * IN + i];
    for (int dt = 0; dt < 2; dt++) {
        out[OUT * NIDX * IN] = -9;
        CHECK(tide_cpu_index_select(TIDE_F64, out, x, dt ? (void *)idx64 : (void *)idx32, dt ? TIDE_I64 : TIDE_I32,
                                    OUT, NSRC, IN, NIDX) == 0, "index_select: %s", tide_last_error());
        check_close(dt ? "index_select i64 idx" : "index_select i32 idx", out, want, OUT * NIDX * IN, 0, 0);
        CHECK(out[OUT * NIDX * IN] == -9, "index_select wrote past the output");
    }
    /* any dtype: u8 rows */
    uint8_t xb[6] = { 1, 2, 3, 4, 5, 6 }, ob[4];
    int64_t ib[2] = { 2, 0 };
    tide_cpu_index_select(TIDE_U8, ob, xb, ib, TIDE_I64, 1, 3, 2, 2);
    CHECK(ob[0] == 5 && ob[1] == 6 && ob[2] == 1 && ob[3] == 2, "index_select u8");

    /* out of range: an error naming the value and the bound, nothing written */
    int32_t badidx[NIDX] = { 1, 5, 0, 0 };
    for (int i = 0; i < OUT * NIDX * IN; i++) out[i] = -1;
    CHECK(tide_cpu_index_select(TIDE_F64, out, x, badidx, TIDE_I32, OUT, NSRC, IN, NIDX) != 0 &&
          error_mentions("index 5", "[0, 5)"), "index_select index 5 of 5 rejected: %s", tide_last_error());
    CHECK(out[0] == -1, "index_select wrote before failing");
    int64_t negidx[1] = { -1 };
    CHECK(tide_cpu_index_select(TIDE_F64, out, x, negidx, TIDE_I64, OUT, NSRC, IN, 1) != 0 &&
          error_mentions("index -1", NULL), "index_select index -1 rejected: %s", tide_last_error());
    CHECK(tide_cpu_index_select(TIDE_F64, out, x, idx32, TIDE_F32, OUT, NSRC, IN, NIDX) != 0 &&
          error_mentions("i32 or i64", NULL), "index_select f32 indices rejected: %s", tide_last_error());

    /* index_add: duplicates accumulate */
    double gx[OUT * NSRC * IN], gw[OUT * NSRC * IN], gy[OUT * NIDX * IN];
    fill_rand(gy, OUT * NIDX * IN, -1, 1);
    for (int i = 0; i < OUT * NSRC * IN; i++) gx[i] = gw[i] = 0.25 * i;
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < NIDX; j++)
            for (int i = 0; i < IN; i++) gw[(o * NSRC + idx32[j]) * IN + i] += gy[(o * NIDX + j) * IN + i];
    CHECK(tide_cpu_index_add(TIDE_F64, gx, gy, idx64, TIDE_I64, OUT, NSRC, IN, NIDX) == 0, "index_add: %s", tide_last_error());
    check_close("index_add f64 (duplicate indices)", gx, gw, OUT * NSRC * IN, 1e-15, 1e-15);
    float gxf[OUT * NSRC * IN], gyf[OUT * NIDX * IN];
    for (int i = 0; i < OUT * NSRC * IN; i++) gxf[i] = 0.25f * i;
    f64_to_f32(gyf, gy, OUT * NIDX * IN);
    tide_cpu_index_add(TIDE_F32, gxf, gyf, idx32, TIDE_I32, OUT, NSRC, IN, NIDX);
    f32_to_f64(gx, gxf, OUT * NSRC * IN);
    check_close("index_add f32", gx, gw, OUT * NSRC * IN, 1e-6, 1e-6);
    CHECK(tide_cpu_index_add(TIDE_F64, gx, gy, badidx, TIDE_I32, OUT, NSRC, IN, NIDX) != 0 &&
          error_mentions("index_add", "[0, 5)"), "index_add out of range rejected: %s", tide_last_error());

    /* gather / scatter_add along the middle axis: x [2, 4, 3], idx [2, 3, 3] */
    enum { NX = 4, NI = 3 };
    double xg[OUT * NX * IN], og[OUT * NI * IN], wg[OUT * NI * IN];
    int64_t gi[OUT * NI * IN];
    int32_t gi32[OUT * NI * IN];
    fill_rand(xg, OUT * NX * IN, -1, 1);
    for (int k = 0; k < OUT * NI * IN; k++) gi32[k] = (int32_t)(gi[k] = (k * 7 + 3) % NX);
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < NI; j++)
            for (int i = 0; i < IN; i++) {
                int k = (o * NI + j) * IN + i;
                wg[k] = xg[(o * NX + gi[k]) * IN + i];
            }
    CHECK(tide_cpu_gather(TIDE_F64, og, xg, gi, TIDE_I64, OUT, NX, NI, IN) == 0, "gather: %s", tide_last_error());
    check_close("gather f64", og, wg, OUT * NI * IN, 0, 0);
    float xgf[OUT * NX * IN], ogf[OUT * NI * IN];
    f64_to_f32(xgf, xg, OUT * NX * IN);
    tide_cpu_gather(TIDE_F32, ogf, xgf, gi32, TIDE_I32, OUT, NX, NI, IN);
    f32_to_f64(og, ogf, OUT * NI * IN);
    check_close("gather f32", og, wg, OUT * NI * IN, 1e-7, 0);

    double so[OUT * NX * IN], sw[OUT * NX * IN], src[OUT * NI * IN];
    fill_rand(src, OUT * NI * IN, -1, 1);
    for (int i = 0; i < OUT * NX * IN; i++) so[i] = sw[i] = 1.0;
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < NI; j++)
            for (int i = 0; i < IN; i++) {
                int k = (o * NI + j) * IN + i;
                sw[(o * NX + gi[k]) * IN + i] += src[k];
            }
    CHECK(tide_cpu_scatter_add(TIDE_F64, so, src, gi32, TIDE_I32, OUT, NX, NI, IN) == 0, "scatter_add: %s", tide_last_error());
    check_close("scatter_add f64", so, sw, OUT * NX * IN, 1e-15, 1e-15);
    gi[5] = NX;
    for (int i = 0; i < OUT * NX * IN; i++) so[i] = 1.0;
    CHECK(tide_cpu_scatter_add(TIDE_F64, so, src, gi, TIDE_I64, OUT, NX, NI, IN) != 0 && error_mentions("index 4", "[0, 4)"),
          "scatter_add out of range rejected: %s", tide_last_error());
    CHECK(so[0] == 1.0 && so[OUT * NX * IN - 1] == 1.0, "scatter_add wrote before failing");
    CHECK(tide_cpu_gather(TIDE_F64, og, xg, gi, TIDE_I64, OUT, NX, NI, IN) != 0 && error_mentions("gather", "index 4"),
          "gather out of range rejected: %s", tide_last_error());

    int ok = -1;
    int64_t bad = 0;
    CHECK(tide_cpu_check_index("t", idx32, TIDE_I32, NIDX, 5, 0, &bad, &ok) == 0 && ok == 1, "check_index in range: ok = %d", ok);
    CHECK(tide_cpu_check_index("t", gi, TIDE_I64, OUT * NI * IN, NX, 1, &bad, &ok) == 0 && ok == 0 && bad == NX,
          "check_index finds %lld", (long long)bad);
}

/* ---- AdamW ------------------------------------------------------------------------------------- */

static void test_adamw(void)
{
    enum { N = 17 };
    const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    double p[N], m[N], v[N], g[3][N];
    double pw[N], mw[N], vw[N];
    float pf[N], mf[N], vf[N], gf[N];
    fill_rand(p, N, -1, 1);
    for (int s = 0; s < 3; s++) fill_rand(g[s], N, -1, 1);
    g[0][0] = 0.0;   /* a zero gradient: only decay moves the weight on the first step */
    for (int i = 0; i < N; i++) { m[i] = v[i] = 0; pw[i] = p[i]; mw[i] = vw[i] = 0; pf[i] = (float)p[i]; mf[i] = vf[i] = 0; }
    for (int t = 0; t < 3; t++) {
        double bc1 = 1 - pow(b1, t + 1), bc2 = 1 - pow(b2, t + 1);
        CHECK(tide_cpu_adamw(TIDE_F64, p, g[t], m, v, NULL, N, lr, b1, b2, eps, wd, bc1, bc2) == 0, "adamw f64: %s", tide_last_error());
        f64_to_f32(gf, g[t], N);
        tide_cpu_adamw(TIDE_F32, pf, gf, mf, vf, NULL, N, lr, b1, b2, eps, wd, bc1, bc2);
        /* closed form: the moments are geometric sums of the gradients */
        for (int i = 0; i < N; i++) {
            double ms = 0, vs = 0;
            for (int s = 0; s <= t; s++) {
                ms += (1 - b1) * pow(b1, t - s) * g[s][i];
                vs += (1 - b2) * pow(b2, t - s) * g[s][i] * g[s][i];
            }
            mw[i] = ms;
            vw[i] = vs;
            pw[i] = pw[i] * (1 - lr * wd);
            pw[i] -= lr * (ms / bc1) / (sqrt(vs / bc2) + eps);
        }
        char what[64];
        snprintf(what, sizeof what, "adamw f64 step %d: p", t);
        check_close(what, p, pw, N, 1e-12, 1e-12);
        snprintf(what, sizeof what, "adamw f64 step %d: m", t);
        check_close(what, m, mw, N, 1e-12, 1e-12);
        snprintf(what, sizeof what, "adamw f64 step %d: v", t);
        check_close(what, v, vw, N, 1e-12, 1e-12);
    }
    double pfd[N];
    f32_to_f64(pfd, pf, N);
    check_close("adamw f32 after 3 steps vs f64", pfd, p, N, 1e-6, 1e-6);
    CHECK(tide_cpu_adamw(TIDE_I32, p, g[0], m, v, NULL, N, lr, b1, b2, eps, wd, 0.1, 0.05) != 0 && error_mentions("adamw", "i32"),
          "adamw i32 rejected on cpu: %s", tide_last_error());   /* bf16 and the non-finite flag: test_optim.c */
}

/* ---- threads ------------------------------------------------------------------------------------ */

static void test_threads(int initial)
{
    const char *env = getenv("TIDE_NUM_THREADS");
    if (env && atoi(env) >= 1)
        CHECK(initial == atoi(env), "TIDE_NUM_THREADS=%s at load gives %d threads", env, initial);
    CHECK(initial >= 1, "default thread count %d", initial);
    tide_cpu_set_threads(1);
    CHECK(tide_cpu_get_threads() == 1, "set_threads(1) -> %d", tide_cpu_get_threads());
    tide_cpu_set_threads(3);
    CHECK(tide_cpu_get_threads() == 3, "set_threads(3) -> %d", tide_cpu_get_threads());
    /* 0 goes back to the default, which TIDE_NUM_THREADS overrides (an unusable value is ignored) */
    unsetenv("TIDE_NUM_THREADS");
    tide_cpu_set_threads(0);
    int cores = tide_cpu_get_threads();
    setenv("TIDE_NUM_THREADS", "5", 1);
    tide_cpu_set_threads(0);
    CHECK(tide_cpu_get_threads() == 5, "set_threads(0) with TIDE_NUM_THREADS=5 -> %d", tide_cpu_get_threads());
    setenv("TIDE_NUM_THREADS", "lots", 1);
    tide_cpu_set_threads(0);
    int fallback = tide_cpu_get_threads();
    CHECK(cores >= 1 && fallback == cores, "set_threads(0) with TIDE_NUM_THREADS=lots -> %d, expected the core count %d",
          fallback, cores);
    if (env) setenv("TIDE_NUM_THREADS", env, 1);
    else unsetenv("TIDE_NUM_THREADS");
    tide_cpu_set_threads(initial);
    const char *info = tide_cpu_blas_info();
    CHECK(info && strncmp(info, "OpenBLAS", 8) == 0 && strstr(info, "(openmp)"), "blas_info \"%s\"", info ? info : "(null)");
    printf("threads %d, %s\n", initial, info);
}

/* ---- the OpenBLAS kernels for a CPU that OpenBLAS did not recognise ----------------------------------------
   Only a generic fallback core is replaced, by the widest kernels the CPU's vector units run; a core OpenBLAS chose
   itself stays, whatever the vector units. */
static void test_blas_core_choice(void)
{
    static const struct { const char *detected; int avx512, avx2_fma, avx; const char *want; } cases[] = {
        { "Prescott", 1, 1, 1, "SkylakeX" },   { "prescott", 1, 1, 1, "SkylakeX" }, { "Prescott", 0, 1, 1, "Haswell" },
        { "Prescott", 0, 0, 1, "Sandybridge" }, { "Prescott", 0, 0, 0, NULL },      { "Core2", 0, 1, 1, "Haswell" },
        { "Nehalem", 1, 1, 1, "SkylakeX" },    { "Penryn", 0, 0, 1, "Sandybridge" }, { "Haswell", 1, 1, 1, NULL },
        { "SkylakeX", 1, 1, 1, NULL },         { "Zen", 0, 1, 1, NULL },            { "Sandybridge", 0, 1, 1, NULL },
        { "Cooperlake", 1, 1, 1, NULL },       { NULL, 1, 1, 1, NULL },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *got = tide_cpu_blas_core_choice(cases[i].detected, cases[i].avx512, cases[i].avx2_fma, cases[i].avx);
        int same = got && cases[i].want ? strcmp(got, cases[i].want) == 0 : got == cases[i].want;
        CHECK(same, "blas core choice for %s (avx512 %d, avx2+fma %d, avx %d): %s, expected %s",
              cases[i].detected ? cases[i].detected : "(null)", cases[i].avx512, cases[i].avx2_fma, cases[i].avx,
              got ? got : "(null)", cases[i].want ? cases[i].want : "(null)");
    }
    /* the process's own hint: none once OPENBLAS_CORETYPE is set (the user's choice, or the executable's) */
    const char *env = getenv("OPENBLAS_CORETYPE");
    setenv("OPENBLAS_CORETYPE", "Prescott", 1);
    CHECK(tide_cpu_blas_core_hint() == NULL, "core hint with OPENBLAS_CORETYPE set: %s", tide_cpu_blas_core_hint());
    if (env) setenv("OPENBLAS_CORETYPE", env, 1);
    else unsetenv("OPENBLAS_CORETYPE");
}

/* ---- first_nonfinite over many buffers, against a per-buffer reference ----------------------------------
   Sizes straddle the chunk size (65,536); each round plants one non-finite value (a NaN with an odd payload,
   an infinity, a bf16 NaN) at a random place of a random buffer, sometimes two, and checks the smallest failing
   index on 1 and 2 threads. */
static void test_first_nonfinite(void)
{
    enum { NB = 7 };
    const int dt[NB] = { TIDE_F32, TIDE_F64, TIDE_BF16, TIDE_F32, TIDE_I32, TIDE_F32, TIDE_F64 };
    const int64_t len[NB] = { 3, 65536, 70001, 200000, 5, 0, 131073 };
    const size_t width[NB] = { 4, 8, 2, 4, 4, 4, 8 };
    void *buf[NB];
    const void *ptr[NB];
    for (int i = 0; i < NB; i++) {
        buf[i] = calloc((size_t)(len[i] ? len[i] : 1), width[i]);
        ptr[i] = buf[i];
    }
    int threads0 = tide_cpu_get_threads(), first = -1;
    CHECK(tide_cpu_first_nonfinite(NB, dt, ptr, len, &first) == 0 && first == NB, "first_nonfinite all finite = %d", first);
    CHECK(tide_cpu_first_nonfinite(0, dt, ptr, len, &first) == 0 && first == 0, "first_nonfinite of none = %d", first);
    for (int round = 0; round < 60; round++) {
        int planted[2], np = 1 + (round % 3 == 0);
        for (int k = 0; k < np; k++) {
            int i;
            do i = (int)(urand(0, NB)); while (i >= NB || dt[i] == TIDE_I32 || len[i] == 0);
            int64_t at = (int64_t)urand(0, (double)len[i]);
            if (at >= len[i]) at = len[i] - 1;
            if (round % 4 == 3) at = (at / 65536) * 65536 + (at % 2 ? 65535 : 0);   /* chunk edges */
            if (at >= len[i]) at = len[i] - 1;
            if (dt[i] == TIDE_F32) ((uint32_t *)buf[i])[at] = round % 2 ? 0xFFEC0001u : 0x7F800000u;
            else if (dt[i] == TIDE_F64) ((uint64_t *)buf[i])[at] = round % 2 ? 0xFFF0000000000001ull : 0x7FF0000000000000ull;
            else ((uint16_t *)buf[i])[at] = round % 2 ? 0xFFC1u : 0xFF80u;
            planted[k] = i;
        }
        int want = NB;
        for (int i = 0; i < NB; i++) {
            int fin = 1;
            tide_cpu_all_finite(dt[i], buf[i], len[i], &fin);
            if (!fin && i < want) want = i;
        }
        CHECK(want == (np == 2 && planted[1] < planted[0] ? planted[1] : planted[0]), "reference sees buffer %d", want);
        for (int th = 1; th <= 2; th++) {
            tide_cpu_set_threads(th);
            first = -1;
            CHECK(tide_cpu_first_nonfinite(NB, dt, ptr, len, &first) == 0, "first_nonfinite: %s", tide_last_error());
            CHECK(first == want, "first_nonfinite round %d, %d thread(s) = %d, reference %d", round, th, first, want);
        }
        for (int i = 0; i < NB; i++) memset(buf[i], 0, (size_t)len[i] * width[i]);
    }
    tide_cpu_set_threads(threads0);
    const int bad_dt[1] = { 99 };
    CHECK(tide_cpu_first_nonfinite(1, bad_dt, ptr, len, &first) != 0, "first_nonfinite rejects an unknown dtype");
    const int64_t neg[1] = { -1 };
    CHECK(tide_cpu_first_nonfinite(1, dt, ptr, neg, &first) != 0, "first_nonfinite rejects a negative length");
    for (int i = 0; i < NB; i++) free(buf[i]);
}

int main(void)
{
    int threads = tide_cpu_get_threads();   /* before any test changes it */
    test_memory();
    test_fill();
    test_zero_rows();
    test_copy_stream();
    test_copy();
    test_random();
    test_unary();
    test_binary();
    test_misc_elementwise();
    test_reduce();
    test_gemm();
    test_gemm_invariant(threads);
    test_gemm_short_k();
    test_gemm_narrow();
    test_gemm_beta0_large();
    test_gemm_long_k();
    test_gemm_long_k_chains();
    test_index();
    test_adamw();
    test_first_nonfinite();
    tide_cpu_set_threads(threads);
    test_threads(threads);
    test_blas_core_choice();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

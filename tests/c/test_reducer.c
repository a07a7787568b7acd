/*
 * test-reducer — the gradient reducer on one process (engine/dist/reducer.c; tests/dist/dp_check.sh runs it across
 * ranks): the backward reports a parameter when the last node that reads it has run, so buckets fill during the
 * backward; one used twice by a node, or by two nodes, is reported once, after both; one the graph never reads is
 * filled with zeros at finish and gets a zero gradient; after finish every gradient holds what the backward left
 * (the sum over one rank). Error paths: a non-leaf, a parameter watched twice, arm twice, finish without arm.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tide.h"
#include "testutil.h"

static int g_pass, g_fail;
static void report(int ok, const char *fmt, const char *what, double v)
{
    ok ? g_pass++ : g_fail++;
    printf("%s  ", ok ? "ok  " : "FAIL");
    printf(fmt, what, v);
    printf("\n");
}

static tide_tensor *leaf(int dtype, int64_t n, double base)
{
    double v[8];
    for (int64_t i = 0; i < n; i++) v[i] = base + 0.5 * (double)i;
    tide_tensor *t = tide_from_f64(dtype, 1, (int64_t[]){n}, 0, v);
    tide_set_requires_grad(t, 1);
    return t;
}

static double grad_diff(tide_tensor *p, const double *want)
{
    if (!p->grad) return INFINITY;
    double *g = host(p->grad), d = 0;
    for (int64_t i = 0; i < p->numel; i++) d = fmax(d, fabs(g[i] - want[i]));
    free(g);
    return d;
}

static tide_tensor *sum_all(tide_tensor *x)
{
    tide_tensor *s = tide_sum(x, 1, (int[]){0}, 0);
    return s;
}

int main(void)
{
    /* a, b f64 [4]; c f64 [3] never read; d f32 [2]: with a 40-byte bucket each is its own bucket (d's dtype differs
       anyway). loss = sum(a * b) + sum(b * b) + sum(d * d) */
    tide_tensor *a = leaf(TIDE_F64, 4, 1.0), *b = leaf(TIDE_F64, 4, -2.0), *c = leaf(TIDE_F64, 3, 3.0),
                *d = leaf(TIDE_F32, 2, 0.25);
    tide_tensor *ps[4] = {a, b, c, d};
    tide_reducer *r = tide_reducer_new(4, ps, 40);
    if (!r) { printf("reducer: %s\n", tide_last_error()); return 2; }
    tide_tensor *ab = tide_mul(a, b), *bb = tide_mul(b, b), *dd = tide_mul(d, d);
    tide_tensor *s1 = sum_all(ab), *s2 = sum_all(bb), *s3 = sum_all(dd);
    tide_tensor *t12 = tide_add(s1, s2);
    tide_tensor *s3d = tide_to_dtype(s3, TIDE_F64);
    tide_tensor *loss = tide_add(t12, s3d);
    if (!loss) { printf("graph: %s\n", tide_last_error()); return 2; }
    if (tide_reducer_arm(r)) { printf("arm: %s\n", tide_last_error()); return 2; }
    report(tide_reducer_arm(r) != 0, "%s (%g)", "arm twice is an error", 0);
    if (tide_backward(loss, NULL)) { printf("backward: %s\n", tide_last_error()); return 2; }
    double st[5] = {0};
    if (tide_reducer_finish(r, st)) { printf("finish: %s\n", tide_last_error()); return 2; }
    report(st[2] == 4, "%s: %g", "buckets", st[2]);
    report(st[4] == 3, "%s: %g of 4 (c is never read: filled at finish)", "buckets full during the backward", st[4]);
    report(st[3] == 0, "%s: %g", "no helper thread on one rank", st[3]);
    double wa[4], wb[4], wc[3] = {0, 0, 0}, wd[2];
    for (int i = 0; i < 4; i++) {
        double av = 1.0 + 0.5 * i, bv = -2.0 + 0.5 * i;
        wa[i] = bv;                /* d/da sum(a b) */
        wb[i] = av + 2 * bv;       /* d/db (sum(a b) + sum(b b)): b read by two nodes, one of them twice */
    }
    for (int i = 0; i < 2; i++) wd[i] = 2 * (0.25 + 0.5 * i);
    report(grad_diff(a, wa) == 0, "%s: max |diff| %g", "a's gradient after finish", grad_diff(a, wa));
    report(grad_diff(b, wb) == 0, "%s: max |diff| %g", "b's gradient (three uses) after finish", grad_diff(b, wb));
    report(grad_diff(c, wc) == 0, "%s: max |diff| %g", "c (never read) gets a zero gradient", grad_diff(c, wc));
    report(grad_diff(d, wd) == 0, "%s: max |diff| %g", "d's f32 gradient", grad_diff(d, wd));
    report(tide_reducer_finish(r, st) != 0, "%s (%g)", "finish without arm is an error", 0);
    /* a second reducer on a watched parameter, and a non-leaf */
    report(tide_reducer_new(1, &a, 40) == NULL && strstr(tide_last_error(), "already watched") != NULL, "%s (%g)",
           "a parameter watched twice is refused", 0);
    report(tide_reducer_new(1, &ab, 40) == NULL && strstr(tide_last_error(), "not a leaf") != NULL, "%s (%g)",
           "a non-leaf is refused", 0);
    /* freed: the parameters are no longer watched, a new reducer takes them */
    tide_reducer_free(r);
    report(a->grad_slot == 0, "%s (%g)", "free unwatches the parameters", 0);
    tide_reducer *r2 = tide_reducer_new(4, ps, 1 << 20);
    report(r2 != NULL, "%s (%g)", "a new reducer after free", 0);
    /* ZeRO-2 owners: every owner must be a rank (one here); with owner 0 everywhere one rank keeps every sum */
    report(tide_reducer_set_owners(r2, (int[]){0, 1, 0, 0}) != 0 && strstr(tide_last_error(), "owner 1 is not a rank of 1"),
           "%s (%g)", "an owner that is not a rank is refused", 0);
    report(tide_reducer_set_owners(r2, (int[]){0, 0, 0, 0}) == 0, "%s (%g)", "owners on one rank", 0);
    tide_reducer_free(r2);
    tide_tensor *all[] = {ab, bb, dd, s1, s2, s3, t12, s3d, loss, a, b, c, d};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tide_tensor_release(all[i]);
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

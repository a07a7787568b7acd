/*
 * testutil.h — helpers the C tests share: a tensor's values on the host, and the distances the tests hold to
 * their tolerances. Header-only (static inline), included by the test files.
 */
#ifndef TIDE_TESTUTIL_H
#define TIDE_TESTUTIL_H
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "tide.h"

/* t's values as doubles (malloc'd, the caller frees); a failed copy ends the test with status 2 */
static inline double *host(const tide_tensor *t)
{
    double *b = malloc((size_t)(t->numel ? t->numel : 1) * sizeof *b);
    if (!b || tide_to_f64_buffer(t, b, t->numel)) { printf("  host copy failed: %s\n", tide_last_error()); exit(2); }
    return b;
}

/* max |x_i| */
static inline double max_abs(const double *x, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

/* max |a_i - b_i| */
static inline double max_abs_diff(const double *a, const double *b, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(a[i] - b[i]));
    return m;
}

/* max |a_i - b_i| / (1 + |b_i|): absolute near zero, relative for large values */
static inline double max_rel_diff(const double *a, const double *b, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(a[i] - b[i]) / (1 + fabs(b[i])));
    return m;
}
#endif

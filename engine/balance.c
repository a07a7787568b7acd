/*
 * balance.c — the host arithmetic of Quantile Balancing (spec/moe.md §4.1) on double arrays: the margins, the
 * interpolated-quantile and order-statistic thresholds and the histogram of required biases. nn/balance.lua
 * drives them between optimiser steps; they were Lua loops, 1.5 ms a layer at 4,096 tokens x 8 experts (5% of the
 * tiny hybrid's step). Every value is the Lua arithmetic's, operation for operation, so the biases (and the
 * routing of the next step) are the same bits.
 */
#include <math.h>
#include <stdlib.h>
#include "internal.h"

/* μ_{t,j} = s_{t,j} − c_t, c_t the (k+1)-th largest s_t + b over the allowed experts (all when allowed is NULL),
   duplicates counted. nn.MoE allows at least k+1 experts per token (its topk_group check); a row with fewer is
   refused here. For k + 1 <= 16, c_t is found by k + 1 passes that each take the largest value left (compares the
   compiler makes branch-free: the insertion into a sorted top list, kept for larger k, mispredicted on every other
   expert of random scores); both give the (k+1)-th largest value, so the margins are the same bits */
int tide_qb_margins(const double *s, const double *b, int64_t m, int64_t n, int64_t k, const uint8_t *allowed,
                    double *mu)
{
    if (m < 0 || n < 1 || k < 0 || k >= n) return tide_set_error("qb margins: bad sizes m=%lld n=%lld k=%lld",
                                                                 (long long)m, (long long)n, (long long)k);
    double *v = malloc((size_t)n * 2 * sizeof *v), *top = v + n;
    if (!v) return tide_set_error("qb margins: out of memory");
    for (int64_t t = 0; t < m; t++) {
        const double *row = s + t * n;
        const uint8_t *ok = allowed ? allowed + t * n : NULL;
        int64_t cnt = 0;
        double c;
        if (k + 1 <= 16) {
            for (int64_t j = 0; j < n; j++) {
                int in = !ok || ok[j];
                v[j] = in ? row[j] + b[j] : -INFINITY;
                cnt += in;
            }
            c = -INFINITY;
            for (int64_t pass = 0; pass <= k && cnt > k; pass++) {
                int64_t bi = 0;
                double best = v[0];
                for (int64_t j = 1; j < n; j++) {
                    int gt = v[j] > best;
                    best = gt ? v[j] : best;
                    bi = gt ? j : bi;
                }
                c = best;
                v[bi] = -INFINITY;
            }
        } else {
            for (int64_t j = 0; j < n; j++) {
                if (ok && !ok[j]) continue;
                double x = row[j] + b[j];
                int64_t i;
                if (cnt <= k) i = cnt++;
                else if (x > top[k]) i = k;
                else continue;
                while (i > 0 && top[i - 1] < x) { top[i] = top[i - 1]; i--; }
                top[i] = x;
            }
            c = top[k];
        }
        if (cnt <= k) {
            free(v);
            return tide_set_error("qb margins: token %lld allows %lld experts, fewer than top_k + 1 = %lld",
                                  (long long)t, (long long)cnt, (long long)(k + 1));
        }
        double *out = mu + t * n;
        for (int64_t j = 0; j < n; j++) out[j] = row[j] - c;
    }
    free(v);
    return 0;
}

/* the kk-th smallest (0-based) of a[0..n-1], duplicates counted; a and tmp (n each) are scratch. Three-way
   partitions around a median-of-three pivot, written branch-free into the two buffers (a Hoare partition of random
   margins mispredicted about every other element); the value is the kk-th smallest whatever the algorithm (a
   value equal to it under < is returned: −0 for +0 at worst) */
static double select_kth(double *a, double *tmp, int64_t n, int64_t kk)
{
    while (n > 8) {
        double x = a[0], y = a[n / 2], z = a[n - 1];
        double mn = x < y ? x : y, mx = x > y ? x : y;
        double inner = mx < z ? mx : z;
        double p = mn > inner ? mn : inner;
        int64_t nl = 0, nh = 0;
        double *hi = tmp;
        for (int64_t i = 0; i < n; i++) {
            double e = a[i];
            a[nl] = e;           /* nl <= i: the lower part is compacted in place */
            nl += e < p;
            hi[nh] = e;
            nh += e > p;
        }
        if (kk < nl) n = nl;
        else if (kk < n - nh) return p;
        else {
            kk -= n - nh;
            double *t = a; a = hi; tmp = t;
            n = nh;
        }
    }
    /* a few left: insertion sort */
    for (int64_t i = 1; i < n; i++) {
        double e = a[i];
        int64_t j = i;
        while (j > 0 && a[j - 1] > e) { a[j] = a[j - 1]; j--; }
        a[j] = e;
    }
    return a[kk];
}

/* θ_j = the (1 − k/n) quantile of column j of μ [m·n], linearly interpolated (numpy's default): pos =
   (1 − k/n)(m − 1), θ = x_⌊pos⌋ + frac(pos)·(x_⌊pos⌋+1 − x_⌊pos⌋) of the column sorted ascending */
int tide_qb_theta_exact(const double *mu, int64_t m, int64_t n, int64_t k, double *theta)
{
    if (m < 1 || n < 1 || k < 0 || k > n) return tide_set_error("qb theta: bad sizes m=%lld n=%lld k=%lld",
                                                                (long long)m, (long long)n, (long long)k);
    double *col = malloc((size_t)m * 3 * sizeof *col), *tmp = col + m, *keep = tmp + m;
    if (!col) return tide_set_error("qb theta: out of memory");
    double pos = (1.0 - (double)k / (double)n) * (double)(m - 1);
    double fi = floor(pos);
    int64_t i = (int64_t)fi;
    double frac = pos - fi;
    for (int64_t j = 0; j < n; j++) {
        for (int64_t t = 0; t < m; t++) keep[t] = col[t] = mu[t * n + j];
        double lo = select_kth(col, tmp, m, i), v = lo;
        if (frac > 0 && i + 1 < m) {
            /* the (i+1)-th smallest: lo again when more than i+1 values are <= lo, else the least value above it */
            int64_t le = 0;
            double hi = INFINITY;
            /* (a minimum and a count: any order gives the same values) */
            _Pragma("omp simd reduction(+:le) reduction(min:hi)")
            for (int64_t t = 0; t < m; t++) {
                double e = keep[t], above = e > lo ? e : INFINITY;
                le += e <= lo;
                hi = above < hi ? above : hi;
            }
            if (le > i + 1) hi = lo;
            v = lo + frac * (hi - lo);
        }
        theta[j] = v;
    }
    free(col);
    return 0;
}

/* θ_j = the bare r-th largest of column j, r = ⌊m·k/n⌋ + 1 (at most m) */
int tide_qb_theta_order_statistic(const double *mu, int64_t m, int64_t n, int64_t k, double *theta)
{
    if (m < 1 || n < 1 || k < 0 || k > n) return tide_set_error("qb theta: bad sizes m=%lld n=%lld k=%lld",
                                                                (long long)m, (long long)n, (long long)k);
    double *col = malloc((size_t)m * 2 * sizeof *col), *tmp = col + m;
    if (!col) return tide_set_error("qb theta: out of memory");
    int64_t r = (int64_t)floor((double)m * (double)k / (double)n) + 1;
    if (r > m) r = m;
    for (int64_t j = 0; j < n; j++) {
        for (int64_t t = 0; t < m; t++) col[t] = mu[t * n + j];
        theta[j] = select_kth(col, tmp, m, m - r);
    }
    free(col);
    return 0;
}

/* counts [n·bins] (expert-major, zeroed here) of the required bias r = −μ over [lo, hi): bin ⌊(r − lo)/w⌋, the
   values outside in the edge bins and counted in *clamped (a NaN margin, from NaN scores, goes to bin 0 and counts
   as clamped) */
int tide_qb_histogram(const double *mu, int64_t m, int64_t n, double lo, double hi, int64_t bins, int64_t *counts,
                      int64_t *clamped)
{
    if (m < 0 || n < 1 || bins < 1) return tide_set_error("qb histogram: bad sizes m=%lld n=%lld bins=%lld",
                                                         (long long)m, (long long)n, (long long)bins);
    double w = (hi - lo) / (double)bins;
    int64_t out = 0;
    for (int64_t i = 0; i < n * bins; i++) counts[i] = 0;
    for (int64_t t = 0; t < m; t++)
        for (int64_t j = 0; j < n; j++) {
            double f = floor((-mu[t * n + j] - lo) / w);
            int64_t i;
            if (f < 0 || f != f) { i = 0; out++; }
            else if (f >= (double)bins) { i = bins - 1; out++; }
            else i = (int64_t)f;
            counts[j * bins + i]++;
        }
    *clamped = out;
    return 0;
}

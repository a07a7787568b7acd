/* test-dist-allreduce — run under `mpirun -np 2`: N ranks compute what one rank computes (DESIGN.md §9).
   Each rank holds a different tensor; after the all-reduce every rank holds the exact sum, and a
   broadcast from rank 1 reaches every rank; the reduce to the last rank leaves the same sum there; the all-gather
   concatenates in rank order; the all-to-all-v delivers uneven (and empty) parts. Also passes (trivially, world size 1) without mpirun. */
#include <stdio.h>
#include <stdlib.h>
#include "tide.h"

int main(void)
{
    int pass = 0, fail = 0;
    if (tide_dist_init()) { printf("init failed: %s\n", tide_last_error()); return 1; }
    int r = tide_dist_rank(), w = tide_dist_world_size();
    double v[5];
    for (int i = 0; i < 5; i++) v[i] = (double)(r + 1) * (i + 1);           /* rank r holds (r+1)·(1..5) */
    tide_tensor *t = tide_from_f64(TIDE_F64, 1, (int64_t[]){5}, 0, v);
    if (tide_dist_allreduce_sum_(t)) { printf("allreduce failed: %s\n", tide_last_error()); return 1; }
    double out[5], ranks = (double)w * (w + 1) / 2;                         /* sum over r of (r+1) */
    tide_to_f64_buffer(t, out, 5);
    int ok = 1;
    for (int i = 0; i < 5; i++) ok &= out[i] == ranks * (i + 1);
    ok ? pass++ : (fail++, printf("rank %d: allreduce gave %g, expected %g\n", r, out[0], ranks));
    /* each rank sends the 40 bytes once in the reduce chain (all but the last) and once passing the sum on (all but
       rank N-2) */
    int64_t sent = tide_dist_bytes_sent(), want = w > 1 ? 40 * ((r < w - 1) + (r != w - 2)) : 0;
    sent == want ? pass++ : (fail++, printf("rank %d: %lld bytes sent, expected %lld\n", r, (long long)sent, (long long)want));
    /* the sum in rank order, bitwise: rank r holds 0.1·3^r; every rank computes ((x_0 + x_1) + ...) itself */
    double x = 0.1, acc = 0;
    for (int q = 0; q < w; q++) { double xq = 0.1; for (int e = 0; e < q; e++) xq *= 3; acc = q == 0 ? xq : acc + xq; }
    for (int e = 0; e < r; e++) x *= 3;
    tide_tensor *o = tide_from_f64(TIDE_F64, 1, (int64_t[]){1}, 0, &x);
    double got = 0;
    if (tide_dist_allreduce_sum_(o)) { printf("allreduce failed: %s\n", tide_last_error()); return 1; }
    tide_to_f64_buffer(o, &got, 1);
    got == acc ? pass++ : (fail++, printf("rank %d: the sum %.17g is not the rank-order sum %.17g\n", r, got, acc));
    tide_tensor_release(o);
    for (int i = 0; i < 5; i++) v[i] = r == w - 1 ? 7.0 * i : -1;
    tide_tensor *b = tide_from_f64(TIDE_F32, 1, (int64_t[]){5}, 0, v);
    if (tide_dist_broadcast_(b, w - 1)) { printf("broadcast failed: %s\n", tide_last_error()); return 1; }
    tide_to_f64_buffer(b, out, 5);
    ok = 1;
    for (int i = 0; i < 5; i++) ok &= out[i] == 7.0 * i;
    ok ? pass++ : (fail++, printf("rank %d: broadcast wrong\n", r));
    /* reduce to the last rank (ZeRO-2's reduce-scatter): the rank-order sum there, bitwise the all-reduce's; every
       rank but the last sends the 8 bytes once, the last none */
    {
        double y = 0.1;
        for (int e = 0; e < r; e++) y *= 3;
        tide_tensor *q = tide_from_f64(TIDE_F64, 1, (int64_t[]){1}, 0, &y);
        int64_t before = tide_dist_bytes_sent();
        if (tide_dist_reduce_to_last_(q)) { printf("reduce failed: %s\n", tide_last_error()); return 1; }
        double gq = 0;
        tide_to_f64_buffer(q, &gq, 1);
        if (r == w - 1) gq == acc ? pass++ : (fail++, printf("rank %d: reduce gave %.17g, expected %.17g\n", r, gq, acc));
        int64_t d = tide_dist_bytes_sent() - before, dw = (w > 1 && r < w - 1) ? 8 : 0;
        d == dw ? pass++ : (fail++, printf("rank %d: reduce sent %lld bytes, expected %lld\n", r, (long long)d, (long long)dw));
        tide_tensor_release(q);
    }
    /* all-gather: rank r's 3 values (r, r + 0.5, -r) in rank order on every rank; 24 bytes to each other rank */
    {
        double mine[3] = {r, r + 0.5, -r};
        tide_tensor *in = tide_from_f64(TIDE_F64, 1, (int64_t[]){3}, 0, mine);
        tide_tensor *all = tide_zeros(TIDE_F64, 1, (int64_t[]){3 * w}, 0);
        int64_t before = tide_dist_bytes_sent();
        if (tide_dist_allgather_(all, in)) { printf("allgather failed: %s\n", tide_last_error()); return 1; }
        double *g = malloc((size_t)(3 * w) * sizeof *g);
        tide_to_f64_buffer(all, g, 3 * w);
        int good = 1;
        for (int q = 0; q < w; q++) good &= g[3 * q] == q && g[3 * q + 1] == q + 0.5 && g[3 * q + 2] == -q;
        good ? pass++ : (fail++, printf("rank %d: allgather gave the wrong values\n", r));
        int64_t d = tide_dist_bytes_sent() - before;
        d == 24 * (w - 1) ? pass++ : (fail++, printf("rank %d: allgather sent %lld bytes\n", r, (long long)d));
        tide_tensor *bad = tide_zeros(TIDE_F64, 1, (int64_t[]){3 * w + 1}, 0);
        (tide_dist_allgather_(bad, in) != 0) ? pass++ : (fail++, printf("allgather into a wrong size must be an error\n"));
        free(g);
        tide_tensor_release(in); tide_tensor_release(all); tide_tensor_release(bad);
    }
    /* all-to-all-v with uneven counts, zeros included: rank r sends (r + q) % 3 values to rank q, each value
       1000 r + 10 q + k; rank q then holds, from every r in order, its (r + q) % 3 values */
    {
        int64_t sc[64], rcnt[64], ns = 0, nr = 0;
        for (int q = 0; q < w; q++) { sc[q] = (r + q) % 3; ns += sc[q]; rcnt[q] = (q + r) % 3; nr += rcnt[q]; }
        double *sv = malloc((size_t)(ns > 0 ? ns : 1) * sizeof *sv), *rv = malloc((size_t)(nr > 0 ? nr : 1) * sizeof *rv);
        int64_t o = 0;
        for (int q = 0; q < w; q++) for (int64_t k = 0; k < sc[q]; k++) sv[o++] = 1000.0 * r + 10.0 * q + (double)k;
        tide_tensor *st = tide_from_f64(TIDE_F32, 1, (int64_t[]){ns}, 0, sv), *rt = tide_zeros(TIDE_F32, 1, (int64_t[]){nr}, 0);
        int64_t before = tide_dist_bytes_sent();
        if (tide_dist_alltoallv_(st, sc, rt, rcnt)) { printf("alltoallv failed: %s\n", tide_last_error()); return 1; }
        tide_to_f64_buffer(rt, rv, nr);
        int good = 1;
        o = 0;
        for (int q = 0; q < w; q++) for (int64_t k = 0; k < rcnt[q]; k++) good &= rv[o++] == 1000.0 * q + 10.0 * r + (double)k;
        good ? pass++ : (fail++, printf("rank %d: alltoallv gave the wrong values\n", r));
        int64_t want_b = 0;
        for (int q = 0; q < w; q++) if (q != r) want_b += 4 * sc[q];
        (tide_dist_bytes_sent() - before == want_b) ? pass++ : (fail++, printf("rank %d: alltoallv bytes\n", r));
        int64_t wrong[64];
        for (int q = 0; q < w; q++) wrong[q] = sc[q];
        wrong[0] += 1;
        (tide_dist_alltoallv_(st, wrong, rt, rcnt) != 0) ? pass++ : (fail++, printf("alltoallv with wrong counts must be an error\n"));
        free(sv); free(rv);
        tide_tensor_release(st); tide_tensor_release(rt);
    }
    tide_tensor *i32 = tide_zeros(TIDE_I32, 1, (int64_t[]){2}, 0);
    (tide_dist_allreduce_sum_(i32) != 0) ? pass++ : (fail++, printf("allreduce of i32 must be an error\n"));
    (tide_dist_reduce_to_last_(i32) != 0) ? pass++ : (fail++, printf("reduce of i32 must be an error\n"));
    tide_tensor_release(t); tide_tensor_release(b); tide_tensor_release(i32);
    tide_dist_barrier();
    tide_dist_finalize();
    if (r == 0) printf("world %d: %d passed, %d failed\n", w, pass, fail);
    return fail ? 1 : 0;
}

/* test-dist-allreduce — run under `mpirun -np 2`: N ranks compute what one rank computes (DESIGN.md §9).
   Each rank holds a different tensor; after the all-reduce every rank holds the exact sum, and a
   broadcast from rank 1 reaches every rank; the reduce to the last rank leaves the same sum there. Also passes (trivially, world size 1) without mpirun. */
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
    tide_tensor *i32 = tide_zeros(TIDE_I32, 1, (int64_t[]){2}, 0);
    (tide_dist_allreduce_sum_(i32) != 0) ? pass++ : (fail++, printf("allreduce of i32 must be an error\n"));
    (tide_dist_reduce_to_last_(i32) != 0) ? pass++ : (fail++, printf("reduce of i32 must be an error\n"));
    tide_tensor_release(t); tide_tensor_release(b); tide_tensor_release(i32);
    tide_dist_barrier();
    tide_dist_finalize();
    if (r == 0) printf("world %d: %d passed, %d failed\n", w, pass, fail);
    return fail ? 1 : 0;
}

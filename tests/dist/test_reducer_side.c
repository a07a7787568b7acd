/* test-dist-reducer-side — run under `mpirun -np 2`: the gradient reducer's side-stream path (engine/dist/reducer.c),
   the one CUDA tensors take (their sums queued on the device's side stream as the buckets fill), run on the CPU: the
   CPU table is given recording comm_fork / comm_back / comm_join entries (tide_backend_override), so the reducer
   queues each bucket from the backward's own thread, in bucket order, bracketed by fork and back, and joins once at
   finish. Checked: the gradients are bitwise those of the helper-thread reducer and of one all-reduce after the
   backward; buckets are queued during the backward (before finish) and each exactly once; a parameter the graph
   never reads is filled with zeros and queued at finish; under ep / cp (set_concurrent) and ZeRO-2 the side stream
   is not used; a failing fork ends finish with its error. One rank: skipped (the side stream needs peers). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tide.h"
#include "internal.h"

static int pass, fail_n;
static void check(int ok, const char *what)
{
    ok ? pass++ : fail_n++;
    if (!ok || tide_dist_rank() == 0) printf("%s  [rank %d] %s\n", ok ? "ok  " : "FAIL", tide_dist_rank(), what);
}

/* the recorder: every call in order, and whether the thread is between fork and back */
static char g_log[256];
static int g_len, g_on_side, g_nested, g_fail_at = -1, g_forks;
static int rec_fork(void)
{
    if (g_forks++ == g_fail_at) return tide_set_error("fork refused");
    g_nested |= g_on_side;
    g_on_side = 1;
    if (g_len < 255) g_log[g_len++] = 'F';
    return 0;
}
static int rec_back(void)
{
    g_on_side = 0;
    if (g_len < 255) g_log[g_len++] = 'B';
    return 0;
}
static int rec_join(void)
{
    if (g_len < 255) g_log[g_len++] = 'J';
    return 0;
}

enum { NP = 5 };
static const int64_t sizes[NP] = {7, 3, 300, 11, 5};   /* p4 (f32) is never read */

static tide_tensor *make_param(int i, int rank)
{
    double v[300];
    for (int64_t j = 0; j < sizes[i]; j++) v[j] = 0.1 * (double)(rank + 1) * (double)(j % 13 + 1) + 0.013 * (double)i;
    tide_tensor *t = tide_from_f64(i >= 3 ? TIDE_F32 : TIDE_F64, 1, (int64_t[]){sizes[i]}, 0, v);
    tide_set_requires_grad(t, 1);
    return t;
}

/* loss = Σ p0² + Σ p1³ + Σ sin-free products; the f32 p3 through a cast; p4 unused */
static int backward(tide_tensor **p)
{
    tide_tensor *q0 = tide_mul(p[0], p[0]), *q1 = tide_mul(tide_mul(p[1], p[1]), p[1]), *q2 = tide_mul(p[2], p[2]),
                *q3 = tide_to_dtype(tide_mul(p[3], p[3]), TIDE_F64);
    tide_tensor *s = tide_add(tide_add(tide_sum(q0, 1, (int[]){0}, 0), tide_sum(q1, 1, (int[]){0}, 0)),
                              tide_add(tide_sum(q2, 1, (int[]){0}, 0), tide_sum(q3, 1, (int[]){0}, 0)));
    int rc = s ? tide_backward(s, NULL) : -1;
    return rc;   /* the graph's tensors are left to the process's end: a test */
}

/* the parameters' gradients as bytes, for bitwise comparison */
static size_t grads(tide_tensor **p, char *out)
{
    size_t n = 0;
    for (int i = 0; i < NP; i++) {
        size_t nb = (size_t)sizes[i] * (i >= 3 ? 4 : 8);
        if (p[i]->grad) tide_read_bytes(p[i]->grad, out + n, nb);
        else memset(out + n, 0, nb);
        n += nb;
    }
    return n;
}

/* one step of the graph through a reducer (NULL: the gradients all-reduced one by one after the backward) */
static int step(tide_reducer *r, tide_tensor **p, int *forks_in_backward)
{
    for (int i = 0; i < NP; i++) tide_zero_grad(p[i]);
    if (r && tide_reducer_arm(r)) return -1;
    if (backward(p)) return -1;
    if (forks_in_backward) *forks_in_backward = g_forks;
    if (!r) {
        for (int i = 0; i < NP; i++) {
            if (!p[i]->grad) { tide_tensor *z = tide_zeros(p[i]->dtype, 1, (int64_t[]){sizes[i]}, 0); p[i]->grad = z; }
            if (tide_dist_allreduce_sum_(p[i]->grad)) return -1;
        }
        return 0;
    }
    double st[5];
    return tide_reducer_finish(r, st);
}

int main(void)
{
    if (tide_dist_init()) { printf("init: %s\n", tide_last_error()); return 1; }
    int me = tide_dist_rank();
    if (tide_dist_world_size() < 2) { printf("test-dist-reducer-side: one rank: skipped\n"); return 0; }
    tide_tensor *p[NP];
    for (int i = 0; i < NP; i++) p[i] = make_param(i, me);
    static char want[8192], got[8192];

    /* the reference: one all-reduce per gradient after the backward */
    if (step(NULL, p, NULL)) { printf("reference: %s\n", tide_last_error()); return 1; }
    size_t nbytes = grads(p, want);

    /* the helper-thread reducer (the CPU's own path) */
    tide_reducer *r = tide_reducer_new(NP, p, 100);
    if (!r || step(r, p, NULL)) { printf("threaded: %s\n", tide_last_error()); return 1; }
    grads(p, got);
    check(memcmp(got, want, nbytes) == 0, "the helper-thread reducer == one all-reduce after the backward (bitwise)");
    tide_reducer_free(r);

    /* the side-stream path: a CPU table with the side stream's entries */
    tide_backend t = tide_cpu_backend;
    t.comm_fork = rec_fork;
    t.comm_back = rec_back;
    t.comm_join = rec_join;
    tide_backend_override(TIDE_CPU, &t);
    /* 100-byte buckets in reverse order: {p4, p3: f32, 20 + 44 B}, {p2: 2400 B}, {p1, p0: 24 + 56 B} */
    r = tide_reducer_new(NP, p, 100);
    int during = 0;
    g_len = 0;
    if (!r || step(r, p, &during)) { printf("side: %s\n", tide_last_error()); return 1; }
    grads(p, got);
    g_log[g_len] = '\0';
    check(memcmp(got, want, nbytes) == 0, "the side-stream path == one all-reduce after the backward (bitwise)");
    char what[400];
    snprintf(what, sizeof what, "each of the 3 buckets queued once between fork and back, one join last (%s)", g_log);
    check(strcmp(g_log, "FBFBFBJ") == 0, what);
    check(!g_nested, "no fork while on the side stream");
    /* p4 (never read) is the first bucket, so nothing can be queued before finish fills it: the order holds */
    check(during == 0, "a bucket waits for every bucket before it (the first fills only at finish)");
    tide_reducer_free(r);

    /* the unread parameter last in bucket order: the other buckets are queued during the backward */
    tide_tensor *q[NP] = {p[4], p[0], p[1], p[2], p[3]};
    r = tide_reducer_new(NP, q, 100);
    g_len = 0; g_forks = 0;
    if (!r || step(r, p, &during)) { printf("side, reordered: %s\n", tide_last_error()); return 1; }
    grads(p, got);
    g_log[g_len] = '\0';
    check(memcmp(got, want, nbytes) == 0, "reordered buckets: the same sums bitwise");
    check(during == 3, "3 of the 4 buckets queued during the backward, the unread parameter's at finish");
    check(g_len >= 2 && g_log[g_len - 1] == 'J' && g_log[g_len - 2] == 'B', "the join after the last bucket");

    /* under ep / cp and ZeRO-2 the side stream is not used (the sums at finish or on the helper thread) */
    tide_reducer_set_concurrent(r, 1);
    g_len = 0; g_forks = 0;
    if (step(r, p, NULL)) { printf("concurrent: %s\n", tide_last_error()); return 1; }
    grads(p, got);
    check(memcmp(got, want, nbytes) == 0 && g_forks == 0 && g_len == 0, "concurrent (ep / cp): no side stream, the same sums");
    tide_reducer_set_concurrent(r, 0);
    int owners[NP] = {1, 0, 1, 0, 1};
    tide_reducer_set_owners(r, owners);
    if (step(r, p, NULL)) { printf("zero-2: %s\n", tide_last_error()); return 1; }
    int owned_ok = 1;
    for (int i = 0; i < NP; i++) owned_ok &= (q[i]->grad != NULL) == (owners[i] == me);
    check(owned_ok && g_forks == 0, "ZeRO-2: no side stream, each owner keeps its sums");
    tide_reducer_set_owners(r, NULL);

    /* a fork that fails: finish names it (every rank fails alike, so the sums still pair up) */
    g_forks = 0; g_fail_at = 1;
    int rc = step(r, p, NULL);
    check(rc != 0 && strstr(tide_last_error(), "fork refused") != NULL, "a failing fork ends finish with its error");
    g_fail_at = -1;
    tide_reducer_free(r);
    tide_backend_override(TIDE_CPU, NULL);

    int fails = fail_n;
    tide_tensor *f = tide_from_f64(TIDE_F64, 1, (int64_t[]){1}, 0, (double[]){(double)fails});
    tide_dist_allreduce_sum_(f);
    double all = 0;
    tide_to_f64_buffer(f, &all, 1);
    if (me == 0) printf("%d passed, %.0f failed over the ranks\n", pass, all);
    tide_dist_finalize();
    return all > 0 ? 1 : 0;
}

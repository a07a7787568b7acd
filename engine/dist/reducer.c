/*
 * reducer.c — data parallelism's gradient sum overlapped with the backward (DESIGN.md §9; tide.h documents the API).
 *
 * The parameters are cut into buckets of about bucket_bytes, in reverse order and one dtype each: the backward
 * reaches the last parameters (the head) first. During an armed backward the autograd engine reports each watched
 * parameter when the last node that uses it has run (autograd.c: a count of its uses in the graph); its gradient is
 * copied into its bucket's flat buffer, and a bucket whose parameters are all in is handed to a helper thread, which
 * sums the buckets over the ranks in bucket order with tide_dist_allreduce_sum_ (the rank-order chain) while the
 * backward goes on. Every rank takes the buckets in the same order, whatever order its own become full in (an MoE
 * rank whose tokens missed an expert fills that bucket only at finish), so the messages always pair up. The sums are
 * elementwise the flat all-reduce's, so the result does not depend on the bucket size, the timing, or whether the
 * thread ran: bit for bit the unbucketed step.
 *
 * The helper sums on the reducer's own communicator (a world-sized group made when the reducer is), so its messages
 * never meet those of the backward itself: under expert and context parallelism the backward exchanges with the ep
 * and cp groups while the buckets sum (tide_reducer_set_concurrent), which needs MPI_THREAD_MULTIPLE; plain data
 * parallelism needs MPI_THREAD_SERIALIZED (between arm and finish only the helper calls MPI). Where the library gives
 * less, or there is no MPI, finish sums the buckets on the calling thread (no overlap, the same sums).
 *
 * Device tensors (CUDA: NCCL) need no thread: their collectives are queued, not waited for. The buckets live on the
 * parameters' device, and a device whose backend has a side stream (backend.h: comm_fork) gets each bucket's sum
 * queued there by the backward's own thread, in bucket order, as soon as the bucket and every one before it are
 * full; the side stream starts it once the main stream has copied the gradients in, and runs it beside the rest of
 * the backward; finish makes the main stream wait for the side stream before the sums are copied out. The side
 * stream allocates nothing: each sum receives into the reducer's own scratch (the engine's block cache does not
 * follow streams). Under expert and context parallelism (concurrent) and ZeRO-2 a device's buckets sum at finish on
 * the main stream instead: NCCL kernels of two communicators queued in a different order on different ranks can wait
 * on each other. A CPU table given a comm_fork (a test's, tide_backend_override) runs the same path with MPI's
 * blocking sums (tests/dist/test_reducer_side.c).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../internal.h"

typedef struct {
    int dtype;
    int64_t numel;
    tide_tensor *flat;       /* [numel] buffer on the parameters' device the bucket is summed in */
    int n_params, n_ready;
    int full;                /* every parameter copied in: the helper may sum it */
    int early;               /* it became full during the backward (not at finish) */
    double t0, t1;           /* when the helper summed it */
} bucket;

struct tide_reducer {
    int n;
    int *owner;              /* ZeRO-2 (set_owners): each parameter's owner; the buckets are reduced to the last
                                rank, which sends every owner its parameters' sums; NULL: all-reduced */
    tide_tensor **params;    /* retained */
    int *bucket_of;
    int64_t *offset_of;      /* element offset in the bucket */
    char *in;                /* this backward: copied into its bucket */
    int nb;
    bucket *b;
    int armed, threaded;
    int device;              /* the parameters' (every one's) */
    int side;                /* this step's sums are queued on the device's side stream as buckets fill */
    int next;                /* side: the first bucket not yet queued */
    tide_tensor *scratch;    /* side: what each sum receives into (the largest bucket's elements) */
    int group;               /* the communicator of the sums: a world-sized group of the reducers' own */
    int concurrent;          /* the backward calls MPI itself (ep, cp): a helper thread needs MPI_THREAD_MULTIPLE */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;                /* buckets summed by the helper */
    int failed;
    char err[256];
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}


void tide_reducer_free(tide_reducer *r)
{
    if (!r) return;
    if (r->armed) tide_set_grad_ready_hook(NULL, NULL);
    for (int i = 0; i < r->n; i++) {
        if (r->params[i]) { r->params[i]->grad_slot = 0; tide_tensor_release(r->params[i]); }
    }
    for (int k = 0; k < r->nb; k++) tide_tensor_release(r->b[k].flat);
    tide_tensor_release(r->scratch);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r->params); free(r->bucket_of); free(r->offset_of); free(r->in); free(r->b); free(r->owner);
    free(r);
}

tide_reducer *tide_reducer_new(int n, tide_tensor **params, int64_t bucket_bytes)
{
    if (n <= 0 || !params) { tide_set_error("reducer: no parameters"); return NULL; }
    if (bucket_bytes <= 0) { tide_set_error("reducer: bucket size must be positive, got %lld", (long long)bucket_bytes); return NULL; }
    for (int i = 0; i < n; i++) {
        tide_tensor *p = params[i];
        if (!p) { tide_set_error("reducer: parameter %d is NULL", i); return NULL; }
        if (p->dtype != TIDE_F32 && p->dtype != TIDE_F64) {
            tide_set_error("reducer: parameter %d is %s; buckets take f32/f64 tensors", i, tide_dtype_name(p->dtype));
            return NULL;
        }
        if (p->device != params[0]->device) {
            tide_set_error("reducer: parameter %d is on device %d, parameter 0 on %d; buckets take one device's", i,
                           p->device, params[0]->device);
            return NULL;
        }
        if (p->node) { tide_set_error("reducer: parameter %d is not a leaf", i); return NULL; }
        if (p->grad_slot) { tide_set_error("reducer: parameter %d is already watched by a reducer", i); return NULL; }
    }
    tide_reducer *r = calloc(1, sizeof *r);
    if (!r) { tide_set_error("reducer: out of memory"); return NULL; }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->params = calloc((size_t)n, sizeof *r->params);
    r->bucket_of = calloc((size_t)n, sizeof *r->bucket_of);
    r->offset_of = calloc((size_t)n, sizeof *r->offset_of);
    r->in = calloc((size_t)n, 1);
    r->b = calloc((size_t)n, sizeof *r->b);
    if (!r->params || !r->bucket_of || !r->offset_of || !r->in || !r->b) {
        tide_reducer_free(r);
        tide_set_error("reducer: out of memory");
        return NULL;
    }
    r->n = n;
    r->device = params[0]->device;
    /* buckets in reverse parameter order; a new one when the next would pass bucket_bytes or changes dtype */
    int k = -1;
    int64_t bytes = 0;
    for (int i = n - 1; i >= 0; i--) {
        tide_tensor *p = params[i];
        int64_t nb = tide_tensor_nbytes(p);
        if (k < 0 || r->b[k].dtype != p->dtype || (bytes > 0 && bytes + nb > bucket_bytes)) {
            k++;
            r->b[k].dtype = p->dtype;
            bytes = 0;
        }
        r->bucket_of[i] = k;
        r->offset_of[i] = r->b[k].numel;
        r->b[k].numel += p->numel;
        r->b[k].n_params++;
        bytes += nb;
    }
    r->nb = k + 1;
    int64_t most = 0;
    for (k = 0; k < r->nb; k++) {
        r->b[k].flat = tide_empty(r->b[k].dtype, 1, (int64_t[]){r->b[k].numel}, r->device);
        if (!r->b[k].flat) { tide_reducer_free(r); return NULL; }
        if (r->b[k].numel > most) most = r->b[k].numel;
    }
    /* the side stream's receive buffer, in the widest dtype of the buckets */
    if (tide_backend_for(r->device)->comm_fork && tide_dist_world_size() > 1) {
        int wide = TIDE_F32;
        for (k = 0; k < r->nb; k++) if (r->b[k].dtype == TIDE_F64) wide = TIDE_F64;
        r->scratch = tide_empty(wide, 1, (int64_t[]){most}, r->device);
        if (!r->scratch) { tide_reducer_free(r); return NULL; }
    }
    /* the reducers' own group, made by every rank's first reducer (a collective), shared by the later ones (one is
       armed at a time: the grad-ready hook is the engine's one) */
    static int sums_group = -1;
    if (tide_dist_world_size() > 1 && sums_group < 0 && (sums_group = tide_dist_group_split(0)) < 0) {
        tide_reducer_free(r);
        return NULL;
    }
    r->group = sums_group < 0 ? 0 : sums_group;
    for (int i = 0; i < n; i++) {
        tide_tensor_retain(params[i]);
        r->params[i] = params[i];
        params[i]->grad_slot = i + 1;
    }
    return r;
}

int tide_reducer_set_concurrent(tide_reducer *r, int on)
{
    if (!r) return tide_set_error("reducer: NULL");
    if (r->armed) return tide_set_error("reducer: set_concurrent while armed");
    r->concurrent = on != 0;
    return 0;
}

/* bucket k summed over the ranks on the reducer's group (reduced to the last rank under ZeRO-2) */
static int sum_bucket(tide_reducer *r, int k)
{
    return r->owner ? tide_dist_reduce_to_last_group_(r->group, r->b[k].flat)
                    : tide_dist_allreduce_sum_group_(r->group, r->b[k].flat);
}

static void fail(tide_reducer *r, const char *what)
{
    if (r->failed) return;
    r->failed = 1;
    snprintf(r->err, sizeof r->err, "%s%s", what, tide_last_error());
}

/* side: the full buckets from r->next on, in order, queued on the side stream (each after everything the main stream
   has been given, the copies of its gradients included) */
static void queue_full(tide_reducer *r)
{
    const tide_backend *bk = tide_backend_for(r->device);
    while (r->next < r->nb && r->b[r->next].full && !r->failed) {
        int k = r->next++;
        r->b[k].t0 = now_s();
        if (bk->comm_fork()) { fail(r, "reducer: "); break; }
        int rc = tide_dist_allreduce_sum_scratch_(r->group, r->b[k].flat, r->scratch);
        bk->comm_back();
        r->b[k].t1 = now_s();
        if (rc) { fail(r, ""); break; }
    }
}

/* parameter i's gradient (zeros when it has none) into its bucket; the bucket marked full when it is the last */
static void take(tide_reducer *r, int i)
{
    if (r->in[i]) return;
    r->in[i] = 1;
    tide_tensor *p = r->params[i];
    bucket *b = &r->b[r->bucket_of[i]];
    size_t es = p->dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    char *dst = (char *)tide_data(b->flat) + (size_t)r->offset_of[i] * es;
    tide_tensor *g = p->grad;
    if (r->device == TIDE_CPU && g && tide_is_contiguous(g) && g->numel == p->numel && g->dtype == p->dtype &&
        g->device == TIDE_CPU)
        memcpy(dst, tide_data(g), (size_t)p->numel * es);
    else if (r->device == TIDE_CPU && !g)
        memset(dst, 0, (size_t)p->numel * es);
    else {
        /* a device's bucket (or a gradient of another layout): copied or zeroed in place, on the main stream */
        int64_t stride[TIDE_MAX_DIMS];
        tide_contiguous_strides(p->ndim, p->shape, stride);
        tide_tensor *view = tide_view_of(b->flat, p->ndim, p->shape, stride, b->flat->offset + r->offset_of[i]);
        if (!view || (g ? tide_copy_(view, g) : tide_fill_(view, 0.0))) fail(r, "reducer: copying a gradient into its bucket: ");
        tide_tensor_release(view);
    }
    if (++b->n_ready == b->n_params) {
        b->early = r->armed == 1;
        pthread_mutex_lock(&r->mu);
        b->full = 1;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        if (r->side) queue_full(r);
    }
}

static void on_ready(void *ctx, tide_tensor *leaf)
{
    tide_reducer *r = ctx;
    int i = leaf->grad_slot - 1;
    if (r->armed == 1 && i >= 0 && i < r->n && r->params[i] == leaf) take(r, i);
}

/* the buckets in order, each as soon as it is full */
static void *helper(void *arg)
{
    tide_reducer *r = arg;
    tide_dist_set_polite(1);   /* the backward computes on the cores meanwhile */
    for (int k = 0; k < r->nb; k++) {
        pthread_mutex_lock(&r->mu);
        while (!r->b[k].full) pthread_cond_wait(&r->cv, &r->mu);
        pthread_mutex_unlock(&r->mu);
        double t0 = now_s();
        int rc = sum_bucket(r, k);
        double t1 = now_s();
        pthread_mutex_lock(&r->mu);
        r->b[k].t0 = t0;
        r->b[k].t1 = t1;
        if (rc) fail(r, "");
        r->done = k + 1;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        if (rc) break;
    }
    return NULL;
}

int tide_reducer_set_owners(tide_reducer *r, const int *owner)
{
    if (!r) return tide_set_error("reducer: NULL");
    int w = tide_dist_world_size();
    for (int i = 0; owner && i < r->n; i++)
        if (owner[i] < 0 || owner[i] >= w) return tide_set_error("reducer: parameter %d's owner %d is not a rank of %d", i, owner[i], w);
    free(r->owner);
    r->owner = NULL;
    if (!owner) return 0;
    r->owner = malloc((size_t)r->n * sizeof *r->owner);
    if (!r->owner) return tide_set_error("reducer: out of memory");
    memcpy(r->owner, owner, (size_t)r->n * sizeof *r->owner);
    return 0;
}

int tide_reducer_arm(tide_reducer *r)
{
    if (!r) return tide_set_error("reducer: NULL");
    if (r->armed) return tide_set_error("reducer: armed twice without finish");
    memset(r->in, 0, (size_t)r->n);
    for (int k = 0; k < r->nb; k++) {
        r->b[k].n_ready = 0; r->b[k].full = 0; r->b[k].early = 0; r->b[k].t0 = r->b[k].t1 = 0;
    }
    r->done = 0;
    r->next = 0;
    r->failed = 0;
    r->err[0] = '\0';
    r->armed = 1;
    /* a device with a side stream queues the sums as the buckets fill (not under ep / cp or ZeRO-2: see the top);
       a device without one, or under those, sums at finish; the CPU sums on the helper thread */
    r->side = r->scratch && !r->concurrent && !r->owner;
    int level = r->concurrent ? tide_dist_thread_multiple() : tide_dist_thread_serialized();
    r->threaded = !r->side && r->device == TIDE_CPU && tide_dist_world_size() > 1 && level &&
                  pthread_create(&r->thread, NULL, helper, r) == 0;
    tide_set_grad_ready_hook(on_ready, r);
    return 0;
}

int tide_reducer_finish(tide_reducer *r, double *stats)
{
    if (!r) return tide_set_error("reducer: NULL");
    if (!r->armed) return tide_set_error("reducer: finish without arm");
    double t_end = now_s();
    tide_set_grad_ready_hook(NULL, NULL);
    r->armed = 2;   /* finishing: what take() fills now was not reported by the backward */
    /* what the backward did not report (no gradient on this rank, or no backward at all) goes in now, in order */
    for (int i = r->n - 1; i >= 0; i--) take(r, i);
    if (r->threaded) pthread_join(r->thread, NULL);
    else if (r->side) {
        queue_full(r);   /* every bucket is full now */
        if (tide_backend_for(r->device)->comm_join()) fail(r, "reducer: ");
    } else {
        for (int k = 0; k < r->nb && !r->failed; k++) {
            r->b[k].t0 = now_s();
            if (sum_bucket(r, k)) fail(r, "");
            r->b[k].t1 = now_s();
        }
    }
    r->armed = 0;
    double comm = 0, before = 0;
    int early = 0;
    for (int k = 0; k < r->nb; k++) {
        early += r->b[k].early;
        comm += r->b[k].t1 - r->b[k].t0;
        double e = r->b[k].t1 < t_end ? r->b[k].t1 : t_end;
        if (e > r->b[k].t0) before += e - r->b[k].t0;
    }
    /* side: the seconds are those of queuing the sums, not of running them */
    if (stats) { stats[0] = comm; stats[1] = before; stats[2] = r->nb; stats[3] = r->threaded || r->side; stats[4] = early; }
    if (r->failed) return tide_set_error("%s", r->err);
    int me = tide_dist_rank(), last = tide_dist_world_size() - 1;
    if (r->owner && last > 0) {
        /* ZeRO-2: the sums are on the last rank; it sends each other owner its parameters' sums, in parameter order
           (the only sender, every pair's messages in order: nothing to deadlock on) */
        for (int i = 0; i < r->n; i++) {
            int o = r->owner[i];
            if (o == last || (me != last && me != o)) continue;
            tide_tensor *p = r->params[i];
            bucket *b = &r->b[r->bucket_of[i]];
            int64_t stride[TIDE_MAX_DIMS];
            tide_contiguous_strides(1, (int64_t[]){p->numel}, stride);
            tide_tensor *part = tide_view_of(b->flat, 1, (int64_t[]){p->numel}, stride, b->flat->offset + r->offset_of[i]);
            int rc = part ? (me == last ? tide_dist_send_(part, o) : tide_dist_recv_(part, last)) : -1;
            tide_tensor_release(part);
            if (rc) return -1;
        }
    }
    /* the sums into the gradients (created where a parameter had none); under ZeRO-2 only the owner keeps one */
    for (int i = 0; i < r->n; i++) {
        tide_tensor *p = r->params[i];
        if (r->owner && r->owner[i] != me) {
            tide_tensor_release(p->grad);
            p->grad = NULL;
            continue;
        }
        bucket *b = &r->b[r->bucket_of[i]];
        size_t es = p->dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
        const char *src = (const char *)tide_data(b->flat) + (size_t)r->offset_of[i] * es;
        if (!p->grad || !tide_is_contiguous(p->grad) || p->grad->dtype != p->dtype || p->grad->device != r->device) {
            tide_tensor *g = tide_empty(p->dtype, p->ndim, p->shape, r->device);
            if (!g) return -1;
            tide_tensor_release(p->grad);
            p->grad = g;
        }
        if (r->device == TIDE_CPU) memcpy(tide_data(p->grad), src, (size_t)p->numel * es);
        else {
            int64_t stride[TIDE_MAX_DIMS];
            tide_contiguous_strides(p->ndim, p->shape, stride);
            tide_tensor *view = tide_view_of(b->flat, p->ndim, p->shape, stride, b->flat->offset + r->offset_of[i]);
            int rc = view ? tide_copy_(p->grad, view) : -1;
            tide_tensor_release(view);
            if (rc) return -1;
        }
    }
    return 0;
}

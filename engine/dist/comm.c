/*
 * comm.c — collectives for data parallelism (DESIGN.md §9). CPU tensors go through MPI when the build
 * found an MPI library; CUDA tensors through their backend's entries (NCCL, bootstrapped over MPI:
 * kernels/cuda/nccl_comm.cu); without MPI, or in a process not started by mpirun, there is one rank and every
 * collective is the identity.
 */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include "../internal.h"
#ifdef TIDE_HAVE_MPI
#include <mpi.h>
#endif

static int g_rank = 0, g_world = 1, g_inited, g_serialized, g_multiple;

/* process groups (DESIGN.md §9: the dp, ep and cp groups of a layout): group 0 is the world; tide_dist_group_split
   makes the others. A group's ranks are numbered in world order; members[r] is group rank r's world rank. */
enum { MAX_GROUPS = TIDE_DIST_MAX_GROUPS };
typedef struct dist_group {
    int rank, size;
    int *members;                 /* NULL: the world (member r is world rank r) */
#ifdef TIDE_HAVE_MPI
    MPI_Comm comm;
#endif
} dist_group;
static dist_group g_groups[MAX_GROUPS];
static int g_n_groups = 1;

static int launched_by_mpirun(void)
{
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK") || getenv("TIDE_FORCE_MPI");
}

int tide_dist_init(void)
{
    if (g_inited) return 0;
    g_inited = 1;
#ifdef TIDE_HAVE_MPI
    if (!launched_by_mpirun()) return 0;
    int ready = 0, provided = MPI_THREAD_SINGLE;
    MPI_Initialized(&ready);
    /* MULTIPLE: the gradient reducer's helper thread sums buckets (on its own communicator) while the backward runs,
       which under expert and context parallelism exchanges with its groups at the same time; SERIALIZED (one thread
       at a time) is enough for plain data parallelism */
    if (!ready && MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
        return tide_set_error("dist: MPI_Init failed");
    if (ready) MPI_Query_thread(&provided);
    g_serialized = provided >= MPI_THREAD_SERIALIZED;
    g_multiple = provided >= MPI_THREAD_MULTIPLE;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
#endif
    return 0;
}

/* the world as group 0 (filled once MPI has answered) */
static const dist_group *world_group(void)
{
    tide_dist_init();
    g_groups[0].rank = g_rank;
    g_groups[0].size = g_world;
#ifdef TIDE_HAVE_MPI
    g_groups[0].comm = MPI_COMM_WORLD;
#endif
    return &g_groups[0];
}

static const dist_group *find_group(int g, const char *op)
{
    const dist_group *w = world_group();
    if (g == 0) return w;
    if (g < 1 || g >= g_n_groups) { tide_set_error("%s: %d is not a process group (tide_dist_group_split)", op, g); return NULL; }
    return &g_groups[g];
}

/* the world rank of group rank r, for messages */
static int world_rank_of(const dist_group *G, int r) { return G->members ? G->members[r] : r; }

int tide_dist_group_split(int color)
{
    world_group();
    if (color < 0) return tide_set_error("group split: color %d must be >= 0", color);
    if (g_n_groups >= MAX_GROUPS) return tide_set_error("group split: more than %d process groups", MAX_GROUPS - 1);
    dist_group *G = &g_groups[g_n_groups];
    G->rank = 0;
    G->size = 1;
    G->members = malloc(sizeof *G->members * (size_t)(g_world > 0 ? g_world : 1));
    if (!G->members) return tide_set_error("group split: out of memory");
    G->members[0] = g_rank;
#ifdef TIDE_HAVE_MPI
    G->comm = MPI_COMM_NULL;
    if (g_world > 1) {
        /* key = world rank: the group's ranks keep the world's order */
        if (MPI_Comm_split(MPI_COMM_WORLD, color, g_rank, &G->comm) != MPI_SUCCESS) {
            free(G->members);
            return tide_set_error("group split: MPI_Comm_split failed");
        }
        MPI_Comm_rank(G->comm, &G->rank);
        MPI_Comm_size(G->comm, &G->size);
        if (MPI_Allgather(&g_rank, 1, MPI_INT, G->members, 1, MPI_INT, G->comm) != MPI_SUCCESS) {
            free(G->members);
            return tide_set_error("group split: MPI_Allgather failed");
        }
    }
#endif
    return g_n_groups++;
}

int tide_dist_group_rank(int g) { const dist_group *G = find_group(g, "group"); return G ? G->rank : -1; }
int tide_dist_group_size(int g) { const dist_group *G = find_group(g, "group"); return G ? G->size : -1; }
int tide_dist_group_member(int g, int r)
{
    const dist_group *G = find_group(g, "group");
    if (!G) return -1;
    if (r < 0 || r >= G->size) return tide_set_error("group: rank %d is not in a group of %d", r, G->size);
    return world_rank_of(G, r);
}

int tide_dist_rank(void) { tide_dist_init(); return g_rank; }
int tide_dist_thread_serialized(void) { tide_dist_init(); return g_serialized; }
int tide_dist_thread_multiple(void) { tide_dist_init(); return g_multiple; }
int tide_dist_world_size(void) { tide_dist_init(); return g_world; }

static int check_cpu_tensor(const tide_tensor *t, const char *op)
{
    if (!t) return tide_set_error("%s: tensor is NULL", op);
    if (t->device != TIDE_CPU) return tide_set_error("%s: only CPU tensors are supported by the MPI path", op);
    if (!tide_is_contiguous(t)) return tide_set_error("%s: tensor must be contiguous", op);
    return 0;
}

/* a device tensor goes to its backend's collectives (CUDA: NCCL, kernels/cuda/nccl_comm.cu); 1 when it did */
static int device_tensor(const tide_tensor *t, const char *op, int *rc)
{
    if (!t || t->device == TIDE_CPU) return 0;
    *rc = tide_is_contiguous(t) ? 0 : tide_set_error("%s: tensor must be contiguous", op);
    return 1;
}

/* group G as the backends' collectives see it (the device's communicator of the group is made on its first use) */
static tide_dist_grp grp_of(const dist_group *G)
{
    tide_dist_grp d = {(int)(G - g_groups), G->rank, G->size, G->members, NULL};
#ifdef TIDE_HAVE_MPI
    d.mpi_comm = &G->comm;
#endif
    return d;
}

/* bytes this rank handed to the network (sends, and a broadcast's payload at its root) since the start */
static int64_t g_bytes_sent;
int64_t tide_dist_bytes_sent(void) { return __atomic_load_n(&g_bytes_sent, __ATOMIC_RELAXED); }
/* the reducer's helper thread counts too */
#define SENT(n) __atomic_fetch_add(&g_bytes_sent, (int64_t)(n), __ATOMIC_RELAXED)

/* a thread that sums while another computes (the gradient reducer's helper) waits politely: a blocking MPI call
   polls the network on its core, which on a machine whose cores all compute takes them from the backward */
static __thread int t_polite;
void tide_dist_set_polite(int on) { t_polite = on; }

#ifdef TIDE_HAVE_MPI
enum { CHAIN_CHUNK = 1 << 18 };   /* elements per message of the chain */

/* MPI_Recv / MPI_Send; polite: started non-blocking and tested every 20 µs, sleeping in between */
static int wait_polite(MPI_Request *rq)
{
    struct timespec nap = {0, 20000};
    for (;;) {
        int done = 0;
        if (MPI_Test(rq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return MPI_ERR_OTHER;
        if (done) return MPI_SUCCESS;
        nanosleep(&nap, NULL);
    }
}

static int chain_recv(MPI_Comm comm, void *buf, size_t n, int src, int tag)
{
    if (!t_polite) return MPI_Recv(buf, (int)n, MPI_BYTE, src, tag, comm, MPI_STATUS_IGNORE);
    MPI_Request rq;
    int rc = MPI_Irecv(buf, (int)n, MPI_BYTE, src, tag, comm, &rq);
    return rc != MPI_SUCCESS ? rc : wait_polite(&rq);
}

static int chain_send(MPI_Comm comm, const void *buf, size_t n, int dst, int tag)
{
    if (!t_polite) return MPI_Send(buf, (int)n, MPI_BYTE, dst, tag, comm);
    MPI_Request rq;
    int rc = MPI_Isend(buf, (int)n, MPI_BYTE, dst, tag, comm, &rq);
    return rc != MPI_SUCCESS ? rc : wait_polite(&rq);
}

/* acc[i] = prev[i] + acc[i]: the partial sum of the ranks before this one, then this rank's values */
static void add_into(int dtype, void *acc, const void *prev, int64_t n)
{
    if (dtype == TIDE_F32) {
        float *a = acc; const float *p = prev;
        for (int64_t i = 0; i < n; i++) a[i] = p[i] + a[i];
    } else {
        double *a = acc; const double *p = prev;
        for (int64_t i = 0; i < n; i++) a[i] = p[i] + a[i];
    }
}
#endif

#ifdef TIDE_HAVE_MPI
/* the first half of the rank-order sum: the partial sums travel the chain 0 -> 1 -> ... -> N-1 in chunks (each rank
   adds its values to what arrives and passes it on, pipelined); the whole sum is then on rank N-1 alone */
static int chain_sum_to_last(tide_tensor *t, const char *op, const dist_group *G)
{
    size_t es = t->dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    char *data = tide_data(t);
    int64_t n = t->numel;
    int me = G->rank, size = G->size;
    void *tmp = me > 0 ? malloc((size_t)(n < CHAIN_CHUNK ? n : CHAIN_CHUNK) * es) : NULL;
    if (me > 0 && !tmp) return tide_set_error("%s: out of memory for %lld values", op, (long long)n);
    for (int64_t k0 = 0; k0 < n; k0 += CHAIN_CHUNK) {
        int64_t m = n - k0 < CHAIN_CHUNK ? n - k0 : CHAIN_CHUNK;
        char *chunk = data + (size_t)k0 * es;
        if (me > 0) {
            if (chain_recv(G->comm, tmp, (size_t)m * es, me - 1, 7) != MPI_SUCCESS) {
                free(tmp);
                return tide_set_error("%s: receiving from rank %d failed", op, world_rank_of(G, me - 1));
            }
            add_into(t->dtype, chunk, tmp, m);
        }
        if (me < size - 1) {
            if (chain_send(G->comm, chunk, (size_t)m * es, me + 1, 7) != MPI_SUCCESS) {
                free(tmp);
                return tide_set_error("%s: sending to rank %d failed", op, world_rank_of(G, me + 1));
            }
            SENT((int64_t)((size_t)m * es));
        }
    }
    free(tmp);
    return 0;
}
#endif

/* the same chain for a device tensor, through its backend's send / recv (one message per rank, not pipelined): the
   partial sum of the ranks before arrives in a scratch tensor and is added (IEEE addition commutes, so
   acc + prev has the bits of prev + acc) */
static int device_chain_sum_to_last(tide_tensor *t, const char *op, const dist_group *G)
{
    int rc = 0;
    tide_dist_grp g = grp_of(G);
    if (G->rank > 0) {
        tide_tensor *prev = tide_empty(t->dtype, t->ndim, t->shape, t->device);
        if (!prev) return -1;
        rc = TIDE_DISPATCH(t->device, dist_recv, op, &g, tide_data(prev), tide_tensor_nbytes(t), G->rank - 1);
        if (!rc) rc = tide_axpy_(t, 1.0, prev);
        tide_tensor_release(prev);
    }
    if (!rc && G->rank < G->size - 1) {
        rc = TIDE_DISPATCH(t->device, dist_send, op, &g, tide_data(t), tide_tensor_nbytes(t), G->rank + 1);
        if (!rc) SENT(tide_tensor_nbytes(t));
    }
    return rc;
}

/* The rank-order sum ((x_0 + x_1) + x_2) + ... on rank N-1 alone (the other ranks' t is left partial): a
   reduce-scatter in rank order is this, then rank N-1 hands each rank its part (lua/tide/dist.lua); every rank but
   the last sends the buffer once, the last none. */
int tide_dist_reduce_to_last_group_(int group, tide_tensor *t)
{
    int rc = 0;
    const dist_group *G = find_group(group, "reduce");
    if (!G) return -1;
    if (device_tensor(t, "reduce", &rc)) {
        if (rc || G->size == 1 || t->numel == 0) return rc;
        return device_chain_sum_to_last(t, "reduce", G);
    }
    if (check_cpu_tensor(t, "reduce")) return -1;
    if (t->dtype != TIDE_F32 && t->dtype != TIDE_F64)
        return tide_set_error("reduce: dtype %s is not supported (f32, f64)", tide_dtype_name(t->dtype));
    if (G->size == 1 || t->numel == 0) return 0;
#ifdef TIDE_HAVE_MPI
    return chain_sum_to_last(t, "reduce", G);
#else
    return 0;
#endif
}

int tide_dist_reduce_to_last_(tide_tensor *t) { return tide_dist_reduce_to_last_group_(0, t); }

/* The sum in rank order, ((x_0 + x_1) + x_2) + ...: the partial sums travel the chain 0 -> 1 -> ... -> N-1 in chunks
   (each rank adds its values to what arrives and passes it on, pipelined), then the sum travels on from rank N-1
   through 0, 1, ..., N-2 (every rank sends the buffer once or twice: 2(N-1)/N times on average, a ring's volume). The
   order of every addition is fixed by the ranks alone, so N ranks reproduce themselves bit for bit whatever the
   message timing, and match one process that accumulates the same N parts in order (gradient accumulation). */
int tide_dist_allreduce_sum_group_(int group, tide_tensor *t) { return tide_dist_allreduce_sum_scratch_(group, t, NULL); }

/* the same, a device tensor's sum receiving into scratch (at least t's bytes on its device; NULL: the backend's own) */
int tide_dist_allreduce_sum_scratch_(int group, tide_tensor *t, tide_tensor *scratch)
{
    int rc = 0;
    const dist_group *G = find_group(group, "allreduce");
    if (!G) return -1;
    if (device_tensor(t, "allreduce", &rc)) {
        if (rc || G->size == 1 || t->numel == 0) return rc;
        tide_dist_grp g = grp_of(G);
        if (scratch && (scratch->device != t->device || tide_tensor_nbytes(scratch) < tide_tensor_nbytes(t)))
            return tide_set_error("allreduce: the scratch holds %lld bytes on device %d, the sum needs %lld on %d",
                                  (long long)tide_tensor_nbytes(scratch), scratch->device,
                                  (long long)tide_tensor_nbytes(t), t->device);
        rc = TIDE_DISPATCH(t->device, dist_allreduce_sum, "allreduce", &g, t->dtype, tide_data(t), t->numel,
                           scratch ? tide_data(scratch) : NULL);
        if (!rc) SENT(tide_tensor_nbytes(t) * ((G->rank < G->size - 1) + (G->rank != G->size - 2)));
        return rc;
    }
    if (check_cpu_tensor(t, "allreduce")) return -1;
    if (t->dtype != TIDE_F32 && t->dtype != TIDE_F64)
        return tide_set_error("allreduce: dtype %s is not supported (f32, f64)", tide_dtype_name(t->dtype));
    if (G->size == 1 || t->numel == 0) return 0;
#ifdef TIDE_HAVE_MPI
    size_t es = t->dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    char *data = tide_data(t);
    int64_t n = t->numel;
    int me = G->rank, size = G->size;
    if (chain_sum_to_last(t, "allreduce", G)) return -1;
    /* the sum from rank N-1 along the chain N-1 -> 0 -> 1 -> ... -> N-2, in the same chunks (each rank receives it
       once and passes it on once: the bytes every rank sends are its own, counted where they leave) */
    int prev = me == 0 ? size - 1 : me - 1, next = me == size - 1 ? 0 : me + 1;
    int recv = me != size - 1, send = me != size - 2;
    for (int64_t k0 = 0; k0 < n; k0 += CHAIN_CHUNK) {
        int64_t m = n - k0 < CHAIN_CHUNK ? n - k0 : CHAIN_CHUNK;
        char *chunk = data + (size_t)k0 * es;
        if (recv && chain_recv(G->comm, chunk, (size_t)m * es, prev, 8) != MPI_SUCCESS)
            return tide_set_error("allreduce: receiving the sum from rank %d failed", world_rank_of(G, prev));
        if (send) {
            if (chain_send(G->comm, chunk, (size_t)m * es, next, 8) != MPI_SUCCESS)
                return tide_set_error("allreduce: passing the sum to rank %d failed", world_rank_of(G, next));
            SENT((int64_t)((size_t)m * es));
        }
    }
#endif
    return 0;
}

int tide_dist_allreduce_sum_(tide_tensor *t) { return tide_dist_allreduce_sum_group_(0, t); }

/* the device's communicator (CUDA: NCCL over MPI) set up now; *world: its rank count, which must be MPI's */
int tide_dist_device_init(int device, int *world)
{
    int w = 0;
    if (device == TIDE_CPU) { if (world) *world = tide_dist_world_size(); return 0; }
    if (tide_dist_init()) return -1;
    tide_dist_grp g = grp_of(world_group());
    int rc = TIDE_DISPATCH(device, dist_init, "dist init", &g, &w);
    if (rc) return rc;
    if (w != tide_dist_world_size())
        return tide_set_error("dist init: the device communicator has %d ranks, MPI %d", w, tide_dist_world_size());
    if (world) *world = w;
    return 0;
}

int tide_dist_broadcast_(tide_tensor *t, int root)
{
    int rc = 0;
    if (root < 0 || root >= tide_dist_world_size())
        return tide_set_error("broadcast: root %d is not a rank (world size %d)", root, tide_dist_world_size());
    if (device_tensor(t, "broadcast", &rc)) {
        if (rc || tide_dist_world_size() == 1 || t->numel == 0) return rc;
        tide_dist_grp g = grp_of(world_group());
        rc = TIDE_DISPATCH(t->device, dist_broadcast, "broadcast", &g, tide_data(t), tide_tensor_nbytes(t), root);
        if (!rc && g_rank == root) SENT(tide_tensor_nbytes(t));
        return rc;
    }
    if (check_cpu_tensor(t, "broadcast")) return -1;
    if (tide_dist_world_size() == 1 || t->numel == 0) return 0;
#ifdef TIDE_HAVE_MPI
    if (MPI_Bcast(tide_data(t), (int)tide_tensor_nbytes(t), MPI_BYTE, root, MPI_COMM_WORLD) != MPI_SUCCESS)
        return tide_set_error("broadcast: MPI_Bcast failed");
    if (g_rank == root) SENT((int64_t)tide_tensor_nbytes(t));
#endif
    return 0;
}

/* the ranks' tensors concatenated in rank order: out holds world x in's elements, of in's dtype and device */
int tide_dist_allgather_group_(int group, tide_tensor *out, const tide_tensor *in)
{
    if (!out || !in) return tide_set_error("allgather: tensor is NULL");
    const dist_group *G = find_group(group, "allgather");
    if (!G) return -1;
    int w = G->size;
    if (out->dtype != in->dtype || out->device != in->device || out->numel != (int64_t)w * in->numel)
        return tide_set_error("allgather: out must hold %d x %lld elements of %s on in's device, got %lld of %s", w,
                              (long long)in->numel, tide_dtype_name(in->dtype), (long long)out->numel,
                              tide_dtype_name(out->dtype));
    if (!tide_is_contiguous(out) || !tide_is_contiguous(in)) return tide_set_error("allgather: tensors must be contiguous");
    int64_t nb = tide_tensor_nbytes(in);
    int rc = 0;
    if (w == 1 || nb == 0) {
        if (nb) rc = TIDE_DISPATCH(in->device, copy, "allgather", tide_data(out), out->dtype, (int64_t[]){1},
                                   tide_data(in), in->dtype, (int64_t[]){1}, 1, (int64_t[]){in->numel});
        return rc;
    }
    if (in->device != TIDE_CPU) {
        tide_dist_grp g = grp_of(G);
        rc = TIDE_DISPATCH(in->device, dist_allgather, "allgather", &g, tide_data(in), tide_data(out), nb);
    } else {
#ifdef TIDE_HAVE_MPI
        if (nb > INT32_MAX) return tide_set_error("allgather: %lld bytes a rank is past MPI's int count", (long long)nb);
        if (MPI_Allgather(tide_data(in), (int)nb, MPI_BYTE, tide_data(out), (int)nb, MPI_BYTE, G->comm) != MPI_SUCCESS)
            rc = tide_set_error("allgather: MPI_Allgather failed");
#endif
    }
    if (!rc) g_bytes_sent += nb * (w - 1);   /* this rank's part, to every other rank */
    return rc;
}

int tide_dist_allgather_(tide_tensor *out, const tide_tensor *in) { return tide_dist_allgather_group_(0, out, in); }

/* all-to-all with counts per rank: send_counts[r] elements of send (in rank order) to rank r, recv_counts[r] from
   rank r into recv (in rank order); counts in elements of the tensors' dtype (the same on both sides) */
int tide_dist_alltoallv_group_(int group, const tide_tensor *send, const int64_t *send_counts, tide_tensor *recv,
                               const int64_t *recv_counts)
{
    if (!send || !recv || !send_counts || !recv_counts) return tide_set_error("alltoallv: NULL argument");
    const dist_group *G = find_group(group, "alltoallv");
    if (!G) return -1;
    if (send->dtype != recv->dtype || send->device != recv->device)
        return tide_set_error("alltoallv: send and recv must share dtype and device");
    if (!tide_is_contiguous(send) || !tide_is_contiguous(recv)) return tide_set_error("alltoallv: tensors must be contiguous");
    int w = G->size, me = G->rank;
    int64_t es = tide_dtype_size(send->dtype), ns = 0, nr = 0;
    int64_t *sb = malloc((size_t)w * 4 * sizeof *sb);
    if (!sb) return tide_set_error("alltoallv: out of memory");
    int64_t *so = sb + w, *rb = sb + 2 * w, *ro = sb + 3 * w;
    for (int r = 0; r < w; r++) {
        if (send_counts[r] < 0 || recv_counts[r] < 0) {
            free(sb);
            return tide_set_error("alltoallv: negative count for rank %d", world_rank_of(G, r));
        }
        so[r] = ns * es; sb[r] = send_counts[r] * es; ns += send_counts[r];
        ro[r] = nr * es; rb[r] = recv_counts[r] * es; nr += recv_counts[r];
    }
    if (ns != send->numel || nr != recv->numel) {
        free(sb);
        return tide_set_error("alltoallv: the counts sum to %lld sent and %lld received, the tensors hold %lld and %lld",
                              (long long)ns, (long long)nr, (long long)send->numel, (long long)recv->numel);
    }
    int rc = 0;
    if (w == 1) {
        if (sb[0] != rb[0]) rc = tide_set_error("alltoallv: one rank sends itself %lld elements but expects %lld",
                                                 (long long)send_counts[0], (long long)recv_counts[0]);
        else if (sb[0])
            rc = TIDE_DISPATCH(send->device, copy, "alltoallv", tide_data(recv), recv->dtype, (int64_t[]){1},
                               tide_data(send), send->dtype, (int64_t[]){1}, 1, (int64_t[]){send->numel});
    } else if (send->device != TIDE_CPU) {
        tide_dist_grp g = grp_of(G);
        rc = TIDE_DISPATCH(send->device, dist_alltoallv, "alltoallv", &g, tide_data(send), sb, so, tide_data(recv), rb, ro);
    } else {
#ifdef TIDE_HAVE_MPI
        int *ic = malloc((size_t)w * 4 * sizeof *ic);
        if (!ic) rc = tide_set_error("alltoallv: out of memory");
        for (int r = 0; !rc && r < w; r++) {
            if (so[r] + sb[r] > INT32_MAX || ro[r] + rb[r] > INT32_MAX)
                rc = tide_set_error("alltoallv: more than %d bytes are past MPI's int counts", INT32_MAX);
            else { ic[r] = (int)sb[r]; ic[w + r] = (int)so[r]; ic[2 * w + r] = (int)rb[r]; ic[3 * w + r] = (int)ro[r]; }
        }
        if (!rc && MPI_Alltoallv(tide_data(send), ic, ic + w, MPI_BYTE, tide_data(recv), ic + 2 * w, ic + 3 * w, MPI_BYTE,
                                 G->comm) != MPI_SUCCESS)
            rc = tide_set_error("alltoallv: MPI_Alltoallv failed");
        free(ic);
#endif
    }
    if (!rc)
        for (int r = 0; r < w; r++) if (r != me) SENT(sb[r]);
    free(sb);
    return rc;
}

int tide_dist_alltoallv_(const tide_tensor *send, const int64_t *send_counts, tide_tensor *recv, const int64_t *recv_counts)
{
    return tide_dist_alltoallv_group_(0, send, send_counts, recv, recv_counts);
}

/* point to point: the bytes of a contiguous CPU tensor to rank dst / from rank src into t (same shape and dtype) */
int tide_dist_send_(tide_tensor *t, int dst)
{
    int rc = 0;
    if (dst < 0 || dst >= tide_dist_world_size() || dst == tide_dist_rank())
        return tide_set_error("send: rank %d is not another rank (world size %d)", dst, tide_dist_world_size());
    if (device_tensor(t, "send", &rc)) {
        tide_dist_grp g = grp_of(world_group());
        if (!rc) rc = TIDE_DISPATCH(t->device, dist_send, "send", &g, tide_data(t), tide_tensor_nbytes(t), dst);
        if (!rc) SENT(tide_tensor_nbytes(t));
        return rc;
    }
    if (check_cpu_tensor(t, "send")) return -1;
#ifdef TIDE_HAVE_MPI
    if (MPI_Send(tide_data(t), (int)tide_tensor_nbytes(t), MPI_BYTE, dst, 11, MPI_COMM_WORLD) != MPI_SUCCESS)
        return tide_set_error("send: MPI_Send to rank %d failed", dst);
    SENT((int64_t)tide_tensor_nbytes(t));
#endif
    return 0;
}

int tide_dist_recv_(tide_tensor *t, int src)
{
    int rc = 0;
    if (src < 0 || src >= tide_dist_world_size() || src == tide_dist_rank())
        return tide_set_error("recv: rank %d is not another rank (world size %d)", src, tide_dist_world_size());
    if (device_tensor(t, "recv", &rc)) {
        tide_dist_grp g = grp_of(world_group());
        if (!rc) rc = TIDE_DISPATCH(t->device, dist_recv, "recv", &g, tide_data(t), tide_tensor_nbytes(t), src);
        return rc;
    }
    if (check_cpu_tensor(t, "recv")) return -1;
#ifdef TIDE_HAVE_MPI
    int got = 0;
    MPI_Status st;
    if (MPI_Recv(tide_data(t), (int)tide_tensor_nbytes(t), MPI_BYTE, src, 11, MPI_COMM_WORLD, &st) != MPI_SUCCESS)
        return tide_set_error("recv: MPI_Recv from rank %d failed", src);
    MPI_Get_count(&st, MPI_BYTE, &got);
    if ((int64_t)got != tide_tensor_nbytes(t))
        return tide_set_error("recv: rank %d sent %d bytes, expected %lld", src, got, (long long)tide_tensor_nbytes(t));
#endif
    return 0;
}

int tide_dist_barrier(void)
{
#ifdef TIDE_HAVE_MPI
    if (tide_dist_world_size() > 1 && MPI_Barrier(MPI_COMM_WORLD) != MPI_SUCCESS) return tide_set_error("barrier: MPI_Barrier failed");
#endif
    return 0;
}

int tide_dist_active(void) { return g_inited && g_world > 1; }

void tide_dist_abort(int code)
{
#ifdef TIDE_HAVE_MPI
    if (tide_dist_active()) MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
#endif
    (void)code;
}

void tide_dist_finalize(void)
{
#ifdef TIDE_HAVE_MPI
    int ready = 0, done = 0;
    MPI_Initialized(&ready);
    MPI_Finalized(&done);
    if (ready && !done) MPI_Finalize();
#endif
}

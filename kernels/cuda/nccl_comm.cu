/*
 * nccl_comm.cu — the collectives of engine/dist/comm.c for CUDA tensors, over NCCL (kernels/backend.h: dist_*).
 * One NCCL communicator per process group (tide_dist_grp: the world, or a layout's dp / ep / cp group), made on the
 * group's first collective: the group's rank 0 draws an ncclUniqueId, broadcasts it over the group's MPI
 * communicator, and the members join with ncclCommInitRank. One rank per GPU: each rank uses its process's current
 * device (give each rank its own, e.g. CUDA_VISIBLE_DEVICES per rank). Everything runs on the engine's stream, in
 * stream order with the kernels around it.
 *
 * The sum is comm.c's chain, not NCCL's ring: partial sums travel 0 -> 1 -> ... -> N-1 in chunks (ncclRecv, one
 * add kernel, ncclSend), then the sum travels on N-1 -> 0 -> ... -> N-2. Every addition's order is fixed by the
 * ranks, so N ranks reproduce themselves bit for bit and equal gradient accumulation on one rank.
 *
 * Built only with NCCL and MPI (TIDE_HAVE_NCCL); without them the entries are NULL and a CUDA tensor's collective
 * is the engine's "no kernel" error. tests/gpu/emu/nccl.cpp runs this file on the CPU under mpirun, with NCCL
 * stood in for by MPI (tests/gpu/emu/fake/nccl.h).
 */
#include "common.cuh"

#ifdef TIDE_HAVE_NCCL
#include <mpi.h>
#include <nccl.h>

#ifndef NCCL_CHUNK
#define NCCL_CHUNK (1 << 22)      /* elements per message of the chain */
#endif

static ncclComm_t g_comms[TIDE_DIST_MAX_GROUPS];   /* by group id; NULL until the group's first collective */

/* the side stream of the gradient buckets (backend.h: comm_fork / comm_back / comm_join): a thread between fork and
   back issues its collectives there, ordered after the main stream's work by an event */
static cudaStream_t g_side;
static cudaEvent_t g_main_done, g_side_done;
static thread_local int t_on_side;

/* the stream this thread's collectives go on */
static int comm_stream(cudaStream_t *s)
{
    if (t_on_side) { *s = g_side; return 0; }
    return tide_cuda_get_stream(s);
}
#define COMM_STREAM(s) \
    cudaStream_t s = 0; \
    do { if (comm_stream(&s)) return -1; } while (0)

static int nccl_comm_fork(void)
{
    TIDE_STREAM(main);
    if (!g_side) {
        TIDE_CU(cudaStreamCreateWithFlags(&g_side, cudaStreamNonBlocking), "comm fork: side stream");
        TIDE_CU(cudaEventCreateWithFlags(&g_main_done, cudaEventDisableTiming), "comm fork: event");
        TIDE_CU(cudaEventCreateWithFlags(&g_side_done, cudaEventDisableTiming), "comm fork: event");
    }
    TIDE_CU(cudaEventRecord(g_main_done, main), "comm fork: record");
    TIDE_CU(cudaStreamWaitEvent(g_side, g_main_done, 0), "comm fork: wait");
    t_on_side = 1;
    return 0;
}

static int nccl_comm_back(void)
{
    t_on_side = 0;
    return 0;
}

static int nccl_comm_join(void)
{
    if (!g_side) return 0;
    TIDE_STREAM(main);
    TIDE_CU(cudaEventRecord(g_side_done, g_side), "comm join: record");
    TIDE_CU(cudaStreamWaitEvent(main, g_side_done, 0), "comm join: wait");
    return 0;
}

/* group g's communicator, made now if it is the group's first collective (every member is in this call) */
static ncclComm_t nccl_comm(const tide_dist_grp *g, const char *what)
{
    if (g->id < 0 || g->id >= TIDE_DIST_MAX_GROUPS) {
        tide_set_error("%s: %d is not a process group", what, g->id);
        return NULL;
    }
    if (g_comms[g->id]) return g_comms[g->id];
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited || !g->mpi_comm) {
        tide_set_error("%s: the NCCL communicator bootstraps over MPI: run under mpirun", what);
        return NULL;
    }
    MPI_Comm mc = *(const MPI_Comm *)g->mpi_comm;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    ncclResult_t r = ncclSuccess;
    if (g->rank == 0) r = ncclGetUniqueId(&id);
    /* every member takes part in the broadcast, so a failure at the group's rank 0 still reaches the others as a bad id */
    if (MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, mc) != MPI_SUCCESS) {
        tide_set_error("%s: broadcasting the NCCL id over MPI failed (group %d)", what, g->id);
        return NULL;
    }
    if (r != ncclSuccess) {
        tide_set_error("%s: ncclGetUniqueId: %s", what, ncclGetErrorString(r));
        return NULL;
    }
    ncclComm_t c = NULL;
    r = ncclCommInitRank(&c, g->size, id, g->rank);
    if (r != ncclSuccess) {
        tide_set_error("%s: ncclCommInitRank (rank %d of %d in group %d): %s", what, g->rank, g->size, g->id,
                       ncclGetErrorString(r));
        return NULL;
    }
    g_comms[g->id] = c;
    return c;
}

#define NCCL_CHECK(call, what)                                                                                      \
    do {                                                                                                            \
        ncclResult_t nr_ = (call);                                                                                  \
        if (nr_ != ncclSuccess) return tide_set_error("%s: %s", (what), ncclGetErrorString(nr_));                  \
    } while (0)

template <typename T> __global__ void chain_add_kernel(T *acc, const T *prev, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        acc[i] = prev[i] + acc[i];
}

static int chain_allreduce(const tide_dist_grp *g, int dtype, void *data, int64_t n, void *scratch)
{
    const char *what = "allreduce (nccl)";
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s is not supported (f32, f64)", what, tide_cuda_dtype_str(dtype));
    ncclComm_t comm = nccl_comm(g, what);
    if (!comm) return -1;
    int me = g->rank, size = g->size;
    if (size == 1 || n == 0) return 0;
    COMM_STREAM(s);
    size_t es = dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    ncclDataType_t nt = dtype == TIDE_F32 ? ncclFloat32 : ncclFloat64;
    char *base = (char *)data;
    void *tmp = scratch;
    int64_t cmax = n < NCCL_CHUNK ? n : NCCL_CHUNK;
    if (me > 0 && !tmp && tide_cuda_alloc(&tmp, (size_t)cmax * es, s) != cudaSuccess)
        return tide_set_error("%s: out of device memory for %lld values", what, (long long)cmax);
    int rc = 0;
    for (int64_t k0 = 0; k0 < n && !rc; k0 += NCCL_CHUNK) {
        int64_t m = n - k0 < NCCL_CHUNK ? n - k0 : NCCL_CHUNK;
        char *chunk = base + (size_t)k0 * es;
        if (me > 0) {
            ncclResult_t r = ncclRecv(tmp, (size_t)m, nt, me - 1, comm, s);
            if (r != ncclSuccess) { rc = tide_set_error("%s: ncclRecv: %s", what, ncclGetErrorString(r)); break; }
            unsigned blocks = (unsigned)((m + 255) / 256 < 4096 ? (m + 255) / 256 : 4096);
            if (dtype == TIDE_F32) chain_add_kernel<float><<<blocks, 256, 0, s>>>((float *)chunk, (const float *)tmp, m);
            else chain_add_kernel<double><<<blocks, 256, 0, s>>>((double *)chunk, (const double *)tmp, m);
            if (cudaGetLastError() != cudaSuccess) { rc = tide_set_error("%s: the add kernel failed", what); break; }
        }
        if (me < size - 1) {
            ncclResult_t r = ncclSend(chunk, (size_t)m, nt, me + 1, comm, s);
            if (r != ncclSuccess) rc = tide_set_error("%s: ncclSend: %s", what, ncclGetErrorString(r));
        }
    }
    if (tmp && tmp != scratch) tide_cuda_release(tmp, s);
    if (rc) return rc;
    /* the sum on from N-1 through 0 .. N-2 */
    int prev = me == 0 ? size - 1 : me - 1, next = me == size - 1 ? 0 : me + 1;
    for (int64_t k0 = 0; k0 < n; k0 += NCCL_CHUNK) {
        int64_t m = n - k0 < NCCL_CHUNK ? n - k0 : NCCL_CHUNK;
        char *chunk = base + (size_t)k0 * es;
        if (me != size - 1) NCCL_CHECK(ncclRecv(chunk, (size_t)m, nt, prev, comm, s), what);
        if (me != size - 2) NCCL_CHECK(ncclSend(chunk, (size_t)m, nt, next, comm, s), what);
    }
    return 0;
}

static int nccl_broadcast(const tide_dist_grp *g, void *data, int64_t nbytes, int root)
{
    const char *what = "broadcast (nccl)";
    ncclComm_t comm = nccl_comm(g, what);
    if (!comm) return -1;
    if (g->size == 1 || nbytes == 0) return 0;
    COMM_STREAM(s);
    NCCL_CHECK(ncclBroadcast(data, data, (size_t)nbytes, ncclChar, root, comm, s), what);
    return 0;
}

static int nccl_send(const tide_dist_grp *g, const void *data, int64_t nbytes, int peer)
{
    const char *what = "send (nccl)";
    ncclComm_t comm = nccl_comm(g, what);
    if (!comm) return -1;
    COMM_STREAM(s);
    NCCL_CHECK(ncclSend(data, (size_t)nbytes, ncclChar, peer, comm, s), what);
    return 0;
}

static int nccl_recv(const tide_dist_grp *g, void *data, int64_t nbytes, int peer)
{
    const char *what = "recv (nccl)";
    ncclComm_t comm = nccl_comm(g, what);
    if (!comm) return -1;
    COMM_STREAM(s);
    NCCL_CHECK(ncclRecv(data, (size_t)nbytes, ncclChar, peer, comm, s), what);
    return 0;
}

static int nccl_allgather(const tide_dist_grp *g, const void *send, void *recv, int64_t nbytes)
{
    const char *what = "allgather (nccl)";
    ncclComm_t comm = nccl_comm(g, what);
    if (!comm) return -1;
    if (nbytes == 0) return 0;
    COMM_STREAM(s);
    NCCL_CHECK(ncclAllGather(send, recv, (size_t)nbytes, ncclChar, comm, s), what);
    return 0;
}

/* every pair's send and receive in one group: NCCL matches them without an order to deadlock on */
static int nccl_alltoallv(const tide_dist_grp *g, const void *send, const int64_t *send_bytes, const int64_t *send_off,
                          void *recv, const int64_t *recv_bytes, const int64_t *recv_off)
{
    const char *what = "alltoallv (nccl)";
    ncclComm_t comm = nccl_comm(g, what);
    if (!comm) return -1;
    COMM_STREAM(s);
    NCCL_CHECK(ncclGroupStart(), what);
    for (int r = 0; r < g->size; r++) {
        if (send_bytes[r] > 0) {
            ncclResult_t e = ncclSend((const char *)send + send_off[r], (size_t)send_bytes[r], ncclChar, r, comm, s);
            if (e != ncclSuccess) { ncclGroupEnd(); return tide_set_error("%s: %s", what, ncclGetErrorString(e)); }
        }
        if (recv_bytes[r] > 0) {
            ncclResult_t e = ncclRecv((char *)recv + recv_off[r], (size_t)recv_bytes[r], ncclChar, r, comm, s);
            if (e != ncclSuccess) { ncclGroupEnd(); return tide_set_error("%s: %s", what, ncclGetErrorString(e)); }
        }
    }
    NCCL_CHECK(ncclGroupEnd(), what);
    return 0;
}

static int nccl_init(const tide_dist_grp *g, int *world)
{
    ncclComm_t comm = nccl_comm(g, "init (nccl)");
    if (!comm) return -1;
    int n = 0;
    NCCL_CHECK(ncclCommCount(comm, &n), "init (nccl): ncclCommCount");
    *world = n;
    return 0;
}

void tide_cuda_dist_entries(tide_backend *t)
{
    t->dist_init = nccl_init;
    t->dist_allgather = nccl_allgather;
    t->dist_alltoallv = nccl_alltoallv;
    t->dist_allreduce_sum = chain_allreduce;
    t->dist_broadcast = nccl_broadcast;
    t->dist_send = nccl_send;
    t->dist_recv = nccl_recv;
    t->comm_fork = nccl_comm_fork;
    t->comm_back = nccl_comm_back;
    t->comm_join = nccl_comm_join;
}
#else
void tide_cuda_dist_entries(tide_backend *t) { (void)t; }
#endif

/*
 * nccl_comm.cu — the collectives of engine/dist/comm.c for CUDA tensors, over NCCL (kernels/backend.h: dist_*).
 * The communicator is bootstrapped over MPI on first use (rank 0's ncclUniqueId broadcast with MPI_Bcast), one
 * rank per GPU: each rank uses its process's current device (give each rank its own, e.g. CUDA_VISIBLE_DEVICES per
 * rank). Everything runs on the engine's stream, in stream order with the kernels around it.
 *
 * The sum is comm.c's chain, not NCCL's ring: partial sums travel 0 -> 1 -> ... -> N-1 in chunks (ncclRecv, one
 * add kernel, ncclSend), then the sum travels on N-1 -> 0 -> ... -> N-2. Every addition's order is fixed by the
 * ranks, so N ranks reproduce themselves bit for bit and equal gradient accumulation on one rank.
 *
 * Built only with NCCL and MPI (TIDE_HAVE_NCCL); without them the entries are NULL and a CUDA tensor's collective
 * is the engine's "no kernel" error.
 */
#include "common.cuh"

#ifdef TIDE_HAVE_NCCL
#include <mpi.h>
#include <nccl.h>

#define NCCL_CHUNK (1 << 22)      /* elements per message of the chain */

static ncclComm_t g_comm;
static int g_rank, g_world, g_ready;

static int nccl_comm(const char *what)
{
    if (g_ready) return 0;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) return tide_set_error("%s: the NCCL communicator bootstraps over MPI: run under mpirun", what);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    ncclResult_t r = ncclSuccess;
    if (g_rank == 0) r = ncclGetUniqueId(&id);
    /* every rank takes part in the broadcast, so a failure at rank 0 still reaches the others as a bad id */
    if (MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
        return tide_set_error("%s: broadcasting the NCCL id over MPI failed", what);
    if (r != ncclSuccess) return tide_set_error("%s: ncclGetUniqueId: %s", what, ncclGetErrorString(r));
    r = ncclCommInitRank(&g_comm, g_world, id, g_rank);
    if (r != ncclSuccess) return tide_set_error("%s: ncclCommInitRank (rank %d of %d): %s", what, g_rank, g_world,
                                                ncclGetErrorString(r));
    g_ready = 1;
    return 0;
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

static int chain_allreduce(int dtype, void *data, int64_t n)
{
    const char *what = "allreduce (nccl)";
    if (dtype != TIDE_F32 && dtype != TIDE_F64)
        return tide_set_error("%s: dtype %s is not supported (f32, f64)", what, tide_cuda_dtype_str(dtype));
    if (nccl_comm(what)) return -1;
    if (g_world == 1 || n == 0) return 0;
    TIDE_STREAM(s);
    size_t es = dtype == TIDE_F32 ? sizeof(float) : sizeof(double);
    ncclDataType_t nt = dtype == TIDE_F32 ? ncclFloat32 : ncclFloat64;
    char *base = (char *)data;
    void *tmp = NULL;
    int64_t cmax = n < NCCL_CHUNK ? n : NCCL_CHUNK;
    if (g_rank > 0 && tide_cuda_alloc(&tmp, (size_t)cmax * es, s) != cudaSuccess)
        return tide_set_error("%s: out of device memory for %lld values", what, (long long)cmax);
    int rc = 0;
    for (int64_t k0 = 0; k0 < n && !rc; k0 += NCCL_CHUNK) {
        int64_t m = n - k0 < NCCL_CHUNK ? n - k0 : NCCL_CHUNK;
        char *chunk = base + (size_t)k0 * es;
        if (g_rank > 0) {
            ncclResult_t r = ncclRecv(tmp, (size_t)m, nt, g_rank - 1, g_comm, s);
            if (r != ncclSuccess) { rc = tide_set_error("%s: ncclRecv: %s", what, ncclGetErrorString(r)); break; }
            unsigned blocks = (unsigned)((m + 255) / 256 < 4096 ? (m + 255) / 256 : 4096);
            if (dtype == TIDE_F32) chain_add_kernel<float><<<blocks, 256, 0, s>>>((float *)chunk, (const float *)tmp, m);
            else chain_add_kernel<double><<<blocks, 256, 0, s>>>((double *)chunk, (const double *)tmp, m);
            if (cudaGetLastError() != cudaSuccess) { rc = tide_set_error("%s: the add kernel failed", what); break; }
        }
        if (g_rank < g_world - 1) {
            ncclResult_t r = ncclSend(chunk, (size_t)m, nt, g_rank + 1, g_comm, s);
            if (r != ncclSuccess) rc = tide_set_error("%s: ncclSend: %s", what, ncclGetErrorString(r));
        }
    }
    if (tmp) tide_cuda_release(tmp, s);
    if (rc) return rc;
    /* the sum on from N-1 through 0 .. N-2 */
    int prev = g_rank == 0 ? g_world - 1 : g_rank - 1, next = g_rank == g_world - 1 ? 0 : g_rank + 1;
    for (int64_t k0 = 0; k0 < n; k0 += NCCL_CHUNK) {
        int64_t m = n - k0 < NCCL_CHUNK ? n - k0 : NCCL_CHUNK;
        char *chunk = base + (size_t)k0 * es;
        if (g_rank != g_world - 1) NCCL_CHECK(ncclRecv(chunk, (size_t)m, nt, prev, g_comm, s), what);
        if (g_rank != g_world - 2) NCCL_CHECK(ncclSend(chunk, (size_t)m, nt, next, g_comm, s), what);
    }
    return 0;
}

static int nccl_broadcast(void *data, int64_t nbytes, int root)
{
    const char *what = "broadcast (nccl)";
    if (nccl_comm(what)) return -1;
    if (g_world == 1 || nbytes == 0) return 0;
    TIDE_STREAM(s);
    NCCL_CHECK(ncclBroadcast(data, data, (size_t)nbytes, ncclChar, root, g_comm, s), what);
    return 0;
}

static int nccl_send(const void *data, int64_t nbytes, int peer)
{
    const char *what = "send (nccl)";
    if (nccl_comm(what)) return -1;
    TIDE_STREAM(s);
    NCCL_CHECK(ncclSend(data, (size_t)nbytes, ncclChar, peer, g_comm, s), what);
    return 0;
}

static int nccl_recv(void *data, int64_t nbytes, int peer)
{
    const char *what = "recv (nccl)";
    if (nccl_comm(what)) return -1;
    TIDE_STREAM(s);
    NCCL_CHECK(ncclRecv(data, (size_t)nbytes, ncclChar, peer, g_comm, s), what);
    return 0;
}

static int nccl_allgather(const void *send, void *recv, int64_t nbytes)
{
    const char *what = "allgather (nccl)";
    if (nccl_comm(what)) return -1;
    if (nbytes == 0) return 0;
    TIDE_STREAM(s);
    NCCL_CHECK(ncclAllGather(send, recv, (size_t)nbytes, ncclChar, g_comm, s), what);
    return 0;
}

/* every pair's send and receive in one group: NCCL matches them without an order to deadlock on */
static int nccl_alltoallv(const void *send, const int64_t *send_bytes, const int64_t *send_off, void *recv,
                          const int64_t *recv_bytes, const int64_t *recv_off)
{
    const char *what = "alltoallv (nccl)";
    if (nccl_comm(what)) return -1;
    TIDE_STREAM(s);
    NCCL_CHECK(ncclGroupStart(), what);
    for (int r = 0; r < g_world; r++) {
        if (send_bytes[r] > 0) {
            ncclResult_t e = ncclSend((const char *)send + send_off[r], (size_t)send_bytes[r], ncclChar, r, g_comm, s);
            if (e != ncclSuccess) { ncclGroupEnd(); return tide_set_error("%s: %s", what, ncclGetErrorString(e)); }
        }
        if (recv_bytes[r] > 0) {
            ncclResult_t e = ncclRecv((char *)recv + recv_off[r], (size_t)recv_bytes[r], ncclChar, r, g_comm, s);
            if (e != ncclSuccess) { ncclGroupEnd(); return tide_set_error("%s: %s", what, ncclGetErrorString(e)); }
        }
    }
    NCCL_CHECK(ncclGroupEnd(), what);
    return 0;
}

static int nccl_init(int *world)
{
    if (nccl_comm("init (nccl)")) return -1;
    int n = 0;
    NCCL_CHECK(ncclCommCount(g_comm, &n), "init (nccl): ncclCommCount");
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
}
#else
void tide_cuda_dist_entries(tide_backend *t) { (void)t; }
#endif

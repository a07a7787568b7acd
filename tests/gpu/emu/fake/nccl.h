// fake/nccl.h — the part of NCCL that kernels/cuda/nccl_comm.cu calls, stood in for by MPI on host memory, so that
// file runs on the CPU under the emulator (emu.h) in an mpirun job (tests/gpu/emu/nccl.cpp). The emulator's device
// memory is host memory and its stream is synchronous, so a collective is done when the call returns.
//
// Semantics kept from NCCL: one communicator per ncclCommInitRank, ranks numbered by the rank passed there;
// ncclSend / ncclRecv (to any rank, this one included) outside a group block until matched (so a cycle of them deadlocks here as it would on GPUs);
// inside ncclGroupStart / ncclGroupEnd they are posted together at the end and matched in any order; counts are in
// elements of the datatype. Where the fake is stricter: ncclCommInitRank makes its MPI communicator with
// MPI_Comm_split over MPI_COMM_WORLD, so every world rank must be making a communicator at the same time (true of
// the harness: the groups of one split all make theirs in the same collective).
#pragma once
#include <mpi.h>
#include <cstring>
#include <vector>

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
} ncclResult_t;

typedef enum { ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclInt32 = 2, ncclFloat32 = 7, ncclFloat64 = 8 } ncclDataType_t;

typedef struct { char internal[128]; } ncclUniqueId;

struct fake_nccl_comm {
    MPI_Comm comm;
    int rank, size;
};
typedef fake_nccl_comm *ncclComm_t;

namespace fake_nccl {
struct op {
    bool send;
    void *buf;
    size_t bytes;
    int peer;
    MPI_Comm comm;
};
inline int depth;                 // ncclGroupStart nesting
inline std::vector<op> pending;   // the group's sends and receives
inline long long bytes_sent;      // what this rank handed to its peers (the harness checks the chain's volume)
inline int comms_made;            // ncclCommInitRank calls that succeeded
inline int counter;               // ids drawn by this process
inline cudaStream_t last_stream;  // the stream of the latest call (the harness checks the side stream's routing)

inline size_t type_size(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclInt32: case ncclFloat32: return 4;
    case ncclFloat64: return 8;
    }
    return 0;
}
inline ncclResult_t ok(int mpi_rc) { return mpi_rc == MPI_SUCCESS ? ncclSuccess : ncclSystemError; }
}  // namespace fake_nccl

inline const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclSystemError: return "unhandled system error";
    default: return "internal error";
    }
}

// the id names the rank that drew it: the members of one communicator share its creator
inline ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    int wr = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    memset(id, 0, sizeof *id);
    int v[3] = {0x7e1de, wr, fake_nccl::counter++};
    memcpy(id->internal, v, sizeof v);
    return ncclSuccess;
}

inline ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank)
{
    int v[3];
    memcpy(v, id.internal, sizeof v);
    if (v[0] != 0x7e1de || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    MPI_Comm c;
    if (MPI_Comm_split(MPI_COMM_WORLD, v[1], rank, &c) != MPI_SUCCESS) return ncclSystemError;
    int r = 0, n = 0;
    MPI_Comm_rank(c, &r);
    MPI_Comm_size(c, &n);
    if (r != rank || n != nranks) { MPI_Comm_free(&c); return ncclInvalidUsage; }
    *comm = new fake_nccl_comm{c, r, n};
    fake_nccl::comms_made++;
    return ncclSuccess;
}

inline ncclResult_t ncclCommCount(ncclComm_t comm, int *count)
{
    if (!comm) return ncclInvalidArgument;
    *count = comm->size;
    return ncclSuccess;
}

inline ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    if (!comm) return ncclInvalidArgument;
    MPI_Comm_free(&comm->comm);
    delete comm;
    return ncclSuccess;
}

inline ncclResult_t ncclGroupStart(void)
{
    fake_nccl::depth++;
    return ncclSuccess;
}

inline ncclResult_t ncclGroupEnd(void)
{
    using namespace fake_nccl;
    if (depth <= 0) return ncclInvalidUsage;
    if (--depth > 0) return ncclSuccess;
    std::vector<MPI_Request> rq(pending.size());
    int rc = MPI_SUCCESS;
    for (size_t i = 0; i < pending.size() && rc == MPI_SUCCESS; i++) {
        op &o = pending[i];
        rc = o.send ? MPI_Isend(o.buf, (int)o.bytes, MPI_BYTE, o.peer, 0, o.comm, &rq[i])
                    : MPI_Irecv(o.buf, (int)o.bytes, MPI_BYTE, o.peer, 0, o.comm, &rq[i]);
        if (o.send) bytes_sent += (long long)o.bytes;
    }
    if (rc == MPI_SUCCESS) rc = MPI_Waitall((int)rq.size(), rq.data(), MPI_STATUSES_IGNORE);
    pending.clear();
    return ok(rc);
}

inline ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t st)
{
    using namespace fake_nccl;
    last_stream = st;
    if (!comm || peer < 0 || peer >= comm->size) return ncclInvalidArgument;
    size_t bytes = count * type_size(t);
    if (depth > 0) {
        pending.push_back({true, const_cast<void *>(buf), bytes, peer, comm->comm});
        return ncclSuccess;
    }
    bytes_sent += (long long)bytes;
    return ok(MPI_Send(buf, (int)bytes, MPI_BYTE, peer, 0, comm->comm));
}

inline ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t st)
{
    using namespace fake_nccl;
    last_stream = st;
    if (!comm || peer < 0 || peer >= comm->size) return ncclInvalidArgument;
    size_t bytes = count * type_size(t);
    if (depth > 0) {
        pending.push_back({false, buf, bytes, peer, comm->comm});
        return ncclSuccess;
    }
    MPI_Status status;
    int rc = MPI_Recv(buf, (int)bytes, MPI_BYTE, peer, 0, comm->comm, &status);
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (rc == MPI_SUCCESS && (size_t)got != bytes) return ncclInvalidUsage;   // NCCL needs the sizes to match
    return ok(rc);
}

inline ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t, ncclComm_t comm,
                                  cudaStream_t st)
{
    fake_nccl::last_stream = st;
    if (!comm) return ncclInvalidArgument;
    size_t bytes = count * fake_nccl::type_size(t);
    fake_nccl::bytes_sent += (long long)(bytes * (size_t)(comm->size - 1));
    return fake_nccl::ok(MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, comm->comm));
}

inline ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root,
                                  ncclComm_t comm, cudaStream_t st)
{
    fake_nccl::last_stream = st;
    if (!comm || root < 0 || root >= comm->size) return ncclInvalidArgument;
    size_t bytes = count * fake_nccl::type_size(t);
    if (comm->rank == root) {
        if (send != recv) memmove(recv, send, bytes);
        fake_nccl::bytes_sent += (long long)bytes;
    }
    return fake_nccl::ok(MPI_Bcast(recv, (int)bytes, MPI_BYTE, root, comm->comm));
}

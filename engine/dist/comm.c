/*
 * comm.c — collectives for data parallelism (DESIGN.md §9). CPU tensors go through MPI when the build
 * found an MPI library; without MPI, or in a process not started by mpirun, there is one rank and every
 * collective is the identity. (NCCL for CUDA tensors comes with the CUDA data-parallel work.)
 */
#include <stdlib.h>
#include "../internal.h"
#ifdef TIDE_HAVE_MPI
#include <mpi.h>
#endif

static int g_rank = 0, g_world = 1, g_inited;

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
    int ready = 0;
    MPI_Initialized(&ready);
    if (!ready && MPI_Init(NULL, NULL) != MPI_SUCCESS) return tide_set_error("dist: MPI_Init failed");
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world);
#endif
    return 0;
}

int tide_dist_rank(void) { tide_dist_init(); return g_rank; }
int tide_dist_world_size(void) { tide_dist_init(); return g_world; }

static int check_cpu_tensor(const tide_tensor *t, const char *op)
{
    if (!t) return tide_set_error("%s: tensor is NULL", op);
    if (t->device != TIDE_CPU) return tide_set_error("%s: only CPU tensors are supported by the MPI path", op);
    if (!tide_is_contiguous(t)) return tide_set_error("%s: tensor must be contiguous", op);
    return 0;
}

int tide_dist_allreduce_sum_(tide_tensor *t)
{
    if (check_cpu_tensor(t, "allreduce")) return -1;
    if (t->dtype != TIDE_F32 && t->dtype != TIDE_F64)
        return tide_set_error("allreduce: dtype %s is not supported (f32, f64)", tide_dtype_name(t->dtype));
    if (tide_dist_world_size() == 1 || t->numel == 0) return 0;
#ifdef TIDE_HAVE_MPI
    if (MPI_Allreduce(MPI_IN_PLACE, tide_data(t), (int)t->numel, t->dtype == TIDE_F32 ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM,
                      MPI_COMM_WORLD) != MPI_SUCCESS)
        return tide_set_error("allreduce: MPI_Allreduce failed");
#endif
    return 0;
}

int tide_dist_broadcast_(tide_tensor *t, int root)
{
    if (check_cpu_tensor(t, "broadcast")) return -1;
    if (root < 0 || root >= tide_dist_world_size())
        return tide_set_error("broadcast: root %d is not a rank (world size %d)", root, tide_dist_world_size());
    if (tide_dist_world_size() == 1 || t->numel == 0) return 0;
#ifdef TIDE_HAVE_MPI
    if (MPI_Bcast(tide_data(t), (int)tide_tensor_nbytes(t), MPI_BYTE, root, MPI_COMM_WORLD) != MPI_SUCCESS)
        return tide_set_error("broadcast: MPI_Bcast failed");
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

void tide_dist_finalize(void)
{
#ifdef TIDE_HAVE_MPI
    int ready = 0, done = 0;
    MPI_Initialized(&ready);
    MPI_Finalized(&done);
    if (ready && !done) MPI_Finalize();
#endif
}

/*
 * test_nccl.c — the NCCL path of the collectives (kernels/cuda/nccl_comm.cu) on one GPU: the communicator
 * bootstraps over MPI (a singleton MPI job: TIDE_FORCE_MPI, or under `mpirun -np 1`) and has MPI's one rank; on that
 * rank a CUDA tensor's all-reduce, reduce to the last rank and broadcast leave it unchanged and send no bytes. More
 * than one rank needs more than one
 * GPU (NCCL refuses two ranks on one device), so the chain itself across ranks is tested on the MPI path
 * (tests/dist/dp_check.sh) and waits for a machine with two GPUs here.
 *
 * Exit code: 0 passed, 1 failed, 77 skipped (no CUDA device, or a build without NCCL/MPI).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tide.h"

#define GPU 1   /* cuda:0 */

int main(void)
{
    if (tide_cuda_device_count() < 1) { printf("test-nccl: no CUDA device: skipped\n"); return 77; }
    if (!tide_mpi_available()) { printf("test-nccl: built without MPI: skipped\n"); return 77; }
    setenv("TIDE_FORCE_MPI", "1", 0);
    int pass = 0, fail = 0, world = -1;
    if (tide_dist_device_init(GPU, &world)) {
        const char *e = tide_last_error();
        if (strstr(e, "no dist_init kernel")) { printf("test-nccl: built without NCCL (%s): skipped\n", e); return 77; }
        printf("FAIL  the NCCL communicator did not come up: %s\n", e);
        return 1;
    }
    (world == tide_dist_world_size() && world >= 1) ? pass++ : (fail++, printf("FAIL  NCCL has %d ranks, MPI %d\n", world,
                                                                             tide_dist_world_size()));
    printf("ok    the NCCL communicator bootstrapped over MPI: %d rank(s)\n", world);
    double v[6] = {1.5, -2.25, 3.0, 0.125, 1e-3, -7.0}, out[6];
    tide_tensor *h = tide_from_f64(TIDE_F32, 1, (int64_t[]){6}, 0, v);
    tide_tensor *d = tide_to_device(h, GPU);
    if (!d) { printf("FAIL  copying to the GPU: %s\n", tide_last_error()); return 1; }
    int64_t before = tide_dist_bytes_sent();
    int rc = tide_dist_allreduce_sum_(d) || tide_dist_reduce_to_last_(d) || tide_dist_broadcast_(d, 0);
    if (rc) { printf("FAIL  a collective on one rank: %s\n", tide_last_error()); fail++; }
    else {
        tide_to_f64_buffer(d, out, 6);
        int same = 1;
        for (int i = 0; i < 6; i++) same &= out[i] == (double)(float)v[i];
        same ? pass++ : (fail++, printf("FAIL  one rank's all-reduce / reduce / broadcast changed the tensor\n"));
        (tide_dist_bytes_sent() == before) ? pass++ : (fail++, printf("FAIL  one rank sent bytes\n"));
        if (same) printf("ok    one rank: all-reduce, reduce to the last rank and broadcast leave a CUDA tensor as it was\n");
    }
    tide_tensor_release(h); tide_tensor_release(d);
    tide_dist_finalize();
    printf("%d passed, %d failed\n", pass, fail);
    return fail ? 1 : 0;
}

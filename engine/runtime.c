/* runtime.c — version, threads, and what this build and machine can do (`tide info`). */
#include <stdio.h>
#include <time.h>
#include "internal.h"
#include "../kernels/cpu/cpu.h"

#ifndef TIDE_VERSION
#define TIDE_VERSION "0.0.0"
#endif

const char *tide_version(void) { return TIDE_VERSION; }
int tide_num_threads(void) { return tide_cpu_get_threads(); }
void tide_set_num_threads(int n) { tide_cpu_set_threads(n); }
const char *tide_blas_info(void) { return tide_cpu_blas_info(); }

int tide_cuda_device_count(void)
{
#ifdef TIDE_HAVE_CUDA
    return tide_cuda_runtime_device_count();
#else
    return 0;
#endif
}

int tide_cuda_available(void) { return tide_cuda_device_count() > 0; }

const char *tide_cuda_info(void)
{
#ifdef TIDE_HAVE_CUDA
    return tide_cuda_runtime_info();
#else
    return "built without CUDA";
#endif
}

int tide_mpi_available(void)
{
#ifdef TIDE_HAVE_MPI
    return 1;
#else
    return 0;
#endif
}

double tide_time_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* runtime.c — version, threads, and what this build and machine can do (`tide info`). */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "internal.h"
#include "../kernels/cpu/cpu.h"

#ifndef TIDE_VERSION
#define TIDE_VERSION "0.0.0"
#endif

#ifndef TIDE_BUILD_TYPE
#define TIDE_BUILD_TYPE "unknown"
#endif
#ifndef TIDE_COMMIT
#define TIDE_COMMIT "unknown"
#endif

const char *tide_version(void) { return TIDE_VERSION; }

/* "Release, gcc 12.2.0, commit 1a2b3c4" — the commit is the source tree's when the build was configured */
const char *tide_build_info(void)
{
#if defined(__clang__)
#define TIDE_CC "clang " __clang_version__
#elif defined(__GNUC__)
#define TIDE_CC "gcc " __VERSION__
#else
#define TIDE_CC "unknown compiler"
#endif
#if defined(__SANITIZE_ADDRESS__)
    return TIDE_BUILD_TYPE " + ASan, " TIDE_CC ", commit " TIDE_COMMIT;
#else
    return TIDE_BUILD_TYPE ", " TIDE_CC ", commit " TIDE_COMMIT;
#endif
}
int tide_num_threads(void) { return tide_cpu_get_threads(); }
void tide_set_num_threads(int n) { tide_cpu_set_threads(n); }
int tide_set_batch_invariant(int on) { return tide_cpu_set_batch_invariant(on); }
int tide_batch_invariant(void) { return tide_cpu_batch_invariant(); }
const char *tide_blas_info(void) { return tide_cpu_blas_info(); }
const char *tide_blas_core_hint(void) { return tide_cpu_blas_core_hint(); }

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

/* CPU: MemAvailable (the kernel's estimate of what a new allocation can get without swapping) and MemTotal from
   /proc/meminfo; where it is absent, the free and total physical pages */
static int cpu_memory(int64_t *free_bytes, int64_t *total_bytes)
{
    int64_t avail = -1, total = -1;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        long long kb;
        while (fgets(line, sizeof line, f)) {
            if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) avail = (int64_t)kb * 1024;
            else if (sscanf(line, "MemTotal: %lld kB", &kb) == 1) total = (int64_t)kb * 1024;
        }
        fclose(f);
    }
    long page = sysconf(_SC_PAGESIZE);
    if (avail < 0 && page > 0) avail = (int64_t)sysconf(_SC_AVPHYS_PAGES) * page;
    if (total < 0 && page > 0) total = (int64_t)sysconf(_SC_PHYS_PAGES) * page;
    if (avail < 0 || total < 0) return tide_set_error("device memory: the system does not report the cpu's memory");
    *free_bytes = avail;
    *total_bytes = total;
    return 0;
}

int tide_device_memory(int device, int64_t *free_bytes, int64_t *total_bytes)
{
    if (!free_bytes || !total_bytes) return tide_set_error("device memory: NULL output");
    if (device == 0) return cpu_memory(free_bytes, total_bytes);
    if (device < 1 || device - 1 >= tide_cuda_device_count())
        return tide_set_error("device memory: device cuda:%d is not available (%s)", device - 1, tide_cuda_info());
#ifdef TIDE_HAVE_CUDA
    return tide_cuda_runtime_mem_info(device - 1, free_bytes, total_bytes);
#else
    return tide_set_error("device memory: built without CUDA");
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

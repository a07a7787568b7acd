/*
 * threads.c — one thread count for OpenMP loops and OpenBLAS. We link the OpenMP build of OpenBLAS,
 * so both share one pool; setting them together keeps BLAS and our loops from competing for cores.
 * Default: the number of cores available to the process, or TIDE_NUM_THREADS when set.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <cblas.h>
#include "cpu.h"

static int g_threads;
static char g_blas_info[160];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void apply_threads(int n)
{
    g_threads = n;
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
}

static void describe_blas(void)
{
    /* openblas_get_config() starts "OpenBLAS <version> ..."; keep those two words */
    const char *cfg = openblas_get_config();
    char name[64] = "OpenBLAS", version[64] = "";
    if (cfg) sscanf(cfg, "%63s %63s", name, version);
    const char *core = openblas_get_corename();
    int par = openblas_get_parallel();
    const char *mode = par == 2 ? "openmp" : par == 1 ? "pthreads" : "sequential";
    snprintf(g_blas_info, sizeof g_blas_info, "%s%s%s %s (%s)", name, version[0] ? " " : "", version,
             core ? core : "unknown core", mode);
}

/* TIDE_NUM_THREADS when set to a usable number, else the cores available to the process */
static int default_threads(void)
{
    int n = omp_get_num_procs();
    const char *env = getenv("TIDE_NUM_THREADS");
    if (env && *env) {
        char *end;
        long v = strtol(env, &end, 10);
        /* an unusable value falls back to the core count rather than failing at load time */
        if (*end == '\0' && v >= 1 && v <= 4096) n = (int)v;
    }
    return n > 0 ? n : 1;
}

static void init_once(void)
{
    apply_threads(default_threads());
    describe_blas();
}

/* at load, so the first kernel already runs with the chosen count */
__attribute__((constructor)) static void threads_at_load(void)
{
    pthread_once(&g_once, init_once);
}

void tide_cpu_set_threads(int n)
{
    pthread_once(&g_once, init_once);
    apply_threads(n >= 1 ? n : default_threads());   /* 0 or negative: back to the default */
}

int tide_cpu_get_threads(void)
{
    pthread_once(&g_once, init_once);
    return g_threads;
}

const char *tide_cpu_blas_info(void)
{
    pthread_once(&g_once, init_once);
    return g_blas_info;
}

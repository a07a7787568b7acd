/*
 * threads.c — one thread count for OpenMP loops and OpenBLAS. We link the OpenMP build of OpenBLAS,
 * so both share one pool; setting them together keeps BLAS and our loops from competing for cores.
 * Default: the number of cores available to the process, or TIDE_NUM_THREADS when set.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
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

double tide_cpu_omp_scale = 1.0;

/* TIDE_OMP_SCALE: a number >= 0 that multiplies the kernels' parallel thresholds (cpu.h); unset or unusable: 1 */
static void omp_scale_from_env(void)
{
    const char *env = getenv("TIDE_OMP_SCALE");
    if (!env || !*env) return;
    char *end;
    double v = strtod(env, &end);
    if (*end == '\0' && v >= 0 && v <= 1e6) tide_cpu_omp_scale = v;
}

static void init_once(void)
{
    omp_scale_from_env();
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

/* OpenBLAS's dynamic-arch build picks its kernels from the CPU model at load. A model newer than the library
   (Debian 12's 0.3.21 on an Emerald Rapids Xeon, model 207) falls back to the generic Prescott (SSE3) kernels:
   sgemm at 65 GFLOP/s on 2 cores where the SkylakeX kernels run 300. OPENBLAS_CORETYPE names the kernels to load
   instead, read once at load; the tide executable sets it and re-executes itself (engine/host/main.c).
   tide_cpu_blas_core_choice: the kernels a CPU with these vector units should get when OpenBLAS detected
   `detected`: NULL when that is already right (a detected core other than a generic fallback is OpenBLAS's own
   judgement and kept) or when the CPU has nothing wider than SSE. */
const char *tide_cpu_blas_core_choice(const char *detected, int avx512, int avx2_fma, int avx)
{
    static const char *const generic[] = { "Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Katmai",
                                           "Coppermine", "Northwood", "Banias" };
    if (!detected) return NULL;
    int fallback = 0;
    for (size_t i = 0; i < sizeof generic / sizeof generic[0]; i++)
        if (strcasecmp(detected, generic[i]) == 0) fallback = 1;
    if (!fallback) return NULL;
    if (avx512) return "SkylakeX";
    if (avx2_fma) return "Haswell";
    if (avx) return "Sandybridge";
    return NULL;
}

/* the choice for this process: NULL when OPENBLAS_CORETYPE is already set (the user's, or ours after the
   re-execution) or nothing better fits. avx512 means F, BW, DQ and VL (SkylakeX's kernels use all four);
   __builtin_cpu_supports also checks that the OS saves the vector state. */
const char *tide_cpu_blas_core_hint(void)
{
    if (getenv("OPENBLAS_CORETYPE")) return NULL;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    int avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    int avx = __builtin_cpu_supports("avx");
    return tide_cpu_blas_core_choice(openblas_get_corename(), avx512, avx2_fma, avx);
#else
    return NULL;
#endif
}

const char *tide_cpu_blas_info(void)
{
    pthread_once(&g_once, init_once);
    return g_blas_info;
}

/* memory.c — raw host memory for the CPU backend (the caching allocator in engine/alloc.c sits on top). */
#include <stdlib.h>
#include <string.h>
#include "cpu.h"

/* 64 bytes: one cache line, and the widest vector load (AVX-512) never straddles two lines */
#define TIDE_CPU_ALIGN 64

void *tide_cpu_malloc(size_t nbytes)
{
    void *p = NULL;
    /* posix_memalign(0) may return NULL or a unique pointer; always hand out a real block */
    if (posix_memalign(&p, TIDE_CPU_ALIGN, nbytes ? nbytes : TIDE_CPU_ALIGN) != 0)
        return NULL;
    return p;
}

void tide_cpu_free(void *p)
{
    free(p);
}

int tide_cpu_memcpy_h2d(void *dst, const void *src, size_t n)
{
    if (n) memcpy(dst, src, n);
    return 0;
}

int tide_cpu_memcpy_d2h(void *dst, const void *src, size_t n)
{
    if (n) memcpy(dst, src, n);
    return 0;
}

int tide_cpu_memcpy_d2d(void *dst, const void *src, size_t n)
{
    /* memmove: the engine may copy between overlapping views of one storage */
    if (n && dst != src) memmove(dst, src, n);
    return 0;
}

int tide_cpu_synchronize(void)
{
    return 0;   /* CPU kernels finish before they return */
}

/*
 * philox.h — Philox 4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
 *
 * Counter based: the numbers for element i depend only on (seed, offset + i), so every backend, thread
 * count and run produces the same stream. Header-only so the CPU and CUDA kernels share one definition.
 * Element i uses counter (lo, hi) = (offset + i) split into two 32-bit words, key = seed.
 */
#ifndef TIDE_PHILOX_H
#define TIDE_PHILOX_H
#include <stdint.h>
#ifndef __CUDACC__
#include <math.h>
#endif

#ifdef __CUDACC__
#define TIDE_HD __host__ __device__ __forceinline__
#else
#define TIDE_HD static inline
#endif

typedef struct { uint32_t v[4]; } tide_philox4;

TIDE_HD tide_philox4 tide_philox4x32_10(uint64_t counter, uint64_t seed)
{
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = (uint32_t)p0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    tide_philox4 out;
    out.v[0] = c0; out.v[1] = c1; out.v[2] = c2; out.v[3] = c3;
    return out;
}

/* uniform in [0, 1) with 53 random bits, from words (a, b) */
TIDE_HD double tide_philox_u01(uint32_t a, uint32_t b)
{
    uint64_t bits = ((uint64_t)a << 21) ^ (uint64_t)(b >> 11);
    return (double)(bits & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
}

/* element i of the uniform stream */
TIDE_HD double tide_philox_uniform_at(uint64_t seed, uint64_t counter)
{
    tide_philox4 r = tide_philox4x32_10(counter, seed);
    return tide_philox_u01(r.v[0], r.v[1]);
}

/* element i of the standard normal stream (Box-Muller on words 0-1 and 2-3; u1 in (0, 1]) */
TIDE_HD double tide_philox_normal_at(uint64_t seed, uint64_t counter)
{
    tide_philox4 r = tide_philox4x32_10(counter, seed);
    double u1 = 1.0 - tide_philox_u01(r.v[0], r.v[1]);
    double u2 = tide_philox_u01(r.v[2], r.v[3]);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
#endif

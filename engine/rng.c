/*
 * rng.c — the global counter-based generator. State is (seed, offset): every random tensor of n
 * elements takes counters [offset, offset + n) and advances offset by n, so the numbers depend only on
 * the seed and the order of draws — not on threads or backend. (seed, offset) is saved in checkpoints.
 */
#include "internal.h"
#include "../kernels/philox.h"

static uint64_t g_seed = 0x7469646500000001ull;   /* "tide" */
static uint64_t g_offset;

void tide_manual_seed(uint64_t seed) { g_seed = seed; g_offset = 0; }
void tide_rng_get(uint64_t *seed, uint64_t *offset) { if (seed) *seed = g_seed; if (offset) *offset = g_offset; }
void tide_rng_set(uint64_t seed, uint64_t offset) { g_seed = seed; g_offset = offset; }

uint64_t tide_rng_take(uint64_t n, uint64_t *seed)
{
    uint64_t o = g_offset;
    *seed = g_seed;
    g_offset += n;
    return o;
}

void tide_philox_uniform(uint64_t seed, uint64_t offset, double *out, int64_t n)
{
    for (int64_t i = 0; i < n; i++) out[i] = tide_philox_uniform_at(seed, offset + (uint64_t)i);
}

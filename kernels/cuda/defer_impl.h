/*
 * defer_impl.h — the host side of the deferred checks (common.cuh): the ring of call contexts, the base key of a
 * new check and the report at a synchronisation. Included once: by backend_cuda.cu (and by the CUDA emulator's
 * host stand-ins, tests/gpu/emu/emu_host.h).
 */
#include <stdio.h>

static tide_cuda_defer_ctx tide_defer_ring[TIDE_DEFER_RING];
static unsigned long long tide_defer_calls;   /* checks recorded since the record was last seen clean */

int tide_cuda_defer_begin(const tide_cuda_defer_ctx *ctx, unsigned long long *base)
{
    /* the call number must fit above the position bits: past that, report (and so reset) first */
    if (tide_defer_calls + 1 >= (1ull << (64 - TIDE_DEFER_SHIFT)) && tide_cuda_deferred_report()) return -1;
    unsigned long long seq = tide_defer_calls++;
    tide_defer_ring[seq % TIDE_DEFER_RING] = *ctx;
    *base = seq << TIDE_DEFER_SHIFT;
    return 0;
}

int tide_cuda_deferred_report(void)
{
    if (tide_defer_calls == 0) return 0;          /* no check since the record was clean: nothing to read */
    cudaStream_t s = 0;
    tide_cuda_scratch *sc = NULL;
    if (tide_cuda_get_stream(&s) || tide_cuda_get_scratch(&sc)) return -1;
    unsigned long long key = 0;
    double value = 0;
    TIDE_CU(cudaMemcpyAsync(&key, &sc->defer_key, sizeof key, cudaMemcpyDeviceToHost, s), "deferred check copy");
    TIDE_CU(cudaMemcpyAsync(&value, &sc->defer_value, sizeof value, cudaMemcpyDeviceToHost, s), "deferred check copy");
    TIDE_CU(cudaStreamSynchronize(s), "deferred check (synchronize)");
    unsigned long long calls = tide_defer_calls;
    tide_defer_calls = 0;
    if (key == ~0ull) return 0;
    TIDE_CU(cudaMemsetAsync(&sc->defer_key, 0xff, sizeof key, s), "deferred check reset");
    unsigned long long seq = key >> TIDE_DEFER_SHIFT, pos = key & ((1ull << TIDE_DEFER_SHIFT) - 1);
    const char *where = "found on the device, reported at its next synchronisation";
    if (calls - seq > TIDE_DEFER_RING)
        return tide_set_error("a check on the device failed %llu checks before this synchronisation; its op is no "
                              "longer known (position %llu, value %g)", calls - seq, pos, value);
    const tide_cuda_defer_ctx &c = tide_defer_ring[seq % TIDE_DEFER_RING];
    switch (c.kind) {
    case TIDE_DEFER_INDEX:
        if (!strcmp(c.what, "embedding"))
            return tide_set_error("embedding: token id %lld at position %llu is out of range for a vocabulary of %lld "
                                  "(%s)", (long long)value, pos, (long long)c.n, where);
        if (!strcmp(c.what, "moe_experts"))
            return tide_set_error("moe_experts: sel holds expert id %lld at position %llu, outside [0, %lld) (%s)",
                                  (long long)value, pos, (long long)c.n, where);
        return tide_set_error("%s: index %lld at position %llu is out of range [0, %lld) (%s)", c.what,
                              (long long)value, pos, (long long)c.n, where);
    case TIDE_DEFER_TARGET:
        return tide_set_error("%s: target %lld at row %llu is outside [0, %lld) and is not the ignore index %lld (%s)",
                              c.what, (long long)value, pos, (long long)c.n, (long long)c.ignore, where);
    case TIDE_DEFER_KDA: {
        long long tok = (long long)(pos / (unsigned long long)(c.H * c.dk)), hh = (long long)((pos / c.dk) % c.H),
                  ch = (long long)(pos % c.dk);
        return tide_set_error("%s: g = %g at [b %lld, t %lld, head %lld, channel %lld] is outside [%g, 0]: the chunk "
                              "path factorises the decay and needs the lower-bounded gate (kda.md §5); use the bounded "
                              "gate or the chunk_safe path (%s)", c.what, value, tok / c.n, tok % c.n, hh, ch, c.lb,
                              where);
    }
    default:
        return tide_set_error("a check on the device failed (kind %d, position %llu, value %g)", c.kind, pos, value);
    }
}

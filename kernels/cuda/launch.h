/*
 * launch.h — the launch shapes the CUDA host code chooses (grid, block, dynamic shared memory), as plain host
 * functions of the sizes. The .cu files launch with them, and tests/gpu/launch_limits.py checks them without a GPU:
 * over the shipped configs it compares every shape with the compiled kernels' registers and shared memory (the
 * ptxas report) and the device limits. Host C/C++ only, no CUDA headers.
 */
#ifndef TIDE_CUDA_LAUNCH_H
#define TIDE_CUDA_LAUNCH_H
#include <stdint.h>

#define TIDE_THREADS 256

/* blocks for a grid-stride loop over n elements on sms SMs (at most a few waves; loops cover the rest) */
static inline unsigned tide_grid_blocks(int64_t n, int sms)
{
    int64_t b = (n + TIDE_THREADS - 1) / TIDE_THREADS;
    int64_t cap = (int64_t)sms * 32;
    if (b > cap) b = cap;
    return (unsigned)(b < 1 ? 1 : b);
}
/* threads for a block that owns one row of C elements: a power of two in [32, 1024], ~4 per thread */
static inline unsigned tide_row_threads(int64_t C)
{
    unsigned t = 32;
    while (t < 1024 && (int64_t)t * 4 < C) t <<= 1;
    return t;
}
/* rows are spread over a grid-stride loop so any count fits in gridDim.x */
static inline unsigned tide_row_blocks(int64_t N)
{
    return (unsigned)(N < 65535 * 16 ? (N < 1 ? 1 : N) : 65535 * 16);
}

/* column sums over rows in chunks (the dw / dν / d(gate) reductions; block (32, 8), grid (cols/32, chunks)):
   about 4 blocks per SM, at least ~32 rows per chunk, at most 1024 chunks; returns the chunk count, *rows_per the
   rows of each */
static inline int64_t tide_colsum_chunks(int64_t cols, int64_t rows, int sms, int64_t *rows_per)
{
    int64_t colblocks = (cols + 31) / 32, want = 4 * (int64_t)sms;
    int64_t nchunks = (want + colblocks - 1) / colblocks, maxc = (rows + 31) / 32;
    if (nchunks > maxc) nchunks = maxc;
    if (nchunks > 1024) nchunks = 1024;
    if (nchunks < 1) nchunks = 1;
    int64_t per = (rows + nchunks - 1) / nchunks;
    if (per < 1) per = 1;
    *rows_per = per;
    return (rows + per - 1) / per;
}

/* AttnRes (attnres.cu): one block per row of d channels, each thread holding VPT channels in registers. The
   kernels are compiled for at most TIDE_AR_THREADS threads (__launch_bounds__), so ptxas keeps every VPT within
   an SM's 65,536 registers: rows up to TIDE_AR_THREADS · TIDE_AR_MAX_VPT channels. */
#define TIDE_AR_THREADS 512
#define TIDE_AR_MAX_VPT 32
/* channels per thread (a template size: a power of two) for rows of d channels, *threads the block size; 0 when
   d is too wide */
static inline int tide_attnres_shape(int64_t d, unsigned *threads)
{
    unsigned t = tide_row_threads(d);
    if (t > TIDE_AR_THREADS) t = TIDE_AR_THREADS;
    int64_t per = (d + t - 1) / t;
    int vpt = 1;
    while (vpt < per) vpt <<= 1;
    if (vpt > TIDE_AR_MAX_VPT) return 0;
    int64_t need = (d + vpt - 1) / vpt;
    *threads = (unsigned)((need + 31) / 32 * 32);
    return vpt;
}

/* reduce.cu: the one block that adds sum_squares' partial sums */
#define TIDE_SUM_PARTIALS_THREADS 1024
/* reduce.cu: block (bx, 256 / bx) with bx a power of two up to a warp over the inner size */
static inline void tide_reduce_block(int64_t inner, unsigned *bx, unsigned *by)
{
    unsigned x = 1;
    while (x < 32 && (int64_t)x < inner) x <<= 1;
    *bx = x;
    *by = 256 / x;
}
/* reduce.cu: grid (inner / bx, min(outer, 65535), chunks of the reduced axis) and each chunk's length; the
   axis is split when the grid is too small for the machine and the axis is long (>= ~1024 elements per chunk) */
static inline void tide_reduce_grid(int64_t outer, int64_t red, int64_t inner, int sms, int64_t *gx, int64_t *gy,
                                    int64_t *chunks, int64_t *rchunk)
{
    unsigned bx, by;
    tide_reduce_block(inner, &bx, &by);
    *gx = (inner + bx - 1) / bx;
    *gy = outer < 65535 ? outer : 65535;
    int64_t want = 4 * (int64_t)sms, have = *gx * *gy, n = 1;
    if (have < want && red >= 4096) {
        n = (want + have - 1) / have;
        int64_t maxc = red / 1024;
        if (n > maxc) n = maxc;
        if (n > 1024) n = 1024;
        if (n < 1) n = 1;
    }
    int64_t rc = (red + n - 1) / n;
    if (rc < 1) rc = 1;
    *rchunk = rc;
    *chunks = red > 0 ? (red + rc - 1) / rc : 1;
}
/* index_add (index.cu): positions sorted by a bitonic sort over n rounded up to a power of two, then one block per
   sorted position, its threads over the row's cols = outer x inner columns */
static inline int64_t tide_index_sort_len(int64_t n)
{
    int64_t p = 1;
    while (p < n) p <<= 1;
    return p;
}
static inline unsigned tide_index_rows_threads(int64_t cols)
{
    return cols >= TIDE_THREADS ? TIDE_THREADS : (unsigned)((cols + 31) / 32 * 32);
}

/* KDA: chunks (of the op's chunk size) between the forward's state checkpoints (backend.h kda_ckpt_chunks).
   The CUDA backward recomputes a block's start states from its checkpoint, so this sets its memory, not its
   work: at K3 heads one checkpoint per 1,024 tokens (6 KiB per token) and a buffer of 64 states. */
#define TIDE_KDA_CUDA_CKPT_CHUNKS 64

/* KDA (kda.cu): a block per (segment, head) walks its chunks in order, with the state S (dk x dv) in shared memory.
   The columns of S evolve independently (kda.md §4: S_c = diag(Γ_c) S₀ + K_rᵀ M diag(β)(V − K̂S₀) acts on each
   column alone), so when the (segment, head) blocks do not fill the device, each is split into nv blocks over
   dv / nv columns: each redoes the chunk's dk-side work (K̂Ǩᵀ, the inverse) and owns its columns' products. The
   split halves until the blocks fill the SMs, keeping >= TIDE_KDA_MIN_BV columns a block (KDA_RG x columns work
   items for KDA_NT threads: below that the column phases leave threads idle) and whole 16-column tiles for wmma.
   Returns nv (1: no split); force > 0 asks for that split (tests), 0 chooses. */
#define TIDE_KDA_MIN_BV 64
static inline int tide_kda_vsplit(int64_t blocks, int64_t dv, int sms, int force)
{
    if (force > 0) return dv % force == 0 ? force : 1;
    int nv = 1;
    while (blocks * nv < sms && dv % (2 * nv) == 0 && dv / (2 * nv) >= TIDE_KDA_MIN_BV && (dv / (2 * nv)) % 16 == 0)
        nv *= 2;
    return nv;
}

/* MoE (moe.cu) for decoding-sized batches: at most TIDE_MOE_DEVICE_ROWS routed rows (m·k, dropless), when the caller
   needs no host offsets (no backward), the two expert products run as moe_rows_gemm_kernel, which reads the
   per-expert row counts on the device: no host sync. A block per (expert, tile of TIDE_MOE_RG_THREADS / 32 warps x
   TIDE_MOE_RG_COLS columns), grid-stride over them, at most 32 blocks per SM. */
#define TIDE_MOE_DEVICE_ROWS 1024
#define TIDE_MOE_RG_THREADS 256
#define TIDE_MOE_RG_COLS 4
#define TIDE_MOE_RG_ROWS 8
#define TIDE_MOE_RG_TILE (TIDE_MOE_RG_THREADS / 32 * TIDE_MOE_RG_COLS)   /* output columns per block */
static inline int64_t tide_moe_rows_tiles(int64_t N) { return (N + TIDE_MOE_RG_TILE - 1) / TIDE_MOE_RG_TILE; }
static inline unsigned tide_moe_rows_blocks(int64_t n_experts, int64_t N, int sms)
{
    int64_t b = n_experts * tide_moe_rows_tiles(N), cap = (int64_t)sms * 32;
    if (b > cap) b = cap;
    return (unsigned)(b < 1 ? 1 : b);
}

#endif

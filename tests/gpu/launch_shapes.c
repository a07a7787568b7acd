/*
 * launch_shapes.c — every launch shape the CUDA host code chooses over the shipped configs, one line per launch,
 * for tests/gpu/launch_limits.py (which holds them against the compiled kernels' resources and the device limits).
 * The shapes come from kernels/cuda/launch.h, the functions the .cu files launch with; the sizes are the configs'
 * (spec/README.md: tiny, k3; the recipes' small models; the vision towers), T up to 1M tokens.
 *
 * A line: kernel pattern (fnmatch over the demangled names, e.g. "attnres_fwd_kernel<float, 16>"), the config and
 * shape, grid x y z, block x y z (0 0 0: the kernel's own __launch_bounds__ block, a constant of its .cu file),
 * dynamic shared memory in bytes (-1: chosen by the host code against the device's opt-in limit at run time, which
 * the emulator checks at these head shapes), whether the kernel opts in to more than 48 KiB, and the largest flat
 * element offset the launch addresses (64-bit indexing is needed above 2^31 - 1).
 */
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include "launch.h"

typedef struct {
    const char *name;
    int64_t d, V, ffn;                  /* model width, vocabulary, dense FFN width */
    int64_t kda_h, kda_dk, kda_dv;      /* KDA heads and head dims (0: none) */
    int64_t mla_h, mla_dn, mla_dr, mla_dv, mla_dq, mla_dc;
    int64_t moe_n, moe_k, moe_de, moe_dlat, moe_shared;
    int64_t attnres_sources;            /* the most sources of one AttnRes mix */
    int64_t vit_d, vit_heads, vit_mlp, vit_tokens;
    int64_t batch;                      /* sequences per forward */
    int64_t T[5];                       /* sequence lengths (0 ends) */
} config;

/* spec/README.md (tiny, k3), recipes/ (agent_*: d 64; dense: d 128, 4 heads), spec/vision.md (tiny-vlm, MoonViT) */
static const config configs[] = {
    {"tiny", 128, 320, 384, 2, 64, 64, 2, 64, 32, 64, 96, 64, 8, 2, 128, 64, 128, 5, 64, 4, 256, 64, 8, {256, 0}},
    {"small", 64, 320, 192, 2, 32, 32, 2, 32, 16, 32, 48, 32, 16, 2, 64, 0, 64, 5, 0, 0, 0, 0, 8, {128, 1024, 0}},
    {"dense", 128, 320, 512, 0, 0, 0, 4, 32, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, {128, 0}},
    {"moonvit", 1152, 320, 4304, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1152, 16, 4304, 16384, 1, {4096, 0}},
    {"k3", 7168, 163840, 33792, 96, 128, 128, 96, 128, 64, 128, 1536, 512, 896, 16, 3072, 3584, 6144, 9, 0, 0, 0, 0,
     1, {8192, 65536, 262144, 1048576, 0}},
};

/* SMs of the targets (sm_80: A100 108; sm_90: H100/H200 132): the grid-stride caps scale with them */
static const int sm_counts[] = {108, 132};

static void emit(const char *kernel, const char *cfg, const char *shape, int64_t gx, int64_t gy, int64_t gz, int64_t bx,
                 int64_t by, int64_t bz, int64_t smem, int optin, int64_t elems)
{
    printf("%s\t%s %s\t%lld %lld %lld\t%lld %lld %lld\t%lld\t%d\t%lld\n", kernel, cfg, shape, (long long)gx,
           (long long)gy, (long long)gz, (long long)bx, (long long)by, (long long)bz, (long long)smem, optin,
           (long long)elems);
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* the grid-stride kernels of TIDE_THREADS threads over n elements (tide_blocks) */
static void grid_stride(const char *kernel, const config *c, const char *shape, int64_t n, int sms)
{
    emit(kernel, c->name, shape, tide_grid_blocks(n, sms), 1, 1, TIDE_THREADS, 1, 1, 0, 0, n);
}

/* one block per row of C elements (tide_row_blocks, tide_row_threads) */
static void row_kernel(const char *kernel, const config *c, const char *shape, int64_t N, int64_t C)
{
    emit(kernel, c->name, shape, tide_row_blocks(N), 1, 1, tide_row_threads(C), 1, 1, 0, 0, N * C);
}

/* the (32, 8) column-sum blocks over rows in chunks (tide_colsum_chunks) */
static void colsum(const char *kernel, const config *c, const char *shape, int64_t cols, int64_t rows, int sms)
{
    int64_t per, chunks = tide_colsum_chunks(cols, rows, sms, &per);
    emit(kernel, c->name, shape, (cols + 31) / 32, chunks, 1, 32, 8, 1, 0, 0, rows * cols);
}

static void attnres(const config *c, const char *shape, int64_t rows, int sms)
{
    static const char *types[] = {"float", "__nv_bfloat16", "double"};
    unsigned th = 0;
    int vpt = tide_attnres_shape(c->d, &th);
    char k[96];
    for (int i = 0; i < 3; i++) {
        size_t acc = i == 2 ? 8 : 4;
        if (!vpt) {   /* the host code refuses this width with an error: nothing launches */
            continue;
        }
        snprintf(k, sizeof k, "attnres_fwd_kernel<%s, %d>", types[i], vpt);
        emit(k, c->name, shape, tide_row_blocks(rows), 1, 1, th, 1, 1, 0, 0, c->attnres_sources * rows * c->d);
        snprintf(k, sizeof k, "attnres_bwd_kernel<%s, %d>", types[i], vpt);
        emit(k, c->name, shape, tide_row_blocks(rows), 1, 1, th, 1, 1, (int64_t)(2 * c->attnres_sources * acc), 0,
             c->attnres_sources * rows * c->d);
    }
    colsum("attnres_rowsum_partial_kernel<*>", c, shape, c->d, rows, sms);
    grid_stride("attnres_rowsum_final_kernel<*>", c, shape, c->d, sms);
}

/* every AttnRes width the kernels take, 32 to the widest (a sweep beyond the configs: the width is a recipe field) */
static void attnres_sweep(void)
{
    static const char *types[] = {"float", "__nv_bfloat16", "double"};
    char k[96], shape[64];
    for (int64_t d = 32; d <= TIDE_AR_THREADS * TIDE_AR_MAX_VPT; d += 32) {
        unsigned th = 0;
        int vpt = tide_attnres_shape(d, &th);
        if (!vpt) continue;
        snprintf(shape, sizeof shape, "d=%lld", (long long)d);
        for (int i = 0; i < 3; i++) {
            snprintf(k, sizeof k, "attnres_fwd_kernel<%s, %d>", types[i], vpt);
            emit(k, "sweep", shape, tide_row_blocks(8192), 1, 1, th, 1, 1, 0, 0, 9 * 8192 * d);
            snprintf(k, sizeof k, "attnres_bwd_kernel<%s, %d>", types[i], vpt);
            emit(k, "sweep", shape, tide_row_blocks(8192), 1, 1, th, 1, 1, 2 * 2048 * (i == 2 ? 8 : 4), 0, 9 * 8192 * d);
        }
    }
}

static void reduce(const config *c, const char *shape, int64_t outer, int64_t red, int64_t inner, int sms)
{
    int64_t gx, gy, chunks, rchunk;
    unsigned bx, by;
    tide_reduce_block(inner, &bx, &by);
    tide_reduce_grid(outer, red, inner, sms, &gx, &gy, &chunks, &rchunk);
    emit("reduce_kernel<*>", c->name, shape, gx, gy, chunks, bx, by, 1, 0, 0, outer * red * inner);
    emit("reduce_max_backward_kernel<*>", c->name, shape, gx, gy, 1, bx, by, 1, 0, 0, outer * red * inner);
    grid_stride("reduce_finalize_kernel<*>", c, shape, outer * inner, sms);
}

static void one_config(const config *c, int64_t T, int sms)
{
    char shape[64];
    snprintf(shape, sizeof shape, "T=%lld B=%lld sms=%d", (long long)T, (long long)c->batch, sms);
    int64_t N = T * c->batch;                                     /* tokens of one forward */
    int64_t widest = max64(max64(c->V, c->ffn), max64(c->moe_shared, c->kda_h * c->kda_dv));
    int64_t act = N * max64(widest, c->d);                        /* the largest activation */
    int64_t params = max64(c->V * c->d, c->ffn * c->d);           /* the largest weight */
    if (c->moe_n) params = max64(params, c->moe_n * c->moe_de * 2 * c->moe_dlat);

    /* elementwise, copies, fills, random, index ops, the optimizer, reductions to a scalar */
    static const char *elementwise[] = {
        "fill_kernel<*>", "copy_kernel<*>", "random_kernel<*>", "unary_kernel<*>", "unary_backward_kernel<*>",
        "binary_flat_kernel<*>", "binary_kernel<*>", "swiglu_kernel<*>", "swiglu_backward_kernel<*>", "axpy_kernel<*>",
        "scale_rows_kernel<*>", "index_select_kernel<*>", "gather_kernel<*>", "bf16_to_f32_kernel",
        "f32_to_bf16_kernel",
        "scatter_add_kernel<*>", "check_index_kernel", "all_finite_kernel<*>", "sum_squares_kernel<*>",
        "first_nonfinite_kernel", "situ_kernel<*>", "situ_backward_kernel<*>", "rope_kernel<*>",
        "chain_add_kernel<*>", "norm_dw_final_kernel<*>", "conv_gw_final_kernel<*>", "mla_sum_groups_kernel<*>",
        "kda_gate_kernel<*>", "kda_gate_final_kernel<*>", NULL};
    for (int i = 0; elementwise[i]; i++) grid_stride(elementwise[i], c, shape, act, sms);
    /* index_add's sort over the tokens (rounded up to a power of two), then a block per token over the row's d columns */
    grid_stride("index_add_keys_kernel", c, shape, tide_index_sort_len(N), sms);
    grid_stride("bitonic_step_kernel", c, shape, tide_index_sort_len(N), sms);
    emit("index_add_rows_kernel<*>", c->name, shape, N, 1, 1, tide_index_rows_threads(c->d), 1, 1, 0, 0, N * c->d);
    /* behind each deferred check (common.cuh): one warp reads the recorded position */
    emit("tide_defer_capture_kernel<*>", c->name, shape, 1, 1, 1, 32, 1, 1, 0, 0, act);
    grid_stride("adamw_kernel<*>", c, shape, params, sms);
    emit("sum_partials_kernel", c->name, shape, 1, 1, 1, TIDE_SUM_PARTIALS_THREADS, 1, 1, 0, 0,
         tide_grid_blocks(act, sms));
    grid_stride("topk_kernel<*>", c, shape, N, sms);

    /* norms over the width and over a head; softmax and the losses over the vocabulary */
    static const char *norms[] = {"rmsnorm_kernel<*>", "rmsnorm_backward_kernel<*>", "layernorm_kernel<*>",
                                  "layernorm_backward_kernel<*>", "softmax_kernel<*>", "softmax_backward_kernel<*>", NULL};
    for (int i = 0; norms[i]; i++) {
        row_kernel(norms[i], c, shape, N, c->d);
        if (c->kda_h) row_kernel(norms[i], c, shape, N * c->kda_h, c->kda_dk);
        row_kernel(norms[i], c, shape, N, c->V);
    }
    colsum("norm_dw_partial_kernel<*>", c, shape, c->d, N, sms);
    static const char *losses[] = {"cross_entropy_kernel<*>", "cross_entropy_backward_kernel<*>",
                                   "token_logprobs_kernel<*>", "token_logprobs_backward_kernel<*>", NULL};
    for (int i = 0; losses[i]; i++) row_kernel(losses[i], c, shape, N, c->V);
    reduce(c, shape, 1, N, c->d, sms);        /* a sum over tokens */
    reduce(c, shape, N, c->V, 1, sms);        /* a max over the vocabulary */
    reduce(c, shape, 1, act, 1, sms);         /* everything to one number */

    if (c->attnres_sources) attnres(c, shape, N, sms);

    if (c->kda_h) {
        int64_t HD = c->kda_h * c->kda_dk, conv_c = c->kda_h * (2 * c->kda_dk + c->kda_dv);
        static const char *conv[] = {"conv_kernel<*>", "conv_gy_kernel<*>", "conv_gx_kernel<*>", "conv_gcache_kernel<*>",
                                     NULL};
        for (int i = 0; conv[i]; i++) grid_stride(conv[i], c, shape, N * conv_c, sms);
        colsum("conv_gw_partial_kernel<*>", c, shape, conv_c * 4, N, sms);
        /* a decoding step: one token for each of the batch's rows over its own history */
        grid_stride("conv_rows_kernel<*>", c, "decode", c->batch * conv_c, sms);
        /* kda.cu's gate backward sizes its chunks with the same formula (inline there) */
        colsum("kda_gate_backward_kernel<*>", c, shape, HD, N, sms);
        /* one block per (segment, head) and column split (tide_kda_vsplit); segments: one per sequence up to one
           per 16 tokens. The split backward adds its partial sums over the rows of a block of at most
           TIDE_KDA_CUDA_CKPT_CHUNKS chunks of 16 per segment, grid-stride. */
        int64_t segs = c->batch, docs = N / 16;
        int nv = tide_kda_vsplit(segs * c->kda_h, c->kda_dv, sms, 0), nvd = tide_kda_vsplit(docs * c->kda_h, c->kda_dv, sms, 0);
        int64_t prow = segs * 16 * min64((T + 15) / 16, TIDE_KDA_CUDA_CKPT_CHUNKS);
        emit("kda_chunk_kernel<*>", c->name, shape, segs * c->kda_h * nv, 1, 1, 0, 0, 0, -1, 1, N * HD);
        emit("kda_recurrent_kernel<*>", c->name, shape, segs * c->kda_h, 1, 1, 0, 0, 0, -1, 1, N * HD);
        emit("kda_chunk_backward_kernel<*>", c->name, shape, segs * c->kda_h * nv, 1, 1, 0, 0, 0, -1, 1, N * HD);
        emit("kda_vsum_kernel<*>", c->name, shape, tide_grid_blocks(prow * c->kda_h * (3 * c->kda_dk + 1), sms), 1, 1,
             TIDE_THREADS, 1, 1, 0, 0, N * HD);
        emit("kda_chunk_kernel<*>", c->name, "docs of 16 tokens", docs * c->kda_h * nvd, 1, 1, 0, 0, 0, -1, 1, N * HD);
        /* the backward's pre-pass: a block per state slot (a block of chunks per segment; docs: one chunk each) and head */
        emit("kda_intra_kernel<*>", c->name, shape, prow / 16 * c->kda_h, 1, 1, 0, 0, 0, -1, 1, N * HD);
        emit("kda_intra_kernel<*>", c->name, "docs of 16 tokens", docs * c->kda_h, 1, 1, 0, 0, 0, -1, 1, N * HD);
        emit("kdec_kernel<*>", c->name, "decode", c->batch * c->kda_h, 1, 1, 0, 0, 0, (int64_t)(3 * c->kda_dk) * 4, 0,
             c->batch * c->kda_h * c->kda_dk * c->kda_dv);
    }
    if (c->mla_h) {
        /* the query tiles are 16 to 64 rows (mla.cu picks the largest that fits); 16 is the largest grid */
        int64_t tiles = (T + 15) / 16, D = c->mla_dn + c->mla_dr;
        int64_t qkv = N * c->mla_h * max64(D, c->mla_dv);
        emit("mla_forward_kernel<*>", c->name, shape, tiles, c->mla_h, c->batch, 0, 0, 0, -1, 1, qkv);
        emit("mla_dq_kernel<*>", c->name, shape, tiles, c->mla_h, c->batch, 0, 0, 0, -1, 1, qkv);
        emit("mla_dkv_kernel<*>", c->name, shape, tiles, c->mla_h, c->batch, 0, 0, 0, -1, 1, qkv);
        emit("mla_rowdot_kernel<*>", c->name, shape, (int64_t)sms * 32, 1, 1, 0, 0, 0, 0, 0, N * c->mla_h * c->mla_dv);
        /* mla_latent_attention: its fp32 sums (output, dq, the [H·(dn + dv), dc] weight gradient) rounded to bf16 */
        grid_stride("mla_to_bf16_kernel", c, shape,
                    max64(qkv, c->mla_h * (c->mla_dn + c->mla_dv) * c->mla_dc), sms);
        emit("dec_append_kernel<*>", c->name, "decode", c->batch, 1, 1, 0, 0, 0, 0, 0, c->batch * T * c->mla_dc);
        emit("dec_attend_kernel<*>", c->name, "decode", c->batch * c->mla_h, 1, 1, 0, 0, 0, -1, 0,
             c->batch * T * (c->mla_dc + c->mla_dr));
    }
    if (c->moe_n) {
        int64_t A = N * c->moe_k;
        static const char *moe[] = {"moe_scatter_kernel", "moe_tail_kernel", NULL};
        for (int i = 0; moe[i]; i++) grid_stride(moe[i], c, shape, A, sms);
        static const char *moe_t[] = {"moe_gather_kernel<*>", "moe_act_kernel<*>", "moe_combine_kernel<*>",
                                      "moe_dy_kernel<*>", "moe_dp_kernel<*>", "moe_act_backward_kernel<*>",
                                      "moe_dx_kernel<*>", NULL};
        for (int i = 0; moe_t[i]; i++) grid_stride(moe_t[i], c, shape, A * max64(c->moe_de * 2, c->d), sms);
        /* the counting sort: blocks of its __launch_bounds__, at most 16 or 32 per SM; one int per expert */
        emit("moe_rank_kernel", c->name, shape, (int64_t)sms * 16, 1, 1, 0, 0, 0, c->moe_n * 4, 0, A);
        emit("moe_tile_scan_kernel", c->name, shape, (int64_t)sms * 32, 1, 1, 0, 0, 0, 0, 0, A);
        emit("moe_offsets_kernel", c->name, shape, 1, 1, 1, 0, 0, 0, 0, 0, c->moe_n);
        /* a decoding step's experts without a host sync: a block per (expert, column tile) of either product, capped;
           the largest index is into the weights [n, N, K] */
        int64_t wide = max64(2 * c->moe_de, c->d);
        emit("moe_rows_gemm_kernel<*>", c->name, "decode", tide_moe_rows_blocks(c->moe_n, wide, sms), 1, 1, 0, 0, 0, 0,
             0, c->moe_n * 2 * c->moe_de * max64(c->moe_dlat, c->d));
    }
    if (c->vit_d) {
        int64_t hd = c->vit_d / c->vit_heads;
        grid_stride("rope2d_kernel<*>", c, shape, c->vit_tokens * c->vit_d, sms);
        static const char *pos[] = {"pos_interp_kernel<*>", "pos_interp_bwd_x<*>", "pos_interp_bwd_y<*>",
                                    "pos_interp_store<*>", NULL};
        for (int i = 0; pos[i]; i++) grid_stride(pos[i], c, shape, c->vit_tokens * c->vit_d, sms);
        row_kernel("layernorm_kernel<*>", c, shape, c->vit_tokens, c->vit_d);
        row_kernel("softmax_kernel<*>", c, shape, c->vit_tokens * c->vit_heads, hd);
    }
}

int main(void)
{
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++)
        for (int j = 0; configs[i].T[j]; j++)
            for (int s = 0; s < 2; s++) one_config(&configs[i], configs[i].T[j], sm_counts[s]);
    attnres_sweep();
    return 0;
}

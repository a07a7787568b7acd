/*
 * sgemm_ceiling.c — the f32 GEMM rate this machine reaches through the engine's public tide_matmul, at
 * the shapes a dense Transformer training step runs: for every Linear (in -> out) of the model, the
 * forward x Wᵀ, the input gradient g W and the weight gradient gᵀ x, with the batch folded into one
 * token dimension. Each shape is timed best of --reps calls; the JSON on stdout lists the shapes, the
 * ceiling (the best rate over the shapes) and the step rate (a step's GEMM FLOPs over the time they
 * take when every GEMM runs at its best standalone rate). bench/run_step_dense.sh reads it.
 *
 *   bench-sgemm-ceiling --tokens 256 --dim 768 --ffn 2048 --vocab 50304 --layers 12 [--reps 5] [--label s]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tide.h"

typedef struct {
    const char *linear;           /* which Linear of the model */
    const char *pass;             /* "forward", "grad_input", "grad_weight" */
    int64_t m, n, k;              /* C [m, n] = A [m, k] B [k, n] */
    int ta, tb;                   /* tide_matmul's transposes */
    int64_t per_step;             /* how many of these a training step runs */
    double best_s;
} gemm_shape;

static int parse_i64(const char *flag, const char *text, int64_t *out)
{
    char *end;
    long long v = strtoll(text, &end, 10);
    if (*text == '\0' || *end != '\0' || v < 1) {
        fprintf(stderr, "sgemm_ceiling: %s must be a positive integer, got '%s'\n", flag, text);
        return -1;
    }
    *out = v;
    return 0;
}

/* best-of-reps seconds of one product; operands are allocated in the layout tide_matmul reads */
static int time_shape(gemm_shape *s, int64_t reps)
{
    int64_t ash[2] = { s->ta ? s->k : s->m, s->ta ? s->m : s->k };
    int64_t bsh[2] = { s->tb ? s->n : s->k, s->tb ? s->k : s->n };
    tide_tensor *a = tide_randn(TIDE_F32, 2, ash, TIDE_CPU, 0.0, 1.0);
    tide_tensor *b = a ? tide_randn(TIDE_F32, 2, bsh, TIDE_CPU, 0.0, 1.0) : NULL;
    if (!a || !b) {
        fprintf(stderr, "sgemm_ceiling: cannot allocate operands for %s %s: %s\n", s->linear, s->pass, tide_last_error());
        tide_tensor_release(a);
        return -1;
    }
    s->best_s = 1e30;
    for (int64_t r = 0; r < reps + 1; r++) {          /* one untimed call warms the allocator and BLAS buffers */
        double t0 = tide_time_now();
        tide_tensor *c = tide_matmul(a, b, s->ta, s->tb);
        double dt = tide_time_now() - t0;
        if (!c) {
            fprintf(stderr, "sgemm_ceiling: matmul %s %s failed: %s\n", s->linear, s->pass, tide_last_error());
            tide_tensor_release(a);
            tide_tensor_release(b);
            return -1;
        }
        tide_tensor_release(c);
        if (r > 0 && dt < s->best_s) s->best_s = dt;
    }
    tide_tensor_release(a);
    tide_tensor_release(b);
    return 0;
}

int main(int argc, char **argv)
{
    int64_t tokens = 0, dim = 0, ffn = 0, vocab = 0, layers = 0, reps = 5;
    const char *label = "";
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t *dst = !strcmp(f, "--tokens") ? &tokens : !strcmp(f, "--dim") ? &dim : !strcmp(f, "--ffn") ? &ffn
                     : !strcmp(f, "--vocab") ? &vocab : !strcmp(f, "--layers") ? &layers : !strcmp(f, "--reps") ? &reps
                     : NULL;
        if (!strcmp(f, "--label") && v) {
            if (strpbrk(v, "\"\\") || strlen(v) > 64) {
                fprintf(stderr, "sgemm_ceiling: --label must be at most 64 characters without quotes or backslashes\n");
                return 2;
            }
            label = v;
            i++;
            continue;
        }
        if (!dst || !v) {
            fprintf(stderr, "usage: %s --tokens N --dim D --ffn F --vocab V --layers L [--reps R] [--label S]\n"
                            "(unknown or incomplete option '%s')\n", argv[0], f);
            return 2;
        }
        if (parse_i64(f, v, dst)) return 2;
        i++;
    }
    if (!tokens || !dim || !ffn || !vocab || !layers) {
        fprintf(stderr, "sgemm_ceiling: --tokens, --dim, --ffn, --vocab and --layers are required\n");
        return 2;
    }

    /* Linear(in -> out) on N tokens: forward [N,in]x[out,in]ᵀ, grad_input [N,out]x[out,in],
       grad_weight [N,out]ᵀx[N,in]; per-step counts: q,k,v,o are 4 per layer, gate/up 2, down 1 */
    struct { const char *name; int64_t in, out, count; } lin[4] = {
        { "attn_proj", dim, dim, 4 * layers }, { "mlp_gate_up", dim, ffn, 2 * layers },
        { "mlp_down", ffn, dim, layers }, { "lm_head", dim, vocab, 1 },
    };
    gemm_shape shapes[12];
    int ns = 0;
    for (int l = 0; l < 4; l++) {
        int64_t in = lin[l].in, out = lin[l].out;
        shapes[ns++] = (gemm_shape){ lin[l].name, "forward", tokens, out, in, 0, 1, lin[l].count, 0 };
        shapes[ns++] = (gemm_shape){ lin[l].name, "grad_input", tokens, in, out, 0, 0, lin[l].count, 0 };
        shapes[ns++] = (gemm_shape){ lin[l].name, "grad_weight", out, in, tokens, 1, 0, lin[l].count, 0 };
    }

    double best_rate = 0, step_flops = 0, step_time = 0;
    for (int i = 0; i < ns; i++) {
        if (time_shape(&shapes[i], reps)) return 1;
        double flops = 2.0 * (double)shapes[i].m * (double)shapes[i].n * (double)shapes[i].k;
        double rate = flops / shapes[i].best_s / 1e9;
        if (rate > best_rate) best_rate = rate;
        step_flops += flops * (double)shapes[i].per_step;
        step_time += shapes[i].best_s * (double)shapes[i].per_step;
    }

    printf("{\"label\": \"%s\", \"blas\": \"%s\", \"threads\": %d, \"reps\": %lld, \"tokens\": %lld, \"dim\": %lld, "
           "\"ffn\": %lld, \"vocab\": %lld, \"layers\": %lld,\n \"shapes\": [\n",
           label, tide_blas_info(), tide_num_threads(), (long long)reps, (long long)tokens, (long long)dim,
           (long long)ffn, (long long)vocab, (long long)layers);
    for (int i = 0; i < ns; i++) {
        const gemm_shape *s = &shapes[i];
        double flops = 2.0 * (double)s->m * (double)s->n * (double)s->k;
        printf("  {\"linear\": \"%s\", \"pass\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, \"ta\": %d, \"tb\": %d, "
               "\"per_step\": %lld, \"best_ms\": %.3f, \"gflops\": %.1f}%s\n",
               s->linear, s->pass, (long long)s->m, (long long)s->n, (long long)s->k, s->ta, s->tb,
               (long long)s->per_step, s->best_s * 1e3, flops / s->best_s / 1e9, i + 1 < ns ? "," : "");
    }
    printf(" ],\n \"ceiling_gflops\": %.1f, \"step_gemm_gflops\": %.1f, \"step_gemm_seconds\": %.4f}\n", best_rate,
           step_flops / step_time / 1e9, step_time);
    return 0;
}

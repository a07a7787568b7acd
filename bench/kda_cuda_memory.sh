#!/bin/sh
# kda_cuda_memory.sh — the CUDA KDA backward's device memory at K3 head shapes (H 96, dk = dv 128, chunk 16,
# one segment of T tokens), T = 8K .. 1M, before and after the checkpointed backward (kernels/cuda/kda.cu).
# Before: one start state per chunk of 16 tokens (chunks x H x dk x dv floats). After: the forward's checkpoints
# (every TIDE_KDA_CUDA_CKPT_CHUNKS-th chunk, kept by the engine until the backward) plus the backward's scratch
# (a block's start states, the carried dS, the segment table, and where the (segment, head) blocks do not fill an
# H100's 132 SMs the column split's partial dq/dk/dg/dβ; the pre-pass's chunk matrices), from kda_backward_plan /
# kda_backward_bytes: the functions the backward sizes its allocations with. The emulator check (tests/gpu/emu/run.sh kdackpt) holds the
# backward's measured peak to the same formula at small sizes, with gradients bitwise equal to the every-state
# backward. Runs on the CPU (no GPU needed); writes bench/results/kda_cuda_memory.{md,json} and prints the table.
# Needs what tests/gpu/emu/run.sh needs (g++, python3, the CUDA headers, a built libtide in BUILD, default build).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-${TMPDIR:-/tmp}/tide-emu}
log=$(BUILD=${BUILD:-$root/build} OUT=$out sh "$root/tests/gpu/emu/run.sh" kdamem 2>/dev/null)
table=$(echo "$log" | grep '^|')
rows=$(echo "$log" | sed -n 's/^json //p')
[ -n "$table" ] && [ -n "$rows" ] || { echo "kda_cuda_memory: the emulator harness printed no table" >&2; exit 1; }
res=$root/bench/results
{
    echo "# CUDA KDA backward memory at K3 head shapes"
    echo
    echo "One KDA layer, H 96, dk = dv 128, chunk 16, B 1 (bench/kda_cuda_memory.sh; formulas of kernels/cuda/kda.cu,"
    echo "the backward's peak checked against them under the emulator). The backward's blocks are split over dv columns"
    echo "where the (segment, head) blocks do not fill the device (launch.h tide_kda_vsplit; here 96 blocks on an"
    echo "H100's 132 SMs: 2 splits); each split's partial dq, dk, dg, dβ over a block of chunks are kept until they"
    echo "are added (TIDE_KDA_VSPLIT=1 turns the split off and saves them). The backward's pre-pass keeps each chunk's"
    echo "Af, P, M (3 x 16 x 16 floats per chunk and head) for a block of chunks."
    echo
    echo "$table"
} > "$res/kda_cuda_memory.md.tmp"
printf '{"benchmark": "kda_cuda_memory", "H": 96, "dk": 128, "dv": 128, "chunk": 16, "B": 1,\n "ckpt_chunks": 64, "rows": %s}\n' \
    "$rows" > "$res/kda_cuda_memory.json.tmp"
mv "$res/kda_cuda_memory.md.tmp" "$res/kda_cuda_memory.md"
mv "$res/kda_cuda_memory.json.tmp" "$res/kda_cuda_memory.json"
cat "$res/kda_cuda_memory.md"

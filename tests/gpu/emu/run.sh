#!/bin/sh
# Runs kernels/cuda/kda.cu, conv.cu, mla.cu (with gemm.cu) and attention.cu on the CPU under emu.h (harness.cpp says what is checked): a check
# of the CUDA kernels for machines without a GPU (the ctest entry gpu-emu-kda); then mla_decode.cu and kda_decode.cu (run_one.sh mla_decode, kda_decode). Needs g++, python3, the CUDA
# headers (CUDA_HOME, default /usr/local/cuda) and a built libtide (BUILD, default ./build). With no arguments
# the KDA/conv groups and the MLA/attention groups run as two processes side by side.
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build=${BUILD:-$root/build}
cuda=${CUDA_HOME:-/usr/local/cuda}
out=${OUT:-${TMPDIR:-/tmp}/tide-emu}
mkdir -p "$out"
python3 "$here/kernel_resources.py" "$build" "$out/kernel_resources.h"
python3 "$here/transform.py" "$root/kernels/cuda/kda.cu" "$out/kda_emu.inc"
python3 "$here/transform.py" "$root/kernels/cuda/conv.cu" "$out/conv_emu.inc"
python3 "$here/transform.py" "$root/kernels/cuda/mla.cu" "$out/mla_emu.inc"
python3 "$here/transform.py" "$root/kernels/cuda/gemm.cu" "$out/gemm_emu.inc"
python3 "$here/transform.py" "$root/kernels/cuda/attention.cu" "$out/attention_emu.inc"
g++ -std=c++20 -O1 -w -I"$out" -I"$here" -I"$root/kernels/cuda" -I"$root/kernels" -I"$root/engine" -I"$cuda/include" \
    -DTIDE_HAVE_CUDA=1 "$here/harness.cpp" -o "$out/harness" -L"$build" -ltide \
    -Wl,-rpath,"$build:$cuda/lib64" -L"$cuda/lib64"
[ $# -gt 0 ] && exec "$out/harness" "$@"
"$out/harness" mlasmall mlaedge mla64 mla128 mlalatent varlen attnsmall attn64 > "$out/mla.log" 2>&1 &
mla=$!
rc=0
"$out/harness" gate conv kdasmall kda16 kda64 kda128 kdackpt kdasplit bound || rc=1
wait $mla || rc=1
cat "$out/mla.log"
sh "$here/run_one.sh" mla_decode || rc=1
sh "$here/run_one.sh" kda_decode || rc=1
exit $rc

#!/bin/sh
# Runs kernels/cuda/loss.cu (token_logprobs and cross_entropy) on the CPU under emu.h (loss.cpp says what is checked).
# Needs g++, python3, the CUDA headers (CUDA_HOME, default /usr/local/cuda) and a built libtide (BUILD, default ./build).
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build=${BUILD:-$root/build}
cuda=${CUDA_HOME:-/usr/local/cuda}
out=${OUT:-${TMPDIR:-/tmp}/tide-emu}
mkdir -p "$out"
python3 "$here/transform.py" "$root/kernels/cuda/loss.cu" "$out/loss_emu.inc"
g++ -std=c++20 -O1 -w -I"$out" -I"$here" -I"$root/kernels/cuda" -I"$root/kernels" -I"$root/engine" -I"$cuda/include" \
    -DTIDE_HAVE_CUDA=1 "$here/loss.cpp" -o "$out/loss" -L"$build" -ltide \
    -Wl,-rpath,"$build:$cuda/lib64" -L"$cuda/lib64"
exec "$out/loss" "$@"

#!/bin/sh
# run_one.sh NAME [ARGS]: runs kernels/cuda/NAME.cu on the CPU under emu.h, checked by NAME.cpp (each .cpp says what
# it checks; ARGS go to it). NAME: attnres, moe, vision, optim (AdamW and its non-finite flag), loss
# (token_logprobs and cross_entropy), index (index_add and scatter_add: deterministic, in index order), mla_decode (mla_decode_rows), kda_decode (kda_decode_rows; run.sh runs both too); run.sh covers the KDA, conv,
# MLA and attention kernels. Needs g++, python3, the CUDA headers (CUDA_HOME, default /usr/local/cuda) and a built
# libtide (BUILD, default ./build).
set -e
name=${1:?usage: run_one.sh NAME [ARGS] (NAME: attnres, moe, vision, optim, loss, index, mla_decode, kda_decode)}
shift
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
[ -f "$here/$name.cpp" ] && [ -f "$root/kernels/cuda/$name.cu" ] || {
    echo "run_one.sh: no emulator check '$name' (tests/gpu/emu/$name.cpp and kernels/cuda/$name.cu)" >&2; exit 2; }
build=${BUILD:-$root/build}
cuda=${CUDA_HOME:-/usr/local/cuda}
out=${OUT:-${TMPDIR:-/tmp}/tide-emu}
mkdir -p "$out"
python3 "$here/kernel_resources.py" "$build" "$out/kernel_resources.h"
python3 "$here/transform.py" "$root/kernels/cuda/$name.cu" "$out/${name}_emu.inc"
g++ -std=c++20 -O1 -w -I"$out" -I"$here" -I"$root/kernels/cuda" -I"$root/kernels" -I"$root/engine" -I"$cuda/include" \
    -DTIDE_HAVE_CUDA=1 "$here/$name.cpp" -o "$out/$name" -L"$build" -ltide \
    -Wl,-rpath,"$build:$cuda/lib64" -L"$cuda/lib64"
exec "$out/$name" "$@"

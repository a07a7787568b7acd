#!/bin/sh
# run_nccl.sh: builds tests/gpu/emu/nccl.cpp (kernels/cuda/nccl_comm.cu on the CPU under emu.h, NCCL stood in for by
# MPI: fake/nccl.h) and runs it under mpirun at 2 and at 4 ranks (oversubscribed). Needs mpicxx and mpirun, python3,
# the CUDA headers (CUDA_HOME, default /usr/local/cuda) and a built libtide with MPI (BUILD, default ./build); without
# MPI it skips (exit 0).
set -e
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build=${BUILD:-$root/build}
cuda=${CUDA_HOME:-/usr/local/cuda}
out=${OUT:-${TMPDIR:-/tmp}/tide-emu}
mpirun=${MPIEXEC:-mpirun}
for tool in mpicxx "$mpirun"; do
    command -v "$tool" > /dev/null || { echo "run_nccl.sh: no $tool: skipped"; exit 0; }
done
mkdir -p "$out"
python3 "$here/kernel_resources.py" "$build" "$out/kernel_resources.h"
python3 "$here/transform.py" "$root/kernels/cuda/nccl_comm.cu" "$out/nccl_comm_emu.inc"
mpicxx -std=c++20 -O1 -w -I"$here/fake" -I"$out" -I"$here" -I"$root/kernels/cuda" -I"$root/kernels" -I"$root/engine" \
    -I"$cuda/include" -DTIDE_HAVE_CUDA=1 -DTIDE_HAVE_NCCL=1 -DNCCL_CHUNK=257 "$here/nccl.cpp" -o "$out/nccl" \
    -L"$build" -ltide -Wl,-rpath,"$build:$cuda/lib64" -L"$cuda/lib64"
for n in 2 4; do
    "$mpirun" --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1 -np $n "$out/nccl"
done

#!/bin/sh
# run_step_dense.sh — builds what the dense-step benchmark needs (when missing or stale) and runs it:
# the sgemm ceiling, tide's training step and the PyTorch baseline, per config, in one run. Writes
# bench/results/step_dense.json and bench/results/step_dense.md and prints the table.
#
#   bench/run_step_dense.sh [--only=gpt2-small] [--steps=N] [--baseline=false] [...]
#
# Arguments are passed to `tide run bench/step_dense.lua`. Environment: BUILD_DIR (default build),
# PYTHON (default /usr/bin/python3, the interpreter with Debian's python3-torch), JOBS (default 2).
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-"$root/build"}
python=${PYTHON:-/usr/bin/python3}
jobs=${JOBS:-2}

if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build" --target tide_exe bench-sgemm-ceiling -j "$jobs"

cd "$root"
# PyTorch's setting is chosen inside step_dense.lua (OMP_WAIT_POLICY=PASSIVE on its command only);
# tide runs with the environment as it is.
exec "$build/tide" run bench/step_dense.lua --python="$python" --results=bench/results "$@"

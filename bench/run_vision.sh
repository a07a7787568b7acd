#!/bin/sh
# run_vision.sh — builds the tide executable (when missing or stale) and runs the vision-encoder benchmark: the
# tide/PyTorch output check, interleaved tide and PyTorch forward + backward rounds, memory at 1x/2x/4x packed
# images and the per-op profile, per config, in one run. Writes bench/results/vision.json and bench/results/vision.md
# and prints the table.
#
#   bench/run_vision.sh [--only=tiny-vlm|moonvit-narrow] [--rounds=N] [--baseline=false] [...]
#
# Arguments are passed to `tide run bench/vision.lua`. Environment: BUILD_DIR (default build), PYTHON (default
# /usr/bin/python3, the interpreter with Debian's python3-torch), JOBS (default 2).
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-"$root/build"}
python=${PYTHON:-/usr/bin/python3}
jobs=${JOBS:-2}

if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build" --target tide_exe -j "$jobs"

cd "$root"
# PyTorch runs with OMP_WAIT_POLICY=PASSIVE (set inside vision.lua on its command only); tide runs with the
# environment as it is.
exec "$build/tide" run bench/vision.lua --python="$python" --results=bench/results "$@"

#!/bin/sh
# run_rl.sh — builds the tide executable (when missing or stale) and runs the RL benchmark: rollout tokens/s with the
# calc tool at G = 8 and 32, tide and PyTorch eager rounds interleaved, one iteration's split between sampling,
# scoring and update in both, the batched-forward probe and the pause/resume ratios, in one run. Writes
# bench/results/rl.json and bench/results/rl.md (the ratio table and the targets' verdicts) and prints the table.
#
#   bench/run_rl.sh [--rounds=N] [--Gs=8,32] [--prompts=N] [--max_new=N] [--baseline=false] [...]
#
# Arguments are passed to `tide run bench/rl.lua`. Environment: BUILD_DIR (default build), PYTHON (default
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
# PyTorch runs with OMP_WAIT_POLICY=PASSIVE (set inside rl.lua on its command only); tide runs with the environment
# as it is.
exec "$build/tide" run bench/rl.lua --python="$python" --results=bench/results "$@"

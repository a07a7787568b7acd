#!/bin/sh
# run_torch.sh NAME [ARGS] — builds what the benchmarks with a PyTorch baseline need (the tide executable and the
# sgemm-ceiling probe, when missing or stale) and runs bench/NAME.lua: tide and PyTorch eager measured in the same
# run, results in bench/results/NAME.json and bench/results/NAME.md, the table printed. NAME:
#   step_dense  one dense training step: the sgemm ceiling, tide's step and PyTorch's, per config
#               [--only=gpt2-small] [--steps=N] [--baseline=false] [...]
#   vision      the ViT encoder + projector forward + backward: the output check, interleaved rounds, memory at
#               1x/2x/4x packed images, the per-op profile [--only=tiny-vlm|moonvit-narrow] [--rounds=N] [...]
#   hybrid      training steps of the hybrid model (tiny-hybrid and the quickstart model) at T 256 x B 16 and
#               T 1,024 x B 4: the f64/f32 check against bench/torch_hybrid.py, interleaved rounds against both OpenMP
#               settings, the perf profile of tide's step [--only=tiny-hybrid|quickstart] [--rounds=N] [...]
#   rl          rollout tokens/s with the calc tool at G = 8 and 32, one iteration's split between sampling, scoring
#               and update, the batched-forward probe, the pause/resume ratios [--rounds=N] [--Gs=8,32] [...]
#
# ARGS are passed to `tide run bench/NAME.lua`. PyTorch's fastest setting (OMP_WAIT_POLICY=PASSIVE, on its command
# only) is chosen inside the benchmark; tide runs with the environment as it is. Environment: BUILD_DIR (default
# build), PYTHON (default /usr/bin/python3, the interpreter with Debian's python3-torch), JOBS (default 2). With
# build/torch-pypi (scripts/torch_pypi.sh: PyTorch 2.x from PyPI), the benchmarks time that build too.
set -eu

name=${1:?usage: bench/run_torch.sh step_dense|vision|hybrid|rl [ARGS]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
case $name in
    step_dense|vision|hybrid|rl) ;;
    *) echo "run_torch.sh: no benchmark '$name' with a PyTorch baseline (step_dense, vision, hybrid, rl)" >&2; exit 2 ;;
esac
build=${BUILD_DIR:-"$root/build"}
python=${PYTHON:-/usr/bin/python3}
jobs=${JOBS:-2}

if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build" --target tide_exe bench-sgemm-ceiling -j "$jobs"

cd "$root"
# a PyPI build of PyTorch beside Debian's when scripts/torch_pypi.sh made one: every benchmark times both and quotes the
# fastest
pythons=$python
[ -x build/torch-pypi/bin/python ] && pythons="$python,build/torch-pypi/bin/python"
exec "$build/tide" run "bench/$name.lua" --python="$pythons" --results=bench/results "$@"

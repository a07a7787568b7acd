#!/usr/bin/env bash
# The second PyTorch baseline of the benchmarks: PyTorch from PyPI (2.x, MKL and its own OpenMP runtime) in
# build/torch-pypi, beside Debian's python3-torch (1.13, OpenBLAS). Which one is faster depends on the workload and
# on its OpenMP setting, so bench/step_dense.lua and bench/hybrid.lua (and bench/run_torch.sh) time every build they
# find under both settings and quote the fastest. Nothing else uses it: not the engine, not the tests.
#
#   bash scripts/torch_pypi.sh [VERSION]     (VERSION: a pip requirement, default the newest `torch`)
#
# The PyPI wheel for Linux pulls the CUDA runtime packages it links against (about 5 GB with them); it runs on the
# CPU without a GPU. Safe to run again: an environment that imports torch is kept. Needs network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

env_dir=build/torch-pypi
req=${1:-torch}
if [ -x "$env_dir/bin/python" ] && "$env_dir/bin/python" -c 'import torch' 2>/dev/null; then
  echo "torch_pypi: $env_dir has PyTorch $("$env_dir/bin/python" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
if ! python3 -m venv --help >/dev/null 2>&1; then
  echo "torch_pypi: python3 -m venv is not available (apt-get install python3-venv)" >&2
  exit 1
fi
mkdir -p build
rm -rf "$env_dir"
python3 -m venv "$env_dir"
if ! "$env_dir/bin/pip" install -q --disable-pip-version-check "$req" numpy; then
  echo "torch_pypi: pip could not install '$req' from PyPI (no network?); the benchmarks run Debian's PyTorch alone" >&2
  rm -rf "$env_dir"
  exit 1
fi
"$env_dir/bin/python" -c 'import torch; print("torch_pypi: " + "'"$env_dir"'" + " has PyTorch " + torch.__version__)'

#!/usr/bin/env bash
# Installs what is missing (Debian packages), then configures and builds tide into ./build.
# Used by the README's two commands and by CI. Safe to run again: it only installs what is absent.
set -euo pipefail
cd "$(dirname "$0")/.."

# clang-14 + libclang-rt-14-dev (libFuzzer, the sanitizer runtimes): the fuzz lane (scripts/lane_fuzz.sh)
pkgs=(build-essential cmake pkg-config luajit libluajit-5.1-dev libopenblas-openmp-dev libcjson-dev
      libreadline-dev fortunes libopenmpi-dev openmpi-bin clang-14 libclang-rt-14-dev libstb-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# CUDA: built when nvcc is found (on PATH or in /usr/local/cuda); TIDE_CUDA=OFF skips it.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTIDE_CUDA="${TIDE_CUDA:-AUTO}" >/dev/null
cmake --build build -j"$(nproc)"

#!/usr/bin/env bash
# The test suite's interoperability checks: a Python environment with the real libraries tide's files must
# work with (tokenizers, safetensors, tensorboard, transformers on Debian's PyTorch) and headless Chromium for
# the report page's screenshot. The engine never needs any of it at run time.
#
# Creates build/pyenv (a venv over the system Python, so Debian's python3-torch is visible) and installs the
# pinned packages into it when absent; safe to run again. Called by scripts/bootstrap.sh; TIDE_TEST_DEPS=0 skips it
# (the tests that need it then fail and say to run this script).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
pkgs=(python3-venv python3-torch chromium python3-sklearn python3-pil)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "test_deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

env_dir=build/pyenv
py=/usr/bin/python3
if [ ! -x "$env_dir/bin/python" ]; then
  mkdir -p build
  "$py" -m venv --system-site-packages "$env_dir"
fi
# versions that work with Debian 12's torch 1.13 and Python 3.11
want=(tokenizers==0.19.1 safetensors==0.4.3 tensorboard==2.16.2 transformers==4.40.2 numpy==1.26.4)
if ! "$env_dir/bin/python" - "${want[@]}" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, v = spec.split("==")
    if version(name) != v:
        sys.exit(1)
import torch, transformers, tokenizers, tensorboard, safetensors  # noqa: F401  (they import together)
EOF
then
  echo "test_deps: pip install ${want[*]}"
  "$env_dir/bin/python" -m pip install -q --disable-pip-version-check "${want[@]}"
fi
echo "test_deps: $env_dir ready ($("$env_dir/bin/python" -c 'import torch, transformers, tokenizers; print("torch", torch.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__)'))"

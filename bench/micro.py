"""Engine micro-benchmarks (C++): hook-path overhead per gradient, and engine
all-reduce bandwidth against raw Gloo on the same buffer sizes.

    python bench/micro.py

Builds the C++ benchmarks (cmake, HEMIOLA_BUILD_TESTS=ON) into build/bench,
runs them, writes bench/results/micro.jsonl and prints a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from statistics import median

from hemiola.bench.record import DEFAULT_OUT, write_lines

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "bench"


def build() -> Path:
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(BUILD), "-DHEMIOLA_BUILD_TESTS=ON",
                    "-DHEMIOLA_WITH_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(BUILD), "--target", "bench_hook_overhead",
                    "bench_allreduce_bandwidth", "-j", str(os.cpu_count() or 1)],
                   check=True, capture_output=True)
    return BUILD / "bench" / "cpp"


def main() -> None:
    binaries = build()
    rows = []
    out = subprocess.run([str(binaries / "bench_hook_overhead"), "10000", "16", "20"],
                         check=True, capture_output=True, text=True).stdout
    hook = json.loads(out)
    rows.append(hook)
    print(f"hook path (mark_ready), {hook['params']} params of {hook['elements_per_param']} "
          f"floats: median {hook['median_ns']:.0f} ns, p99 {hook['p99_ns']:.0f} ns "
          f"(timer itself {hook['timer_overhead_median_ns']:.0f} ns)")

    # Several independent runs (fresh processes); the table shows, per buffer
    # size, the median over runs of each run's median.
    world, runs = 2, 5
    by_size: dict[int, list[dict[str, float]]] = {}
    for _ in range(runs):
        store = tempfile.mkdtemp(prefix="hemiola-bench-")
        procs = [subprocess.Popen([str(binaries / "bench_allreduce_bandwidth"), str(r),
                                   str(world), store, "21"], stdout=subprocess.PIPE, text=True)
                 for r in range(world)]
        lines = procs[0].communicate(timeout=900)[0]
        procs[1].wait(timeout=60)
        for line in lines.splitlines():
            row = json.loads(line)
            by_size.setdefault(row["bytes"], []).append(row)
    print(f"{'bytes':>12s} {'engine ms':>10s} {'raw gloo ms':>12s} {'engine/raw bw':>14s} "
          f"{'(min..max over runs)':>22s}")
    for size, samples in by_size.items():
        ratios = [r["engine_vs_raw"] for r in samples]
        row = {"bench": "allreduce_bandwidth", "world": world, "bytes": size, "runs": runs,
               "engine_ms": median([r["engine_ms"] for r in samples]),
               "raw_gloo_ms": median([r["raw_gloo_ms"] for r in samples]),
               "engine_vs_raw": median(ratios), "engine_vs_raw_min": min(ratios),
               "engine_vs_raw_max": max(ratios)}
        rows.append(row)
        print(f"{size:12d} {row['engine_ms']:10.3f} {row['raw_gloo_ms']:12.3f} "
              f"{row['engine_vs_raw']:14.3f} {min(ratios):10.3f}..{max(ratios):.3f}")
    print(f"wrote {write_lines(DEFAULT_OUT / 'micro.jsonl', rows)}")


if __name__ == "__main__":
    main()

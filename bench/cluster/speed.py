"""Speed benchmark of the cluster simulator (numbers go to docs/cluster.md).

1. The paper's 160-job workload at task level on 16 x 4 GPUs (budget 0.5 s per run).
2. The full Philly trace at iteration level on 512 x 4 = 2,048 GPUs (budget 60 s).

Times are wall-clock seconds of the native simulate() call (the GIL is released),
measured with time.perf_counter; trace loading is timed separately.

    python bench/cluster/speed.py [--trace PATH] [--out bench/results/cluster]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from hemiola import _C
from hemiola.cluster import ClusterConfig, PolicyConfig, run_jobs
from hemiola.cluster.api import make_cluster

C = _C.cluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="../shared/data/traces/philly.csv")
    parser.add_argument("--out", default="bench/results/cluster")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    host = {"machine": platform.machine(), "python": platform.python_version()}

    models = list(C.builtin_models())
    cluster = ClusterConfig()
    for placement, comm in [("first-fit", "srsf:1"), ("lwf:1", "ada-srsf"), ("lwf:4", "srsf:2")]:
        walls = []
        for seed in range(args.repeats):
            jobs = list(C.paper_workload(jobs=160, seed=seed))
            s, _ = run_jobs(jobs, models, cluster, PolicyConfig(placement, comm, "task", seed))
            walls.append(s.wall_s)
        rec = {"bench": "paper-160-task", "placement": placement, "comm": comm,
               "runs": len(walls), "median_s": statistics.median(walls), "max_s": max(walls),
               **host}
        records.append(rec)
        print(json.dumps(rec))

    trace = Path(args.trace)
    if not trace.exists():
        print(f"trace {trace} not found: skipping the Philly benchmark")
    else:
        big = ClusterConfig(nodes=512, gpus_per_node=4)
        t0 = time.perf_counter()
        jobs = list(C.load_trace(str(trace), models, make_cluster(big), seed=0))
        load_s = time.perf_counter() - t0
        for placement, comm in [("lwf:4", "ada-srsf"), ("lwf:1", "srsf:1"),
                                ("first-fit", "srsf:2")]:
            s, _ = run_jobs(jobs, models, big, PolicyConfig(placement, comm, "iteration", 0))
            rec = {"bench": "philly-iteration-2048", "placement": placement, "comm": comm,
                   "jobs": len(jobs), "load_s": load_s, "simulate_s": s.wall_s,
                   "events": s.events, "mean_jct_ms": s.mean_jct_ms, **host}
            records.append(rec)
            print(json.dumps(rec))
    with open(out / "speed.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

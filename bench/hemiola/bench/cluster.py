"""The cluster scheduler against the baselines a cluster runs today, in the
event simulator: LWF-κ placement against first-fit and random, Ada-SRSF
against SRSF(1) and SRSF(2), on the same jobs per seed.

    hemiola bench cluster                      # the paper's 160-job workload, 10 seeds
    hemiola bench cluster --seeds 20 --placements first-fit,lwf:1,lwf:4

Every (placement, communication policy) pair runs on every seed's workload
(task level, 16 nodes x 4 GPUs; :func:`hemiola.cluster.compare`). One result
row per pair: the mean job completion time (JCT) and the makespan, each the
median and p10-p90 over seeds, and the per-seed ratios to the baseline pair
(first-fit with SRSF(1)), so a policy is compared on the same jobs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hemiola.bench.record import DEFAULT_OUT, percentiles, write_lines

PLACEMENTS = "first-fit,random,lwf:1,lwf:4,lwf:16"
COMMS = "srsf:1,srsf:2,ada-srsf"
BASELINE = ("first-fit", "srsf:1")


def rows_of(runs: list[dict[str, Any]], jobs: int, nodes: int,
            gpus_per_node: int) -> list[dict[str, Any]]:
    """One summary row per (placement, comm) pair over the seeds of `runs`."""
    by_key: dict[tuple[str, str, int], dict[str, Any]] = {
        (r["placement"], r["comm"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for placement, comm in dict.fromkeys((r["placement"], r["comm"]) for r in runs):
        mine = [by_key[(placement, comm, s)] for s in seeds]
        row: dict[str, Any] = {
            "suite": "cluster", "placement": placement, "comm": comm, "seeds": len(seeds),
            "jobs": jobs, "nodes": nodes, "gpus_per_node": gpus_per_node,
            "mean_jct_s": percentiles(r["mean_jct_ms"] / 1e3 for r in mine),
            "makespan_s": percentiles(r["makespan_ms"] / 1e3 for r in mine)}
        if all((*BASELINE, s) in by_key for s in seeds):
            base = [by_key[(*BASELINE, s)] for s in seeds]
            row["jct_vs_baseline"] = percentiles(
                r["mean_jct_ms"] / b["mean_jct_ms"] for r, b in zip(mine, base))
        rows.append(row)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--placements", default=PLACEMENTS,
                        help=f"comma-separated placement policies (default {PLACEMENTS})")
    parser.add_argument("--comms", default=COMMS,
                        help=f"comma-separated communication policies (default {COMMS})")
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    parser.add_argument("--jobs", type=int, default=160, help="jobs of the paper's workload")
    parser.add_argument("--threads", type=int, default=1, help="simulations run at once")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--name", default="cluster", help="results go to OUT/NAME.jsonl")


def run(args: argparse.Namespace) -> int:
    from hemiola.cluster import ClusterConfig, WorkloadConfig, compare

    cluster = ClusterConfig()
    runs = compare(WorkloadConfig(kind="paper", jobs=args.jobs), cluster,
                   args.placements.split(","), args.comms.split(","), list(range(args.seeds)),
                   fidelity="task", workers=args.threads)
    rows = rows_of(runs, args.jobs, cluster.nodes, cluster.gpus_per_node)
    for r in rows:
        ratio = r.get("jct_vs_baseline")
        print(f"{r['placement']:>10} {r['comm']:>9}: mean JCT {r['mean_jct_s']['median']:8.1f} s "
              f"[{r['mean_jct_s']['p10']:.1f}-{r['mean_jct_s']['p90']:.1f}]"
              + (f"  {ratio['median']:.3f}x first-fit/srsf:1" if ratio else ""))
    print(f"wrote {write_lines(args.out / f'{args.name}.jsonl', rows)}")
    return 0

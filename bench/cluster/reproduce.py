"""Reproduction of Wang et al. 2020's main comparisons on the paper's workload.

Grid: placements first-fit, random, lwf:{1,2,4,8,16,32} x communication
srsf:1, srsf:2, ada-srsf x seeds 0..N-1 (task level, 16 x 4 GPUs, 160 jobs).
Writes runs.jsonl, table.md, jct_cdf.png, utilization.png, kappa.png (mean JCT
vs κ) and reproduction.md (the paper-vs-measured summary) under --out.

    python bench/cluster/reproduce.py --seeds 20 --out bench/results/cluster/reproduce
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hemiola.cluster import ClusterConfig, WorkloadConfig, aggregate, compare

PLACEMENTS = ["first-fit", "random", "lwf:1", "lwf:2", "lwf:4", "lwf:8", "lwf:16", "lwf:32"]
COMMS = ["srsf:1", "srsf:2", "ada-srsf"]


def _per_seed(rows: Sequence[dict[str, Any]], metric: str) -> dict[tuple[str, str, int], float]:
    return {(r["placement"], r["comm"], r["seed"]): float(r[metric]) for r in rows}


def _stat(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {spread:.3f} (min {min(values):.3f}, " \
           f"max {max(values):.3f})"


def summary(rows: Sequence[dict[str, Any]], seeds: Sequence[int]) -> str:
    """Ratios computed per seed (same jobs for every policy), then mean ± std."""
    jct = _per_seed(rows, "mean_jct_ms")
    mk = _per_seed(rows, "makespan_ms")
    lines = [f"# Reproduction summary ({len(seeds)} seeds: {seeds[0]}..{seeds[-1]})", ""]
    lines += ["## Placement: mean-JCT speedup of LWF-κ over first-fit "
              "(first-fit JCT / LWF JCT; paper: up to 1.59×)", "",
              "| comm | placement | JCT speedup | makespan speedup |", "|---|---|---|---|"]
    for comm in COMMS:
        for p in PLACEMENTS[1:]:
            sp = [jct[("first-fit", comm, s)] / jct[(p, comm, s)] for s in seeds]
            ms = [mk[("first-fit", comm, s)] / mk[(p, comm, s)] for s in seeds]
            lines.append(f"| {comm} | {p} | {_stat(sp)} | {_stat(ms)} |")
    lines += ["", "## Communication: change of mean JCT of Ada-SRSF vs SRSF(n) "
              "(ada/srsf − 1; paper: −20.1% vs SRSF(1), −36.7% vs SRSF(2))", "",
              "| placement | vs srsf:1 (%) | vs srsf:2 (%) |", "|---|---|---|"]
    for p in PLACEMENTS:
        cells = []
        for base in ("srsf:1", "srsf:2"):
            ch = [100 * (jct[(p, "ada-srsf", s)] / jct[(p, base, s)] - 1) for s in seeds]
            cells.append(_stat(ch))
        lines.append(f"| {p} | {cells[0]} | {cells[1]} |")
    lines += ["", "## Diagnostics: how often transfers start next to another one, and the "
              "mean JCT of jobs spanning several nodes (mean ± std over seeds)", "",
              "| placement | comm | transfers shared (%) | multi-node jobs | "
              "their mean JCT (s) |", "|---|---|---|---|---|"]
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((r["placement"], r["comm"]), []).append(r)
    for (p, comm), rs in by_key.items():
        shared = [100 * r["shared_transfer_starts"] / max(1, r["transfers"]) for r in rs]
        multi = [float(r["multi_node_jobs"]) for r in rs]
        jct = [r["mean_jct_multi_node_ms"] / 1000 for r in rs]
        lines.append(f"| {p} | {comm} | {statistics.fmean(shared):.1f} ± "
                     f"{statistics.stdev(shared) if len(rs) > 1 else 0:.1f} | "
                     f"{statistics.fmean(multi):.1f} | {statistics.fmean(jct):.2f} ± "
                     f"{statistics.stdev(jct) if len(rs) > 1 else 0:.2f} |")
    return "\n".join(lines) + "\n"


def plot_kappa(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Mean JCT (mean ± std over seeds) against κ, one line per comm policy;
    first-fit and random as horizontal references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = aggregate(rows)
    kappas = [int(p.split(":")[1]) for p in PLACEMENTS if p.startswith("lwf:")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, comm in enumerate(COMMS):
        mean = [agg[(f"lwf:{k}", comm)]["mean_jct_ms"][0] / 1000 for k in kappas]
        std = [agg[(f"lwf:{k}", comm)]["mean_jct_ms"][1] / 1000 for k in kappas]
        ax.errorbar(kappas, mean, yerr=std, marker="o", capsize=3, color=f"C{i}",
                    label=f"LWF-κ / {comm}")
        for base, style in (("first-fit", "--"), ("random", ":")):
            ax.axhline(agg[(base, comm)]["mean_jct_ms"][0] / 1000, color=f"C{i}",
                       linestyle=style, linewidth=0.8, label=f"{base} / {comm}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(kappas, [str(k) for k in kappas])
    ax.set_xlabel("κ (jobs of ≤ κ GPUs spread; larger jobs packed by node)")
    ax.set_ylabel("mean JCT (s), mean ± std over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=160)
    parser.add_argument("--out", default="bench/results/cluster/reproduce")
    parser.add_argument("--workers", type=int, default=1, help="threads for the grid")
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    rows = compare(WorkloadConfig(kind="paper", jobs=args.jobs), ClusterConfig(), PLACEMENTS,
                   COMMS, seeds, fidelity="task", out_dir=args.out, workers=args.workers)
    text = summary(rows, seeds)
    Path(args.out, "reproduction.md").write_text(text)
    plot_kappa(rows, Path(args.out, "kappa.png"))
    print(Path(args.out, "table.md").read_text())
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Grids of simulations (policies x seeds), a summary table and plots."""

from __future__ import annotations

import json
import statistics
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from hemiola.cluster.api import SimulationSummary, load_models, make_jobs, run_jobs
from hemiola.cluster.config import ClusterConfig, PolicyConfig, WorkloadConfig

METRICS = ("mean_jct_ms", "median_jct_ms", "p99_jct_ms", "makespan_ms", "gpu_utilization")


def compare(
    workload: WorkloadConfig,
    cluster: ClusterConfig,
    placements: Sequence[str],
    comms: Sequence[str],
    seeds: Sequence[int],
    fidelity: str = "task",
    out_dir: str | Path | None = None,
    progress: bool = True,
    workers: int = 1,
    job_order: str = "fifo",
) -> list[dict[str, Any]]:
    """Run every (placement, comm) pair on every seed's workload.

    The workload seed and the random-placement seed are both the grid's seed,
    so every policy sees the same jobs for a given seed. Returns one dict per
    run (the keys of :meth:`SimulationSummary.to_dict` plus ``seed``). With
    ``out_dir``, also writes ``runs.jsonl``, ``table.md``, ``jct_cdf.png`` and
    ``utilization.png`` there. ``workers`` > 1 runs simulations on that many
    threads (the native simulator releases the GIL and has no shared state);
    the results do not depend on it. Ctrl-C stops the runs in flight, drops
    the queued ones and raises ``KeyboardInterrupt``.
    """
    from tqdm import tqdm

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    # Each seed's jobs are built once and shared by every policy (read-only).
    tasks = []
    for seed in seeds:
        wl = replace(workload, seed=seed)
        models = load_models(wl)
        jobs = make_jobs(wl, cluster, models)
        for placement in placements:
            for comm in comms:
                policy = PolicyConfig(
                    placement=placement,
                    comm=comm,
                    fidelity=fidelity,
                    seed=seed,
                    job_order=job_order,
                )
                tasks.append((seed, jobs, models, policy))

    # Simulations run on pool threads, which Ctrl-C does not reach: the main
    # thread gets KeyboardInterrupt and tells them to stop through this event.
    stop = threading.Event()

    def run(task: tuple[int, list[Any], list[Any], PolicyConfig]) -> SimulationSummary:
        _, jobs, models, policy = task
        return run_jobs(jobs, models, cluster, policy, should_stop=stop.is_set)[0]

    rows: list[dict[str, Any]] = []
    series: dict[str, list[SimulationSummary]] = {}
    bar = tqdm(total=len(tasks), desc="cluster compare", unit="run", disable=not progress)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            # map() yields in submission order, so rows are in grid order.
            for task, summary in zip(tasks, pool.map(run, tasks)):
                row = summary.to_dict()
                row["seed"] = task[0]
                rows.append(row)
                series.setdefault(f"{summary.placement} / {summary.comm}", []).append(summary)
                bar.update(1)
        except BaseException:
            # Ctrl-C or a failed run: without this the pool would finish the
            # whole grid before the exception got out.
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise
        finally:
            bar.close()
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "runs.jsonl", "w") as f:
            meta = {"workload": asdict(workload), "cluster": asdict(cluster)}
            for row in rows:
                f.write(json.dumps({**row, **meta}) + "\n")
        (out / "table.md").write_text(format_table(rows))
        try:
            import matplotlib  # noqa: F401 - only to know whether the plots can be drawn
        except ImportError:
            print("note: matplotlib is not installed, so jct_cdf.png and utilization.png are "
                  "not drawn (pip install matplotlib)")
        else:
            plot_jct_cdf(series, out / "jct_cdf.png")
            plot_utilization(series, out / "utilization.png")
    return rows


Stats = dict[tuple[str, str], dict[str, tuple[float, float]]]


def aggregate(rows: Sequence[dict[str, Any]]) -> Stats:
    """(placement, comm) -> metric -> (mean over seeds, sample std over seeds)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["placement"], r["comm"]), []).append(r)
    out: Stats = {}
    for key, rs in groups.items():
        stats: dict[str, tuple[float, float]] = {}
        for m in METRICS:
            values = [float(r[m]) for r in rs]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            stats[m] = (statistics.fmean(values), spread)
        out[key] = stats
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: mean ± std over seeds for every policy pair."""
    agg = aggregate(rows)
    n = len({r["seed"] for r in rows})
    lines = [
        f"Mean ± std over {n} seed(s); times in seconds.",
        "",
        "| placement | comm | mean JCT | median JCT | p99 JCT | makespan | GPU util |",
        "|---|---|---|---|---|---|---|",
    ]
    for (placement, comm), s in agg.items():
        cells = [f"{s[m][0] / 1000:.2f} ± {s[m][1] / 1000:.2f}" for m in METRICS[:4]]
        util = s["gpu_utilization"]
        cells.append(f"{util[0]:.3f} ± {util[1]:.3f}")
        lines.append(f"| {placement} | {comm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _styles(series: dict[str, list[SimulationSummary]]) -> dict[str, dict[str, Any]]:
    """One colour per placement, one line style per communication policy."""
    placements = list(dict.fromkeys(runs[0].placement for runs in series.values()))
    comms = list(dict.fromkeys(runs[0].comm for runs in series.values()))
    dashes = ["-", "--", ":", "-."]
    return {
        label: {
            "color": f"C{placements.index(runs[0].placement) % 10}",
            "linestyle": dashes[comms.index(runs[0].comm) % len(dashes)],
        }
        for label, runs in series.items()
    }


def plot_jct_cdf(series: dict[str, list[SimulationSummary]], path: Path) -> None:
    """CDF of job completion times per policy, pooled over seeds."""
    plt = _pyplot()
    styles = _styles(series)
    fig, ax = plt.subplots(figsize=(9, 5))
    for label, runs in series.items():
        jct = sorted(j / 1000 for s in runs for j in s.jct_ms)
        if not jct:
            continue
        ys = [(i + 1) / len(jct) for i in range(len(jct))]
        ax.step(jct, ys, where="post", label=label, linewidth=1.0, **styles[label])
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("JCT CDF per policy (all seeds pooled)")
    _finish(plt, fig, ax, path)


def _finish(plt: Any, fig: Any, ax: Any, path: Path) -> None:
    """Grid, a legend beside the axes (when there is anything to label), save."""
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing to label when every run was empty
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def binned_utilization(
    time_ms: Sequence[float], value: Sequence[float], bins: int = 200
) -> tuple[list[float], list[float]]:
    """Average of a step function (value[i] on [time[i], time[i+1])) over equal bins.

    Returns (bin centres in ms, mean value per bin); exact, because the integral
    of a step function is piecewise linear between its breakpoints.
    """
    import numpy as np

    t = np.asarray(time_ms, dtype=float)
    v = np.asarray(value, dtype=float)
    if t.size < 2 or t[-1] <= t[0]:
        return [], []
    area = np.concatenate([[0.0], np.cumsum(v[:-1] * np.diff(t))])
    edges = np.linspace(t[0], t[-1], bins + 1)
    cum = np.interp(edges, t, area)
    means = np.diff(cum) / np.diff(edges)
    centres = 0.5 * (edges[:-1] + edges[1:])
    return centres.tolist(), means.tolist()


def plot_utilization(series: dict[str, list[SimulationSummary]], path: Path) -> None:
    """GPU utilisation over time for each policy (first seed's run, 200 time bins)."""
    plt = _pyplot()
    styles = _styles(series)
    fig, ax = plt.subplots(figsize=(9, 5))
    for label, runs in series.items():
        s = runs[0]
        centres, means = binned_utilization(s.util_time_ms, s.util_value)
        if not centres:
            continue
        ax.plot([t / 1000 for t in centres], means, label=label, linewidth=1.0, **styles[label])
    ax.set_xlabel("time (s)")
    ax.set_ylabel("fraction of GPUs computing")
    ax.set_title("GPU utilisation over time (first seed; mean per 1/200 of the run)")
    ax.set_ylim(0, 1.05)
    _finish(plt, fig, ax, path)

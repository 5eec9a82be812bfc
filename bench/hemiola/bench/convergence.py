"""Convergence of every schedule: the same tasks, hyper-parameters and seeds,
trained to the end with each schedule, compared with ``wfbp``.

    hemiola bench convergence                            # every schedule, 2 tasks, 3 seeds, 4 ranks
    hemiola bench convergence --schedules wfbp --seeds 1 --steps 20  # a quick check
    hemiola bench convergence --tasks shapes,shapes-adamw            # the ResNet image tasks

For every task x seed x schedule it runs `--world-size` local CPU ranks
(``hemiola.launch.run_local``), each training on its own shard of every
epoch's shuffled data (:mod:`hemiola.bench.tasks`; the schedules are
:class:`~hemiola.bench.contender.Contender` names). It records rank 0's per-step loss,
evaluations spread over training, the final metrics and the time, then reports
the mean, std, min/max, median and p10-p90 over seeds per schedule and each schedule's
difference from ``wfbp``. Targets: mean final test accuracy within 0.5 points
of wfbp or better; mean final losses within 5% of wfbp's or better.

Writes OUT/<name>.jsonl (one row per run, then one per task and schedule)
and OUT/<name>_<task>.png (loss curves, when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hemiola.bench.contender import VARIANTS, Contender
from hemiola.bench.record import DEFAULT_OUT, percentiles, write_lines
from hemiola.bench.tasks import DATA_INFO, HEADLINE, TASKS, RankResult, metrics_of, train_rank
from hemiola.config import SCHEDULES
from hemiola.launch import run_local

BASELINE = "wfbp"
ACCURACY_POINTS = 0.5  # a schedule may lose at most this many accuracy points
LOSS_RELATIVE = 0.05  # and its losses may be at most this much higher


def final_train_loss(results: dict[int, RankResult]) -> float:
    """The training loss at the end: the mean over ranks of each rank's mean
    step loss over the last 10% of steps (as the optimizer saw it)."""
    means = []
    for r in results.values():
        tail = max(1, len(r.losses) // 10)
        means.append(sum(r.losses[-tail:]) / tail)
    return sum(means) / len(means)


def steps_to_target(task: str, evals: list[dict[str, float]]) -> int | None:
    """The first evaluated step at which the headline metric reached its target."""
    h = HEADLINE[task]
    for e in evals:
        value = e[h.metric]
        if (value >= h.target) if h.higher_is_better else (value <= h.target):
            return int(e["step"])
    return None


def run_one(task: str, schedule: str, seed: int, world: int, epochs: int | None,
            steps: int | None, evals: int, clip: float | None = None) -> dict[str, Any]:
    """One training run on `world` ranks; a JSON-able row."""
    start = time.perf_counter()
    results = run_local(train_rank, world, task, schedule, seed, epochs, steps, evals, clip,
                        timeout_s=3600)
    wall = time.perf_counter() - start
    r0 = results[0]
    return {
        "bench": "convergence", "row": "run", "task": task, "schedule": schedule, "seed": seed,
        "world": world, "steps": r0.steps, "clip": clip, **r0.final,
        "final_train_loss": final_train_loss(results),
        "steps_to_target": steps_to_target(task, r0.evals),
        "train_seconds": r0.train_seconds, "ms_per_step": 1e3 * r0.train_seconds / r0.steps,
        "wall_seconds": wall, "losses": r0.losses, "evals": r0.evals,
        **{f"rank0_{k}": v for k, v in r0.stats.items()},
    }


def spread(values: list[float]) -> dict[str, float | None]:
    """Mean, sample std (None for one value), min, max, median, p10 and p90."""
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), **percentiles(values)}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per task and schedule: each metric's spread over seeds and, when
    wfbp ran too, the difference from wfbp's mean and whether it meets the target."""
    rows = []
    for task, schedule in dict.fromkeys((r["task"], r["schedule"]) for r in runs):
        mine = [r for r in runs if r["task"] == task and r["schedule"] == schedule]
        base = [r for r in runs if r["task"] == task and r["schedule"] == BASELINE]
        row: dict[str, Any] = {"bench": "convergence", "row": "summary", "task": task,
                               "schedule": schedule, "seeds": [r["seed"] for r in mine],
                               "world": mine[0]["world"], "steps": mine[0]["steps"],
                               "clip": mine[0].get("clip")}
        reached = [r["steps_to_target"] for r in mine if r["steps_to_target"] is not None]
        row["steps_to_target"] = spread(reached) if reached else None
        row["target_reached"] = f"{len(reached)}/{len(mine)}"
        for key in ["ms_per_step", "wall_seconds", "rank0_approximate_read_fraction",
                    "rank0_preview_read_fraction", "rank0_preview_error"]:
            if all(key in r for r in mine):
                row[key] = spread([r[key] for r in mine])
        verdicts = []
        for metric in metrics_of(task):
            row[metric] = spread([r[metric] for r in mine])
            if not base or metric == "heldout_perplexity":
                continue
            mean, ref = row[metric]["mean"], statistics.fmean(r[metric] for r in base)
            if metric == "test_accuracy":
                diff = 100 * (mean - ref)  # points
                ok = diff >= -ACCURACY_POINTS
            else:
                diff = 100 * (mean / ref - 1)  # percent
                ok = diff <= 100 * LOSS_RELATIVE
            row[metric]["vs_wfbp"] = diff
            row[metric]["meets_target"] = ok
            verdicts.append(ok)
        row["meets_targets"] = all(verdicts) if base else None
        rows.append(row)
    return rows


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` values."""
    sums = list(itertools.accumulate(values, initial=0.0))
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window)
            for i in range(len(values))]


def plot(runs: list[dict[str, Any]], task: str, path: Path) -> Path | None:
    """Training loss (smoothed) and the headline metric over steps: the mean over
    seeds per schedule, shaded between the seeds' min and max. Returns None when
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    headline = HEADLINE[task].metric
    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    lowest, highest, window = float("inf"), 0.0, 1
    for schedule in dict.fromkeys(r["schedule"] for r in runs if r["task"] == task):
        mine = [r for r in runs if r["task"] == task and r["schedule"] == schedule]
        n = min(len(r["losses"]) for r in mine)
        window = max(1, n // 25)
        curves = [smooth(r["losses"][:n], window) for r in mine]
        steps = range(1, n + 1)
        mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
        lowest, highest = min(lowest, *mean), max(highest, *mean)
        line, = ax_loss.plot(steps, mean, label=f"{schedule} ({len(mine)} seeds)")
        ax_loss.fill_between(steps, [min(c[i] for c in curves) for i in range(n)],
                             [max(c[i] for c in curves) for i in range(n)],
                             color=line.get_color(), alpha=0.2)
        points = [r["evals"] for r in mine]
        k = min(len(p) for p in points)
        x = [points[0][i]["step"] for i in range(k)]
        values = [[p[i][headline] for p in points] for i in range(k)]
        ax_eval.plot(x, [statistics.fmean(v) for v in values], marker="o", ms=3,
                     color=line.get_color(), label=schedule)
        ax_eval.fill_between(x, [min(v) for v in values], [max(v) for v in values],
                             color=line.get_color(), alpha=0.2)
    ax_loss.set(xlabel="step", ylabel=f"training loss, rank 0 (moving average of {window})",
                title=f"{task}: training loss")
    if highest / max(1e-12, lowest) > 20:
        ax_loss.set_yscale("log")
    ax_eval.set(xlabel="step", ylabel=headline, title=f"{task}: {headline} (held out)")
    if HEADLINE[task].higher_is_better:
        ax_eval.set_ylim(max(0.0, HEADLINE[task].target - 0.1), 1.0)
    else:
        ax_eval.set_ylim(None, HEADLINE[task].target * 1.5)
    for ax in (ax_loss, ax_eval):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def fmt(s: dict[str, Any] | None, scale: float = 1.0, digits: int = 3) -> str:
    """'mean ± std [min, max]' of a spread."""
    if s is None:
        return "-"
    std = "" if s["std"] is None else f" ± {scale * s['std']:.{digits}f}"
    return (f"{scale * s['mean']:.{digits}f}{std} "
            f"[{scale * s['min']:.{digits}f}, {scale * s['max']:.{digits}f}]")


def print_table(summaries: list[dict[str, Any]]) -> None:
    """A readable table: mean ± std [min, max] and the difference from wfbp."""
    for row in summaries:
        print(f"\n{row['task']} / {row['schedule']}: {len(row['seeds'])} seeds, "
              f"{row['world']} ranks, {row['steps']} steps, "
              f"{fmt(row['ms_per_step'], digits=1)} ms/step, "
              f"target reached {row['target_reached']} "
              f"(at step {fmt(row['steps_to_target'], digits=0)})")
        if "rank0_approximate_read_fraction" in row:
            print("  forward reads of approximate values (rank 0): "
                  f"{fmt(row['rank0_approximate_read_fraction'], 100, 1)}%")
        if "rank0_preview_error" in row:
            print("  the preview's relative distance from the average (rank 0): "
                  f"{fmt(row['rank0_preview_error'], digits=3)}")
        for metric in metrics_of(row["task"]):
            s = row[metric]
            scale, unit, digits = (100, "%", 2) if metric == "test_accuracy" else (1, "", 4)
            verdict = ""
            if "vs_wfbp" in s:
                what = "points" if metric == "test_accuracy" else "%"
                verdict = (f"  vs wfbp {s['vs_wfbp']:+.2f} {what} "
                           f"({'meets' if s['meets_target'] else 'MISSES'} target)")
            print(f"  {metric:20s} {fmt(s, scale, digits)}{unit}{verdict}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", default="digits,lm",
                        help=f"comma-separated, of {', '.join(TASKS)} (default digits,lm)")
    parser.add_argument("--schedules", default=",".join([*SCHEDULES, *VARIANTS]),
                        help="comma-separated (default: all of "
                             f"{', '.join([*SCHEDULES, *VARIANTS])}); SCHEDULE+COMPRESSION "
                             "trains with that compression, e.g. wfbp+int8; ddp and "
                             "ddp+COMPRESSION train torch DDP with the matching hook")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="start the seeds here (--first-seed 3 --seeds 3: seeds 3, 4, 5)")
    parser.add_argument("--world-size", type=int, default=4, help="local ranks (default 4)")
    parser.add_argument("--epochs", type=int, help="override every task's number of epochs")
    parser.add_argument("--steps", type=int, help="override every task's number of steps")
    parser.add_argument("--clip", type=float,
                        help="clip the gradients' global 2-norm to this (default: no clipping)")
    parser.add_argument("--evals", type=int, default=10,
                        help="evaluations spread over training (default 10)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--name", default="convergence",
                        help="results go to OUT/NAME.jsonl and OUT/NAME_<task>.png")


def run(args: argparse.Namespace) -> int:
    tasks = args.tasks.split(",")
    schedules = args.schedules.split(",")
    for t in tasks:
        if t not in TASKS:
            raise SystemExit(f"unknown task {t!r}; available: {', '.join(TASKS)}")
    for s in schedules:
        try:
            Contender.parse(s)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if BASELINE not in schedules:
        print(f"note: {BASELINE} is not in --schedules, so there is no comparison with it")

    # Seeds outermost within a task, schedules innermost: a drift in machine
    # load touches every schedule alike.
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    plan = [(t, seed, s) for t in tasks for seed in seeds for s in schedules]
    runs = []
    bar = tqdm(plan, desc="convergence", unit="run")
    for task, seed, schedule in bar:
        bar.set_postfix(task=task, schedule=schedule, seed=seed)
        runs.append(run_one(task, schedule, seed, args.world_size, args.epochs, args.steps,
                            args.evals, args.clip))
    bar.close()

    summaries = summarize(runs)
    setup = []
    for t in tasks:
        fields = dataclasses.fields(TASKS[t])  # type: ignore[arg-type]
        hyper = {f.name: getattr(TASKS[t], f.name) for f in fields if f.repr}
        setup.append({"bench": "convergence", "row": "task", "task": t, **hyper,
                      "epochs_override": args.epochs, "steps_override": args.steps,
                      "clip": args.clip,
                      **(DATA_INFO[t]() if t in DATA_INFO else {})})
    print_table(summaries)
    for row in setup + runs + summaries:
        row["suite"] = "convergence"
    print(f"\nwrote {write_lines(args.out / f'{args.name}.jsonl', setup + runs + summaries)}")
    for t in tasks:
        picture = plot(runs, t, args.out / f"{args.name}_{t}.png")
        if picture is not None:
            print(f"wrote {picture}")
    return 0

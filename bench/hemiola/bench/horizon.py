"""Low-communication training at a horizon that counts: per replica count and
seed, the same three runs of ``hemiola bench streaming``, then each contender
against DDP and against one replica alone, with 95% intervals over the seeds.

    hemiola bench horizon                                     # code task, 3000 steps, 2 replicas
    hemiola bench horizon --replicas 2,4,8 --seeds 5          # the whole study (CPU-days)
    hemiola bench horizon --rate none --task lm --steps 8 --eval-every 4   # a quick check

Per replica count K and seed, in this order:

1. **DDP on loopback** for ``--steps`` (its held-out loss at equal inner
   steps; the link changes DDP's time, not its arithmetic). Its final loss is
   the run's target, fixed before step 3 starts.
2. **DDP's time at ``--rate``**: ``--ddp-timing-steps`` steps of DDP and the
   bare model in the shaped link (a 10M model's all-reduce takes seconds a
   step at 100 Mbit/s: the whole run there would take hours).
3. **The contenders at ``--rate``** (``--contenders``, ``hemiola bench
   streaming``'s names), trained side by side in alternating blocks of
   ``--eval-every`` steps, every evaluation on the same ``--eval-windows``
   held-out windows.

Each run's rows are kept (suite ``streaming``, with ``phase``); the summary
rows (suite ``horizon``), per K and contender, give over the seeds the mean
and 95% t-interval of: the final held-out loss; its ratio to DDP's on the
same seed, minus 1 (paired); its difference from one replica alone's (the
bare model, rank 0 alone on its shard, same seed: paired); the time per
step, the slowest rank's; the seconds to the target; and the held-out loss
at equal wall-clock: at the budget B, the shortest total training time among
the contenders of step 3, each contender's loss at its last evaluation
within B (DDP's at the last of its loopback evaluations whose step, at its
measured time per step at the rate, fits in B). The time to the target is
averaged over the seeds that reached it (the table says how many did).
Writes OUT/NAME.jsonl (the runs after each, the summary at the end); a
``bench-report`` block with the filter ``suite=horizon`` renders the summary.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hemiola.bench.record import DEFAULT_OUT, read_lines, write_lines

#: fixed before any run: the library's defaults (H 100, fragments and overlap
#: chosen, averaging, the mix); at H 20 hemiola's chosen shape with int8,
#: and hemiola and torchft each with 4 fragments, tau 2, mix 0.5, averaging, float32
DEFAULT_CONTENDERS = ("compute,streaming-h100-auto@lr1m0,streaming-h20-auto+int8@lr1m0,"
                      "streaming-h20-f4t2@lr1m0~mix0.5,torchft-h20-f4t2@lr1m0~mix0.5")


def interval(values: list[float]) -> tuple[float, float | None]:
    """The mean of `values` and the half-width of its 95% t-interval (None for
    fewer than two values)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, None
    from scipy.stats import t

    return m, float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(
        len(values))


def loss_within(evals: list[dict[str, Any]], budget: float) -> float:
    """The held-out loss at the last evaluation whose time fits `budget`."""
    return [e for e in evals if e["seconds"] <= budget + 1e-9][-1]["heldout_loss"]


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``horizon`` rows of the runs in `rows` (module docstring)."""
    out = []
    rows = [r for r in rows if r.get("row") == "run"]  # (not a skipped contender's line)
    for world in sorted({r["world"] for r in rows if r["phase"] == "main"}):
        mine = [r for r in rows if r["world"] == world]
        seeds = sorted({r["seed"] for r in mine if r["phase"] == "main"})
        ddp = {r["seed"]: r for r in mine if r["phase"] == "quality"}
        ddp_ms = {r["seed"]: r["ms_per_step"] for r in mine
                  if r["phase"] == "ddp-timing" and r["kind"] == "ddp"}
        main = [r for r in mine if r["phase"] == "main"]
        bare = {r["seed"]: r for r in main if r["kind"] == "compute"}
        budget = {s: min(r["evals"][-1]["seconds"] for r in main if r["seed"] == s)
                  for s in seeds}
        names = list(dict.fromkeys(r["contender"] for r in main)) + ["ddp"]
        for name in names:
            runs = {r["seed"]: r for r in main if r["contender"] == name}
            if name == "ddp":
                runs = {s: {**ddp[s], "ms_per_step": ddp_ms[s]} for s in seeds}
            final = [runs[s]["heldout_loss"] for s in seeds]
            if name == "ddp":
                at_budget = [loss_within([{**e, "seconds": e["step"] * ddp_ms[s] / 1e3}
                                          for e in runs[s]["evals"]], budget[s]) for s in seeds]
            else:
                at_budget = [loss_within(runs[s]["evals"], budget[s]) for s in seeds]
            reached = [runs[s]["seconds_to_target"] for s in seeds]
            if name == "ddp":
                target = {s: runs[s]["heldout_loss"] for s in seeds}
                reached = [next(e["step"] for e in runs[s]["evals"]
                                if e["heldout_loss"] <= target[s]) * ddp_ms[s] / 1e3
                           for s in seeds]
            first = runs[seeds[0]]
            out.append({
                "suite": "horizon", "row": "summary", "task": first["task"],
                "rate": main[0]["rate"], "world": world, "seeds": seeds,
                "steps": first["steps"], "params": first["params"],
                "tokens_per_rank_step": first["tokens_per_rank_step"],
                "eval_every": first["eval_every"], "eval_windows": first["eval_windows"],
                "contender": name, "label": first["label"],
                "heldout_loss": interval(final),
                "vs_ddp": interval([f / ddp[s]["heldout_loss"] - 1 for f, s in zip(final, seeds)]),
                "vs_one_replica": interval([f - bare[s]["heldout_loss"]
                                            for f, s in zip(final, seeds)]),
                "ms_per_step": interval([runs[s]["ms_per_step"] for s in seeds]),
                "budget_s": interval([budget[s] for s in seeds]),
                "loss_at_budget": interval(at_budget),
                "at_budget_vs_one_replica": interval([a - loss_within(bare[s]["evals"], budget[s])
                                                      for a, s in zip(at_budget, seeds)]),
                "target_loss": [ddp[s]["heldout_loss"] for s in seeds],
                "seconds_to_target": (interval([v for v in reached if v is not None])
                                      if any(v is not None for v in reached) else None),
                "reached": sum(v is not None for v in reached),
                **{k: first[k] for k in ("date", "commit", "torch", "cpu", "cpus") if k in first}})
    return out


def streaming(args: argparse.Namespace, out: Path, name: str, world: int, seed: int, rate: str,
              contenders: str, steps: int, target: float | None = None) -> list[dict[str, Any]]:
    """One ``hemiola bench streaming`` run (its own processes), its rows."""
    command = [sys.executable, "-m", "hemiola", "bench", "streaming", "--task", args.task,
               "--rates", rate, "--steps", str(steps), "--eval-every", str(args.eval_every),
               "--eval-windows", str(args.eval_windows), "--seeds", "1", "--first-seed",
               str(seed), "--world-size", str(world), "--contenders", contenders,
               "--port", str(args.port), "--timeout-s", str(args.timeout_s), "--out", str(out),
               "--name", name]
    if target is not None:
        command += ["--target", repr(target)]
    if not any(c.startswith("torchft") for c in contenders.split(",")):
        command.append("--no-torchft")
    print("$ " + " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True)
    return read_lines(out / f"{name}.jsonl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="code",
                        help="a convergence task (default code: 10.8M parameters)")
    parser.add_argument("--replicas", default="2",
                        help="replica counts, comma-separated (default 2; the study: 2,4,8)")
    parser.add_argument("--rate", default="100mbit",
                        help="the link's tc rate (default 100mbit; root); none: loopback")
    parser.add_argument("--steps", type=int, default=3000, help="inner steps (default 3000)")
    parser.add_argument("--eval-every", type=int, default=250,
                        help="steps between evaluations (default 250)")
    parser.add_argument("--eval-windows", type=int, default=256,
                        help="held-out windows per evaluation (default 256)")
    parser.add_argument("--ddp-timing-steps", type=int, default=20,
                        help="DDP's steps at --rate for its time per step (default 20)")
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds (default 1)")
    parser.add_argument("--first-seed", type=int, default=10,
                        help="the first seed (default 10: no option was chosen on it)")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS,
                        help=f"hemiola bench streaming's names (default {DEFAULT_CONTENDERS})")
    parser.add_argument("--timeout-s", type=float, default=6 * 3600.0,
                        help="per run (default 6 h: 3000 steps of five contenders of the code "
                             "task take about 70 minutes at 2 replicas on 2 cores)")
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--name", default="horizon", help="results go to OUT/NAME.jsonl")


def run(args: argparse.Namespace) -> int:
    if "compute" not in args.contenders.split(","):
        raise SystemExit("--contenders must include compute (one replica alone)")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(k) for k in args.replicas.split(",")):
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                tag = f"k{world}-s{seed}"
                quality = streaming(args, Path(tmp), f"quality-{tag}", world, seed, "none",
                                    "ddp", args.steps)
                timing = streaming(args, Path(tmp), f"timing-{tag}", world, seed, args.rate,
                                   "compute,ddp", args.ddp_timing_steps)
                main = streaming(args, Path(tmp), f"main-{tag}", world, seed, args.rate,
                                 args.contenders, args.steps,
                                 target=next(r["heldout_loss"] for r in quality
                                             if r.get("kind") == "ddp"))
                for phase, part in (("quality", quality), ("ddp-timing", timing),
                                    ("main", main)):
                    rows += [{**r, "phase": phase} for r in part]
                # every finished run kept, whatever happens to the next
                write_lines(args.out / f"{args.name}.jsonl", rows)
    summary = summarise(rows)
    from hemiola.bench.report import horizon_table

    print("\n" + horizon_table(summary))
    print(f"\nwrote {write_lines(args.out / f'{args.name}.jsonl', rows + summary)}")
    return 0

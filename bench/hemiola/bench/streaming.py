"""Low-communication training side by side: the bare model, torch DDP, hemiola's
best per-step configuration, torchft's DiLoCo and hemiola ``streaming``, on the
same task, link, seeds, batches and initial parameters.

    hemiola bench streaming                                   # 100 Mbit/s and 1 Gbit/s, 300 steps
    hemiola bench streaming --rates none --steps 20 --hs 10   # loopback, a quick check
    hemiola bench streaming --contenders compute,ddp,streaming-h20-f2t1+int8,torchft-h20

For each rate the ranks run in network namespaces joined by ``tc tbf``-limited
veth pairs (:mod:`hemiola.bench.netlab`, root; ``none``: loopback). Each rank
trains every contender (:mod:`hemiola.bench.streaming_rank` names them) in
alternating blocks of ``--eval-every`` steps with a barrier before each block,
so a drift in machine load touches every contender alike, and rank 0
evaluates each after every block. Per contender and seed it records:

- ``ms_per_step``: training wall time per step of the slowest rank (a job
  goes at its pace; evaluations excluded; a block ends by landing what is
  still on the wire), and ``ms_per_step_ranks``: every rank's;
- ``compute_utilisation``: the bare model's ms per step / this one's (both
  the slowest rank's: the bare model's time is what the job's computation
  alone takes);
- ``bytes_per_token``: what one rank sends per token it trains, by the formula
  2 (N-1)/N * P * b / (H * tokens per rank per step) (P parameters, b bytes
  per element of the coding: 4, 2, 1 + 4/256 for int8 or 1/2 + 4/256 for
  int4, plus 1 for
  decoupled's preview codes under Adam(W); H = 1 per step),
  and ``bytes_per_token_measured``: the bytes the rank's veth sent during the
  contender's blocks (netlab only), per token;
- ``heldout_loss`` after each block (equal tokens across contenders at equal
  steps), and ``seconds_to_target``: the slowest rank's training wall time
  at the first evaluation at or below the target loss (``--target``; by default the
  highest final held-out loss among the communicating contenders, so each
  reaches it).

The bare model trains each rank alone on its own shard: its loss is at half
the tokens per model with 2 ranks (the table marks it). Writes OUT/NAME.jsonl;
``hemiola bench report`` renders its table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hemiola.bench.record import DEFAULT_OUT, percentiles, write_lines

#: hemiola's per-step contender: decoupled + int8 was the fastest per-step
#: configuration over a 1 Gbit/s link (docs/benchmarks.md, speed table)
PER_STEP = "decoupled+int8"
DEFAULT_HS = "10,20,50"


def default_contenders(hs: list[int]) -> list[str]:
    """The bare model, DDP, PER_STEP, then per H: torchft's DiLoCo and hemiola
    streaming blocking and with 2 fragments and tau 1, each without and with int8."""
    names = ["compute", "ddp", PER_STEP]
    for h in hs:
        names += [f"torchft-h{h}", f"streaming-h{h}", f"streaming-h{h}+int8",
                  f"streaming-h{h}-f2t1", f"streaming-h{h}-f2t1+int8"]
    return names


def torchft_missing() -> str | None:
    """None when torchft can be imported here, else why not."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install torchft)"
    try:
        import torchft.local_sgd  # noqa: F401
    except Exception as e:  # a broken install: any import error is the reason
        return f"import torchft.local_sgd failed: {type(e).__name__}: {e}"
    return None


def run_with_progress(net: Any, command: list[str], port: int, timeout_s: float,
                      progress: Path, total: int, desc: str) -> list[str]:
    """``net.run_ranks`` in a thread while a tqdm bar follows the steps rank 0
    writes to `progress`."""
    from tqdm import tqdm

    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["out"] = net.run_ranks(command, port, timeout_s)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    with tqdm(total=total, desc=desc, unit="step") as bar:
        while thread.is_alive():
            thread.join(1.0)
            try:
                bar.update(int(progress.read_text() or 0) - bar.n)
            except (OSError, ValueError):
                pass
    if "error" in result:
        raise result["error"]
    return list(result["out"])


def ranks_ms(run: dict[str, Any]) -> list[float]:
    """A contender's ms per step on each rank (the job's: the largest)."""
    return [1e3 * s / len(run["step_ms"]) for s in run["seconds_ranks"]]


def rows_of(result: dict[str, Any], config: dict[str, Any], rate: str, world: int,
            target: float | None) -> list[dict[str, Any]]:
    """One row per contender of one run (a rate and a seed)."""
    from hemiola.bench.streaming_rank import bytes_per_token, parse

    runs, params, tps = result["runs"], result["params"], result["tokens_per_step"]
    bare = runs.get("compute")
    bare_ms = max(ranks_ms(bare)) if bare else None
    finals = {n: r["evals"][-1]["heldout_loss"] for n, r in runs.items()}
    if target is None:
        talking = [v for n, v in finals.items() if n != "compute"]
        target = max(talking) if talking else None
    rows = []
    for name, r in runs.items():
        spec = parse(name)
        steps = len(r["step_ms"])
        per_rank = ranks_ms(r)
        ms = max(per_rank)
        reached = next((e for e in r["evals"] if target is not None
                        and e["heldout_loss"] <= target), None)
        tx = r["tx_bytes"]
        rows.append({
            "suite": "streaming", "row": "run", "task": config["task"], "rate": rate,
            "seed": config["seed"], "world": world, "steps": steps, "contender": name,
            "label": spec.label, "kind": spec.kind, "h": spec.h, "fragments": spec.fragments,
            "overlap": spec.overlap, "coding": spec.coding, "outer_lr": spec.outer_lr,
            "outer_momentum": spec.outer_momentum, "params": params,
            "tokens_per_rank_step": tps,
            "tokens_per_model": steps * tps * (1 if spec.kind == "compute" else world),
            "ms_per_step": ms, "step_ms": percentiles(r["step_ms"]),
            "ms_per_step_ranks": per_rank,
            "compute_utilisation": bare_ms / ms if bare_ms else None,
            "bytes_per_token": bytes_per_token(spec, params, world, tps, result["optimizer"]),
            "inner_optimizer": result["optimizer"],
            "bytes_per_token_measured": tx / (steps * tps) if tx is not None else None,
            "heldout_loss": finals[name], "evals": r["evals"],
            "final_train_loss": statistics.fmean(r["losses"][-max(1, steps // 10):]),
            "target_loss": target,
            "seconds_to_target": reached["seconds"] if reached else None,
            "steps_to_target": reached["step"] if reached else None,
            "eval_every": config["eval_every"], "eval_windows": config["eval_windows"],
            **{f"rank0_{k}": v for k, v in r["stats"].items()}})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """Per rate and seed: each contender's metrics."""
    for rate, seed in dict.fromkeys((r["rate"], r["seed"]) for r in rows if r["row"] == "run"):
        mine = [r for r in rows if r["row"] == "run" and (r["rate"], r["seed"]) == (rate, seed)]
        print(f"\n{mine[0]['task']} at {rate}, seed {seed}, {mine[0]['steps']} steps, "
              f"target held-out loss {mine[0]['target_loss']:.4f}:")
        print(f"  {'contender':46s} {'ms/step':>8s} {'util':>5s} {'B/token':>8s} "
              f"{'measured':>8s} {'held-out':>8s} {'s to target':>11s}")
        for r in mine:
            util = r["compute_utilisation"]
            meas = r["bytes_per_token_measured"]
            reach = r["seconds_to_target"]
            print(f"  {r['label']:46s} {r['ms_per_step']:8.1f} "
                  f"{'' if util is None else f'{util:.2f}':>5s} {r['bytes_per_token']:8.1f} "
                  f"{'' if meas is None else f'{meas:.1f}':>8s} {r['heldout_loss']:8.4f} "
                  f"{'-' if reach is None else f'{reach:.1f}':>11s}")
    for r in rows:
        if r["row"] == "skipped":
            print(f"\nskipped {r['contender']}: {r['reason']}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="100mbit,1gbit",
                        help="tc rates, comma-separated (default 100mbit,1gbit; needs root); "
                             "'none' runs on loopback without a limit")
    parser.add_argument("--task", default="lm", help="a convergence task (default lm: ByteLM)")
    parser.add_argument("--hs", default=DEFAULT_HS,
                        help=f"the H (sync_every) values of the default contenders "
                             f"(default {DEFAULT_HS})")
    parser.add_argument("--contenders",
                        help="comma-separated, instead of the default set: compute, ddp, a "
                             "per-step hemiola contender (decoupled+int8), "
                             "streaming-hH[-fFtT|-auto][+CODING][@lrLmM][~mixA], "
                             "torchft-hH[-fFtT][@lrLmM][~mixA] (@lrLmM: outer lr L, "
                             "momentum M; ~mixA: the merge's alpha)")
    parser.add_argument("--steps", type=int, default=300, help="inner steps (default 300)")
    parser.add_argument("--eval-every", type=int, default=50,
                        help="steps per block; rank 0 evaluates after each (default 50)")
    parser.add_argument("--eval-windows", type=int, default=256,
                        help="held-out windows per evaluation (default 256)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="how many seeds, from --first-seed (default 1)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the first seed (default 0): tune on some seeds, report on others")
    parser.add_argument("--target", type=float,
                        help="target held-out loss (default: the highest final held-out loss "
                             "among the communicating contenders)")
    parser.add_argument("--no-torchft", action="store_true", help="leave torchft out")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per rate and seed")
    parser.add_argument("--port", type=int, default=29600, help="base port of the ranks")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--name", default="streaming", help="results go to OUT/NAME.jsonl")


def run(args: argparse.Namespace) -> int:
    from hemiola.bench.netlab import Loopback, Network, parse_result
    from hemiola.bench.streaming_rank import parse
    from hemiola.bench.tasks import TASKS

    if args.task not in TASKS:
        raise SystemExit(f"unknown task {args.task!r}; available: {', '.join(TASKS)}")
    hs = [int(h) for h in args.hs.split(",") if h]
    names = (args.contenders.split(",") if args.contenders else default_contenders(hs))
    try:
        specs = [parse(n) for n in names if n]
    except ValueError as e:
        raise SystemExit(f"--contenders: {e}") from None
    if args.eval_every < 1 or args.steps < 1:
        raise SystemExit("--steps and --eval-every must be at least 1")
    rows: list[dict[str, Any]] = []
    missing = "left out (--no-torchft)" if args.no_torchft else torchft_missing()
    if missing and any(s.kind == "torchft" for s in specs):
        for s in specs:
            if s.kind == "torchft":
                rows.append({"suite": "streaming", "row": "skipped", "contender": s.name,
                             "label": s.label, "reason": missing})
        specs = [s for s in specs if s.kind != "torchft"]
        print(f"torchft's DiLoCo skipped: {missing}")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates.split(","):
            net = Loopback(args.world_size) if rate == "none" else Network(args.world_size, rate)
            with net:
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    progress = Path(tmp) / f"progress-{rate}-{seed}"
                    config = {"task": args.task, "seed": seed, "steps": args.steps,
                              "eval_every": args.eval_every,
                              "eval_windows": args.eval_windows,
                              "contenders": [s.name for s in specs],
                              "progress": str(progress)}
                    out = run_with_progress(
                        net, [sys.executable, "-m", "hemiola.bench.streaming", "--worker",
                              json.dumps(config)],
                        args.port + 100 * seed, args.timeout_s, progress, args.steps,
                        f"{rate} seed {seed}: {len(specs)} contenders")
                    rows += rows_of(parse_result(out[0]), config, rate, args.world_size,
                                    args.target)
    print_table(rows)
    print(f"\nwrote {write_lines(args.out / f'{args.name}.jsonl', rows)}")
    return 0


def main_worker(config: dict[str, Any]) -> None:
    """A rank's entry point: trains, reports its result, shuts torch's group down."""
    import torch.distributed as dist

    from hemiola.bench.netlab import print_result
    from hemiola.bench.streaming_rank import worker

    started = time.perf_counter()
    result = worker(config)
    result["worker_seconds"] = time.perf_counter() - started
    print_result(result)
    dist.destroy_process_group()  # torch's Gloo thread must not outlive the interpreter


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        main_worker(json.loads(sys.argv[2]))
    else:
        sys.exit("run `hemiola bench streaming` (this module's entry point is for its ranks)")

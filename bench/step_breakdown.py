"""Where a training step's time goes, per schedule, over a real rate-limited
network: the convergence task's model and optimizer, its ranks in network
namespaces joined by ``tc tbf`` links (hemiola.bench.netlab), the engine's
timeline on, and the compute alone (the bare model, one process per core,
both at once) measured first for the bound.

    python bench/step_breakdown.py                      # lm, wfbp and decoupled, 1 Gbit/s
    python bench/step_breakdown.py --task digits --schedules wfbp,priority,decoupled

Needs root. Each rank trains `--steps` steps on its shard; the last
`--window` are summed from rank 0's timeline, per lane and kind, in ms per
step: ``compute forward`` (the whole pass, waits for landings inside it
included), ``compute wait`` (the schedule waiting for reductions or previews),
``comm allreduce`` (the full reductions), ``preview preview`` (decoupled's
preview lane) and so on. Writes rank 0's trace to
bench/results/step_breakdown_<task>_<schedule>.json (draw it with
bench/plot_timeline.py) and the rows to bench/results/step_breakdown.jsonl.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from hemiola.bench.netlab import Network, parse_result, print_result
from hemiola.bench.record import DEFAULT_OUT, write_lines


def _task(name: str) -> Any:
    from hemiola.bench.tasks import TASKS

    return TASKS[name]()


def compute_alone(task_name: str, steps: int) -> dict[str, Any]:
    """The bare model (no wrapper, one thread): median ms per step."""
    import torch

    torch.set_num_threads(1)
    task = _task(task_name)
    torch.manual_seed(0)
    model = task.model()
    optimizer = task.optimizer(model)
    x_all, y_all = task.epoch_samples(0, 0)
    times = []
    for i in range(steps):
        idx = torch.arange(i * task.batch_size, (i + 1) * task.batch_size) % len(x_all)
        start = time.perf_counter()
        optimizer.zero_grad()
        task.loss(model, x_all[idx], y_all[idx]).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return {"ms": 1e3 * statistics.median(times[5:])}


def rank_main(config: dict[str, Any]) -> dict[str, Any]:
    """One rank (RANK, WORLD_SIZE, MASTER_*, GLOO_SOCKET_IFNAME set by netlab)."""
    import torch

    import hemiola
    from hemiola.bench.contender import Contender

    torch.set_num_threads(1)
    hemiola.init()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    task = _task(config["task"])
    torch.manual_seed(0)
    model = task.model()
    name, options = Contender.parse(config["schedule"]).wrap_arguments()
    model, optimizer = hemiola.wrap(model, task.optimizer(model), schedule=name, timeline=True,
                                    **options)
    x_all, y_all = task.epoch_samples(0, 0)
    mine = torch.arange(rank, len(x_all), world)
    times = []
    for i in range(config["steps"]):
        idx = mine[torch.arange(i * task.batch_size, (i + 1) * task.batch_size) % len(mine)]
        start = time.perf_counter()
        optimizer.zero_grad()
        task.loss(model, x_all[idx], y_all[idx]).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    window = times[-config["window"]:]
    trace = model.timeline()
    result: dict[str, Any] = {"ms": 1e3 * statistics.median(window)}
    if rank == 0:
        result["per_step"] = breakdown(json.loads(trace), sum(window), len(window))
        DEFAULT_OUT.mkdir(parents=True, exist_ok=True)
        path = DEFAULT_OUT / f"step_breakdown_{config['task']}_{config['schedule']}.json"
        path.write_text(trace)
        result["trace"] = str(path)
    model.synchronize()
    return result


def breakdown(trace: dict[str, Any], seconds: float, steps: int) -> dict[str, float]:
    """ms per step by lane and kind over the trace's last `seconds` (`steps`
    steps). Per-module forward spans are left out: the whole pass holds them."""
    events = trace["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"
             and not (e["cat"] == "forward" and e["name"].startswith("forward "))]
    end = max(e["ts"] + e["dur"] for e in spans)
    start = end - seconds * 1e6
    total: collections.Counter[str] = collections.Counter()
    for e in spans:
        if e["ts"] >= start:
            total[f"{lanes.get(e['tid'], e['tid'])} {e['cat']}"] += e["dur"] / 1e3 / steps
    return {k: round(v, 2) for k, v in sorted(total.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="lm")
    parser.add_argument("--schedules", default="wfbp,decoupled")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--window", type=int, default=50, help="the last N steps are summed")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--alone", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        print_result(rank_main(json.loads(args.rank)))
        return
    if args.alone is not None:
        print_result(compute_alone(args.alone, 40))
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts the store

    # Compute alone: one bare process per rank, all at once, as the ranks share the cores.
    procs = [subprocess.Popen([sys.executable, __file__, "--alone", args.task],
                              stdout=subprocess.PIPE, text=True)
             for _ in range(args.world_size)]
    alone = statistics.fmean(parse_result(p.communicate()[0])["ms"] for p in procs)
    print(f"{args.task}: compute alone {alone:.1f} ms per step ({args.world_size} bare "
          "processes at once)")
    rows = []
    with Network(args.world_size, args.rate) as net:
        for k, schedule in enumerate(args.schedules.split(",")):
            config = {"task": args.task, "schedule": schedule, "steps": args.steps,
                      "window": args.window}
            outputs = net.run_ranks([sys.executable, __file__, "--rank", json.dumps(config)],
                                    29800 + k, args.timeout_s)
            result = parse_result(outputs[0])
            rows.append({"task": args.task, "schedule": schedule, "rate": args.rate,
                         "world": args.world_size, "compute_alone_ms": alone, **result})
            print(f"{schedule:>10}: {result['ms']:.1f} ms per step "
                  f"({result['ms'] / alone:.2f}x compute alone); rank 0, ms per step:")
            for key, ms in result["per_step"].items():
                print(f"{'':>12}{key:<24} {ms:7.2f}")
            print(f"{'':>12}trace: {result['trace']}")
    path = write_lines(DEFAULT_OUT / "step_breakdown.jsonl", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Parameter server with a straggler: every consistency model against
all-reduce, on a real task, per iteration and to a target accuracy.

    hemiola bench ps                        # 1x, 2x, 4x straggler, every scheme
    hemiola bench ps --slowdowns 4 --schemes bsp eager --iterations 100
    hemiola bench ps --workers 2 4 --lr 0.05 --seeds 3   # the stability check

Task: ``hemiola.demo.DigitsCNN`` (or a 64-96-48-10 MLP: ``--model mlp``; a
64-512-512-10 one: ``--model wide-mlp``) on
scikit-learn's digits (:mod:`hemiola.bench.tasks`' ``digits``: SGD, lr 0.02
(``--lr``), momentum 0.9 (``--momentum``), weight decay 5e-4, 16 samples per
worker and iteration). `--workers` workers (4 by
default); the parameter-server schemes (``bsp``, ``asp``, ``ssp`` with s=2,
``eager``) add `--servers` server processes; the all-reduce schedules
(``wfbp``, ``decoupled``) use hemiola.wrap on the workers alone. The last
worker is the straggler: after each of its iterations it sleeps (k-1) x T,
where T is the time per iteration of ``bsp`` without a straggler, measured
first in the same invocation; so a k-times straggler needs k times a normal
iteration (a sleep, so it takes no CPU from the others on this small machine;
slowing it by its own measured time would not do, as on 2 cores most of an
iteration is waiting for the CPU, not computing).

An *iteration* is one mini-batch per worker: one synchronous step. For the
asynchronous schemes, iterations = applied pushes / workers, read from the
version of the parameters worker 0 receives. Every scheme runs until
`--iterations` iterations; worker 0 evaluates test accuracy every 5 of its
own iterations (evaluation time is excluded from its clock). Reported per
run: time per iteration, iterations and wall time to reach `--target` test
accuracy (first evaluation at or above it), final accuracy and staleness;
over seeds, the mean and [min, max].

Targets (issues 5, 14 and 29): with a 4x straggler, ``eager`` time per
iteration <= 0.3 x ``bsp``; ``eager`` reaches the target in <= 0.7 x the
iterations of the ``asp`` users run today (no staleness rule, torch's
momentum: ``asp:none/none``) and in the fewest seconds of all schemes, with
final accuracy within 0.5 points of ``bsp``; at lr 0.05 with 2 and 4 workers,
``eager``'s final accuracy >= ``bsp``'s - 1 point.

With ``--rate`` (e.g. ``1gbit``; needs root) every rank runs in its own
network namespace behind a ``tc tbf`` link of that rate
(:mod:`hemiola.bench.netlab`), a fresh interpreter each: with ``--model
wide-mlp`` (1.2 MB of gradients) the link, not the computation, sets the pace.
Without it the ranks run on loopback (:func:`hemiola.launch.run_local`).

Writes OUT/<--name>.jsonl (one row per run, then one per workers, slowdown and
scheme with the median and p10-p90 over seeds) and OUT/<--name>[_<workers>w].png
(when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

import hemiola
import hemiola.ps
from hemiola.bench.netlab import Network, parse_result, rank_main
from hemiola.bench.record import DEFAULT_OUT, percentiles, split_ahead, write_lines
from hemiola.bench.tasks import DIGITS_ARCHITECTURES, DigitsTask
from hemiola.launch import run_local
from hemiola.ps.roles import JOB_TOKEN_ENV

PS_SCHEMES = ("bsp", "asp", "ssp", "eager")
#: eager without the local correction of the worker's own push (PSConfig.local_correction)
UNCORRECTED = "eager-uncorrected"
ALLREDUCE = ("wfbp", "decoupled")
EVAL_EVERY = 5


class Scheme(NamedTuple):
    """A --schemes entry: CONSISTENCY[:STALENESS_RULE][/MOMENTUM_RULE][@AHEAD],
    e.g. "eager:none", "eager-uncorrected", "asp/compensated", "eager@0.25"."""

    consistency: str  # or an all-reduce schedule
    rule: str  # staleness rule, "" for the default
    corrected: bool  # PSConfig.local_correction
    momentum_rule: str  # PSConfig.momentum_rule, "" for the default
    ahead: float | None  # PSConfig.ahead_fraction (None: learned)


def parse_scheme(scheme: str) -> Scheme:
    """Splits a --schemes entry into its parts."""
    name, ahead = split_ahead(scheme)
    name, _, momentum_rule = name.partition("/")
    consistency, _, rule = name.partition(":")
    corrected = consistency != UNCORRECTED
    return Scheme("eager" if not corrected else consistency, rule, corrected, momentum_rule,
                  ahead)


def run_rank(rank: int, world: int, scheme: str, servers: int, workers: int, delay_s: float,
             iterations: int, seed: int, lr: float, momentum: float,
             architecture: str = "cnn") -> dict[str, Any] | None:
    """One rank of one run (called by run_local)."""
    task = DigitsTask(lr=lr, momentum=momentum, architecture=architecture)
    consistency, rule, corrected, momentum_rule, ahead = parse_scheme(scheme)
    is_ps = consistency in PS_SCHEMES
    if is_ps:
        named = {"momentum_rule": momentum_rule} if momentum_rule else {}  # else the default
        config = hemiola.ps.PSConfig(consistency=consistency, num_servers=servers,
                                     staleness_rule=rule or None, staleness_bound=2,
                                     timeout_s=120, local_correction=corrected,
                                     ahead_fraction=ahead, **named)
        r = hemiola.ps.role(servers)
        if r.is_server:
            hemiola.ps.serve(config, r)
            return None
        worker = r.worker_index
    else:
        hemiola.init()
        worker = rank
    torch.manual_seed(seed)
    model = task.model()
    optimizer = task.optimizer(model)
    if is_ps:
        wrapped, optimizer = hemiola.ps.wrap(model, optimizer, config)
    else:
        wrapped, optimizer = hemiola.wrap(model, optimizer, schedule=scheme, timeout_s=120)
    x_train, y_train, x_test, y_test = task.data
    mine = torch.arange(worker, len(y_train), workers)
    g = torch.Generator().manual_seed(seed * 100 + worker)
    straggler = worker == workers - 1

    def global_iterations(own: int) -> float:
        return wrapped.version() / workers if is_ps and consistency != "bsp" else float(own)

    evals: list[dict[str, float]] = []
    clock = 0.0  # training time, evaluation excluded
    own = 0
    start = time.perf_counter()
    while global_iterations(own) < iterations:
        idx = mine[torch.randint(len(mine), (task.batch_size,), generator=g)]
        optimizer.zero_grad()
        task.loss(wrapped, x_train[idx], y_train[idx]).backward()
        optimizer.step()
        own += 1
        if straggler and delay_s > 0:
            time.sleep(delay_s)
        if worker == 0 and own % EVAL_EVERY == 0:
            clock += time.perf_counter() - start
            # The parameter server's wrapper pulls what this worker trains on
            # now; an all-reduce model lands what is pending (synchronize()) and is
            # evaluated through its module, as DDP scripts do on one rank (a
            # forward of the wrapper may broadcast buffers, a collective).
            model.eval()
            if not is_ps:
                wrapped.synchronize()
            evaluated = wrapped if is_ps else model
            with torch.no_grad():
                accuracy = (evaluated(x_test).argmax(1) == y_test).float().mean().item()
            model.train()
            evals.append({"iteration": global_iterations(own), "seconds": clock,
                          "accuracy": accuracy})
            start = time.perf_counter()
    clock += time.perf_counter() - start
    result = {"worker": worker, "own_iterations": own, "seconds": clock, "evals": evals}
    if is_ps:
        result["staleness"] = wrapped.staleness()
        result["pulled_ahead"] = wrapped.pulled_ahead()
        wrapped.close()
    return result


def run_in_network(rate: str, world: int, args: list[Any], port: int) -> dict[int, Any]:
    """The ranks of one run, each in its own namespace behind a `rate` link:
    ``{rank: run_rank's result}``, as :func:`run_local` returns them."""
    with Network(world, rate) as net:
        # The job's token, as run_local gives one (in the environment: argv is public).
        outputs = net.run_ranks([sys.executable, "-m", "hemiola.bench.ps", "--rank",
                                 json.dumps(args)], port, timeout_s=900,
                                env={JOB_TOKEN_ENV: secrets.token_hex(16)})
    return {rank: parse_result(output) for rank, output in enumerate(outputs)}


def network_rank(args: list[Any]) -> dict[str, Any] | None:
    """One rank of :func:`run_in_network`, in its namespace (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, GLOO_SOCKET_IFNAME and the job token set by netlab)."""
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts the store
    torch.set_num_threads(1)
    return run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)


def summarize(scheme: str, slowdown: float, seed: int, results: dict[int, Any], target: float,
              lr: float, momentum: float, architecture: str) -> dict[str, Any]:
    workers = sorted((v for v in results.values() if v), key=lambda v: v["worker"])
    w0 = workers[0]
    reached = next((e for e in w0["evals"] if e["accuracy"] >= target), None)
    final = w0["evals"][-1]
    row: dict[str, Any] = {
        "scheme": scheme, "workers": len(workers), "model": architecture, "lr": lr,
        "momentum": momentum, "slowdown": slowdown, "seed": seed, "target": target,
        "iterations": final["iteration"], "seconds": w0["seconds"],
        "ms_per_iteration": 1000 * w0["seconds"] / max(final["iteration"], 1e-9),
        "iterations_to_target": reached["iteration"] if reached else None,
        "seconds_to_target": reached["seconds"] if reached else None,
        "final_accuracy": final["accuracy"],
        "best_accuracy": max(e["accuracy"] for e in w0["evals"]),
        "own_iterations": [w["own_iterations"] for w in workers],
        "evals": w0["evals"],
    }
    if "staleness" in w0:
        row["mean_staleness"] = {w["worker"]: round(w["staleness"]["mean"], 2) for w in workers}
        row["max_staleness"] = max(w["staleness"]["max"] for w in workers)
        row["pulled_ahead"] = w0["pulled_ahead"]
    return row


def plot(rows: list[dict[str, Any]], slowdown: float, workers: int, path: Path) -> Path | None:
    """Test accuracy over iterations and seconds, one line per scheme (the
    first seed). Returns None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r["slowdown"] == slowdown and r["seed"] == rows[0]["seed"]
            and r["workers"] == workers]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        its = [e["iteration"] for e in r["evals"]]
        secs = [e["seconds"] for e in r["evals"]]
        acc = [100 * e["accuracy"] for e in r["evals"]]
        style = "--" if r["scheme"] in ALLREDUCE else "-"
        left.plot(its, acc, style, label=r["scheme"])
        right.plot(secs, acc, style, label=r["scheme"])
    for ax, xlabel in ((left, f"iterations ({workers} mini-batches each)"),
                       (right, "seconds")):
        ax.axhline(100 * runs[0]["target"], color="grey", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(50, 100)
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle(f"digits, {workers} workers, lr {runs[0]['lr']:g}, momentum "
                 f"{runs[0]['momentum']:g}, worker {workers - 1} slowed {slowdown:g}x")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summaries(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workers, slowdown and scheme: the median and p10-p90 over
    seeds of the time per iteration, the final accuracy and (over the seeds that
    reached the target) the iterations and seconds to it."""
    out = []
    for workers, slowdown, scheme in dict.fromkeys(
            (r["workers"], r["slowdown"], r["scheme"]) for r in rows):
        runs = [r for r in rows if (r["workers"], r["slowdown"], r["scheme"])
                == (workers, slowdown, scheme)]
        hit = [r for r in runs if r["iterations_to_target"] is not None]
        row: dict[str, Any] = {
            "suite": "ps", "row": "summary", "workers": workers, "slowdown": slowdown,
            "scheme": scheme, "seeds": len(runs), "reached": len(hit),
            "target": runs[0]["target"], "lr": runs[0]["lr"], "model": runs[0]["model"],
            "rate": runs[0].get("rate", "none"),
            "ms_per_iteration": percentiles(r["ms_per_iteration"] for r in runs),
            "final_accuracy": percentiles(r["final_accuracy"] for r in runs)}
        if hit:
            row["iterations_to_target"] = percentiles(r["iterations_to_target"] for r in hit)
            row["seconds_to_target"] = percentiles(r["seconds_to_target"] for r in hit)
        out.append(row)
    return out


def spread(values: list[float], fmt: str) -> str:
    """'mean [min, max]' of `values` (just the value for one)."""
    if len(values) == 1:
        return format(values[0], fmt)
    return (f"{format(statistics.fmean(values), fmt)} "
            f"[{format(min(values), fmt)}, {format(max(values), fmt)}]")


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for workers in args.workers:
        t_ref = next(r["t_ref_ms"] for r in rows if r["workers"] == workers)
        link = "loopback" if args.rate == "none" else f"{args.rate} links"
        print(f"\n{workers} workers + {args.servers} server(s) on {link}, digits {args.model}, "
              f"lr {args.lr:g}, "
              f"momentum {args.momentum:g}, target {100 * args.target:.0f}% test accuracy, "
              f"{args.iterations} iterations, {args.seeds} seed(s): mean [min, max]; "
              f"straggler delay (k-1) x {t_ref:.1f} ms")
        print(f"{'slowdown':>8} {'scheme':>20} {'ms/iter':>8} {'reached':>7} "
              f"{'iters→target':>18} {'s→target':>18} {'final acc %':>20}")
        for slowdown, scheme in itertools.product(args.slowdowns, args.schemes):
            runs = [r for r in rows if r["slowdown"] == slowdown and r["scheme"] == scheme
                    and r["workers"] == workers]
            hit = [r for r in runs if r["iterations_to_target"] is not None]
            its = spread([r["iterations_to_target"] for r in hit], ".0f") if hit else "—"
            secs = spread([r["seconds_to_target"] for r in hit], ".2f") if hit else "—"
            print(f"{slowdown:>7g}x {scheme:>20} "
                  f"{statistics.fmean(r['ms_per_iteration'] for r in runs):>8.1f} "
                  f"{len(hit)}/{len(runs):<5} {its:>18} {secs:>18} "
                  f"{spread([100 * r['final_accuracy'] for r in runs], '.1f'):>20}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schemes", nargs="+", default=list(PS_SCHEMES + ALLREDUCE),
                        help="consistency models and all-reduce schedules; CONSISTENCY:RULE "
                             "overrides the staleness rule (e.g. eager:none, asp:inverse); "
                             f"{UNCORRECTED}: eager without local correction; /MOMENTUM_RULE "
                             "(e.g. asp/compensated, asp:none/none): PSConfig.momentum_rule; "
                             "a suffix @F (e.g. eager@0.25): eager pulling the front F of the "
                             "bytes ahead")
    parser.add_argument("--slowdowns", nargs="+", type=float, default=[1, 2, 4])
    parser.add_argument("--workers", nargs="+", type=int, default=[4],
                        help="numbers of workers (the last one is the straggler)")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--lr", type=float, default=DigitsTask.lr)
    parser.add_argument("--momentum", type=float, default=DigitsTask.momentum)
    parser.add_argument("--model", choices=DIGITS_ARCHITECTURES, default="cnn",
                        help="the digits CNN (default), a 64-96-48-10 MLP or a 64-512-512-10 "
                             "one (wide-mlp)")
    parser.add_argument("--rate", default="none",
                        help="tc rate of every rank's link, e.g. 1gbit (needs root; default "
                             "none: loopback, no limit)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--name", default="ps_straggler", help="name of the result files")


def run(args: argparse.Namespace) -> int:
    def run_scheme(scheme: str, workers: int, slowdown: float, seed: int, delay_s: float
            ) -> dict[str, Any]:
        is_ps = parse_scheme(scheme).consistency in PS_SCHEMES
        world = workers + (args.servers if is_ps else 0)
        rank_args = [scheme, args.servers, workers, delay_s, args.iterations, seed, args.lr,
                     args.momentum, args.model]
        if args.rate == "none":
            results = run_local(run_rank, world, *rank_args, timeout_s=900)
        else:
            results = run_in_network(args.rate, world, rank_args, port=29500)
        return {**summarize(scheme, slowdown, seed, results, args.target, args.lr,
                            args.momentum, args.model), "rate": args.rate}

    if args.rate != "none":
        # A terminated run must still leave through Network's cleanup, which
        # deletes the namespaces.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    rows = []
    for workers in args.workers:
        # T: bsp's time per iteration without a straggler, the unit of the slowdowns.
        t_ref = run_scheme("bsp", workers, 1.0, 0, 0.0)["ms_per_iteration"] / 1000
        print(f"{workers} workers: T = {1000 * t_ref:.1f} ms per bsp iteration without a "
              "straggler")
        plan = list(itertools.product(range(args.seeds), args.slowdowns, args.schemes))
        for seed, slowdown, scheme in tqdm(plan, desc=f"ps straggler, {workers} workers",
                                           unit="run"):
            row = run_scheme(scheme, workers, slowdown, seed, (slowdown - 1) * t_ref)
            rows.append({**row, "suite": "ps", "row": "run", "t_ref_ms": 1000 * t_ref})
    print_table(rows, args)
    path = write_lines(args.out / f"{args.name}.jsonl", rows + summaries(rows))
    print(f"\nwrote {path}")
    for workers in args.workers:
        suffix = "" if len(args.workers) == 1 else f"_{workers}w"
        image = plot(rows, max(args.slowdowns), workers, args.out / f"{args.name}{suffix}.png")
        if image is not None:
            print(f"wrote {image}")
    return 0


if __name__ == "__main__":
    rank_main(network_rank, "ps", "--rank")

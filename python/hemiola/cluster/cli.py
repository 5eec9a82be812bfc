"""``hemiola cluster simulate`` and ``hemiola cluster compare``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hemiola.cluster.config import ClusterConfig, PolicyConfig, WorkloadConfig

# Exit status after Ctrl-C: 128 + SIGINT, as a shell reports a process it interrupted.
_INTERRUPTED = 130


def _add_common(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=("paper", "trace"),
        default=None,
        help="the paper's synthetic workload (default) or a trace (--trace)",
    )
    w.add_argument("--jobs", type=int, default=160, help="jobs in the paper workload (160)")
    w.add_argument(
        "--arrival-window-ms",
        type=float,
        default=12000.0,
        help="paper workload: arrivals uniform in [0, this) (12000)",
    )
    w.add_argument(
        "--trace",
        metavar="PATH",
        default=None,
        help="Philly-format CSV (timestamp,duration,num_gpus); "
        "e.g. ../shared/data/traces/philly.csv",
    )
    w.add_argument("--first-row", type=int, default=0, help="first trace row to use (0-based)")
    w.add_argument(
        "--max-rows",
        type=int,
        default=None,
        help="use at most this many trace rows (>= 1; default all)",
    )
    w.add_argument(
        "--models",
        metavar="PATH",
        default=None,
        help="CSV of models: name,size_mb,forward_ms,backward_ms,memory_mb",
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=16)
    c.add_argument("--gpus-per-node", type=int, default=4)
    c.add_argument("--gpu-memory-mb", type=float, default=32768.0)
    c.add_argument("--beta", type=float, default=0.856, help="ms per MB on an idle link")
    c.add_argument("--eta", type=float, default=0.235, help="extra ms per MB per added transfer")
    p.add_argument("--fidelity", choices=("task", "iteration"), default="task")
    p.add_argument(
        "--job-order",
        choices=("fifo", "srsf"),
        default="fifo",
        help="order in which waiting jobs are offered to placement (fifo)",
    )


def _workload(args: argparse.Namespace, seed: int) -> WorkloadConfig:
    kind = args.workload or ("trace" if args.trace else "paper")
    return WorkloadConfig(
        kind=kind,
        jobs=args.jobs,
        seed=seed,
        arrival_window_ms=args.arrival_window_ms,
        trace_path=args.trace,
        first_row=args.first_row,
        max_rows=args.max_rows,
        models_path=args.models,
    )


def _cluster(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_mb=args.gpu_memory_mb,
        beta_ms_per_mb=args.beta,
        eta_ms_per_mb=args.eta,
    )


def _simulate(args: argparse.Namespace) -> int:
    from hemiola.cluster.api import simulate

    try:
        summary = simulate(
            _workload(args, args.seed),
            _cluster(args),
            PolicyConfig(
                placement=args.placement,
                comm=args.comm,
                fidelity=args.fidelity,
                seed=args.seed,
                job_order=args.job_order,
            ),
        )
    except (ValueError, OSError) as e:
        print(f"hemiola cluster simulate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hemiola cluster simulate: interrupted (Ctrl-C)", file=sys.stderr)
        return _INTERRUPTED
    d: dict[str, Any] = summary.to_dict()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(
            f"{d['jobs']} jobs, {d['placement']} / {d['comm']} / {d['job_order']} "
            f"({d['fidelity']} level)"
        )
        for key in ("mean_jct_ms", "median_jct_ms", "p99_jct_ms", "makespan_ms"):
            print(f"  {key:<16} {d[key] / 1000:12.3f} s")
        print(f"  {'gpu_utilization':<16} {d['gpu_utilization']:12.3f}")
        print(f"  simulated in {d['wall_s']:.3f} s ({d['events']} events)")
    return 0


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _seeds(text: str) -> list[int]:
    """``"10"`` -> 0..9; ``"3,5,8"`` -> those; ``"2-6"`` -> 2..6."""
    try:
        if "," in text:
            seeds = [int(t) for t in _split(text)]
        elif "-" in text:
            lo, hi = text.split("-", 1)
            seeds = list(range(int(lo), int(hi) + 1))
        else:
            seeds = list(range(int(text)))
    except ValueError:
        seeds = []
    if not seeds:
        raise argparse.ArgumentTypeError(
            f"expected N (seeds 0..N-1), A-B or a comma list of seeds, got {text!r}"
        )
    return seeds


def _compare(args: argparse.Namespace) -> int:
    from hemiola.cluster.compare import compare, format_table

    placements: list[str] = []
    for p in _split(args.placements):
        if p == "lwf":
            placements += [f"lwf:{k}" for k in _split(args.kappas)]
        else:
            placements.append(p)
    try:
        rows = compare(
            _workload(args, 0),
            _cluster(args),
            placements,
            _split(args.comms),
            args.seeds,
            fidelity=args.fidelity,
            out_dir=args.out,
            progress=not args.no_progress,
            workers=args.workers,
            job_order=args.job_order,
        )
    except (ValueError, OSError) as e:
        print(f"hemiola cluster compare: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hemiola cluster compare: interrupted (Ctrl-C); nothing written", file=sys.stderr)
        return _INTERRUPTED
    print(format_table(rows), end="")
    print(f"wrote {args.out}/runs.jsonl, table.md, jct_cdf.png, utilization.png")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``cluster`` command (``simulate``, ``compare``) to the top-level CLI."""
    cluster = subparsers.add_parser(
        "cluster", help="simulate scheduling of many training jobs on a GPU cluster"
    )
    sub = cluster.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    sub.required = True

    sim = sub.add_parser("simulate", help="run one simulation and print its metrics")
    _add_common(sim)
    sim.add_argument("--seed", type=int, default=0, help="workload / random-placement seed")
    sim.add_argument("--placement", default="lwf:4", help="first-fit | random | lwf:K")
    sim.add_argument("--comm", default="ada-srsf", help="srsf:N | srsf:inf | ada-srsf")
    sim.add_argument("--json", action="store_true", help="print JSON")
    sim.set_defaults(run=_simulate)

    cmp_ = sub.add_parser("compare", help="run a grid of policies x kappa x seeds")
    _add_common(cmp_)
    cmp_.add_argument(
        "--placements",
        default="first-fit,random,lwf",
        help="comma list; 'lwf' expands to lwf:K for each K in --kappas",
    )
    cmp_.add_argument("--kappas", default="1,2,4,8")
    cmp_.add_argument("--comms", default="srsf:1,srsf:2,ada-srsf")
    cmp_.add_argument("--seeds", type=_seeds, default="10", help="N (0..N-1), A-B, or a comma list")
    cmp_.add_argument("--out", default="bench/results/cluster-compare", help="output folder")
    cmp_.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    cmp_.add_argument(
        "--workers",
        type=int,
        default=1,
        help="simulations run in parallel on this many threads (1)",
    )
    cmp_.set_defaults(run=_compare)

"""``hemiola advise`` on a real rate-limited network: its predicted time for
the configuration it picks against the time measured running it.

    hemiola bench advise --rates 1gbit,5gbit        # as root

For each rate, N network namespaces joined by ``tc tbf`` links
(:mod:`hemiola.bench.netlab`) run ``python -m hemiola advise`` as the ranks of
one job (the built-in 9.4M-parameter MLP, one thread per rank). Rank 0's
report is printed; one row per rate (the advice, its predicted and measured
time) goes to OUT/NAME.jsonl.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path

from hemiola.bench.netlab import Network
from hemiola.bench.record import DEFAULT_OUT, write_lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="1gbit,5gbit", help="tc rates, comma-separated")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--name", default="advise", help="results go to OUT/NAME.jsonl")


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rows = []
    for k, rate in enumerate(args.rates.split(",")):
        with Network(args.world_size, rate) as net:
            out = net.run_ranks([sys.executable, "-m", "hemiola", "advise",
                                 "--iterations", str(args.iterations)], 29600 + k,
                                args.timeout_s)[0]
        report = out[out.index(f"{args.world_size} ranks."):]
        print(f"--- {rate} ---\n{report}", flush=True)
        use = re.search(r"Use: (.*)", report)
        check = re.search(r"Checked: ([\d.]+) ms .* against ([\d.]+) ms predicted", report)
        if use is None or check is None:
            raise RuntimeError(f"unexpected report:\n{report}")
        measured, predicted = float(check.group(1)), float(check.group(2))
        rows.append({"suite": "advise", "rate": rate, "world": args.world_size,
                     "choice": use.group(1), "predicted_ms": predicted,
                     "measured_ms": measured, "error": measured / predicted - 1})
    path = write_lines(args.out / f"{args.name}.jsonl", rows)
    for r in rows:
        print(f"{r['rate']:>7s}: {r['choice']}: predicted {r['predicted_ms']:.1f} ms, measured "
              f"{r['measured_ms']:.1f} ms ({100 * r['error']:+.1f}%)")
    print(f"wrote {path}")
    return 0

"""``hemiola advise`` on a real rate-limited network: its predicted time for
the configuration it picks against the time measured running it.

    python bench/advise_check.py --rates 1gbit,5gbit        # as root

For each rate, N network namespaces joined by ``tc tbf`` links
(bench/netlab.py) run ``python -m hemiola advise`` as the ranks of one job
(the built-in 9.4M-parameter MLP, one thread per rank). Rank 0's report is
printed; the rows go to bench/results/advise_check.jsonl.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from common import write_results
from netlab import Network


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1gbit,5gbit", help="tc rates, comma-separated")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
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
        rows.append({"bench": "advise_check", "rate": rate, "world": args.world_size,
                     "choice": use.group(1), "predicted_ms": predicted,
                     "measured_ms": measured, "error": measured / predicted - 1})
    path = write_results("advise_check", rows)
    for r in rows:
        print(f"{r['rate']:>7s}: {r['choice']}: predicted {r['predicted_ms']:.1f} ms, measured "
              f"{r['measured_ms']:.1f} ms ({100 * r['error']:+.1f}%)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Task level vs iteration level on the paper's workload (same jobs, same policies).

Prints a Markdown table of mean JCT (mean over seeds) at both fidelities and
their ratio; the iteration-level (fluid) model is a deliberately pessimistic
approximation (see docs/cluster.md), and this measures by how much.

    python bench/cluster/fidelity.py --seeds 10 [--windows-s 12,120,600]
"""

from __future__ import annotations

import argparse
import statistics

from hemiola.cluster import ClusterConfig, PolicyConfig, WorkloadConfig, simulate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--windows-s", default="12",
                        help="comma list of arrival windows in seconds (the paper: 12)")
    args = parser.parse_args()
    print("| arrivals in | placement | comm | task mean JCT (s) | iteration mean JCT (s) | ratio |")
    print("|---|---|---|---|---|---|")
    for window in (float(w) for w in args.windows_s.split(",")):
        for placement in ("first-fit", "lwf:1", "lwf:4"):
            for comm in ("srsf:1", "srsf:2", "ada-srsf"):
                means = {}
                for fidelity in ("task", "iteration"):
                    means[fidelity] = statistics.fmean(
                        simulate(WorkloadConfig(seed=s, arrival_window_ms=window * 1000),
                                 ClusterConfig(),
                                 PolicyConfig(placement, comm, fidelity, s)).mean_jct_ms
                        for s in range(args.seeds))
                t, i = means["task"] / 1000, means["iteration"] / 1000
                print(f"| {window:g} s | {placement} | {comm} | {t:.2f} | {i:.2f} | {i / t:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

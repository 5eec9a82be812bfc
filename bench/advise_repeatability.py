"""How often this machine's measurement of a configuration agrees with itself:
the ceiling a prediction of it can be checked against.

    python bench/advise_repeatability.py

Reads the committed ``hemiola bench advise`` grids (docs/results), nothing is
measured. Each per-step row holds its trial rounds (``measured_rounds_ms``:
the same configuration, same job, same profile, minutes apart, in
alternating order). For every grid of two or more rounds it prints how often
one round is within 10% of another round, and for grids of three or more
how often one round is within 10% of the median of the others (what a
prediction checked against a median of rounds competes with), beside how
often the grid's predictions (``error_trials``) were within 10% of the
median of all its rounds.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

from hemiola.bench.record import read_lines

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def within(a: float, b: float, tolerance: float = 0.10) -> bool:
    return abs(a / b - 1) <= tolerance


def main() -> None:
    print("grid: rounds per row; one round against another, one round against the "
          "median of the others, the predictions against the median of all (within 10%)")
    for path in sorted(RESULTS.glob("advise-grid-*.jsonl")):
        rows = read_lines(path)
        rows = [r for r in rows if not r["config"].startswith("streaming")
                and len(r.get("measured_rounds_ms") or []) >= 2]
        if not rows:
            continue
        pairs = [within(a, b) for r in rows
                 for a, b in itertools.combinations(r["measured_rounds_ms"], 2)]
        others = [within(t, statistics.median(r["measured_rounds_ms"][:k]
                                              + r["measured_rounds_ms"][k + 1:]))
                  for r in rows if len(r["measured_rounds_ms"]) >= 3
                  for k, t in enumerate(r["measured_rounds_ms"])]
        predicted = [abs(r["error_trials"]) <= 0.10 for r in rows if "error_trials" in r]
        rounds = len(rows[0]["measured_rounds_ms"])
        cells = [f"{sum(pairs)} of {len(pairs)} ({100 * sum(pairs) / len(pairs):.0f}%)",
                 f"{sum(others)} of {len(others)} ({100 * sum(others) / len(others):.0f}%)"
                 if others else "-",
                 f"{sum(predicted)} of {len(predicted)} "
                 f"({100 * sum(predicted) / len(predicted):.0f}%)" if predicted else "-"]
        print(f"  {path.stem:38s} {rounds}: " + "; ".join(cells))


if __name__ == "__main__":
    main()

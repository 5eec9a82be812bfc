"""Would a different ``contention`` have made ``hemiola advise`` right, and what
does the wire's measured rate beside the computation change? Re-predicts
every per-step row of the committed advise grids from the grid's saved
profiles with the profile's contention replaced (and, for grids that
measured it, with ``wire_rate_beside`` left out), and compares with what was
measured. Nothing is measured: the rows and profiles are in docs/results.

    python bench/advise_contention.py                   # contention 0, 0.5 and 1
    python bench/advise_contention.py --values 0.8

A configuration's measured ``overhead`` (its free-wire step minus the model
of it) was derived with the profile's own contention; it is re-derived with
the new one, so that each prediction still matches the free-wire step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from hemiola.advise import model
from hemiola.advise.cli import local_network
from hemiola.advise.collective import Network
from hemiola.advise.profile import Profile

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
GRIDS = ("advise-grid-2026-11-27", "advise-grid-quiet-2026-11-27", "advise-grid-slowest-2026-11-27",
         "advise-grid-beside-2026-11-27")
#: the variant that leaves the wire's measured rate beside the computation out
NO_WIRE_BESIDE = -1.0


def predict(profile: Profile, contention: float | None, schedule: str, coding: str) -> float:
    """Seconds per iteration on the profile's 2-rank link, with `contention`
    in place of the measured one (None: as measured; "no wire beside": the
    profile without ``wire_rate_beside``)."""
    net = local_network(profile, 2)
    if contention is None:
        return model.predict_one(profile, net, schedule, coding)
    if contention == NO_WIRE_BESIDE:
        return model.predict_one(replace(profile, wire_rate_beside=0.0), net, schedule, coding)
    free = Network(world=1, bandwidth=1.0)
    key = f"{schedule}+{coding}"
    changed = copy.deepcopy(profile)
    changed.contention = contention
    changed.overhead[key] = (profile.overhead.get(key, 0.0)
                             + model.predict_one(profile, free, schedule, coding)
                             - model.predict_one(changed, free, schedule, coding))
    return model.predict_one(changed, net, schedule, coding)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", default="0,0.5,1",
                        help="contentions to try, comma-separated")
    args = parser.parse_args()
    for grid in GRIDS:
        rows = [json.loads(line) for line in (RESULTS / f"{grid}.jsonl").open()]
        profiles = {cell: Profile.load(RESULTS / f"{grid}-profiles" / f"{grid}-{cell}.profile.json")
                    for cell in {f"{r['model']}-{r['rate']}" for r in rows}}
        values: list[float | None] = [None, *(float(v) for v in args.values.split(","))]
        if any(p.wire_rate_beside > 0 for p in profiles.values()):
            values.append(NO_WIRE_BESIDE)
        for contention in values:
            errors: dict[str, list[float]] = defaultdict(list)
            for r in rows:
                if r["config"].startswith("streaming"):
                    continue
                schedule, coding = r["config"].split("+")
                cell = f"{r['model']}-{r['rate']}"
                error = 1e3 * predict(profiles[cell], contention, schedule, coding) \
                    / r["measured_ms"] - 1
                errors[schedule].append(error)
                errors["all"].append(error)
            said = ("as measured" if contention is None else "as measured, no wire beside"
                    if contention == NO_WIRE_BESIDE else f"{contention:g}")
            parts = [f"{k} median {100 * statistics.median(v):+.1f}%, "
                     f"{sum(abs(e) <= 0.10 for e in v)}/{len(v)} within 10%"
                     for k, v in errors.items()]
            print(f"{grid}, contention {said}: " + "; ".join(parts))


if __name__ == "__main__":
    main()

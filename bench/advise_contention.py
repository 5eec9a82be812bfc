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
from hemiola.advise.collective import Network
from hemiola.advise.model import local_network
from hemiola.advise.profile import Profile
from hemiola.advise.wire import rate_beside

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
GRIDS = ("advise-grid-2026-11-27", "advise-grid-quiet-2026-11-27", "advise-grid-slowest-2026-11-27",
         "advise-grid-beside-2026-11-27")


def predict(profile: Profile, contention: float | None, schedule: str, coding: str,
            wire_beside: bool = True) -> float:
    """Seconds per iteration on the profile's 2-rank link, with `contention`
    in place of the measured one (None: as measured); `wire_beside` False:
    the profile without ``wire_rate_beside``."""
    net = local_network(profile, 2)
    if not wire_beside:
        profile = replace(profile, wire_rate_beside=0.0)
    if contention is None:
        return model.predict_one(profile, net, schedule, coding)
    free = Network(world=1, bandwidth=1.0)
    key = f"{schedule}+{coding}"
    changed = copy.deepcopy(profile)
    changed.contention = contention
    changed.overhead[key] = (profile.overhead.get(key, 0.0)
                             + model.predict_one(profile, free, schedule, coding)
                             - model.predict_one(changed, free, schedule, coding))
    return model.predict_one(changed, net, schedule, coding)


def rederived(profile: Profile) -> Profile:
    """The profile with ``wire_rate_beside`` derived as hemiola derives it
    now (``wire.rate_beside``: the link's bandwidth times the all-reduce's
    seconds alone over beside) from the two medians it kept in
    ``meta["wire_beside"]``; the fourth grid measured with a first
    definition (the bytes over the seconds beside, past a 5% threshold)."""
    if "wire_beside" not in profile.meta or profile.link is None:
        return profile
    alone, beside = profile.meta["wire_beside"]
    return replace(profile, wire_rate_beside=rate_beside(profile.link.bandwidth, alone, beside))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", default="0,0.5,1",
                        help="contentions to try, comma-separated")
    args = parser.parse_args()
    for grid in GRIDS:
        rows = [json.loads(line) for line in (RESULTS / f"{grid}.jsonl").open()]
        profiles = {cell: rederived(Profile.load(
                        RESULTS / f"{grid}-profiles" / f"{grid}-{cell}.profile.json"))
                    for cell in {f"{r['model']}-{r['rate']}" for r in rows}}
        variants: list[tuple[float | None, bool]] = [
            (None, True), *((float(v), True) for v in args.values.split(","))]
        if any(p.wire_rate_beside > 0 for p in profiles.values()):
            variants.append((None, False))
        for contention, beside in variants:
            errors: dict[str, list[float]] = defaultdict(list)
            for r in rows:
                if r["config"].startswith("streaming"):
                    continue
                schedule, coding = r["config"].split("+")
                cell = f"{r['model']}-{r['rate']}"
                error = 1e3 * predict(profiles[cell], contention, schedule, coding, beside) \
                    / r["measured_ms"] - 1
                errors[schedule].append(error)
                errors["all"].append(error)
            said = "as measured" if contention is None else f"{contention:g}"
            if not beside:
                said += ", without the wire's rate beside the computation"
            parts = [f"{k} median {100 * statistics.median(v):+.1f}%, "
                     f"{sum(abs(e) <= 0.10 for e in v)}/{len(v)} within 10%"
                     for k, v in errors.items()]
            print(f"{grid}, contention {said}: " + "; ".join(parts))


if __name__ == "__main__":
    main()

"""The ranks' wait for each other (``peer_wait``) of ``hemiola advise``: what a
coding's reduction takes at 2 ranks beyond its CPU work alone, and what
modelling it does to the committed grids.

    python bench/advise_peer_wait.py measure [--model lm] [--repeats 7] [--caps 25,4,1]
    python bench/advise_peer_wait.py replay

``measure``: on 2 local ranks (loopback), one reduction of every gradient of
the model per coding, through an engine of one rank (every collective
returns at once) and through the 2-rank engine, alternately twice; prints
each one's median wall time and the process's CPU time (every thread) over
it, per rank; ``--caps``: with buckets of each of these MiB (25: DDP's
plan; 4: ``priority``'s), to see the wait grow with the collectives.
``replay``: re-predicts every per-step row of the committed
advise grids (docs/results) at the trials' computation from the grid's own
profiles, with the profile's ``peer_wait`` derived from its measured
reductions and without it, and counts the rows within 10%. Nothing is
measured there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hemiola.advise import model
from hemiola.advise.measure import with_peer_wait
from hemiola.advise.model import local_network
from hemiola.advise.profile import Profile
from hemiola.bench.record import read_lines

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _reductions(rank: int, world: int, spec: str, repeats: int,
                caps: list[int]) -> dict[str, list[float]]:
    import torch

    import hemiola
    from hemiola.advise import instruments
    from hemiola.advise.models import load_factory, make_workload
    from hemiola.distributed import new_engine

    torch.set_num_threads(1)
    hemiola.init()
    engine, _ = new_engine(timeout_s=600.0)
    params = instruments.params_of(make_workload(load_factory(spec)).model)
    free, _ = instruments.free_engine()
    out: dict[str, list[float]] = {}
    for coding, cap in ((c, cap) for c in model.CODINGS for cap in caps):
        for label, eng in (("1 rank", free), ("2 ranks", engine)) * 2:
            reduction = instruments.Reduction(eng, params, coding, cap << 20)
            engine.barrier().wait()
            reduction.run()
            walls, cpus = [], []
            for _ in range(repeats):
                engine.barrier().wait()
                wall, cpu = time.perf_counter(), time.process_time()
                reduction.run()
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            key = f"{coding} {cap} MiB {label}"
            out.setdefault(key, []).extend([1e3 * statistics.median(walls),
                                            1e3 * statistics.median(cpus)])
    return out


def measure_loopback(spec: str, repeats: int, caps: list[int]) -> None:
    from hemiola.launch import run_local

    results = run_local(_reductions, 2, spec, repeats, caps, timeout_s=1800)
    print("ms per reduction of every gradient: wall / process CPU (two measurements each)")
    for key in results[0]:
        cells = []
        for rank in sorted(results):
            w1, c1, w2, c2 = results[rank][key]
            cells.append(f"rank {rank}: {w1:5.1f} / {c1:5.1f}, {w2:5.1f} / {c2:5.1f}")
        print(f"  {key:26s} " + "   ".join(cells))


def _errors(rows: list[dict[str, Any]], profiles: dict[str, Profile]) -> list[float]:
    errors = []
    for row in rows:
        schedule, coding = row["config"].split("+", 1)
        profile = profiles[f"{row['model']}-{row['rate']}"]
        trials = row.get("bare_trials_ms", row.get("bare_now_ms"))
        profile = profile.scaled(trials / 1e3 / profile.compute)
        seconds = model.predict_one(profile, local_network(profile, 2), schedule, coding)
        errors.append(seconds / (row["measured_ms"] / 1e3) - 1)
    return errors


def replay() -> None:
    print("grid: per-step rows within 10% at the trials' computation (median error), "
          "without the peer wait -> with it")
    for rows_file in sorted(RESULTS.glob("advise-grid-*.jsonl")):
        folder = RESULTS / f"{rows_file.stem}-profiles"
        if not folder.is_dir():
            continue
        profiles = {"-".join(f.name.removesuffix(".profile.json").split("-")[-2:]):
                    Profile.load(f) for f in folder.glob("*.profile.json")}
        rows = read_lines(rows_file)
        rows = [r for r in rows if not r["config"].startswith("streaming")
                and f"{r['model']}-{r['rate']}" in profiles and profiles[
                    f"{r['model']}-{r['rate']}"].link is not None]
        if not rows:
            continue
        cells = []
        for peer_wait in (False, True):
            each = {cell: with_peer_wait(p) if peer_wait else replace(p, peer_wait={})
                    for cell, p in profiles.items()}
            errors = _errors(rows, each)
            within = sum(abs(e) <= 0.1 for e in errors)
            cells.append(f"{within:2d} of {len(errors)} ({100 * statistics.median(errors):+.1f}%)")
        print(f"  {rows_file.stem:36s} {cells[0]} -> {cells[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--model", default="lm", help="a model of hemiola.bench.advise_models")
    m.add_argument("--repeats", type=int, default=7)
    m.add_argument("--caps", default="25", help="bucket sizes in MiB, comma-separated")
    sub.add_parser("replay")
    args = parser.parse_args()
    if args.what == "measure":
        measure_loopback(f"hemiola.bench.advise_models:{args.model}", args.repeats,
                         [int(c) for c in args.caps.split(",")])
    else:
        replay()


if __name__ == "__main__":
    main()

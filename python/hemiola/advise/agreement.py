"""Cross-rank agreement: every rank measures, and every rank must hold the
same profile and choose from the same numbers. Rank 0's profile is
broadcast (with every rank's mean overheads), its CPU times scaled to the
pace of a synchronous job on these ranks (its slowest rank's), and
configurations' times taken at that pace.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from hemiola.advise.instruments import Bare
from hemiola.advise.profile import Profile


def lockstep_pace(lockstep: torch.Tensor) -> float:
    """A synchronous job's step from every rank's step times measured in
    lockstep (a row per rank): the median over steps of the slowest rank's
    time in each. It exceeds the slowest rank's own median wherever the
    ranks' times vary from step to step independently."""
    return float(lockstep.max(dim=0).values.median())


def agree(profile: Profile, engine: Any | None, steps: Bare | None = None) -> Profile:
    """The profile every rank uses: rank 0's, with every rank's mean
    overheads, and its CPU times scaled to
    a synchronous job's step on these ranks (:func:`lockstep_pace` of every
    rank's `steps`); without them, to the slowest rank's computation. A
    job goes at its slowest rank's pace, and ranks sharing a machine need not
    compute alike (two ranks on this project's 2-core machine: the second
    up to 18% slower than the first) nor at the same moment alike.
    ``lockstep`` keeps the job's step over the pace of ranks that run on
    their own (the slowest rank's mean step, as ``streaming``'s ranks go
    between syncs), ``meta["slowest_rank"]`` the job's over rank 0's."""
    if engine is None or engine.world_size == 1:
        return profile
    from hemiola.engine_tensors import all_gather_rows, broadcast_tensors

    def every(times: list[float]) -> torch.Tensor:
        return all_gather_rows(engine, torch.tensor(times, dtype=torch.float64))

    text = json.dumps(profile.to_json()).encode()
    size = torch.tensor([len(text)], dtype=torch.int64)
    broadcast_tensors(engine, [size])
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if engine.rank == 0:
        buf.copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    broadcast_tensors(engine, [buf])
    agreed = Profile.from_json(json.loads(bytes(buf.tolist()).decode()))
    # The overheads are differences of two noisy medians (the wrapped step's
    # and the bare one's, a tenth of the step or less): every rank's mean
    # halves their variance (rank 0's alone, measured four times with five
    # turns each, ranged over 86 ms for one configuration of a 0.3 s step).
    names = sorted(agreed.overhead)
    overheads = every([profile.overhead[n] for n in names]).mean(dim=0)
    agreed.overhead = {n: float(overheads[k]) for k, n in enumerate(names)}
    if steps is None:
        job = slowest = free = float(every([profile.compute]).max())
    else:
        lockstep = every(steps.lockstep)
        job = lockstep_pace(lockstep)
        slowest = float(lockstep.median(dim=1).values.max())
        free = float(every(steps.free).mean(dim=1).max())
    # Rank 0's profile holds the medians of its own steps' parts. A slower
    # rank is slower at every CPU work (all of it scales); waiting each step
    # for whichever rank is slow then lengthens only the computation.
    out = agreed
    if slowest > agreed.compute:
        out = agreed.scaled(slowest / agreed.compute)
        out.meta = {**agreed.meta, "slowest_rank": slowest / agreed.compute}
    if job > out.compute:
        out = out.computation_scaled(job / out.compute)
    out.lockstep = max(1.0, job / free)
    return out


def job_pace(times: dict[str, float], engine: Any | None) -> dict[str, float]:
    """Each configuration's time at the job's pace: the slowest rank's (a
    synchronous job goes at it), so that every rank chooses from the same
    numbers and returns the same advice."""
    if engine is None or engine.world_size == 1 or not times:
        return dict(times)
    from hemiola.engine_tensors import all_gather_rows

    names = sorted(times)  # the same on every rank: the agreed profile's predictions
    rows = all_gather_rows(engine, torch.tensor([times[n] for n in names], dtype=torch.float64))
    slowest = rows.max(dim=0).values
    return {n: float(slowest[k]) for k, n in enumerate(names)}

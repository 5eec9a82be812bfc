"""The event simulation behind :mod:`hemiola.advise.model`: the computation,
as segments that wait for reductions and make buckets ready, and the
engine's lane, reducing one bucket's job after another, sharing the core by
the profile's contention; the steady seconds per iteration, and optionally
the spans of a predicted timeline.

A job is one collective phase of the lane in its issue order: a bucket's
reduction, or (``sharded``) a bucket's reduce-scatter under backward and,
as further jobs of the same iteration, its all-gather after the step. The
lane is one wire (FIFO): a job starts once ready and once the one before it
is done.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    """One bucket's reduction on the engine's lane."""

    cpu: float
    wire: float
    #: CPU seconds the engine spends while on the wire
    wire_cpu: float = 0.0
    #: the wire's seconds while the computation runs beside it (>= wire;
    #: 0: as `wire`)
    wire_beside: float = 0.0
    #: what it is, for a predicted timeline (default ``bucket K``)
    name: str = ""


@dataclass(frozen=True)
class Segment:
    """A stretch of the computation: it starts once `waits` (iteration
    offset, job) are done, and makes `emits` (jobs of its iteration) and
    `releases` ((iteration offset, job): ``sharded``'s forward issues the
    last step's next all-gather as it lands one) ready when it ends."""

    work: float
    waits: tuple[tuple[int, int], ...] = ()
    emits: tuple[int, ...] = ()
    releases: tuple[tuple[int, int], ...] = ()
    #: what it is, for a predicted timeline
    name: str = ""


@dataclass(frozen=True)
class Span:
    """One stretch of a predicted iteration (:func:`simulate`'s `trace`):
    `lane` ``compute`` or ``comm``, seconds from the simulation's start."""

    lane: str
    name: str
    start: float
    end: float


def simulate(program: Sequence[Segment], jobs: Sequence[Job], contention: float,
             iterations: int = 6, trace: list[Span] | None = None) -> float:
    """Steady seconds per iteration of `program` with the lane running
    `jobs` (one per bucket, or per collective of one: ``sharded``'s, in
    issue order) every iteration. `trace`: the
    spans of every iteration are appended to it (the predicted timeline).
    ValueError for a time that is not finite (the simulation would never
    end), and, should it still not end, after a bounded number of events."""
    for what, values in (("a contention", [contention]),
                         ("a segment of the computation", [s.work for s in program]),
                         ("a bucket's reduction", [t for j in jobs for t in
                                                   (j.cpu, j.wire, j.wire_cpu, j.wire_beside)])):
        if not all(math.isfinite(v) and v >= 0 for v in values):
            bad = next(v for v in values if not (math.isfinite(v) and v >= 0))
            raise ValueError(f"the iteration model cannot simulate {what} of {bad!r} (each "
                             "must be finite and >= 0)")
    # Each step of the loop below ends a segment, a phase of a job or (from
    # rounding) a sliver of one: far fewer than this, unless something is wrong.
    budget = 16 * (iterations + 1) * (len(program) + 3 * len(jobs) + 1) + 1000
    eps = 1e-12
    now = 0.0
    starts = [0.0]
    it, seg = 0, 0
    started, rem_c = False, 0.0
    ready: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    job_it, job_k, phase, rem_m, busy = 0, 0, 0, 0.0, False
    phases = [(j.cpu / 2, max(j.wire, j.wire_cpu), j.cpu / 2) for j in jobs]
    seg_start = phase_start = idle_since = 0.0

    def satisfied(waits: tuple[tuple[int, int], ...]) -> bool:
        return all(it + off < 0 or (it + off, k) in done for off, k in waits)

    def record(lane: str, name: str, start: float) -> None:
        if trace is not None and now - start > eps:
            trace.append(Span(lane, name, start, now))

    while it < iterations:
        moved = True
        while moved and it < iterations:
            moved = False
            if not started and satisfied(program[seg].waits):
                record("compute", f"wait ({it})", idle_since)
                started, rem_c, moved, seg_start = True, program[seg].work, True, now
            if started and rem_c <= eps:
                record("compute", f"{program[seg].name} ({it})", seg_start)
                ready.update((it, k) for k in program[seg].emits)
                ready.update((it + off, k) for off, k in program[seg].releases)
                started, seg, moved, idle_since = False, seg + 1, True, now
                if seg == len(program):
                    it, seg = it + 1, 0
                    starts.append(now)
            if not jobs:
                continue
            if not busy and (job_it, job_k) in ready:
                busy, phase, rem_m, moved, phase_start = True, 0, phases[job_k][0], True, now
            while busy and rem_m <= eps:
                moved = True
                record("comm", f"{jobs[job_k].name or f'bucket {job_k}'} ({job_it}) "
                       f"{('cpu before', 'wire', 'cpu after')[phase]}", phase_start)
                phase_start = now
                phase += 1
                if phase < 3:
                    rem_m = phases[job_k][phase]
                    continue
                done.add((job_it, job_k))
                busy = False
                job_k += 1
                if job_k == len(jobs):
                    job_it, job_k = job_it + 1, 0
        if it >= iterations:
            break
        computing = started
        lane_cpu = busy and phase != 1
        on_wire = busy and phase == 1
        rate_m = 1.0
        if computing and lane_cpu:
            rate_m = 1 / (1 + contention)
        elif computing and on_wire and jobs[job_k].wire_beside > phases[job_k][1]:
            rate_m = phases[job_k][1] / jobs[job_k].wire_beside
        share = 0.0
        if on_wire and phases[job_k][1] > 0:
            # the wire's CPU, spread over the phase as long as it lasts at rate_m
            share = jobs[job_k].wire_cpu / phases[job_k][1] * rate_m
        rate_c = 1 / (1 + contention) if lane_cpu else 1 / (1 + contention * share)
        steps = []
        if computing:
            steps.append(rem_c / rate_c)
        if busy:
            steps.append(rem_m / rate_m)
        if not steps:
            raise RuntimeError("the iteration model waits for a reduction that never starts "
                               "(a bucket no backward segment makes ready)")
        dt = min(steps)
        budget -= 1
        if not (math.isfinite(dt) and dt >= 0) or budget < 0:
            raise ValueError(f"the iteration model did not settle (a step of {dt!r} seconds at "
                             f"{now!r}): the times it was given are out of range")
        now += dt
        if computing:
            rem_c -= dt * rate_c
        if busy:
            rem_m -= dt * rate_m
    last = min(3, iterations - 1)
    return (starts[iterations] - starts[iterations - last]) / last

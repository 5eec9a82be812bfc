"""Short trial runs: a configuration trained for a few iterations on the
job's ranks (the advice checked against what it predicted), and the bare
model's step as a synchronous job takes it under the machine's present load.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from hemiola.advise import model
from hemiola.advise.agreement import lockstep_pace
from hemiola.advise.instruments import median_time, training_step
from hemiola.advise.models import Factory, Workload, make_workload


def trial(factory: Factory, prediction: model.Prediction, iterations: int,
          timeline: Path | None = None) -> float:
    """Trains `iterations` (after 3 of warm-up) with the configuration on the
    job's ranks; median seconds per iteration on this rank. ``streaming``:
    the mean over whole periods of sync_every steps (at least two), after
    one period of warm-up: its syncs are the point. `timeline`: record the
    engine's timeline and write it there."""
    import hemiola

    work = make_workload(factory)
    optimizer = work.make_optimizer(work.model.parameters())
    coding = None if prediction.coding == "none" else prediction.coding
    options: dict[str, Any] = dict(prediction.options)
    if prediction.schedule != "streaming":
        options["powersgd_start_iter"] = 0
    if timeline is not None:
        options["timeline"] = True
    wrapped, optimizer = hemiola.wrap(work.model, optimizer, schedule=prediction.schedule,
                                      compression=coding, **options)
    try:
        return _timed_trial(wrapped, work, optimizer, prediction, iterations)
    finally:
        if timeline is not None:
            timeline.write_text(wrapped.timeline())


def _timed_trial(wrapped: Any, work: Workload, optimizer: Any, prediction: model.Prediction,
                 iterations: int) -> float:
    """trial()'s timing of the wrapped configuration."""

    def step() -> None:
        training_step(wrapped, work.loss_fn, optimizer)

    if prediction.schedule == "streaming":
        period = int(prediction.options["sync_every"])
        steps = period * max(2, -(-iterations // period))
        for _ in range(period):
            step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wrapped.synchronize()
        return (time.perf_counter() - start) / steps
    for _ in range(3):
        step()
    seconds = median_time(step, iterations)
    wrapped.synchronize()
    return seconds


def bare_step(factory: Factory, iterations: int, engine: Any) -> float:
    """Collective: the bare model's step now, as a synchronous job of
    `engine`'s ranks takes it (every rank begins each step together; the
    median over steps of the slowest rank's time): what the computation
    costs under the machine's present load."""
    from hemiola.engine_tensors import all_gather_rows

    work = make_workload(factory)
    optimizer = work.make_optimizer(work.model.parameters())
    training_step(work.model, work.loss_fn, optimizer)
    times = []
    for _ in range(iterations):
        engine.barrier().wait()
        times.append(median_time(lambda: training_step(work.model, work.loss_fn, optimizer), 1))
    return lockstep_pace(all_gather_rows(engine, torch.tensor(times, dtype=torch.float64)))

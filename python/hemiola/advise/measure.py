"""A profile measured where the job runs, with one thread per rank as
training runs: the order of the measurements and what each adds to the
profile. The instruments are in :mod:`~hemiola.advise.instruments` (on one
machine) and :mod:`~hemiola.advise.wire` (the job's link), the ranks'
agreement in :mod:`~hemiola.advise.agreement`, trial runs in
:mod:`~hemiola.advise.trials`.

Every rank measures at the same time (the ranks share the machine as they
will in training); rank 0's numbers are broadcast (the overheads: every
rank's mean) so every rank holds the same profile. What is measured
(:class:`~hemiola.advise.profile.Profile`):

- the bare model: forward, backward, step, when each module's forward first
  reads its parameters and when backward produces each gradient (hooks);
- each configuration's wrapped step on a *free wire*: an engine of one rank
  (every collective returns at once, every copy and coding still runs), from
  which each schedule's issue order is read too. Its time less the model's
  prediction of it is the configuration's ``overhead``. ``sharded`` runs
  uncompressed only, and where it refuses the model (its optimizer's step
  is not element-wise, a parameter is not contiguous or is read in another
  module than the first time) the refusal is kept (``meta["refused"]``)
  and it is not predicted;
- each coding's CPU cost: one reduction of every gradient on a free wire;
- the contention: how much that reduction, run beside the bare step, delays
  it, per second of its CPU;
- streaming's sync: its step with a blocking sync every step on a free wire;
- on the job's own ranks, the link: all-reduces of two sizes (latency and
  bandwidth), the CPU the process spends per byte sent, one reduction of
  every gradient per coding (what it takes beyond the model of it is the
  ranks' ``peer_wait``), and the same reduction while every rank trains
  beside it (how fast the wire goes then).
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from hemiola.advise import model
from hemiola.advise.agreement import agree
from hemiola.advise.collective import Network
from hemiola.advise.instruments import (
    Reduction,
    bare,
    contention,
    free_engine,
    free_wire_step,
    median_time,
    params_of,
)
from hemiola.advise.models import Factory, make_workload
from hemiola.advise.profile import Profile
from hemiola.advise.wire import link, wire_rate_beside

#: schedules that refuse some models and optimizers by design (``sharded``:
#: a step that is not element-wise, a parameter not contiguous or read in
#: another module): measuring records the refusal instead of failing
REFUSING = ("sharded",)


class Progress:
    """A line on stderr as each measurement (or trial) starts, rank 0 only:
    they take minutes on a large model, and a silent command looks hung."""

    def __init__(self, total: int, rank: int, verb: str = "measuring") -> None:
        self.total, self.rank, self.done, self.verb = total, rank, 0, verb
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        if self.rank == 0:
            print(f"hemiola advise: {self.verb} {what} ({self.done}/{self.total}, "
                  f"{time.perf_counter() - self.start:.0f} s so far)", file=sys.stderr,
                  flush=True)


def measure(factory: Factory, repeats: int, engine: Any | None) -> Profile:
    """Every rank measures (collectively where `engine`, the job's, is given);
    the profile of rank 0 (with every rank's mean overheads, :func:`agree`)
    is returned on every rank."""
    torch.set_num_threads(1)
    sync = (lambda: engine.barrier().wait()) if engine is not None else (lambda: None)
    multi = engine is not None and engine.world_size > 1
    configurations = [(schedule, coding) for schedule in model.SCHEDULES
                      for coding in model.codings_of(schedule)]
    progress = Progress(4 + len(model.CODINGS) + len(configurations)
                        + (2 + len(model.CODINGS) if multi else 0),
                        engine.rank if engine is not None else 0)
    progress.step("the bare steps")
    work = make_workload(factory)
    # the bare steps in lockstep, and thrice as many as other measurements:
    # a synchronous job's step is the slowest rank's each time (agree)
    measured = bare(work, 3 * repeats, sync)
    forward, backward, step, params = measured[:4]
    optimizer_name = type(work.make_optimizer(work.model.parameters())).__name__
    free, _ = free_engine()
    coding_cpu = {}
    for coding in (*model.CODINGS, "int4"):  # int4: streaming's outer wire
        progress.step(f"the CPU cost of coding {coding}")
        sync()
        reduction = Reduction(free, params_of(work.model), coding)
        reduction.run()
        coding_cpu[coding] = median_time(reduction.run, repeats)
    # the contention of the per-step codings (int4 runs only on streaming's wire)
    costliest = max(model.CODINGS, key=lambda c: coding_cpu[c])
    progress.step("how coding slows the computation beside it")
    sync()
    share = contention(work, free, costliest, repeats, sync)
    profile = Profile(forward, backward, step, params, coding_cpu=coding_cpu, contention=share,
                      optimizer=optimizer_name)
    # Each configuration's wrapped step beyond the bare one, on a free wire.
    extra: dict[str, float] = {}
    refused: dict[str, str] = {}
    for schedule, coding in configurations:
        progress.step(f"{schedule} + {coding}'s step on a free wire")
        if schedule in refused:
            continue
        sync()
        # thrice the repeats: each overhead is a small difference of two
        # medians of steps whose speed jitters by ±12% from one to the next
        try:
            seconds, alone, plan = free_wire_step(factory, schedule, coding, 3 * repeats, sync)
        except (ValueError, RuntimeError) as e:
            # every rank refuses alike (the same model and optimizer),
            # before its first barrier
            if schedule not in REFUSING:
                raise
            refused[schedule] = str(e)
            continue
        extra[f"{schedule}+{coding}"] = seconds - alone
        profile.plans.setdefault(schedule, plan)
    progress.step("a streaming sync's step on a free wire")
    sync()
    seconds, alone, _ = free_wire_step(factory, "streaming", "int8", repeats, sync)
    free_net = Network(world=1, bandwidth=1.0)
    for name, seconds_beyond in extra.items():
        schedule, coding = name.split("+")
        modelled = model.predict_one(profile, free_net, schedule, coding) - profile.compute
        profile.overhead[name] = seconds_beyond - modelled
    profile.overhead["streaming-sync"] = max(0.0, seconds - alone - coding_cpu["int8"])
    wire_beside_seconds: list[float] = []
    if multi:
        progress.step("the link between the ranks")
        sync()
        profile.link, profile.wire_cpu_per_byte = link(engine, repeats)
        for coding in model.CODINGS:
            progress.step(f"the model's all-reduce with coding {coding}")
            reduction = Reduction(engine, params_of(work.model), coding)
            reduction.run()
            sync()
            profile.reduce[coding] = median_time(reduction.run, repeats)
        progress.step("the link's rate beside the computation")
        sync()
        profile.wire_rate_beside, alone, beside = wire_rate_beside(
            work, engine, profile.link.bandwidth, repeats)
        wire_beside_seconds = [alone, beside]
    profile.meta = provenance(factory)
    if refused:
        profile.meta["refused"] = refused
    if wire_beside_seconds:  # the all-reduce of every gradient alone and beside training
        profile.meta["wire_beside"] = wire_beside_seconds
    return with_peer_wait(agree(profile, engine, measured))


def with_peer_wait(profile: Profile) -> Profile:
    """`profile` with ``peer_wait`` from its measured reductions (each coding's
    time on the link beyond the model of it), once its CPU times are the
    job's (after :func:`agree`: the same on every rank)."""
    if profile.link is None or not profile.reduce:
        return profile
    net = model.local_network(profile, profile.link.world)
    return replace(profile, peer_wait={
        coding: max(0.0, seconds - model.reduction_alone(profile, net, coding))
        for coding, seconds in profile.reduce.items()})


def provenance(factory: Factory) -> dict[str, Any]:
    import hemiola

    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "hemiola": getattr(hemiola, "__version__", "?"),
            "model": f"{factory.__module__}:{factory.__name__}",
            "load": os.getloadavg()[0]}

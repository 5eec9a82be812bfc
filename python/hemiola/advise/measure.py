"""The measurements behind a profile, made where the job runs, with one
thread per rank as training runs; and short trial runs of configurations.

Every rank measures at the same time (the ranks share the machine as they
will in training); rank 0's numbers are broadcast (the overheads: every
rank's mean) so every rank holds the same profile. What is measured
(:class:`~hemiola.advise.profile.Profile`):

- the bare model: forward, backward, step, when each module's forward first
  reads its parameters and when backward produces each gradient (hooks);
- each configuration's wrapped step on a *free wire*: an engine of one rank
  (every collective returns at once, every copy and coding still runs), from
  which each schedule's issue order is read too. Its time less the model's
  prediction of it is the configuration's ``overhead``;
- each coding's CPU cost: one reduction of every gradient on a free wire;
- the contention: how much that reduction, run beside the bare step, delays
  it, per second of its CPU;
- streaming's sync: its step with a blocking sync every step on a free wire;
- on the job's own ranks, the link: all-reduces of two sizes (latency and
  bandwidth), the CPU the process spends per byte sent, one reduction of
  every gradient per coding (what it takes beyond the model of it is the
  ranks' ``meeting``), and the same reduction while every rank trains
  beside it (how fast the wire goes then).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hemiola.advise import model
from hemiola.advise.collective import Network, sent_bytes
from hemiola.advise.models import Factory, Workload, make_workload
from hemiola.advise.profile import Link, Param, Profile

#: all-reduce sizes that measure the link's latency and bandwidth (bytes)
SMALL, LARGE = 64 << 10, 16 << 20


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def training_step(model_: torch.nn.Module, loss_fn: Callable[[Any], torch.Tensor],
                  optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    loss_fn(model_).backward()
    optimizer.step()


def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


class Bare(NamedTuple):
    """The bare model's iteration on this rank (medians, seconds), each
    parameter's first read in the forward and its gradient's arrival in the
    backward, and every measured step's whole time (for :func:`agree`):
    begun together with the other ranks (`lockstep`) and on its own
    (`free`)."""

    forward: float
    backward: float
    step: float
    params: list[Param]
    lockstep: list[float]
    free: list[float]


def bare(work: Workload, repeats: int, sync: Callable[[], None] = lambda: None) -> Bare:
    """The bare model's iteration: `repeats` steps each begun by `sync()`
    (the job's barrier: every rank starts each step together, as a
    synchronous job's ranks do), then `repeats` steps one after another, as
    ranks that meet only every H steps run."""
    net = work.model
    params = params_of(net)
    index = {id(p): i for i, p in enumerate(params)}
    optimizer = work.make_optimizer(net.parameters())
    start = [0.0]
    need: list[list[float]] = [[] for _ in params]
    ready: list[list[float]] = [[] for _ in params]

    def read(own: list[int]) -> None:
        t = time.perf_counter() - start[0]
        for i in own:
            if len(need[i]) < len(times):
                need[i].append(t)

    def produced(i: int) -> None:
        if len(ready[i]) < len(times):
            ready[i].append(time.perf_counter() - start[0])

    handles = []
    for m in net.modules():
        own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
        if own:
            handles.append(m.register_forward_pre_hook(lambda *_, own=own: read(own)))
    for i, p in enumerate(params):
        handles.append(p.register_post_accumulate_grad_hook(lambda _, i=i: produced(i)))
    times: list[tuple[float, float, float]] = []
    training_step(net, work.loss_fn, optimizer)  # warm-up: the hooks record nothing yet
    try:
        for _ in range(repeats):
            times.append((0.0, 0.0, 0.0))  # this repetition's slot: hooks fill once
            sync()
            optimizer.zero_grad()
            start[0] = t0 = time.perf_counter()
            loss = work.loss_fn(net)
            start[0] = t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            times[-1] = (t1 - t0, t2 - t1, time.perf_counter() - t2)
    finally:
        for h in handles:
            h.remove()
    free = [median_time(lambda: training_step(net, work.loss_fn, optimizer), 1)
            for _ in range(repeats)]
    forward, backward, step = (statistics.median(t[k] for t in times) for k in range(3))
    out = []
    for i, p in enumerate(params):
        out.append(Param(p.numel(), p.element_size(), p.shape[0] if p.dim() > 1 else 0,
                         statistics.median(need[i]) if need[i] else 0.0,
                         statistics.median(ready[i]) if ready[i] else backward))
    return Bare(forward, backward, step, out, [sum(t) for t in times], free)


def _specs(params: list[torch.Tensor]) -> list[tuple[int, int, str, int]]:
    from hemiola.engine_tensors import dtype_code

    return [(dtype_code(p.dtype), p.numel(), f"p{i}", p.shape[0] if p.dim() > 1 else 0)
            for i, p in enumerate(params)]


class Reduction:
    """One all-reduce of every gradient through a reducer of `engine` with
    DDP's buckets, or buckets of `cap` bytes (the engine thread does it;
    start() returns at once)."""

    def __init__(self, engine: Any, params: list[torch.Tensor], coding: str,
                 cap: int = model.FUSION["wfbp"]) -> None:
        from hemiola.config import compression_code

        self.grads = [torch.randn_like(p) for p in params]
        self.reducer = engine.make_reducer(
            _specs(params), cap, model.FIRST_BUCKET, record_order=False,
            compression=compression_code(None if coding == "none" else coding),
            powersgd_start_iteration=0)

    def start(self) -> int:
        for i in reversed(range(len(self.grads))):  # backward order
            self.reducer.mark_ready(i, self.grads[i].data_ptr())
        return int(self.reducer.finish_marking())

    def run(self) -> None:
        self.reducer.wait(self.start())


def free_engine() -> tuple[Any, Any]:
    """An engine of one rank: every collective returns at once."""
    from hemiola._native import C

    store = C.MemoryStore()
    return C.Engine(0, 1, store), store


def free_wire_step(factory: Factory, schedule: str, coding: str, repeats: int,
                   sync: Callable[[], None] = lambda: None,
                   ) -> tuple[float, float, list[list[int]]]:
    """The configuration's wrapped step on a free wire and the bare step,
    timed in turns (so that both see the same load; median seconds each;
    each begun by `sync()`, so that every rank is in the same turn), and its
    buckets (parameter indices) in issue order, after the warm-up."""
    from hemiola.config import Config

    work, plain = make_workload(factory), make_workload(factory)
    plain_optimizer = plain.make_optimizer(plain.model.parameters())
    engine, store = free_engine()
    optimizer = work.make_optimizer(work.model.parameters())
    if schedule == "streaming":
        from hemiola.streaming import StreamingParallel

        # a blocking sync after every step: the sync's own cost, per step
        config = Config.from_kwargs(schedule="streaming", sync_every=1, compression=coding)
        wrapped: Any = StreamingParallel(work.model, config, engine, store, optimizer)
    else:
        from hemiola.data_parallel import DataParallel

        config = Config.from_kwargs(schedule=schedule, powersgd_start_iter=0,
                                    compression=None if coding == "none" else coding)
        wrapped = DataParallel(work.model, config, engine, store, None, optimizer)
        # hemiola.wrap's second half: the schedule takes the optimizer over
        optimizer = wrapped._schedule.wrap_optimizer(optimizer)
    for _ in range(3):
        training_step(wrapped, work.loss_fn, optimizer)
    wrapped.synchronize()
    training_step(plain.model, plain.loss_fn, plain_optimizer)
    wrapped_times, bare_times = [], []

    def burst() -> None:
        # Two steps and the wait for their reductions: priority's and
        # decoupled's reductions land after their step returns, and must not
        # land in the bare step's turn (they made overheads come out below 0).
        for _ in range(2):
            training_step(wrapped, work.loss_fn, optimizer)
        wrapped.synchronize()

    for _ in range(repeats):
        sync()
        wrapped_times.append(median_time(burst, 1) / 2)
        sync()
        bare_times.append(median_time(
            lambda: training_step(plain.model, plain.loss_fn, plain_optimizer), 1))
    wrapped.synchronize()
    seconds, alone = statistics.median(wrapped_times), statistics.median(bare_times)
    if schedule == "streaming":
        return seconds, alone, []
    names = {n: i for i, (n, p) in enumerate(
        (n, p) for n, p in work.model.named_parameters() if p.requires_grad)}
    return seconds, alone, [[names[n] for n in bucket] for bucket in wrapped.buckets()]


def contention(work: Workload, engine: Any, coding: str, repeats: int,
               sync: Callable[[], None] = lambda: None) -> float:
    """Extra seconds of the bare step per second of the engine's CPU work
    beside it, in [0, 1]: free-wire reductions of `coding` run back to back
    through a whole step, and the engine's CPU seconds meanwhile (the
    process's less the training thread's) are what delays it. Steps alone
    and beside are timed in turns, so both see the same load, each begun by
    `sync()` (the job's barrier: every rank in the same turn, else one
    rank's step alone shares the cores with another's load). (One
    reduction beside a step loads it with tens of milliseconds, against
    steps that vary by as much: its ratio came out anywhere in [0, 1] for
    the same model on the same machine.)"""
    net = work.model
    optimizer = work.make_optimizer(net.parameters())
    reduction = Reduction(engine, params_of(net), coding)
    reduction.run()

    def step() -> None:
        training_step(net, work.loss_fn, optimizer)

    alone, beside, engine_cpu = [], [], []
    for _ in range(repeats):
        sync()
        alone.append(median_time(step, 1))
        sync()
        done = threading.Event()

        def load(done: threading.Event = done) -> None:
            while not done.is_set():
                reduction.run()

        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        step()
        c1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
        done.set()
        thread.join()
        beside.append(w1 - w0)
        engine_cpu.append((c1 - c0) - (t1 - t0))
    cpu = statistics.median(engine_cpu)
    if cpu <= 0:
        return 0.0
    extra = statistics.median(beside) - statistics.median(alone)
    return min(1.0, max(0.0, extra / cpu))


def link(engine: Any, repeats: int) -> tuple[Link, float]:
    """The job's link (latency and bandwidth from ring all-reduces of two
    sizes) and the CPU seconds this process spends per byte it sends."""
    from hemiola._native import C

    n = engine.world_size
    times, cpu = {}, 0.0
    for size in (SMALL, LARGE):
        buf = torch.zeros(size // 4)

        def once(buf: torch.Tensor = buf) -> None:
            engine.all_reduce(buf.data_ptr(), int(C.DType.float32), buf.numel()).wait()

        once()
        engine.barrier().wait()
        c0 = time.process_time()
        times[size] = median_time(once, repeats)
        if size == LARGE:
            cpu = (time.process_time() - c0) / repeats / sent_bytes("all_reduce", n, size)
        engine.barrier().wait()
    factor = 2 * (n - 1) / n
    per_byte = max((times[LARGE] - times[SMALL]) / (factor * (LARGE - SMALL)), 1e-12)
    latency = max(0.0, (times[SMALL] - factor * SMALL * per_byte) / (2 * (n - 1)))
    return Link(n, latency, 1 / per_byte), cpu


def train_until(wait: Callable[[], None], step: Callable[[], None]) -> float:
    """Runs `step` again and again while `wait` (which must release the GIL
    while it blocks) runs on another thread; the seconds until `wait`
    returned. Its error is raised here once the step in progress ends: a
    failed collective ends the loop rather than leaving it training forever."""
    done = threading.Event()
    outcome: dict[str, Any] = {}
    start = time.perf_counter()

    def waiter() -> None:
        try:
            wait()
        except BaseException as e:  # handed to the training thread below
            outcome["error"] = e
        finally:
            outcome["end"] = time.perf_counter()
            done.set()

    thread = threading.Thread(target=waiter, daemon=True)  # never holds the process up
    thread.start()
    while not done.is_set():
        step()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return float(outcome["end"] - start)


def rate_beside(bandwidth: float, alone: float, beside: float) -> float:
    """The link's `bandwidth` slowed by an all-reduce's seconds `alone` over
    `beside` the computation, where beside is the slower, else 0 (no cap)."""
    return bandwidth * alone / beside if beside > alone else 0.0


def wire_rate_beside(work: Workload, engine: Any, bandwidth: float,
                     repeats: int) -> tuple[float, float, float]:
    """(rate, alone, beside): the seconds of one all-reduce of every gradient
    alone and while this rank trains beside it (medians; in turns, on every
    rank at once), and the link's `bandwidth` slowed by their ratio where
    beside is the slower (the collective's threads and sockets share the
    cores with the computation; its copies, which the model charges apart,
    slow alike, so the ratio and not the bytes over the time is kept), else
    0."""
    net = work.model
    optimizer = work.make_optimizer(net.parameters())
    reduction = Reduction(engine, params_of(net), "none")
    reduction.run()
    training_step(net, work.loss_fn, optimizer)
    alone, beside = [], []
    for _ in range(repeats):
        engine.barrier().wait()
        alone.append(median_time(reduction.run, 1))
        engine.barrier().wait()
        beside.append(train_until(reduction.run,
                                  lambda: training_step(net, work.loss_fn, optimizer)))
    slow, fast = statistics.median(beside), statistics.median(alone)
    return rate_beside(bandwidth, fast, slow), fast, slow


def measure(factory: Factory, repeats: int, engine: Any | None) -> Profile:
    """Every rank measures (collectively where `engine`, the job's, is given);
    the profile of rank 0 (with every rank's mean overheads, :func:`agree`)
    is returned on every rank."""
    torch.set_num_threads(1)
    sync = (lambda: engine.barrier().wait()) if engine is not None else (lambda: None)
    work = make_workload(factory)
    # the bare steps in lockstep, and thrice as many as other measurements:
    # a synchronous job's step is the slowest rank's each time (agree)
    measured = bare(work, 3 * repeats, sync)
    forward, backward, step, params = measured[:4]
    optimizer_name = type(work.make_optimizer(work.model.parameters())).__name__
    free, _ = free_engine()
    coding_cpu = {}
    for coding in (*model.CODINGS, "int4"):  # int4: streaming's outer wire
        sync()
        reduction = Reduction(free, params_of(work.model), coding)
        reduction.run()
        coding_cpu[coding] = median_time(reduction.run, repeats)
    # the contention of the per-step codings (int4 runs only on streaming's wire)
    costliest = max(model.CODINGS, key=lambda c: coding_cpu[c])
    sync()
    share = contention(work, free, costliest, repeats, sync)
    profile = Profile(forward, backward, step, params, coding_cpu=coding_cpu, contention=share,
                      optimizer=optimizer_name)
    # Each configuration's wrapped step beyond the bare one, on a free wire.
    extra: dict[str, float] = {}
    for schedule in model.SCHEDULES:
        for coding in model.CODINGS:
            sync()
            # thrice the repeats: each overhead is a small difference of two
            # medians of steps whose speed jitters by ±12% from one to the next
            seconds, alone, plan = free_wire_step(factory, schedule, coding, 3 * repeats, sync)
            extra[f"{schedule}+{coding}"] = seconds - alone
            profile.plans.setdefault(schedule, plan)
    sync()
    seconds, alone, _ = free_wire_step(factory, "streaming", "int8", repeats, sync)
    free_net = Network(world=1, bandwidth=1.0)
    for name, seconds_beyond in extra.items():
        schedule, coding = name.split("+")
        modelled = model.predict_one(profile, free_net, schedule, coding) - profile.compute
        profile.overhead[name] = seconds_beyond - modelled
    profile.overhead["streaming-sync"] = max(0.0, seconds - alone - coding_cpu["int8"])
    wire_beside_seconds: list[float] = []
    if engine is not None and engine.world_size > 1:
        sync()
        profile.link, profile.wire_cpu_per_byte = link(engine, repeats)
        for coding in model.CODINGS:
            reduction = Reduction(engine, params_of(work.model), coding)
            reduction.run()
            sync()
            profile.reduce[coding] = median_time(reduction.run, repeats)
        sync()
        profile.wire_rate_beside, alone, beside = wire_rate_beside(
            work, engine, profile.link.bandwidth, repeats)
        wire_beside_seconds = [alone, beside]
    profile.meta = provenance(factory)
    if wire_beside_seconds:  # the all-reduce of every gradient alone and beside training
        profile.meta["wire_beside"] = wire_beside_seconds
    return with_meeting(agree(profile, engine, measured))


def with_meeting(profile: Profile) -> Profile:
    """`profile` with ``meeting`` from its measured reductions (each coding's
    time on the link beyond the model of it), once its CPU times are the
    job's (after :func:`agree`: the same on every rank)."""
    if profile.link is None or not profile.reduce:
        return profile
    net = model.local_network(profile, profile.link.world)
    return replace(profile, meeting={
        coding: max(0.0, seconds - model.reduction_alone(profile, net, coding))
        for coding, seconds in profile.reduce.items()})


def provenance(factory: Factory) -> dict[str, Any]:
    import hemiola

    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "hemiola": getattr(hemiola, "__version__", "?"),
            "model": f"{factory.__module__}:{factory.__name__}",
            "load": os.getloadavg()[0]}


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

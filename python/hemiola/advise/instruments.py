"""The instruments behind a profile, on one machine: the bare model's
iteration (its parts, and when each parameter is read and its gradient
produced), a reduction of every gradient through an engine, an engine of one
rank whose collectives return at once (a *free wire*), a configuration's
wrapped step on it, and how much the engine's CPU work beside the
computation delays it (the contention).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hemiola.advise import model
from hemiola.advise.models import Factory, Workload, make_workload
from hemiola.advise.profile import Param


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def training_step(model_: torch.nn.Module, loss_fn: Callable[[Any], torch.Tensor],
                  optimizer: torch.optim.Optimizer) -> None:
    """One iteration: zero the gradients, forward and backward, step."""
    optimizer.zero_grad()
    loss_fn(model_).backward()
    optimizer.step()


def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """The trainable parameters, in registration order (the profile's)."""
    return [p for p in module.parameters() if p.requires_grad]


class Bare(NamedTuple):
    """The bare model's iteration on this rank (medians, seconds), each
    parameter's first read in the forward and its gradient's arrival in the
    backward, and every measured step's whole time (for :func:`~hemiola.advise.agreement.agree`):
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

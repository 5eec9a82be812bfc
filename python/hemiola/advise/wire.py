"""The instruments of the job's own link, measured on its ranks together:
its latency and bandwidth, the CPU a rank spends per byte it sends, and how
fast the wire goes while every rank trains beside it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hemiola.advise.collective import sent_bytes
from hemiola.advise.instruments import Reduction, median_time, params_of, training_step
from hemiola.advise.models import Workload
from hemiola.advise.profile import Link

#: all-reduce sizes that measure the link's latency and bandwidth (bytes)
SMALL, LARGE = 64 << 10, 16 << 20


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

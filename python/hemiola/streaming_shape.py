"""``streaming``'s fragments and overlap when the user leaves them out: chosen
from the wire's time measured at the first sync.

The run starts blocking, with one fragment (DiLoCo itself). At inner step
``sync_every`` (H) that first sync has been timed: ``W`` ms waiting for the
whole model's average, against ``T`` ms per inner step (the median of the
steps before it). ``r = W / T`` is what a sync costs in inner steps:

- ``r <= 5% of H``: the sync costs at most 5%; it stays blocking (the exact
  DiLoCo step, every rank equal after each sync);
- otherwise the average must travel under later steps: with F fragments one
  fragment takes about ``r / F`` steps on the wire, so the overlap is
  ``tau = ceil(1.5 r / F)`` (half again, for the link's jitter), which must
  stay below ``H / F`` (one fragment on the wire at a time). F is the largest
  of 4, 2, 1 that fits, since smaller fragments land sooner (a shorter
  delay, as Streaming DiLoCo found better) and send the same bytes;
- none fits (the link needs more than H steps for the model): F = 1 and the
  largest overlap, ``H - 1``, and a warning says to raise ``sync_every`` or
  compress (``compression="int8"``).

Every rank takes rank 0's choice, so the fragments agree; the choice is
logged (logger ``hemiola``) and is in ``model.stats()``.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import warnings
from dataclasses import dataclass

log = logging.getLogger("hemiola")

#: a sync that costs at most this fraction of H inner steps stays blocking
BLOCKING_SHARE = 0.05
#: the overlap covers the measured wire time times this
MARGIN = 1.5
#: fragment counts tried, most first
FRAGMENTS = (4, 2, 1)


@dataclass(frozen=True)
class Shape:
    """Fragments and overlap, and why."""

    fragments: int
    overlap: int
    reason: str
    keeps_up: bool = True  # False: the wire needs longer than the overlap allows


def choose(wire_ms: float, step_ms: float, sync_every: int) -> Shape:
    """The fragments and overlap for a sync of `wire_ms` (the whole model)
    when inner steps take `step_ms` (see the module's docstring)."""
    r = wire_ms / max(step_ms, 1e-3)
    cost = f"the first sync took {wire_ms:.0f} ms, {r:.2f} inner steps of {step_ms:.0f} ms"
    if r <= BLOCKING_SHARE * sync_every:
        return Shape(1, 0, f"{cost}: at most {BLOCKING_SHARE:.0%} of sync_every={sync_every}, "
                           "so syncs stay blocking")
    for f in FRAGMENTS:
        tau = math.ceil(MARGIN * r / f)
        if f <= sync_every and tau * f < sync_every:
            return Shape(f, tau, f"{cost}: {f} fragment(s), each landing {tau} inner steps "
                                 "after it is sent, hide it")
    return Shape(1, sync_every - 1,
                 f"{cost}: more than sync_every={sync_every} allows to hide; one fragment with "
                 f"the largest overlap ({sync_every - 1}) leaves the steps waiting. Raise "
                 "sync_every or send less (compression='int8' sends about a quarter)",
                 keeps_up=False)


class FirstSyncProbe:
    """Times the inner steps before the first sync and the sync itself."""

    def __init__(self, sync_every: int) -> None:
        self.sync_every = sync_every
        self._last: float | None = None
        self._intervals: list[float] = []

    def before_step(self, step: int) -> None:
        """Called as inner step `step` (1, 2, ...) is counted, before its sync."""
        now = time.perf_counter()
        if self._last is not None and step < self.sync_every:
            self._intervals.append(1e3 * (now - self._last))
        self._last = now

    def step_ms(self) -> float:
        """The median inner step (ms) before the first sync."""
        return statistics.median(self._intervals) if self._intervals else 0.0


def announce(shape: Shape, rank: int) -> None:
    """Logs the choice (rank 0), and warns where the link cannot keep up."""
    if rank != 0:
        return
    message = (f"hemiola streaming: fragments={shape.fragments}, overlap={shape.overlap} "
               f"({shape.reason})")
    log.info(message)
    if not shape.keeps_up:
        warnings.warn(message, stacklevel=4)

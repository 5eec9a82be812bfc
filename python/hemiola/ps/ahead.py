"""Which of ``eager``'s pulls are requested ahead of the worker's own push.

A pull requested when the forward ends (ahead) is answered at once, so it
streams in under backward and the next forward never waits for it, but it
lacks every push the other workers make during this backward: its gradient
will be staler. A pull requested after the push (at ``optimizer.step()``, as
``asp`` pulls) holds those pushes, but the next forward may have to wait for
it. The front layers are read first, so they are the ones that would wait.

The plan is either a fixed share of the bytes, front layers first, or
learned: every pull starts after the push, and a tensor whose pull keeps the
forward waiting is pulled ahead from then on. On a fast network that is the
first tensor or two; on a slow one, as many front layers as the next
forward needs before the rest can arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

#: A learned plan pulls a tensor ahead once its forward's wait for the pull
#: averages more than this share of an iteration.
STALL_SHARE = 0.01
#: Weight of the newest iteration in that average: a short late reply (the
#: machine busy for a moment) does not move a tensor ahead; a wait of over 5%
#: of an iteration does at once, and a shorter one that recurs within a few
#: iterations. A tensor moved ahead stays ahead: its pull no longer waits, so
#: nothing would tell when to move it back.
NEWEST_WEIGHT = 0.2
#: The first iterations, while the other workers may still be starting, are
#: not learnt from.
WARMUP_ITERATIONS = 3


class AheadPlan:
    """Chooses the tensors pulled ahead, from a fixed `fraction` of the bytes
    or (``None``) learned from how long the forward waited for each pull."""

    def __init__(self, numels: Sequence[int], fraction: float | None) -> None:
        self._numels = list(numels)
        self._total = sum(self._numels)
        self._fraction = fraction
        self._learned = [False] * len(numels)
        self._stall = [0.0] * len(numels)  # moving mean of wait / iteration time
        self._waits: dict[int, float] = {}  # this iteration's waits for pulls sent after the push
        self._iterations = 0

    def choose(self, order: Sequence[int]) -> list[int]:
        """The tensors to pull ahead, in `order` (the last forward's reads). A
        fixed fraction takes the front tensors until their elements reach it
        (so any fraction above 0 takes at least the first tensor)."""
        if self._fraction is None:
            return [i for i in order if self._learned[i]]
        budget = self._fraction * self._total
        ahead: list[int] = []
        taken = 0
        for i in order:
            if taken >= budget:
                break
            ahead.append(i)
            taken += self._numels[i]
        return ahead

    def waited(self, i: int, seconds: float) -> None:
        """The forward waited `seconds` for tensor i's pull, sent after the push."""
        self._waits[i] = seconds

    def iteration_ended(self, seconds: float) -> None:
        """Learns from the waits of an iteration that took `seconds`."""
        self._iterations += 1
        if self._fraction is not None or seconds <= 0 or self._iterations <= WARMUP_ITERATIONS:
            self._waits.clear()
            return
        for i, wait in self._waits.items():
            self._stall[i] = (1 - NEWEST_WEIGHT) * self._stall[i] + NEWEST_WEIGHT * wait / seconds
            if self._stall[i] > STALL_SHARE:
                self._learned[i] = True
        self._waits.clear()

"""Which of ``eager``'s pulls are requested ahead of the worker's own push.

A pull requested when the forward ends (ahead) is answered at once, so it
streams in under backward and the next forward never waits for it, but it
lacks every push the other workers make during this backward: its gradient
will be staler. A pull requested after the push (at ``optimizer.step()``, as
``asp`` pulls) holds those pushes, but the next forward may have to wait for
it. The front layers are read first, so they are the ones that would wait.

The plan is either a fixed share of the bytes, front layers first, or
learned: every pull starts after the push, and the tensors whose pulls keep
the forward waiting are moved ahead on trial. On a fast network that is the
first tensor or two; on a slow one, as many front layers as the next
forward needs before the rest can arrive. The trial keeps them ahead only
if the iterations get shorter by a real margin: a wait can also be the CPU
busy with other processes (the server, other workers on the same cores),
which pulling ahead does not remove, and then the staler gradients would be
bought for nothing.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

#: A learned plan pulls a tensor ahead once its forward's wait for the pull
#: averages more than this share of an iteration.
STALL_SHARE = 0.01
#: Weight of the newest iteration in that average: a short late reply (the
#: machine busy for a moment) does not stall a tensor; a wait of over 5% of an
#: iteration does at once, and a shorter one that recurs within a few
#: iterations.
NEWEST_WEIGHT = 0.2
#: The first iterations, while the other workers may still be starting, are
#: not learnt from.
WARMUP_ITERATIONS = 3
#: Iterations timed before a move (the pulls as they were, with the stall
#: present) and after it (the trial); their medians are compared. The
#: iteration right after a change is not timed: its forward took pulls sent
#: under the plan before it.
TRIAL_ITERATIONS = 10
#: A move is kept when the trial's median iteration is at least this share
#: shorter than before it. A pull ahead lacks the pushes the other workers
#: make during backward, so the gradients it leads to are staler and the run
#: needs more iterations (46% more on the loopback straggler benchmark, where
#: pulling everything ahead saved no time): a wait removed must buy real time.
#: A tensor kept ahead stays ahead (its pull no longer waits, so nothing
#: would tell when to move it back); one moved back is not tried again.
KEEP_GAIN = 0.1


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
        self._refused = [False] * len(numels)  # moved ahead on trial and back: stays after
        # Iteration times of this plan while some tensor stalls: the baseline,
        # left as it is while a trial runs.
        self._recent: deque[float] = deque(maxlen=TRIAL_ITERATIONS)
        self._trial: list[int] = []  # the tensors moved ahead on trial, now
        self._trial_times: list[float] = []
        self._untimed = 0  # iterations still to skip after a change of plan

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
        """Learns from the waits of an iteration that took `seconds`: once
        some tensor's pull keeps the forward waiting and the plan as it is has
        been timed with that wait, the stalled tensors go ahead on trial; a
        trial ends with them kept ahead or moved back."""
        self._iterations += 1
        waits, self._waits = self._waits, {}
        if self._fraction is not None or seconds <= 0 or self._iterations <= WARMUP_ITERATIONS:
            return
        for i, wait in waits.items():
            self._stall[i] = (1 - NEWEST_WEIGHT) * self._stall[i] + NEWEST_WEIGHT * wait / seconds
        if self._untimed:
            self._untimed -= 1
            return
        if self._trial:
            self._trial_times.append(seconds)
            if len(self._trial_times) >= TRIAL_ITERATIONS:
                self._end_trial()
            return
        stalled = [i for i, share in enumerate(self._stall)
                   if share > STALL_SHARE and not self._learned[i] and not self._refused[i]]
        if not stalled:
            self._recent.clear()  # the baseline must hold the waits a move would remove
            return
        self._recent.append(seconds)
        if len(self._recent) >= TRIAL_ITERATIONS:
            self._trial, self._trial_times = stalled, []
            for i in stalled:
                self._learned[i] = True
            self._untimed = 1

    def _end_trial(self) -> None:
        baseline = statistics.median(self._recent)
        if statistics.median(self._trial_times) > (1 - KEEP_GAIN) * baseline:
            for i in self._trial:
                self._learned[i] = False
                self._refused[i] = True
        self._trial, self._trial_times = [], []
        self._recent.clear()  # the next move is timed against the plan as it is now
        self._untimed = 1

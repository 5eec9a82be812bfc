"""``decoupled``: iteration t's reduction runs under the next iteration(s).

The dependency between iteration t's communication and iteration t+1's
computation is removed. After backward t the rank does not wait: its
optimizer step applies its *own* gradient g_local(t) to the exact parameters
w_t, giving approximate parameters w~_{t+1} on which iteration t+1 computes
while the all-reduce of iteration t proceeds. When the averaged gradient g(t)
has arrived, the exact step lands:

    w_{t+1} = step(w_t, state_t, g(t))       (exact, committed)

and the approximation is re-derived from it. The invariant, per parameter:

    live value = shadow (exact through its newest landed iteration)
                 stepped with the local gradient of every iteration after that
                 whose step was taken (at most ``in_flight`` of them)

When does an exact step land? As soon as it has arrived, but never while a
forward may still need the value it read: in the forward pre-hook of the
module that reads the parameter first (see ``hemiola.forward_gate``), or
in ``optimizer.step()``; and at the latest when ``in_flight`` iterations are
pending, in ``optimizer.step()``, which then waits. With
``correct_on_arrival=False`` it lands only then, which makes training
independent of network timing (bitwise reproducible).

By default the engine runs this schedule (``hemiola.schedules.native``: the
shadow, the landing graph and the SGD / Adam / AdamW steps in C++, see
cpp/include/hemiola/updater.h). This module is the path for everything else
(other optimizers, GPU parameters by default): the exact parameters
and optimizer state live in a shadow copy; both steps are the user's own
optimizer (the others' gradients hidden), so every
``torch.optim`` optimizer whose update is per parameter works (SGD with
momentum/Nesterov/weight decay, Adam, AdamW, RMSprop, ...), learning-rate
schedulers included (each step uses the hyper-parameters its iteration ran
with). Every rank computes the shadow from the same inputs with the same
arithmetic, so the exact parameters are bitwise identical across ranks. For
the SGD family this equals the linear correction w <- w~ + lr (g_local - g)
(and the same for the momentum buffer); computing it from the shadow instead
keeps ranks from drifting apart by rounding.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any

import torch

from hemiola.config import Config
from hemiola.replica import Replica
from hemiola.schedules.base import Clip
from hemiola.schedules.torch_update import PendingUpdate, TorchUpdate, hyper_parameters


def _copy_state(src: dict[str, Any], dst: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of optimizer state `src`, reusing `dst`'s tensors where they fit."""
    out: dict[str, Any] = {}
    for key, value in src.items():
        if isinstance(value, torch.Tensor):
            old = dst.get(key) if dst is not None else None
            if (isinstance(old, torch.Tensor) and old.shape == value.shape
                    and old.dtype == value.dtype and old is not value):
                out[key] = old.copy_(value)
            else:
                out[key] = value.detach().clone()
        else:
            out[key] = copy.deepcopy(value)
    return out


class _Iteration(PendingUpdate):
    """An iteration whose local step was taken and whose exact step has not
    landed for every parameter yet."""

    def __init__(self, iteration: int, hyper: list[dict[str, Any]], unmarked: list[int] | None,
                 clip: Clip | None,
                 local_grads: list[torch.Tensor | None] | None, check_finite: bool) -> None:
        super().__init__(iteration, hyper, unmarked, clip, check_finite)
        # Copies of the local gradients, to re-take the local step after an
        # older iteration lands (only needed with in_flight > 1).
        self.local_grads = local_grads


class Decoupled(TorchUpdate):
    """The decoupled schedule stepping with torch's optimizer (the fallback of
    ``hemiola.schedules.native``); see the module docstring."""

    @classmethod
    def reducer_needs(cls, config: Config, optimizer: Any,
                      device: torch.device) -> tuple[int, bool]:
        return config.in_flight, False

    def __init__(self, replica: Replica, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(replica, optimizer, grad_scaler)
        self._on_arrival = replica.config.correct_on_arrival
        # Exact parameters and optimizer state, per parameter index.
        self._shadow_params = [p.detach().clone() for p in replica.params]
        self._shadow_state: list[dict[str, Any]] = [{} for _ in replica.params]
        # Per parameter: the newest iteration whose exact step is in the shadow.
        self._landed = [-1] * len(replica.params)
        self._pending: deque[_Iteration] = deque()
        # Elements read by forwards in total, and while still approximate.
        self._reads = 0
        self._approximate_reads = 0
        # The first iteration's results must outlive the rebuild of the
        # buckets that follows it (see step()).
        replica.gather_all_results = not self._rebuilt

    # ---- optimizer side ------------------------------------------------------

    def step(self) -> None:
        """``optimizer.step()``: land what has arrived (and, waiting, what the
        in-flight bound requires), then take this iteration's local step."""
        self.check_grads_untouched()
        overflow = self.take_scaler_state()
        self._read.clear()
        iteration, self._finished = self._finished, None
        everything = list(range(len(self.replica.params)))
        if iteration is None:  # no synchronised backward since the last step
            self._advance(everything, must=len(self._pending))
            self._inner_step()
            self._commit(everything)
            return
        if not self._members:
            self.refresh_buckets()
        usage = None
        if not self._rebuilt:
            # The first iteration takes the same steps as every other (the
            # local step now, the exact one later), so that a run resumed
            # from a checkpoint repeats the run that saved it. Only its timing
            # differs: the reduction is waited for here so that the buckets
            # can be rebuilt in the observed order; its results were written
            # to tensors of the model's and outlive the rebuild.
            reducer = self.replica.reducer
            reducer.wait(iteration, stream=self.replica.stream())
            if iteration in self._unmarked:
                usage = reducer.usage(iteration)
            reducer.rebuild_from_observed_order()
            self.refresh_buckets()
            self._rebuilt = True
            self.replica.gather_all_results = False
        self._advance(everything, must=len(self._pending) + 1 - self.in_flight)
        hyper = hyper_parameters(self._optimizer)
        # From the live values with the local gradient; none if it overflowed
        # (the exact step is then skipped too: the average is not finite).
        if not overflow:
            with self.replica.timeline.span("compute", f"local step {iteration}",
                                            "step"):
                self._inner_step()  # from the live values, which are the exact ones
        local = None
        if self.in_flight > 1:
            local = [None if p.grad is None or overflow else p.grad.detach().clone()
                     for p in self.replica.params]
        pending = _Iteration(iteration, hyper, self._unmarked.pop(iteration, None),
                             self.take_clip(iteration), local, self.scaling)
        pending.usage = usage
        self._pending.append(pending)

    def shadow_of(self, index: int) -> torch.Tensor:
        return self._shadow_params[index]

    def synchronize(self) -> None:
        self._advance(list(range(len(self.replica.params))), must=len(self._pending))
        self._buffers.finish()

    def parameters_replaced(self) -> None:
        # Whatever was pending belongs to the old parameters.
        for pending in self._pending:
            self.replica.release_gathered(pending.iteration)
        self._pending.clear()
        self._commit(list(range(len(self.replica.params))))

    def land_before_forward(self, indices: list[int]) -> None:
        if self._pending and self._on_arrival:
            # Everything that has arrived and that no forward read since the
            # last backward, not only `indices`: one optimizer step.
            self._advance(self.unread(list(range(len(self.replica.params)))), must=0)
        if torch.is_grad_enabled():
            newest = self._pending[-1].iteration if self._pending else -1
            params = self.replica.params
            for i in indices:
                self._reads += params[i].numel()
                if self._landed[i] < newest:
                    self._approximate_reads += params[i].numel()

    def stats(self) -> dict[str, float]:
        return {"approximate_read_fraction": self._approximate_reads / max(1, self._reads)}

    # ---- landing -------------------------------------------------------------

    def _advance(self, indices: list[int], must: int) -> None:
        """Lands exact steps for parameters `indices`: of the `must` oldest
        pending iterations waiting for their reductions, of the newer ones
        those that have arrived (if correcting on arrival). Per parameter the
        steps land in order; then the approximation is re-derived."""
        recorder = self.replica.timeline
        plan: list[tuple[_Iteration, list[int]]] = []
        blocked: set[int] = set()  # an older iteration has not landed for them
        for age, pending in enumerate(self._pending):
            it = pending.iteration
            wanted = [i for i in indices if i not in blocked and self._landed[i] < it]
            if not wanted:
                continue
            if age < must:
                self.wait_for(pending, wanted)
                ready = wanted
            elif self._on_arrival and not pending.needs_whole:
                ready = self.arrived(it, wanted)
            else:
                ready = []
            blocked.update(set(wanted) - set(ready))
            if ready:
                plan.append((pending, ready))
        if not plan:
            return
        start = recorder.now()
        touched = sorted({i for _, ready in plan for i in ready})
        self._restore(touched)
        for pending, ready in plan:
            self.apply_reduced(pending, set(ready))
            self._commit(ready)
            for i in ready:
                self._landed[i] = pending.iteration
        # Re-take the local steps of the iterations still pending for them.
        for pending in self._pending:
            again = {i for i in touched if self._landed[i] < pending.iteration}
            if again:
                assert pending.local_grads is not None, "in_flight == 1 never re-steps"
                self.step_with([g if i in again else None
                                for i, g in enumerate(pending.local_grads)], pending.hyper)
        while self._pending and min(self._landed) >= self._pending[0].iteration:
            self.replica.release_gathered(self._pending.popleft().iteration)
        recorder.record("compute", f"exact step ({len(touched)} parameters)", "correction",
                        start)

    def _restore(self, indices: list[int]) -> None:
        """Live parameters and optimizer state `indices` <- the shadow."""
        opt = self._optimizer
        params = self.replica.params
        with torch.no_grad():
            for i in indices:
                p = params[i]
                p.copy_(self._shadow_params[i])
                if opt is not None:
                    opt.state[p] = _copy_state(self._shadow_state[i], opt.state.get(p))

    def _commit(self, indices: list[int]) -> None:
        """The live parameters and optimizer state `indices` are exact:
        remember them."""
        opt = self._optimizer
        params = self.replica.params
        with torch.no_grad():
            for i in indices:
                p = params[i]
                self._shadow_params[i].copy_(p)
                if opt is not None:
                    self._shadow_state[i] = _copy_state(opt.state.get(p, {}),
                                                        self._shadow_state[i])

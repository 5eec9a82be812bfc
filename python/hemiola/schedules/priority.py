"""``priority``: exact synchronous SGD with layer-wise overlap (the
ByteScheduler / P3 idea, with a fixed order instead of a tuned one).

Same math as ``wfbp``, different timing:

- ``backward()`` returns without waiting; ``optimizer.step()`` applies the
  update of each bucket whose reduction has arrived and defers the rest.
- The next forward of a module waits only for the buckets of the parameters
  it reads first (a forward pre-hook waits for them and applies their update;
  which module reads a parameter first is learnt in the first forward, see
  ``hemiola.forward_gate``), so the front layers compute while the rest is
  still being reduced. A parameter that receives a gradient while its update
  is still pending was read before it was updated: that is an error, never a
  silently stale gradient.
- Front layers get priority: after the bucket plan is rebuilt in backward
  order, the buckets that hold the first ``priority_front_fraction`` of the
  gradient bytes (the front layers, whose gradients are ready last) are
  issued front-first once backward is done, instead of back-to-front. The
  issue order is a fixed permutation derived from the plan, so it is the same
  on every rank without negotiation.
- Large tensors are partitioned (``partition_mb``, 4 MiB by default) into
  pieces in separate buckets, so the tail of a huge tensor can wait behind
  the front layers' buckets; a parameter is updated once all its pieces are
  reduced.

By default the engine runs this schedule (``hemiola.schedules.native``: the
landing graph and the SGD / Adam / AdamW step in C++). This module is the
path for everything else: each bucket's update is the user's own optimizer
stepping only that bucket's parameters (the others' gradients are hidden),
with the hyper-parameters of the iteration it belongs to, so every
``torch.optim`` optimizer whose update is per parameter works, LR schedulers
included.
"""

from __future__ import annotations

from typing import Any

import torch

from hemiola.replica import Replica
from hemiola.schedules.base import Clip
from hemiola.schedules.torch_update import PendingUpdate, TorchUpdate, hyper_parameters


class _Pending(PendingUpdate):
    """An iteration whose update is partly applied."""

    def __init__(self, iteration: int, hyper: list[dict[str, Any]], unmarked: list[int] | None,
                 clip: Clip | None, params: int, check_finite: bool) -> None:
        super().__init__(iteration, hyper, unmarked, clip, check_finite)
        self.remaining = set(range(params))  # parameters not updated yet


class Priority(TorchUpdate):
    """The priority schedule stepping with torch's optimizer (the fallback of
    ``hemiola.schedules.native``); see the module docstring."""

    def __init__(self, replica: Replica, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(replica, optimizer, grad_scaler)
        self._pending: _Pending | None = None

    def synchronize(self) -> None:
        self._apply_all()

    def parameters_replaced(self) -> None:
        self._pending = None

    def land_before_forward(self, indices: list[int]) -> None:
        pending = self._pending
        if pending is not None:
            todo = [i for i in indices if i in pending.remaining]
            if todo:
                self._update(pending, todo, wait=True)

    def mark(self, index: int, grad: torch.Tensor) -> None:
        pending = self._pending
        if pending is not None and index in pending.remaining:
            m = self.replica
            lander = self._gate.lander.get(index)
            message = (
                f"schedule='priority': parameter {m.names[index]!r} was read in this forward "
                "before its update from the previous iteration was applied, so its gradient "
                "would be wrong. Its update is applied in the forward pre-hook of the module "
                f"that read it first in the first training forward ({type(lander).__name__}); "
                "that module did not run first this time. Use schedule='wfbp' for models whose "
                "order of parameter reads changes between iterations."
            )
            m.reducer.abort(message)
            raise RuntimeError(message)
        super().mark(index, grad)

    # ---- optimizer side ------------------------------------------------------

    def step(self) -> None:
        self.check_grads_untouched()
        self.take_scaler_state()  # an overflow shows in the reduced gradients
        self._apply_all()  # whatever the previous iteration left (rare)
        iteration, self._finished = self._finished, None
        if iteration is None:  # no synchronised backward since the last step
            self._inner_step()
            return
        if not self._members:
            self.refresh_buckets()
        pending = _Pending(iteration, hyper_parameters(self._optimizer),
                           self._unmarked.pop(iteration, None), self.take_clip(iteration),
                           len(self.replica.params), self.scaling)
        self._pending = pending
        if not self._rebuilt:
            # The first iteration runs synchronously; then the buckets are
            # rebuilt in the observed order and the issue order is derived.
            self._apply_all()
            reducer = self.replica.reducer
            reducer.rebuild_from_observed_order()
            self.refresh_buckets()
            reducer.set_issue_order(self._priority_order())
            self._rebuilt = True
            return
        if not pending.needs_whole:
            self._update(pending, sorted(pending.remaining), wait=False)

    def _priority_order(self) -> list[int]:
        """Plan order (backward order), except that the buckets holding the
        front layers' first `priority_front_fraction` of the bytes go last,
        front-most first."""
        params = self.replica.params
        sizes = [sum(params[i].numel() * params[i].element_size() / len(self._buckets_of[i])
                     for i in members) for members in self._members]
        budget = self.replica.config.priority_front_fraction * sum(sizes)
        tail: list[int] = []
        covered = 0.0
        for b in reversed(range(len(sizes))):  # the last buckets hold the front layers
            if covered >= budget or len(tail) == len(sizes) - 1:
                break
            tail.append(b)
            covered += sizes[b]
        head = [b for b in range(len(sizes)) if b not in set(tail)]
        return head + tail  # tail is already front-most first

    def _apply_all(self) -> None:
        pending = self._pending
        if pending is None:
            return
        if pending.remaining:
            self._update(pending, sorted(pending.remaining), wait=True)
        self._pending = None
        self._buffers.finish()

    def _update(self, pending: _Pending, wanted: list[int], wait: bool) -> None:
        """Applies the update of the parameters in `wanted` (waiting for their
        buckets if `wait`, else only those already reduced), and of every other
        unread parameter whose buckets are reduced by then: one optimizer step."""
        recorder = self.replica.timeline
        it = pending.iteration
        if wait:
            self.wait_for(pending, wanted)
        # Besides `wanted`, only parameters no forward has read since the last
        # backward: updating one that was read would change a value autograd
        # may still need.
        # What was waited for is ready (on a GPU: ordered on the current
        # stream, though maybe not complete yet); the rest only if complete.
        waited = set(wanted) & pending.remaining if wait else set()
        others = set(self.unread(sorted(pending.remaining))) - waited
        ready = sorted(waited | set(self.arrived(it, sorted(others))))
        if not ready:
            return
        start = recorder.now()
        chosen = set(ready)
        self.apply_reduced(pending, chosen)
        pending.remaining -= chosen
        recorder.record("compute", f"update {len(ready)} parameters ({it})", "step", start)

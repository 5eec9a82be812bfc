"""``priority``: exact synchronous SGD with layer-wise overlap (the
ByteScheduler / P3 idea, with a fixed order instead of a tuned one).

Same math as ``wfbp``, different timing:

- ``backward()`` returns without waiting; ``optimizer.step()`` applies the
  update of each bucket whose reduction has arrived and defers the rest.
- The next forward of a module waits only for its own parameters' buckets
  (a forward pre-hook waits for them and applies their update), so the front
  layers compute while the rest is still being reduced.
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

Each bucket's update is the user's own optimizer stepping only that bucket's
parameters (the others' gradients are hidden), with the hyper-parameters of
the iteration it belongs to, so every ``torch.optim`` optimizer whose update
is per parameter works, LR schedulers included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hemiola.schedules.base import DeferredSchedule, hyper_parameters, set_hyper_parameters


class _Pending:
    """An iteration whose update is partly applied."""

    def __init__(self, iteration: int, hyper: list[dict[str, Any]], unmarked: list[int] | None,
                 params: int) -> None:
        self.iteration = iteration
        self.hyper = hyper
        self.unmarked = unmarked
        self.remaining = set(range(params))  # parameters not updated yet


class Priority(DeferredSchedule):
    """The priority schedule; see the module docstring."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        super().__init__(model)
        self._pending: _Pending | None = None
        self._members: list[list[int]] = []     # per bucket: its parameters
        self._buckets_of: list[list[int]] = []  # per parameter: its buckets (pieces)
        index_of = {id(p): i for i, p in enumerate(model._params)}
        # Forward pre-hooks: a module waits only for the parameters it owns.
        for module in model.module.modules():
            owned = [index_of[id(p)] for p in module.parameters(recurse=False)
                     if id(p) in index_of]
            if owned:
                module.register_forward_pre_hook(self._pre_forward_hook(owned))

    def synchronize(self) -> None:
        self._apply_all()

    def parameters_replaced(self) -> None:
        self._pending = None

    def _pre_forward_hook(self, owned: list[int]) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            pending = self._pending
            if pending is not None:
                todo = [i for i in owned if i in pending.remaining]
                if todo:
                    self._update(pending, todo, wait=True)
        return hook

    # ---- optimizer side ------------------------------------------------------

    def step(self) -> None:
        self._apply_all()  # whatever the previous iteration left (rare)
        iteration, self._finished = self._finished, None
        if iteration is None:  # no synchronised backward since the last step
            self._inner_step()
            return
        if not self._members:
            self._refresh_buckets()
        pending = _Pending(iteration, hyper_parameters(self._optimizer),
                           self._unmarked.pop(iteration, None), len(self.model._params))
        self._pending = pending
        if not self._rebuilt:
            # The first iteration runs synchronously; then the buckets are
            # rebuilt in the observed order and the issue order is derived.
            self._apply_all()
            reducer = self.model._reducer
            reducer.rebuild_from_observed_order()
            self._refresh_buckets()
            reducer.set_issue_order(self._priority_order())
            self._rebuilt = True
            return
        if pending.unmarked is None:  # usage counts would need the whole iteration
            self._update(pending, sorted(pending.remaining), wait=False)

    def _refresh_buckets(self) -> None:
        self._members = self.model._reducer.buckets()
        self._buckets_of = [[] for _ in self.model._params]
        for b, members in enumerate(self._members):
            for i in members:
                self._buckets_of[i].append(b)

    def _priority_order(self) -> list[int]:
        """Plan order (backward order), except that the buckets holding the
        front layers' first `priority_front_fraction` of the bytes go last,
        front-most first."""
        params = self.model._params
        sizes = [sum(params[i].numel() * params[i].element_size() / len(self._buckets_of[i])
                     for i in members) for members in self._members]
        budget = self.model.config.priority_front_fraction * sum(sizes)
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
        parameter whose buckets are reduced by then: one optimizer step."""
        m = self.model
        reducer = m._reducer
        recorder = m.timeline_recorder
        it = pending.iteration
        if wait:
            needed = {b for i in wanted for b in self._buckets_of[i]}
            with recorder.span("compute", f"wait buckets {sorted(needed)} ({it})", "wait"):
                if pending.unmarked:
                    reducer.wait(it)  # usage counts come at the very end
                else:
                    for b in reducer.issue_order():
                        if b in needed:
                            reducer.wait_bucket(it, b)
        ready = [i for i in sorted(pending.remaining)
                 if all(reducer.bucket_done(it, b) for b in self._buckets_of[i])]
        if not ready:
            return
        usage = reducer.usage(it) if pending.unmarked else None
        start = recorder.now()
        opt = self._optimizer
        assert opt is not None
        chosen = set(ready)
        saved = [p.grad for p in m._params]
        current_hyper = hyper_parameters(opt)
        with torch.no_grad():
            for i, p in enumerate(m._params):
                used = i in chosen and (usage is None or usage[i] > 0)
                p.grad = m._reduced(it, i) if used else None
            set_hyper_parameters(opt, pending.hyper)
            self._inner_step()
            set_hyper_parameters(opt, current_hyper)
            for p, g in zip(m._params, saved):
                p.grad = g
        pending.remaining -= chosen
        recorder.record("compute", f"update {len(ready)} parameters ({it})", "step", start)

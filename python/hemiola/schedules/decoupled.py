"""``decoupled``: iteration t's reduction runs under the whole of iteration t+1.

The dependency between iteration t's communication and iteration t+1's
computation is removed. After backward t the rank does not wait: its
optimizer step applies its *own* gradient g_local(t) to the exact parameters
w_t, giving approximate parameters w~_{t+1} on which iteration t+1 computes
while the all-reduce of iteration t proceeds. At the next ``optimizer.step()``
the averaged gradient g(t) has arrived, and the exact step lands:

    w_{t+1} = step(w_t, state_t, g(t))       (exact, committed)
    w~_{t+2} = step(w_{t+1}, state_{t+1}, g_local(t+1))   (approximate, not committed)

The exact parameters and optimizer state live in a shadow copy; both steps
are the user's own optimizer, so every ``torch.optim`` optimizer works (SGD
with momentum/Nesterov/weight decay, Adam, AdamW, RMSprop, ...), learning-rate
schedulers included (each exact step uses the hyper-parameters its iteration
ran with). Because every rank computes the shadow from the same inputs with
the same arithmetic, the exact parameters are bitwise identical across ranks.
For the SGD family this equals the linear correction w <- w~ + lr (g_local - g)
(and the same for the momentum buffer); computing it from the shadow instead
keeps ranks from drifting apart by rounding.

Parameters are never written while autograd may read them: the exact step
lands in ``optimizer.step()`` (after backward) or ``synchronize()``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from hemiola.schedules.base import DeferredSchedule, hyper_parameters, set_hyper_parameters


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


class Decoupled(DeferredSchedule):
    """The decoupled schedule; see the module docstring."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        super().__init__(model)
        # Exact parameters w_t and optimizer state (per parameter index).
        self._shadow_params = [p.detach().clone() for p in model._params]
        self._shadow_state: list[dict[str, Any]] = [{} for _ in model._params]
        # The iteration whose exact step is pending (with its hyper-parameters
        # and the parameters it had no gradient for).
        self._pending: tuple[int, list[dict[str, Any]], list[int] | None] | None = None

    # ---- optimizer side ------------------------------------------------------

    def step(self) -> None:
        """``optimizer.step()``: land the previous iteration's exact step, then
        take this iteration's local (approximate) step."""
        self._land()
        iteration, self._finished = self._finished, None
        if iteration is None:  # no synchronised backward since the last step
            self._inner_step()
            self._commit_shadow()
            return
        if not self._rebuilt:
            # The first iteration runs synchronously: its exact step is taken
            # at once, then the buckets are rebuilt in the observed order
            # (which needs every reduction finished).
            self._pending = (iteration, hyper_parameters(self._optimizer),
                             self._unmarked.pop(iteration, None))
            self._land()
            self.model._reducer.rebuild_from_observed_order()
            self._rebuilt = True
            return
        hyper = hyper_parameters(self._optimizer)
        with self.model.timeline_recorder.span("compute", f"local step {iteration}", "step"):
            self._inner_step()  # from the exact w_t with the local gradient: w~_{t+1}
        self._pending = (iteration, hyper, self._unmarked.pop(iteration, None))

    def synchronize(self) -> None:
        self._land()

    def parameters_replaced(self) -> None:
        # Whatever was pending belongs to the old parameters.
        self._pending = None
        self._commit_shadow()

    def _land(self) -> None:
        """Replaces the approximate parameters by the exact step of the
        pending iteration (waiting for its reduction if needed)."""
        if self._pending is None:
            return
        iteration, hyper, unmarked = self._pending
        self._pending = None
        m = self.model
        opt = self._optimizer
        assert opt is not None
        recorder = m.timeline_recorder
        with recorder.span("compute", f"wait reduction {iteration}", "wait"):
            m._reducer.wait(iteration)
        start = recorder.now()
        usage = m._reducer.usage(iteration) if unmarked else None
        params = m._params
        local_grads = [p.grad for p in params]
        current_hyper = hyper_parameters(opt)
        with torch.no_grad():
            for i, p in enumerate(params):
                p.copy_(self._shadow_params[i])
                opt.state[p] = _copy_state(self._shadow_state[i], opt.state.get(p))
                globally_unused = usage is not None and usage[i] == 0
                p.grad = None if globally_unused else m._reduced(iteration, i)
            set_hyper_parameters(opt, hyper)
            self._inner_step()
            set_hyper_parameters(opt, current_hyper)
            self._commit_shadow()
            for p, g in zip(params, local_grads):
                p.grad = g
        recorder.record("compute", f"exact step {iteration}", "correction", start)
        self._buffers.finish()

    def _commit_shadow(self) -> None:
        """The live parameters and optimizer state are exact: remember them."""
        opt = self._optimizer
        with torch.no_grad():
            for i, p in enumerate(self.model._params):
                self._shadow_params[i].copy_(p)
                if opt is not None:
                    self._shadow_state[i] = _copy_state(opt.state.get(p, {}),
                                                        self._shadow_state[i])

"""torch's own optimizer step, taken for the engine's updater: its external
stepper (``ExternalStepper`` in cpp/include/hemiola/updater.h).

The engine's landing graph decides when which parameters land, as it does
for the optimizers it steps itself; for any other per-parameter optimizer
(RMSprop, Adagrad, Adamax, ...), for parameters its own steps cannot take,
and for ``native_optimizer=False``, it calls :class:`TorchStep` once per
landing group, inside an engine call on the training thread. The step is the
user's optimizer stepping only that group's parameters (its param groups hold
only them for the call), with the group's reduced gradients as ``.grad`` and
the hyper-parameters of the iteration the update belongs to, so learning-rate
schedulers keep working.

The optimizer's state (``optimizer.state``) is the exact state between
calls, as with the engine's own steps, so ``state_dict()`` is torch's. Before
each call the engine has written the exact parameter values into the live
ones; a committed step advances both. ``decoupled``'s local steps (from its
own gradient, or a preview's estimate) step a scratch copy of the state and
leave the exact state as it was; several pending iterations chain local steps
through that copy.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hemiola.engine_tensors import device_view
from hemiola.schedules.takeover import hyper_parameters

#: ExternalStepper's StepMode
COMMIT, LOCAL, LOCAL_AGAIN = 0, 1, 2


def copy_state(src: dict[str, Any], dst: dict[str, Any] | None) -> dict[str, Any]:
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


def dense(p: torch.Tensor) -> bool:
    """`p`'s elements fill its memory without gaps or overlap, in some order
    of dimensions (contiguous, channels_last, ...): the engine copies such a
    parameter as one block of ``numel * element_size`` bytes."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(p.stride(), p.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class TorchStep:
    """The external stepper of one wrapped model: see the module docstring.
    `inner_step` is the optimizer's own ``step`` (the schedule took over the
    public one)."""

    def __init__(self, optimizer: torch.optim.Optimizer, inner_step: Callable[[], Any],
                 params: list[torch.Tensor], keep: int) -> None:
        self._optimizer = optimizer
        self._inner_step = inner_step
        self._params = params
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups)
                    for p in group["params"]}
        self._group_of = [group_of[id(p)] for p in params]
        # Hyper-parameter snapshots by key: the iterations still pending
        # are at most `keep` steps old.
        self._keep = keep
        self._hyper: dict[int, list[dict[str, Any]]] = {}
        self._next_key = 0
        # Per parameter index: the state of its local steps (LOCAL copies the
        # exact state here, LOCAL_AGAIN goes on from it).
        self._scratch: dict[int, dict[str, Any]] = {}

    def callback(self) -> Callable[..., None]:
        """What the engine calls. It holds this object weakly: the engine's
        updater belongs to the schedule that owns this, and a strong
        reference through C++ would be a cycle the collector cannot see."""
        ref = weakref.ref(self)

        def step(indices: list[int], grads: list[Any], key: int, grad_scale: float,
                 mode: int) -> None:
            stepper = ref()
            if stepper is None:
                raise RuntimeError("hemiola: the model's schedule is gone")
            stepper.step(indices, grads, key, grad_scale, mode)

        return step

    def remember(self) -> int:
        """A key to the hyper-parameters the optimizer holds now (the
        iteration's), for the updater's steps of this iteration."""
        key = self._next_key
        self._next_key += 1
        self._hyper[key] = hyper_parameters(self._optimizer)
        self._hyper.pop(key - self._keep, None)
        return key

    def forget_scratch(self) -> None:
        """The parameters were replaced: local steps start afresh."""
        self._scratch.clear()

    def step(self, indices: list[int], grads: list[Any], key: int, grad_scale: float,
             mode: int) -> None:
        """Parameters `indices` take one step of the user's optimizer with
        `grads` (engine memory: memoryviews on the CPU, pointers on a GPU)
        times `grad_scale`, and the hyper-parameters remembered as `key`."""
        opt = self._optimizer
        params = self._params
        chosen = [params[i] for i in indices]
        views = [self._view(g, p) for g, p in zip(grads, chosen)]
        if grad_scale != 1.0:
            views = [g * grad_scale for g in views]
        groups = opt.param_groups
        hyper = self._hyper[key]
        members = [group["params"] for group in groups]
        current = [{k: group[k] for k in h} for group, h in zip(groups, hyper)]
        saved_grads = [p.grad for p in chosen]
        exact: list[dict[str, Any] | None] = []
        try:
            for group, h in zip(groups, hyper):
                group["params"] = []
                group.update(h)
            for i, p, g in zip(indices, chosen, views):
                groups[self._group_of[i]]["params"].append(p)
                p.grad = g
            if mode != COMMIT:
                state = opt.state
                for i, p in zip(indices, chosen):
                    exact.append(state.get(p))
                    if mode == LOCAL:
                        self._scratch[i] = copy_state(exact[-1] or {}, self._scratch.get(i))
                    state[p] = self._scratch[i]
            self._inner_step()
        finally:
            for group, ps, h in zip(groups, members, current):
                group["params"] = ps
                group.update(h)
            for p, g in zip(chosen, saved_grads):
                p.grad = g
            for p, s in zip(chosen, exact):
                if s is None:
                    opt.state.pop(p, None)
                else:
                    opt.state[p] = s

    @staticmethod
    def _view(grad: Any, p: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like `p` over the engine's gradient `grad`."""
        if isinstance(grad, int):
            return device_view(grad, p)
        if p.numel() == 0:
            return torch.zeros_like(p, memory_format=torch.contiguous_format)
        return torch.frombuffer(grad, dtype=p.dtype).view(p.shape)

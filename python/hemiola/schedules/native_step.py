"""The engine's optimizer step (``hemiola._C.optim``, the same one the
parameter server uses) for the schedules that take over the user's optimizer.

For ``torch.optim.SGD``, ``Adam`` and ``AdamW`` the schedules step with the
engine instead of calling the optimizer: one native call per parameter, on
the optimizer's own state tensors (created in torch's format), so that
``optimizer.state_dict()`` stays torch's. ``decoupled`` uses the engine's
shadow semantics: the approximate step writes only the live parameter,
computed from the exact one (the shadow) and the exact state, which only the
exact step advances. Other optimizers keep the torch path.
"""

from __future__ import annotations

from typing import Any

import torch

from hemiola._native import C
from hemiola.tensors import dtype_code

_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}


def unsupported(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                in_flight: int) -> str | None:
    """Why the engine cannot step `optimizer` for these parameters (None: it can)."""
    name = type(optimizer).__name__
    if type(optimizer) not in _KINDS:
        return f"{name} is not one of the engine's optimizers (SGD, Adam, AdamW)"
    if in_flight > 1:
        return "in_flight > 1 re-takes local steps on top of each other"
    if any(p.device.type != "cpu" for p in params):
        return "the engine's optimizer steps CPU parameters only so far"
    if any(not p.is_contiguous() for p in params):
        return "a parameter is not contiguous (e.g. channels_last)"
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable"):
            return f"{name} with differentiable or capturable state"
    return None


class NativeSteps:
    """Steps parameters of a wrapped model with the engine's optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        self._optimizer = optimizer
        self._kind = _KINDS[type(optimizer)]
        self._params = params
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups)
                    for p in group["params"]}
        #: per parameter index: its param group's index
        self.group_of = [group_of[id(p)] for p in params]

    def step(self, index: int, grad: torch.Tensor, hyper: dict[str, Any],
             shadow: torch.Tensor, commit: bool) -> None:
        """One step of parameter `index` with `grad` and its group's
        hyper-parameters `hyper`: from `shadow` (the parameter itself, or
        decoupled's exact copy) into the parameter; when committing also
        into `shadow` and the optimizer's state."""
        p = self._params[index]
        if not grad.is_contiguous():
            grad = grad.contiguous()
        state = self._optimizer.state[p]
        if self._kind == "sgd":
            self._sgd(p, grad, hyper, shadow, state, commit)
        else:
            self._adam(p, grad, hyper, shadow, state, commit)

    def _sgd(self, p: torch.Tensor, grad: torch.Tensor, hyper: dict[str, Any],
             shadow: torch.Tensor, state: dict[str, Any], commit: bool) -> None:
        momentum = float(hyper["momentum"])
        buf = state.get("momentum_buffer")
        first = momentum != 0.0 and buf is None
        if first and commit:
            buf = torch.empty_like(p)  # the step writes the gradient into it
        C.optim.sgd_step(
            param=p.data_ptr(), shadow=shadow.data_ptr(),
            momentum_buffer=0 if buf is None else buf.data_ptr(), grad=grad.data_ptr(),
            numel=p.numel(), dtype=dtype_code(p.dtype), device=-1, lr=float(hyper["lr"]),
            momentum=momentum, dampening=float(hyper["dampening"]),
            weight_decay=float(hyper["weight_decay"]), nesterov=bool(hyper["nesterov"]),
            maximize=bool(hyper["maximize"]), first_step=first, commit=commit)
        if first and commit:
            state["momentum_buffer"] = buf

    def _adam(self, p: torch.Tensor, grad: torch.Tensor, hyper: dict[str, Any],
              shadow: torch.Tensor, state: dict[str, Any], commit: bool) -> None:
        amsgrad = bool(hyper["amsgrad"])
        if not state:  # as torch creates it
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)
        beta1, beta2 = hyper["betas"]
        vmax = state.get("max_exp_avg_sq")
        C.optim.adam_step(
            param=p.data_ptr(), shadow=shadow.data_ptr(), exp_avg=state["exp_avg"].data_ptr(),
            exp_avg_sq=state["exp_avg_sq"].data_ptr(),
            max_exp_avg_sq=0 if vmax is None else vmax.data_ptr(), grad=grad.data_ptr(),
            numel=p.numel(), dtype=dtype_code(p.dtype), device=-1, lr=float(hyper["lr"]),
            beta1=float(beta1), beta2=float(beta2), eps=float(hyper["eps"]),
            weight_decay=float(hyper["weight_decay"]),
            decoupled_weight_decay=(self._kind == "adamw"
                                    or bool(hyper.get("decoupled_weight_decay", False))),
            maximize=bool(hyper["maximize"]), amsgrad=amsgrad,
            step=int(state["step"].item()) + 1, commit=commit)
        if commit:
            state["step"] += 1

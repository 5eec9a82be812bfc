"""The optimizers the engine's updater steps itself (``torch.optim.SGD``,
``Adam``, ``AdamW``): which ones it can take, and the state it reads of
each parameter (``slots``). Every other optimizer steps through torch's own
step (``hemiola.schedules.torch_step``).

The state stays in the optimizer's own tensors, in torch's format, so
``optimizer.state_dict()`` and ``load_state_dict()`` are torch's; the engine
reads and writes those tensors in place (``state_dict`` leaves out what the
engine has not filled yet: ``state_dict_without_unfilled_momentum``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hemiola.engine_tensors import dtype_code

if TYPE_CHECKING:
    from hemiola.config import Config

#: the optimizers the engine steps itself, by the name its updater takes
KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}


def unsupported(optimizer: Any, params: list[torch.Tensor]) -> str | None:
    """Why the engine cannot step `optimizer` for these parameters itself
    (None: it can); then torch's step does, through the external stepper."""
    name = type(optimizer).__name__
    if type(optimizer) not in KINDS:
        return f"{name} is not one of the engine's optimizers (SGD, Adam, AdamW)"
    on_gpu = any(p.device.type == "cuda" for p in params)
    if any(p.device.type not in ("cpu", "cuda") for p in params):
        return "the engine's updater steps CPU and CUDA parameters only"
    if on_gpu and any(p.dtype == torch.float64 for p in params):
        return "the engine's CUDA optimizer kernels take float32, float16 and bfloat16 only"
    if on_gpu and any(group.get("amsgrad") for group in optimizer.param_groups):
        return "the engine's CUDA Adam kernel has no amsgrad"
    if any(not p.is_contiguous() for p in params):
        return "a parameter is not contiguous (e.g. channels_last)"
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable") or group.get("fused"):
            return f"{name} with differentiable, capturable or fused set"
    return None


def native_kind(config: Config, optimizer: Any, params: list[torch.Tensor]) -> str | None:
    """The engine's own step for `optimizer` ("sgd", "adam" or "adamw"), or
    None: torch's step through the external stepper."""
    if config.native_optimizer is False or unsupported(optimizer, params) is not None:
        return None
    return KINDS[type(optimizer)]


def slots(kind: str | None, optimizer: torch.optim.Optimizer, names: list[str],
          params: list[torch.Tensor]) -> list[tuple[Any, ...]]:
    """Each parameter with its optimizer state, as the updater takes them,
    the state created as torch creates it on the first step (an SGD momentum
    buffer the engine has not initialised yet is kept out of state_dict(),
    see :func:`state_dict_without_unfilled_momentum`). `kind` is ``native_kind``'s;
    None (the external stepper keeps the state in the optimizer): none is
    handed over."""
    if kind is None:
        return [(name, p.data_ptr(), dtype_code(p.dtype), p.numel(), 0, 0, False, 0, 0, 0, 0)
                for name, p in zip(names, params)]
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups)
                for p in group["params"]}
    out = []
    for name, p in zip(names, params):
        group = optimizer.param_groups[group_of[id(p)]]
        state = optimizer.state[p]
        momentum_buffer = exp_avg = exp_avg_sq = max_exp_avg_sq = step = 0
        initialised = False
        if kind == "sgd":
            buf = state.get("momentum_buffer")
            initialised = buf is not None
            if buf is None and group["momentum"] != 0:
                buf = state["momentum_buffer"] = torch.zeros_like(p)
            if buf is not None:
                momentum_buffer = _state_pointer(state, "momentum_buffer", p)
        else:
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            if group["amsgrad"] and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p)
            if not isinstance(state["step"], torch.Tensor) or \
                    state["step"].dtype != torch.float32 or state["step"].device.type != "cpu":
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
            exp_avg = _state_pointer(state, "exp_avg", p)
            exp_avg_sq = _state_pointer(state, "exp_avg_sq", p)
            if "max_exp_avg_sq" in state:
                max_exp_avg_sq = _state_pointer(state, "max_exp_avg_sq", p)
            step = state["step"].data_ptr()
        out.append((name, p.data_ptr(), dtype_code(p.dtype), p.numel(), group_of[id(p)],
                    momentum_buffer, initialised, exp_avg, exp_avg_sq, max_exp_avg_sq, step))
    return out


def _state_pointer(state: dict[str, Any], key: str, p: torch.Tensor) -> int:
    """The state tensor `key` as the engine reads it: contiguous, of the
    parameter's dtype and size (replaced in `state` if it was not)."""
    t = state[key]
    if t.dtype != p.dtype or t.shape != p.shape or not t.is_contiguous() or \
            t.device != p.device:
        t = state[key] = t.to(device=p.device, dtype=p.dtype).reshape(p.shape).contiguous()
    return int(t.data_ptr())


def state_dict_without_unfilled_momentum(optimizer: torch.optim.Optimizer,
                                         params: list[torch.Tensor], initialised: list[bool],
                                         inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``optimizer.state_dict()``, made by `inner` (torch's own), without the
    SGD momentum buffers the engine has not filled yet (`initialised`, the
    updater's, per parameter): :func:`slots` created them for the engine, and
    before its first step a buffer is not torch's state."""
    hidden = {}
    for p, filled in zip(params, initialised):
        if not filled and "momentum_buffer" in optimizer.state.get(p, {}):
            hidden[p] = optimizer.state[p].pop("momentum_buffer")
    try:
        return inner()
    finally:
        for p, buf in hidden.items():
            optimizer.state[p]["momentum_buffer"] = buf

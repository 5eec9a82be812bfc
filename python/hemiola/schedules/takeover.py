"""The optimizer take-over of the schedules whose update is applied when the
reductions arrive (``priority``, ``decoupled``): ``optimizer.step()`` calls
the schedule, and the optimizer's state is read and written only once
everything pending has landed."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hemiola.schedules.base import Schedule


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A snapshot of every param group's hyper-parameters (lr, momentum, ...)."""

    def copy_value(v: Any) -> Any:
        return v.clone() if isinstance(v, torch.Tensor) else v

    return [{k: copy_value(v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def take_over_optimizer(schedule: Schedule, optimizer: Any, step: Callable[[], None]) -> Any:
    """Makes ``optimizer.step()`` call `step` (the schedule decides when and
    with which gradients the real step runs), and ``state_dict`` /
    ``load_state_dict`` synchronize first. Returns the original bound step."""
    name = schedule.bound.config.schedule
    if not isinstance(optimizer, torch.optim.Optimizer):
        got = "None" if optimizer is None else type(optimizer).__name__
        raise ValueError(
            f"schedule={name!r} needs the torch.optim.Optimizer that trains the model (got "
            f"{got}): it takes over the optimizer's step to apply updates when reductions "
            "arrive. Build the optimizer before wrapping and pass it: model, optimizer = "
            "hemiola.wrap(model, optimizer, ...). (Only schedule='wfbp' accepts None and an "
            "optimizer built after wrapping.)"
        )
    _check_coverage(name, optimizer, schedule.bound.names, schedule.bound.params)
    inner_step = optimizer.step
    inner_state_dict = optimizer.state_dict
    inner_load = optimizer.load_state_dict

    def wrapped_step(opt: torch.optim.Optimizer, closure: Any = None) -> Any:
        # As torch's per-parameter optimizers do: the closure (forward and
        # backward) runs once, first. (L-BFGS, which needs it called many
        # times, is refused by its own step.)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step()
        opt._opt_called = True  # what an LR scheduler's wrapper of step records
        return loss

    def state_dict(opt: torch.optim.Optimizer) -> dict[str, Any]:
        schedule.synchronize()  # the exact state
        return schedule.optimizer_state_dict(inner_state_dict)

    def load_state_dict(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        schedule.synchronize()
        inner_load(state)
        schedule.parameters_replaced()

    if hasattr(inner_step, "_wrapped_by_lr_sched"):
        # An LR scheduler built before wrapping checks that step is still its
        # wrapper; this one records the call as that wrapper does.
        wrapped_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(wrapped_step, optimizer)
    # GradScaler then always calls step (see scaler_handshake.take_scaler_state).
    optimizer._step_supports_amp_scaling = True
    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    return inner_step


def _check_coverage(name: str, optimizer: torch.optim.Optimizer, names: list[str],
                    params: list[torch.Tensor]) -> None:
    """The optimizer steps exactly the wrapped model's trainable parameters.
    A parameter outside it could only be stepped by another optimizer, from
    ``.grad``, which holds this rank's own gradient here: the ranks would
    differ. So it is refused by name, saying what to do."""
    ours = {id(p) for p in params}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if any(id(p) not in ours for group in optimizer.param_groups for p in group["params"]
           if p.requires_grad):
        raise ValueError(
            f"schedule={name!r}: the optimizer holds a trainable parameter that is not "
            "a parameter of the wrapped model; wrap the model that owns every parameter "
            "the optimizer steps"
        )
    missing = [n for n, p in zip(names, params) if id(p) not in held]
    if missing:
        listed = ", ".join(repr(n) for n in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ValueError(
            f"schedule={name!r}: the optimizer passed to hemiola.wrap does not hold "
            f"{len(missing)} trainable parameter(s) of the model: {listed}. This schedule "
            "applies the averaged gradients through that optimizer only (.grad keeps this "
            "rank's own gradient, so another optimizer stepping from it would make the ranks "
            "differ). Put them in it, in a param group of their own for other "
            "hyper-parameters (e.g. torch.optim.AdamW([{'params': body.parameters()}, "
            "{'params': head.parameters(), 'lr': 1e-4}])); set requires_grad=False before "
            "wrapping on those that must not train; or use schedule='wfbp', which works with "
            "any number of optimizers, as DDP does."
        )

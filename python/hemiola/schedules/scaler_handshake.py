"""The handshake with ``torch.amp.GradScaler`` under the engine's updater:
what ``scaler.step(optimizer)`` hands the taken-over optimizer, and the
refusal of a GradScaler hemiola was not given."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hemiola.bound_model import BoundModel


def unknown_scaler(schedule: str) -> str:
    """The refusal of a GradScaler's step that hemiola was not given."""
    return (f"schedule={schedule!r}: optimizer.step() is driven by a torch.amp.GradScaler "
            "that hemiola does not know, so the reduced gradients would be applied still "
            "scaled. Pass it when wrapping: hemiola.wrap(model, optimizer, schedule=..., "
            "grad_scaler=scaler).")


def take_scaler_state(optimizer: Any, bound: BoundModel, scaling: bool) -> bool:
    """Under ``scaler.step(optimizer)``: what GradScaler handed the
    optimizer (it calls our step always, with ``grad_scale`` and
    ``found_inf`` set, since take_over_optimizer declares
    ``_step_supports_amp_scaling``). Unscales the local ``.grad`` if
    ``unscale_`` was not called, hides both attributes from the inner
    optimizer (a fused Adam would apply them to the reduced gradient, which
    is unscaled already), and returns whether this rank's own gradient
    overflowed. `scaling`: the GradScaler given to hemiola.wrap scales this
    model's gradients; a step driven by another is refused."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return False
    if not scaling:
        message = unknown_scaler(bound.config.schedule)
        bound.reducer.abort(message)
        raise RuntimeError(message)
    grad_scale = getattr(optimizer, "grad_scale", None)
    optimizer.grad_scale = optimizer.found_inf = None  # GradScaler deletes them after the step
    if grad_scale is not None:  # unscale_() was not called: .grad is still scaled
        grads = [p.grad for p in bound.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, grad_scale.double().reciprocal().float())
    return bool(found_inf.item())

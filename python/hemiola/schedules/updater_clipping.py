"""Clipping under the engine's updater (``model.clip_grad_norm_`` with
``priority`` and ``decoupled``): what one iteration's clip asked for, the
total norm the engine clips by on the CPU, and the averaged gradient's norm
read before ``optimizer.step()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hemiola.engine_tensors import engine_view

if TYPE_CHECKING:
    from hemiola.bound_model import BoundModel


class Clip(NamedTuple):
    """``model.clip_grad_norm_(max_norm, norm_type)`` of one iteration, and
    the coefficient decoupled's preview step scales its estimate of the
    averaged gradient by (1.0 without a preview; see
    ``Decoupled._preview_clip``)."""

    max_norm: float
    norm_type: float
    preview_coef: float


def torch_total_norm(params: list[torch.Tensor]) -> Callable[..., float]:
    """The total norm the engine clips by (UpdaterOptions::clip_norm):
    torch's ``get_total_norm`` over the averaged gradients, in parameter
    order, as ``torch.nn.utils.clip_grad_norm_`` sums them under DDP, so
    that the coefficient, and the run, are DDP's bit for bit. (The engine's
    own norm is accumulated in double, and can differ in the last bit.)"""

    def norm(indices: list[int], grads: list[memoryview], norm_type: float) -> float:
        views = [torch.frombuffer(g, dtype=params[i].dtype).view(params[i].shape)
                 if params[i].numel() else params[i].new_zeros(params[i].shape)
                 for i, g in zip(indices, grads)]
        return float(torch.nn.utils.get_total_norm(views, norm_type))

    return norm


def averaged_before_step(bound: BoundModel, updater: Any, iteration: int) -> list[torch.Tensor]:
    """`iteration`'s averaged gradient of each parameter, read before its
    ``optimizer.step()``: waits for the reduction; views of the engine's
    memory, valid until that step."""
    assert bound.reducer is not None
    bound.reducer.wait(iteration, stream=bound.stream())
    # The updater's view: a parameter partitioned over several buckets has
    # no single view in the reducer.
    return [engine_view(updater.averaged_ptr(iteration, i), p)
            for i, p in enumerate(bound.params)]


def averaged_norm_before_step(bound: BoundModel, updater: Any, iteration: int,
                              norm_type: float) -> float:
    """The norm of `iteration`'s averaged gradient read before its
    ``optimizer.step()``, as the update will take it."""
    averaged = averaged_before_step(bound, updater, iteration)
    return float(torch.nn.utils.get_total_norm(averaged, norm_type))

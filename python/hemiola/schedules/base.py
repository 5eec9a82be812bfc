"""The interface between the wrapped model and a communication schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hemiola.data_parallel import DataParallel


class Schedule:
    """Hooks a schedule implements. The model calls them at fixed points."""

    #: earlier iterations whose reduction may still run while one is marked
    in_flight = 0

    def __init__(self, model: DataParallel) -> None:
        self.model = model

    def mark(self, index: int, grad: torch.Tensor) -> None:
        """Autograd produced `grad` for parameter `index` (hook path)."""
        raise NotImplementedError

    def backward_done(self, iteration: int, unmarked: list[int]) -> None:
        """Backward finished; `iteration`'s marking is closed. `unmarked`
        were contributed as zeros (find_unused_parameters)."""
        raise NotImplementedError

    def before_forward(self) -> None:
        """Called at the start of every forward of the wrapped model."""

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Returns the optimizer users step (possibly the same object)."""
        return optimizer

    def synchronize(self) -> None:
        """Lands everything pending, so parameters are exact."""

    def parameters_replaced(self) -> None:
        """The parameters were overwritten (load_state_dict)."""

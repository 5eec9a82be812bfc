"""The interface between the wrapped model and a communication schedule:
the hooks every schedule implements."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hemiola.bound_model import BoundModel
    from hemiola.config import Config


class Schedule:
    """Hooks a schedule implements. The model calls them at fixed points."""

    #: earlier iterations whose reduction may still run while one is marked
    in_flight = 0
    #: the reducer takes a preview of every bucket (``Config.preview``)
    preview = False
    #: the bound model makes the engine's reducer (False: the schedule
    #: buckets and marks on its own, and implements the marking hooks below)
    uses_reducer = True

    def __init__(self, bound: BoundModel, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        #: the model bound to this rank's engine (parameters, reducer, stream,
        #: results; hemiola.bound_model)
        self.bound = bound
        #: the GradScaler given to hemiola.wrap (None: no loss scaling)
        self.grad_scaler = grad_scaler
        # What the bound model's reducer was built for (see reducer_needs).
        self.in_flight = bound.in_flight
        self.preview = bound.preview

    @classmethod
    def reducer_needs(cls, config: Config, optimizer: Any,
                      device: torch.device) -> tuple[int, bool]:
        """(in_flight, preview) this schedule needs of the reducer, known
        before the reducer and the schedule exist: the earlier iterations
        whose reduction may still run while one is marked, and whether the
        reducer takes a preview of every bucket."""
        return cls.in_flight, False

    def backward_started(self) -> None:
        """A synchronised backward produced its first gradient; nothing of
        it is marked yet."""

    def mark(self, index: int, grad: torch.Tensor) -> None:
        """Autograd produced `grad` for parameter `index` (hook path)."""
        raise NotImplementedError

    # ---- marking: the reducer's, unless the schedule buckets on its own -------

    def unmarked(self) -> list[int]:
        """Parameters with no gradient yet in the backward being marked."""
        return self.bound.reducer.unmarked()  # type: ignore[union-attr]

    def abort_backward(self, message: str) -> None:
        """The backward being marked cannot complete (`message` says why)."""
        self.bound.reducer.abort(message)  # type: ignore[union-attr]

    def mark_unused(self, index: int) -> None:
        """Parameter `index` contributes zeros this backward."""
        self.bound.reducer.mark_unused(index, stream=self.bound.stream())  # type: ignore[union-attr]

    def finish_marking(self) -> int:
        """Closes the backward's marking; its iteration number (-1: none)."""
        return self.bound.reducer.finish_marking()  # type: ignore[union-attr]

    def buckets(self) -> list[list[int]]:
        """Parameter indices per bucket, in issue order."""
        reducer = self.bound.reducer
        if reducer is None:
            return []
        buckets = reducer.buckets()
        return [buckets[b] for b in reducer.issue_order()]

    def backward_done(self, iteration: int, unmarked: list[int]) -> None:
        """Backward finished; `iteration`'s marking is closed. `unmarked`
        were contributed as zeros (find_unused_parameters)."""
        raise NotImplementedError

    def before_forward(self) -> None:
        """Called at the start of every forward of the wrapped model."""

    def forward_is_compiled(self) -> None:
        """The wrapped model's forward runs compiled (torch.compile after
        wrapping): module hooks inside it are not reliable places to land."""

    def forward_scope(self) -> contextlib.AbstractContextManager[None]:
        """A context around every forward of the wrapped module."""
        return contextlib.nullcontext()

    @property
    def observing(self) -> bool:
        """The next forward is observed (it must run eagerly, not compiled)."""
        return False

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """``model.clip_grad_norm_``: clips what the optimizer will apply."""
        params = [p for p in self.bound.params if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def averaged_gradients(self) -> list[torch.Tensor]:
        """``model.averaged_gradients``: each parameter's averaged gradient
        (``bound.params`` order), a copy; here ``.grad`` holds it."""
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for p in self.bound.params]

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Returns the optimizer users step (possibly the same object)."""
        return optimizer

    def synchronize(self) -> None:
        """Lands everything pending, so parameters are exact."""

    def replan(self) -> None:
        """The bound model's ``config`` changed how buckets are planned (before
        the first backward): the reducer, and what is built on it, are made
        again."""
        self.bound.plan()

    def stats(self) -> dict[str, float]:
        """Schedule-specific counters (see ``DataParallel.stats``)."""
        return {}

    def parameters_replaced(self) -> None:
        """The parameters were overwritten (load_state_dict)."""

    def optimizer_state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The taken-over optimizer's ``state_dict()``, made by `inner`
        (torch's own) once everything pending has landed."""
        return inner()

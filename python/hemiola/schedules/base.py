"""The interface between the wrapped model and a communication schedule, and
helpers shared by the schedules that take over the optimizer's step."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hemiola.tensors import UINT8

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


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A snapshot of every param group's hyper-parameters (lr, momentum, ...)."""

    def copy_value(v: Any) -> Any:
        return v.clone() if isinstance(v, torch.Tensor) else v

    return [{k: copy_value(v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def set_hyper_parameters(optimizer: torch.optim.Optimizer, hyper: list[dict[str, Any]]) -> None:
    for group, h in zip(optimizer.param_groups, hyper):
        group.update(h)


def take_over_optimizer(schedule: Schedule, optimizer: Any, step: Callable[[], None]) -> Any:
    """Makes ``optimizer.step()`` call `step` (the schedule decides when and
    with which gradients the real step runs), and ``state_dict`` /
    ``load_state_dict`` synchronize first. Returns the original bound step."""
    name = schedule.model.config.schedule
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"schedule={name!r} needs the torch.optim.Optimizer that trains the model: it "
            "takes over the optimizer's step to apply updates when reductions arrive"
        )
    ours = {id(p) for p in schedule.model._params}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in ours:
                raise ValueError(
                    f"schedule={name!r}: the optimizer holds a trainable parameter that is not "
                    "a parameter of the wrapped model; wrap the model that owns every parameter "
                    "the optimizer steps"
                )
    inner_step = optimizer.step
    inner_state_dict = optimizer.state_dict
    inner_load = optimizer.load_state_dict

    def wrapped_step(opt: torch.optim.Optimizer, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError(f"schedule={name!r} does not support optimizer closures")
        step()

    def state_dict(opt: torch.optim.Optimizer) -> dict[str, Any]:
        schedule.synchronize()  # the exact state
        return inner_state_dict()

    def load_state_dict(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        schedule.synchronize()
        inner_load(state)
        schedule.parameters_replaced()

    optimizer.step = types.MethodType(wrapped_step, optimizer)
    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    return inner_step


class BufferBroadcast:
    """Rank 0's buffers, broadcast asynchronously after backward and applied
    later, so that a forward never waits behind an in-flight reduction."""

    def __init__(self, model: DataParallel) -> None:
        self.model = model
        self._stage: torch.Tensor | None = None
        self._handle: Any = None

    @property
    def wanted(self) -> bool:
        m = self.model
        return bool(m.config.broadcast_buffers and m._buffers_to_sync and m.world_size > 1)

    def start(self) -> None:
        self.finish()
        buffers = self.model._buffers_to_sync
        self._stage = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in buffers])
        self._handle = self.model._engine.broadcast(self._stage.data_ptr(), UINT8,
                                                    self._stage.numel(), 0)

    def finish(self) -> None:
        if self._handle is None:
            return
        handle, stage = self._handle, self._stage
        self._handle = self._stage = None
        handle.wait()
        if self.model.rank == 0:
            return
        offset = 0
        with torch.no_grad():
            for b in self.model._buffers_to_sync:
                nbytes = b.numel() * b.element_size()
                b.copy_(stage[offset:offset + nbytes].view(b.dtype).view(b.shape))
                offset += nbytes


class DeferredSchedule(Schedule):
    """Base of the schedules whose ``backward()`` does not wait (``priority``,
    ``decoupled``): gradients are copied into the engine and their results
    stay there (``.grad`` keeps the local gradient), buffers follow rank 0's
    asynchronously, and ``optimizer.step()`` is taken over so that updates
    are applied when the reductions arrive."""

    in_flight = 1

    def __init__(self, model: DataParallel) -> None:
        super().__init__(model)
        self._optimizer: torch.optim.Optimizer | None = None
        self._inner_step: Any = None
        # The iteration whose marking closed and whose step is not taken yet.
        self._finished: int | None = None
        self._unmarked: dict[int, list[int]] = {}
        self._rebuilt = not model.config.rebuild_buckets
        self._buffers = BufferBroadcast(model)

    def mark(self, index: int, grad: torch.Tensor) -> None:
        source = grad if grad.is_contiguous() else grad.contiguous()
        # The engine copies the gradient in now; the result stays in the
        # reducer (or, if partitioned, goes to a tensor of the model's).
        self.model._reducer.mark_ready_to(index, source.data_ptr(),
                                          self.model._result_target(index))

    def backward_done(self, iteration: int, unmarked: list[int]) -> None:
        self._finished = iteration
        if unmarked:
            self._unmarked[iteration] = unmarked
        if self._buffers.wanted:
            self._buffers.start()

    def wrap_optimizer(self, optimizer: Any) -> Any:
        self._inner_step = take_over_optimizer(self, optimizer, self.step)
        self._optimizer = optimizer
        return optimizer

    def step(self) -> None:
        """What ``optimizer.step()`` does under this schedule."""
        raise NotImplementedError

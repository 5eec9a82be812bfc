"""The interface between the wrapped model and a communication schedule, and
helpers shared by the schedules that take over the optimizer's step."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hemiola.deferred_norm import DeferredNorm
from hemiola.forward_gate import ForwardGate
from hemiola.tensors import UINT8, pack_bytes, unpack_bytes

if TYPE_CHECKING:
    from hemiola.config import Config
    from hemiola.replica import Replica


class Clip(NamedTuple):
    """``model.clip_grad_norm_(max_norm, norm_type)`` of one iteration, and
    the coefficient decoupled's preview step scales its estimate of the
    averaged gradient by: torch's rule applied to an estimate of the averaged
    gradient's norm (see ``Schedule.clip_grad_norm_``)."""

    max_norm: float
    norm_type: float
    preview_coef: float


class Schedule:
    """Hooks a schedule implements. The model calls them at fixed points."""

    #: earlier iterations whose reduction may still run while one is marked
    in_flight = 0
    #: the reducer takes a preview of every bucket (``Config.preview``)
    preview = False

    def __init__(self, replica: Replica, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        self.replica = replica
        #: the GradScaler given to hemiola.wrap (None: no loss scaling)
        self.grad_scaler = grad_scaler
        # What the replica's reducer was built for (see reducer_needs).
        self.in_flight = replica.in_flight
        self.preview = replica.preview

    @classmethod
    def reducer_needs(cls, config: Config, optimizer: Any,
                      device: torch.device) -> tuple[int, bool]:
        """(in_flight, preview) this schedule needs of the reducer, known
        before the reducer and the schedule exist: the earlier iterations
        whose reduction may still run while one is marked, and whether the
        reducer takes a preview of every bucket."""
        return cls.in_flight, False

    def mark(self, index: int, grad: torch.Tensor) -> None:
        """Autograd produced `grad` for parameter `index` (hook path)."""
        raise NotImplementedError

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
        params = [p for p in self.replica.params if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Returns the optimizer users step (possibly the same object)."""
        return optimizer

    def synchronize(self) -> None:
        """Lands everything pending, so parameters are exact."""

    def stats(self) -> dict[str, float]:
        """Schedule-specific counters (see ``DataParallel.stats``)."""
        return {}

    def parameters_replaced(self) -> None:
        """The parameters were overwritten (load_state_dict)."""

    def optimizer_state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The taken-over optimizer's ``state_dict()``, made by `inner`
        (torch's own) once everything pending has landed."""
        return inner()


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
    name = schedule.replica.config.schedule
    if not isinstance(optimizer, torch.optim.Optimizer):
        got = "None" if optimizer is None else type(optimizer).__name__
        raise ValueError(
            f"schedule={name!r} needs the torch.optim.Optimizer that trains the model (got "
            f"{got}): it takes over the optimizer's step to apply updates when reductions "
            "arrive. Build the optimizer before wrapping and pass it: model, optimizer = "
            "hemiola.wrap(model, optimizer, ...). (Only schedule='wfbp' accepts None and an "
            "optimizer built after wrapping.)"
        )
    ours = {id(p) for p in schedule.replica.params}
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
    # GradScaler then always calls step (see DeferredSchedule.take_scaler_state).
    optimizer._step_supports_amp_scaling = True
    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    return inner_step


class BufferBroadcast:
    """Rank 0's buffers, broadcast asynchronously after backward and applied
    later, so that a forward never waits behind an in-flight reduction."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._stage: torch.Tensor | None = None
        self._offsets: list[int] = []
        self._handle: Any = None

    @property
    def wanted(self) -> bool:
        m = self.replica
        return bool(m.config.broadcast_buffers and m.buffers and m.world_size > 1)

    def start(self) -> None:
        self.finish()
        # Host memory: the engine's broadcast reads it from its own thread.
        # Only rank 0's bytes are read: the others copy nothing off the GPU.
        self._stage, self._offsets = pack_bytes(self.replica.buffers,
                                                fill=self.replica.rank == 0)
        self._handle = self.replica.engine.broadcast(self._stage.data_ptr(), UINT8,
                                                     self._stage.numel(), 0)

    def finish(self) -> None:
        if self._handle is None:
            return
        handle, stage = self._handle, self._stage
        self._handle = self._stage = None
        handle.wait()
        if self.replica.rank == 0:
            return
        unpack_bytes(stage, self._offsets, self.replica.buffers)


class DeferredSchedule(Schedule):
    """Base of the schedules whose ``backward()`` does not wait (``priority``,
    ``decoupled``): gradients are copied into the engine and their results
    stay there (``.grad`` keeps the local gradient), buffers follow rank 0's
    asynchronously, and ``optimizer.step()`` is taken over so that updates
    are applied when the reductions arrive. Where they land is learnt by the
    forward gate; the engine's updater lands them (``native``)."""

    in_flight = 1

    def __init__(self, replica: Replica, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(replica, optimizer, grad_scaler)
        self._optimizer: torch.optim.Optimizer | None = None
        self._inner_step: Any = None
        # The iteration whose marking closed and whose step is not taken yet.
        self._finished: int | None = None
        self._unmarked: dict[int, list[int]] = {}
        self._buffers = BufferBroadcast(replica)
        self._gate = ForwardGate(replica.module, replica.params, self.land, self.landers_learnt)
        # The local gradients as backward left them (object, version), to
        # catch code that edits .grad before optimizer.step(): that edit would
        # not reach the reduced gradient the update uses.
        self._grads_seen: list[tuple[int, int]] | None = None
        #: per clipped iteration: its model.clip_grad_norm_
        self._clip: dict[int, Clip] = {}
        #: this rank's gradient norm of the newest clipped iterations
        self._local_norms: dict[int, float] = {}
        # 1 / the GradScaler's scale in the backward being marked
        self._inv_scale: float | None = None

    def forward_scope(self) -> contextlib.AbstractContextManager[None]:
        return self._gate.scope()

    @property
    def observing(self) -> bool:
        return self._gate.learning

    def forward_is_compiled(self) -> None:
        self._gate.land_at_start_only()

    def before_forward(self) -> None:
        if not torch.is_grad_enabled():
            # Evaluation sees the exact parameters and rank 0's buffers, as
            # under DDP.
            self.synchronize()
        elif self._finished is not None:
            # A second training forward before optimizer.step(): gradient
            # accumulation without no_sync (or a step GradScaler skipped).
            # The next backward's reduction contains this one's (.grad keeps
            # accumulating the local gradients), so this one is superseded;
            # land what is pending so the reducer has room for the next.
            self.synchronize()
        else:
            self._gate.land_now()

    def land(self, lander: int, indices: list[int]) -> None:
        """A forward reaches lander `lander` (see ForwardGate), before which
        parameters `indices` are first read."""
        raise NotImplementedError

    def landers_learnt(self, landers: list[list[int]]) -> None:
        """The gate learnt (or reset) its landers; lander 0 is everything."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        # The local gradients are clipped now (decoupled's local step uses
        # them); the reduced gradient is clipped by the same rule, with its
        # own global norm, when the update is applied.
        if self._finished is None:
            raise RuntimeError("model.clip_grad_norm_() goes between backward() and "
                               "optimizer.step()")
        iteration = self._finished
        local = super().clip_grad_norm_(max_norm, norm_type)
        # The preview's coefficient. Without a preview nothing reads the local
        # norm here (on a GPU, reading it would wait for the device each step).
        coef = (self._preview_clip(iteration, float(local), float(max_norm)) if self.preview
                else 1.0)
        self._clip[iteration] = Clip(float(max_norm), float(norm_type), coef)
        self._grads_seen = self._grad_versions()
        # What clip_grad_norm_ returns under wfbp and DDP: the norm of the
        # averaged gradient, the same on every rank, read when it is known.
        return DeferredNorm(lambda: self._averaged_norm(iteration, float(norm_type)))

    def _preview_clip(self, iteration: int, local_norm: float, max_norm: float) -> float:
        """The clipping coefficient the preview of `iteration` steps with."""
        # The averaged gradient's norm is not known until its reduction has
        # arrived, and it is smaller than one rank's (averaging cancels noise):
        # clipping the preview by this rank's norm would shorten its step. So
        # its estimate is this rank's norm times the ratio the newest iteration
        # with a known average had, and the coefficient torch's rule for it.
        ratio = 1.0
        for before, own in sorted(self._local_norms.items(), reverse=True):
            averaged = self.recorded_clip_norm(before)
            if averaged is not None and own > 0.0:
                ratio = averaged / own
                break
        self._local_norms = {it: own for it, own in self._local_norms.items()
                             if it >= iteration - 4}
        self._local_norms[iteration] = local_norm
        return min(1.0, max_norm / (local_norm * ratio + 1e-6))

    def recorded_clip_norm(self, iteration: int) -> float | None:
        """The total norm the update of `iteration` clipped with, once computed
        (None before; never blocks)."""
        raise NotImplementedError

    def _averaged_norm(self, iteration: int, norm_type: float) -> float:
        recorded = self.recorded_clip_norm(iteration)
        if recorded is not None:
            return recorded
        m = self.replica
        if iteration == self._finished:
            # Read before optimizer.step(): wait for the reduction and take
            # the norm of what it delivered, as the update will.
            assert m.reducer is not None
            m.reducer.wait(iteration, stream=m.stream())
            return float(torch.nn.utils.get_total_norm(
                [m.reduced(iteration, i) for i in range(len(m.params))], norm_type))
        self.synchronize()  # the update computes it when it lands
        recorded = self.recorded_clip_norm(iteration)
        if recorded is None:
            raise RuntimeError(
                f"the gradient norm of iteration {iteration} was never computed: a second "
                "backward before optimizer.step() superseded that iteration (accumulate "
                "inside model.no_sync(), or read the norm before the next backward)")
        return recorded

    def _grad_versions(self) -> list[tuple[int, int]]:
        return [(id(p.grad), p.grad._version) if p.grad is not None else (0, 0)
                for p in self.replica.params]

    def check_grads_untouched(self) -> None:
        """Raises if .grad was modified in place since backward (clipping,
        unscaling): under this schedule the update applies the reduced
        gradient, which such an edit never reaches."""
        seen, self._grads_seen = self._grads_seen, None
        if seen is None:
            return
        m = self.replica
        for (grad_id, version), p, name in zip(seen, m.params, m.names):
            if grad_id and id(p.grad) == grad_id and p.grad._version != version:
                raise RuntimeError(
                    f"parameter {name!r}: its .grad was modified in place between backward() "
                    f"and optimizer.step(). schedule={m.config.schedule!r} updates with the "
                    "reduced gradient, which such an edit does not reach. To clip, call "
                    "model.clip_grad_norm_(max_norm) instead of torch.nn.utils."
                    "clip_grad_norm_; for other gradient edits use schedule='wfbp'."
                )

    def take_clip(self, iteration: int) -> Clip | None:
        """How `iteration`'s gradients were clipped, if they were."""
        return self._clip.pop(iteration, None)

    def source(self, grad: torch.Tensor) -> torch.Tensor:
        """What this rank contributes for local gradient `grad`."""
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            # Each rank reduces its gradient unscaled, so the average is right
            # whatever the ranks' scales, and not finite iff a rank overflowed.
            if self._inv_scale is None:
                self._inv_scale = 1.0 / scaler.get_scale()
            grad = grad * self._inv_scale  # (keeps grad's layout, e.g. channels_last)
        return grad if grad.is_contiguous() else grad.contiguous()

    def backward_done(self, iteration: int, unmarked: list[int]) -> None:
        if self._finished is not None:  # superseded (see before_forward)
            self._unmarked.pop(self._finished, None)
            self._clip.pop(self._finished, None)
        self._finished = iteration
        self._inv_scale = None
        self._grads_seen = self._grad_versions()
        if unmarked:
            self._unmarked[iteration] = unmarked
        if self._buffers.wanted:
            self._buffers.start()

    def wrap_optimizer(self, optimizer: Any) -> Any:
        self._inner_step = take_over_optimizer(self, optimizer, self.step)
        self._optimizer = optimizer
        return optimizer

    @property
    def scaling(self) -> bool:
        """A GradScaler scales this model's gradients."""
        scaler = self.grad_scaler
        return scaler is not None and scaler.is_enabled()

    def take_scaler_state(self) -> bool:
        """Under ``scaler.step(optimizer)``: what GradScaler handed the
        optimizer (it calls our step always, with ``grad_scale`` and
        ``found_inf`` set, since take_over_optimizer declares
        ``_step_supports_amp_scaling``). Unscales the local ``.grad`` if
        ``unscale_`` was not called, hides both attributes from the inner
        optimizer (a fused Adam would apply them to the reduced gradient,
        which is unscaled already), and returns whether this rank's own
        gradient overflowed."""
        opt = self._optimizer
        found_inf = getattr(opt, "found_inf", None)
        if found_inf is None:
            return False
        name = self.replica.config.schedule
        if not self.scaling:
            message = (
                f"schedule={name!r}: optimizer.step() is driven by a torch.amp.GradScaler that "
                "hemiola does not know, so the reduced gradients would be applied still scaled. "
                "Pass it when wrapping: hemiola.wrap(model, optimizer, schedule=..., "
                "grad_scaler=scaler)."
            )
            self.replica.reducer.abort(message)
            raise RuntimeError(message)
        grad_scale = getattr(opt, "grad_scale", None)
        opt.grad_scale = opt.found_inf = None  # GradScaler deletes them after the step
        if grad_scale is not None:  # unscale_() was not called: .grad is still scaled
            grads = [p.grad for p in self.replica.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, grad_scale.double().reciprocal().float())
        return bool(found_inf.item())

    def step(self) -> None:
        """What ``optimizer.step()`` does under this schedule."""
        raise NotImplementedError

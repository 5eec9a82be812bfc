"""What ``priority`` and ``decoupled`` share: ``UpdaterSchedule``, the schedule
whose updates the engine's updater lands (``hemiola._C.Updater``,
cpp/include/hemiola/updater.h): which parameter waits for which reduction,
where in the next forward it lands, and the optimizer step that lands it.
``backward()`` does not wait: gradients are copied into the engine and their
results stay there (``.grad`` keeps the local gradient), buffers follow rank
0's asynchronously (``buffers``), and ``optimizer.step()`` is taken over
(``takeover``) so that updates are applied when the reductions arrive. See
docs/schedules.md for what each schedule does; ``priority`` and
``decoupled`` hold only what differs.

Python's part per iteration is one native call per gradient (the autograd
hook), one per gate (a module's forward pre-hook) and one per
``optimizer.step()`` with the hyper-parameters of each param group, read
every step so LR schedulers keep working. The optimizer's state lives in the
optimizer's own tensors, in torch's format, so ``optimizer.state_dict()`` and
``load_state_dict()`` are torch's.

The engine steps ``torch.optim.SGD``, ``Adam`` and ``AdamW`` itself, on CPU
and CUDA parameters (on a GPU every kernel, copy and wait is on the current
stream; ``engine_optimizer``). Every other per-parameter optimizer, and these
where the engine's steps cannot take them or with ``native_optimizer=False``,
steps through the updater's external stepper: torch's own step, called by the
engine once per landing group (``torch_step``). Parameters must be dense in
memory (contiguous, channels_last, ...): the updater copies them as blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hemiola._native import C
from hemiola.deferred_norm import DeferredNorm
from hemiola.forward_gate import ForwardGate
from hemiola.hyper import group_hyper
from hemiola.schedules.base import Schedule
from hemiola.schedules.buffers import BufferBroadcast
from hemiola.schedules.engine_optimizer import (
    native_kind,
    slots,
    state_dict_without_unfilled_momentum,
)
from hemiola.schedules.gated import LandsAtGates
from hemiola.schedules.refusals import GradWatch, refuse_scattered_parameters
from hemiola.schedules.scaler_handshake import take_scaler_state
from hemiola.schedules.takeover import take_over_optimizer
from hemiola.schedules.torch_step import TorchStep
from hemiola.schedules.updater_clipping import (
    Clip,
    averaged_before_step,
    averaged_norm_before_step,
    torch_total_norm,
)
from hemiola.schedules.updater_switches import device_clip_norms, multi_tensor_steps
from hemiola.torch_sqrt import torch_sqrt

if TYPE_CHECKING:
    from hemiola.bound_model import BoundModel


def _no_mark(*args: int) -> None:
    raise RuntimeError("hemiola: a gradient was marked before the optimizer was wrapped")


class UpdaterSchedule(LandsAtGates, Schedule):
    """The part of ``priority`` and ``decoupled`` that is the same: the
    engine's updater lands each update where the forward gate learnt it is
    first read, and steps the optimizer (see the module docstring). A
    subclass says what its reducer needs and overrides the hooks marked as
    such (``_before_update``, ``_preview_clip``, ``_local_pointer``)."""

    in_flight = 1

    def __init__(self, bound: BoundModel, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(bound, optimizer, grad_scaler)
        self._optimizer: torch.optim.Optimizer | None = None
        self._inner_step: Any = None
        # The iteration whose marking closed and whose step is not taken yet.
        self._finished: int | None = None
        self._unmarked: dict[int, list[int]] = {}
        self._buffers = BufferBroadcast(bound)
        #: this backward's buffers broadcast started when it began
        self._buffers_early = False
        self._gate = ForwardGate(bound.module, bound.params, self.land, self.gates_learnt)
        # .grad as backward left it and as the last step took it: an edit in
        # place would not reach the reduced gradient the update uses, and a
        # second step from it would make the ranks differ (refusals)
        self._grads = GradWatch(bound)
        #: per clipped iteration: its model.clip_grad_norm_
        self._clip: dict[int, Clip] = {}
        # 1 / the GradScaler's scale in the backward being marked
        self._inv_scale: float | None = None
        refuse_scattered_parameters(bound)
        #: the engine's own step ("sgd", "adam", "adamw"), or None: torch's
        #: step through the external stepper
        self._kind = native_kind(bound.config, optimizer, bound.params)
        self._torch_step: TorchStep | None = None  # the external stepper, if any
        self._updater: Any = None  # C.Updater, made by wrap_optimizer (none without parameters)
        # the reducer's mark, once the updater observes its marks
        self._mark: Callable[..., None] = _no_mark
        # contiguous copies of non-contiguous local gradients (the engine
        # reads gradients in logical order), refreshed in step()
        self._local: dict[int, torch.Tensor] = {}
        self._cuda = bound.device.type == "cuda"

    def wrap_optimizer(self, optimizer: Any) -> Any:
        self._inner_step = take_over_optimizer(self, optimizer, self.step)
        self._optimizer = optimizer
        m = self.bound
        if not m.params:
            return optimizer  # nothing to reduce: step() is the optimizer's
        if self._kind is None:
            # The hyper-parameters of at most in_flight pending iterations
            # and of the one being stepped are read.
            self._torch_step = TorchStep(optimizer, self._inner_step, m.params,
                                         keep=self.in_flight + 2)
        self._make_updater()
        return optimizer

    def _make_updater(self) -> None:
        """The engine's updater on the bound model's reducer (see the module
        docstring)."""
        m = self.bound
        external = None if self._torch_step is None else self._torch_step.callback()
        roots = torch_sqrt()  # the engine's Adam takes torch's square root
        self._updater = C.Updater(
            m.engine, m.reducer, self._slots(), schedule=m.config.schedule,
            optimizer=self._kind or "sgd", correct_on_arrival=m.config.correct_on_arrival,
            priority_front_fraction=m.config.priority_front_fraction,
            rebuild_buckets=m.config.rebuild_buckets, raise_if_not_finite=m.config.check_finite,
            stream=m.stream(), sqrt_f32=roots.f32, sqrt_f64=roots.f64, external=external,
            multi_tensor_steps=multi_tensor_steps(), device_clip_norms=device_clip_norms(),
            clip_norm=None if self._cuda else torch_total_norm(m.params))
        self._updater.set_gates(self._gate.gates)
        # Marks go straight to the reducer, whose observer the updater is.
        self._mark = m.reducer.mark

    def replan(self) -> None:
        # The updater is built on the reducer: it goes first, and a new one
        # is built on the new reducer (nothing is pending before the first
        # backward).
        had_updater, self._updater = self._updater is not None, None
        super().replan()
        if had_updater:
            self._make_updater()

    def _slots(self) -> list[tuple[Any, ...]]:
        """Each parameter with its optimizer state, for the updater."""
        assert self._optimizer is not None
        return slots(self._kind, self._optimizer, self.bound.names, self.bound.params)

    # ---- the forward -------------------------------------------------------

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

    def land(self, gate: int, indices: list[int]) -> None:
        """A forward reaches gate `gate` (see ForwardGate), before which
        parameters `indices` are first read."""
        if self._updater is None:
            return
        stream = self.bound.stream() if self._cuda else 0  # self._stream(), inlined
        self._updater.land(gate, torch.is_grad_enabled(), stream)

    def gates_learnt(self, gates: list[list[int]]) -> None:
        """The gate learnt (or reset) its gates; gate 0 is everything."""
        if self._updater is not None:
            self._updater.set_gates(gates)

    # ---- backward ----------------------------------------------------------

    def _stream(self) -> int:
        """The stream the engine's work of this call goes on (0 on the CPU,
        without asking torch). The per-gradient and per-gate calls inline
        it: a Python call there is paid per parameter."""
        return self.bound.stream() if self._cuda else 0

    def mark(self, index: int, grad: torch.Tensor) -> None:
        stream = self.bound.stream() if self._cuda else 0  # self._stream(), inlined
        if grad.is_contiguous() and self.grad_scaler is None:  # the common case
            self._mark(index, grad.data_ptr(), grad.data_ptr(), stream)
            return
        source = self.source(grad)  # (kept alive until the engine has copied it)
        self._mark(index, source.data_ptr(), self._local_pointer(index, grad), stream)

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

    def _local_pointer(self, index: int, grad: torch.Tensor) -> int:
        """Where the engine reads parameter `index`'s own gradient `grad`
        (decoupled's local step): `grad` itself, or a contiguous copy of it
        (kept until step(), which refreshes it: clipping edits .grad in
        place). A subclass may refuse a non-contiguous one."""
        if grad.is_contiguous():
            return grad.data_ptr()
        copy = self._local[index] = grad.contiguous()
        return copy.data_ptr()

    def backward_started(self) -> None:
        # The forward has updated the buffers, and the backward does not:
        # rank 0's are broadcast now, ahead of every bucket on the engine's
        # lane. Started after backward, the broadcast queued behind all of
        # them, and priority's optimizer.step(), which waits for it, waited
        # for every reduction: the next forward overlapped none (a
        # BatchNorm CNN at 1 Gbit/s stepped in 432 ms, wfbp in 522,
        # decoupled in 360). Only when the last broadcast has been copied
        # (priority copies it in optimizer.step()): copying one now would
        # edit buffers autograd saved; then it starts after backward.
        self._buffers_early = self._buffers.wanted and not self._buffers.pending
        if self._buffers_early:
            self._buffers.start()

    def backward_done(self, iteration: int, unmarked: list[int]) -> None:
        if self._finished is not None:  # superseded (see before_forward)
            self._unmarked.pop(self._finished, None)
            self._clip.pop(self._finished, None)
        self._finished = iteration
        self._inv_scale = None
        self._grads.remember_backward()
        if unmarked:
            self._unmarked[iteration] = unmarked
        if self._buffers.wanted and not self._buffers_early:
            self._buffers.start()
        self._buffers_early = False
        params = self.bound.params
        for i in unmarked:  # contributed as zeros; torch steps them if .grad exists
            grad = params[i].grad
            self._updater.set_local_grad(i, 0 if grad is None else self._local_pointer(i, grad))

    # ---- clipping ----------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        # The local gradients are clipped now (decoupled's local step uses
        # them); the reduced gradient is clipped by the same rule, with its
        # own global norm, when the update is applied.
        if self._finished is None:
            raise RuntimeError("model.clip_grad_norm_() goes between backward() and "
                               "optimizer.step()")
        iteration = self._finished
        local = super().clip_grad_norm_(max_norm, norm_type)
        coef = self._preview_clip(iteration, local, float(max_norm))
        self._clip[iteration] = Clip(float(max_norm), float(norm_type), coef)
        self._grads.remember_backward()
        # What clip_grad_norm_ returns under wfbp and DDP: the norm of the
        # averaged gradient, the same on every rank, read when it is known.
        return DeferredNorm(lambda: self._averaged_norm(iteration, float(norm_type)))

    def averaged_gradients(self) -> list[torch.Tensor]:
        # .grad holds this rank's own gradient here: the averaged one is the
        # engine's (what the update applies, before any clipping).
        if self._finished is None:
            raise RuntimeError("model.averaged_gradients() goes between backward() and "
                               "optimizer.step()")
        return [g.detach().clone()
                for g in averaged_before_step(self.bound, self._updater, self._finished)]

    def _preview_clip(self, iteration: int, local_norm: torch.Tensor, max_norm: float) -> float:
        """The clipping coefficient the preview of `iteration` steps with,
        given this rank's gradient norm: 1.0 here, where no preview is taken.
        (Nothing reads `local_norm` then: on a GPU, reading it would wait
        for the device each step.)"""
        return 1.0

    def recorded_clip_norm(self, iteration: int) -> float | None:
        """The total norm the update of `iteration` clipped with, once computed
        (None before; never blocks)."""
        return None if self._updater is None else self._updater.clip_norm(iteration)

    def _averaged_norm(self, iteration: int, norm_type: float) -> float:
        recorded = self.recorded_clip_norm(iteration)
        if recorded is not None:
            return recorded
        if iteration == self._finished:  # read before optimizer.step()
            return averaged_norm_before_step(self.bound, self._updater, iteration, norm_type)
        self.synchronize()  # the update computes it when it lands
        recorded = self.recorded_clip_norm(iteration)
        if recorded is None:
            raise RuntimeError(
                f"the gradient norm of iteration {iteration} was never computed: a second "
                "backward before optimizer.step() superseded that iteration (accumulate "
                "inside model.no_sync(), or read the norm before the next backward)")
        return recorded

    def take_clip(self, iteration: int) -> Clip | None:
        """How `iteration`'s gradients were clipped, if they were."""
        return self._clip.pop(iteration, None)

    # ---- GradScaler --------------------------------------------------------

    @property
    def scaling(self) -> bool:
        """A GradScaler scales this model's gradients."""
        scaler = self.grad_scaler
        return scaler is not None and scaler.is_enabled()

    # ---- optimizer.step() --------------------------------------------------

    def step(self) -> None:
        """``optimizer.step()``: the engine lands and steps (see updater.h)."""
        if self._finished is None:
            self._grads.refuse_second_step()
        self.bound.backward_since_step = False
        self._grads.check_untouched()
        opt = self._optimizer
        assert opt is not None
        overflow = take_scaler_state(opt, self.bound, self.scaling)
        if self._updater is None:  # no trainable parameters
            self._inner_step()
            return
        if self._torch_step is None:
            hyper, key = [group_hyper(group) for group in opt.param_groups], 0
        else:  # torch's step reads the optimizer's own param groups
            hyper, key = [], self._torch_step.remember()
        iteration, self._finished = self._finished, None
        self._before_update()
        params = self.bound.params
        if iteration is None:  # no synchronised backward since the last step
            grads = [p.grad if p.grad is None or p.grad.is_contiguous() else
                     p.grad.contiguous() for p in params]  # (alive during the call)
            self._updater.step_local([0 if g is None else g.data_ptr() for g in grads], hyper,
                                     self._stream(), hyper_key=key)
            return
        for i, copy in self._local.items():  # after clipping and unscaling
            if params[i].grad is not None:
                copy.copy_(params[i].grad)
        clip = self.take_clip(iteration)
        self._updater.step(
            iteration, hyper, has_unused=bool(self._unmarked.pop(iteration, None)),
            clip_max_norm=-1.0 if clip is None else clip.max_norm,
            clip_norm_type=2.0 if clip is None else clip.norm_type,
            skip_if_not_finite=self.scaling, local_overflow=overflow,
            stream=self._stream(), preview_scale=1.0 if clip is None else clip.preview_coef,
            hyper_key=key)
        self._local.clear()
        self._grads.remember_step()

    def _before_update(self) -> None:
        """In ``optimizer.step()``, before the engine is handed the update."""

    def synchronize(self) -> None:
        if self._updater is not None:
            self._updater.synchronize(self._stream())
        self._buffers.finish()

    def parameters_replaced(self) -> None:
        if self._torch_step is not None:
            self._torch_step.forget_scratch()
        if self._updater is not None:
            self._updater.replace_parameters(self._slots(), self._stream())

    def optimizer_state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        opt = self._optimizer
        if self._kind != "sgd" or opt is None or self._updater is None:
            return inner()
        return state_dict_without_unfilled_momentum(
            opt, self.bound.params, self._updater.momentum_initialised(), inner)

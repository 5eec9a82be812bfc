"""``priority`` and ``decoupled``, run by the engine's updater
(``hemiola._C.Updater``, cpp/include/hemiola/updater.h): which parameter waits
for which reduction, where in the next forward it lands, and the optimizer
step that lands it. This is their only implementation; see
docs/schedules.md for what each schedule does.

Python's part per iteration is one native call per gradient (the autograd
hook), one per lander (a module's forward pre-hook) and one per
``optimizer.step()`` with the hyper-parameters of each param group, read
every step so LR schedulers keep working. The optimizer's state lives in the
optimizer's own tensors, in torch's format, so ``optimizer.state_dict()`` and
``load_state_dict()`` are torch's.

The engine steps ``torch.optim.SGD``, ``Adam`` and ``AdamW`` itself, on CPU
and CUDA parameters (on a GPU every kernel, copy and wait is on the current
stream). Every other per-parameter optimizer, and these where the engine's
steps cannot take them (``unsupported``) or with ``native_optimizer=False``,
steps through the updater's external stepper: torch's own step, called by the
engine once per landing group (``hemiola.schedules.torch_step``). Parameters
must be dense in memory (contiguous, channels_last, ...): the updater copies
them as blocks.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hemiola._native import C
from hemiola.hyper import group_hyper
from hemiola.schedules.base import DeferredSchedule
from hemiola.schedules.torch_step import TorchStep, dense
from hemiola.tensors import dtype_code
from hemiola.torch_math import torch_sqrt

if TYPE_CHECKING:
    from hemiola.config import Config
    from hemiola.replica import Replica

_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
#: the optimizers ``decoupled`` takes a preview for when ``Config.preview`` is None
PREVIEW_BY_DEFAULT = ("adam", "adamw")


def unsupported(optimizer: Any, params: list[torch.Tensor]) -> str | None:
    """Why the engine cannot step `optimizer` for these parameters itself
    (None: it can); then torch's step does, through the external stepper."""
    name = type(optimizer).__name__
    if type(optimizer) not in _KINDS:
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
    return _KINDS[type(optimizer)]


def _flag(name: str) -> bool:
    """An on/off switch of the GPU path that waits for a GPU run before it
    becomes the default (docs/gpu.md):

    - ``HEMIOLA_MULTI_TENSOR_STEPS=1``: the engine steps a landing group's
      parameters in multi-tensor calls (on a GPU one launch per up to 24
      parameters; UpdaterOptions::multi_tensor_steps; on the CPU the same
      result);
    - ``HEMIOLA_DEVICE_CLIP=1``: on a GPU, clipping's coefficient is
      computed on the device and read there by the steps, so the host never
      waits for a reduction to clip (UpdaterOptions::device_clip_norms).
    """
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: use 1 (on) or 0 (off)")
    return raw == "1"


class NativeUpdate(DeferredSchedule):
    """``priority`` or ``decoupled`` (``model.config.schedule``) with the
    engine's updater; see the module docstring and the schedules' own."""

    @classmethod
    def reducer_needs(cls, config: Config, optimizer: Any,
                      device: torch.device) -> tuple[int, bool]:
        if config.schedule != "decoupled":
            return cls.in_flight, False
        in_flight = config.in_flight
        preview = config.preview
        if preview is None:
            preview = _KINDS.get(type(optimizer)) in PREVIEW_BY_DEFAULT and in_flight == 1
        takes = bool(preview) and device.type != "cuda" and in_flight == 1
        if config.preview and not takes:
            warnings.warn("hemiola: preview=True is implemented for CPU models with "
                          "in_flight=1 only; this model takes no preview", stacklevel=6)
        return in_flight, takes

    def __init__(self, replica: Replica, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(replica, optimizer, grad_scaler)
        for name, p in zip(replica.names, replica.params):
            if not dense(p):
                raise ValueError(
                    f"schedule={replica.config.schedule!r}: parameter {name!r} is not dense in "
                    f"memory (shape {tuple(p.shape)}, strides {p.stride()}: a view into a larger "
                    "tensor, or with gaps), and the engine's updater copies parameters as "
                    "blocks. Make it a tensor of its own before wrapping (e.g. "
                    "module.weight = nn.Parameter(module.weight.detach().clone())), or use "
                    "schedule='wfbp'.")
        #: the engine's own step ("sgd", "adam", "adamw"), or None: torch's
        #: step through the external stepper
        self._kind = native_kind(replica.config, optimizer, replica.params)
        self._torch_step: TorchStep | None = None  # the external stepper, if any
        self._updater: Any = None  # C.Updater, made by wrap_optimizer (none without parameters)
        # decoupled: contiguous copies of non-contiguous local gradients (the
        # engine reads gradients in logical order), refreshed in step()
        self._local: dict[int, torch.Tensor] = {}
        self._decoupled = replica.config.schedule == "decoupled"
        self._cuda = replica.device.type == "cuda"

    def wrap_optimizer(self, optimizer: Any) -> Any:
        optimizer = super().wrap_optimizer(optimizer)
        m = self.replica
        if not m.params:
            return optimizer  # nothing to reduce: step() is the optimizer's
        external = None
        if self._kind is None:
            # The hyper-parameters of at most in_flight pending iterations
            # and of the one being stepped are read.
            self._torch_step = TorchStep(optimizer, self._inner_step, m.params,
                                         keep=self.in_flight + 2)
            external = self._torch_step.callback()
        roots = torch_sqrt()  # the engine's Adam takes torch's square root
        self._updater = C.Updater(
            m.engine, m.reducer, self._slots(), schedule=m.config.schedule,
            optimizer=self._kind or "sgd", correct_on_arrival=m.config.correct_on_arrival,
            priority_front_fraction=m.config.priority_front_fraction,
            rebuild_buckets=m.config.rebuild_buckets, raise_if_not_finite=m.config.check_finite,
            stream=m.stream(), sqrt_f32=roots.f32, sqrt_f64=roots.f64, external=external,
            multi_tensor_steps=_flag("HEMIOLA_MULTI_TENSOR_STEPS"),
            device_clip_norms=_flag("HEMIOLA_DEVICE_CLIP"))
        self._updater.set_landers(self._gate.landers)
        return optimizer

    def _slots(self) -> list[tuple[Any, ...]]:
        """Each parameter with its optimizer state, created as torch creates
        it on the first step (an SGD momentum buffer the engine has not
        initialised yet is kept out of state_dict(), see below). The external
        stepper keeps the state in the optimizer: none is handed over."""
        opt = self._optimizer
        assert opt is not None
        if self._kind is None:
            return [(name, p.data_ptr(), dtype_code(p.dtype), p.numel(), 0, 0, False, 0, 0, 0, 0)
                    for name, p in zip(self.replica.names, self.replica.params)]
        group_of = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
        slots = []
        for name, p in zip(self.replica.names, self.replica.params):
            group = opt.param_groups[group_of[id(p)]]
            state = opt.state[p]
            momentum_buffer = exp_avg = exp_avg_sq = max_exp_avg_sq = step = 0
            initialised = False
            if self._kind == "sgd":
                buf = state.get("momentum_buffer")
                initialised = buf is not None
                if buf is None and group["momentum"] != 0:
                    buf = state["momentum_buffer"] = torch.zeros_like(p)
                if buf is not None:
                    momentum_buffer = self._state_pointer(state, "momentum_buffer", p)
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
                exp_avg = self._state_pointer(state, "exp_avg", p)
                exp_avg_sq = self._state_pointer(state, "exp_avg_sq", p)
                if "max_exp_avg_sq" in state:
                    max_exp_avg_sq = self._state_pointer(state, "max_exp_avg_sq", p)
                step = state["step"].data_ptr()
            slots.append((name, p.data_ptr(), dtype_code(p.dtype), p.numel(),
                          group_of[id(p)], momentum_buffer, initialised, exp_avg, exp_avg_sq,
                          max_exp_avg_sq, step))
        return slots

    @staticmethod
    def _state_pointer(state: dict[str, Any], key: str, p: torch.Tensor) -> int:
        """The state tensor `key` as the engine reads it: contiguous, of the
        parameter's dtype and size (replaced in `state` if it was not)."""
        t = state[key]
        if t.dtype != p.dtype or t.shape != p.shape or not t.is_contiguous() or \
                t.device != p.device:
            t = state[key] = t.to(device=p.device, dtype=p.dtype).reshape(p.shape).contiguous()
        return int(t.data_ptr())

    # ---- per iteration -----------------------------------------------------

    def _stream(self) -> int:
        """The stream the engine's work of this call goes on (0 on the CPU,
        without asking torch). The per-gradient and per-lander calls inline
        it: a Python call there is paid per parameter."""
        return self.replica.stream() if self._cuda else 0

    def mark(self, index: int, grad: torch.Tensor) -> None:
        stream = self.replica.stream() if self._cuda else 0  # self._stream(), inlined
        if grad.is_contiguous() and self.grad_scaler is None:  # the common case
            self._updater.mark(index, grad.data_ptr(), grad.data_ptr(), stream)
            return
        source = self.source(grad)  # (kept alive until the engine has copied it)
        self._updater.mark(index, source.data_ptr(), self._local_pointer(index, grad), stream)

    def _local_pointer(self, index: int, grad: torch.Tensor) -> int:
        """Where decoupled's local step reads parameter `index`'s own
        gradient `grad`: `grad` itself, or a contiguous copy of it (kept
        until step(), which refreshes it: clipping edits .grad in place)."""
        if grad.is_contiguous():
            return grad.data_ptr()
        if self._kind is not None and self._decoupled:
            # (unsupported() sends non-contiguous parameters to the external
            # stepper; a contiguous parameter's gradient is contiguous)
            raise ValueError(
                f"parameter {self.replica.names[index]!r} has a non-contiguous gradient; the "
                "engine's own optimizer step reads it in place. Make the parameter's gradient "
                "contiguous or pass native_optimizer=False to hemiola.wrap.")
        copy = self._local[index] = grad.contiguous()
        return copy.data_ptr()

    def backward_done(self, iteration: int, unmarked: list[int]) -> None:
        super().backward_done(iteration, unmarked)
        params = self.replica.params
        for i in unmarked:  # contributed as zeros; torch steps them if .grad exists
            grad = params[i].grad
            self._updater.set_local_grad(i, 0 if grad is None else self._local_pointer(i, grad))

    def land(self, lander: int, indices: list[int]) -> None:
        if self._updater is None:
            return
        stream = self.replica.stream() if self._cuda else 0  # self._stream(), inlined
        self._updater.land(lander, torch.is_grad_enabled(), stream)

    def landers_learnt(self, landers: list[list[int]]) -> None:
        if self._updater is not None:
            self._updater.set_landers(landers)

    def step(self) -> None:
        """``optimizer.step()``: the engine lands and steps (see updater.h)."""
        self.check_grads_untouched()
        overflow = self.take_scaler_state()
        opt = self._optimizer
        assert opt is not None
        if self._updater is None:  # no trainable parameters
            self._inner_step()
            return
        if self._torch_step is None:
            hyper, key = [group_hyper(group) for group in opt.param_groups], 0
        else:  # torch's step reads the optimizer's own param groups
            hyper, key = [], self._torch_step.remember()
        iteration, self._finished = self._finished, None
        if not self._decoupled:
            self._buffers.finish()  # the previous iteration's broadcast, as DDP's order
        params = self.replica.params
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

    def recorded_clip_norm(self, iteration: int) -> float | None:
        return None if self._updater is None else self._updater.clip_norm(iteration)

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
        # A momentum buffer the first step has not filled is not torch's state.
        hidden = {}
        for p, initialised in zip(self.replica.params, self._updater.momentum_initialised()):
            if not initialised and "momentum_buffer" in opt.state.get(p, {}):
                hidden[p] = opt.state[p].pop("momentum_buffer")
        try:
            return inner()
        finally:
            for p, buf in hidden.items():
                opt.state[p]["momentum_buffer"] = buf

    def stats(self) -> dict[str, float]:
        if not self._decoupled or self._updater is None:
            return {}
        stats = {"approximate_read_fraction": self._updater.approximate_read_fraction()}
        if self.preview:
            stats["preview_read_fraction"] = self._updater.preview_read_fraction()
            stats["preview_error"] = self.replica.reducer.preview_error()
        return stats

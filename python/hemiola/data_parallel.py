"""The wrapped model: hooks autograd into the engine's gradient reducer.

What happens around a backward pass is the same for every schedule (hooks mark
gradients ready; at the end, missing gradients are handled and the iteration's
marking is closed); what happens next is the schedule's business (see
``hemiola.schedules``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hemiola._native import C
from hemiola.bound_model import BoundModel
from hemiola.comm_hooks import compression_of
from hemiola.config import COMPRESSIONS, RESIDUAL_CODINGS, Config, compression_code
from hemiola.engine_tensors import all_gather_rows, broadcast_tensors
from hemiola.hooks import weak_hook
from hemiola.schedules import Schedule, choose_schedule
from hemiola.timeline import Recorder
from hemiola.validate import check_module, check_same_model

#: attribute set on a wrapped module and on a taken-over optimizer, so that
#: wrapping either a second time is refused
WRAPPED_MARK = "_hemiola_wrapped"


class DataParallel(nn.Module):
    """A module whose gradients are reduced across ranks while backward runs.

    Made by :func:`hemiola.wrap`. Behaves like ``torch.nn.parallel.
    DistributedDataParallel``: parameters and buffers are broadcast from rank 0
    when wrapped, buffers are kept in sync with rank 0's, and ``state_dict()``
    is the wrapped module's own (no ``module.`` prefix). When gradients come
    back and how the optimizer uses them depends on the schedule
    (:class:`hemiola.Config`).
    """

    def __init__(self, module: nn.Module, config: Config, engine: C.Engine, store: C.Store,
                 grad_scaler: torch.amp.GradScaler | None = None, optimizer: Any = None):
        super().__init__()
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got "
                            f"{type(grad_scaler).__name__}")
        #: the GradScaler given to hemiola.wrap (None: no loss scaling)
        self.grad_scaler = grad_scaler
        #: the device the model lives on (the CPU or one GPU)
        self.device = check_module(module)
        self._refuse_compression_on_gpu(config.compression)
        self.module = module
        check_same_model(engine, store, module, config)
        broadcast_tensors(engine, [*module.parameters(), *module.buffers()])
        # The schedule's kind decides what its reducer must hold, so it is
        # chosen first; the bound model (parameters, reducer, results) is built
        # for it, and the schedule from the bound model, each complete when made.
        kind = choose_schedule(config)
        in_flight, preview = kind.reducer_needs(config, optimizer, self.device)
        self._bound = BoundModel(module, engine, config, self.device, in_flight, preview,
                                 with_reducer=kind.uses_reducer, store=store)
        self._schedule: Schedule = kind(self._bound, optimizer, grad_scaler)
        # Checkpoints are exact however they are taken (model.state_dict(),
        # model.module.state_dict(), a reference to the module kept from
        # before): pending updates land first; a load replaces them.
        module.register_state_dict_pre_hook(lambda *_: self.synchronize())
        module.register_load_state_dict_pre_hook(lambda *_: self.synchronize())
        module.register_load_state_dict_post_hook(
            lambda *_: self._schedule.parameters_replaced())
        #: DDP's flag (``no_sync()`` clears it; nanoGPT sets it directly): when
        #: False, backward accumulates gradients locally and reduces nothing.
        self.require_backward_grad_sync = True
        self._in_backward = False
        self._backward_start = 0
        self.timeline_recorder.watch_modules(module)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad, i))
            for i, p in enumerate(self._bound.params)
        ]

    @property
    def config(self) -> Config:
        """The configuration the model was wrapped with (:class:`hemiola.Config`)."""
        return self._bound.config

    @property
    def timeline_recorder(self) -> Recorder:
        """Records forward, backward and waits on the engine's timeline."""
        return self._bound.timeline

    # ---- user API ----------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Under torch.compile(wrapped model) this is traced; the flag is a
        # constant of the compiled code, and _pre_forward runs eagerly.
        self._pre_forward(torch.compiler.is_compiling())
        with (self.timeline_recorder.span("compute", "forward", "forward"),
              self._schedule.forward_scope()):
            module = self.module
            if self._schedule.observing:
                # Learning where parameters are first read needs the eager
                # module (torch.compile(model) before wrapping).
                module = getattr(module, "_orig_mod", module)
            out = module(*args, **kwargs)
        self._bound.require_forward_param_sync = (torch.is_grad_enabled()
                                                    and self.require_backward_grad_sync)
        return out

    @torch.compiler.disable
    def _pre_forward(self, compiled: bool) -> None:
        if compiled:
            self._schedule.forward_is_compiled()
        self._schedule.before_forward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside accumulate locally;
        the first backward after it reduces the accumulated gradients.
        (Setting ``require_backward_grad_sync`` does the same, as in DDP.)"""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """DDP's ``register_comm_hook`` for torch's standard hooks: each is
        mapped to the engine's native compression (``allreduce_hook``: none;
        ``fp16_compress_hook`` / ``bf16_compress_hook``: ``compression=
        "fp16"`` / ``"bf16"``; ``powerSGD_hook``: ``"powersgd"`` with its
        state's rank and first iteration); any other hook is refused with the
        list of those understood. As with DDP, call it on every rank before
        the first backward; ranks that register different hooks fail here,
        naming them.
        """
        compression, options = compression_of(state, hook)
        reducer = self._bound.reducer
        if reducer is not None and reducer.iterations_started > 0:
            raise RuntimeError("register_comm_hook must be called before the first backward "
                               "(as with DDP)")
        self._refuse_compression_on_gpu(compression)
        code = compression_code(compression)
        config = dataclasses.replace(self.config, compression=compression, **options)
        chosen = [code, config.powersgd_rank, config.powersgd_start_iter]
        rows = all_gather_rows(self._bound.engine,
                               torch.tensor(chosen, dtype=torch.float64)).tolist()
        if any(row != rows[0] for row in rows):
            names = {v: k for k, v in COMPRESSIONS.items()}
            seen = [f"{names.get(int(c), 'none')}" + (f" (rank {int(r)}, from iteration "
                    f"{int(i)})" if int(c) == COMPRESSIONS["powersgd"] else "")
                    for c, r, i in rows]
            raise RuntimeError(f"register_comm_hook: the ranks registered different hooks "
                               f"(compression per rank: {seen}); register the same on every rank")
        replan = config.partition_bytes != self.config.partition_bytes
        self._bound.config = config
        if replan:
            # priority's 4 MiB partitions, planned at wrap time, would cut
            # large matrices into pieces PowerSGD cannot compress: plan the
            # buckets again, as wrap(compression="powersgd") does.
            self._schedule.replan()
        elif reducer is not None:
            reducer.set_compression(code, powersgd_rank=config.powersgd_rank,
                                    powersgd_start_iteration=config.powersgd_start_iter)

    def _refuse_compression_on_gpu(self, compression: str | None) -> None:
        """Compression on a CUDA model: what the engine's table says runs on
        a GPU (today fp16 and bf16, which it casts on its stream); the others
        are CPU only."""
        if compression is None or self.device.type != "cuda":
            return
        on_gpu = [c for c in C.codings("cuda") if c != "none"]
        if compression not in on_gpu:
            raise ValueError(f"compression={compression!r} is implemented for CPU models only; "
                             f"on a GPU use compression={' or '.join(repr(c) for c in on_gpu)}, "
                             "or None")

    def comm_state_dict(self) -> dict[str, torch.Tensor]:
        """The communication state a checkpoint must carry to resume exactly:
        with ``compression="int8"``, ``"int4"`` or ``"powersgd"``, each compressed
        parameter's error-feedback residuals (what this rank's codings have
        dropped and will add next time), flat, by parameter name; empty
        otherwise. Per rank: save it from every rank (torch.save to a per-rank
        file) and load it into the same rank with :meth:`load_comm_state_dict`.
        (PowerSGD's warm-start matrices are not in it, and its iteration count
        starts again with the new wrap: a resumed run travels uncompressed for
        ``powersgd_start_iter`` iterations, then starts the matrices afresh.)"""
        r = self._bound
        if self.config.compression not in RESIDUAL_CODINGS or r.reducer is None:
            return {}
        self.synchronize()
        out = {}
        for i, (name, p) in enumerate(zip(r.names, r.params)):
            view = r.reducer.residual_view(i)
            if p.dtype == torch.float32 and view.nbytes > 0:
                # int8/int4 keep two residuals per element (their own coding's
                # and the owner's), PowerSGD one: flat, as the coding holds it.
                out[name] = torch.frombuffer(view, dtype=torch.float32).clone()
        return out

    def load_comm_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores what :meth:`comm_state_dict` returned (on the same rank)."""
        mine = self.comm_state_dict()
        if set(state) != set(mine):
            raise ValueError(f"comm state holds {sorted(state)[:4]}..., this model expects "
                             f"{sorted(mine)[:4]}... (was it saved with the same compression?)")
        for name, tensor in state.items():
            if tensor.shape != mine[name].shape:
                raise ValueError(f"comm state {name!r} has shape {tuple(tensor.shape)}, this "
                                 f"model's is {tuple(mine[name].shape)}")
        reducer = self._bound.reducer
        assert reducer is not None or not mine
        for i, name in enumerate(self._bound.names):
            if name in state:
                view = torch.frombuffer(reducer.residual_view(i), dtype=torch.float32)  # type: ignore[union-attr]
                view.copy_(state[name].reshape(-1))

    def synchronize(self) -> None:
        """Lands every pending correction: afterwards every rank holds the
        exact global parameters (bitwise identical across ranks). Local: no
        communication beyond waiting for this rank's own reductions."""
        self._schedule.synchronize()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the gradients the optimizer
        will apply; call it between ``backward()`` and ``optimizer.step()``.

        Under ``wfbp`` that is the averaged ``.grad``. Under ``priority`` and
        ``decoupled`` ``.grad`` holds this rank's own gradient when
        ``backward()`` returns: it is clipped now (``decoupled``'s local step
        uses it) and the averaged gradient is clipped by the same rule, with
        its own global norm, when the update is applied. Returns the norm of
        the averaged gradient, as DDP does, the same on every rank: under
        ``priority``/``decoupled`` a 0-d tensor filled when first read
        (reading it before ``optimizer.step()`` waits for the reduction).
        """
        return self._schedule.clip_grad_norm_(max_norm, norm_type)

    def averaged_gradients(self) -> dict[str, torch.Tensor]:
        """The gradient every rank's optimizer applies, by parameter name (a
        copy): the average over the ranks, what ``.grad`` holds under DDP and
        ``wfbp``. Under ``priority`` and ``decoupled`` ``.grad`` keeps this
        rank's own gradient, so read this instead to log or inspect the
        gradient; it waits for the reduction. Call it between ``backward()``
        and ``optimizer.step()``; it is the gradient before clipping."""
        grads = self._schedule.averaged_gradients()
        return dict(zip(self._bound.names, grads))

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of :meth:`averaged_gradients` (what a DDP script logs from
        ``.grad``; ``clip_grad_norm_`` returns the same while it clips), the
        same on every rank. Between ``backward()`` and ``optimizer.step()``."""
        return torch.nn.utils.get_total_norm(list(self.averaged_gradients().values()),
                                             norm_type)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped module's state dict (no ``module.`` prefix), exact:
        pending updates land first. ``model.module.state_dict()`` is the same."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads into the wrapped module (``model.module.load_state_dict`` is the
        same): what was pending is landed first and forgotten after."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def train(self, mode: bool = True) -> DataParallel:
        if not mode:
            self.synchronize()  # evaluate the exact parameters
        return super().train(mode)

    @property
    def rank(self) -> int:
        return self._bound.rank

    @property
    def world_size(self) -> int:
        return self._bound.world_size

    def stats(self) -> dict[str, float]:
        """Counters of the schedule. ``decoupled``: ``approximate_read_fraction``,
        the fraction of parameter elements that training forwards read while
        they still held the approximation (0: every correction had landed
        before its first read; 1: communication always took the whole next
        iteration). With the preview also ``preview_read_fraction`` (those
        reads that took the preview) and ``preview_error``, the previews'
        relative distance from the averages they estimate,
        sqrt(sum |estimate - average|^2 / sum |average|^2)."""
        return self._schedule.stats()

    def buckets(self) -> list[list[str]]:
        """The current fusion plan: parameter names per bucket, in issue order
        (``priority`` sends the buckets holding the front layers last,
        front-most first, so its order is not backward's)."""
        names = self._bound.names
        return [[names[i] for i in bucket] for bucket in self._schedule.buckets()]

    def timeline(self) -> str:
        """Chrome trace JSON of engine events (``timeline=True`` to record)."""
        return self._bound.engine.timeline_json()

    # ---- autograd plumbing -------------------------------------------------

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        """Parameter `index`'s gradient is complete for this backward."""
        self._bound.backward_since_step = True
        if not self.require_backward_grad_sync:
            return
        grad = param.grad
        if grad is None:
            return
        if not self._in_backward:
            self._in_backward = True
            self._backward_start = self.timeline_recorder.now()
            # Runs once, when the whole backward pass has finished.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._schedule.backward_started()
        if grad.is_sparse:
            name = self._bound.names[index]
            raise ValueError(f"parameter {name!r} got a sparse gradient; hemiola reduces "
                             "dense gradients only")
        self._schedule.mark(index, grad)

    def _finish_backward(self) -> None:
        self._in_backward = False
        self.timeline_recorder.record("compute", "backward", "backward", self._backward_start)
        schedule = self._schedule
        unmarked = schedule.unmarked()
        if unmarked:
            if not self.config.find_unused_parameters:
                names = [self._bound.names[i] for i in unmarked]
                message = (
                    f"hemiola: {len(names)} parameter(s) received no gradient in this "
                    f"backward pass: {', '.join(names[:10])}"
                    f"{' ...' if len(names) > 10 else ''}. If they are not used in forward "
                    "in some iterations, pass find_unused_parameters=True to hemiola.wrap; "
                    "if they should never be trained, set requires_grad=False before "
                    "wrapping."
                )
                schedule.abort_backward(message)
                raise RuntimeError(message)
            for i in unmarked:
                schedule.mark_unused(i)
        schedule.backward_done(schedule.finish_marking(), unmarked)

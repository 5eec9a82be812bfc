"""The landing path that steps with torch's optimizer: the fallback of
``priority`` and ``decoupled`` for what the engine's updater does not cover
(optimizers other than SGD / Adam / AdamW, non-contiguous parameters, or
``native_optimizer=False``; see ``hemiola.schedules.native``). The landing
logic here mirrors the engine's (cpp/src/engine/updater.cpp) with
per-parameter Python bookkeeping, which is why it is only the fallback."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hemiola.schedules.base import (
    Clip,
    DeferredSchedule,
    hyper_parameters,
    set_hyper_parameters,
)
from hemiola.tensors import raise_if_not_finite

if TYPE_CHECKING:
    from hemiola.replica import Replica

__all__ = ["PendingUpdate", "TorchUpdate", "hyper_parameters"]


class PendingUpdate:
    """An iteration whose reduced gradients have not been applied to every
    parameter yet."""

    def __init__(self, iteration: int, hyper: list[dict[str, Any]], unmarked: list[int] | None,
                 clip: Clip | None, check_finite: bool = False) -> None:
        self.iteration = iteration
        self.hyper = hyper  # the hyper-parameters the iteration ran with
        self.unmarked = unmarked  # parameters this rank contributed as zeros
        self.clip = clip  # model.clip_grad_norm_'s
        #: the norm of the whole reduced gradient (clip's norm type, else 2),
        #: once computed; and the clipping coefficient derived from it
        self.norm: torch.Tensor | None = None
        self.coef: torch.Tensor | None = None
        #: usage counts read before a rebuild of the buckets discarded them
        self.usage: list[int] | None = None
        #: a GradScaler is in use: the update is skipped if any reduced
        #: gradient is not finite (some rank overflowed)
        self.check_finite = check_finite

    @property
    def needs_whole(self) -> bool:
        """Usage counts (unused parameters) and the clipping norm exist only
        once the whole iteration is reduced."""
        return bool(self.unmarked) or self.clip is not None or self.check_finite


class TorchUpdate(DeferredSchedule):
    """A deferred schedule whose updates are torch optimizer steps over the
    reduced gradients, read out of the engine one parameter at a time."""

    def __init__(self, replica: Replica, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(replica, optimizer, grad_scaler)
        # The first iteration runs synchronously, then the buckets are rebuilt.
        self._rebuilt = not replica.config.rebuild_buckets
        self._members: list[list[int]] = []     # per bucket: its parameters
        self._buckets_of: list[list[int]] = []  # per parameter: its buckets (pieces)
        # Parameters a forward read since the last backward.
        self._read: set[int] = set()

    def refresh_buckets(self) -> None:
        """Reads the reducer's bucket plan (after it was built or rebuilt)."""
        self._members = self.replica.reducer.buckets()
        self._buckets_of = [[] for _ in self.replica.params]
        for b, members in enumerate(self._members):
            for i in members:
                self._buckets_of[i].append(b)

    def wait_params(self, iteration: int, indices: list[int]) -> None:
        """Waits for the reduced gradients of parameters `indices` of
        `iteration` (their buckets, in issue order)."""
        with self.replica.timeline.span(
                "compute", f"wait {len(indices)} parameters ({iteration})", "wait"):
            self.replica.reducer.wait_for(iteration, indices, stream=self.replica.stream())

    def shadow_of(self, index: int) -> torch.Tensor:
        """The exact copy of parameter `index` a committed step starts from."""
        return self.replica.params[index]

    def step_with(self, grads: list[torch.Tensor | None], hyper: list[dict[str, Any]]) -> None:
        """One committed step, with the hyper-parameters `hyper`, over the
        parameters that have a gradient in `grads`: the user's optimizer,
        whose other parameters' gradients are hidden (torch optimizers skip a
        parameter without a gradient). ``.grad`` is left as it was."""
        opt = self._optimizer
        assert opt is not None
        params = self.replica.params
        saved = [p.grad for p in params]
        current = hyper_parameters(opt)
        try:
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.grad = g
                set_hyper_parameters(opt, hyper)
                self._inner_step()
        finally:
            set_hyper_parameters(opt, current)
            for p, g in zip(params, saved):
                p.grad = g

    def arrived(self, iteration: int, indices: list[int]) -> list[int]:
        """Those of `indices` whose every bucket of `iteration` is reduced."""
        if iteration in self.replica.gathered_iterations:
            return indices  # waited for before the buckets were rebuilt
        return self.replica.reducer.arrived(iteration, indices)

    def land(self, lander: int, indices: list[int]) -> None:
        self.land_before_forward(indices)
        self._read.update(indices)

    def land_before_forward(self, indices: list[int]) -> None:
        """The forward pre-hook of the module that reads `indices` first."""
        raise NotImplementedError

    def unread(self, indices: list[int]) -> list[int]:
        """Those of `indices` that no forward has read since the last
        backward (a forward may have read the others, and autograd may still
        need the values it read, so they must not be written until then)."""
        return [i for i in indices if i not in self._read]

    def backward_done(self, iteration: int, unmarked: list[int]) -> None:
        self._read.clear()
        super().backward_done(iteration, unmarked)


    def wait_for(self, pending: PendingUpdate, indices: list[int]) -> None:
        """Waits until `pending`'s reduced gradients of parameters `indices`
        can be applied: their buckets, or the whole iteration if it needs it."""
        if pending.iteration in self.replica.gathered_iterations:
            return  # waited for before the buckets were rebuilt
        if pending.needs_whole:
            with self.replica.timeline.span(
                    "compute", f"wait reduction {pending.iteration}", "wait"):
                self.replica.reducer.wait(pending.iteration, stream=self.replica.stream())
        else:
            self.wait_params(pending.iteration, indices)

    def apply_reduced(self, pending: PendingUpdate, chosen: set[int]) -> None:
        """One step of the user's optimizer applying `pending`'s reduced
        gradients to the parameters `chosen` (all arrived): parameters no rank
        used are skipped, and a clipped iteration's gradients are scaled by
        torch's clip_grad_norm_ coefficient of the whole reduced gradient."""
        m = self.replica
        it = pending.iteration
        count = len(m.params)
        usage = pending.usage
        if usage is None and pending.unmarked:
            usage = m.reducer.usage(it)
        used = [usage is None or usage[i] > 0 for i in range(count)]
        if (pending.check_finite or pending.clip) and pending.norm is None:
            # needs_whole: every bucket has arrived. One norm serves both.
            norm_type = pending.clip.norm_type if pending.clip else 2.0
            pending.norm = torch.nn.utils.get_total_norm(
                [m.reduced(it, i) for i in range(count) if used[i]], norm_type)
            if pending.clip:
                pending.coef = torch.clamp(pending.clip.max_norm / (pending.norm + 1e-6),
                                           max=1.0)
                self._clip_norms[it] = float(pending.norm)
                self._clip_norms.pop(it - 16, None)
        if pending.check_finite and not bool(torch.isfinite(pending.norm)):
            return  # non-finite iff some rank overflowed: GradScaler skips, on every rank
        if m.config.check_finite and not pending.check_finite:  # (a scaler skips instead)
            raise_if_not_finite([(m.names[i], m.reduced(it, i)) for i in sorted(chosen)
                                 if used[i]], it)
        grads: list[torch.Tensor | None] = []
        for i in range(count):
            g = m.reduced(it, i) if i in chosen and used[i] else None
            grads.append(g if g is None or pending.coef is None else g * pending.coef)
        self.step_with(grads, pending.hyper)

    def mark(self, index: int, grad: torch.Tensor) -> None:
        source = self.source(grad)
        # The engine copies the gradient in now; the result stays in the
        # reducer (or, if partitioned, goes to a tensor of the model's).
        self.replica.reducer.mark_ready_to(index, source.data_ptr(),
                                           self.replica.result_target(index),
                                           stream=self.replica.stream())


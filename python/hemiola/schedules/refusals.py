"""What the engine's updater refuses, saying what to do instead: a parameter
that is not dense in memory, a ``.grad`` edited in place between backward
and ``optimizer.step()`` (the update applies the reduced gradient, which the
edit never reaches), and a second step from the ``.grad`` the last one was
given (it would make the ranks' models differ)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from hemiola.schedules.torch_step import dense

if TYPE_CHECKING:
    from hemiola.bound_model import BoundModel


def refuse_scattered_parameters(bound: BoundModel) -> None:
    """Raises for the first parameter that is not dense in memory: the
    updater copies parameters as blocks."""
    for name, p in zip(bound.names, bound.params):
        if not dense(p):
            raise ValueError(
                f"schedule={bound.config.schedule!r}: parameter {name!r} is not dense in "
                f"memory (shape {tuple(p.shape)}, strides {p.stride()}: a view into a larger "
                "tensor, or with gaps), and the engine's updater copies parameters as "
                "blocks. Make it a tensor of its own before wrapping (e.g. "
                "module.weight = nn.Parameter(module.weight.detach().clone())), or use "
                "schedule='wfbp'.")


class GradWatch:
    """The ``.grad`` tensors as backward left them and as the last
    synchronised step took them, to refuse an in-place edit of them
    before ``optimizer.step()`` and a second step from them."""

    def __init__(self, bound: BoundModel) -> None:
        self.bound = bound
        # The local gradients as backward (or clipping) left them (object,
        # version), until the step checks them.
        self._seen: list[tuple[int, int]] | None = None
        # The .grad tensors (and versions) the last synchronised step was given.
        self._stepped: list[tuple[Any, int]] = []

    def remember_backward(self) -> None:
        """The local gradients are final for this iteration (backward ended,
        or ``model.clip_grad_norm_`` clipped them)."""
        self._seen = [(id(p.grad), p.grad._version) if p.grad is not None else (0, 0)
                      for p in self.bound.params]

    def check_untouched(self) -> None:
        """Raises if .grad was modified in place since backward (clipping,
        unscaling): under this schedule the update applies the reduced
        gradient, which such an edit never reaches."""
        seen, self._seen = self._seen, None
        if seen is None:
            return
        m = self.bound
        for (grad_id, version), p, name in zip(seen, m.params, m.names):
            if grad_id and id(p.grad) == grad_id and p.grad._version != version:
                raise RuntimeError(
                    f"parameter {name!r}: its .grad was modified in place between backward() "
                    f"and optimizer.step(). schedule={m.config.schedule!r} updates with the "
                    "reduced gradient, which such an edit does not reach. To clip, call "
                    "model.clip_grad_norm_(max_norm) instead of torch.nn.utils."
                    "clip_grad_norm_; for other gradient edits use schedule='wfbp'."
                )

    def remember_step(self) -> None:
        """A synchronised step was given the present ``.grad`` tensors."""
        self._stepped = [(None, 0) if p.grad is None else
                         (weakref.ref(p.grad), p.grad._version) for p in self.bound.params]

    def refuse_second_step(self) -> None:
        """``optimizer.step()`` with no synchronised backward since the last
        step, while ``.grad`` still holds what that step was given: under DDP
        that is the averaged gradient, applied again on every rank alike;
        here it is this rank's own gradient, and stepping from it would make
        the ranks' models differ. Refused, saying what to do. (After
        ``zero_grad()``, or a backward inside ``no_sync()``, ``.grad`` holds
        something else, and a step from it is what DDP would take.)"""
        m = self.bound
        again = [name for (ref, version), p, name in zip(self._stepped, m.params, m.names)
                 if ref is not None and p.grad is not None and ref() is p.grad
                 and p.grad._version == version]
        if again:
            schedule = m.config.schedule
            raise RuntimeError(
                f"optimizer.step() was called again with no backward() since the last step "
                f"(.grad of {again[0]!r}{' and others' if len(again) > 1 else ''} is the one "
                f"already stepped). Under schedule={schedule!r} .grad holds this rank's own "
                "gradient (the averaged one is applied inside hemiola), so a second step from "
                "it would make the ranks' models differ. Step once per backward: to accumulate "
                "micro-batches, call backward() on each (inside model.no_sync() for all but "
                "the last) and optimizer.step() once; to apply the same averaged gradient "
                "twice, use schedule='wfbp' (as DDP does).")

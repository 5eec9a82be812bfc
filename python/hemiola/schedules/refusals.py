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
        step. Under DDP ``.grad`` is then the averaged gradient (or what the
        user made of it, the same on every rank), and the step applies it on
        every rank alike; here it is this rank's own gradient, and a step
        from it, as it is or edited in place (``p.grad.mul_(0.5)``), would
        make the ranks' models differ. Refused, saying what to do, unless a
        backward ran since the last step (inside ``no_sync()``: DDP steps
        from those local gradients too) or every ``.grad`` is None or zero
        (``zero_grad()``: the same step on every rank)."""
        m = self.bound
        if m.backward_since_step:
            return
        stepped = self._stepped or [(None, 0)] * len(m.params)
        left = [(name, p.grad, record) for p, name, record in zip(m.params, m.names, stepped)
                if p.grad is not None and bool(p.grad.any())]
        if not left:
            return
        name, grad, (ref, version) = left[0]
        untouched = ref is not None and ref() is grad and grad._version == version
        what = "is the one already stepped" if untouched else "was changed since the last step"
        schedule = m.config.schedule
        raise RuntimeError(
            f"optimizer.step() was called again with no backward() since the last step (.grad "
            f"of {name!r}{' and others' if len(left) > 1 else ''} {what}). Under schedule="
            f"{schedule!r} .grad holds this rank's own gradient (the averaged one is applied "
            "inside hemiola), so a second step from it, edited or not, would make the ranks' "
            "models differ. Step once per backward: to accumulate micro-batches, call "
            "backward() on each (inside model.no_sync() for all but the last) and "
            "optimizer.step() once; to apply the same averaged gradient twice, or to edit it "
            "between steps, use schedule='wfbp' (as DDP does).")

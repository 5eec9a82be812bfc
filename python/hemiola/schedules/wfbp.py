"""``wfbp``: wait-free back-propagation with tensor fusion (torch DDP's math)."""

from __future__ import annotations

from typing import Any

import torch

from hemiola.bound_model import BoundModel
from hemiola.engine_tensors import raise_if_not_finite
from hemiola.schedules.base import Schedule


class Wfbp(Schedule):
    """Buckets are reduced while backward runs; the end of backward waits for
    the last one, so ``backward()`` returns with every gradient averaged."""

    in_flight = 0

    def __init__(self, bound: BoundModel, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(bound, optimizer, grad_scaler)
        # Gradients handed to the engine stay referenced until it wrote back.
        self._inflight: list[torch.Tensor] = []
        # Non-contiguous gradients are reduced through a contiguous copy.
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rebuilt = not bound.config.rebuild_buckets

    def before_forward(self) -> None:
        m = self.bound
        if m.config.broadcast_buffers and m.require_forward_param_sync and m.buffers:
            m.sync_buffers()

    def mark(self, index: int, grad: torch.Tensor) -> None:
        if not grad.is_contiguous():
            staged = grad.contiguous()
            self._staged.append((grad, staged))
            grad = staged
        self._inflight.append(grad)
        self.bound.reducer.mark_ready(index, grad.data_ptr(), stream=self.bound.stream())

    def backward_done(self, iteration: int, unmarked: list[int]) -> None:
        reducer = self.bound.reducer
        try:
            with self.bound.timeline.span("compute", f"wait reduction {iteration}",
                                            "wait"):
                reducer.wait(iteration, stream=self.bound.stream())
            if unmarked:
                self._write_back_unused(iteration, unmarked)
            for grad, staged in self._staged:
                grad.copy_(staged)
            m = self.bound
            if m.config.check_finite:
                raise_if_not_finite([(n, p.grad) for n, p in zip(m.names, m.params)
                                     if p.grad is not None], iteration)
        finally:
            self._inflight.clear()
            self._staged.clear()
        if not self._rebuilt:
            reducer.rebuild_from_observed_order()
            self._rebuilt = True

    def _write_back_unused(self, iteration: int, unmarked: list[int]) -> None:
        # A parameter this rank did not use but another did gets the average;
        # one no rank used keeps its .grad as it was (as in DDP).
        usage = self.bound.reducer.usage(iteration)
        for i in unmarked:
            if usage[i] == 0:
                continue
            p = self.bound.params[i]
            reduced = self.bound.reduced(iteration, i)
            if p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)

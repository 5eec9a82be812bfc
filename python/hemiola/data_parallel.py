"""The wrapped model: hooks autograd into the engine's gradient reducer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hemiola._native import C
from hemiola.config import Config
from hemiola.tensors import broadcast_tensors, dtype_code
from hemiola.validate import check_module, check_same_model


class DataParallel(nn.Module):
    """A module whose gradients are averaged across ranks during ``backward()``.

    Made by :func:`hemiola.wrap`. Behaves like ``torch.nn.parallel.
    DistributedDataParallel``: parameters and buffers are broadcast from rank 0
    when wrapped, buffers again before each forward (``broadcast_buffers``),
    and ``loss.backward()`` returns with every gradient averaged over ranks.
    ``state_dict()`` is the wrapped module's own (no ``module.`` prefix).
    """

    def __init__(self, module: nn.Module, config: Config, engine: C.Engine, store: C.Store):
        super().__init__()
        check_module(module)
        self.module = module
        self.config = config
        self._engine = engine
        check_same_model(engine, store, module, config)
        broadcast_tensors(engine, [*module.parameters(), *module.buffers()])

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffers_to_sync = [b for b in module.buffers() if b.numel() > 0]
        self._reducer: C.Reducer | None = None
        if self._params:
            specs = [(dtype_code(p.dtype), p.numel(), n) for n, p in named]
            self._reducer = engine.make_reducer(
                specs,
                fusion_bytes=config.fusion_bytes,
                first_bucket_bytes=config.first_bucket_bytes,
                track_usage=config.find_unused_parameters,
                record_order=config.rebuild_buckets,
            )
        self._require_sync = True
        self._in_backward = False
        self._rebuilt = not config.rebuild_buckets
        # Gradients handed to the engine stay referenced until it wrote back.
        self._inflight: list[torch.Tensor] = []
        # Non-contiguous gradients are reduced through a contiguous copy.
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self._params)
        ]

    # ---- user API ----------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if (
            self.config.broadcast_buffers
            and self._require_sync
            and torch.is_grad_enabled()
            and self._buffers_to_sync
        ):
            broadcast_tensors(self._engine, self._buffers_to_sync)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside accumulate locally;
        the first backward after it reduces the accumulated gradients."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    def buckets(self) -> list[list[str]]:
        """The current fusion plan: parameter names per bucket, in issue order."""
        if self._reducer is None:
            return []
        return [[self._names[i] for i in b] for b in self._reducer.buckets()]

    def timeline(self) -> str:
        """Chrome trace JSON of engine events (``timeline=True`` to record)."""
        return self._engine.timeline_json()

    # ---- autograd plumbing -------------------------------------------------

    def _make_hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if not self._require_sync:
                return
            grad = param.grad
            if grad is None:
                return
            if not self._in_backward:
                self._in_backward = True
                # Runs once, when the whole backward pass has finished.
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if grad.is_sparse:
                raise ValueError(
                    f"parameter {self._names[index]!r} got a sparse gradient; hemiola reduces "
                    "dense gradients only"
                )
            if not grad.is_contiguous():
                staged = grad.contiguous()
                self._staged.append((grad, staged))
                grad = staged
            self._inflight.append(grad)
            assert self._reducer is not None
            self._reducer.mark_ready(index, grad.data_ptr())

        return hook

    def _finish_backward(self) -> None:
        self._in_backward = False
        reducer = self._reducer
        assert reducer is not None
        try:
            unmarked = reducer.unmarked()
            if unmarked:
                if not self.config.find_unused_parameters:
                    names = [self._names[i] for i in unmarked]
                    message = (
                        f"hemiola: {len(names)} parameter(s) received no gradient in this "
                        f"backward pass: {', '.join(names[:10])}"
                        f"{' ...' if len(names) > 10 else ''}. If they are not used in forward "
                        "in some iterations, pass find_unused_parameters=True to hemiola.wrap; "
                        "if they should never be trained, set requires_grad=False before "
                        "wrapping."
                    )
                    reducer.abort(message)
                    raise RuntimeError(message)
                for i in unmarked:
                    reducer.mark_unused(i)
            iteration = reducer.finish_marking()
            reducer.wait(iteration)
            if unmarked:
                self._write_back_unused(iteration, unmarked)
            for grad, staged in self._staged:
                grad.copy_(staged)
        finally:
            self._inflight.clear()
            self._staged.clear()
        if not self._rebuilt:
            reducer.rebuild_from_observed_order()
            self._rebuilt = True

    def _write_back_unused(self, iteration: int, unmarked: list[int]) -> None:
        # A parameter this rank did not use but another did gets the average;
        # one no rank used keeps its .grad as it was (as in DDP).
        assert self._reducer is not None
        usage = self._reducer.usage(iteration)
        for i in unmarked:
            if usage[i] == 0:
                continue
            p = self._params[i]
            reduced = torch.frombuffer(self._reducer.result_view(iteration, i),
                                       dtype=p.dtype).view(p.shape)
            if p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)

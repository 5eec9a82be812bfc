"""A gradient norm that is known only once the averaged gradient has arrived.

Under ``priority`` and ``decoupled`` ``model.clip_grad_norm_`` returns before
the reduction ends, but scripts log its value. :class:`DeferredNorm` is a 0-d
tensor whose value is filled in the first time anything reads it (``item()``,
``float()``, printing, arithmetic, logging): then it waits for what it needs,
so an unread norm costs nothing and a read one is always the averaged norm,
the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class DeferredNorm(torch.Tensor):
    """0-d float tensor holding ``resolve()`` once read (see the module)."""

    _resolve: Callable[[], float] | None

    @staticmethod
    def __new__(cls, resolve: Callable[[], float]) -> DeferredNorm:
        t = torch.Tensor._make_subclass(cls, torch.full((), float("nan")))
        t._resolve = resolve
        return t

    def _fill(self) -> None:
        resolve, self._resolve = self._resolve, None
        if resolve is not None:
            value = resolve()
            with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
                self.fill_(value)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            if isinstance(a, DeferredNorm):
                a._fill()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

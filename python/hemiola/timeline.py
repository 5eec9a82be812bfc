"""Timeline events recorded from Python (forward, backward, optimizer steps,
waits), merged with the engine's own (each bucket's all-reduce) into one
Chrome trace per rank: open it in chrome://tracing or https://ui.perfetto.dev,
or plot it with ``python bench/plot_timeline.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from hemiola._native import C


class Recorder:
    """Records spans into an engine's timeline; free when the timeline is off."""

    def __init__(self, engine: C.Engine) -> None:
        self._engine = engine
        self.enabled = bool(engine.timeline_enabled)

    def now(self) -> int:
        return int(self._engine.timeline_now_us()) if self.enabled else 0

    def record(self, lane: str, name: str, category: str, start_us: int) -> None:
        if self.enabled:
            self._engine.timeline_record(lane, name, category, start_us, self.now())

    @contextlib.contextmanager
    def span(self, lane: str, name: str, category: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.record(lane, name, category, start)

    def watch_modules(self, module: nn.Module) -> None:
        """Records the forward of each top-level child module (and the whole)."""
        if not self.enabled:
            return
        starts: dict[int, int] = {}

        def pre(m: nn.Module, _: Any) -> None:
            starts[id(m)] = self.now()

        def post(name: str) -> Any:
            def hook(m: nn.Module, _: Any, __: Any) -> None:
                self.record("compute", f"forward {name}", "forward", starts.pop(id(m), 0))
            return hook

        for name, child in module.named_children():
            child.register_forward_pre_hook(pre)
            child.register_forward_hook(post(name))

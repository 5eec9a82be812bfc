"""Buffers of the schedules whose ``backward()`` does not wait: rank 0's,
broadcast asynchronously (DDP's ``broadcast_buffers``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hemiola.engine_tensors import UINT8, pack_bytes, unpack_bytes

if TYPE_CHECKING:
    from hemiola.bound_model import BoundModel


class BufferBroadcast:
    """Rank 0's buffers, broadcast asynchronously during or after backward
    and applied later (never during a backward: autograd may have saved the
    buffers), so that a forward never waits behind an in-flight reduction."""

    def __init__(self, bound: BoundModel) -> None:
        self.bound = bound
        self._stage: torch.Tensor | None = None
        self._offsets: list[int] = []
        self._handle: Any = None

    @property
    def wanted(self) -> bool:
        m = self.bound
        return bool(m.config.broadcast_buffers and m.buffers and m.world_size > 1)

    @property
    def pending(self) -> bool:
        """A broadcast is started and not yet copied into the buffers."""
        return self._handle is not None

    def start(self) -> None:
        self.finish()
        # Host memory: the engine's broadcast reads it from its own thread.
        # Only rank 0's bytes are read: the others copy nothing off the GPU.
        self._stage, self._offsets = pack_bytes(self.bound.buffers,
                                                fill=self.bound.rank == 0)
        self._handle = self.bound.engine.broadcast(self._stage.data_ptr(), UINT8,
                                                     self._stage.numel(), 0)

    def finish(self) -> None:
        if self._handle is None:
            return
        handle, stage = self._handle, self._stage
        self._handle = self._stage = None
        handle.wait()
        if self.bound.rank == 0:
            return
        unpack_bytes(stage, self._offsets, self.bound.buffers)

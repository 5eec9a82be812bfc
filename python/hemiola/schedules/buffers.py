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
        # Started and not yet landed at one of the points every rank passes
        # (start() again, or land()). finish() alone may run on one rank only
        # (an evaluation or a checkpoint on rank 0 synchronizes there), so it
        # must not decide where the next broadcast goes in the engine's order.
        self._outstanding = False

    @property
    def wanted(self) -> bool:
        m = self.bound
        return bool(m.config.broadcast_buffers and m.buffers and m.world_size > 1)

    @property
    def pending(self) -> bool:
        """A broadcast is started and has not landed at a point every rank
        passes (it may be copied already: see finish). The same on every
        rank, so decisions on it keep the engine's order the same."""
        return self._outstanding

    def start(self) -> None:
        self.finish()
        self._outstanding = True
        # Host memory: the engine's broadcast reads it from its own thread.
        # Only rank 0's bytes are read: the others copy nothing off the GPU.
        self._stage, self._offsets = pack_bytes(self.bound.buffers,
                                                fill=self.bound.rank == 0)
        self._handle = self.bound.engine.broadcast(self._stage.data_ptr(), UINT8,
                                                     self._stage.numel(), 0)

    def land(self) -> None:
        """finish(), at a point every rank passes (priority's optimizer.step())."""
        self.finish()
        self._outstanding = False

    def finish(self) -> None:
        """Waits for the broadcast started last, if not yet, and copies it
        into the buffers (rank 0's are its own). May run on one rank only."""
        if self._handle is None:
            return
        handle, stage = self._handle, self._stage
        self._handle = self._stage = None
        handle.wait()
        if self.bound.rank == 0:
            return
        unpack_bytes(stage, self._offsets, self.bound.buffers)

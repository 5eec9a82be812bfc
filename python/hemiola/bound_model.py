"""The model bound to this rank's engine, as the schedules see it (not a copy
of the model: the wrapped module's own parameters, tied to what reduces them).

A :class:`BoundModel` owns what a schedule works with: the trainable parameters
and their names, the buffers kept in sync with rank 0, the device and its
current stream, the engine and the gradient reducer, the timeline recorder,
and the views of the reduced gradients.
:class:`hemiola.data_parallel.DataParallel` builds
one and hands it to its schedule; schedules never see the wrapper, so the
dependency runs one way: data_parallel -> schedules -> bound_model.
"""

from __future__ import annotations

import torch
from torch import nn

from hemiola._native import C
from hemiola.config import Config, compression_code
from hemiola.engine_tensors import broadcast_tensors, device_view, dtype_code, stream_of
from hemiola.timeline import Recorder


class BoundModel:
    """See the module docstring. `in_flight` and `preview` are what the
    schedule needs of the reducer (its ``reducer_needs``)."""

    def __init__(self, module: nn.Module, engine: C.Engine, config: Config,
                 device: torch.device, in_flight: int, preview: bool,
                 with_reducer: bool = True, store: C.Store | None = None) -> None:
        self.module = module
        self.engine = engine
        #: the engine's rendezvous store (None where the caller gave none)
        self.store = store
        #: the wrap's configuration (register_comm_hook replaces it)
        self.config = config
        #: the CPU or one GPU
        self.device = device
        #: earlier iterations whose reduction may still run while one is
        #: marked, and whether the reducer takes previews (the schedule's needs)
        self.in_flight = in_flight
        self.preview = preview
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        #: the trainable parameters, in the reducer's order, and their names
        self.names = [n for n, _ in named]
        #: a backward produced gradients since the last optimizer.step()
        #: (set by DataParallel's gradient hook, cleared by the step)
        self.backward_since_step = False
        self.params = [p for _, p in named]
        #: the buffers kept equal to rank 0's
        self.buffers = [b for b in module.buffers() if b.numel() > 0]
        self.timeline = Recorder(engine)
        #: DDP's rule for buffers: broadcast them before a forward that
        #: follows a synchronised training forward (and before the first one)
        self.require_forward_param_sync = True
        self.reducer: C.Reducer | None = None
        self._partitioned: set[int] = set()
        #: the schedule uses the engine's reducer (``sharded`` buckets on its own)
        self.with_reducer = with_reducer
        self.plan()

    def plan(self) -> None:
        """Makes the reducer (the bucket plan and its buffers) for the current
        ``config``; called again, it replaces the reducer (before the first
        backward: register_comm_hook's PowerSGD under priority)."""
        config = self.config
        self.reducer = None  # the old one's memory goes first
        if self.params and self.with_reducer:
            specs = [(dtype_code(p.dtype), p.numel(), n, p.shape[0] if p.dim() > 1 else 0)
                     for n, p in zip(self.names, self.params)]
            self.reducer = self.engine.make_reducer(
                specs,
                fusion_bytes=config.fusion_bytes,
                first_bucket_bytes=config.first_bucket_bytes,
                track_usage=config.find_unused_parameters,
                record_order=config.rebuild_buckets,
                in_flight=self.in_flight,
                preview=self.preview,
                partition_bytes=config.partition_bytes,
                device=self.device.index if self.device.type == "cuda" else -1,
                compression=compression_code(config.compression),
                powersgd_rank=config.powersgd_rank,
                powersgd_start_iteration=config.powersgd_start_iter,
            )
        # Partitioned gradients are spread over several buckets: the reducer
        # holds no one view of their results (the engine's updater gathers
        # them into buffers of its own).
        self._partitioned = {
            i for i, p in enumerate(self.params)
            if 0 < config.partition_bytes < p.numel() * p.element_size()
        }

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def stream(self) -> int:
        """The current stream's handle on the model's GPU (0 on the CPU): the
        engine orders its copies after work there and makes it wait for
        results on the device, never on the host."""
        return stream_of(self.device)

    def reduced(self, iteration: int, index: int) -> torch.Tensor:
        """Parameter `index`'s reduced gradient of `iteration`: a view into the
        engine's buffers."""
        assert self.reducer is not None
        p = self.params[index]
        if index in self._partitioned:
            raise RuntimeError(
                f"parameter {self.names[index]!r} is partitioned over several buckets "
                "(partition_mb); its reduced gradient has no single view in the reducer")
        if self.device.type == "cuda":
            return device_view(self.reducer.result_ptr(iteration, index), p)
        view = self.reducer.result_view(iteration, index)
        return torch.frombuffer(view, dtype=p.dtype).view(p.shape)

    def sync_buffers(self) -> None:
        """Broadcasts rank 0's buffers (blocking)."""
        broadcast_tensors(self.engine, self.buffers)

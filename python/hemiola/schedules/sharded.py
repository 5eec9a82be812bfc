"""``sharded``: DeAR's cut of the all-reduce with ZeRO-2's sharded state.

Backward copies each gradient into its bucket (the reducer's fusion rule:
``wfbp``'s buckets) and frees ``.grad``; a full bucket is reduce-scattered
(``Engine.reduce_scatter``: the ring's chunks, each element summed in the
order ``wfbp``'s all-reduce sums it, so the result is bitwise ``wfbp``'s).
``optimizer.step()`` copies this rank's chunk of each bucket out into the
shard's gradients and lets the user's optimizer step the shard (its param
groups point at views of this rank's pieces: ``sharded_optimizer``); the
updated pieces are then all-gathered bucket by bucket, front layers first,
straight into the parameters (``Engine.all_gather_chunks`` over the bucket's
parameters as segments: no buffer), and the next forward waits at each
module for its own parameters only (``forward_gate``, as ``priority`` lands
its updates). Gradients and optimizer state exist for this rank's shard
only; at most ``Config.buckets_in_flight`` gradient buckets are alive at
once, so the memory of parameters, gradients, state and buckets is
4 + 12/N bytes per parameter with AdamW in float32, plus those buffers.

Under ``compression="int8"`` or ``"int4"`` a float32 bucket's reduce-scatter
is ``Engine.reduce_scatter_coded``: every rank codes its gradients plus its
residual in blocks with its own scales and sends each owner its chunk's
records, the owner averages them in float32 (the precision does not depend
on the number of ranks), and what the coding dropped waits in the rank's
residual (a float32 bucket per bucket: 4 bytes a parameter more) for the
next iteration. The all-gathers of the parameters stay exact.

The first iteration learns the order gradients arrive in (rank 0's, as
``wfbp``'s rebuild does) and plans the buckets from it for the rest of the
run; its step completes each old bucket's all-reduce (the all-gather of the
reduced chunks, one bucket at a time) to hand the averaged gradients to the
new plan's shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hemiola._native import C
from hemiola.config import compression_code
from hemiola.engine_tensors import dtype_code
from hemiola.forward_gate import ForwardGate
from hemiola.schedules.base import Schedule
from hemiola.schedules.buffers import BufferBroadcast
from hemiola.schedules.gated import LandsAtGates
from hemiola.schedules.scaler_handshake import unknown_scaler
from hemiola.schedules.sharded_gradients import clip_, gather_whole, shard_norm
from hemiola.schedules.sharded_optimizer import (
    ShardedOptimizer,
    refuse_non_elementwise,
    refuse_scattered,
)
from hemiola.schedules.sharded_plan import Bucket, ShardPlan
from hemiola.schedules.sharded_state import (
    full_state_dict,
    install_state_methods,
    load_full_state_dict,
)
from hemiola.schedules.takeover import take_over_optimizer

if TYPE_CHECKING:
    from hemiola.bound_model import BoundModel

INT64 = int(C.DType.int64)
#: compression -> the dtype float32 gradients travel in
HALVES: dict[str | None, torch.dtype | None] = {
    None: None, "fp16": torch.float16, "bf16": torch.bfloat16}
#: the codings whose reduce-scatter is coded in blocks with error feedback
CODED = ("int8", "int4")
FLOAT64 = dtype_code(torch.float64)


class _Reduction:
    """One bucket's reduce-scatter in flight: its buffer, its residual
    (int8/int4; the wire thread writes both until the handle is done) and
    its handle."""

    def __init__(self, bucket: int, buffer: torch.Tensor, handle: Any,
                 residual: torch.Tensor | None = None) -> None:
        self.bucket = bucket
        self.buffer = buffer
        self.residual = residual
        self.handle = handle


class Sharded(LandsAtGates, Schedule):
    """See the module docstring."""

    uses_reducer = False

    def __init__(self, bound: BoundModel, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(bound, optimizer, grad_scaler)
        config = bound.config
        if bound.device.type != "cpu":
            raise ValueError(
                "schedule='sharded' runs on CPU parameters (the Gloo wire) in this build; its "
                "GPU path over NCCL's reduce-scatter and all-gather has not run on a GPU yet. "
                "Use schedule='priority' on a GPU.")
        if config.compression not in HALVES and config.compression not in CODED:
            raise ValueError(
                f"schedule='sharded' compresses its reduce-scatters with 'fp16', 'bf16', 'int8' "
                f"or 'int4' (compression={config.compression!r} is not available to it); use "
                "one of those, or schedule='priority' with it")
        #: the half type float32 gradients travel in (None: as they are)
        self._half = HALVES.get(config.compression)
        #: the engine's code of int8/int4 (None: the reduce-scatter is not coded)
        self._coding = (compression_code(config.compression) if config.compression in CODED
                        else None)
        #: per coded bucket: what this rank's codings dropped (error feedback)
        self._residuals: dict[int, torch.Tensor] = {}
        refuse_scattered(bound.names, bound.params)
        self._world = bound.world_size
        self._rank = bound.rank
        self._order: list[int] = []  # the first iteration's arrival order
        self._learn_order = config.rebuild_buckets and self._world > 1
        self.plan = self._make_plan(list(range(len(bound.params)))[::-1])
        self._optimizer: ShardedOptimizer | None = None
        self._inner_step: Any = None
        self._iteration = -1
        # The backward being marked: per bucket, gradients copied in, and
        # its buffer; the next bucket to reduce (buckets go in plan order on
        # every rank).
        self._filled = [0] * len(self.plan.buckets)
        self._staging: dict[int, torch.Tensor] = {}
        self._next = 0
        self._marking = False
        self._marked = [False] * len(bound.params)
        self._reductions: list[_Reduction] = []  # in flight, oldest first
        # The averaged gradients of this rank's chunk of each bucket, kept
        # from the reduction to the step (persistent: 4/N bytes a parameter).
        self._grads = [torch.empty(b.hi - b.lo, dtype=b.dtype) for b in self.plan.buckets]
        self._reduced = False  # a synchronised backward waits for its step
        self._usage: torch.Tensor | None = None
        self._usage_handle: Any = None
        # The all-gathers of the parameters on the wire, by bucket.
        self._gathers: dict[int, Any] = {}
        self._unlanded: set[int] = set()  # buckets whose parameters are stale
        self._free: list[torch.Tensor] = []  # spare gradient bucket buffers
        self._buffers = BufferBroadcast(bound)
        self._buffers_early = False
        self._gate = ForwardGate(bound.module, bound.params, self.land)
        # Buckets the forward before this backward never landed: a gradient
        # of one of their parameters means it was read stale.
        self._stale: set[int] = set()
        #: full optimizer states gathered so far (sharded_state)
        self.state_calls = 0
        # 1 / the GradScaler's scale in the backward being marked
        self._inv_scale: float | None = None
        #: model.clip_grad_norm_ of this iteration: (max_norm, the norm)
        self._clip: tuple[float, float] | None = None

    # ---- the plan ------------------------------------------------------------

    def _make_plan(self, order: list[int]) -> ShardPlan:
        m = self.bound
        return ShardPlan(m.params, order, m.config.first_bucket_bytes, m.config.fusion_bytes,
                         self._rank, self._world, self._half, coded=self._coding is not None)

    def _replan(self, order: list[int]) -> None:
        """Plans from `order` from now on: the buckets, their counts and the
        shard's gradients follow (between iterations)."""
        old, self.plan = self.plan, self._make_plan(order)
        self._residuals = self._moved_residuals(old)
        self._grads = [torch.empty(b.hi - b.lo, dtype=b.dtype) for b in self.plan.buckets]
        self._filled = [0] * len(self.plan.buckets)
        self._free.clear()

    def _moved_residuals(self, old: ShardPlan) -> dict[int, torch.Tensor]:
        """The residuals laid out by the current plan, each parameter's moved
        from where `old` kept it (nothing the codings dropped is lost)."""
        if not self._residuals:
            return {}
        moved: dict[int, torch.Tensor] = {}
        for i, p in enumerate(self.bound.params):
            ob, oo = old.where[i]
            if ob not in self._residuals:
                continue
            nb, no = self.plan.where[i]
            if nb not in moved:
                moved[nb] = torch.zeros(self.plan.buckets[nb].numel, dtype=torch.float32)
            moved[nb][no:no + p.numel()].copy_(self._residuals[ob][oo:oo + p.numel()])
        return moved

    def _residual(self, b: int) -> torch.Tensor:
        """Bucket b's residual (zeros the first time)."""
        if b not in self._residuals:
            self._residuals[b] = torch.zeros(self.plan.buckets[b].numel, dtype=torch.float32)
        return self._residuals[b]

    def residuals(self) -> dict[int, torch.Tensor]:
        """Per coded bucket, what this rank's int8/int4 codings dropped and
        will send with the next gradients (empty without those codings)."""
        return self._residuals

    def load_residuals(self, residuals: dict[int, torch.Tensor]) -> None:
        """Replaces the residuals with those ``residuals()`` returned under
        the current plan (``{}``: none owed)."""
        self._wait_reductions()
        self._residuals = {}
        for b, r in residuals.items():
            mine = self._residual(int(b))
            if mine.numel() != r.numel():
                raise ValueError(f"the saved residual of bucket {b} has {r.numel()} elements, "
                                 f"this plan's bucket {mine.numel()}: it was saved by another "
                                 "plan")
            mine.copy_(r)

    def buckets(self) -> list[list[int]]:
        return [b.indices for b in self.plan.buckets]

    # ---- the optimizer -------------------------------------------------------

    def wrap_optimizer(self, optimizer: Any) -> Any:
        self._inner_step = take_over_optimizer(self, optimizer, self.step)
        refuse_non_elementwise(optimizer)
        self._optimizer = ShardedOptimizer(optimizer, self.bound.params)
        self._optimizer.point_at(self.plan)
        install_state_methods(optimizer, self)
        return optimizer

    @property
    def sharded_optimizer(self) -> ShardedOptimizer:
        assert self._optimizer is not None
        return self._optimizer

    def optimizer_state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        # The full state: a collective (every rank calls optimizer.state_dict()).
        return full_state_dict(self, inner)

    def parameters_replaced(self) -> None:
        if self._optimizer is not None:
            self._optimizer.refresh(self.plan)

    def adopt_plan(self, order: list[int]) -> None:
        """Plans from `order` from now on (a loaded shard's plan)."""
        self._learn_order = False
        if order != self.plan.order:
            self._replan(order)
            self.sharded_optimizer.point_at(self.plan)

    # ---- bucket buffers ------------------------------------------------------

    def _buffer(self, bucket: Bucket, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A bucket-sized buffer of `dtype` (the bucket's): a spare one, or
        a new one once fewer than buckets_in_flight are alive (else the
        oldest reduction is waited for, and its buffer reused)."""
        dtype = dtype or bucket.dtype
        cap = self.bound.config.buckets_in_flight
        while len(self._reductions) >= cap:
            self._harvest(self._reductions[0])
        for k, spare in enumerate(self._free):
            if spare.dtype == dtype and spare.numel() >= bucket.numel:
                del self._free[k]
                return spare[:bucket.numel]
        return torch.empty(bucket.numel, dtype=dtype)

    def _release(self, buffer: torch.Tensor) -> None:
        base = buffer._base if buffer._base is not None else buffer
        self._free.append(base)
        cap = self.bound.config.buckets_in_flight
        if len(self._free) > cap:
            self._free.sort(key=lambda t: t.numel(), reverse=True)
            del self._free[cap:]

    # ---- backward ------------------------------------------------------------

    def backward_started(self) -> None:
        # Every all-gather lands before the first reduce-scatter is queued,
        # so the engine's order is the same on every rank whatever the
        # forward read.
        self._stale = set(self._unlanded)
        self.synchronize()
        # Rank 0's buffers travel ahead of every bucket (see UpdaterSchedule).
        self._buffers_early = self._buffers.wanted and not self._buffers.pending
        if self._buffers_early:
            self._buffers.start()

    def mark(self, index: int, grad: torch.Tensor) -> None:
        if self._marked[index]:
            raise RuntimeError(f"parameter {self.bound.names[index]!r} got two gradients in "
                               "one backward pass")
        b, offset = self.plan.where[index]
        if b in self._stale:
            self._refuse_stale_read(index)
        if self._reduced:
            raise RuntimeError(
                "schedule='sharded': a second synchronised backward before optimizer.step(); "
                "accumulate gradients inside model.no_sync() and synchronise only the last "
                "backward before the step")
        self._marking = True
        self._marked[index] = True
        if self._learn_order:
            self._order.append(index)
        p = self.bound.params[index]
        bucket = self.plan.buckets[b]
        buffer = self._staging.get(b)
        if buffer is None:
            buffer = self._staging[b] = self._buffer(bucket, bucket.wire)
        slot = buffer[offset:offset + p.numel()].view_as(grad)
        if self._scaling:
            # Each rank contributes its gradient unscaled (GradScaler's scales
            # are powers of two: exact), so the average is right and not
            # finite exactly when some rank overflowed.
            if self._inv_scale is None:
                self._inv_scale = 1.0 / self.grad_scaler.get_scale()  # type: ignore[union-attr]
            grad = grad * self._inv_scale
        slot.copy_(grad)
        if bucket.wire != bucket.dtype:
            # DDP's fp16/bf16 hook: cast, then divide by the ranks in the
            # half type (the sum then cannot overflow where the gradients
            # did not); the wire sums the halves.
            slot.div_(self._world)
        p.grad = None  # the bucket holds it now; the shard's gradient comes back
        self._filled[b] += 1
        self._reduce_full_buckets()

    def _refuse_stale_read(self, index: int) -> None:
        raise RuntimeError(
            f"schedule='sharded': parameter {self.bound.names[index]!r} was read before its "
            "all-gather landed: the forward read it from a module other than the one it was "
            "first read in (the first forward learnt where each parameter is landed). "
            "Read each parameter in the same module every iteration, or use "
            "schedule='wfbp'.")

    def _reduce_full_buckets(self) -> None:
        buckets = self.plan.buckets
        while self._next < len(buckets) and self._filled[self._next] == len(
                buckets[self._next].indices):
            b = self._next
            buffer = self._staging.pop(b)
            halved = buffer.dtype != buckets[b].dtype  # averaged already (see mark)
            residual = None
            if self._coding is not None and buffer.dtype == torch.float32:
                residual = self._residual(b)
                handle = self.bound.engine.reduce_scatter_coded(
                    buffer.data_ptr(), residual.data_ptr(), buffer.numel(), self._coding)
            else:
                handle = self.bound.engine.reduce_scatter(
                    buffer.data_ptr(), dtype_code(buffer.dtype), buffer.numel(),
                    C.ReduceOp.sum if halved else C.ReduceOp.average)
            self._reductions.append(_Reduction(b, buffer, handle, residual))
            self._next += 1
        while self._reductions and self._reductions[0].handle.done():
            self._harvest(self._reductions[0])

    def _harvest(self, reduction: _Reduction) -> None:
        """Waits for a reduce-scatter and keeps this rank's chunk."""
        with self.bound.timeline.span("compute", f"wait reduce-scatter {reduction.bucket}",
                                      "wait"):
            reduction.handle.wait()
        self._reductions.remove(reduction)
        bucket = self.plan.buckets[reduction.bucket]
        self._grads[reduction.bucket].copy_(reduction.buffer[bucket.lo:bucket.hi])
        self._release(reduction.buffer)

    def unmarked(self) -> list[int]:
        return [i for i, marked in enumerate(self._marked) if not marked]

    def abort_backward(self, message: str) -> None:
        self._reset_marking()

    def mark_unused(self, index: int) -> None:
        b, offset = self.plan.where[index]
        p = self.bound.params[index]
        bucket = self.plan.buckets[b]
        buffer = self._staging.get(b)
        if buffer is None:
            buffer = self._staging[b] = self._buffer(bucket, bucket.wire)
        buffer[offset:offset + p.numel()].zero_()
        self._filled[b] += 1
        self._reduce_full_buckets()

    def finish_marking(self) -> int:
        if not self._marking:
            return -1
        assert self._next == len(self.plan.buckets), "a bucket was never reduced"
        if self.bound.config.find_unused_parameters:
            # How many ranks used each parameter: one no rank used is not
            # stepped, as torch skips a parameter without a gradient.
            self._usage = torch.tensor([float(m) for m in self._marked], dtype=torch.float64)
            self._usage_handle = self.bound.engine.all_reduce(
                self._usage.data_ptr(), FLOAT64, self._usage.numel())
        self._iteration += 1
        self._inv_scale = None
        self._reset_marking()
        self._reduced = True
        return self._iteration

    def _reset_marking(self) -> None:
        self._marking = False
        self._marked = [False] * len(self.bound.params)
        self._filled = [0] * len(self.plan.buckets)
        self._next = 0
        for buffer in self._staging.values():
            self._release(buffer)
        self._staging.clear()

    def backward_done(self, iteration: int, unmarked: list[int]) -> None:
        if self._buffers.wanted and not self._buffers_early:
            self._buffers.start()
        self._buffers_early = False

    # ---- optimizer.step() ----------------------------------------------------

    def step(self) -> None:
        """``optimizer.step()``: the shard's averaged gradients, torch's step
        of the shard, and the all-gathers of the updated pieces."""
        if not self._reduced:
            raise RuntimeError(
                "schedule='sharded': optimizer.step() with no synchronised backward since the "
                "last step; the averaged gradient exists only after a backward outside "
                "model.no_sync() (call loss.backward() before optimizer.step())")
        self.bound.backward_since_step = False
        self._buffers.land()
        self._finish_reductions()
        used = self._used()
        self._reduced = False
        opt = self._optimizer
        assert opt is not None
        clip, self._clip = self._clip, None
        if self._skipped_by_scaler(opt.optimizer):
            # What the codings dropped of gradients that are thrown away is
            # thrown away with them (an overflowing rank's would be garbage).
            self._residuals = {}
            return
        grads: dict[int, torch.Tensor | None] = {}
        for b, bucket in enumerate(self.plan.buckets):
            for piece in bucket.pieces:
                if used is None or used[piece.index]:
                    start = piece.offset - bucket.lo
                    grads[piece.index] = self._grads[b][start:start + piece.count]
        opt.set_grads(grads)
        if clip is not None:
            clip_(self._grads, *clip)
        self._inner_step()
        opt.set_grads({})
        self._start_gathers()

    def _wait_reductions(self) -> None:
        """Waits for every reduce-scatter in flight and keeps its chunk."""
        while self._reductions:
            self._harvest(self._reductions[0])

    def _finish_reductions(self) -> None:
        """Waits for every reduce-scatter of the backward; the shard's
        averaged gradients are in place after it."""
        self._wait_reductions()
        if self._learn_order:
            self._adopt_observed_order()

    @property
    def _scaling(self) -> bool:
        return self.grad_scaler is not None and self.grad_scaler.is_enabled()

    def _skipped_by_scaler(self, optimizer: torch.optim.Optimizer) -> bool:
        """Under ``scaler.step(optimizer)``: whether some rank's gradient
        overflowed (the averaged shards are not finite on some rank: every
        rank skips the step), told to the GradScaler so that its update()
        backs off the scale on every rank alike."""
        if getattr(optimizer, "found_inf", None) is None:
            if self._scaling and self.grad_scaler._scale is not None:  # type: ignore[union-attr]
                raise RuntimeError(
                    "schedule='sharded' was given a GradScaler: step with "
                    "scaler.step(optimizer), not optimizer.step()")
            return False
        if not self._scaling:
            raise RuntimeError(unknown_scaler("sharded"))
        optimizer.grad_scale = optimizer.found_inf = None  # the gradients are unscaled already
        mine = float(any(not bool(torch.isfinite(g).all()) for g in self._grads))
        flag = torch.tensor([mine], dtype=torch.float64)
        self.bound.engine.all_reduce(flag.data_ptr(), FLOAT64, 1).wait()
        found = float(flag[0]) > 0
        scaler = self.grad_scaler
        assert scaler is not None
        state = scaler._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {torch.device("cpu"): torch.tensor([float(found)])}
        return found

    def _used(self) -> list[bool] | None:
        if self._usage_handle is None:
            return None
        self._usage_handle.wait()
        self._usage_handle = None
        assert self._usage is not None
        return [u > 0 for u in self._usage.tolist()]

    def _adopt_observed_order(self) -> None:
        """The first iteration's step: every rank plans from rank 0's arrival
        order (wfbp's rebuild), and the new shard's averaged gradients are
        taken from the old plan's chunks, all-gathered one bucket at a time
        (the first iteration's all-reduce completed, in bounded memory)."""
        m = self.bound
        n = len(m.params)
        seen = set(self._order)
        order = torch.tensor(self._order + [i for i in range(n - 1, -1, -1) if i not in seen],
                             dtype=torch.int64)
        m.engine.broadcast(order.data_ptr(), INT64, n, 0).wait()
        self._learn_order = False
        old, old_grads = self.plan, self._grads
        self._replan(order.tolist())
        for b, bucket in enumerate(old.buckets):
            whole = self._buffer(bucket)
            whole[bucket.lo:bucket.hi].copy_(old_grads[b])
            m.engine.all_gather_chunks(whole.data_ptr(), dtype_code(bucket.dtype),
                                       bucket.numel, bucket.bounds).wait()
            for i, offset in zip(bucket.indices, bucket.offsets):
                piece = self.plan.piece_of.get(i)
                if piece is None:
                    continue
                nb, _ = self.plan.where[i]
                start = piece.offset - self.plan.buckets[nb].lo
                self._grads[nb][start:start + piece.count].copy_(
                    whole[offset + piece.begin:offset + piece.begin + piece.count])
            self._release(whole)
        opt = self.sharded_optimizer
        if opt.optimizer.state:
            # A checkpoint loaded before the first step: its full state is
            # cut again by the new plan.
            new, self.plan = self.plan, old
            full = full_state_dict(self, lambda: torch.optim.Optimizer.state_dict(opt.optimizer))
            self.plan = new
            opt.point_at(self.plan)
            load_full_state_dict(self, full)
        else:
            opt.point_at(self.plan)

    # ---- the all-gathers and the next forward --------------------------------

    def _start_gathers(self) -> None:
        """Every bucket's all-gather, front layers first (backward's plan
        order reversed), straight into the parameters: each rank's chunk of
        a bucket is its updated pieces, and the others' land where they lie,
        with no buffer."""
        params = self.bound.params
        engine = self.bound.engine
        for b in range(len(self.plan.buckets) - 1, -1, -1):
            bucket = self.plan.buckets[b]
            flats = [params[i].detach().view(-1) for i in bucket.indices]
            self._gathers[b] = engine.all_gather_segments(
                [f.data_ptr() for f in flats], [f.numel() for f in flats],
                dtype_code(bucket.dtype), bucket.bounds)
        self._unlanded = set(self._gathers)

    def _land_bucket(self, b: int) -> None:
        """Waits for bucket b's all-gather: its parameters are up to date."""
        handle = self._gathers.pop(b)
        with self.bound.timeline.span("compute", f"wait all-gather {b}", "wait"):
            handle.wait()
        self._unlanded.discard(b)

    def land(self, gate: int, indices: list[int]) -> None:
        """A forward reaches gate `gate`: its parameters' buckets land (gate
        0, the start of the forward: those no later gate lands)."""
        if not self._unlanded:
            return
        if gate == 0:
            indices = self._at_start()
        where = self.plan.where
        for b in sorted({where[i][0] for i in indices} & self._unlanded, reverse=True):
            self._land_bucket(b)

    def _at_start(self) -> list[int]:
        gates = self._gate.gates
        if len(gates) == 1:
            return gates[0]
        later = {i for gate in gates[1:] for i in gate}
        return [i for i in gates[0] if i not in later]

    def before_forward(self) -> None:
        if not torch.is_grad_enabled():
            self.synchronize()  # evaluation reads the exact parameters, rank 0's buffers
        else:
            self._gate.land_now()

    def synchronize(self) -> None:
        self._wait_reductions()  # (a checkpoint reads the residuals they write)
        while self._unlanded:
            self._land_bucket(max(self._unlanded))
        self._buffers.finish()

    # ---- gradients, as the user reads them -----------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        if not self._reduced:
            raise RuntimeError("model.clip_grad_norm_() goes between backward() and "
                               "optimizer.step()")
        self._finish_reductions()
        norm = shard_norm(self.bound.engine, self._grads, float(norm_type))
        self._clip = (float(max_norm), norm)
        return torch.tensor(norm)

    def averaged_gradients(self) -> list[torch.Tensor]:
        if not self._reduced:
            raise RuntimeError("model.averaged_gradients() goes between backward() and "
                               "optimizer.step()")
        self._finish_reductions()
        return gather_whole(self.bound.engine, self.plan, self._grads, self.bound.params)

    def stats(self) -> dict[str, float]:
        return {"shard_elements": float(self.plan.shard_numel)}

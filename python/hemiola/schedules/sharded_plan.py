"""Where ``sharded`` keeps what: the buckets (the reducer's fusion rule, so
the same buckets ``wfbp`` reduces), each bucket's chunk per rank (the ring's
chunks of ``Engine.reduce_scatter``, so each element is summed in the order
``wfbp``'s all-reduce sums it), and this rank's shard: the piece of each
parameter that falls in its chunks. A pure description, the same on every
rank given the same order; nothing here communicates."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hemiola._native import C
from hemiola.engine_tensors import dtype_code


@dataclass
class Piece:
    """Elements [begin, begin + count) of parameter `index` (flattened),
    stored at element `offset` of its bucket."""

    index: int
    begin: int
    count: int
    offset: int


@dataclass
class Bucket:
    """Parameters `indices` fused at element `offsets`, and this rank's chunk
    [lo, hi) of the bucket with the pieces of parameters in it."""

    dtype: torch.dtype
    indices: list[int]
    offsets: list[int]
    numel: int
    lo: int
    hi: int
    #: the dtype gradients travel in (a half type under compression)
    wire: torch.dtype
    #: every rank's chunk: world_size + 1 element offsets (the wire's ring)
    bounds: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)


class ShardPlan:
    """The buckets of `params` ready in `order`, and this rank's shard of
    each (see the module docstring). `half`: float32 gradients travel in
    that dtype (``compression``), which sets where the chunks fall; `coded`:
    their reduce-scatter is int8/int4's, whose chunks are whole blocks."""

    def __init__(self, params: list[torch.Tensor], order: list[int], first_bucket_bytes: int,
                 fusion_bytes: int, rank: int, world_size: int,
                 half: torch.dtype | None = None, coded: bool = False) -> None:
        self.order = list(order)
        specs = [(dtype_code(p.dtype), p.numel()) for p in params]
        self.buckets: list[Bucket] = []
        #: per parameter: (bucket, element offset in it)
        self.where: list[tuple[int, int]] = [(0, 0)] * len(params)
        for b, (_code, indices, offsets, numel) in enumerate(
                C.plan_fusion(specs, self.order, first_bucket_bytes, fusion_bytes)):
            dtype = params[indices[0]].dtype
            # A float32 bucket travels in `half` when given (compression):
            # the ring's chunks are the half buffer's.
            wire = half if half is not None and dtype == torch.float32 else dtype
            if coded and dtype == torch.float32:  # int8/int4: whole coding blocks
                bounds = list(C.coded_chunk_bounds(numel, world_size))
            else:
                bounds = list(C.chunk_bounds(numel, dtype_code(wire), world_size))
            lo, hi = bounds[rank], bounds[rank + 1]
            bucket = Bucket(dtype, list(indices), list(offsets), numel, lo, hi, wire, bounds)
            for i, offset in zip(indices, offsets):
                self.where[i] = (b, offset)
                first, last = max(offset, lo), min(offset + params[i].numel(), hi)
                if first < last:
                    bucket.pieces.append(Piece(i, first - offset, last - first, first))
            self.buckets.append(bucket)
        #: per parameter: this rank's piece of it, if any
        self.piece_of: dict[int, Piece] = {
            piece.index: piece for bucket in self.buckets for piece in bucket.pieces}

    @property
    def shard_numel(self) -> int:
        """Elements of every parameter this rank holds the gradient and the
        optimizer state of."""
        return sum(b.hi - b.lo for b in self.buckets)

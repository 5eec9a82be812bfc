"""The averaged gradient under ``sharded`` as a user reads it: it exists in
pieces, each rank's shard of each bucket, so its norm is combined from every
rank's part, clipping scales the pieces, and the whole of it is gathered on
request."""

from __future__ import annotations

import math
from typing import Any

import torch

from hemiola.engine_tensors import dtype_code
from hemiola.schedules.sharded_plan import ShardPlan

FLOAT64 = dtype_code(torch.float64)


def shard_norm(engine: Any, grads: list[torch.Tensor], norm_type: float) -> float:
    """The norm of the averaged gradient whose pieces on this rank are
    `grads`: each rank's part (a sum of |g|^p, or a maximum) in float64,
    all-gathered and combined in rank order, so every rank gets the same.
    (torch sums each tensor's float32 norm instead: the two can differ in
    the last bits.)"""
    partial = 0.0
    for piece in grads:
        g = piece.double()
        if g.numel() == 0:
            continue
        if math.isinf(norm_type):
            partial = max(partial, float(g.abs().max()))
        else:
            partial += float(g.abs().pow(norm_type).sum())
    mine = torch.tensor([partial], dtype=torch.float64)
    every = torch.empty(engine.world_size, dtype=torch.float64)
    engine.all_gather(mine.data_ptr(), every.data_ptr(), FLOAT64, 1).wait()
    if math.isinf(norm_type):
        return float(every.max())
    return float(every.sum()) ** (1.0 / norm_type)


def clip_(grads: list[torch.Tensor], max_norm: float, total: float) -> None:
    """torch's clip_grad_norm_ rule on the pieces: every gradient times
    min(1, max_norm / (total + 1e-6)), the coefficient a float32 tensor."""
    norm = torch.tensor(total, dtype=torch.float32)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def gather_whole(engine: Any, plan: ShardPlan, grads: list[torch.Tensor],
                 params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter's averaged gradient, whole, on every rank (a
    collective: each bucket's chunks all-gathered)."""
    out = [torch.zeros_like(p) for p in params]
    for b, bucket in enumerate(plan.buckets):
        whole = torch.zeros(bucket.numel, dtype=bucket.dtype)
        whole[bucket.lo:bucket.hi].copy_(grads[b])
        engine.all_gather_chunks(whole.data_ptr(), dtype_code(bucket.dtype), bucket.numel,
                                 bucket.bounds).wait()
        for i, offset in zip(bucket.indices, bucket.offsets):
            out[i].view(-1).copy_(whole[offset:offset + params[i].numel()])
    return out

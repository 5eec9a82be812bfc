"""Wrap-time checks that every rank holds the same model, with a clear message
naming the first difference when they do not."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

from hemiola._native import C
from hemiola.config import Config
from hemiola.engine_tensors import GRAD_DTYPES, all_gather_rows, model_device


def check_module(module: nn.Module) -> torch.device:
    """Refuses what the engine cannot reduce, before any communication.
    Returns the one device the module lives on."""
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise ValueError(
                f"module {name or type(sub).__name__!r} produces sparse gradients "
                "(sparse=True); hemiola reduces dense gradients only: construct it with "
                "sparse=False"
            )
    device = model_device([*module.named_parameters(), *module.named_buffers()])
    for name, p in module.named_parameters():
        if p.requires_grad and p.dtype not in GRAD_DTYPES:
            raise ValueError(
                f"parameter {name!r} has dtype {p.dtype}; hemiola reduces float32, float64, "
                "float16 and bfloat16 gradients (set requires_grad=False to freeze it)"
            )
    return device


def signature(module: nn.Module, config: Config) -> list[list[object]]:
    """What must be identical on every rank, one row per item."""
    rows: list[list[object]] = [
        ["config", config.schedule, config.fusion_bytes, config.first_bucket_bytes,
         config.partition_bytes, config.find_unused_parameters, config.broadcast_buffers,
         config.rebuild_buckets, config.priority_front_fraction, config.compression,
         config.powersgd_rank, config.powersgd_start_iter]
    ]
    if config.schedule == "streaming":
        # Ranks that sync at different steps, cut different fragments or take
        # different outer steps would fail inside Gloo or train apart silently.
        rows.append(["streaming", config.sync_every, config.fragments, config.overlap,
                     config.outer_lr, config.outer_momentum, config.outer_nesterov,
                     config.mix, config.replica_ranks])
    for name, p in module.named_parameters():
        rows.append(["parameter", name, list(p.shape), str(p.dtype), p.requires_grad])
    for name, b in module.named_buffers():
        rows.append(["buffer", name, list(b.shape), str(b.dtype)])
    return rows


def _digest(rows: list[list[object]]) -> int:
    raw = hashlib.sha256(json.dumps(rows).encode()).digest()
    return int.from_bytes(raw[:8], "little", signed=True)


def _first_difference(mine: list[list[object]], theirs: list[list[object]]) -> str:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"at entry {i}: rank 0 has {b}, this rank has {a}"
    return (
        f"rank 0 has {len(theirs)} entries (parameters, buffers), this rank has {len(mine)}; "
        f"first extra: {(mine[len(theirs)] if len(mine) > len(theirs) else theirs[len(mine)])}"
    )


def check_same_model(engine: C.Engine, store: C.Store, module: nn.Module, config: Config) -> None:
    """Collective: raises ValueError on every rank when any rank's model differs."""
    if engine.world_size == 1:
        return
    rows = signature(module, config)
    digests = all_gather_rows(engine, torch.tensor([_digest(rows)], dtype=torch.int64))[:, 0]
    differing = [r for r, d in enumerate(digests.tolist()) if d != digests[0].item()]
    if not differing:
        return
    # Only on failure: publish full signatures through the store to name the
    # first difference.
    store.set(f"signature/{engine.rank}", json.dumps(rows).encode())
    reference = json.loads(store.get("signature/0", config.timeout_s))
    if engine.rank in differing:
        detail = _first_difference(rows, reference)
        raise ValueError(
            f"hemiola.wrap: the model on rank {engine.rank} differs from rank 0's {detail}. "
            "Every rank must build the same model (same parameters, shapes, dtypes, buffers) "
            "and pass the same options."
        )
    other = differing[0]
    theirs = json.loads(store.get(f"signature/{other}", config.timeout_s))
    raise ValueError(
        f"hemiola.wrap: the model on rank {other} differs from rank 0's "
        f"{_first_difference(theirs, reference)} (ranks that differ: {differing}). Every rank "
        "must build the same model and pass the same options."
    )

"""The optimizer's state under ``sharded``, saved and loaded.

- ``optimizer.state_dict()``: the **full** state, in torch's format for the
  unwrapped optimizer (the model's parameters numbered in param-group order),
  gathered from every rank's shard: a collective, so every rank calls it (a
  checkpoint written by rank 0 alone is then complete, and loads into a plain
  torch optimizer, or into ``sharded`` at any number of ranks).
- ``optimizer.load_state_dict(full)``: local; each rank keeps its pieces (and
  plans its buckets from the saved order, so the resumed run sums as the
  uninterrupted one would).
- ``optimizer.shard_state_dict()`` / ``optimizer.load_shard_state_dict(sd)``:
  this rank's shard alone (no communication, 1/N of the bytes), with the
  plan it was cut by; loading checks that the plan, the rank and the number of
  ranks are the same, and resumes bit for bit.
"""

from __future__ import annotations

import copy
import types
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hemiola.engine_tensors import UINT8, dtype_code
from hemiola.schedules.sharded_optimizer import ShardedOptimizer
from hemiola.schedules.sharded_plan import ShardPlan

if TYPE_CHECKING:
    from hemiola.bound_model import BoundModel


class Sharded(Protocol):
    """What of the ``sharded`` schedule its state's saving reads."""

    bound: BoundModel
    plan: ShardPlan
    #: how many full states were gathered (names each gathering in the store)
    state_calls: int

    @property
    def sharded_optimizer(self) -> ShardedOptimizer: ...

    def adopt_plan(self, order: list[int]) -> None: ...

    def residuals(self) -> dict[int, torch.Tensor]: ...

    def load_residuals(self, residuals: dict[int, torch.Tensor]) -> None: ...

    def synchronize(self) -> None: ...


def install_state_methods(optimizer: torch.optim.Optimizer, schedule: Sharded) -> None:
    """The optimizer's state methods under ``sharded`` (see the module
    docstring): ``load_state_dict`` takes the full state;
    ``shard_state_dict`` and ``load_shard_state_dict`` are added.
    (``state_dict`` is the take-over's, which asks the schedule.)"""

    def load_state_dict(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Loads the full state optimizer.state_dict() returned (local: each
        rank keeps its pieces)."""
        schedule.synchronize()
        load_full_state_dict(schedule, state)
        schedule.load_residuals({})  # each rank's own: a full state has none

    def shard(opt: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shard of the optimizer state, with the plan it was cut
        by (no communication; load it on this rank with load_shard_state_dict)."""
        schedule.synchronize()  # (nothing on the wire writes what is saved)
        return shard_state_dict(schedule, lambda: torch.optim.Optimizer.state_dict(opt))

    def load_shard(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Loads what shard_state_dict() saved on this rank."""
        schedule.synchronize()
        schedule.adopt_plan(check_shard(schedule, state))
        schedule.load_residuals(state["hemiola_shard"].get("residuals", {}))
        torch.optim.Optimizer.load_state_dict(
            opt, {k: v for k, v in state.items() if k != "hemiola_shard"})

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]
    optimizer.shard_state_dict = types.MethodType(shard, optimizer)  # type: ignore[attr-defined]
    optimizer.load_shard_state_dict = types.MethodType(load_shard, optimizer)  # type: ignore[attr-defined]

FLOAT64 = dtype_code(torch.float64)
_KEYS_BYTES = 4096


def _element_keys(state: dict[int, dict[str, Any]],
                  views: list[torch.Tensor | None]) -> tuple[list[str], list[str]]:
    """(per-element keys, scalar keys) of the state: a per-element value is
    a tensor shaped like its piece."""
    for i, entry in state.items():
        view = views[i]
        assert view is not None
        per = [k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() == 1
               and v.numel() == view.numel()]
        return per, [k for k in entry if k not in per]
    return [], []


def _agree(schedule: Sharded, keys: tuple[list[str], list[str]]) -> tuple[list[str], list[str]]:
    """Rank 0's keys on every rank (rank 0 holds a piece of every bucket)."""
    text = "\n".join(["|".join(keys[0]), "|".join(keys[1])]).encode()
    if len(text) > _KEYS_BYTES:
        raise ValueError("the optimizer's state has too many keys to gather")
    buffer = torch.zeros(_KEYS_BYTES, dtype=torch.uint8)
    buffer[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    schedule.bound.engine.broadcast(buffer.data_ptr(), UINT8, _KEYS_BYTES, 0).wait()
    per, scalars = bytes(buffer.tolist()).rstrip(b"\0").decode().split("\n")
    return [k for k in per.split("|") if k], [k for k in scalars.split("|") if k]


def _by_index(schedule: Sharded) -> dict[int, dict[str, Any]]:
    """This rank's optimizer state per model parameter index."""
    opt = schedule.sharded_optimizer
    index = {id(v): i for i, v in enumerate(opt.views) if v is not None}
    return {index[id(v)]: s for v, s in opt.optimizer.state.items() if id(v) in index}


#: how long a rank waits for the others to ask for the full state too
CALL_WAIT_S = 30.0


def _everyone_asks(schedule: Sharded) -> None:
    """Every rank called optimizer.state_dict() (a collective): a rank
    that alone did (``if rank == 0: torch.save(optimizer.state_dict())``,
    DDP's habit) is told so within CALL_WAIT_S, instead of waiting in a
    gather the others never join."""
    m = schedule.bound
    store = m.store
    if store is None or m.world_size == 1:
        return
    schedule.state_calls += 1
    key = f"hemiola_sharded_state/{schedule.state_calls}/"
    store.set(key + str(m.rank), b"1")
    wait = min(CALL_WAIT_S, m.config.timeout_s)
    missing = []
    for r in range(m.world_size):
        try:
            store.get(key + str(r), wait if not missing else 0.01)
        except (RuntimeError, TimeoutError):  # the engine's store, or torch's
            missing.append(r)
    if missing:
        raise RuntimeError(
            f"optimizer.state_dict() under schedule='sharded' gathers the state from every "
            f"rank's shard, so every rank must call it: rank(s) {missing} did not within "
            f"{wait:.0f} s. Call it on every rank and save where rank == 0 (e.g. state = "
            "optimizer.state_dict(); if rank == 0: torch.save(state, path)), or save each "
            "rank's own optimizer.shard_state_dict() (no communication).")


def full_state_dict(schedule: Sharded, inner: Any) -> dict[str, Any]:
    """The full state (see the module docstring); `inner` is torch's own
    state_dict of the optimizer, whose param groups it keeps."""
    _everyone_asks(schedule)
    m = schedule.bound
    opt = schedule.sharded_optimizer
    mine = _by_index(schedule)
    per, scalars = _agree(schedule, _element_keys(mine, opt.views))
    plan = schedule.plan
    n = len(m.params)
    full: dict[int, dict[str, Any]] = {}
    # Scalars (a step count): from the rank holding the parameter's first
    # element, summed with zeros elsewhere (exact), as float64; whether a
    # parameter has state at all travels the same way.
    values = torch.zeros((len(scalars) + 1, n), dtype=torch.float64)
    kinds: dict[str, Any] = {}
    for i, entry in mine.items():
        if plan.piece_of[i].begin != 0:
            continue
        values[0, i] = 1.0
        for k, key in enumerate(scalars, 1):
            value = entry.get(key)
            kinds[key] = value
            if value is not None:
                values[k, i] = float(value)
    m.engine.all_reduce(values.data_ptr(), FLOAT64, values.numel()).wait()
    sample = _agree_kinds(schedule, scalars, kinds)
    for i in range(n):
        if values[0, i] == 0:
            continue
        entry = full[i] = {}
        for k, key in enumerate(scalars, 1):
            entry[key] = _like(sample[key], float(values[k, i]))
    for key in per:
        for bucket in plan.buckets:
            whole = torch.zeros(bucket.numel, dtype=bucket.dtype)
            for piece in bucket.pieces:
                value = mine.get(piece.index, {}).get(key)
                if value is not None:
                    whole[piece.offset:piece.offset + piece.count].copy_(value)
            m.engine.all_gather_chunks(whole.data_ptr(), dtype_code(bucket.dtype),
                                       bucket.numel, bucket.bounds).wait()
            for i, offset in zip(bucket.indices, bucket.offsets):
                if i in full:
                    p = m.params[i]
                    full[i][key] = whole[offset:offset + p.numel()].view_as(p).clone()
    numbering = {i: k for k, i in enumerate(i for g in opt.group_indices for i in g)}
    out = inner()
    groups = copy.deepcopy(out["param_groups"])
    start = 0
    for group, indices in zip(groups, opt.group_indices):
        group["params"] = list(range(start, start + len(indices)))
        start += len(indices)
    # The plan's order too (torch's load ignores it): a resume at the same
    # count cuts the same chunks, and sums as the uninterrupted run would.
    return {"state": {numbering[i]: entry for i, entry in sorted(full.items())},
            "param_groups": groups, "hemiola_order": list(plan.order)}


def _agree_kinds(schedule: Sharded, scalars: list[str],
                 kinds: dict[str, Any]) -> dict[str, Any]:
    """How each scalar is stored (a 0-d tensor of a dtype, or a number):
    rank 0's, broadcast (every rank rebuilds the same values)."""
    codes = torch.zeros(max(1, len(scalars)), dtype=torch.float64)
    table = [torch.float32, torch.float64, torch.float16, torch.bfloat16, int, float, type(None)]
    for k, key in enumerate(scalars):
        value = kinds.get(key)
        kind = value.dtype if isinstance(value, torch.Tensor) else type(value)
        codes[k] = table.index(kind) if kind in table else 0
    schedule.bound.engine.broadcast(codes.data_ptr(), FLOAT64, codes.numel(), 0).wait()
    return {key: table[int(codes[k])] for k, key in enumerate(scalars)}


def _like(kind: Any, value: float) -> Any:
    if kind is type(None):
        return None
    if isinstance(kind, torch.dtype):
        return torch.tensor(value, dtype=kind)
    return kind(value)


def load_full_state_dict(schedule: Sharded, state: dict[str, Any]) -> None:
    """Keeps this rank's pieces of a full state (local)."""
    opt = schedule.sharded_optimizer
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise ValueError("optimizer.load_state_dict under schedule='sharded' takes the full "
                         "state that optimizer.state_dict() returns ({'state', 'param_groups'}); "
                         "for a shard saved with optimizer.shard_state_dict() use "
                         "optimizer.load_shard_state_dict()")
    if "hemiola_shard" in state:
        raise ValueError("this is one rank's shard (optimizer.shard_state_dict()); load it with "
                         "optimizer.load_shard_state_dict() on the rank that saved it")
    order = state.get("hemiola_order")
    if order is not None and sorted(order) == list(range(len(schedule.bound.params))):
        schedule.adopt_plan([int(i) for i in order])
    groups = state["param_groups"]
    if len(groups) != len(opt.group_indices) or any(
            len(g["params"]) != len(indices) for g, indices in zip(groups, opt.group_indices)):
        raise ValueError(
            "optimizer.load_state_dict: the saved param groups hold "
            f"{[len(g['params']) for g in groups]} parameters, this optimizer "
            f"{[len(i) for i in opt.group_indices]}: a state of another model or optimizer")
    numbering = [i for g in opt.group_indices for i in g]
    inner = opt.optimizer
    for group, saved in zip(inner.param_groups, groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = value
    inner.state.clear()
    params = schedule.bound.params
    for number, entry in state["state"].items():
        i = numbering[int(number)]
        view = opt.views[i]
        if view is None:
            continue
        piece = schedule.plan.piece_of[i]
        mine: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == params[i].shape and value.dim():
                flat = value.detach().reshape(-1)
                mine[key] = flat[piece.begin:piece.begin + piece.count].to(
                    dtype=value.dtype).clone()
            elif isinstance(value, torch.Tensor):
                mine[key] = value.detach().clone()
            else:
                mine[key] = value
        inner.state[view] = mine


def shard_state_dict(schedule: Sharded, inner: Any) -> dict[str, Any]:
    """This rank's shard and the plan it was cut by (local)."""
    out = inner()
    m = schedule.bound
    out["hemiola_shard"] = {"rank": m.rank, "world_size": m.world_size,
                            "order": list(schedule.plan.order),
                            "fusion_bytes": m.config.fusion_bytes,
                            "first_bucket_bytes": m.config.first_bucket_bytes,
                            "compression": m.config.compression,
                            # int8/int4: what this rank's codings still owe
                            "residuals": {b: r.clone() for b, r in schedule.residuals().items()}}
    return out


def check_shard(schedule: Sharded, state: dict[str, Any]) -> list[int]:
    """The plan order of a shard state saved by this rank in this layout;
    a clear error otherwise."""
    meta = state.get("hemiola_shard") if isinstance(state, dict) else None
    if meta is None:
        raise ValueError("optimizer.load_shard_state_dict takes what optimizer.shard_state_dict() "
                         "returned; for a full state use optimizer.load_state_dict()")
    m = schedule.bound
    mine = {"rank": m.rank, "world_size": m.world_size,
            "fusion_bytes": m.config.fusion_bytes,
            "first_bucket_bytes": m.config.first_bucket_bytes,
            "compression": m.config.compression}
    # (a shard saved before its compression was recorded had none of int8's
    # block-aligned chunks)
    saved = {k: meta.get(k, v if k == "compression" and v not in ("int8", "int4") else "-")
             for k, v in mine.items()}
    differ = {k: (saved[k], v) for k, v in mine.items() if saved[k] != v}
    if differ:
        said = ", ".join(f"{k} {saved} (now {now})" for k, (saved, now) in differ.items())
        raise ValueError(f"this optimizer shard was saved with {said}: a shard loads only on the "
                         "rank that saved it, with the same number of ranks, bucket sizes and "
                         "compression. To change them, save the full state "
                         "(optimizer.state_dict(), on every rank) and load that")
    order = [int(i) for i in meta["order"]]
    if sorted(order) != list(range(len(m.params))):
        raise ValueError("this optimizer shard's plan does not cover this model's parameters")
    return order

"""Checks of a ``streaming`` checkpoint before any of it is restored.

A streaming state is restored into live engine buffers; restoring half of
one, or one that disagrees across ranks, leaves the ranks training apart
(or failing inside Gloo later). So everything is checked first, on every
rank alike: the layout against this model's fragments, the values for NaN
and infinity, and, across the ranks, that they loaded the same step and the
same shared copy (which is bitwise the same on every rank of a run).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from hemiola._native import C
from hemiola.engine_tensors import all_gather_rows


def check_layout(saved: dict[str, Any], numels: Sequence[int], dtypes: Sequence[torch.dtype],
                 residual_numels: Sequence[int] | None) -> None:
    """Raises ValueError, naming the fragment, unless `saved` fits fragments
    of `numels` elements of `dtypes` (and, with error feedback, residuals of
    `residual_numels`) and holds only finite values."""
    count = len(numels)
    for key in ("shared", "outer_momentum", "momentum_started"):
        if len(saved.get(key) or []) != count:
            raise ValueError(f"the checkpoint's streaming state has {len(saved.get(key) or [])} "
                             f"fragments in {key!r}, this model {count}: resume with the same "
                             "model and fragments")
    for f, (numel, dtype) in enumerate(zip(numels, dtypes)):
        for key in ("shared", "outer_momentum"):
            _check_tensor(saved[key][f], numel, dtype, f"{key}[{f}] (fragment {f})")
    if residual_numels is not None and saved.get("residuals") is not None:
        if len(saved["residuals"]) != len(residual_numels):
            raise ValueError(f"the checkpoint holds {len(saved['residuals'])} residuals, this "
                             f"model {len(residual_numels)}: resume with the same compression")
        for i, (theirs, numel) in enumerate(zip(saved["residuals"], residual_numels)):
            _check_tensor(theirs, numel, torch.float32, f"residuals[{i}]")
    in_flight = saved.get("in_flight")
    if in_flight is not None:
        f = in_flight["fragment"]
        if not 0 <= f < count:
            raise ValueError(f"the checkpoint's fragment in flight, {f}, is not one of this "
                             f"model's {count}")
        for key in ("average", "base"):
            _check_tensor(in_flight[key], numels[f], dtypes[f], f"the in-flight {key} of "
                          f"fragment {f}")
        if not 0 <= in_flight["step"] <= saved["inner_steps"]:
            raise ValueError(f"the checkpoint's fragment in flight was sent after step "
                             f"{in_flight['step']}, past its step count {saved['inner_steps']}")


def _check_tensor(t: Any, numel: int, dtype: torch.dtype, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"the checkpoint's streaming {what} is a {type(t).__name__}, not a "
                         "tensor")
    if t.numel() != numel or t.dtype != dtype:
        raise ValueError(f"the checkpoint's streaming {what} has {t.numel()} elements of "
                         f"{t.dtype}; this model's has {numel} of {dtype}: resume with the same "
                         "model and fragments")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"the checkpoint's streaming {what} holds NaN or infinity: the file "
                         "is damaged, or was saved after a replica diverged")


def agree_across_ranks(engines: Sequence[C.Engine], saved: dict[str, Any],
                       refused: str | None) -> None:
    """Collective (every engine's ranks): raises ValueError on every rank
    when any rank `refused` its state (check_layout's message, or None), or
    unless every rank loaded the same step, fragment in flight and shared
    copy, naming the first rank that differs."""
    row = torch.tensor([1, 0, 0, 0, 0], dtype=torch.int64)
    if refused is None:
        digest = hashlib.sha256()
        for t in (*saved["shared"], *saved["outer_momentum"]):
            digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        in_flight = saved.get("in_flight")
        row = torch.tensor([0, saved["inner_steps"],
                            -1 if in_flight is None else in_flight["fragment"],
                            0 if in_flight is None else in_flight["step"],
                            int.from_bytes(digest.digest()[:8], "little", signed=True)],
                           dtype=torch.int64)
    # Every engine's rows before any raise (a rank that raised before a later
    # gather would leave its peers waiting there), what each engine's ranks
    # found carried into the next gather (across the replicas, then inside
    # each group), so that every rank raises alike.
    differs = ""
    for engine in engines:
        rows = all_gather_rows(engine, row) if engine.world_size > 1 else row[None]
        for r in range(engine.world_size):
            if not differs and not rows[:, 0].any() and not torch.equal(rows[r], rows[0]):
                what = ("step count" if rows[r][1] != rows[0][1] else
                        "fragment in flight" if not torch.equal(rows[r][2:4], rows[0][2:4])
                        else "shared copy or outer momentum")
                differs = (f"streaming checkpoint: the ranks loaded different states (their "
                           f"{what} differs: {rows[0].tolist()[1:4]} against "
                           f"{rows[r].tolist()[1:4]}, steps/fragment/sent); every rank must load "
                           "a state saved at the same step by the same run (each rank's own "
                           "file, or one file on every rank)")
        row = row.clone()
        row[0] = max(int(rows[:, 0].max()), 2 if differs else 0)
    if refused is not None:
        raise ValueError(refused)
    if differs:
        raise ValueError(differs)
    if row[0] == 1:
        raise ValueError("streaming checkpoint: another rank refused the state it loaded (its "
                         "error says why); nothing was restored on any rank")
    if row[0] == 2:
        raise ValueError("streaming checkpoint: other ranks loaded states that differ (their "
                         "error says how); nothing was restored on any rank")


def warn_if_resized(saved: dict[str, Any], replicas: int, replica_ranks: int) -> None:
    """A state saved by another number of replicas still resumes (the shared
    copy and the outer momentum are the run's); says so, once, on rank 0."""
    then = saved.get("replicas"), saved.get("replica_ranks")
    if then[0] is None or then == (replicas, replica_ranks):
        return
    warnings.warn(f"streaming checkpoint saved by {then[0]} replicas of {then[1]} rank(s), "
                  f"resumed by {replicas} of {replica_ranks}: the shared copy and the outer "
                  "momentum carry over; each rank's inner state and residuals are those of the "
                  "file it loaded", stacklevel=4)

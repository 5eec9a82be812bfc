"""Communication schedules: what happens after gradients are marked ready.

- ``wfbp``: wait-free back-propagation; ``backward()`` returns with averaged
  gradients (torch DDP's behaviour).
- ``priority``: exact (wfbp's math); each bucket's update is applied when its
  reduction arrives, the next forward of a module waits only for the
  parameters it reads first, and the front layers are reduced first after
  backward.
- ``decoupled``: the reduction of iteration t runs under iteration t+1, which
  computes on approximate parameters (the exact ones stepped with this rank's
  own gradient); the exact step lands as soon as it has arrived and no forward
  still needs the approximate value, at the latest in ``optimizer.step()``.

Schedules work on a ``hemiola.replica.Replica`` (parameters, reducer,
stream, results), never on the wrapper; ``hemiola.forward_gate`` learns where
in the forward each parameter must be up to date. ``native`` runs
``priority`` and ``decoupled`` in the engine (its updater lands the updates
and steps SGD / Adam / AdamW); ``torch_update`` is their fallback through
torch's optimizer.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hemiola.config import Config
from hemiola.schedules.base import Schedule
from hemiola.schedules.decoupled import Decoupled
from hemiola.schedules.native import NativeUpdate, unsupported
from hemiola.schedules.priority import Priority
from hemiola.schedules.wfbp import Wfbp

_SCHEDULES: dict[str, type[Schedule]] = {
    "wfbp": Wfbp, "priority": Priority, "decoupled": Decoupled,
}


def choose_schedule(config: Config, optimizer: Any,
                    params: list[torch.Tensor]) -> type[Schedule]:
    """The schedule class for `config.schedule` and `optimizer`: for
    ``priority`` and ``decoupled``, run by the engine where it can step the
    optimizer, else through torch's step (saying why, once). Build it with
    its ``reducer_needs`` first, then ``cls(replica, optimizer, grad_scaler)``."""
    name = config.schedule
    if name != "wfbp" and config.native_optimizer is not False:
        reason = unsupported(optimizer, params)
        if reason is None:
            return NativeUpdate
        if optimizer is not None and params:
            warnings.warn(f"hemiola: schedule={name!r} steps with torch's optimizer, not the "
                          f"engine's: {reason}", stacklevel=5)
    if name == "decoupled" and config.preview:
        warnings.warn("hemiola: preview=True needs the engine's updater (native_optimizer; "
                      "SGD, Adam or AdamW); this model steps "
                      "with torch's optimizer and takes no preview", stacklevel=5)
    return _SCHEDULES[name]


__all__ = ["Decoupled", "NativeUpdate", "Priority", "Schedule", "Wfbp", "choose_schedule"]

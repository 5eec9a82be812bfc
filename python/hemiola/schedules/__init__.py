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

``gate`` learns where in the forward each parameter must be up to date;
``native`` runs ``priority`` and ``decoupled`` in the engine (its updater
lands the updates and steps SGD / Adam / AdamW); ``torch_update`` is their
fallback through torch's optimizer.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from hemiola.schedules.base import Schedule
from hemiola.schedules.decoupled import Decoupled
from hemiola.schedules.native import NativeUpdate, unsupported
from hemiola.schedules.priority import Priority
from hemiola.schedules.wfbp import Wfbp

if TYPE_CHECKING:
    from hemiola.data_parallel import DataParallel

_SCHEDULES: dict[str, type[Schedule]] = {
    "wfbp": Wfbp, "priority": Priority, "decoupled": Decoupled,
}


def make_schedule(name: str, model: DataParallel, optimizer: Any) -> Schedule:
    """The schedule `name` for `model`, trained by `optimizer`: for
    ``priority`` and ``decoupled``, run by the engine where it can step the
    optimizer, else through torch's step (saying why, once)."""
    native = model.config.native_optimizer
    if name != "wfbp" and native is not False:
        reason = unsupported(optimizer, model._params)
        if reason is None:
            return NativeUpdate(model, optimizer)
        if optimizer is not None and model._params:
            warnings.warn(f"hemiola: schedule={name!r} steps with torch's optimizer, not the "
                          f"engine's: {reason}", stacklevel=4)
    if name == "decoupled" and model.config.preview:
        warnings.warn("hemiola: preview=True needs the engine's updater (native_optimizer; "
                      "SGD, Adam or AdamW); this model steps "
                      "with torch's optimizer and takes no preview", stacklevel=4)
    return _SCHEDULES[name](model)


__all__ = ["Decoupled", "NativeUpdate", "Priority", "Schedule", "Wfbp", "make_schedule"]

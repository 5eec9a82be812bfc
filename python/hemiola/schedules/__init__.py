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

``gate`` learns where in the forward each parameter must be up to date.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hemiola.schedules.base import Schedule
from hemiola.schedules.decoupled import Decoupled
from hemiola.schedules.priority import Priority
from hemiola.schedules.wfbp import Wfbp

if TYPE_CHECKING:
    from hemiola.data_parallel import DataParallel

_SCHEDULES: dict[str, type[Schedule]] = {
    "wfbp": Wfbp, "priority": Priority, "decoupled": Decoupled,
}


def make_schedule(name: str, model: DataParallel) -> Schedule:
    return _SCHEDULES[name](model)


__all__ = ["Decoupled", "Priority", "Schedule", "Wfbp", "make_schedule"]

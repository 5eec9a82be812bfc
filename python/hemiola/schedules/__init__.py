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
- ``sharded``: exact; buckets are reduce-scattered during backward, each rank
  steps its shard of the parameters (gradients and optimizer state exist for
  the shard only), and the updated shards are all-gathered under the next
  forward, each module waiting for its own parameters.

Schedules work on a ``hemiola.bound_model.BoundModel`` (parameters, reducer,
stream, results), never on the wrapper; ``hemiola.forward_gate`` learns where
in the forward each parameter must be up to date. ``priority`` and
``decoupled`` run in the engine: what they share is ``updater_schedule`` (its
updater lands the updates and steps SGD / Adam / AdamW itself,
``engine_optimizer``, and any other optimizer through torch's own step,
``torch_step``, the updater's external stepper), with the optimizer's
take-over (``takeover``) and the buffers' broadcast (``buffers``).
"""

from __future__ import annotations

from hemiola.config import Config
from hemiola.schedules.base import Schedule
from hemiola.schedules.decoupled import Decoupled
from hemiola.schedules.priority import Priority
from hemiola.schedules.sharded import Sharded
from hemiola.schedules.wfbp import Wfbp

#: the class of each ``Config.schedule``
SCHEDULE_CLASSES: dict[str, type[Schedule]] = {
    "wfbp": Wfbp, "priority": Priority, "decoupled": Decoupled, "sharded": Sharded}


def choose_schedule(config: Config) -> type[Schedule]:
    """The schedule class for `config.schedule`. Build it with its
    ``reducer_needs`` first, then ``cls(bound, optimizer, grad_scaler)``."""
    return SCHEDULE_CLASSES[config.schedule]


__all__ = ["Decoupled", "Priority", "Schedule", "Sharded", "Wfbp", "choose_schedule"]

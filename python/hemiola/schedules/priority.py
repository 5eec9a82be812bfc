"""``priority``: exact (wfbp's math). Each bucket's update is applied when its
reduction arrives, the next forward of a module waits only for the
parameters it reads first, and the front layers are reduced first after
backward (the engine's priority policy; docs/schedules.md)."""

from __future__ import annotations

from hemiola.schedules.updater_schedule import UpdaterSchedule


class Priority(UpdaterSchedule):
    """``priority`` on the engine's updater: everything but the buffers'
    timing is ``UpdaterSchedule``'s (the policy is the engine's, chosen by
    ``config.schedule``)."""

    def _before_update(self) -> None:
        # The buffers' broadcast that backward started lands in
        # optimizer.step(), so the next forward starts from rank 0's buffers
        # (DDP's order; docs/schedules.md#buffers).
        self._buffers.land()

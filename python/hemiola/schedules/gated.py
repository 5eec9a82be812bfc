"""What the schedules that land updates in the next forward share
(``priority``, ``decoupled``, ``sharded``): the forward's hooks go to their
forward gate (hemiola.forward_gate), which learns where each parameter is
first read and calls the schedule's ``land`` there."""

from __future__ import annotations

import contextlib

from hemiola.forward_gate import ForwardGate


class LandsAtGates:
    """Mixin of a Schedule holding a ForwardGate as ``_gate``: the forward
    is observed through it, and a compiled forward lands at its start."""

    _gate: ForwardGate

    def forward_scope(self) -> contextlib.AbstractContextManager[None]:
        return self._gate.scope()

    @property
    def observing(self) -> bool:
        return self._gate.learning

    def forward_is_compiled(self) -> None:
        self._gate.land_at_start_only()

"""One replica of an elastic ``streaming`` run (``Config.coordinator``): its
membership epochs, the engine of each, and what it does when a peer dies or
joins.

The streamer averages each fragment over the current epoch's engine, every
average ending with a confirmation (engine/streaming/fragment_averager.h).

* **A peer dies.** The wire fails (at once for a killed process, whose
  sockets the kernel closes; after the coordinator's ``timeout_s`` for a
  machine that vanished), and ``after_inner_step`` raises with the step
  counted and the fragment in flight kept. This replica reports the sync it
  was at and whether it has the average; the coordinator answers with the
  survivors' epoch and whether to keep that average or average the fragment
  again over the survivors, from the live values it was sent from (the
  streamer kept them). Then the step finishes. No inner step is lost, and
  the survivors' shared copies stay bitwise equal.
* **A group joins.** The heartbeat hears the coordinator's offer (the next
  epoch's number) and the streamer carries it in its confirmations; after
  the sync whose confirmation agreed on it, every member asks to admit the
  joiners, the epoch forms, and rank 0 broadcasts the shared copy, the outer
  momentum, the step and sync counts and the module's buffers, checked on
  every rank by a SHA-256 of what arrived. The joiner's live parameters
  become the shared copy; it sends at the next fragment's sync.
* **Too few replicas** (below the coordinator's ``min_replicas``): after the
  sync that found it out, training waits, saying who is missing, until
  groups join.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hemiola._native import C
from hemiola.distributed import engine_over
from hemiola.elastic.client import CoordinatorClient, CoordinatorStore, Epoch, parse_address
from hemiola.engine_tensors import all_gather_rows, broadcast_tensors
from hemiola.validate import check_same_model

if TYPE_CHECKING:
    from hemiola.config import Config

log = logging.getLogger("hemiola")


class StreamingParallel(Protocol):
    """What of the wrapped model (hemiola.streaming) a replica works on."""

    _streamer: Any
    _engine: C.Engine
    module: torch.nn.Module
    config: Config

    def _views(self, fragment: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _copy_host_to_params(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One membership change this replica went through."""

    epoch: int
    replicas: int
    #: the inner step it happened at (nothing of it is lost)
    inner_step: int
    #: "failure" (the failed sync's average kept), "failure, averaged again", or "admit"
    what: str
    #: seconds from the call that met the failure (its wait for the dead
    #: peer included), or from the admit request, to training again
    stall_s: float


def group_name(config: Config) -> str:
    """This launch's name in the run (its rank 0's choice, for a launch of
    several ranks): ``group_name``, else ``HEMIOLA_GROUP``, else host name
    and process id."""
    return config.group_name or os.environ.get("HEMIOLA_GROUP") or (
        f"{socket.gethostname()}-{os.getpid()}")


class ElasticReplica:
    """This rank's membership in the run at ``config.coordinator``: rank
    `place` of the `places` ranks of replica group `name` (one launch); blocks
    until an epoch admits the group."""

    def __init__(self, config: Config, name: str, place: int = 0, places: int = 1) -> None:
        assert config.coordinator is not None
        self._config = config
        self._host = parse_address(config.coordinator)[0]
        self.name = name
        self._speaks = place == 0  # one log line per group, from its first rank
        self.client = CoordinatorClient(config.coordinator, name, place, places)
        #: what this replica went through, in order
        self.recoveries: list[Recovery] = []
        #: the run's inner step at which this replica joined it (None: it
        #: started with the run)
        self.joined_at_step: int | None = None
        if place == 0:
            log.warning("hemiola elastic: group %s (%d rank%s) joins the run at %s", name,
                        places, "s" if places > 1 else "", config.coordinator)
        self.epoch = self.client.join()
        self.engine, self.store = self._engine_for(self.epoch)
        if place == 0:
            log.warning("hemiola elastic: group %s is replica %d of %d in epoch %d%s", name,
                        self.epoch.rank, self.epoch.world, self.epoch.number,
                        "" if self.epoch.fresh else " (joining a running run)")

    @property
    def joining(self) -> bool:
        """This replica joined a running run: a peer hands it the state."""
        return self.epoch.joining

    def _engine_for(self, epoch: Epoch) -> tuple[C.Engine, CoordinatorStore]:
        # Each place of the groups averages its pieces over an engine of its own.
        store = self.client.store(f"epoch{epoch.number}/place{epoch.place}/")
        engine = engine_over(store, self._host, epoch.rank, epoch.world, self.client.timeout_s,
                             timeline=self._config.timeline,
                             gpu_backend=self._config.gpu_backend,
                             # the coordinator knows who died: no wait to find out
                             diagnose_failures=False)
        return engine, store

    def attach(self, model: StreamingParallel) -> None:
        """Called once the model's streamer exists: offers reach it, and a
        joiner receives the run's state."""
        self.client.on_offer = lambda offer: model._streamer.offer(offer)
        if self.joining:
            self._share_state(model)
            self.joined_at_step = model._streamer.inner_steps

    # ---- every inner step -------------------------------------------------

    def step(self, model: StreamingParallel) -> None:
        """``after_inner_step`` with the membership changes it may need."""
        streamer = model._streamer
        self._through_failures(model, streamer.after_inner_step, streamer.finish_step)
        if streamer.agreed_offer > self.epoch.number:
            self._admit(model, time.monotonic())

    def wait(self, model: StreamingParallel) -> None:
        """``wait_in_flight`` (``synchronize()``), through a peer's failure."""
        streamer = model._streamer
        self._through_failures(model, streamer.wait_in_flight, streamer.wait_in_flight)

    def _through_failures(self, model: StreamingParallel, call: Callable[[], None],
                          then: Callable[[], None]) -> None:
        """`call`; if the average in flight failed there, the survivors'
        epoch, then `then` (what of `call` is left)."""
        start = time.monotonic()
        try:
            call()
        except C.HemiolaError as e:
            if model._streamer.in_flight_fragment < 0:
                raise  # not an average that failed
            self._recover(model, e, then, start)

    def _recover(self, model: StreamingParallel, error: Exception,
                 then: Callable[[], None], start: float) -> None:
        """The survivors' epoch; the failed average kept or done again over
        it; then `then` (the rest of the step, or the wait). `start`: when
        the call that failed began (the stall counts the detection too)."""
        streamer = model._streamer
        step = streamer.inner_steps
        if self._speaks:
            log.warning("hemiola elastic: group %s: the average of sync %d failed at inner step "
                        "%d (%s); asking the coordinator who is left", self.name,
                        streamer.in_flight_round, step, str(error).splitlines()[0][:200])
        while True:
            epoch = self.client.reform(self.epoch.number, streamer.in_flight_round,
                                       streamer.in_flight_averaged)
            try:
                self._switch(model, epoch, redo=not epoch.keep)
                then()
                break
            except C.HemiolaError as e:  # another replica failed meanwhile
                log.warning("hemiola elastic: group %s: epoch %d failed too (%s)", self.name,
                            epoch.number, str(e).splitlines()[0][:200])
        what = "failure" if epoch.keep else "failure, averaged again"
        self._done(what, step, start)
        if epoch.joiners:
            self._share_state(model)
        if epoch.pause:
            self._admit(model, time.monotonic())

    def _admit(self, model: StreamingParallel, start: float) -> None:
        """At a landed sync: the epoch with the joiners (or, paused, the one
        that brings the run back to min_replicas)."""
        streamer = model._streamer
        while True:
            epoch = self.client.admit(self.epoch.number, streamer.syncs - 1)
            try:
                self._switch(model, epoch, redo=False)
                if epoch.joiners:
                    self._share_state(model)
                break
            except C.HemiolaError as e:
                log.warning("hemiola elastic: group %s: admitting failed (%s); again", self.name,
                            str(e).splitlines()[0][:200])
        self._done("admit", streamer.inner_steps, start)

    def _switch(self, model: StreamingParallel, epoch: Epoch, redo: bool) -> None:
        engine, store = self._engine_for(epoch)
        check_same_model(engine, store, model.module, model.config)
        model._streamer.rejoin(engine, redo)
        self.epoch, self.engine, self.store = epoch, engine, store
        model._engine = engine

    def _done(self, what: str, step: int, start: float) -> None:
        recovery = Recovery(self.epoch.number, self.epoch.world, step, what,
                            time.monotonic() - start)
        self.recoveries.append(recovery)
        if not self._speaks:
            return
        log.warning("hemiola elastic: group %s: epoch %d, %d replicas %s (%s at inner step %d; "
                    "%.2f s without training)", self.name, self.epoch.number, self.epoch.world,
                    self.epoch.members, what, step, recovery.stall_s)

    # ---- the state a joiner is handed ---------------------------------------

    def _share_state(self, model: StreamingParallel) -> None:
        """Collective over the epoch's engine: rank 0's shared copy, outer
        momentum, counts and buffers to every rank, checked by SHA-256."""
        streamer = model._streamer
        count = len(streamer.fragments())
        meta = torch.tensor([streamer.inner_steps, streamer.syncs,
                             *streamer.momentum_started()], dtype=torch.int64)
        broadcast_tensors(self.engine, [meta])
        # An outer momentum not started yet is zeros on every rank (the
        # default outer step, the average, never starts one): not sent.
        started = [bool(v) for v in meta[2:]]
        views = [view for f in range(count) for view in model._views(f)]
        sent = [view for f in range(count)
                for view, wanted in zip(model._views(f), (True, started[f])) if wanted]
        broadcast_tensors(self.engine, [*sent, *model.module.buffers()])
        digest = hashlib.sha256(meta.numpy().tobytes())
        for view in views:
            digest.update(view.view(torch.uint8).numpy().tobytes())
        mine = torch.frombuffer(bytearray(digest.digest()), dtype=torch.int64)
        every = all_gather_rows(self.engine, mine)
        differ = [r for r in range(every.shape[0]) if not torch.equal(every[r], every[0])]
        if differ:
            raise RuntimeError(f"hemiola elastic: the state handed to the joiners differs on "
                               f"ranks {differ} of epoch {self.epoch.number} (SHA-256 of the "
                               "shared copy and outer momentum); it was not used")
        if self.epoch.joining:
            values = [int(v) for v in meta]
            streamer.adopt(values[0], values[1], values[2:])
            model._copy_host_to_params()
            if self._speaks:
                log.warning("hemiola elastic: group %s took the run's state at inner step "
                            "%d (sync %d) from replica 0", self.name, values[0], values[1])

    def close(self) -> None:
        self.client.close()

"""A replica group's side of the coordinator (coordinator.py): its heartbeat,
its membership requests, and the key-value store its engines rendezvous
through."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from hemiola._native import C
from hemiola.elastic import protocol

log = logging.getLogger("hemiola")

#: seconds between two heartbeats (a tenth of the shortest sensible timeout)
BEAT_EVERY_S = 0.5


class Dropped(RuntimeError):
    """The coordinator counted this group out of the run (it answered too
    late); a restart joins again."""


@dataclasses.dataclass(frozen=True)
class Epoch:
    """One membership epoch as the coordinator announced it to this group."""

    number: int
    #: this group's rank among the epoch's groups, and how many there are
    rank: int
    world: int
    #: this rank's place in its group (each place averages over its own engine)
    place: int
    members: list[str]
    #: groups that join in this epoch (a member hands them the shared copy)
    joiners: list[str]
    #: a new run (every group starts from the model it wrapped)
    fresh: bool = False
    #: a member: keep the failed sync's average (else average it again)
    keep: bool = True
    #: fewer replicas than min_replicas: wait for groups after this sync
    pause: bool = False

    @property
    def joining(self) -> bool:
        """This group joins a running run in this epoch."""
        return self.members[self.rank] in self.joiners


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator={address!r} is not 'HOST:PORT'")
    return host, int(port)


class _Connection:
    """One connection to the coordinator, one request at a time."""

    def __init__(self, address: tuple[str, int], timeout_s: float) -> None:
        try:
            self._sock = socket.create_connection(address, timeout=timeout_s)
        except OSError as e:
            raise ConnectionError(f"cannot reach the coordinator at {address[0]}:{address[1]} "
                                  f"({e}); start it with `hemiola coordinator`") from e
        self._sock.settimeout(None)
        self._reader = self._sock.makefile("rb")
        self._lock = threading.Lock()
        hello = self.request({"op": "hello", "token": os.environ.get("HEMIOLA_JOB_TOKEN", "")})
        if "error" in hello:
            raise ConnectionError(f"the coordinator refused this group: {hello['error']}")
        self.timeout_s = float(hello["timeout_s"])

    def request(self, message: dict[str, Any],
                on_waiting: Callable[[str], None] | None = None) -> dict[str, Any]:
        with self._lock:
            protocol.send(self._sock, message)
            while True:
                answer = protocol.receive(self._reader, request=False)
                if answer is None:
                    raise ConnectionError("the coordinator closed the connection")
                if "waiting" not in answer:
                    return answer
                if on_waiting is not None:
                    on_waiting(str(answer["waiting"]))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class CoordinatorStore(C.Store):
    """The engine's rendezvous store, kept by the coordinator under `prefix`."""

    def __init__(self, connection: _Connection, prefix: str) -> None:
        super().__init__()
        self._connection = connection
        self._prefix = prefix

    def set(self, key: str, value: bytes) -> None:
        self._connection.request({"op": "set", "key": self._prefix + key,
                                  "value": protocol.encode(bytes(value))})

    def get(self, key: str, timeout_s: float) -> bytes:
        answer = self._connection.request({"op": "get", "key": self._prefix + key,
                                           "timeout_s": timeout_s})
        if "value" not in answer:
            raise TimeoutError(f"store key {key!r} not set within {timeout_s:.1f} s")
        return protocol.decode(answer["value"])

    def check(self, key: str) -> bool:
        return bool(self._connection.request({"op": "check", "key": self._prefix + key})["ok"])


class CoordinatorClient:
    """One rank's connections to the coordinator at `address` ('HOST:PORT'):
    rank `place` of the `places` ranks of group `group`.

    A heartbeat thread beats every half second on a connection of its own
    (its closing is how the coordinator learns this rank died) and hands
    every offer it hears to `on_offer`.
    """

    def __init__(self, address: str, group: str, place: int = 0, places: int = 1) -> None:
        self.group = group
        self.place = place
        self._whoami = {"group": group, "place": place}
        self._address = parse_address(address)
        self._beats = _Connection(self._address, 30.0)
        self.timeout_s = self._beats.timeout_s
        self._control = _Connection(self._address, 30.0)
        self._store = _Connection(self._address, 30.0)
        first = self._beats.request({"op": "beat", **self._whoami, "places": places})
        self._places = places
        if "error" in first:
            raise ValueError(f"the coordinator refused group {group!r}: {first['error']}")
        self.on_offer: Callable[[int], None] = lambda _offer: None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hemiola-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_EVERY_S):
            try:
                answer = self._beats.request({"op": "beat", **self._whoami,
                                              "places": self._places})
            except (OSError, ConnectionError, protocol.ProtocolError) as e:
                if not self._stop.is_set():
                    log.warning("hemiola elastic: lost the coordinator (%s)", e)
                return
            self.on_offer(int(answer.get("offer", 0)))

    def store(self, prefix: str) -> CoordinatorStore:
        return CoordinatorStore(self._store, prefix)

    def join(self) -> Epoch:
        """Blocks until an epoch admits this group."""
        return self._epoch({"op": "join", **self._whoami})

    def reform(self, epoch: int, round_: int, averaged: bool) -> Epoch:
        """This member's average of sync `round_` failed: blocks until the
        survivors' epoch forms."""
        return self._epoch({"op": "reform", **self._whoami, "epoch": epoch, "round": round_,
                            "averaged": averaged})

    def admit(self, epoch: int, round_: int) -> Epoch:
        """At sync `round_` (landed), the members agreed to admit the groups
        waiting (or wait for them, paused): blocks until the epoch forms."""
        return self._epoch({"op": "admit", **self._whoami, "epoch": epoch, "round": round_})

    def _epoch(self, message: dict[str, Any]) -> Epoch:
        answer = self._control.request(
            message, on_waiting=lambda why: log.warning("hemiola elastic (%s): %s", self.group,
                                                        why))
        if "dropped" in answer:
            raise Dropped(answer["dropped"])
        if "error" in answer:
            raise RuntimeError(f"the coordinator refused {message['op']}: {answer['error']}")
        return Epoch(number=int(answer["epoch"]), rank=int(answer["rank"]),
                     world=int(answer["world"]), place=int(answer["place"]),
                     members=list(answer["members"]),
                     joiners=list(answer["joiners"]), fresh=bool(answer.get("fresh", False)),
                     keep=bool(answer.get("keep", True)), pause=bool(answer.get("pause", False)))

    def close(self) -> None:
        self._stop.set()
        for connection in (self._beats, self._control, self._store):
            connection.close()

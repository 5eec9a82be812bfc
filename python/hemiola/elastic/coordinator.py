"""The coordinator of an elastic ``streaming`` run: who the replicas are.

One small process (``hemiola coordinator``, as torchft's lighthouse is) that
every replica group connects to. It holds no model state and moves no
tensors; it answers three questions:

* **Who trains now.** The run goes through membership *epochs*; in each, the
  replicas are a fixed list (a rank each) and average over an engine of their
  own, which rendezvouses through the coordinator's key-value store
  (``epoch{N}/``). The first epoch forms when ``min_replicas`` groups have
  joined.
* **Who is gone.** Every group keeps a heartbeat connection open: a closed
  connection (a killed process: the kernel closes its sockets) is a death
  seen at once, ``timeout_s`` without a beat (a machine that vanished) one
  seen then.
* **What to do about it.** A survivor whose average failed reports which
  sync it was (its *round*) and whether its average had completed before
  the confirmation failed (engine/streaming/fragment_averager.h). Once every
  live member has reported (or ``timeout_s`` has passed since the first
  report) the next epoch forms from those who reported, and each is told
  whether to keep the average it has or to average the fragment again over
  the survivors: a survivor at an earlier round keeps (another's confirmation
  of that round completed, so every rank has its average), and those at the
  latest round keep only if all of them had the average. A group that joins
  a running run is admitted when the members agree, through their next
  confirmation, that they saw it wait (the *offer* the heartbeat answers
  carry), so every member admits it after the same sync; a peer then hands
  it the shared copy (python/hemiola/elastic/replica.py).

Why a coordinator rather than an election among the groups: the groups
cannot tell a dead peer from a partitioned one on their own, and a
rendezvous needs a place every group can reach first; one process that
every group knows the address of is the simplest thing that answers both.
It keeps no training state, so restarting it means restarting the run from
a checkpoint (any group's: the shared copy is the same on all).
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import logging
import os
import socket
import threading
import time
from typing import Any

from hemiola.elastic import protocol

log = logging.getLogger("hemiola.coordinator")

#: how often a blocked request hears what it waits for
WAITING_EVERY_S = 5.0


@dataclasses.dataclass
class _Rank:
    """One rank of a group ("GROUP/PLACE"), as its heartbeat shows it."""

    last_beat: float
    connected: bool = True


#: ranks per group the coordinator accepts
MAX_PLACES = 4096


@dataclasses.dataclass
class _Request:
    """A member's request for the next epoch."""

    kind: str  # "reform": its average failed; "admit": at a sync, to admit joiners
    round: int  # the sync it is at
    averaged: bool  # reform: its average completed before the failure


class Coordinator:
    """Membership and rendezvous for elastic ``streaming`` runs (module docstring).

    `min_replicas`: below this many groups training pauses after the next
    sync until groups join. `start_replicas`: the first epoch waits for this
    many (default `min_replicas`). `timeout_s`: a
    group silent this long is dead; a member that does not report within it
    of the first report is dropped. `token`: connections must present it
    (``HEMIOLA_JOB_TOKEN``; empty: none needed).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 29400, min_replicas: int = 1,
                 timeout_s: float = 10.0, token: str = "",
                 start_replicas: int | None = None) -> None:
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be at least 1, got {min_replicas}")
        start_replicas = min_replicas if start_replicas is None else start_replicas
        if start_replicas < min_replicas:
            raise ValueError(f"start_replicas ({start_replicas}) must be at least min_replicas "
                             f"({min_replicas})")
        self.start_replicas = start_replicas
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        self.min_replicas = min_replicas
        self.timeout_s = timeout_s
        self._token = token
        self._server = socket.create_server((host, port), reuse_port=False)
        self._cv = threading.Condition()
        self._kv: dict[str, bytes] = {}
        self._ranks: dict[str, _Rank] = {}  # "GROUP/PLACE" -> heartbeat
        self._places: dict[str, int] = {}  # group -> its ranks (places)
        self._epoch = 0
        self._members: list[str] = []
        self._left: list[str] = []  # who the last epoch lost
        self._joiners: list[str] = []  # groups waiting to join, in order
        self._joining: dict[str, set[int]] = {}  # their places that asked
        self._requests: dict[str, dict[int, _Request]] = {}  # group -> place -> request
        self._first_request_at = 0.0
        self._answers: dict[str, dict[str, Any]] = {}  # "GROUP/PLACE" -> answer
        self._closed = False
        #: the epochs formed so far: (epoch, members, why), for tests and logs
        self.history: list[tuple[int, list[str], str]] = []

    @property
    def address(self) -> tuple[str, int]:
        return self._server.getsockname()[:2]

    @property
    def epoch(self) -> int:
        with self._cv:
            return self._epoch

    def start(self) -> None:
        """Serves on background threads (returns at once)."""
        threading.Thread(target=self._accept, name="hemiola-coordinator", daemon=True).start()
        threading.Thread(target=self._tick, name="hemiola-coordinator-tick", daemon=True).start()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._server.close()

    # ---- connections --------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _tick(self) -> None:
        # Deaths by silence and report timeouts need no message to happen.
        while True:
            time.sleep(0.1)
            with self._cv:
                if self._closed:
                    return
                self._advance()

    def _serve(self, conn: socket.socket) -> None:
        beating: str | None = None  # the group whose heartbeat connection this is
        try:
            reader = conn.makefile("rb")
            hello = protocol.receive(reader)
            if hello is None or hello.get("op") != "hello":
                protocol.send(conn, {"error": "a connection begins with a hello"})
                return
            if not hmac.compare_digest(str(hello.get("token", "")), self._token):
                protocol.send(conn, {"error": "wrong job token (HEMIOLA_JOB_TOKEN differs from "
                                              "the coordinator's)"})
                return
            protocol.send(conn, {"ok": True, "timeout_s": self.timeout_s})
            while (message := protocol.receive(reader)) is not None:
                op = message["op"]
                if op == "beat":
                    beating = self._beat(conn, message, beating)
                elif op in ("set", "get", "check"):
                    self._store(conn, message)
                elif op in ("join", "reform", "admit"):
                    self._membership(conn, message)
                else:
                    protocol.send(conn, {"error": f"unknown op {op!r}"})
        except (OSError, protocol.ProtocolError, ValueError, KeyError, TypeError) as e:
            log.debug("coordinator: a connection ended: %s", e)
        finally:
            conn.close()
            if beating is not None:
                with self._cv:
                    rank = self._ranks.get(beating)
                    if rank is not None:
                        rank.connected = False
                        log.warning("coordinator: %s is gone (its connection closed)",
                                    _describe(beating))
                    self._advance()
                    self._cv.notify_all()

    def _beat(self, conn: socket.socket, message: dict[str, Any], beating: str | None) -> str:
        name = str(message.get("group", ""))
        place, places = message.get("place", 0), message.get("places", 1)
        if not (isinstance(place, int) and isinstance(places, int)
                and 0 <= place < places <= MAX_PLACES):
            protocol.send(conn, {"error": f"place {place!r} of {places!r} ranks is not a rank "
                                          f"of a group (at most {MAX_PLACES})"})
            raise ValueError("bad place")
        key = f"{name}/{place}"
        with self._cv:
            if beating is None:
                if not name or "/" in name or self._alive_rank(key):
                    protocol.send(conn, {"error": f"group name {name!r} (rank {place}) is taken "
                                                  "by a live group, or not a name (each group "
                                                  "needs its own, without '/')"})
                    raise ValueError("duplicate group")
                known = self._places.get(name)
                if known not in (None, places) and any(
                        self._alive_rank(f"{name}/{j}") for j in range(known)):
                    protocol.send(conn, {"error": f"group {name!r} has {known} ranks, this rank "
                                                  f"says {places}"})
                    raise ValueError("places differ")
                self._places[name] = places
                log.info("coordinator: %s connected", _describe(key))
            elif key != beating:
                raise ValueError("a heartbeat connection beats for one rank")
            self._ranks[key] = _Rank(last_beat=time.monotonic())
            offer = self._epoch + 1 if self._epoch and self._waiting_joiners() else 0
            protocol.send(conn, {"epoch": self._epoch, "offer": offer})
            return key

    def _store(self, conn: socket.socket, message: dict[str, Any]) -> None:
        op, key = message["op"], str(message.get("key", ""))
        with self._cv:
            if op == "set":
                self._kv[key] = protocol.decode(message["value"])
                self._cv.notify_all()
                protocol.send(conn, {"ok": True})
            elif op == "check":
                protocol.send(conn, {"ok": key in self._kv})
            else:
                deadline = time.monotonic() + float(message.get("timeout_s", 60.0))
                while key not in self._kv and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                if key in self._kv:
                    protocol.send(conn, {"value": protocol.encode(self._kv[key])})
                else:
                    protocol.send(conn, {"error": f"key {key!r} not set in time"})

    # ---- membership ---------------------------------------------------------

    def _alive_rank(self, key: str) -> bool:
        rank = self._ranks.get(key)
        return (rank is not None and rank.connected
                and time.monotonic() - rank.last_beat <= self.timeout_s)

    def _alive(self, name: str) -> bool:
        """Every rank of group `name` is alive (a group with a dead rank is dead:
        its own per-step schedule cannot go on)."""
        places = self._places.get(name)
        return places is not None and all(self._alive_rank(f"{name}/{j}")
                                          for j in range(places))

    def _waiting_joiners(self) -> list[str]:
        """Groups all of whose ranks asked to join, and are alive."""
        return [j for j in self._joiners if self._alive(j)
                and len(self._joining.get(j, ())) == self._places[j]]

    def _reported(self, name: str) -> bool:
        return len(self._requests.get(name, {})) == self._places.get(name, 0)

    def _membership(self, conn: socket.socket, message: dict[str, Any]) -> None:
        op, name = message["op"], str(message.get("group", ""))
        place = message.get("place", 0)
        key = f"{name}/{place}"
        with self._cv:
            if not self._alive_rank(key):
                protocol.send(conn, {"error": f"{_describe(key)} has no heartbeat: beat first"})
                return
            if op == "join":
                if name in self._members:
                    # Its earlier self died: it is dropped at the next epoch.
                    log.info("coordinator: group %s rejoins", name)
                if name not in self._joiners:
                    self._joiners.append(name)
                self._joining.setdefault(name, set()).add(int(place))
            else:
                if message.get("epoch") != self._epoch or name not in self._members:
                    protocol.send(conn, {"dropped": (
                        f"group {name!r} is not a member of epoch {self._epoch} (it did not "
                        f"report within {self.timeout_s} s of the others, one of its ranks "
                        "died, or it came back after being counted dead); start it again to "
                        "rejoin the run")})
                    return
                if not self._requests:
                    self._first_request_at = time.monotonic()
                self._requests.setdefault(name, {})[int(place)] = _Request(
                    op, int(message["round"]), bool(message.get("averaged", True)))
            self._answers.pop(key, None)
            self._advance()
            last_said = time.monotonic()
            while key not in self._answers and not self._closed:
                self._cv.wait(0.5)
                if time.monotonic() - last_said >= WAITING_EVERY_S:
                    protocol.send(conn, {"waiting": self._waiting_for(name)})
                    last_said = time.monotonic()
            answer = self._answers.pop(key, {"error": "the coordinator is closing"})
        protocol.send(conn, answer)

    def _waiting_for(self, name: str) -> str:
        if self._epoch == 0:
            ready = len(self._waiting_joiners())
            return (f"{ready} of {self.start_replicas} groups have joined; the run starts "
                    "when the rest do")
        if name in self._joiners:
            return (f"waiting for the members of epoch {self._epoch} to reach their next sync "
                    "and admit it")
        missing = [m for m in self._members if not self._reported(m) and self._alive(m)]
        if missing:
            return f"waiting for groups {missing} to report (at most {self.timeout_s:.0f} s)"
        alive = sum(self._reported(m) for m in self._members) + len(self._waiting_joiners())
        return (f"paused: {alive} replicas, min_replicas={self.min_replicas}; lost: "
                f"{self._left}; start groups to resume")

    def _advance(self) -> None:
        """Forms the next epoch when its members are known (holds the lock)."""
        if self._epoch == 0:
            ready = self._waiting_joiners()
            if len(ready) >= self.start_replicas:
                self._form(ready, [], "start", lambda m, place: {"fresh": True})
            return
        if not any(self._alive(m) for m in self._members):
            # No member left to hand a joiner the state: the run is over (or
            # every member died: restart it from a checkpoint).
            for j in self._joiners:
                for place in self._joining.get(j, ()):
                    self._answers[f"{j}/{place}"] = {"error": (
                        f"the run has no live member left (epoch {self._epoch}: "
                        f"{self._members} finished or died), so none can hand this group the "
                        "shared copy; if it died, restart every group from a checkpoint")}
            self._joiners.clear()
            self._joining.clear()
            self._requests.clear()
            self._cv.notify_all()
            return
        if not self._requests:
            return
        # (A name among the joiners is a restarted group: its old self is gone.)
        outstanding = [m for m in self._members if not self._reported(m) and self._alive(m)
                       and m not in self._joiners]
        if outstanding and time.monotonic() - self._first_request_at < self.timeout_s:
            return
        reports = {m: self._requests[m] for m in self._members
                   if self._reported(m) and self._alive(m)}
        if not reports:
            self._requests.clear()
            return
        every = [r for places in reports.values() for r in places.values()]
        top = max(r.round for r in every)
        failed = any(r.kind == "reform" for r in every)
        keep_top = all(r.averaged for r in every if r.round == top)
        # Joiners need every member at the same sync, its average kept: then
        # the members' shared copies are the ones a joiner is handed.
        same_point = keep_top and all(r.round == top for r in every)
        survivors = [m for m in self._members if m in reports]
        joiners = [j for j in self._waiting_joiners() if j not in survivors] if same_point else []
        if len(survivors) + len(joiners) < self.min_replicas and not failed:
            return  # paused at a sync: wait for groups to join
        left = [m for m in self._members if m not in reports]
        why = (f"{left} left" if left else "") + (", " if left and joiners else "") + (
            f"{joiners} joined" if joiners else "")
        world = len(survivors) + len(joiners)

        def answer(m: str, place: int) -> dict[str, Any]:
            if m in joiners:
                return {"fresh": False}
            r = reports[m][place]
            return {"keep": r.round < top or keep_top, "pause": world < self.min_replicas}

        self._form(survivors + joiners, joiners, why or "same members", answer)

    def _form(self, members: list[str], joiners: list[str], why: str, answer: Any) -> None:
        self._epoch += 1
        self._left = [m for m in self._members if m not in members]
        # A rank still waiting that is not in the new epoch (its group lost a
        # rank, or reported too late) is told so, rather than left waiting.
        for m, places in self._requests.items():
            if m not in members:
                for place in places:
                    self._answers[f"{m}/{place}"] = {"dropped": (
                        f"group {m!r} is not a member of epoch {self._epoch} (one of its ranks "
                        "died, or it reported too late); start it again to rejoin the run")}
        self._members = list(members)
        self._joiners = [j for j in self._joiners if j not in members]
        for j in members:
            self._joining.pop(j, None)
        self._requests.clear()
        for rank, m in enumerate(members):
            for place in range(self._places[m]):
                self._answers[f"{m}/{place}"] = {
                    "epoch": self._epoch, "rank": rank, "world": len(members), "place": place,
                    "members": members, "joiners": joiners, **answer(m, place)}
        self.history.append((self._epoch, list(members), why))
        log.warning("coordinator: epoch %d: %d replicas %s (%s)", self._epoch, len(members),
                    members, why)
        self._cv.notify_all()


def _describe(key: str) -> str:
    name, _, place = key.rpartition("/")
    return f"group {name}" if place == "0" else f"group {name}'s rank {place}"


def register(commands: Any) -> None:
    """``hemiola coordinator``: serve an elastic ``streaming`` run."""
    parser = commands.add_parser(
        "coordinator", help="the coordinator of an elastic streaming run (membership and "
                            "rendezvous; docs/streaming.md, 'Elastic membership')")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=29400)
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="groups below which training pauses until more join")
    parser.add_argument("--start-replicas", type=int, default=None,
                        help="groups the run waits for to start (default: --min-replicas)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds of silence after which a group is dead")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    token = os.environ.get("HEMIOLA_JOB_TOKEN", "")
    if not token and not args.host.startswith("127."):
        # A group is handed the shared copy when it joins, and its averages
        # go into everyone's model: an open port would give both to anyone.
        log.error("coordinator: listening on %s without HEMIOLA_JOB_TOKEN would let anyone "
                  "who reaches the port join the run, read the model and move it; set "
                  "HEMIOLA_JOB_TOKEN to a secret (the same in every group's environment), or "
                  "serve one machine with --host 127.0.0.1", args.host)
        return 2
    coordinator = Coordinator(args.host, args.port, args.min_replicas, args.timeout, token,
                              args.start_replicas)
    coordinator.start()
    host, port = coordinator.address
    log.warning("coordinator: serving on %s:%d (min_replicas=%d, timeout %.0f s); groups "
                "connect with coordinator='HOST:%d'", host, port, args.min_replicas, args.timeout,
                port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        coordinator.close()
    return 0

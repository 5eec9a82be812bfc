"""Rank functions for the hostile-input tests of the parameter server (see
test_ps_hostile.py): a server, a real worker, and a fuzzer that speaks the wire
protocol from raw Python sockets."""

from __future__ import annotations

import datetime
import os
import random
import socket
import struct
import time
from typing import Any

import ps_workers
import torch.distributed as dist

import hemiola.ps
from hemiola._native import C
from hemiola.ps.roles import PS_PREFIX

# The wire header (cpp/src/ps/protocol.h), little-endian, 136 bytes.
HEADER = struct.Struct("<IHHQiiqqq7diiiidQ")
MAGIC, PROTOCOL = 0x53504D48, 1
PING, HELLO, REGISTER, PUSH, PULL = 8, 9, 1, 3, 5
ERROR, WELCOME, REGISTERED = 24, 25, 20
ASP = 1


def fnv1a(data: bytes) -> int:
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def header(type_: int, *, seq: int = 0, key: int = -1, worker: int = -1, version: int = 0,
           aux: int = 0, payload_bytes: int = 0, checksum: int | None = None) -> bytes:
    """A header as the C++ side lays it out; the checksum is right unless given."""
    fields = [MAGIC, PROTOCOL, type_, seq, key, worker, version, aux, payload_bytes,
              0.05, 0.0, 0.0, 0.0, 0.9, 0.999, 1e-8, 0, 0, 0, 0, 1.0]
    if checksum is None:
        checksum = fnv1a(HEADER.pack(*fields, 0))
    return HEADER.pack(*fields, checksum)


def read_message(s: socket.socket) -> tuple[int, bytes] | None:
    """(type, payload), or None when the server closed the connection."""
    def exactly(n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            try:
                chunk = s.recv(n - len(data))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            data += chunk
        return data

    raw = exactly(HEADER.size)
    if raw is None:
        return None
    fields = HEADER.unpack(raw)
    payload = exactly(fields[8]) if fields[8] else b""
    return fields[2], payload or b""


def refusal(s: socket.socket) -> str:
    """What the server says to a connection it refuses ('closed' when nothing)."""
    message = read_message(s)
    if message is None:
        return "closed"
    assert read_message(s) is None, "a refused connection stayed open"
    return message[1].decode() if message[0] == ERROR else f"type {message[0]}"


def _server(config: hemiola.ps.PSConfig) -> dict[str, Any]:
    stats = hemiola.ps.serve(config)
    return {"pushes_applied": stats.pushes_applied, "rejected": stats.rejected,
            "refused": stats.refused, "dead_workers": list(stats.dead_workers),
            "rejections": list(stats.rejections)}


def _listening_address(port: int) -> str:
    """The local address of the listening TCP socket on `port` (from /proc)."""
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(path) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    if width == 8:
                        return socket.inet_ntoa(bytes.fromhex(addr)[::-1])
                    return addr
    return "not found"


def _fuzz(options: dict[str, Any], token: str, seed: int) -> dict[str, Any]:
    """Worker slot 1, played by a fuzzer: attacks first as a stranger, then as
    an admitted member sending hostile messages; never a valid gradient."""
    rng = random.Random(seed)
    store = _store()
    store.wait(["ps/s0/address"])
    host, port = store.get("ps/s0/address").decode().rsplit(" ", 1)
    out: dict[str, Any] = {"address": host, "listening_on": _listening_address(int(port))}

    def connect() -> socket.socket:
        s = socket.create_connection((host, int(port)), timeout=20)
        s.settimeout(20)  # never a silent hang
        return s

    silent = connect()
    silent_since = time.monotonic()
    answers: dict[str, str] = {}
    for i in range(8):  # random bytes
        with connect() as s:
            s.sendall(rng.randbytes(rng.randint(1, 3000)))
            answers[f"random {i}"] = refusal(s)
    hello = header(HELLO, worker=1, payload_bytes=len(token))
    with connect() as s:  # a truncated hello, then the connection closes
        s.sendall(hello[:50])
        s.shutdown(socket.SHUT_WR)
        answers["truncated"] = refusal(s)
    with connect() as s:  # a header claiming a terabyte
        s.sendall(header(HELLO, worker=1, payload_bytes=1 << 40))
        answers["terabyte"] = refusal(s)
    with connect() as s:  # a hello longer than any token
        s.sendall(header(HELLO, worker=1, payload_bytes=100_000) + b"x" * 100_000)
        answers["oversized"] = refusal(s)
    with connect() as s:  # garbled: a flipped checksum
        s.sendall(header(HELLO, worker=1, payload_bytes=len(token), checksum=42) + token.encode())
        answers["garbled"] = refusal(s)
    with connect() as s:
        s.sendall(header(HELLO, worker=1, payload_bytes=5) + b"guess")
        answers["wrong token"] = refusal(s)
    with connect() as s:
        s.sendall(header(HELLO, worker=1))
        answers["no token"] = refusal(s)
    with connect() as s:  # a message other than a hello first
        s.sendall(header(PUSH, worker=1, key=0, payload_bytes=8) + b"\0" * 8)
        answers["push first"] = refusal(s)
    with connect() as s:
        s.sendall(header(HELLO, worker=7, payload_bytes=len(token)) + token.encode())
        answers["worker 7"] = refusal(s)
    out["answers"] = answers

    # Now a member of the job (the right token), sending hostile messages.
    member = connect()
    member.sendall(hello + token.encode())
    welcome = read_message(member)
    assert welcome is not None and welcome[0] == WELCOME, welcome
    names = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "net.4.weight",
             "net.4.bias"]
    numels = [20 * 64, 64, 64 * 64, 64, 64 * 5, 5]
    shards = C.ps.plan_shards(numels, 1, hemiola.ps.PSConfig(**options).partition_elems)
    table = ("optimizer 0\n" + "".join(
        f"{s['key']} {s['tensor']} {s['begin']} {s['count']} {names[s['tensor']]}\n"
        for s in shards)).encode()
    register = header(REGISTER, seq=0, worker=1, aux=ASP, payload_bytes=len(table)) + table
    pull = header(PULL, seq=1, worker=1, key=1)
    member.sendall(register + pull)
    replies: list[str] = []

    def collect(errors: int, until_type: int = -1) -> None:
        while len([r for r in replies if r.startswith("error")]) < errors:
            message = read_message(member)
            assert message is not None, f"the member was dropped early: {replies}"
            if message[0] == PING:
                continue
            replies.append(f"error: {message[1].decode()}" if message[0] == ERROR
                           else f"type {message[0]}")
            if message[0] == until_type:
                return

    collect(1, until_type=21)  # registered, then the pull's reply: the key is initialised
    zeros = b"\0" * 256  # one gradient of net.0.bias (key 1)
    nan = struct.pack("<f", float("nan")) * 64
    # Each message that passes the sequence check advances it, rejected or not.
    sent = [
        pull,  # replayed: an old sequence number
        register,  # replayed registration
        header(PUSH, seq=2, worker=1, key=1, payload_bytes=8) + b"\0" * 8,  # wrong size
        header(PUSH, seq=3, worker=1, key=99, payload_bytes=256) + zeros,  # no such key
        header(PUSH, seq=4, worker=1, key=1, version=10**6, payload_bytes=256) + zeros,  # future
        header(PUSH, seq=5, worker=1, key=1, payload_bytes=256) + nan,  # non-finite
        header(PUSH, seq=6, worker=7, key=1, payload_bytes=256) + zeros,  # not its index
        header(HELLO, seq=7, worker=1, payload_bytes=len(token)) + token.encode(),  # hello again
    ]
    for message in sent:
        member.sendall(message)
    collect(len(sent))
    out["replies"] = replies

    # The silent stranger is dropped after timeout_s; meanwhile the member
    # keeps its connection alive with pings.
    silent.settimeout(0.5)
    while True:
        try:
            data = silent.recv(1 << 16)
            silent.settimeout(5)
            while chunk := silent.recv(1 << 16):
                data += chunk
            break
        except TimeoutError:
            member.sendall(header(PING))
            while True:  # drain the server's pings
                member.settimeout(0.01)
                try:
                    if not member.recv(1 << 16):
                        break
                except TimeoutError:
                    break
            member.settimeout(20)
    out["silent_dropped_after_s"] = time.monotonic() - silent_since
    out["silent_told"] = data[HEADER.size:].decode(errors="replace")
    silent.close()

    # Finally garbage inside the admitted connection: it is dropped.
    member.sendall(rng.randbytes(500))
    while (message := read_message(member)) is not None:
        pass
    member.close()
    return out


def fuzz_job(rank: int, world: int, options: dict[str, Any], steps: int, token: str,
             seed: int) -> dict[str, Any] | None:
    """Rank 0 serves, rank 1 (worker 0) trains an MLP, rank 2 (worker 1) fuzzes."""
    if rank == 0:
        return _server(hemiola.ps.PSConfig.from_kwargs(**options))
    if rank == 2:
        return _fuzz(options, token, seed)
    return ps_workers.train(rank, world, options, "mlp", "sgd", steps)


def token_job(rank: int, world: int, options: dict[str, Any], tokens: dict[int, str | None]
              ) -> dict[str, Any] | None:
    """A job whose ranks hold the tokens in `tokens` (None: unset)."""
    token = tokens.get(rank)
    if token is None:
        os.environ.pop("HEMIOLA_JOB_TOKEN", None)
    else:
        os.environ["HEMIOLA_JOB_TOKEN"] = token
    return ps_workers.train(rank, world, options, "mlp", "sgd", 3)


def token_seen(rank: int, world: int) -> str | None:
    """The job token this rank's environment holds."""
    return os.environ.get("HEMIOLA_JOB_TOKEN")


def nan_job(rank: int, world: int, consistency: str) -> dict[str, Any] | None:
    """Worker 0 trains an MLP whose input turns NaN at step 2."""
    config = hemiola.ps.PSConfig(consistency=consistency, num_servers=1, timeout_s=20)
    served = ps_workers.server_or_none(config)
    if served is not None:
        return served
    import torch

    from models import make_batch, make_model, make_optimizer

    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.ps.wrap(m, make_optimizer("sgd", m.parameters()), config)
    try:
        for step in range(4):
            x, y = make_batch("mlp", step, 0, 1)
            if step == 2:
                x = x * float("nan")
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        model.synchronize()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"error": f"{type(e).__name__}: {e}", "step": step}
    return {"error": None}


def snapshot_job(rank: int, world: int, snapshot_dir: str) -> dict[str, Any] | None:
    """A one-worker bsp job that trains two steps and asks for a snapshot."""
    config = hemiola.ps.PSConfig(consistency="bsp", num_servers=1, timeout_s=20,
                                 snapshot_dir=snapshot_dir)
    served = ps_workers.server_or_none(config)
    if served is not None:
        return served
    import torch

    from models import make_batch, make_model, make_optimizer

    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.ps.wrap(m, make_optimizer("sgd", m.parameters()), config)
    for step in range(2):
        x, y = make_batch("mlp", step, 0, 1)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.snapshot()
    model.close()
    return None


def _store() -> Any:
    """The job store under hemiola.ps's prefix, as a stranger on the machine reaches it."""
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    return dist.PrefixStore(PS_PREFIX, store)


def flood_job(rank: int, world: int, options: dict[str, Any], silent: int) -> dict[str, Any] | None:
    """Rank 0 serves; a thread of its process opens `silent` connections to
    the server as soon as its address is published and never says a word,
    holding them until the job ends; only then do the workers join."""
    if rank == 0:
        import threading

        held: list[socket.socket] = []

        def flood() -> None:
            store = _store()
            store.wait(["ps/s0/address"])
            host, port = store.get("ps/s0/address").decode().rsplit(" ", 1)
            for _ in range(silent):
                held.append(socket.create_connection((host, int(port)), timeout=20))
            time.sleep(1.0)  # the server has accepted them: they wait to say hello
            store.set("test/flooded", "1")

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        try:
            served = _server(hemiola.ps.PSConfig.from_kwargs(**options))
        finally:
            for s in held:
                s.close()
        return served
    _store().wait(["test/flooded"])
    return ps_workers.train(rank, world, options, "mlp", "sgd", 4)

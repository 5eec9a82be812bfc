"""Rank functions for the hostile-input tests of the parameter server (see
test_ps_hostile.py): a server, a real worker, and a fuzzer that speaks the wire
protocol from raw Python sockets."""

from __future__ import annotations

import contextlib
import datetime
import encodings.idna  # noqa: F401 - socket needs it, and a stranger run as nobody cannot import it
import os
import random
import select
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
MAGIC, PROTOCOL = 0x53504D48, 2
PING, HELLO, REGISTER, PUSH, PULL = 8, 9, 1, 3, 5
ERROR, WELCOME, REGISTERED, PULL_REPLY = 24, 25, 20, 21
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


def registration(model: Any, options: dict[str, Any]) -> tuple[bytes, list[dict[str, int]]]:
    """What a worker training `model` with models.make_optimizer("sgd")
    registers with server 0 of a one-server job (its shard table and its
    optimizer settings), and the shards."""
    from models import make_optimizer

    named = list(model.named_parameters())
    shards = C.ps.plan_shards([p.numel() for _, p in named], 1,
                              hemiola.ps.PSConfig(**options).partition_elems)
    group = make_optimizer("sgd", model.parameters()).param_groups[0]
    settings = [group["lr"], group["momentum"], group["dampening"], group["weight_decay"],
                float(group["nesterov"]), 0.9, 0.999, 1e-8]
    table = "optimizer 0\n" + "".join(
        f"{s['key']} {s['tensor']} {s['begin']} {s['count']} {named[s['tensor']][0]}\n"
        for s in shards)
    hyper = "".join(f"{s['key']} " + " ".join(repr(float(v)) for v in settings) + "\n"
                    for s in shards)
    return (table + "hyper\n" + hyper).encode(), shards


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
    from models import make_model

    table, _ = registration(make_model("mlp"), options)
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


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _drop_to_nobody() -> bool:
    """Makes this process another user's (nobody's) when it runs as root: a
    stranger on the machine. False when it cannot (not root)."""
    if os.geteuid() != 0:
        return False
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    return True


def _stranger(options: dict[str, Any]) -> dict[str, Any]:
    """Someone else on the machine: it reaches the job's store (no
    authentication) and the server, reads what the store tells anyone, and
    tries to take worker 1's place with a bogus shard table."""
    store = _store()
    other_user = _drop_to_nobody()
    out: dict[str, Any] = {"other_user": other_user}
    store.wait(["ps/s0/address"])
    host, port = store.get("ps/s0/address").decode().rsplit(" ", 1)
    token = ""
    if store.check(["job_token_file/0"]):  # where the job keeps its token, as the source says
        out["token_path"] = store.get("job_token_file/0").decode()
        if other_user:  # the job's own user could read the ranks' memory anyway
            try:
                with open(out["token_path"]) as f:
                    token = f.read()
            except OSError as e:
                out["token_file_error"] = str(e)
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.settimeout(20)
        s.sendall(header(HELLO, worker=1, payload_bytes=len(token)) + token.encode())
        answer = read_message(s)
        if answer is not None and answer[0] == WELCOME:  # admitted: register a bogus model
            table = b"optimizer 0\n0 0 0 3 bogus\nhyper\n0 0.05 0 0 0 0 0.9 0.999 1e-08\n"
            s.sendall(header(REGISTER, worker=1, aux=0, payload_bytes=len(table)) + table)
            answer = read_message(s)
        out["answer"] = (answer[1].decode() if answer and answer[0] == ERROR
                         else f"type {answer[0]}" if answer else "closed")
        store.set("test/stranger_done", "1")
        if out["answer"] == f"type {REGISTERED}":  # it holds the slot: see what becomes of it
            while (message := read_message(s)) is not None and message[0] != ERROR:
                pass
    return out


def stranger_job(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any] | None:
    """Ranks 0-2: a bsp job of one server and two workers launched as torchrun
    launches one, without HEMIOLA_JOB_TOKEN. Rank 3 is a stranger on the
    machine (run as another user when the test runs as root). The real worker 1
    (rank 2) joins only after the stranger has tried its place."""
    os.environ.pop("HEMIOLA_JOB_TOKEN", None)
    if rank == 3:
        return _stranger(options)
    os.environ["WORLD_SIZE"] = "3"  # the job proper; the stranger is not one of its ranks
    if rank == 2:
        _store().wait(["test/stranger_done"])
    return ps_workers.train(rank, 3, options, "mlp", "sgd", 3)


def _wide_model() -> Any:
    """A model whose first weight is one key of 1 MiB (the default partition)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 5))


def unread_pulls_job(rank: int, world: int, options: dict[str, Any], pulls: int
                     ) -> dict[str, Any] | None:
    """Rank 0 serves (reporting how much its peak memory grew while serving),
    rank 1 (worker 0) trains a model with a 1 MiB key, rank 2 (worker 1,
    holding the job token) asks for `pulls` copies of that key and reads none."""
    import torch

    if rank == 0:
        before = _peak_rss_mb()
        served = _server(hemiola.ps.PSConfig.from_kwargs(**options))
        return {**served, "peak_rss_growth_mb": _peak_rss_mb() - before}
    store = _store()
    if rank == 1:
        from models import make_optimizer

        m = _wide_model()
        model, opt = hemiola.ps.wrap(m, make_optimizer("sgd", m.parameters()), **options)
        losses = []
        for _ in range(10):
            x, y = torch.randn(8, 512), torch.randint(0, 5, (8,))
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        store.wait(["test/greedy_done"])  # train on while the greedy one is dropped
        model.close()
        return {"losses": losses}
    store.wait(["ps/s0/address"])
    host, port = store.get("ps/s0/address").decode().rsplit(" ", 1)
    token = os.environ["HEMIOLA_JOB_TOKEN"]
    table, shards = registration(_wide_model(), options)
    largest = max(shards, key=lambda s: s["count"])
    requests = b"".join(header(PULL, seq=i, worker=1, key=largest["key"])
                        for i in range(2, pulls + 2))
    out: dict[str, Any] = {"reply_bytes": 4 * largest["count"]}
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(header(HELLO, worker=1, payload_bytes=len(token)) + token.encode())
        assert read_message(s) == (WELCOME, b"")
        s.sendall(header(REGISTER, seq=0, worker=1, aux=ASP, payload_bytes=len(table)) + table
                  + header(PULL, seq=1, worker=1, key=largest["key"]))
        while (reply := read_message(s)) is not None and reply[0] != PULL_REPLY:  # initialised
            assert reply[0] in (REGISTERED, PING), reply
        started = time.monotonic()
        with contextlib.suppress(OSError):  # the server may drop it while it sends
            s.sendall(requests)
        # Wait, reading nothing, until the server closes the connection.
        poll = select.poll()
        poll.register(s, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        out["dropped"] = bool(poll.poll(30_000))
        out["dropped_after_s"] = time.monotonic() - started
    store.set("test/greedy_done", "1")
    return out


def settings_jobs(rank: int, world: int) -> dict[str, Any]:
    """Two bsp jobs of one server and two workers, one after the other in the
    same processes (each under its own store prefix), training the MLP with
    SGD: "mismatch", workers at learning rates 0.05 and 0.5; "nan", both at
    0.05 and worker 1 setting its rate to NaN before step 2. Returns each
    job's error on this rank (None: none) and when it came."""
    import hemiola.ps.roles

    out: dict[str, Any] = {}
    for name, lrs, nan_at in (("mismatch", (0.05, 0.5), None), ("nan", (0.05, 0.05), 2)):
        hemiola.ps.roles.PS_PREFIX = f"hemiola/ps-{name}"
        started = time.monotonic()
        try:
            _settings_job(lrs, nan_at)
            out[name] = {"error": None}
        except Exception as e:  # noqa: BLE001 - the error is the result
            out[name] = {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - started}
    return out


def _settings_job(lrs: tuple[float, float], nan_at: int | None) -> None:
    import torch

    from models import make_batch, make_model

    config = hemiola.ps.PSConfig(consistency="bsp", num_servers=1, timeout_s=20)
    if ps_workers.server_or_none(config) is not None:
        return
    r = hemiola.ps.role(1)
    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.ps.wrap(m, torch.optim.SGD(m.parameters(), lr=lrs[r.worker_index]),
                                 config)
    for step in range(4):
        if step == nan_at and r.worker_index == 1:
            opt.param_groups[0]["lr"] = float("nan")
        x, y = make_batch("mlp", step, r.worker_index, r.num_workers)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.close()

"""A rate-limited network of Linux network namespaces on this one machine.

    with Network(2, rate="1gbit") as net:
        proc = net.popen(0, [sys.executable, "-c", "..."], env={"RANK": "0"})
        outputs = net.run_ranks([sys.executable, "-m", "mymodule"], port=29500, timeout_s=600)

creates, for each of the N ranks, a namespace ``hemiola-bench-<tag>-<i>``
holding one end of a veth pair (``net.ifaces[i]``, address ``net.addrs[i]`` in
10.233.0.0/24, and ``lo`` up); the other ends are enslaved to a bridge in a
namespace of its own, ``hemiola-bench-<tag>-br``. Both ends of every pair get
``tc qdisc ... root tbf rate <rate> burst 256kb latency 50ms``, so each rank
sends and receives at most ``rate``. Nothing is created in the root namespace,
and the namespaces have no route out: traffic only ever reaches the addresses
of the namespaces created here.

Everything is removed on exit, also on exceptions and KeyboardInterrupt:
processes started with :meth:`Network.popen` are killed first, then the
namespaces (and with them their interfaces) are deleted. Needs root and
iproute2's ``ip`` and ``tc``. :class:`Loopback` runs the same ranks on this
machine's loopback, with no limit and no root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

PREFIX = "hemiola-bench-"
SUBNET = "10.233.0"  # a private /24; rank i has SUBNET.(i + 1)


class NetlabError(RuntimeError):
    """Setting up the namespaces failed, or this process may not do it."""


def available() -> str | None:
    """None when namespaces can be created here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root or with sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}probe-{uuid.uuid4().hex[:6]}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise NetlabError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")


class Network:
    """N namespaces joined by a bridge through rate-limited veth pairs.

    Attributes (valid inside the ``with`` block):
        namespaces: the rank namespaces, ``hemiola-bench-<tag>-<i>``.
        ifaces: the rank end of each veth pair (inside its namespace); set
            ``GLOO_SOCKET_IFNAME`` to it.
        addrs: the IPv4 address of each rank namespace.
        bridge_namespace: the namespace that holds the bridge.
    """

    def __init__(self, n: int, rate: str = "1gbit") -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"between 1 and 250 namespaces, got {n}")
        self.n = n
        self.rate = rate
        self.tag = uuid.uuid4().hex[:6]
        self.namespaces = [f"{PREFIX}{self.tag}-{i}" for i in range(n)]
        self.bridge_namespace = f"{PREFIX}{self.tag}-br"
        # Interface names are per namespace and at most 15 characters.
        self.ifaces = [f"hb{self.tag}r{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> Network:
        reason = available()
        if reason is not None:
            raise NetlabError(reason)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _create(self) -> None:
        br, bridge = self.bridge_namespace, f"hb{self.tag}br"
        _run("ip", "netns", "add", br)
        self._created.append(br)
        _run("ip", "-n", br, "link", "add", bridge, "type", "bridge")
        _run("ip", "-n", br, "link", "set", bridge, "up")
        tbf = ["root", "tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
        for i, (ns, iface, addr) in enumerate(zip(self.namespaces, self.ifaces, self.addrs)):
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
            port = f"hb{self.tag}p{i}"  # the bridge end
            _run("ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", iface,
                 "netns", ns)
            _run("ip", "-n", br, "link", "set", port, "master", bridge)
            _run("ip", "-n", br, "link", "set", port, "up")
            _run("ip", "netns", "exec", br, "tc", "qdisc", "add", "dev", port, *tbf)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            _run("ip", "-n", ns, "link", "set", iface, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, *tbf)

    def popen(self, i: int, command: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[str]:
        """Starts `command` inside namespace `i` (text mode).

        `env` is added to this process's environment. Other keyword arguments
        go to :class:`subprocess.Popen` (e.g. ``stdout=subprocess.PIPE``). The
        process is killed when the network is closed, if it still runs.
        """
        full_env = {**os.environ, **(env or {})}
        proc: subprocess.Popen[str] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.namespaces[i], *command], env=full_env, text=True,
            **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, i: int, command: Sequence[str], env: Mapping[str, str] | None = None,
            timeout_s: float | None = None) -> subprocess.CompletedProcess[str]:
        """Runs `command` inside namespace `i` to completion, capturing its output."""
        proc = self.popen(i, command, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def run_ranks(self, command: Sequence[str], port: int, timeout_s: float,
                  env: Mapping[str, str] | None = None) -> list[str]:
        """Runs `command` once per namespace as the ranks of one job (rank i in
        namespace i, MASTER_ADDR rank 0's address, GLOO_SOCKET_IFNAME its veth,
        and `env` added to every rank's environment); see :func:`run_ranks`."""
        return run_ranks(
            lambda rank, rank_env, **kw: self.popen(rank, command, env={**(env or {}), **rank_env},
                                                    **kw),
            self.n, self.addrs[0], self.ifaces, port, timeout_s)

    def close(self) -> None:
        """Kills the processes started here and deletes every namespace (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._procs.clear()
        # Deleting a namespace deletes the interfaces in it; a veth pair goes
        # when either end does.
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created.clear()


class Loopback:
    """N ranks on this machine's loopback (``lo``), no rate limit, no root:
    :class:`Network`'s ``run_ranks`` for the unlimited case."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rate = "none"

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def run_ranks(self, command: Sequence[str], port: int, timeout_s: float) -> list[str]:
        """Runs `command` once per rank on loopback; see :func:`run_ranks`."""
        def start(rank: int, env: Mapping[str, str], **kwargs: Any) -> subprocess.Popen[str]:
            return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
                list(command), env={**os.environ, **env}, text=True, **kwargs)

        return run_ranks(start, self.n, "127.0.0.1", ["lo"] * self.n, port, timeout_s)


def run_ranks(start: Callable[..., subprocess.Popen[str]], n: int, master: str,
              ifaces: Sequence[str], port: int, timeout_s: float) -> list[str]:
    """Starts `n` ranks of one job with ``start(rank, env, stdout=..., stderr=...)``
    and returns each rank's output (stdout and stderr).

    Each rank gets RANK, WORLD_SIZE, MASTER_ADDR=`master`, MASTER_PORT=`port`,
    GLOO_SOCKET_IFNAME (``ifaces[rank]``) and OMP_NUM_THREADS=1. Raises
    RuntimeError with the output's end as soon as a rank fails, or when one
    still runs after `timeout_s`; the other ranks are killed then.
    """
    logs = [tempfile.TemporaryFile("w+") for _ in range(n)]
    procs: list[subprocess.Popen[str]] = []

    def output(rank: int) -> str:
        logs[rank].seek(0)
        return logs[rank].read()

    try:
        for rank in range(n):
            env = {"RANK": str(rank), "WORLD_SIZE": str(n), "MASTER_ADDR": master,
                   "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": ifaces[rank],
                   "OMP_NUM_THREADS": "1"}
            procs.append(start(rank, env, stdout=logs[rank], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                rank = failed[0] if failed else 0
                raise RuntimeError(f"rank {rank} " + (f"exited with {procs[rank].returncode}"
                                   if failed else f"still running after {timeout_s} s")
                                   + f"; its output ends:\n{output(rank)[-4000:]}")
            time.sleep(0.2)
        for rank, proc in enumerate(procs):
            if proc.returncode != 0:
                raise RuntimeError(f"rank {rank} exited with {proc.returncode}:\n"
                                   f"{output(rank)[-4000:]}")
        return [output(rank) for rank in range(n)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def leftovers() -> list[str]:
    """Namespaces named ``hemiola-bench-*`` that exist now (for checks after cleanup)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


#: How a rank reports its result on stdout: the tag, then one line of JSON.
RESULT_TAG = "RESULT "


def print_result(result: Any) -> None:
    """Reports `result` (JSON-able) from inside a rank (see :func:`parse_result`)."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def rank_main(worker: Callable[[Any], Any], suite: str, flag: str = "--worker") -> None:
    """A suite module's entry point as one of its ranks (``python -m MODULE
    FLAG JSON``): runs `worker` on the JSON configuration, reports its result
    (:func:`print_result`) and takes torch's process group down, whose Gloo
    thread must not outlive the interpreter. Run any other way, it says to
    run ``hemiola bench SUITE`` instead."""
    if len(sys.argv) != 3 or sys.argv[1] != flag:
        sys.exit(f"run `hemiola bench {suite}` (this module's entry point is for its ranks)")
    print_result(worker(json.loads(sys.argv[2])))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def parse_result(output: str) -> Any:
    """The last result a rank reported in `output` (one of ``run_ranks``' outputs)."""
    lines = [line for line in output.splitlines() if line.startswith(RESULT_TAG)]
    if not lines:
        raise RuntimeError(f"the rank reported no result; its output ends:\n{output[-4000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])

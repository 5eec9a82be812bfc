"""Run a function on N local processes the way ``torchrun`` would.

A thin convenience for demos, benchmarks and tests on one machine; real jobs
use ``torchrun``. The parent hosts the rendezvous TCPStore (like torchrun's
agent), so killing any rank, rank 0 included, never takes the store down.
Each rank gets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; its return value
(or its traceback) comes back to the parent.

Ranks start from a fork server that has imported torch and hemiola once, so a
launch costs tens of milliseconds instead of every rank importing torch again
(about 3 s on a 2-core machine). A forked rank is as fresh as a spawned one:
the server runs nothing but the imports (no torch op, so no OpenMP pool to
inherit), each rank gets the launching process's current environment, not
the server's, and ``fn`` and ``__main__`` are prepared exactly as under spawn
(``fn`` must be importable; a script needs ``if __name__ == "__main__":``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import secrets
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What the fork server imports before it forks its first rank.
_PRELOAD = ["torch", "torch.distributed", "hemiola"]


def _context() -> Any:
    """The fork server's context (torch and hemiola preloaded), or spawn where
    a platform has no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Takes effect when the server starts (the first launch); later calls are no-ops.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(fn: Callable[..., Any], rank: int, world: int, port: int,
           launcher_env: dict[str, str], env: dict[str, str], args: tuple[Any, ...],
           results: Any) -> None:
    # The launcher's environment as it is now (a forked rank would otherwise
    # inherit the fork server's, frozen at its start), then the rank's own.
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1",
    )
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    try:
        # Plain pickle copies tensors into bytes; the queue's own pickler would
        # share their memory, which vanishes when this process exits.
        results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except SystemExit as e:
        # A clean sys.exit() (e.g. a parameter server that finished serving) is a result.
        if e.code in (None, 0):
            results.put((rank, "ok", pickle.dumps(None)))
        else:
            results.put((rank, "error", f"SystemExit({e.code!r})"))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        _shut_down_process_group()


def _shut_down_process_group() -> None:
    """Tears torch's process group down before the interpreter exits: its
    Gloo worker thread may otherwise still release Python objects while the
    interpreter is finalising, which aborts the process."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a dead peer must not turn success into failure
            pass


class RankFailure(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank to its traceback."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        super().__init__("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))


def run_local(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0,
              env: dict[str, str] | None = None, expect_errors: bool = False,
              ) -> dict[int, Any]:
    """Runs ``fn(rank, world, *args)`` on `world` local processes.

    `fn` must be importable (a module-level function). Returns ``{rank: result}``.
    The ranks share a random ``HEMIOLA_JOB_TOKEN`` (the parameter server's
    admission secret) unless the environment or `env` sets one.
    Raises :class:`RankFailure` with every failed rank's traceback if any rank
    raised or died, unless `expect_errors`, which returns
    ``{rank: ("ok", result) or ("error", text)}`` instead. A rank still running
    after `timeout_s` is killed and reported as hung: never a silent hang.
    """
    ctx = _context()
    port = free_port()
    # A parameter server admits only ranks that present the job's token: a
    # local job gets a fresh random one unless the caller chose one.
    from hemiola.ps.roles import JOB_TOKEN_ENV

    if JOB_TOKEN_ENV not in os.environ and JOB_TOKEN_ENV not in (env or {}):
        env = {JOB_TOKEN_ENV: secrets.token_hex(16), **(env or {})}
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child,
                    args=(fn, r, world, port, dict(os.environ), env or {}, args, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcome) < world and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.2)
            outcome[rank] = (status, pickle.loads(value) if status == "ok" else value)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for r, p in enumerate(procs):
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            outcome.setdefault(r, ("error", f"rank {r} hung: still running after {timeout_s} s"))
        elif r not in outcome:
            outcome[r] = ("error", f"rank {r} exited with code {p.exitcode} without a result")
    del store
    if expect_errors:
        return outcome
    errors = {r: v for r, (s, v) in outcome.items() if s != "ok"}
    if errors:
        raise RankFailure(errors)
    return {r: v for r, (_, v) in outcome.items()}

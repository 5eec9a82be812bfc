"""Fits torch's CPU threads to the ranks that share a host, as torchrun does.

A script started with ``mp.spawn`` (not torchrun) keeps torch's default of one
thread per core in every rank, so R ranks on C cores run R x C compute
threads. Idle OpenMP threads spin before they sleep; on cores shared with
another rank they take the core from that rank's computation and from the
engine's communication thread. Measured (2 ranks, 2 cores, the MNIST CNN of
torch's examples, fp16 on the wire): torch DDP 143 ms per iteration, hemiola
``wfbp`` 212 ms, the bare model alone 175-372 ms; with one thread per rank,
or with ``OMP_WAIT_POLICY=PASSIVE``, hemiola and DDP are within noise of each
other and both faster. torchrun sets ``OMP_NUM_THREADS=1`` for that reason.
"""

from __future__ import annotations

import hashlib
import os
import socket
import warnings

import torch

from hemiola._native import C
from hemiola.engine_tensors import all_gather_rows


def host_id() -> int:
    """A 63-bit identity of this host's kernel: the same for every process
    that shares its cores (network namespaces and containers included)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            name = f.read().strip()
    except OSError:
        name = socket.gethostname()
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def ranks_on_this_host(engine: C.Engine) -> int:
    """Collective: how many of the job's ranks run on this rank's host."""
    if engine.world_size == 1:
        return 1
    mine = host_id()
    hosts = all_gather_rows(engine, torch.tensor([mine], dtype=torch.int64))[:, 0]
    return int((hosts == mine).sum().item())


def fit_threads(engine: C.Engine) -> None:
    """Collective: when this host's ranks would run more compute threads
    than it has cores and nobody chose a number (``OMP_NUM_THREADS`` unset),
    gives each rank its share of the cores and says so once."""
    local = ranks_on_this_host(engine)
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    share = max(1, cores // local)
    if local < 2 or local * threads <= cores or threads <= share or "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(share)
    if engine.rank == 0:
        warnings.warn(
            f"hemiola.wrap: {local} ranks share this host's {cores} cores and torch gave each "
            f"{threads} threads (OMP_NUM_THREADS is unset, as under mp.spawn); their idle "
            "threads would spin on each other's cores and slow both the model and the "
            f"communication. Each rank now uses {share} (torchrun does the same); set "
            "OMP_NUM_THREADS to choose yourself.", stacklevel=3)

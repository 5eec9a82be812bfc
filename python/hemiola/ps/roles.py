"""Who is who in a parameter-server job launched by torchrun.

Ranks ``0 .. num_servers-1`` are servers; rank ``num_servers + i`` is worker
*i*. Every rank finds the others through torchrun's rendezvous store; the
servers and workers then talk over their own TCP connections.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from hemiola._native import C
from hemiola.distributed import TorchStore, bind_interface


@dataclass(frozen=True)
class Role:
    """This process's place in the job."""

    rank: int
    world_size: int
    num_servers: int

    @property
    def is_server(self) -> bool:
        return self.rank < self.num_servers

    @property
    def num_workers(self) -> int:
        return self.world_size - self.num_servers

    @property
    def server_index(self) -> int:
        return self.rank

    @property
    def worker_index(self) -> int:
        return self.rank - self.num_servers


def role(num_servers: int) -> Role:
    """This process's role, from torchrun's ``RANK`` and ``WORLD_SIZE``."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "hemiola.ps needs a launcher: run the script under torchrun (or "
            "hemiola.launch.run_local) with num_servers servers plus at least one worker")
    r = Role(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), num_servers)
    if r.num_workers < 1:
        raise ValueError(f"world size {r.world_size} leaves no workers after {num_servers} "
                         "server(s): launch more processes or use fewer servers")
    return r


#: The job's shared secret, when a launcher or the user sets it (the same on
#: every rank); without it a job on one machine makes its own
#: (:func:`hemiola.ps.job_token.job_token`).
JOB_TOKEN_ENV = "HEMIOLA_JOB_TOKEN"


#: Where hemiola.ps keeps what it shares in the job's rendezvous store.
PS_PREFIX = "hemiola/ps"
#: The key (under PS_PREFIX) where servers publish their consistency model,
#: for what workers build before they wrap (SharedBatchSampler).
CONSISTENCY_KEY = "consistency"


def ps_store(timeout_s: float) -> dist.Store:
    """The job's rendezvous store under :data:`PS_PREFIX`: the default process
    group's store, else a client of torchrun's (rank 0, always a server, hosts
    it without an agent)."""
    import datetime

    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    else:
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    return dist.PrefixStore(PS_PREFIX, store)


def rendezvous_store(timeout_s: float) -> tuple[C.Store, str, str]:
    """The job's store (prefixed for hemiola.ps), the interface to bind and the
    master address. Binds the interface that routes to ``MASTER_ADDR`` unless
    ``GLOO_SOCKET_IFNAME`` says otherwise."""
    master = os.environ.get("MASTER_ADDR", "")
    return TorchStore(ps_store(timeout_s)), bind_interface(master), master


def worker_group(r: Role, timeout_s: float) -> dist.ProcessGroupGloo:
    """A Gloo process group of the job's workers alone (rank = worker index),
    for what all-reduce users do beside training: averaging a metric, a
    barrier. The servers are not in it, so it never waits for them.

    Every worker must call it, the same number of times: the n-th call on each
    worker joins the n-th group. torch's ``new_group`` cannot make it (every
    rank of the default group, servers included, would have to call that), so
    it is not registered with torch: ``dist.all_reduce``, ``dist.all_gather``
    and ``dist.barrier`` take it as ``group=``; calls that translate a global
    rank (``dist.broadcast(t, src, group=...)``, ``dist.get_rank(group)``)
    refuse it: use ``group.broadcast(t, root).wait()`` and the worker index."""
    import datetime

    if r.is_server:
        raise RuntimeError(f"rank {r.rank} is a server: only workers join the workers' group")
    store = ps_store(timeout_s)
    calls = store.add(f"worker_group_calls/{r.worker_index}", 1)
    iface = bind_interface(os.environ.get("MASTER_ADDR", ""))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface
                        else dist.ProcessGroupGloo.create_default_device()]
    prefixed = dist.PrefixStore(f"workers/{calls}", store)
    return dist.ProcessGroupGloo(prefixed, r.worker_index, r.num_workers, options)

"""Process-group set-up: from torchrun's environment to a hemiola engine."""

from __future__ import annotations

import atexit
import datetime
import itertools
import os

import torch.distributed as dist

from hemiola._native import C
from hemiola.config import check_timeout_s

_engine_ids = itertools.count()


class TorchStore(C.Store):
    """Adapts a ``torch.distributed.Store`` (e.g. torchrun's TCPStore) to the engine."""

    def __init__(self, store: dist.Store) -> None:
        super().__init__()
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            self._store.wait([key], datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # torch raises DistStoreError / RuntimeError
            raise TimeoutError(f"store key {key!r} not set within {timeout_s:.1f} s: {e}") from e
        return self._store.get(key)

    def check(self, key: str) -> bool:
        return bool(self._store.check([key]))


def init(timeout_s: float = 300.0) -> None:
    """Initialises ``torch.distributed`` if it is not initialised yet.

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set) this joins the launcher's rendezvous, so multi-node
    launches just work. Unless ``GLOO_SOCKET_IFNAME`` is set, it is set to the
    interface that routes to ``MASTER_ADDR``, for torch's Gloo and hemiola's
    alike. Without those variables it starts a single-process
    group, so a script also runs alone. A group created here is destroyed at
    exit. hemiola's engines rendezvous through
    the default group's store; their collectives use hemiola's own Gloo
    connections, not the process group.
    """
    check_timeout_s("hemiola.init's timeout_s", timeout_s)
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            # torch's Gloo binds the address the host name resolves to, which
            # peers may not reach (containers, network namespaces). Bind the
            # interface that routes to the master, as hemiola's engine does.
            iface = C.interface_reaching(os.environ["MASTER_ADDR"])
            if iface:
                os.environ["GLOO_SOCKET_IFNAME"] = iface
        dist.init_process_group(backend="gloo", timeout=timeout)
    else:
        # One process: an in-memory store, so nothing is left on disk.
        dist.init_process_group(
            backend="gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    # We created the group, so we also take it down at exit: torch's Gloo
    # worker thread must not outlive the interpreter (it can abort the process
    # at shutdown when a script ends without destroy_process_group()).
    atexit.register(destroy_process_group_if_initialized)


def destroy_process_group_if_initialized() -> None:
    """Takes the default process group down, if there is one (registered with
    atexit by whoever created it: torch's Gloo thread must not outlive the
    interpreter)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def bind_interface(master_addr: str) -> str:
    """The network interface hemiola's Gloo binds: the first of
    ``GLOO_SOCKET_IFNAME``, else the one that routes to `master_addr` ('' when
    none is known: the engine then binds the address that routes there)."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if not iface and master_addr:
        iface = C.interface_reaching(master_addr)
    return iface


def new_engine(timeout_s: float, timeline: bool = False,
               gpu_backend: str = "auto") -> tuple[C.Engine, C.Store]:
    """Creates an engine for the default process group (a collective call).

    Returns the engine and the (prefixed) store it rendezvoused through.
    """
    init(timeout_s)
    return _engine(f"hemiola/engine{next(_engine_ids)}", dist.get_rank(),
                   dist.get_world_size(), timeout_s, timeline, gpu_backend)


def new_subgroup_engines(size: int, timeout_s: float, timeline: bool = False,
                         gpu_backend: str = "auto") -> tuple[C.Engine, C.Store, C.Engine,
                                                             C.Store]:
    """Cuts the default process group into groups of `size` consecutive
    ranks (torchrun numbers a node's ranks consecutively) and creates two
    engines on every rank (a collective call): one over its group (its rank
    there: ``rank % size``), and one across the groups, over the ranks of
    the same place in every group (its rank there: ``rank // size``).

    Returns ``(group engine, its store, across engine, its store)``.
    """
    init(timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    if size < 1 or world % size:
        raise ValueError(f"groups of {size} ranks do not divide the {world} ranks")
    # Every rank draws both ids, so the n-th engine keeps the same prefix
    # everywhere; the group's number keeps the groups' keys apart.
    group_id, across_id = next(_engine_ids), next(_engine_ids)
    group, place = divmod(rank, size)
    inside = _engine(f"hemiola/engine{group_id}/group{group}", place, size, timeout_s,
                     timeline, gpu_backend)
    across = _engine(f"hemiola/engine{across_id}/place{place}", group, world // size,
                     timeout_s, timeline, gpu_backend)
    return (*inside, *across)


def _engine(prefix: str, rank: int, world: int, timeout_s: float, timeline: bool,
            gpu_backend: str) -> tuple[C.Engine, C.Store]:
    store = dist.distributed_c10d._get_default_store()
    engine_store = TorchStore(dist.PrefixStore(prefix, store))
    return engine_over(engine_store, os.environ.get("MASTER_ADDR", ""), rank, world, timeout_s,
                       timeline, gpu_backend), engine_store


def engine_over(store: C.Store, master: str, rank: int, world: int, timeout_s: float,
                timeline: bool = False, gpu_backend: str = "auto",
                diagnose_failures: bool = True) -> C.Engine:
    """An engine of `world` ranks that rendezvous through `store` (a
    collective call); `master`: an address every rank reaches, to pick the
    interface to bind. `diagnose_failures`: name the missing ranks after a
    transport failure (a wait of up to min(timeout_s, 10) s)."""
    return C.Engine(
        rank=rank,
        world_size=world,
        store=store,
        iface=bind_interface(master),
        master_addr=master,
        timeout_s=timeout_s,
        timeline=timeline,
        gpu_backend=gpu_backend,
        staged_chunk_bytes=staged_chunk_bytes(),
        gloo_stripes=gloo_stripes(),
        diagnose_failures=diagnose_failures,
    )


#: The largest HEMIOLA_STAGED_CHUNK_MB: 1 TiB, above any bucket.
_MAX_CHUNK_MB = 1 << 20


def staged_chunk_bytes() -> int:
    """``HEMIOLA_STAGED_CHUNK_MB``: the Gloo backend with CUDA tensors
    pipelines each reduction in chunks of this many MiB through three pinned
    stages (EngineOptions::staged_chunk_bytes; unset or 0: staged whole).
    Experimental until it has run on a GPU (docs/gpu.md); set it alike on
    every rank, as a launcher's environment is."""
    raw = os.environ.get("HEMIOLA_STAGED_CHUNK_MB", "").strip()
    if not raw:
        return 0
    try:
        mib = float(raw)
    except ValueError:
        raise ValueError(f"HEMIOLA_STAGED_CHUNK_MB={raw!r} is not a number of MiB") from None
    if mib < 0:
        raise ValueError(f"HEMIOLA_STAGED_CHUNK_MB={raw!r} is negative")
    if not mib <= _MAX_CHUNK_MB:  # NaN and infinity too
        raise ValueError(f"HEMIOLA_STAGED_CHUNK_MB={raw!r} must be a finite number of MiB, at "
                         f"most {_MAX_CHUNK_MB} (1 TiB)")
    return int(mib * (1 << 20))


def gloo_stripes() -> int:
    """``HEMIOLA_GLOO_STRIPES``: how many Gloo connections one large
    all-reduce is split across, its parts on the wire at once
    (EngineOptions::gloo_stripes; unset: 1). Experimental until measured on a
    GPU machine (docs/gpu.md); set it alike on every rank, as a launcher's
    environment is (the engine refuses a mismatch when it connects)."""
    raw = os.environ.get("HEMIOLA_GLOO_STRIPES", "").strip()
    if not raw:
        return 1
    try:
        stripes = int(raw)
    except ValueError:
        raise ValueError(f"HEMIOLA_GLOO_STRIPES={raw!r} is not a whole number") from None
    if not 1 <= stripes <= 16:
        raise ValueError(f"HEMIOLA_GLOO_STRIPES={raw!r} must be between 1 and 16")
    return stripes

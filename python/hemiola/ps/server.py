"""Running a parameter server (a server rank's whole life)."""

from __future__ import annotations

import logging
import os
import time

from hemiola._native import C
from hemiola.ps.config import PSConfig
from hemiola.ps.job_token import job_token
from hemiola.ps.roles import CONSISTENCY_KEY, Role, rendezvous_store, role

log = logging.getLogger("hemiola.ps")


def serve(config: PSConfig, server_role: Role | None = None) -> C.ps.ServerStats:
    """Serves this rank's shards until every worker has finished.

    Raises ``HemiolaTimeoutError`` when a ``bsp`` job cannot go on (a worker
    died or stalled; the message names it) and ``ValueError`` when workers
    registered different models.
    """
    r = server_role or role(config.num_servers)
    if not r.is_server:
        raise ValueError(f"rank {r.rank} is a worker, not a server")
    store, iface, master = rendezvous_store(config.timeout_s)
    if config.snapshot_dir:
        os.makedirs(config.snapshot_dir, exist_ok=True)
    started = time.monotonic()
    with job_token(r, store, config.timeout_s) as token:
        server = C.ps.Server(
            server_index=r.server_index, num_servers=r.num_servers, num_workers=r.num_workers,
            consistency=config.consistency, staleness_bound=config.staleness_bound,
            timeout_s=config.timeout_s, store=store, snapshot_path=config.snapshot_path(r.rank),
            restore=config.restore, snapshot_every_s=config.snapshot_every_s, iface=iface,
            master_addr=master, token=token, check_finite=config.check_finite)
        log.info("server %d/%d: %s, %d workers", r.server_index, r.num_servers,
                 config.consistency, r.num_workers)
        store.set(CONSISTENCY_KEY, config.consistency.encode())
        server.serve()
    stats = server.stats()
    log.info("server %d done in %.1f s: %d pushes applied, %d pulls answered, %d rejected, "
             "%d connections refused", r.server_index, time.monotonic() - started,
             stats.pushes_applied, stats.pulls_answered, stats.rejected, stats.refused)
    return stats

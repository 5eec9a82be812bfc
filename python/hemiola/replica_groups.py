"""Replica groups of ``schedule="streaming"`` (``Config.replica_ranks``).

Across sites a replica is a node of several GPUs, not one process. Its ranks
average their gradients every inner step as ``wfbp`` does, over the fast
link inside the node, so they hold the same parameters; between replicas
only the outer sync travels, and each rank of a group carries 1/L of every
fragment (engine/streaming/fragment_averager.h), so a group puts one
fragment's bytes on the slow link however many ranks it holds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("hemiola")


def replica_ranks(requested: int | None, world: int,
                  env: Mapping[str, str] = os.environ) -> int:
    """How many consecutive ranks make one replica.

    `requested`: ``Config.replica_ranks``. None picks the ranks of one node
    (torchrun's ``LOCAL_WORLD_SIZE``) when the run spans several nodes, else
    1: on one node every rank is a replica of its own, so a script tried on
    one machine syncs as it will across sites.
    """
    if requested is None:
        local = env.get("LOCAL_WORLD_SIZE", "")
        nodes_share = local.isdigit() and 0 < int(local) < world and world % int(local) == 0
        chosen = int(local) if nodes_share else 1
        if chosen > 1:
            log.info("streaming: replicas of %d ranks (one node each, LOCAL_WORLD_SIZE), %d "
                     "replicas", chosen, world // chosen)
        return chosen
    if world % requested:
        raise ValueError(f"replica_ranks={requested} does not divide the {world} ranks: every "
                         "replica needs the same number of ranks (torchrun starts the same "
                         "--nproc_per_node on every node)")
    if requested == world and world > 1:
        raise ValueError(f"replica_ranks={requested} makes all {world} ranks one replica, with "
                         "no other to average with: use schedule='wfbp' inside one site, or "
                         "fewer ranks per replica")
    return requested

"""Parameter-server training: servers hold the parameters and optimizer state
(sharded by key); workers push gradients per tensor as backward produces them
and pull parameters per module as forward needs them.

Launch ``num_servers + N`` processes with torchrun; the first ``num_servers``
ranks serve::

    model, optimizer = hemiola.ps.wrap(model, optimizer, consistency="eager", num_servers=1)

On a server rank, :func:`wrap` serves until the workers are done and then
exits the process (``SystemExit(0)``); use :func:`role` and :func:`serve` to
control that yourself, or run servers with ``hemiola ps-server``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hemiola.ps.config import CONSISTENCIES, MOMENTUM_RULES, STALENESS_RULES, PSConfig
from hemiola.ps.roles import Role
from hemiola.ps.roles import role as _role
from hemiola.ps.roles import worker_group as _worker_group
from hemiola.ps.sampler import SharedBatchSampler
from hemiola.ps.server import serve
from hemiola.ps.worker import ParameterServerModel

__all__ = ["CONSISTENCIES", "MOMENTUM_RULES", "STALENESS_RULES", "PSConfig",
           "ParameterServerModel", "Role", "SharedBatchSampler", "role", "serve", "worker_group",
           "wrap"]


def role(num_servers: int = 1) -> Role:
    """This process's role in a job whose first `num_servers` ranks are servers."""
    return _role(num_servers)


def worker_group(num_servers: int = 1, timeout_s: float = 300.0) -> dist.ProcessGroupGloo:
    """The workers' own Gloo process group (rank = worker index; the servers
    are not in it), for what all-reduce scripts do beside training: average a
    metric (``dist.all_reduce(t, group=group)``, as BytePS's ``push_pull`` or
    Horovod's ``allreduce``), ``dist.all_gather``, ``dist.barrier``; broadcast
    with ``group.broadcast(t, root).wait()`` (torch's ``dist.broadcast`` refuses
    a group it did not create). Every worker calls it, the same number of
    times; a server rank gets a RuntimeError."""
    return _worker_group(_role(num_servers), timeout_s)


def wrap(module: nn.Module, optimizer: torch.optim.Optimizer, config: PSConfig | None = None,
         **options: Any) -> tuple[ParameterServerModel, torch.optim.Optimizer]:
    """Trains `module` with `optimizer`'s rule through parameter servers.

    Options are :class:`PSConfig` fields (``consistency``, ``num_servers``,
    ``staleness_bound``, ``staleness_rule``, ...). Returns the wrapped model and
    the same optimizer, whose ``step()`` now ends the iteration (the servers
    apply the update). On a server rank this serves and then exits.
    """
    cfg = config or PSConfig.from_kwargs(**options)
    if config is not None and options:
        raise ValueError("pass either config or keyword options, not both")
    r = _role(cfg.num_servers)
    if r.is_server:
        serve(cfg, r)
        sys.exit(0)
    return ParameterServerModel(module, optimizer, cfg, r), optimizer

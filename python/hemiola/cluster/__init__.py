"""Cluster scheduling of many training jobs under communication contention.

An event-driven simulator (C++ core, ``hemiola._C.cluster``) of a GPU cluster
in which every data-parallel job iterates forward -> backward -> all-reduce and
all-reduces contend at the nodes' network interfaces. Policies: placement
(first-fit, random, LWF-kappa), communication (SRSF(n), Ada-SRSF with AdaDUAL).
Workloads: the paper's synthetic workload or a Philly-format trace.
See ``docs/cluster.md``.
"""

from __future__ import annotations

from hemiola.cluster.api import SimulationSummary, make_jobs, run_jobs, simulate
from hemiola.cluster.compare import aggregate, compare, format_table
from hemiola.cluster.config import DEFAULT_TRACE, ClusterConfig, PolicyConfig, WorkloadConfig

__all__ = [
    "DEFAULT_TRACE",
    "ClusterConfig",
    "PolicyConfig",
    "SimulationSummary",
    "WorkloadConfig",
    "aggregate",
    "compare",
    "format_table",
    "make_jobs",
    "run_jobs",
    "simulate",
]

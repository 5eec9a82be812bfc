"""Python API of the cluster simulator: build inputs, run, summarise."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hemiola.cluster.config import ClusterConfig, PolicyConfig, WorkloadConfig


def native() -> Any:
    """The compiled ``hemiola._C.cluster`` module."""
    from hemiola import _C

    return _C.cluster


def make_cluster(config: ClusterConfig) -> Any:
    """A native ``ClusterSpec`` from a :class:`ClusterConfig`."""
    spec = native().ClusterSpec()
    spec.nodes = config.nodes
    spec.gpus_per_node = config.gpus_per_node
    spec.gpu_memory_mb = config.gpu_memory_mb
    spec.beta_ms_per_mb = config.beta_ms_per_mb
    spec.eta_ms_per_mb = config.eta_ms_per_mb
    return spec


def load_models(workload: WorkloadConfig) -> list[Any]:
    """The built-in models, or the user's models file."""
    if workload.models_path:
        return list(native().load_models_csv(workload.models_path))
    return list(native().builtin_models())


def make_jobs(workload: WorkloadConfig, cluster: ClusterConfig, models: list[Any]) -> list[Any]:
    """The job list of a workload (raises ValueError naming a bad row)."""
    c = native()
    if workload.kind == "paper":
        return list(
            c.paper_workload(
                jobs=workload.jobs,
                seed=workload.seed,
                num_models=len(models),
                arrival_window_ms=workload.arrival_window_ms,
            )
        )
    assert workload.trace_path is not None
    return list(
        c.load_trace(
            workload.trace_path,
            models,
            make_cluster(cluster),
            seed=workload.seed,
            first_row=workload.first_row,
            max_rows=-1 if workload.max_rows is None else workload.max_rows,
        )
    )


@dataclass
class SimulationSummary:
    """The outcome of one simulation run (times in milliseconds)."""

    placement: str
    comm: str
    fidelity: str
    job_order: str
    jobs: int
    mean_jct_ms: float
    median_jct_ms: float
    p99_jct_ms: float
    makespan_ms: float
    gpu_utilization: float
    events: int
    wall_s: float
    transfers: int = 0
    shared_transfer_starts: int = 0
    multi_node_jobs: int = 0
    mean_jct_multi_node_ms: float = 0.0
    jct_ms: list[float] = field(default_factory=list, repr=False)
    util_time_ms: list[float] = field(default_factory=list, repr=False)
    util_value: list[float] = field(default_factory=list, repr=False)

    def to_dict(self, with_series: bool = False) -> dict[str, Any]:
        """JSON-ready dict; per-job and time series only with ``with_series``."""
        d: dict[str, Any] = {
            "placement": self.placement,
            "comm": self.comm,
            "fidelity": self.fidelity,
            "job_order": self.job_order,
            "jobs": self.jobs,
            "mean_jct_ms": self.mean_jct_ms,
            "median_jct_ms": self.median_jct_ms,
            "p99_jct_ms": self.p99_jct_ms,
            "makespan_ms": self.makespan_ms,
            "gpu_utilization": self.gpu_utilization,
            "events": self.events,
            "wall_s": self.wall_s,
            "transfers": self.transfers,
            "shared_transfer_starts": self.shared_transfer_starts,
            "multi_node_jobs": self.multi_node_jobs,
            "mean_jct_multi_node_ms": self.mean_jct_multi_node_ms,
        }
        if with_series:
            d["jct_ms"] = self.jct_ms
            d["util_time_ms"] = self.util_time_ms
            d["util_value"] = self.util_value
        return d


def run_jobs(
    jobs: list[Any],
    models: list[Any],
    cluster: ClusterConfig,
    policy: PolicyConfig,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[SimulationSummary, Any]:
    """Simulate prepared native jobs; returns the summary and the native result.

    Ctrl-C raises ``KeyboardInterrupt`` within milliseconds, even deep in a long
    run. ``should_stop`` is asked every few milliseconds; when it returns True
    the run stops with ``hemiola._C.cluster.Interrupted`` (a ``RuntimeError``):
    the way to cancel a run from another thread, where signals do not arrive.
    """
    c = native()
    native_policy = c.PolicyConfig(
        policy.placement, policy.comm, policy.fidelity, policy.seed, policy.job_order
    )
    start = time.perf_counter()
    result = c.simulate(make_cluster(cluster), models, jobs, native_policy, should_stop)
    wall = time.perf_counter() - start
    multi = [j.jct_ms for j in result.jobs if j.multi_node]
    summary = SimulationSummary(
        placement=result.placement,
        comm=result.comm,
        fidelity=result.fidelity,
        job_order=result.job_order,
        jobs=len(jobs),
        mean_jct_ms=result.mean_jct_ms,
        median_jct_ms=result.median_jct_ms,
        p99_jct_ms=result.p99_jct_ms,
        makespan_ms=result.makespan_ms,
        gpu_utilization=result.gpu_utilization,
        events=result.events,
        wall_s=wall,
        transfers=result.transfers,
        shared_transfer_starts=result.shared_transfer_starts,
        multi_node_jobs=len(multi),
        mean_jct_multi_node_ms=sum(multi) / len(multi) if multi else 0.0,
        jct_ms=[j.jct_ms for j in result.jobs],
        util_time_ms=list(result.util_time_ms),
        util_value=list(result.util_value),
    )
    return summary, result


def simulate(
    workload: WorkloadConfig | None = None,
    cluster: ClusterConfig | None = None,
    policy: PolicyConfig | None = None,
) -> SimulationSummary:
    """Run one simulation.

    >>> s = simulate(WorkloadConfig(jobs=160, seed=1), ClusterConfig(), PolicyConfig())
    >>> s.mean_jct_ms  # doctest: +SKIP

    Raises ``ValueError`` with the offending row or field for invalid input
    (an empty workload included) and ``KeyboardInterrupt`` on Ctrl-C.
    """
    workload = workload or WorkloadConfig()
    cluster = cluster or ClusterConfig()
    policy = policy or PolicyConfig()
    models = load_models(workload)
    jobs = make_jobs(workload, cluster, models)
    summary, _ = run_jobs(jobs, models, cluster, policy)
    return summary

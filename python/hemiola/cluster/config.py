"""Configuration dataclasses for the cluster scheduling simulator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Where the Philly trace lives relative to the project root (it may be absent).
DEFAULT_TRACE = Path("../shared/data/traces/philly.csv")


@dataclass(frozen=True)
class ClusterConfig:
    """A cluster of ``nodes`` x ``gpus_per_node`` GPUs.

    Communication inside a node is free; transfers between nodes contend at
    each node's network interface: ``k`` transfers on the busiest interface a
    job spans each run at ``1 / (k*beta + (k-1)*eta)`` MB/ms. The defaults are
    the paper's 16 x 4 GPUs (32 GB) on 10 Gbit/s Ethernet.
    """

    nodes: int = 16
    gpus_per_node: int = 4
    gpu_memory_mb: float = 32768.0
    beta_ms_per_mb: float = 0.856
    eta_ms_per_mb: float = 0.235


@dataclass(frozen=True)
class WorkloadConfig:
    """Which jobs to simulate.

    ``kind="paper"``: the paper's seeded synthetic workload of ``jobs`` jobs
    arriving uniformly within ``arrival_window_ms`` (the paper: 12 s).
    ``kind="trace"``: rows of a Philly-format CSV (``trace_path``), optionally a
    slice (``first_row`` >= 0, ``max_rows`` >= 1 or None for all rows);
    ``seed`` picks each row's model. An empty selection is an error.
    ``models_path`` replaces the four built-in models with a CSV of
    ``name,size_mb,forward_ms,backward_ms,memory_mb``.
    """

    kind: str = "paper"
    jobs: int = 160
    seed: int = 0
    arrival_window_ms: float = 12000.0
    trace_path: str | None = None
    first_row: int = 0
    max_rows: int | None = None
    models_path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("paper", "trace"):
            raise ValueError(f"workload kind must be 'paper' or 'trace', got {self.kind!r}")
        if self.kind == "trace" and not self.trace_path:
            raise ValueError("a trace workload needs trace_path")
        # An empty workload would "succeed" with every metric zero: refuse it.
        if self.jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {self.jobs}")
        if self.first_row < 0:
            raise ValueError(f"first_row must be >= 0, got {self.first_row}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 (or None for all rows), got {self.max_rows}")
        if not self.arrival_window_ms >= 0:
            raise ValueError(f"arrival_window_ms must be >= 0, got {self.arrival_window_ms}")


@dataclass(frozen=True)
class PolicyConfig:
    """Scheduling policies and simulation fidelity.

    ``placement``: ``first-fit``, ``random`` or ``lwf:K`` (least workload first;
    jobs of <= K GPUs spread over the least-loaded GPUs, larger jobs are packed
    onto the least-loaded nodes). ``comm``: ``srsf:N`` (smallest remaining
    GPU-time first, at most N transfers per node) or ``ada-srsf`` (SRSF order +
    AdaDUAL). ``fidelity``: ``task`` (DAG of forward/backward/all-reduce tasks)
    or ``iteration`` (fluid model for trace-scale runs). ``seed`` drives random
    placement. ``job_order``: the order in which waiting jobs are offered to
    placement, ``fifo`` (arrival) or ``srsf`` (smallest total GPU-time first);
    either way a job that does not fit does not block the others.
    ``srsf:inf`` accepts all contention (no limit per node).
    """

    placement: str = "lwf:4"
    comm: str = "ada-srsf"
    fidelity: str = "task"
    seed: int = 0
    job_order: str = "fifo"

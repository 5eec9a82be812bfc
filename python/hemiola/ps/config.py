"""Configuration of the parameter server (``hemiola.ps``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hemiola.config import check_size_mb

CONSISTENCIES = ("bsp", "asp", "ssp", "eager")
STALENESS_RULES = ("none", "inverse", "zhang")
MOMENTUM_RULES = ("rescaled", "compensated", "none")


@dataclass(frozen=True)
class PSConfig:
    """How a parameter-server job runs. Every rank must use the same values.

    Attributes:
        consistency: ``"bsp"`` (synchronous, equals all-reduce training),
            ``"asp"`` (asynchronous), ``"ssp"`` (asynchronous, at most
            `staleness_bound` pushes ahead of the slowest worker) or
            ``"eager"`` (asynchronous with pull and push decoupled: the next
            iteration's parameters that the forward would otherwise wait for
            are pulled without waiting for this worker's own push, so both
            overlap computation; see `ahead_fraction`).
        num_servers: the first `num_servers` ranks of the job are servers,
            the rest are workers.
        staleness_bound: the ``ssp`` bound *s*.
        staleness_rule: how much a gradient that is tau versions stale
            counts: ``"inverse"`` 1/(1+tau), ``"zhang"`` 1/max(1,tau) (Zhang
            et al., IJCAI'16) or ``"none"`` 1. SGD weights the gradient by it
            as it enters the momentum buffer (so its whole influence shrinks,
            not only its first step); Adam and AdamW scale the step's
            learning rate by it. Default (:meth:`rule`): ``"none"`` for
            ``bsp`` (whose tau is always 0) and for SGD under the
            ``"rescaled"`` momentum rule (which weighs a push as ``bsp``
            weighs one of a round's gradients, so that a straggler's shard
            still counts fully); ``"inverse"`` otherwise (Adam, AdamW, the
            other momentum rules: stable at learning rates where ``"none"``
            diverges there).
        partition_mb: tensors larger than this are split into parts, and
            parts are balanced across servers by bytes.
        timeout_s: connection set-up; how long a pull may wait; how long a
            ``bsp`` round waits for a worker before the job fails naming it.
        snapshot_dir: where servers write snapshots (``server-<i>.snap``).
        snapshot_every_s: > 0: servers also snapshot periodically.
        restore: servers start from the snapshots in `snapshot_dir`.
        local_correction: ``eager`` only: a pulled value that lacks this
            worker's own newest push (the pull was requested before it) gets
            that push's own step applied on the worker, so the next forward
            contains the worker's own last gradient and the staleness rule
            counts only other workers' updates. The servers' parameters and
            optimizer state are untouched by it. On by default.
        momentum_rule: asynchronous modes with SGD momentum: how a push
            steps the servers' momentum. ``"rescaled"`` (the default) spreads
            ``bsp``'s momentum over the N pushes of a round (momentum^(1/N)
            per push) and weights each gradient so that it moves the
            parameters as far as it would in ``bsp``; the staleness rule then
            weighs only staleness beyond a round's N - 1 other pushes.
            ``"compensated"`` steps a push tau versions stale with
            momentum/(1+tau) and its gradient weighted by the staleness factor
            (stable at high learning rates, but a gradient counts about 1/8 of
            what it does in ``bsp`` with 4 workers). ``"none"``: torch's
            momentum on every push, the factor on the step's learning rate. No
            effect in ``bsp`` or with Adam. N is the number of workers the
            job started with, also after one has died.
        ahead_fraction: ``eager`` only: which pulls are requested ahead,
            when the forward ends, without waiting for this worker's push
            (and corrected locally), so that they stream in under backward.
            The others are requested after their push, at
            ``optimizer.step()``, as ``asp`` pulls: those replies hold the
            pushes the other workers made during this backward, so the next
            gradient is less stale, but the next forward may wait for them.
            ``None`` (the default) learns it: every pull starts after the
            push, and a tensor whose pull keeps the forward waiting (more
            than 1% of an iteration, on average, after 3 iterations of
            warm-up) is pulled ahead on trial: kept there if the median of
            10 iterations gets at least 10% shorter than the 10 before the
            move, else moved back for good. A number fixes it: the
            front tensors whose elements reach that share of the parameters
            (at least one when above 0); 1 pulls everything ahead, 0 is
            ``asp``'s pulling.
        check_finite: servers refuse a gradient holding NaN or infinity and
            name the parameter (``bsp`` fails the job; asynchronous modes
            reject that push and fail its worker). On by default.

    The job token is not a field: it is a secret, read from the environment
    (``HEMIOLA_JOB_TOKEN``, see :func:`hemiola.ps.job_token.job_token`), so it never
    lands in logs or pickled configs.
    """

    consistency: str = "bsp"
    num_servers: int = 1
    staleness_bound: int = 2
    staleness_rule: str | None = None
    partition_mb: float = 1.0
    timeout_s: float = 300.0
    snapshot_dir: str | None = None
    snapshot_every_s: float = 0.0
    restore: bool = False
    check_finite: bool = True
    local_correction: bool = True
    momentum_rule: str = "rescaled"
    ahead_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.consistency not in CONSISTENCIES:
            raise ValueError(f"consistency={self.consistency!r}: choose one of {CONSISTENCIES}")
        if self.staleness_rule is not None and self.staleness_rule not in STALENESS_RULES:
            raise ValueError(
                f"staleness_rule={self.staleness_rule!r}: choose one of {STALENESS_RULES}")
        if self.momentum_rule not in MOMENTUM_RULES:
            raise ValueError(
                f"momentum_rule={self.momentum_rule!r}: choose one of {MOMENTUM_RULES}")
        if self.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {self.num_servers}")
        if self.staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {self.staleness_bound}")
        check_size_mb("partition_mb", self.partition_mb)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")
        if self.ahead_fraction is not None and not 0.0 <= self.ahead_fraction <= 1.0:
            raise ValueError(f"ahead_fraction must be within [0, 1], got {self.ahead_fraction}")
        if self.restore and not self.snapshot_dir:
            raise ValueError("restore=True needs snapshot_dir")

    def rule(self, optimizer: str) -> str:
        """The staleness rule in effect for `optimizer` (``"sgd"``, ``"adam"``
        or ``"adamw"``).

        By default ``"none"`` where nothing else is needed: in ``bsp`` (tau is
        always 0), and with SGD under ``"rescaled"`` momentum, which weighs
        each push as one of a round's N gradients itself and would leave the
        rule only the straggler, whose shard ``"inverse"`` made count about
        1/17 as much as the others' (a 4x straggler with 4 workers). Else
        ``"inverse"``: there the rule's 1/(1+tau) is also the averaging over
        the N workers, without which asynchrony takes N times bsp's step."""
        if self.staleness_rule is not None:
            return self.staleness_rule
        if self.consistency == "bsp":
            return "none"
        return "none" if optimizer == "sgd" and self.momentum_rule == "rescaled" else "inverse"

    @property
    def partition_elems(self) -> int:
        return max(1, int(self.partition_mb * (1 << 20)) // 4)

    def snapshot_path(self, server_index: int) -> str:
        return f"{self.snapshot_dir}/server-{server_index}.snap" if self.snapshot_dir else ""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> PSConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown hemiola.ps option(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)

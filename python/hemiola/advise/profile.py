"""What ``hemiola advise`` measures of a model on one machine, kept as JSON so
that a profile measured once predicts any cluster (``--profile FILE``).

Every time is in seconds, every size in bytes. A profile can also be written
by hand (a published model's per-layer times and sizes): only ``forward``,
``backward``, ``step`` and ``params`` are required; the rest defaults to
"nothing measured" (no coding cost, no contention, no overhead).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

#: bump when a field changes meaning; a profile of another version is refused
#: (version 1 is read: its priority plan was in backward order, see from_json)
VERSION = 2
#: priority's default: the buckets holding the front layers' first quarter of
#: the bytes are issued front first (Config.priority_front_fraction)
FRONT_FRACTION = 0.25


@dataclass
class Param:
    """One trainable parameter, in registration order."""

    numel: int
    element_size: int = 4
    #: first dimension of a matrix (PowerSGD's view), 0 for a vector
    rows: int = 0
    #: when the forward first reads it, from the forward's start
    need: float = 0.0
    #: when backward has produced its gradient, from the backward's start
    ready: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass
class Link:
    """The network the profile was measured on, as the collective model sees
    it (see :mod:`hemiola.advise.collective`)."""

    world: int
    #: seconds per message (the alpha term)
    latency: float
    #: bytes per second each rank sends and receives (the 1/beta term)
    bandwidth: float


@dataclass
class Profile:
    """One model on one machine (rank 0's medians; the ranks agree on them)."""

    forward: float
    backward: float
    #: the optimizer step of the bare model
    step: float
    params: list[Param]
    #: buckets (parameter indices) in issue order, per schedule; a parameter
    #: cut into pieces is in several; a schedule missing here uses DDP's
    #: plan, computed from the sizes
    plans: dict[str, list[list[int]]] = field(default_factory=dict)
    #: CPU seconds per iteration of each coding on the engine's thread for the
    #: whole model (copies in and out, coding, decoding), measured with a free
    #: wire (one rank)
    coding_cpu: dict[str, float] = field(default_factory=dict)
    #: how much a second of the engine's CPU work beside the computation
    #: delays it: 0 where they run on separate cores (a GPU's computation),
    #: 1 where they share one core
    contention: float = 0.0
    #: CPU seconds the engine spends per byte it sends (Gloo's copies and
    #: sums, the kernel's sockets)
    wire_cpu_per_byte: float = 0.0
    #: bytes per second a rank's collectives send at most while the
    #: computation runs beside them (on CPU ranks the collective's threads and
    #: sockets share the cores with it): the link's bandwidth times one
    #: all-reduce of every gradient alone over the same while each rank
    #: trains; 0 where it was not slower beside, or not measured
    wire_rate_beside: float = 0.0
    #: a synchronous job's step over the slowest rank's own (>= 1): where the
    #: ranks' step times vary independently, a job whose ranks meet every
    #: step waits each time for whichever is slowest then. forward, backward
    #: and step are the job's; ``streaming``'s ranks meet every H steps and
    #: go at ``free_compute``
    lockstep: float = 1.0
    #: per configuration ("wfbp+fp16"): the measured wrapped step on a free
    #: wire minus the model's prediction of it (hooks, Python, landings)
    overhead: dict[str, float] = field(default_factory=dict)
    #: the link the profile was measured on (None: measured without one)
    link: Link | None = None
    #: per coding: one all-reduce of every gradient measured on `link`
    reduce: dict[str, float] = field(default_factory=dict)
    #: per coding: what `reduce` takes beyond the model of it (the coding's
    #: CPU and its collectives on `link`), at least 0: the ranks waiting for
    #: each other. Each collective waits for every rank to have coded its
    #: part, so a coding of several rounds a bucket (PowerSGD's three, int8's
    #: two) waits that often for whichever rank is slower then, and Gloo's
    #: waiting threads spin on the CPU. Seconds per iteration for the whole
    #: model (its DDP plan's collectives), spent on the engine's lane like the
    #: coding's CPU, an equal part per collective; measured at `link`'s world
    #: (profiles written before the name changed call it ``meeting``)
    peer_wait: dict[str, float] = field(default_factory=dict)
    #: the optimizer's class name (Adam and AdamW turn decoupled's preview on)
    optimizer: str = "SGD"
    #: provenance: date, host, cpus, torch, hemiola, model, ...
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def compute(self) -> float:
        """One iteration's computation alone."""
        return self.forward + self.backward + self.step

    @property
    def free_compute(self) -> float:
        """One iteration's computation where the ranks do not meet each step
        (the slowest rank's own pace)."""
        return self.compute / self.lockstep

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def scaled(self, factor: float) -> Profile:
        """This profile on a machine whose CPU work takes `factor` times as
        long: every time but the link's. The wire's rate beside the
        computation stays as measured too: the ranks measure it together,
        the slowest included (``agree``); under ``--rescale-compute`` it is
        the rate of the machine the profile was measured on."""
        return replace(self.computation_scaled(factor),
                       coding_cpu={k: v * factor for k, v in self.coding_cpu.items()},
                       peer_wait={k: v * factor for k, v in self.peer_wait.items()},
                       overhead={k: v * factor for k, v in self.overhead.items()},
                       wire_cpu_per_byte=self.wire_cpu_per_byte * factor)

    def computation_scaled(self, factor: float) -> Profile:
        """This profile with only the computation (forward, backward, step
        and the times within them) `factor` times as long."""
        params = [Param(p.numel, p.element_size, p.rows, p.need * factor, p.ready * factor)
                  for p in self.params]
        return replace(self, forward=self.forward * factor, backward=self.backward * factor,
                       step=self.step * factor, params=params)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, **asdict(self)}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        data = dict(data)
        version = data.pop("version", VERSION)
        if "meeting" in data:  # peer_wait's name in profiles written before 2026-11-29
            if "peer_wait" in data:
                raise ValueError("profile: both peer_wait and meeting (its old name) are given")
            data["peer_wait"] = data.pop("meeting")
        if version not in (1, VERSION):
            raise ValueError(f"this profile is of version {version}; this hemiola reads version "
                             f"{VERSION}: measure it again with hemiola advise --save-profile")
        try:
            params = [Param(**p) for p in data.pop("params")]
            link = data.pop("link", None)
            profile = cls(params=params, link=None if link is None else Link(**link), **data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a hemiola advise profile ({e}): it needs forward, backward, "
                             "step (seconds) and params (a list of {numel, need, ready, ...})"
                             ) from e
        if version == 1 and "priority" in profile.plans:
            # version 1 read priority's buckets in backward order, not the
            # order the engine sends them in, which follows from it
            profile.plans["priority"] = front_first(params, profile.plans["priority"])
        profile.check()
        return profile

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the profile {path}: {e}") from e
        return cls.from_json(data)

    def check(self) -> None:
        """Raises ValueError naming the first impossible value."""
        for name in ("forward", "backward", "step", "contention", "wire_cpu_per_byte",
                     "wire_rate_beside"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"profile: {name} must be a number >= 0, got {value!r}")
        if not (isinstance(self.lockstep, (int, float)) and self.lockstep >= 1):
            raise ValueError(f"profile: lockstep must be a number >= 1, got {self.lockstep!r}")
        if not self.params:
            raise ValueError("profile: params is empty (a model without trainable parameters "
                             "has nothing to reduce)")
        for i, p in enumerate(self.params):
            if p.numel < 1 or p.element_size < 1 or p.rows < 0:
                raise ValueError(f"profile: params[{i}] has numel {p.numel}, element_size "
                                 f"{p.element_size}, rows {p.rows}; each must be positive")
        for schedule, plan in self.plans.items():
            seen = sorted({i for bucket in plan for i in bucket})
            if seen != list(range(len(self.params))):
                raise ValueError(f"profile: the {schedule} plan must hold every parameter "
                                 f"index 0..{len(self.params) - 1} and no other")
        for name in ("coding_cpu", "peer_wait"):
            for coding, seconds in getattr(self, name).items():
                if seconds < 0:
                    raise ValueError(f"profile: {name}[{coding!r}] is negative")


def cut_into(plan: Sequence[Sequence[int]]) -> dict[int, int]:
    """Per parameter index, how many buckets of `plan` hold a piece of it
    (the engine cuts a parameter larger than what a bucket has left)."""
    count: dict[int, int] = {}
    for bucket in plan:
        for i in bucket:
            count[i] = count.get(i, 0) + 1
    return count


def front_first(params: list[Param], plan: list[list[int]],
                fraction: float = FRONT_FRACTION) -> list[list[int]]:
    """`plan` (backward order) with the buckets that hold the first `fraction`
    of the bytes (the front layers) moved to the end, front first, and at
    least one bucket left in its place: priority's issue order, as the
    engine derives it (cpp/src/engine/updater/priority_policy.cpp; a
    parameter cut into pieces counts its share of the bytes in each bucket)."""
    count = cut_into(plan)
    sizes = [sum(params[i].nbytes / count[i] for i in bucket) for bucket in plan]
    tail: list[int] = []
    covered = 0.0
    for k in reversed(range(len(plan))):
        if covered >= fraction * sum(sizes) or len(tail) + 1 >= len(plan):
            break
        tail.append(k)
        covered += sizes[k]
    return plan[: len(plan) - len(tail)] + [plan[k] for k in tail]

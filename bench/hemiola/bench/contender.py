"""What a benchmark trains, by the name its options and tables use: a
``Contender``, parsed from ``SCHEDULE[+COMPRESSION]``.

SCHEDULE is a hemiola schedule (``hemiola.config.SCHEDULES``), one of
``VARIANTS`` (a schedule with options), or ``ddp`` (torch
DistributedDataParallel, the baseline: :mod:`hemiola.bench.ddp`).
COMPRESSION is hemiola's compression (``hemiola.config.COMPRESSIONS``) or,
for ``ddp``, the communication hook that does the same. For example ``wfbp``,
``decoupled+int8``, ``decoupled-late``, ``ddp+powersgd``.

``Contender(FSDP2)`` is torch's FSDP2 (:mod:`hemiola.bench.fsdp`), the
baseline of ``sharded`` in the speed and memory suites; those suites name it
themselves, and ``parse`` does not take it (the suites that parse names train
every other contender through DDP or ``hemiola.wrap``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hemiola.bench.ddp import LABELS as DDP_LABELS
from hemiola.bench.fsdp import LABEL as FSDP2_LABEL
from hemiola.config import COMPRESSIONS, SCHEDULES

DDP = "ddp"
FSDP2 = "fsdp2"

#: schedules with options, as they appear in benchmark tables
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # corrections land only when the in-flight bound forces them: the
    # approximation is read every iteration, as when communication takes the
    # whole next iteration
    "decoupled-late": ("decoupled", {"correct_on_arrival": False}),
    # the approximate step from the rank's own gradient alone, without the
    # preview (the default for SGD; Adam and AdamW take a preview by default)
    "decoupled-own": ("decoupled", {"preview": False}),
    # the buckets planned from the parameters' reverse order and kept: no
    # rebuild from the first iteration's arrival order (whose step completes
    # each old bucket's all-reduce to hand the gradients to the new plan)
    "sharded-static": ("sharded", {"rebuild_buckets": False}),
}


@dataclass(frozen=True)
class Contender:
    """One configuration under test: ``schedule`` (a hemiola schedule, a
    ``VARIANTS`` name, ``ddp`` or ``fsdp2``) and ``compression`` ("" for none)."""

    schedule: str
    compression: str = ""

    @classmethod
    def parse(cls, name: str) -> Contender:
        """The contender named `name`, ``SCHEDULE[+COMPRESSION]``; ValueError
        when either part is unknown (or ``ddp`` has no hook for it)."""
        schedule, plus, compression = name.partition("+")
        if schedule not in (*SCHEDULES, *VARIANTS, DDP):
            raise ValueError(f"unknown schedule {name!r}; known: "
                             f"{', '.join([*SCHEDULES, *VARIANTS, DDP])}, each optionally "
                             f"+{'|+'.join(COMPRESSIONS)}")
        known = DDP_LABELS if schedule == DDP else COMPRESSIONS
        if (plus and not compression) or (compression and compression not in known):
            raise ValueError(f"unknown compression in {name!r}; known: "
                             f"{', '.join(c for c in known if c)}")
        return cls(schedule, compression)

    @property
    def name(self) -> str:
        """``SCHEDULE[+COMPRESSION]``, as parsed."""
        return self.schedule + (f"+{self.compression}" if self.compression else "")

    @property
    def is_ddp(self) -> bool:
        """Whether this is torch DDP (with the hook of ``compression``)."""
        return self.schedule == DDP

    @property
    def is_fsdp2(self) -> bool:
        """Whether this is torch's FSDP2 (``fully_shard``, ZeRO-2)."""
        return self.schedule == FSDP2

    @property
    def is_torch(self) -> bool:
        """Whether torch trains this contender (DDP or FSDP2), not ``hemiola.wrap``."""
        return self.is_ddp or self.is_fsdp2

    @property
    def label(self) -> str:
        """How the contender reads in a table."""
        if self.is_ddp:
            return DDP_LABELS[self.compression]
        if self.is_fsdp2:
            return FSDP2_LABEL
        return f"hemiola {self.schedule}" + (f" + {self.compression}" if self.compression else "")

    def wrap_arguments(self) -> tuple[str, dict[str, Any]]:
        """``hemiola.wrap``'s schedule and keyword options for this contender."""
        if self.is_torch:
            raise ValueError(f"{self.schedule} is torch's, not a hemiola schedule")
        schedule, options = VARIANTS.get(self.schedule, (self.schedule, {}))
        if self.compression:
            options = {**options, "compression": self.compression}
        return schedule, dict(options)

"""Configuration of a wrapped model: every knob, its default and what it does."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from hemiola._native import C

SCHEDULES = ("wfbp", "priority", "decoupled", "streaming", "sharded")
#: Values of ``Config.compression`` besides None, with the engine's code of
#: each: the engine's own table (``hemiola/config.h``), so neither is spelled here.
#: Every fact about every coding, by name ("none" included), from the same
#: table: its code, where it runs, whether streaming may send with it, whether
#: it keeps error-feedback residuals.
CODINGS: dict[str, dict[str, Any]] = {row["name"]: row for row in C.coding_table()}
_CODES: dict[str, int] = {name: row["code"] for name, row in CODINGS.items()}
COMPRESSIONS = {name: code for name, code in _CODES.items() if name != "none"}
#: The codings that keep a residual per tensor (``comm_state_dict`` saves them).
RESIDUAL_CODINGS = frozenset(name for name, row in CODINGS.items() if row["residuals"])
#: The codings streaming's fragments may travel with (None: "none").
STREAMING_CODINGS = tuple(name for name, row in CODINGS.items() if row["streams"])


#: The longest timeout taken, in seconds (about 31 years): longer ones overflow
#: the engine's clocks (nanoseconds in 64 bits reach 9.2e9 s).
MAX_TIMEOUT_S = 1e9


def check_timeout_s(name: str, value: object) -> None:
    """Refuses, naming option `name`, a timeout that is not a number of
    seconds in (0, MAX_TIMEOUT_S]: NaN, infinity and values the engine's
    clocks cannot hold included."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value <= MAX_TIMEOUT_S):
        raise ValueError(f"{name} must be a number of seconds above 0 and at most "
                         f"{MAX_TIMEOUT_S:.0e}, got {value!r}")


def spelled(names: tuple[str, ...]) -> str:
    """Coding names as Config.compression takes them, for messages:
    "None, 'fp16', 'bf16', 'int8' or 'int4'"."""
    shown = ["None" if name == "none" else repr(name) for name in names]
    return ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0]


#: The largest size option (``fusion_mb``, ``first_bucket_mb``,
#: ``partition_mb``): 1 TiB, above any bucket a model needs, and small enough
#: that its bytes fit every integer the engine counts them in (2^44 MiB and
#: more used to crash every rank inside ``wrap``).
MAX_SIZE_MB = float(1 << 20)


def check_size_mb(name: str, value: object, zero_allowed: bool = False) -> None:
    """Raises ValueError naming `name` unless `value` is a finite number of MiB
    in (0, MAX_SIZE_MB] ([0, MAX_SIZE_MB] when `zero_allowed`)."""
    low = 0.0 if zero_allowed else math.nextafter(0.0, 1.0)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not low <= value <= MAX_SIZE_MB):
        bound = "[0" if zero_allowed else "(0"
        raise ValueError(f"{name} must be a number of MiB in {bound}, {MAX_SIZE_MB:.0f}] (at "
                         f"most 1 TiB), got {value!r}")


def compression_code(compression: str | None) -> int:
    """The engine's code of a ``Config.compression`` value (None: "none")."""
    return _CODES["none"] if compression is None else COMPRESSIONS[compression]


@dataclass(frozen=True)
class Config:
    """Knobs of :func:`hemiola.wrap`. Pass them as keyword arguments to ``wrap``.

    Attributes:
        schedule: How communication is scheduled. ``"wfbp"``: wait-free
            back-propagation with tensor fusion; gradients are all-reduced in
            buckets while backward runs and ``backward()`` returns with averaged
            gradients (numerically torch DDP). ``"decoupled"``: ``backward()``
            does not wait; ``optimizer.step()`` applies this rank's own
            gradient so the next iteration computes on approximate parameters
            while the all-reduce runs under it; the exact step lands as soon
            as the reduction has arrived and no forward still needs the
            approximate value, at the latest in the ``optimizer.step()`` that
            would exceed ``in_flight`` (or in ``model.synchronize()``).
            ``"priority"``: wfbp's math, but ``backward()`` does not wait; each
            bucket's update is applied as soon as it is reduced, the next
            forward of a module waits only for its own parameters, and the
            front layers are reduced first once backward is done.
            ``"sharded"``: wfbp's math with each rank holding 1/N of the
            gradients and optimizer state: buckets are reduce-scattered
            during backward, each rank steps its shard with the optimizer
            (element-wise ones: SGD, Adam, AdamW, ...), and the updated
            shards are all-gathered under the next forward, each module
            waiting for its own parameters (docs/sharded.md).
        fusion_mb: Gradients are fused into buckets in the order backward
            produces them; a bucket closes as soon as it holds this many MiB
            (the gradient that reaches the cap is its last), as with DDP's
            ``bucket_cap_mb``. ``None`` (default): 25 MiB, DDP's default,
            for ``wfbp`` and ``decoupled``; 4 MiB for ``priority`` and
            ``sharded`` (whose buffers are sized by it), ``priority``'s
            front-first order needs buckets small enough to reorder (on a
            1 Gbit/s link 25 MiB buckets left it 1.07x DDP's time, 4 MiB
            0.88-0.90x: docs/benchmarks.md).
        first_bucket_mb: Cap of the first bucket (the last layers, whose
            gradients are ready first), so communication starts early.
        timeout_s: Any collective that does not complete within this many
            seconds raises on every surviving rank, naming the pending buckets
            and parameters and the ranks that are missing.
        broadcast_buffers: Before each forward with gradients enabled, broadcast
            the module's buffers (e.g. BatchNorm running statistics) from rank 0,
            as DDP does by default.
        find_unused_parameters: Allow parameters that get no gradient in an
            iteration. When off (the default) such a parameter is an error that
            names it. When on, missing gradients count as zeros in the average;
            parameters no rank used keep their ``.grad`` untouched. Costs one
            small extra all-reduce per iteration.
        rebuild_buckets: After the first iteration, rebuild the buckets in the
            order gradients actually became ready (rank 0's order).
        partition_mb: Gradients larger than this many MiB are cut into pieces
            that may go to different buckets, so a huge tensor cannot hold up
            the front layers' buckets behind it. ``None`` (default): 4 MiB for
            ``priority``, off for the other schedules.
        priority_front_fraction: ``priority`` only: the buckets holding this
            fraction of the gradient bytes, counted from the front layers, are
            reduced front-first after backward (the rest in backward order,
            during backward).
        in_flight: ``decoupled`` only: how many iterations' reductions may be
            pending while the next one computes (1: iteration t's reduction
            overlaps iteration t+1, and the step of t+1 waits for it). A larger
            bound hides a reduction slower than a whole iteration, at the
            price of an approximation that lags further behind.
        correct_on_arrival: ``decoupled`` only: land each exact step as soon
            as its reduction has arrived (in the forward pre-hook of the module
            that reads the parameter first, or in ``optimizer.step()``), so
            the approximation is used only while communication is really in
            flight. ``False``: land only when ``in_flight`` requires it, which
            makes the trajectory independent of network timing.
        preview: ``decoupled`` only: before the full-precision all-reduce,
            all-reduce a one-byte coding of every gradient (a quarter of
            float32's bytes, on a lane of its own); the next forward waits for
            it where it reads a parameter and computes on the approximate
            step taken from it: the rank's own gradient plus the coded average
            minus its own coding, whose mean over the ranks is the exact
            average. The exact steps then land in ``optimizer.step()`` only,
            never on arrival: every forward reads estimates rather than exact
            back layers beside approximate front ones, which measured
            better. ``None`` (default): on
            for Adam and AdamW, off for SGD (where the rank's own gradient
            already trains as well as the exact step); any optimizer on
            request. Needs ``in_flight=1``, a CPU model and
            at most 127 ranks. With ``clip_grad_norm_`` the estimate is
            scaled by torch's clipping coefficient for an estimate of the
            averaged gradient's norm (this rank's norm times the newest known
            average/own ratio); a GradScaler or unused parameters turn it off
            for their iterations.
        timeline: Record engine events; read them with ``model.timeline()``.
        gpu_backend: How a model on a GPU is reduced: ``"nccl"`` (one GPU
            per rank), ``"gloo"`` (through pinned host memory; no NCCL needed,
            and several ranks may share one GPU) or ``"auto"`` (NCCL when
            ``libnccl.so.2`` loads, else Gloo).
        check_finite: Check every averaged gradient (under ``streaming``,
            every fragment's averaged pseudo-gradient) for NaN and infinity
            and raise, on every rank alike, naming a parameter that holds
            one, instead of applying it. Costs one pass over the gradients
            per iteration. With a GradScaler (``grad_scaler``), overflows skip
            the step instead, as GradScaler does.
        compression: How float32 gradient buckets travel, for every schedule:
            ``None`` (default) as they are; ``"fp16"`` / ``"bf16"``: in half
            precision, each rank's bucket divided by the world size first so
            the sum cannot overflow (what DDP's ``fp16_compress_hook`` /
            ``bf16_compress_hook`` do; half the bytes); ``"int8"``: one byte
            per element with a scale per block of 256 (codes in [-127, 127]
            at any number of ranks: each rank's blocks are sent to their
            owner, who averages them in float32 and codes the average again
            for the all-gather), and error feedback on both codings: what a
            coding dropped is added next time (a quarter of the bytes, plus
            1.6% for the scales; ``model.comm_state_dict()`` holds the
            residuals for a checkpoint); ``"int4"``: the same in half a byte
            per element (codes in [-7, 7], two a byte), at any number of ranks;
            ``"powersgd"``: each gradient matrix (viewed as
            first dimension x the rest) sent as a rank-``powersgd_rank``
            approximation with error feedback and warm start, as torch's
            ``powerSGD_hook`` does, from iteration ``powersgd_start_iter``
            on; small tensors travel as they are. Every rank gets the same
            average, bit for bit; with
            ``priority`` and ``decoupled`` the exact step is the step with
            that average. On a CUDA model ``"fp16"`` and ``"bf16"``; the
            others are CPU only and refused there.
            ``model.register_comm_hook(state, hook)`` with torch's
            ``fp16_compress_hook``, ``bf16_compress_hook`` or
            ``powerSGD_hook`` sets this too.
        powersgd_rank: ``compression="powersgd"``: the rank of each
            gradient's approximation (torch's ``matrix_approximation_rank``).
        powersgd_start_iter: ``compression="powersgd"``: iterations before
            this one travel uncompressed (torch's ``start_powerSGD_iter``).
        native_optimizer: ``priority`` and ``decoupled``: the engine's
            updater lands the updates for every optimizer; this chooses who
            steps. ``None`` (default) or ``True``: the engine steps
            ``torch.optim.SGD``, ``Adam`` and ``AdamW`` itself wherever it can
            (on the optimizer's own state tensors; no Python work per
            parameter; on a GPU the fused kernels on the compute stream), and
            any other per-parameter optimizer through torch's own step, which
            it calls once per landing group (its external stepper).
            ``False``: torch's step for every optimizer, at the cost of a
            Python call per landing group (the engine's own CPU steps
            already equal torch's bit for bit).
        sync_every: ``streaming`` only: inner optimizer steps between two
            synchronisations of each fragment of the model (DiLoCo's H).
        fragments: ``streaming`` only: how many pieces the model is
            synchronised in, staggered evenly over ``sync_every`` steps
            (Streaming DiLoCo); one is on the wire at a time.
        overlap: ``streaming`` only: inner steps a fragment's average may take
            to arrive (tau; less than ``sync_every / fragments``); meanwhile
            the rank's own progress stands in, and is kept on top of the new
            shared copy when it lands. 0: each sync waits for its average and
            every rank then holds the same parameters. With both
            ``fragments`` and ``overlap`` left out (None), the run starts
            blocking with one fragment and, after the first sync, chooses
            them from that sync's measured time (hemiola.streaming_shape:
            blocking where a sync costs at most 5% of ``sync_every`` steps,
            else fragments and an overlap that hide it); with one left out,
            it is 1 fragment or 0 overlap.
        outer_lr, outer_momentum, outer_nesterov: ``streaming`` only: the
            outer optimizer (SGD). Default: lr 1, no momentum, so the outer
            step is the average of the replicas' models (local SGD), which
            measured best at tens of syncs (docs/streaming.md); DiLoCo's,
            made for hundreds of syncs, is 0.7, 0.9, Nesterov.
            ``outer_nesterov`` None: Nesterov whenever ``outer_momentum`` > 0.
        mix: ``streaming`` only: the merge when a fragment's average lands.
            None (default): Streaming DiLoCo's mix with a = 0.5 for a fragment
            that travelled under later steps (``overlap`` > 0), and the
            shared copy itself after a blocking sync. ``"eager"``: the
            rank's progress since the send kept on top of the new shared
            copy. A number a in [0, 1]: ``a * local + (1 - a) * shared`` on
            every sync (torchft's ``fragment_update_alpha``; 0 takes the
            shared copy as it is).
        replica_ranks: ``streaming`` only: ranks per replica. A replica is a
            group of this many consecutive ranks (a node's, as torchrun numbers
            them) that averages its gradients every inner step as ``wfbp``
            does, over the fast link inside it; only the outer sync travels
            between replicas, each rank of a group carrying 1/replica_ranks of
            every fragment. None: the ranks of one node (``LOCAL_WORLD_SIZE``)
            when the run spans several nodes, else 1 (every rank a replica).
        coordinator: ``streaming`` only: ``"HOST:PORT"`` of a running
            ``hemiola coordinator`` makes the run elastic (docs/streaming.md,
            "Elastic membership"): each process is a replica of its own,
            started on its own (no torchrun needed), a replica that dies is
            dropped without the others losing an inner step, and one that
            starts later joins at a sync, handed the shared copy by a peer.
            None (default): the replicas are the ranks of this launch.
        group_name: with ``coordinator``: this replica's name in the run
            (unique among the live ones; a restarted replica may take its old
            name). None: ``HEMIOLA_GROUP``, else host name and process id.
        buckets_in_flight: ``sharded``: how many gradient buckets being
            reduce-scattered exist at once; backward waits for the oldest
            reduction beyond it. Bounds the schedule's transient memory to
            this x ``fusion_mb`` (the parameters are all-gathered in place).
    """

    schedule: str = "wfbp"
    fusion_mb: float | None = None
    first_bucket_mb: float = 1.0
    timeout_s: float = 300.0
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    rebuild_buckets: bool = True
    partition_mb: float | None = None
    priority_front_fraction: float = 0.25
    in_flight: int = 1
    correct_on_arrival: bool = True
    preview: bool | None = None
    timeline: bool = False
    gpu_backend: str = "auto"
    check_finite: bool = False
    native_optimizer: bool | None = None
    compression: str | None = None
    powersgd_rank: int = 2
    powersgd_start_iter: int = 10
    sync_every: int = 100
    fragments: int | None = None
    overlap: int | None = None
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    outer_nesterov: bool | None = None
    mix: float | str | None = None
    replica_ranks: int | None = None
    coordinator: str | None = None
    group_name: str | None = None
    buckets_in_flight: int = 2

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {self.schedule!r}; available: {', '.join(SCHEDULES)}"
            )
        if self.fusion_mb is not None:
            check_size_mb("fusion_mb", self.fusion_mb)
        check_size_mb("first_bucket_mb", self.first_bucket_mb)
        if self.partition_mb is not None:
            check_size_mb("partition_mb", self.partition_mb, zero_allowed=True)
        check_timeout_s("timeout_s", self.timeout_s)
        if not (isinstance(self.buckets_in_flight, int) and not isinstance(
                self.buckets_in_flight, bool) and self.buckets_in_flight >= 1):
            raise ValueError("buckets_in_flight must be an integer >= 1, got "
                             f"{self.buckets_in_flight!r}")
        if not (isinstance(self.in_flight, int) and self.in_flight >= 1):
            raise ValueError(f"in_flight must be an integer >= 1, got {self.in_flight!r}")
        if self.gpu_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"gpu_backend must be 'auto', 'nccl' or 'gloo', got "
                             f"{self.gpu_backend!r}")
        if not (isinstance(self.powersgd_rank, int) and self.powersgd_rank >= 1):
            raise ValueError(f"powersgd_rank must be an integer >= 1, got {self.powersgd_rank!r}")
        if not (isinstance(self.powersgd_start_iter, int) and self.powersgd_start_iter >= 0):
            raise ValueError("powersgd_start_iter must be an integer >= 0, got "
                             f"{self.powersgd_start_iter!r}")
        if self.compression is not None and self.compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {self.compression!r}; available: None, "
                             f"{', '.join(repr(c) for c in COMPRESSIONS)}")
        for name in ("sync_every", "fragments"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1) and not (
                    name == "fragments" and value is None):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.coordinator is not None:
            if self.schedule != "streaming":
                raise ValueError(f"coordinator= makes a streaming run elastic; schedule="
                                 f"{self.schedule!r} has no elastic membership (use "
                                 "schedule='streaming', or leave coordinator out)")
            host, sep, port = str(self.coordinator).rpartition(":")
            if not (isinstance(self.coordinator, str) and sep and host and port.isdigit()):
                raise ValueError(f"coordinator must be 'HOST:PORT', got {self.coordinator!r}")
        if self.group_name is not None and not (isinstance(self.group_name, str)
                                                and self.group_name.strip()):
            raise ValueError(f"group_name must be a non-empty string, got {self.group_name!r}")
        if self.overlap is not None and not (isinstance(self.overlap, int) and self.overlap >= 0):
            raise ValueError(f"overlap must be an integer >= 0, got {self.overlap!r}")
        for name in ("outer_lr", "outer_momentum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.outer_nesterov is not None and not isinstance(self.outer_nesterov, bool):
            raise ValueError("outer_nesterov must be True, False or None (Nesterov whenever "
                             f"outer_momentum > 0), got {self.outer_nesterov!r}")
        if self.mix is not None and self.mix != "eager" and (
                isinstance(self.mix, bool) or not isinstance(self.mix, (int, float))
                or not 0 <= self.mix <= 1):
            raise ValueError(f"mix must be None (0.5 where fragments overlap), 'eager' or a "
                             f"number in [0, 1], got {self.mix!r}")
        if self.replica_ranks is not None and not (
                isinstance(self.replica_ranks, int) and not isinstance(self.replica_ranks, bool)
                and self.replica_ranks >= 1):
            raise ValueError(f"replica_ranks must be an integer >= 1 or None, got "
                             f"{self.replica_ranks!r}")
        if self.schedule == "streaming" and (self.compression or "none") not in STREAMING_CODINGS:
            raise ValueError("schedule='streaming' sends its pseudo-gradients with compression "
                             + spelled(STREAMING_CODINGS))
        if not 0.0 <= self.priority_front_fraction <= 1.0:
            raise ValueError("priority_front_fraction must be in [0, 1], got "
                             f"{self.priority_front_fraction!r}")

    @property
    def fusion_bytes(self) -> int:
        """Bucket cap in bytes (see ``fusion_mb``)."""
        mb = self.fusion_mb
        if mb is None:
            mb = 4.0 if self.schedule in ("priority", "sharded") else 25.0
        return max(1, int(mb * (1 << 20)))

    @property
    def partition_bytes(self) -> int:
        """Partition size in bytes (0: never partition)."""
        mb = self.partition_mb
        if mb is None:
            # PowerSGD compresses whole matrices (or pieces of whole rows):
            # priority's partitions would leave most of them uncompressed.
            mb = 4.0 if self.schedule == "priority" and self.compression != "powersgd" else 0.0
        return max(0, int(mb * (1 << 20)))

    @property
    def first_bucket_bytes(self) -> int:
        return max(1, int(self.first_bucket_mb * (1 << 20)))

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> Config:
        """Builds a Config, naming any unknown keyword."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown hemiola option(s) {', '.join(unknown)}; "
                f"known options: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]

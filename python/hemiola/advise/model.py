"""The time of one training iteration per configuration, from a profile and a
network: a small event simulation of the computation and the engine's lane.

The computation runs forward, backward and the optimizer step of each
iteration (times from the profile). Backward makes each bucket ready when its
last gradient is; the engine's lane reduces the buckets one after another in
their issue order, each once ready: half its CPU work (copies, coding), its
collectives on the wire (:mod:`hemiola.advise.collective`), the other half.
Where the lane's CPU work and the computation overlap they share the core by
the profile's ``contention`` (0: separate cores; 1: each runs at half speed),
the wire's own CPU work (``wire_cpu_per_byte``) slows the computation
likewise, and while the computation runs the wire sends no faster than the
profile's ``wire_rate_beside`` (measured: an all-reduce beside training).
The schedules differ in what waits for what:

- ``wfbp``: the end of backward waits for every bucket of its iteration;
- ``priority``: the forward of a module waits for the buckets of the last
  iteration that hold the parameters it reads (front layers' buckets are
  issued front first once backward is done); the step waits for nothing;
- ``decoupled``: the step of iteration t+1 waits for iteration t's buckets.

The simulation (:mod:`hemiola.advise.simulation`) runs a few iterations
and takes the steady period; then the configuration's measured ``overhead``
(its wrapped step on a free wire minus this model of it: hooks, Python,
landings) is added.

``streaming`` (DiLoCo): H inner steps at the computation's speed (the ranks
meet only at syncs, so at the slowest rank's own pace, not the lockstep
job's: ``Profile.free_compute``), and per H
steps every fragment's coded reduction once, each under ``overlap`` inner
steps, with what does not fit exposed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hemiola.advise.collective import (
    Network,
    Piece,
    payloads,
    pieces,
    sent,
    wire,
)
from hemiola.advise.profile import Param, Profile, front_first
from hemiola.advise.simulation import Job, Segment, Span, simulate

SCHEDULES = ("wfbp", "priority", "decoupled")
CODINGS = ("none", "fp16", "int8", "powersgd")
#: the bucket caps of each schedule's plan (Config.fusion_bytes), in bytes
FUSION = {"wfbp": 25 << 20, "decoupled": 25 << 20, "priority": 4 << 20}
FIRST_BUCKET = 1 << 20
#: streaming's sync periods and the fragment counts tried for each
STREAMING_H = (10, 20, 50, 100)
STREAMING_FRAGMENTS = (1, 2, 4)


@dataclass
class Prediction:
    schedule: str
    coding: str
    seconds: float
    #: streaming: sync_every, fragments, overlap
    options: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``schedule+coding``, with streaming's options."""
        base = f"{self.schedule}+{self.coding}"
        if self.options:
            base += "/" + ",".join(f"{k}={v}" for k, v in self.options.items())
        return base


def ddp_plan(params: Sequence[Param], cap: int, first: int = FIRST_BUCKET) -> list[list[int]]:
    """DDP's buckets: parameters in reverse registration order, a bucket
    closed once it holds `first` bytes (the first) or `cap` (the others)."""
    plan: list[list[int]] = []
    bucket: list[int] = []
    size = 0
    for i in reversed(range(len(params))):
        bucket.append(i)
        size += params[i].nbytes
        if size >= (first if not plan else cap):
            plan.append(bucket)
            bucket, size = [], 0
    if bucket:
        plan.append(bucket)
    return plan


def plan_of(profile: Profile, schedule: str) -> list[list[int]]:
    """The schedule's buckets in issue order: measured, or DDP's rule."""
    if schedule in profile.plans:
        return profile.plans[schedule]
    plan = ddp_plan(profile.params, FUSION[schedule])
    return front_first(profile.params, plan) if schedule == "priority" else plan


def _program(profile: Profile, plan: list[list[int]], schedule: str) -> list[Segment]:
    """One iteration of the computation as segments."""
    params = profile.params
    holding: dict[int, list[int]] = {}
    for k, bucket in enumerate(plan):
        for i in bucket:
            holding.setdefault(i, []).append(k)
    program: list[Segment] = []
    # Forward: each module's first read of its parameters, in time order.
    reads: dict[float, list[int]] = {}
    for i, p in enumerate(params):
        reads.setdefault(min(max(p.need, 0.0), profile.forward), []).append(i)
    at = 0.0
    for point in sorted(reads):
        if point > at:
            program.append(Segment(point - at, name="forward"))
            at = point
        waits = tuple(sorted({(-1, k) for i in reads[point] for k in holding[i]}))
        program.append(Segment(0.0, waits if schedule == "priority" else ()))
    program.append(Segment(profile.forward - at, name="forward"))
    # Backward: a bucket is ready once its last gradient is.
    ready: dict[float, list[int]] = {}
    for k, bucket in enumerate(plan):
        point = min(max(max(params[i].ready for i in bucket), 0.0), profile.backward)
        ready.setdefault(point, []).append(k)
    at = 0.0
    for point in sorted(ready):
        program.append(Segment(point - at, (), tuple(ready[point]), name="backward"))
        at = point
    program.append(Segment(profile.backward - at, name="backward"))
    everything = tuple(range(len(plan)))
    if schedule == "wfbp":
        program.append(Segment(0.0, tuple((0, k) for k in everything)))
        program.append(Segment(profile.step, name="step"))
    elif schedule == "decoupled":
        program.append(Segment(profile.step, tuple((-1, k) for k in everything), name="step"))
    elif schedule == "priority":
        program.append(Segment(profile.step, name="step"))
    else:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    return program


def jobs_for(profile: Profile, net: Network, schedule: str, coding: str,
             plan: list[list[int]] | None = None, powersgd_rank: int = 2,
             peer_wait: bool = True) -> list[Job]:
    """One Job per bucket of the schedule's plan under `coding` on `net`.
    `peer_wait`: with the profile's measured wait of the ranks for each
    other wherever there are ranks to meet, spent as the coding's CPU: the
    ranks meet once per collective, so each collective of the bucket holds an
    equal part of what the measured reduction's collectives waited for (a
    plan of more, smaller buckets meets more often)."""
    plan = plan_of(profile, schedule) if plan is None else plan
    buckets = pieces(profile.params, plan)
    total = sum(p.numel for p in profile.params)
    preview = schedule == "decoupled" and profile.optimizer in ("Adam", "AdamW")
    per_collective = peer_wait_per_collective(profile, net, coding, powersgd_rank) \
        if peer_wait else 0.0
    out = []
    for bucket in buckets:
        share = sum(p.numel for p in bucket) / total
        payload = payloads(coding, bucket, net.world, powersgd_rank)
        cpu = profile.coding_cpu.get(coding, 0.0) * share + per_collective * len(payload)
        if preview:  # its one-byte codes go first, on the same link
            payload = payloads("preview", bucket, net.world) + payload
            cpu += profile.coding_cpu.get("int8", 0.0) * share
        nbytes = sent(net, payload)
        seconds = wire(net, payload)
        out.append(Job(cpu, seconds, profile.wire_cpu_per_byte * nbytes,
                       wire_beside(profile, seconds, nbytes)))
    return out


def peer_wait_per_collective(profile: Profile, net: Network, coding: str,
                             powersgd_rank: int = 2) -> float:
    """Seconds the ranks wait for each other at each collective of `coding`:
    the profile's measured ``peer_wait`` over the collectives of the
    reduction that measured it (DDP's plan); 0 where there are no ranks to
    meet."""
    if net.world == 1 or profile.peer_wait.get(coding, 0.0) <= 0:
        return 0.0
    measured = sum(len(payloads(coding, bucket, net.world, powersgd_rank))
                   for bucket in pieces(profile.params, plan_of(profile, "wfbp")))
    return profile.peer_wait[coding] / max(measured, 1)


def local_network(profile: Profile, world: int) -> Network:
    """The job's own link at `world` ranks, as the profile measured it."""
    if profile.link is None:
        raise ValueError("this profile was measured without a link (one process): give "
                         "--rate GBIT to predict")
    return Network(world=world, bandwidth=profile.link.bandwidth, latency=profile.link.latency)


def reduction_alone(profile: Profile, net: Network, coding: str) -> float:
    """Seconds of one reduction of every gradient (DDP's buckets) under
    `coding` on `net` with nothing beside it, as the model sees it before the
    ranks' wait for each other: each bucket's coding CPU, then its collectives (or the
    wire's CPU work where that is longer)."""
    return sum(j.cpu + max(j.wire, j.wire_cpu)
               for j in jobs_for(profile, net, "wfbp", coding, peer_wait=False))


def wire_beside(profile: Profile, seconds: float, nbytes: float) -> float:
    """The seconds of a wire phase of `seconds` alone that sends `nbytes`
    per rank, while the computation runs beside it."""
    if profile.wire_rate_beside <= 0:
        return seconds
    return max(seconds, nbytes / profile.wire_rate_beside)


def predict_one(profile: Profile, net: Network, schedule: str, coding: str,
                trace: list[Span] | None = None) -> float:
    """Seconds per iteration of `schedule` with `coding` on `net`: never less
    than the bare computation, which every configuration does (a measured
    overhead below zero is noise). `trace`: see :func:`simulate`."""
    plan = plan_of(profile, schedule)
    seconds = simulate(_program(profile, plan, schedule),
                       jobs_for(profile, net, schedule, coding, plan), profile.contention,
                       trace=trace)
    return _finite(max(profile.compute,
                       seconds + profile.overhead.get(f"{schedule}+{coding}", 0.0)),
                   f"{schedule}+{coding}")


def _finite(seconds: float, name: str) -> float:
    """`seconds`, predicted for configuration `name`, if finite."""
    if not math.isfinite(seconds):
        raise ValueError(f"the model predicts {seconds!r} seconds per iteration for {name}: "
                         "the profile or the network holds a time out of range")
    return seconds


def predicted_timeline(profile: Profile, net: Network, schedule: str, coding: str) -> str:
    """The model's iterations of `schedule` with `coding` on `net` as Chrome
    trace JSON, in the engine timeline's lanes (``comm``: the lane's CPU work
    and wire time per bucket; ``compute``: forward, backward, step and the
    waits between them), to read beside a measured ``model.timeline()``.
    The configuration's measured overhead is not placed in it."""
    import json

    trace: list[Span] = []
    predict_one(profile, net, schedule, coding, trace)
    lanes = {"comm": 0, "compute": 1}
    events: list[dict[str, object]] = [
        {"ph": "M", "name": "process_name", "pid": 0,
         "args": {"name": f"predicted {schedule}+{coding}"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": lane}}
               for lane, tid in lanes.items()]
    events += [{"ph": "X", "pid": 0, "tid": lanes[s.lane], "name": s.name,
                "cat": s.name.split(" ")[0], "ts": round(1e6 * s.start, 1),
                "dur": round(1e6 * (s.end - s.start), 1)} for s in trace]
    return json.dumps({"traceEvents": events})


def codings_on(profile: Profile) -> tuple[str, ...]:
    """The codings the engine runs on the profile's device (``meta["device"]``)."""
    device = profile.meta.get("device", "cpu")
    if device == "cpu":
        return CODINGS
    from hemiola._native import C

    return tuple(c for c in CODINGS if c in C.codings(device))


def predict(profile: Profile, net: Network, schedules: Sequence[str] = SCHEDULES,
            codings: Sequence[str] | None = None) -> list[Prediction]:
    """Every schedule x coding that runs on `net` and on the profile's device
    (`codings`: a subset), fastest first."""
    out = []
    for coding in codings_on(profile) if codings is None else codings:
        for schedule in schedules:
            out.append(Prediction(schedule, coding, predict_one(profile, net, schedule, coding)))
    return sorted(out, key=lambda p: p.seconds)


def replica_networks(net: Network) -> tuple[Network | None, Network]:
    """``streaming``'s two networks on `net`: inside a replica and across
    replicas. On several nodes of several GPUs a replica is a node's ranks
    (``replica_ranks``' default; hemiola.replica_groups): their inner steps
    are ``wfbp`` over the node's link, and the outer sync runs between the
    nodes, each rank carrying 1/L of every fragment, so a node's link
    carries one fragment per sync, as one rank per node would. Otherwise
    every rank is a replica: (None, `net`)."""
    if net.gpus_per_node > 1 and net.nodes > 1:
        inside = Network(world=net.gpus_per_node, bandwidth=net.intra_bandwidth,
                         latency=net.intra_latency, algorithm=net.algorithm)
        across = Network(world=net.nodes, bandwidth=net.bandwidth, latency=net.latency,
                         algorithm=net.algorithm, sharing=net.sharing)
        return inside, across
    return None, net


def _sync(profile: Profile, net: Network, fragments: int,
          coding: str) -> tuple[float, float, float]:
    """(seconds one fragment's sync takes alone, the same under inner steps
    (the wire as :func:`wire_beside` says), of which CPU) for `fragments`."""
    total = sum(p.numel for p in profile.params)
    payload = payloads(coding, [Piece(total / fragments, 4, 0)], net.world)
    # the sync's own CPU (pseudo-gradient, outer step, merge) and the coding's,
    # per fragment; measured for the whole model
    cpu = (profile.overhead.get("streaming-sync", 0.0)
           + profile.coding_cpu.get(coding, 0.0)) / fragments
    # and the ranks' wait for each other at each of its collectives (measured per coding)
    cpu += peer_wait_per_collective(profile, net, coding) * len(payload)
    seconds = wire(net, payload)
    return seconds + cpu, wire_beside(profile, seconds, sent(net, payload)) + cpu, cpu


def streaming_step(profile: Profile, net: Network, sync_every: int, fragments: int,
                   overlap: int, coding: str = "int8") -> float:
    """Seconds per inner step of ``schedule="streaming"``: the step at the
    computation's speed plus, per `sync_every` steps, each fragment's coded
    reduction less what hides under `overlap` inner steps (the lane's CPU
    work slowing the computation by the profile's contention while it
    does). Under the steps the sync goes at its pace beside them; what is
    left when they end, with nothing computing, at its pace alone. A replica
    of a node's ranks (:func:`replica_networks`) steps as ``wfbp`` over the
    node's link and syncs between the nodes."""
    inside, across = replica_networks(net)
    inner = (profile.free_compute if inside is None
             else predict_one(profile, inside, "wfbp", "none"))
    step = inner + profile.overhead.get("streaming", 0.0)
    alone, beside, cpu = _sync(profile, across, fragments, coding)
    if overlap == 0:
        exposed = alone
    else:
        left = max(0.0, 1 - overlap * step / beside) if beside > 0 else 0.0
        exposed = left * alone + profile.contention * cpu
    return _finite(step + fragments * exposed / sync_every, f"streaming+{coding}")


def streaming_options(profile: Profile, net: Network, sync_every: int,
                      coding: str) -> list[tuple[int, int]]:
    """(fragments, overlap) tried for one H: blocking (DiLoCo), and for each
    fragment count the shortest overlap that hides a fragment's sync, within
    what the schedule allows (overlap < H / fragments)."""
    out = [(1, 0)]
    across = replica_networks(net)[1]
    for f in STREAMING_FRAGMENTS:
        longest = math.ceil(sync_every / f) - 1
        _, beside, _ = _sync(profile, across, f, coding)
        steps = _finite(beside, f"streaming+{coding}") / max(profile.free_compute, 1e-9)
        needed = max(1, math.ceil(min(steps, sync_every)))
        if longest >= 1:
            out.append((f, min(needed, longest)))
    return out


def streaming_codings(profile: Profile, world: int) -> list[str]:
    """The outer wire's codings, in order of preference where equally fast:
    int8, then int4 (half int8's bytes, coarser codes) where the profile
    measured its CPU cost (or measured no coding's); both at any `world`."""
    codings = ["int8"]
    if "int4" in profile.coding_cpu or not profile.coding_cpu:
        codings.append("int4")
    return codings


def predict_streaming(profile: Profile, net: Network) -> list[Prediction]:
    """``streaming`` for each H of STREAMING_H at its fastest coding (of
    :func:`streaming_codings`; the first where they tie), fragments and
    overlap, in H order."""
    out = []
    for h in STREAMING_H:
        best: Prediction | None = None
        for coding in streaming_codings(profile, net.world):
            for f, tau in streaming_options(profile, net, h, coding):
                seconds = streaming_step(profile, net, h, f, tau, coding)
                if best is None or seconds < best.seconds:
                    best = Prediction("streaming", coding, seconds,
                                      {"sync_every": h, "fragments": f, "overlap": tau})
        assert best is not None
        out.append(best)
    return out

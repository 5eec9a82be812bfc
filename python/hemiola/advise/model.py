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
- ``decoupled``: the step of iteration t+1 waits for iteration t's buckets;
- ``sharded``: each bucket is two jobs on the lane, its reduce-scatter
  (ready when backward has filled it; the buckets go in plan order) and its
  all-gather (each half an all-reduce's time and bytes). Backward waits
  where a bucket's first gradient arrives while BUCKETS_IN_FLIGHT
  reduce-scatters are in flight, for the oldest. The step waits for every
  reduce-scatter and steps this rank's shard: ``step / N`` (the profile's
  ``step`` is the optimizer's, element-wise, so a shard of 1/N costs 1/N);
  then every all-gather is issued, front layers first (plan order
  reversed; they write straight into the parameters, so no buffer bounds
  them): the next forward waits at each module's first read for the
  all-gathers of the buckets holding what it reads; the next backward
  begins once every one has landed. The
  copies into and out of the buckets run on the training thread: they are
  in the measured overhead.

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
from hemiola.advise.profile import DEVICES, Param, Profile, front_first
from hemiola.advise.simulation import Job, Segment, Span, simulate

SCHEDULES = ("wfbp", "priority", "decoupled", "sharded")
CODINGS = ("none", "fp16", "int8", "powersgd")
#: the bucket caps of each schedule's plan (Config.fusion_bytes), in bytes
FUSION = {"wfbp": 25 << 20, "decoupled": 25 << 20, "priority": 4 << 20, "sharded": 4 << 20}
FIRST_BUCKET = 1 << 20
#: ``sharded``'s gradient buckets alive at once (Config.buckets_in_flight's
#: default): reduce-scatters in flight under backward
BUCKETS_IN_FLIGHT = 2
#: the codings a schedule runs with, where not all of CODINGS (``sharded``
#: refuses any compression in this build)
SCHEDULE_CODINGS = {"sharded": ("none",)}
#: the devices a schedule runs on, where not every one (``sharded``: CPU
#: parameters over Gloo in this build)
SCHEDULE_DEVICES = {"sharded": ("cpu",)}
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


def codings_of(schedule: str, codings: Sequence[str] = CODINGS) -> tuple[str, ...]:
    """Those of `codings` that `schedule` runs with (SCHEDULE_CODINGS)."""
    allowed = SCHEDULE_CODINGS.get(schedule)
    return tuple(c for c in codings if allowed is None or c in allowed)


def runs(profile: Profile, schedule: str, coding: str) -> bool:
    """Whether `schedule` runs with `coding` on the profile's device and
    model: ``sharded`` only uncompressed, on CPU, and not where measuring
    the profile found it refusing the model (``meta["refused"]``: its
    optimizer, a parameter)."""
    if coding not in codings_of(schedule, (coding,)):
        return False
    if profile.meta.get("device", "cpu") not in SCHEDULE_DEVICES.get(schedule, DEVICES):
        return False
    return schedule not in profile.meta.get("refused", {})


def _program(profile: Profile, plan: list[list[int]], schedule: str,
             world: int = 1) -> list[Segment]:
    """One iteration of the computation as segments (`world`: the ranks,
    which share ``sharded``'s step)."""
    if schedule == "sharded":
        return _sharded_program(profile, plan, world)
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


def _sharded_program(profile: Profile, plan: list[list[int]], world: int,
                     in_flight: int = BUCKETS_IN_FLIGHT) -> list[Segment]:
    """One iteration of ``sharded`` at `world` ranks as segments, its lane's
    jobs as :func:`jobs_for` makes them: B reduce-scatters (job k: bucket k
    of `plan`), then B all-gathers (job B + j: bucket B - 1 - j, front
    layers first). See the module docstring."""
    params = profile.params
    n = len(plan)
    program: list[Segment] = []
    # Forward: at each module's first read, the all-gathers of the last
    # step up to the last one it needs (bucket k's is the (n-1-k)th issued)
    # land, in issue order.
    reads: dict[float, set[int]] = {}
    for k, bucket in enumerate(plan):
        for i in bucket:
            reads.setdefault(min(max(params[i].need, 0.0), profile.forward), set()).add(
                n - 1 - k)
    landed = 0  # all-gathers landed so far (in issue order)

    def land(upto: int) -> list[Segment]:
        """Lands all-gathers landed..upto one by one (all were issued at
        the step)."""
        nonlocal landed
        out = [Segment(0.0, ((-1, n + j),)) for j in range(landed, upto + 1)]
        landed = max(landed, upto + 1)
        return out

    at = 0.0
    for point in sorted(reads):
        if point > at:
            program.append(Segment(point - at, name="forward"))
            at = point
        program += land(max(reads[point]))
    program.append(Segment(profile.forward - at, name="forward"))
    program += land(n - 1)  # the backward begins once every all-gather has landed
    # Backward: bucket k is reduce-scattered once it is full and every
    # bucket before it is (plan order); where its first gradient arrives,
    # it waits until fewer than `in_flight` reduce-scatters are in flight.
    clamp = [min(max(p.ready, 0.0), profile.backward) for p in params]
    issue: list[float] = []
    for bucket in plan:
        issue.append(max([max(clamp[i] for i in bucket), *issue[-1:]]))
    events: list[tuple[float, int, int]] = []  # (time, bucket, 0: first gradient / 1: full)
    for k, bucket in enumerate(plan):
        first = min(clamp[i] for i in bucket)
        events += [(first, k, 0), (issue[k], k, 1)]
    at = 0.0
    for point, k, kind in sorted(events):
        if kind == 1:
            program.append(Segment(point - at, (), (k,), name="backward"))
            at = point
            continue
        issued = sum(1 for i in range(k) if issue[i] <= point)
        if issued >= in_flight:
            program.append(Segment(point - at, name="backward"))
            program.append(Segment(0.0, ((0, issued - in_flight),)))
            at = point
    program.append(Segment(profile.backward - at, name="backward"))
    # The step: every reduce-scatter, this rank's shard, every all-gather.
    program.append(Segment(profile.step / world, tuple((0, k) for k in range(n)),
                           tuple(range(n, 2 * n)), name="step"))
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
    if schedule == "sharded":
        return _sharded_jobs(profile, net, coding, buckets, per_collective)
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


def _sharded_jobs(profile: Profile, net: Network, coding: str, buckets: list[list[Piece]],
                  per_collective: float) -> list[Job]:
    """``sharded``'s lane per iteration: each bucket's reduce-scatter in plan
    order, then each bucket's all-gather, front layers first. Each is one
    collective (where the ranks meet: `per_collective` of CPU on the lane);
    the copies in and out run on the training thread (the overhead)."""
    if coding != "none":
        raise ValueError(f"schedule='sharded' does not compress (coding {coding!r}): it is "
                         "predicted uncompressed only")

    def job(kind: str, k: int) -> Job:
        payload = [(kind, sum(p.numel * p.element_size for p in buckets[k]))]
        nbytes = sent(net, payload)
        seconds = wire(net, payload)
        name = f"{'reduce-scatter' if kind == 'reduce_scatter' else 'all-gather'} {k}"
        return Job(per_collective, seconds, profile.wire_cpu_per_byte * nbytes,
                   wire_beside(profile, seconds, nbytes), name)

    n = len(buckets)
    return ([job("reduce_scatter", k) for k in range(n)]
            + [job("all_gather_chunks", k) for k in reversed(range(n))])


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
    than the configuration's own computation (:func:`computation`), which it
    does (a measured overhead below zero is noise). `trace`: see
    :func:`simulate`."""
    plan = plan_of(profile, schedule)
    seconds = simulate(_program(profile, plan, schedule, net.world),
                       jobs_for(profile, net, schedule, coding, plan), profile.contention,
                       trace=trace)
    return _finite(max(computation(profile, schedule, net.world),
                       seconds + profile.overhead.get(f"{schedule}+{coding}", 0.0)),
                   f"{schedule}+{coding}")


def computation(profile: Profile, schedule: str, world: int) -> float:
    """One iteration's computation under `schedule` at `world` ranks: the
    bare model's, but ``sharded`` steps a shard of 1/`world` of it."""
    if schedule == "sharded":
        return profile.forward + profile.backward + profile.step / world
    return profile.compute


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
    and model (`codings`: a subset; :func:`runs`), fastest first."""
    out = []
    for coding in codings_on(profile) if codings is None else codings:
        for schedule in schedules:
            if not runs(profile, schedule, coding):
                continue
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

"""``hemiola advise``: two ranks measure a profile, agree on it, predict every
configuration, try the candidates and advise one; the prediction model, the
collectives, streaming and the choice against hand-computed values; profiles
saved, loaded and refused; the prediction for a cluster from a profile."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from hemiola import advise
from hemiola.advise import choice, collective, model
from hemiola.advise.cli import advise_rank, report, scale_report
from hemiola.advise.collective import Network, Piece
from hemiola.advise.model import Prediction
from hemiola.advise.profile import Link, Param, Profile, front_first
from hemiola.advise.simulation import Job, Span, simulate
from hemiola.launch import run_local


def small_model() -> tuple[nn.Module, object]:
    """A --model factory: (model, loss_fn)."""
    torch.manual_seed(0)
    model_ = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return model_, lambda m: nn.functional.cross_entropy(m(x), y)


def test_advise_measures_agrees_predicts_tries_and_chooses(tmp_path: Path) -> None:
    # spec, repeats, iterations, profile, --all, rescale, timeline, rounds
    results = run_local(advise_rank, 2, "test_advise:small_model", 2, 2, None, False, False,
                        None, 2, timeout_s=600)
    r0, r1 = results[0], results[1]
    # The ranks agree on the profile, so on the predictions and the candidates.
    assert r0["profile"] == r1["profile"]
    assert r0["predictions"] == r1["predictions"]
    assert set(r0["measured"]) == set(r1["measured"])
    profile = Profile.from_json(r0["profile"])
    assert 0 < profile.forward and 0 < profile.backward
    assert len(profile.params) == 4 and profile.params[0].rows == 128
    # backward produces the last layer's gradients first
    assert profile.params[3].ready <= profile.params[0].ready <= profile.backward * 1.5
    assert set(profile.coding_cpu) == {*model.CODINGS, "int4"}
    assert set(profile.plans) == set(model.SCHEDULES)
    assert profile.link is not None and profile.link.world == 2
    assert profile.link.bandwidth > 0 and set(profile.reduce) == set(model.CODINGS)
    assert set(profile.peer_wait) == set(model.CODINGS)
    assert all(v >= 0 for v in profile.peer_wait.values())
    # the wire beside training: the link slowed by the measured ratio, where slower
    alone, beside = profile.meta["wire_beside"]
    assert alone > 0 and beside > 0
    assert profile.wire_rate_beside == pytest.approx(
        profile.link.bandwidth * alone / beside if beside > alone else 0.0)
    # three schedules x four codings, sharded uncompressed only, streaming's sync
    assert len(profile.overhead) == 3 * 4 + 1 + 1 and "sharded+none" in profile.overhead
    assert "refused" not in profile.meta
    predictions = r0["predictions"]
    assert len(predictions) == 3 * 4 + 1
    assert [p["seconds"] for p in predictions] == sorted(p["seconds"] for p in predictions)
    assert [s["options"]["sync_every"] for s in r0["streaming"]] == list(model.STREAMING_H)
    # every candidate was tried, the fastest predicted first, and the choice is one of them
    assert predictions[0]["schedule"] + "+" + predictions[0]["coding"] in r0["measured"]
    assert all(v > 0 for v in r0["measured"].values())
    # each candidate ran in both rounds on each rank; its time is the median
    # of its rounds on the slower rank (the job's pace), the same on both
    # ranks, which therefore advise the same configuration
    rounds0, rounds1 = r0["rounds"]["measured"], r1["rounds"]["measured"]
    assert set(rounds0) == set(r0["measured"]) and all(len(t) == 2 for t in rounds0.values())
    assert all(r0["measured"][name] == pytest.approx(max(sum(t) / 2, sum(rounds1[name]) / 2))
               for name, t in rounds0.items())
    assert r0["measured"] == r1["measured"] and r0["choice"] == r1["choice"]
    assert r0["choice"] in predictions
    assert r0["run_seconds"] == r0["measured"][r0["choice"]["schedule"] + "+"
                                              + r0["choice"]["coding"]]
    text = report(r0)
    assert "Use: hemiola.wrap(model, optimizer, schedule=" in text
    assert "measured against" in text and "Streaming: " in text
    assert "sharded is for memory" in text
    # the profile predicts another cluster
    path = tmp_path / "p.json"
    profile.save(path)
    assert "Predicted at 16 ranks" in scale_report(Profile.load(path), Network(16, 1.25e9))


def test_training_beside_a_wait_ends_with_it_and_raises_its_error() -> None:
    import time

    from hemiola.advise.wire import train_until

    steps: list[int] = []
    seconds = train_until(lambda: time.sleep(0.05), lambda: steps.append(1) or time.sleep(0.001))
    assert seconds >= 0.05 and len(steps) >= 1

    def fails() -> None:
        time.sleep(0.01)
        raise RuntimeError("the peer is gone")

    # a failed collective ends the loop with its error instead of training forever
    with pytest.raises(RuntimeError, match="the peer is gone"):
        train_until(fails, lambda: time.sleep(0.001))


def _agree_on_uneven_ranks(rank: int, world: int, steps: bool = False) -> dict[str, float]:
    """Rank r's bare forward is 0.1 * (1 + r) s; what agree() gives it. With
    `steps`: both ranks' forward is 0.1 s, and of three steps in lockstep
    each rank was slow (0.4 s instead of 0.3) in a different one. Rank r
    measured an overhead of 0.01 * (1 + 2r) s."""
    from hemiola.advise.agreement import agree
    from hemiola.advise.instruments import Bare
    from hemiola.distributed import new_engine

    engine, _ = new_engine(timeout_s=60.0)
    param = Param(10, need=0.0, ready=0.2)
    mine = Profile(forward=0.1 * (1 + (0 if steps else rank)), backward=0.2, step=0.0,
                   params=[param], overhead={"wfbp+none": 0.01 * (1 + 2 * rank)})
    measured = Bare(0.1, 0.2, 0.0, [param], [0.3, 0.4, 0.3] if rank == 0 else [0.4, 0.3, 0.3],
                    [0.3, 0.3, 0.3])
    agreed = agree(mine, engine, measured if steps else None)
    return {"forward": agreed.forward, "compute": agreed.compute,
            "ready": agreed.params[0].ready, "slowest": agreed.meta.get("slowest_rank", 0.0),
            "lockstep": agreed.lockstep, "free": agreed.free_compute,
            "overhead": agreed.overhead["wfbp+none"]}


def test_a_synchronous_job_waits_each_step_for_the_rank_slow_then() -> None:
    # Each rank's median step is 0.3 s, but every step but one has a slow
    # rank: the job's median step is 0.4 s (and the streaming ranks', who
    # meet only every H steps, stays 0.3 s).
    results = run_local(_agree_on_uneven_ranks, 2, True, timeout_s=120)
    for r in results.values():
        assert r["compute"] == pytest.approx(0.4)
        assert r["forward"] == pytest.approx(0.1 * 4 / 3)
        assert r["lockstep"] == pytest.approx(4 / 3)
        assert r["free"] == pytest.approx(0.3)
        assert r["slowest"] == 0.0  # no rank is slower than rank 0 on its own
        assert r["overhead"] == pytest.approx(0.02)  # every rank's mean


def test_the_ranks_agree_on_rank_0s_profile_at_the_slowest_ranks_pace() -> None:
    # Rank 0 computes 0.3 s, rank 1 0.4 s: the job goes at 0.4 s, so rank
    # 0's profile is scaled by 4/3 on both ranks.
    results = run_local(_agree_on_uneven_ranks, 2, timeout_s=120)
    for r in results.values():
        assert r["compute"] == pytest.approx(0.4)
        assert r["forward"] == pytest.approx(0.1 * 4 / 3)
        assert r["ready"] == pytest.approx(0.2 * 4 / 3)
        assert r["slowest"] == pytest.approx(4 / 3)
        assert r["overhead"] == pytest.approx(0.02 * 4 / 3)  # the mean, scaled as a CPU time


@pytest.mark.parametrize("spec,words", [
    ("nocolon", "MODULE:FUNCTION"), ("test_advise:missing", "no function"),
])
def test_bad_model_specs_are_refused(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        advise.load_factory(spec)


def deep_model() -> tuple[nn.Module, object]:
    """A --model factory of sixteen 1 MiB layers: priority's 4 MiB buckets
    are five, the two front ones (a quarter of the bytes) reordered."""
    torch.manual_seed(0)
    model_ = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(16)])
    x = torch.randn(4, 512)
    return model_, lambda m: m(x).square().mean()


def test_the_profiles_priority_plan_is_the_engines_issue_order() -> None:
    """priority sends its buckets in another order than backward makes them
    (the front layers' last, front first): the profile reads the order the
    engine sends them in, and the model derives the same order itself."""
    from hemiola.advise.instruments import free_wire_step

    _, _, plan = free_wire_step(deep_model, "priority", "none", 1)
    params = [Param(512 * 512) for _ in range(16)]
    backward = sorted(plan, key=lambda bucket: -max(bucket))
    assert plan != backward
    assert plan == front_first(params, backward)
    # a profile of version 1 held priority's buckets in backward order: read,
    # they are in the engine's
    old = {**Profile(0.1, 0.1, 0.01, params, plans={"priority": backward}).to_json(),
           "version": 1}
    assert Profile.from_json(old).plans["priority"] == plan
    _, _, wfbp = free_wire_step(deep_model, "wfbp", "none", 1)
    assert wfbp == model.ddp_plan(params, model.FUSION["wfbp"])


def test_ddp_plan_is_the_engines() -> None:
    from hemiola._native import C

    mib = 1 << 20
    for sizes, cap, first in [([10 * mib, 10 * mib, 10 * mib, mib // 2, mib // 2], 15 * mib, mib),
                              ([12, 20, 28], 16, 16), ([4 * mib] * 7, 25 * mib, mib)]:
        engine = C.Engine(0, 1, C.MemoryStore())
        specs = [(int(C.DType.float32), n // 4, f"p{i}") for i, n in enumerate(sizes)]
        plan = engine.make_reducer(specs, cap, first, record_order=False).buckets()
        params = [Param(n // 4) for n in sizes]
        assert model.ddp_plan(params, cap, first) == [list(b) for b in plan]


def _profile(**kw: object) -> Profile:
    """Two parameters: p0 (front, read first, its gradient last), p1."""
    base = dict(forward=0.03, backward=0.07, step=0.01,
                params=[Param(100, need=0.0, ready=0.07), Param(300, need=0.01, ready=0.02)],
                plans={s: [[1], [0]] for s in model.SCHEDULES})
    base.update(kw)
    return Profile(**base)  # type: ignore[arg-type]


def _period(schedule: str, jobs: list[Job], contention: float = 0.0, **kw: object) -> float:
    p = _profile(**kw)
    return simulate(model._program(p, p.plans[schedule], schedule), jobs, contention)


def test_the_iteration_model_against_hand_computed_timelines() -> None:
    jobs = [Job(0.0, 0.10), Job(0.0, 0.05)]
    # wfbp: bucket 0 (p1) ready at 0.05, on the wire until 0.15; bucket 1 (p0)
    # ready at 0.10, 0.15-0.20; then the step: 0.21 per iteration.
    assert _period("wfbp", jobs) == pytest.approx(0.21)
    # priority: the forward's first read waits for p0 (bucket 1, last issued),
    # so the next forward starts 0.20 after the last one did.
    assert _period("priority", jobs) == pytest.approx(0.20)
    # decoupled: the lane's 0.15 per iteration is longer than the 0.11 of
    # computation, and the whole of it runs under the next iteration.
    assert _period("decoupled", jobs) == pytest.approx(0.15)
    # With a fast wire every schedule takes the computation's time, and
    # wfbp the last bucket's wire after backward.
    fast = [Job(0.0, 0.001), Job(0.0, 0.001)]
    assert _period("decoupled", fast) == pytest.approx(0.11)
    assert _period("wfbp", fast) == pytest.approx(0.111)
    # Contention 1: the lane's 0.02 s of CPU shares the core with the
    # computation, so under decoupled they take 0.13 together.
    cpu = [Job(0.01, 0.0), Job(0.01, 0.0)]
    assert _period("decoupled", cpu, contention=1.0) == pytest.approx(0.13)
    assert _period("decoupled", cpu, contention=0.0) == pytest.approx(0.11)
    # Half of a wire phase's time burning CPU at contention 1: the
    # computation runs at 2/3 speed while it lasts.
    burn = [Job(0.0, 0.02, 0.01), Job(0.0, 0.0)]
    assert _period("decoupled", burn, contention=1.0) == pytest.approx(0.11 + 0.02 / 3)
    # The wire twice as slow while the computation runs: wfbp's bucket 0
    # crosses 0.025 of its 0.10 under backward (0.05-0.10), the rest alone
    # (0.10-0.175); bucket 1 0.175-0.225; the step ends at 0.235.
    beside = [Job(0.0, 0.10, 0.0, 0.20), Job(0.0, 0.05, 0.0, 0.10)]
    assert _period("wfbp", beside) == pytest.approx(0.235)
    # its measured rate: a phase goes at the slower of the link and it
    slowed = _profile(wire_rate_beside=1e6)
    assert model.wire_beside(slowed, 0.1, 2e5) == pytest.approx(0.2)
    assert model.wire_beside(slowed, 0.1, 5e4) == pytest.approx(0.1)
    assert model.wire_beside(_profile(), 0.1, 2e5) == pytest.approx(0.1)
    # The wire's CPU spreads over the phase as long as it lasts: at half the
    # rate (0.04 s instead of 0.02) the computation loses 0.01 s of CPU at
    # contention 1 at 1/(1 + 0.25) speed for 0.04 s, 0.008 s in all.
    burn_beside = [Job(0.0, 0.02, 0.01, 0.04), Job(0.0, 0.0)]
    assert _period("decoupled", burn_beside, contention=1.0) == pytest.approx(0.118)
    # a measured overhead is added; one below zero (noise) cannot make a
    # configuration faster than the bare computation
    free = Network(1, 1e9)
    p = _profile(overhead={"wfbp+none": 0.004, "decoupled+none": -1.0})
    assert model.predict_one(p, free, "wfbp", "none") == pytest.approx(0.114)
    assert model.predict_one(p, free, "decoupled", "none") == pytest.approx(0.11)


def test_the_predicted_timeline_is_the_simulated_iteration() -> None:
    # The hand-computed wfbp case above, span by span.
    jobs = [Job(0.0, 0.10), Job(0.0, 0.05)]
    p = _profile()
    trace: list[Span] = []
    period = simulate(model._program(p, p.plans["wfbp"], "wfbp"), jobs, 0.0, trace=trace)
    assert period == pytest.approx(0.21)
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in trace:
        spans.setdefault((s.lane, s.name), []).append((round(s.start, 9), round(s.end, 9)))
    assert spans[("compute", "forward (0)")] == [(0.0, 0.01), (0.01, 0.03)]
    assert spans[("compute", "backward (0)")] == [(0.03, 0.05), (0.05, 0.1)]
    assert spans[("comm", "bucket 0 (0) wire")] == [(0.05, 0.15)]
    assert spans[("comm", "bucket 1 (0) wire")] == [(0.15, 0.2)]
    assert spans[("compute", "wait (0)")] == [(0.1, 0.2)]
    assert spans[("compute", "step (0)")] == [(0.2, 0.21)]
    assert spans[("compute", "forward (1)")][0] == (0.21, 0.22)
    # as Chrome trace JSON, in the engine timeline's lanes
    events = json.loads(model.predicted_timeline(p, Network(2, 1e9), "wfbp", "none"))
    lanes = {e["args"]["name"] for e in events["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {"comm", "compute"}
    assert any(e.get("cat") == "step" for e in events["traceEvents"])


def test_sharded_against_hand_computed_timelines() -> None:
    """sharded: each bucket's reduce-scatter under backward, the step waits
    for all of them and steps 1/N, each all-gather is issued after it (front
    first) and the next forward waits at each module for its own."""
    # The two buckets' all-reduces of the wfbp case above, cut in halves:
    # reduce-scatters of bucket 0 (p1) and 1 (p0), then the all-gathers of
    # bucket 1 (p0, read first) and 0.
    jobs = [Job(0.0, 0.05), Job(0.0, 0.025), Job(0.0, 0.025), Job(0.0, 0.05)]
    # From a step's end S: p0's all-gather lands at S+0.025 (the forward
    # waits for it), p1's at S+0.075 (its module reads at 0.01: waits
    # 0.04); the forward ends at S+0.095; bucket 0 is reduce-scattered from
    # S+0.115 to S+0.165, bucket 1 from then (backward filled it at S+0.165)
    # to S+0.19; the step (0.01 at one rank) ends at S+0.20.
    assert _period("sharded", jobs) == pytest.approx(0.20)
    p = _profile()
    # at two ranks the step is half as long
    assert simulate(model._program(p, p.plans["sharded"], "sharded", 2), jobs, 0.0) == \
        pytest.approx(0.195)
    # on a fast wire: the computation, its step of 1/N
    fast = [Job(0.0, 0.0)] * 4
    for world in (1, 2, 4):
        assert simulate(model._program(p, p.plans["sharded"], "sharded", world), fast,
                        0.0) == pytest.approx(0.10 + 0.01 / world)
    # as the engine's timeline names them
    trace: list[Span] = []
    simulate(model._program(p, p.plans["sharded"], "sharded"),
             model.jobs_for(p, Network(2, 1e4, latency=0.0), "sharded", "none"), 0.0,
             trace=trace)
    assert {s.name for s in trace if s.lane == "comm" and s.name.endswith("(1) wire")} == {
        "reduce-scatter 0 (1) wire", "reduce-scatter 1 (1) wire", "all-gather 0 (1) wire",
        "all-gather 1 (1) wire"}


def test_shardeds_buffers_in_flight_hold_back_its_collectives() -> None:
    """At most BUCKETS_IN_FLIGHT reduce-scatters are in flight: backward
    waits where a bucket's first gradient arrives for the oldest; the step
    issues every all-gather (they write into the parameters: no buffer
    holds them back), and the forward lands each where it reads."""
    assert model.BUCKETS_IN_FLIGHT == 2
    # four buckets of one parameter each, their gradients at 0.01 ... 0.04,
    # read in the forward in two pairs, at 0.0 and 0.001, 0.03 and 0.031
    # (bucket 3 first: the front)
    params = [Param(1 << 20, need=need, ready=0.01 * (4 - i))
              for i, need in enumerate((0.0, 0.001, 0.03, 0.031))]
    p = Profile(0.04, 0.05, 0.02, params)
    plan = model.plan_of(p, "sharded")  # 4 MiB each: the reducer's rule cuts after each
    assert plan == [[3], [2], [1], [0]]
    program = model._sharded_program(p, plan, 2)
    waits = [s.waits for s in program if s.waits]
    # the forward lands all-gather j (job 4 + j) in issue order
    assert waits[:4] == [((-1, 4),), ((-1, 5),), ((-1, 6),), ((-1, 7),)]
    assert [s.releases for s in program if s.waits][:4] == [(), (), (), ()]
    # bucket 2's first gradient waits for reduce-scatter 0, bucket 3's for 1
    assert waits[4:6] == [((0, 0),), ((0, 1),)]
    step = program[-1]
    assert step.name == "step" and step.work == pytest.approx(0.01)
    assert step.waits == tuple((0, k) for k in range(4)) and step.emits == (4, 5, 6, 7)
    # all-gathers of 0.01 s, back to back from the step: the forward waits
    # for the first (0.01) and the second (to 0.02); the pair after lands
    # under its 0.029 s between the reads.
    jobs = [Job(0.0, 0.0)] * 4 + [Job(0.0, 0.01)] * 4
    two = simulate(program, jobs, 0.0)
    assert two == pytest.approx(0.02 + 0.039 + p.backward + p.step / 2)
    # reduce-scatters of 0.02 s, their gradients 0.01 apart: with one in
    # flight backward waits at each bucket's first gradient for the last,
    # but the wire is the bottleneck either way: the limit moves the wait
    # into backward (the memory it saves), not the step's end.
    slow = [Job(0.0, 0.02)] * 4 + [Job(0.0, 0.0)] * 4
    limited = model._sharded_program(p, plan, 2, in_flight=1)
    assert [s.waits for s in limited if s.waits][4:7] == [((0, 0),), ((0, 1),), ((0, 2),)]
    assert simulate(limited, slow, 0.0) == pytest.approx(simulate(program, slow, 0.0))


def _communication_bound() -> Profile:
    """Sixteen 1 MiB layers, 130 ms of computation (a 20 ms step)."""
    n = 16
    params = [Param(1 << 18, rows=512, need=0.0025 * i, ready=0.0045 * (n - i))
              for i in range(n)]
    return Profile(forward=0.04, backward=0.07, step=0.02, params=params)


def test_sharded_prediction_is_bounded_by_the_wire_and_wfbp() -> None:
    """Where the wire dominates, sharded sends an all-reduce's bytes per
    iteration in halves, hiding them under backward and the next forward:
    never faster than one all-reduce of the model, never slower than wfbp.
    At one rank, or with a free wire, it is its computation: the bare one
    with a step of 1/N."""
    p = _communication_bound()
    model_bytes = 16 * (1 << 20)
    for world in (2, 4, 16):
        for bandwidth in (1e6, 1e7, 3e7):
            net = Network(world, bandwidth, latency=1e-5)
            wire = collective.all_reduce(net, model_bytes)
            assert wire > p.compute
            sharded = model.predict_one(p, net, "sharded", "none")
            assert wire <= sharded <= model.predict_one(p, net, "wfbp", "none"), (world,
                                                                                   bandwidth)
    for world in (1, 2, 8):
        free = Network(world, 1e15, latency=0.0)
        assert model.predict_one(p, free, "sharded", "none") == pytest.approx(
            p.forward + p.backward + p.step / world)
        assert model.computation(p, "sharded", world) == pytest.approx(
            p.forward + p.backward + p.step / world)
    assert model.predict_one(p, Network(1, 1e6), "sharded", "none") == pytest.approx(p.compute)
    no_step = replace(p, step=0.0)
    assert model.predict_one(no_step, Network(8, 1e15, latency=0.0), "sharded", "none") == \
        pytest.approx(no_step.compute)
    # the measured overhead is added, and the computation is its floor
    assert model.predict_one(replace(p, overhead={"sharded+none": 0.005}), Network(1, 1e6),
                             "sharded", "none") == pytest.approx(p.compute + 0.005)
    assert model.predict_one(replace(p, overhead={"sharded+none": -1.0}), Network(4, 1e15),
                             "sharded", "none") == pytest.approx(0.115)


def test_sharded_is_predicted_uncompressed_on_cpu_where_it_takes_the_model() -> None:
    p = _communication_bound()
    net = Network(4, 1e8)
    names = {x.name for x in model.predict(p, net)}
    assert "sharded+none" in names and not {f"sharded+{c}" for c in ("fp16", "int8",
                                                                      "powersgd")} & names
    assert len(names) == 3 * 4 + 1
    assert model.codings_of("sharded") == ("none",) and model.codings_of("wfbp") == \
        model.CODINGS
    with pytest.raises(ValueError, match="does not compress"):
        model.predict_one(p, net, "sharded", "fp16")
    # a GPU profile: sharded runs on CPU parameters only in this build
    gpu = replace(p, meta={"device": "cuda"})
    assert not model.runs(gpu, "sharded", "none") and model.runs(gpu, "wfbp", "none")
    assert "sharded" not in {x.schedule for x in model.predict(gpu, net, codings=("none",))}
    # a model it refused when measured (kept in the profile, which saves it)
    refused = replace(p, meta={"refused": {"sharded": "LBFGS is not element-wise"}})
    assert "sharded" not in {x.schedule for x in model.predict(refused, net)}
    assert Profile.from_json(refused.to_json()).meta["refused"] == refused.meta["refused"]
    with pytest.raises(ValueError, match=r"meta\['refused'\]"):
        Profile.from_json({**p.to_json(), "meta": {"refused": ["sharded"]}})
    assert "sharded: not predicted: it refused this model when measured (LBFGS" in \
        scale_report(refused, net)
    assert "sharded: not predicted: it runs on CPU" in scale_report(gpu, net)
    # the report says what it is for: memory, counted from the sizes
    text = scale_report(p, net)
    assert "sharded is for memory" in text and "4 + 12/N = 7.0 bytes per parameter" in text
    assert choice.sharded_bytes_per_param(1) == choice.DDP_BYTES_PER_PARAM
    assert choice.sharded_bytes_per_param(8) == pytest.approx(5.5)


def test_a_model_sharded_refuses_is_refused_when_measured() -> None:
    """sharded refuses what it cannot shard (here a parameter that is not
    contiguous); measuring keeps the refusal instead of failing."""
    from hemiola.advise import measure
    from hemiola.advise.instruments import free_wire_step

    def scattered() -> tuple[nn.Module, object]:
        net = nn.Linear(8, 4, bias=False)
        net.weight = nn.Parameter(torch.randn(8, 4).t())
        x = torch.randn(2, 8)
        return net, lambda m: m(x).sum()

    with pytest.raises(ValueError, match="not contiguous"):
        free_wire_step(scattered, "sharded", "none", 1)
    assert measure.REFUSING == ("sharded",)


def test_collectives_against_the_formulas() -> None:
    m = 8e6
    net = Network(4, bandwidth=1e9, latency=1e-4)
    assert collective.all_reduce(net, m) == pytest.approx(6 * 1e-4 + 1.5 * m / 1e9)
    assert collective.all_gather(net, 1000) == pytest.approx(3 * (1e-4 + 1000 / 1e9))
    assert collective.all_reduce(Network(1, 1e9), m) == 0.0
    # sharded's halves: a reduce-scatter and an all-gather of the chunks,
    # each (n-1) alpha + (n-1)/n m / bw, each sending (n-1)/n of the bucket
    for half in (collective.reduce_scatter, collective.all_gather_chunks):
        assert half(net, m) == pytest.approx(3 * 1e-4 + 0.75 * m / 1e9)
    for kind in ("reduce_scatter", "all_gather_chunks"):
        assert collective.sent_bytes(kind, 4, m) == pytest.approx(0.75 * m)
        assert collective.wire(net, [(kind, m)]) == pytest.approx(collective.all_reduce(net, m) / 2)
    assert collective.sent_bytes("all_reduce", 4, m) == pytest.approx(1.5 * m)
    tree = Network(64, bandwidth=1e9, latency=1e-4, algorithm="tree")
    assert collective.all_reduce(tree, m) == pytest.approx(12 * 1e-4 + 2 * m / 1e9)
    nodes = dict(world=32, bandwidth=1e9, latency=1e-4, gpus_per_node=8,
                 intra_bandwidth=1e11, intra_latency=1e-6)
    hier = Network(**nodes, algorithm="hierarchical")  # type: ignore[arg-type]
    assert collective.all_reduce(hier, m) == pytest.approx(
        2 * (7e-6 + 7 / 8 * m / 1e11) + 6 * 1e-4 + 1.5 * m / 1e9)
    best = Network(**nodes, algorithm="best")  # type: ignore[arg-type]
    assert collective.all_reduce(best, m) == min(
        collective.all_reduce(Network(**nodes, algorithm=a), m)  # type: ignore[arg-type]
        for a in ("ring", "tree", "hierarchical"))
    # two jobs sharing each link: the cluster simulator's 2 + eta/beta
    shared = Network(2, bandwidth=1e9, latency=0.0, sharing=2)
    assert collective.all_reduce(shared, m) == pytest.approx(m / 1e9 * (2 + 0.235 / 0.856))
    with pytest.raises(ValueError, match="multiple of --gpus-per-node"):
        Network(12, 1e9, gpus_per_node=8)
    with pytest.raises(ValueError, match="unknown algorithm"):
        Network(2, 1e9, algorithm="star")


def test_payloads_follow_the_codecs() -> None:
    bucket = [Piece(512 * 256, 4, 512), Piece(512, 4, 0)]  # a 512x256 matrix and a bias
    n = 512 * 256 + 512
    assert collective.payloads("none", bucket, 2) == [("all_reduce", 4 * n)]
    assert collective.payloads("fp16", bucket, 2) == [("all_reduce", 2 * n)]
    # int8 and int4: a ring all-reduce's bytes of the codes and one scale per
    # 256, at any number of ranks (the preview's summed codes: at most 127)
    scales = 4 * math.ceil(n / 256)
    for world in (2, 8, 256):
        assert collective.payloads("int8", bucket, world) == [("all_reduce", n + scales)]
        assert collective.payloads("int4", bucket, world) == [
            ("all_reduce", math.ceil(n / 2) + scales)]
    # PowerSGD (rank 2): the bias uncompressed, then P (512 x 2) and Q (256 x 2)
    assert collective.payloads("powersgd", bucket, 2) == [
        ("all_reduce", 4 * 512), ("all_reduce", 4 * 512 * 2), ("all_reduce", 4 * 256 * 2)]
    # a matrix too small to gain from low rank travels whole
    assert collective.payloads("powersgd", [Piece(4 * 3, 4, 4)], 2) == [("all_reduce", 48)]
    with pytest.raises(ValueError, match="at most 127 ranks"):
        collective.payloads("preview", bucket, 128)
    # int8 is predicted at 256 ranks too
    p = _profile()
    names = {x.coding for x in model.predict(p, Network(256, 1e9))}
    assert names == {"none", "fp16", "int8", "powersgd"}


def test_streaming_prediction() -> None:
    p = _profile(coding_cpu={"int8": 0.004}, overhead={"streaming-sync": 0.006})
    net = Network(2, bandwidth=1e6, latency=0.0)
    n = 400  # elements: int8 sends n bytes plus 4 per 256 of scales
    wire = 2 * (1 / 2) * n / 1e6 + (4 * math.ceil(n / 256)) / 1e6
    sync = wire + 0.010
    # blocking: the whole sync every H steps
    assert model.streaming_step(p, net, 10, 1, 0) == pytest.approx(0.11 + sync / 10)
    # where a lockstep job's step is 1.1x the ranks' own pace, streaming's
    # inner steps (the ranks meet only at syncs) go at the ranks' own pace
    assert model.streaming_step(replace(p, lockstep=1.1), net, 10, 1, 0) == pytest.approx(
        0.11 / 1.1 + sync / 10)
    # overlapped by one step: it hides; the CPU still slows the computation
    assert model.streaming_step(p, net, 10, 1, 1) == pytest.approx(0.11)
    p.contention = 1.0
    assert model.streaming_step(p, net, 10, 2, 1) == pytest.approx(0.11 + 2 * 0.005 / 10)
    # the wire slowed beside the inner steps: 408 bytes at 1 kB/s (0.418 s
    # with the CPU) no longer hide under one step of 0.11 s; what is left
    # when the step ends goes at the link's own pace (1 MB/s)
    beside = _profile(coding_cpu={"int8": 0.004}, overhead={"streaming-sync": 0.006},
                      wire_rate_beside=1e3)
    assert model.streaming_step(beside, net, 10, 1, 1) == pytest.approx(
        0.11 + (1 - 0.11 / 0.418) * sync / 10)
    assert model.streaming_step(beside, net, 10, 1, 0) == pytest.approx(0.11 + sync / 10)
    slow = Network(2, bandwidth=1e3, latency=0.0)  # 0.4 s per sync: 4 steps exposed
    assert model.streaming_step(p, slow, 10, 1, 2) == pytest.approx(
        0.11 + (0.4 + 8 / 1e3 + 0.01 - 0.22 + 0.01) / 10)
    preds = model.predict_streaming(p, slow)
    assert [x.options["sync_every"] for x in preds] == [10, 20, 50, 100]
    for x in preds:
        assert x.options["overlap"] < x.options["sync_every"] / x.options["fragments"]
    # int4, where its CPU cost is measured, sends half the bytes: at 100 B/s
    # int8's 4.1 s per sync cannot hide under 9 steps at H=10 (and int4's
    # 2.1 s neither), so int4 is faster; where both hide, int8 stays
    p.coding_cpu["int4"] = 0.004
    slower = Network(2, bandwidth=100.0, latency=0.0)
    h10 = model.predict_streaming(p, slower)[0]
    assert h10.coding == "int4" and h10.seconds == pytest.approx(min(
        model.streaming_step(p, slower, 10, f, tau, "int4")
        for f, tau in model.streaming_options(p, slower, 10, "int4")))
    assert h10.seconds < min(model.streaming_step(p, slower, 10, f, tau, "int8")
                             for f, tau in model.streaming_options(p, slower, 10, "int8"))
    assert {x.coding for x in model.predict_streaming(p, net)} == {"int8"}
    # a profile that measured other codings but not int4 is not offered it
    assert model.streaming_codings(_profile(coding_cpu={"int8": 0.004}), 2) == ["int8"]
    assert model.streaming_codings(_profile(), 2) == ["int8", "int4"]
    # int8 and int4 at any number of ranks (their codes are not summed on the
    # wire): on the slow link int4 is the faster at 8 and at 128 ranks too
    assert model.streaming_codings(p, 128) == ["int8", "int4"]
    for world in (8, 128):
        many = Network(world, bandwidth=100.0, latency=0.0)
        assert model.predict_streaming(p, many)[0].coding == "int4", world


def test_choice_tries_near_predictions_and_picks_by_measurement() -> None:
    preds = [Prediction("wfbp", "fp16", 0.50), Prediction("wfbp", "powersgd", 0.49),
             Prediction("decoupled", "none", 0.58), Prediction("priority", "none", 0.90)]
    # within 25% error of each other: 0.58 * 0.75 <= 0.49 * 1.25; 0.90 * 0.75 is not
    assert [p.name for p in choice.within_error(preds)] == [
        "wfbp+powersgd", "wfbp+fp16", "decoupled+none"]
    # the fastest measured wins ...
    measured = {"wfbp+powersgd": 0.546, "wfbp+fp16": 0.650, "decoupled+none": 0.700}
    assert choice.choose(measured, preds).name == "wfbp+powersgd"
    # ... and within NEAR (3%) of it, the least compressed
    measured["wfbp+fp16"] = 0.55
    assert choice.choose(measured, preds).name == "wfbp+fp16"
    with pytest.raises(ValueError, match="no configuration"):
        choice.choose({}, preds)
    # sharded is exact (wfbp's result): after wfbp and priority in a tie,
    # before decoupled
    assert set(choice.EXACTNESS) == set(model.SCHEDULES)
    tie = [Prediction("decoupled", "none", 0.5), Prediction("sharded", "none", 0.5),
           Prediction("wfbp", "none", 0.5)]
    even = {"decoupled+none": 0.5, "sharded+none": 0.5, "wfbp+none": 0.5}
    assert choice.choose(even, tie).name == "wfbp+none"
    assert choice.choose(even, tie[:2]).name == "sharded+none"
    assert choice.choose_predicted(tie[:2]).name == "sharded+none"


def test_the_bench_scores_the_advice_a_user_without_all_gets() -> None:
    """`hemiola bench advise` measures every configuration (--all); its
    `advised` column is the choice among the trials a user's run makes: the
    configuration measured fastest but predicted far from the fastest is
    not among them."""
    from hemiola.bench.advise import advice_without_all

    predictions = [{"schedule": "wfbp", "coding": "none", "seconds": 0.30},
                   {"schedule": "wfbp", "coding": "fp16", "seconds": 0.31},
                   {"schedule": "decoupled", "coding": "fp16", "seconds": 0.60}]
    measured = {"wfbp+none": 0.36, "wfbp+fp16": 0.35, "decoupled+fp16": 0.20}
    assert advice_without_all(predictions, measured) == "wfbp+none"  # within 3%: uncompressed
    measured["wfbp+fp16"] = 0.33
    assert advice_without_all(predictions, measured) == "wfbp+fp16"


def test_streaming_is_advised_only_where_per_step_wastes_the_computation() -> None:
    s = [Prediction("streaming", "int8", t, {"sync_every": h, "fragments": 1, "overlap": 0})
         for h, t in [(10, 0.15), (20, 0.12), (50, 0.105), (100, 0.102)]]
    assert choice.streaming_advice(0.1, 0.19, s) is None  # utilisation 0.53
    advice = choice.streaming_advice(0.1, 0.25, s)  # 0.4: the smallest H reaching 0.9
    assert advice is not None and advice.options["sync_every"] == 50
    slow = [Prediction("streaming", "int8", 1.0, {"sync_every": h}) for h in (10, 100)]
    advice = choice.streaming_advice(0.1, 0.5, slow)
    assert advice is not None and advice.options["sync_every"] == 100
    # streaming's utilisation is of the ranks' own pace: at 0.0925 s H=50
    # reaches only 0.88, H=100 0.91
    advice = choice.streaming_advice(0.1, 0.25, s, free_compute=0.0925)
    assert advice is not None and advice.options["sync_every"] == 100


def test_the_ranks_peer_wait_is_what_a_measured_reduction_takes_beyond_the_model() -> None:
    """The peer wait of a coding is its reduction measured on the link less the
    model's (coding CPU, then the collectives), at least 0; it is spent on
    the lane of every bucket by its collectives (the ranks meet at each),
    and only where there are ranks to meet."""
    from hemiola.advise.measure import with_peer_wait

    link = Link(2, 1e-4, 1e8)
    p = _profile(link=link, coding_cpu={"none": 0.004, "powersgd": 0.008})
    net = Network(2, link.bandwidth, latency=link.latency)
    alone = {c: model.reduction_alone(p, net, c) for c in ("none", "powersgd")}
    # by hand: 400 floats (1600 bytes) in two buckets, each a ring all-reduce
    wire = sum(collective.all_reduce(net, 4 * n) for n in (300, 100))
    assert alone["none"] == pytest.approx(0.004 + wire)
    p.reduce = {"none": alone["none"] - 0.001, "powersgd": alone["powersgd"] + 0.006}
    p = with_peer_wait(p)
    met = p.peer_wait
    assert met["none"] == 0.0  # a reduction faster than the model is no negative peer wait
    assert met["powersgd"] == pytest.approx(0.006)
    jobs = model.jobs_for(p, net, "wfbp", "powersgd")
    bare = model.jobs_for(p, net, "wfbp", "powersgd", peer_wait=False)
    # two buckets of one vector each: one collective each, half the peer wait each
    assert [j.cpu - b.cpu for j, b in zip(jobs, bare)] == pytest.approx([0.003, 0.003])
    # p1 as a 30 x 10 matrix: PowerSGD's P and Q, two collectives for bucket 0
    # and one for bucket 1, so the measured reduction met three times
    m = replace(p, params=[p.params[0], replace(p.params[1], rows=30)])
    met = [j.cpu - b.cpu for j, b in zip(model.jobs_for(m, net, "wfbp", "powersgd"),
                                           model.jobs_for(m, net, "wfbp", "powersgd",
                                                          peer_wait=False))]
    assert met == pytest.approx([0.004, 0.002])
    # priority's plan of the same buckets meets as often
    assert sum(j.cpu for j in model.jobs_for(p, net, "priority", "powersgd")) == \
        pytest.approx(sum(j.cpu for j in jobs))
    assert model.jobs_for(p, Network(1, 1e8), "wfbp", "powersgd") == \
        model.jobs_for(p, Network(1, 1e8), "wfbp", "powersgd", peer_wait=False)
    # wfbp waits for every bucket at the end of backward: the peer wait adds there
    # (the last bucket's share: the first one's meets under the computation)
    assert model.predict_one(p, net, "wfbp", "powersgd") > \
        model.predict_one(replace(p, peer_wait={}), net, "wfbp", "powersgd")
    # streaming's syncs meet too: int8 met 4 ms over the plan's four
    # collectives (two buckets, a scale all-gather and a code all-reduce each),
    # and a fragment's sync is two of them, however large the fragment
    s8 = replace(p, peer_wait={"int8": 0.004})
    for fragments in (1, 2):
        assert model._sync(s8, net, fragments, "int8")[2] == pytest.approx(
            model._sync(replace(s8, peer_wait={}), net, fragments, "int8")[2] + 0.002)
    # a slower machine meets more slowly too (Gloo's waiting threads spin on the CPU)
    assert p.scaled(2.0).peer_wait["powersgd"] == pytest.approx(0.012)


def test_profiles_round_trip_and_bad_ones_are_refused(tmp_path: Path) -> None:
    p = _profile(link=Link(2, 1e-4, 1e8), coding_cpu={"none": 0.001})
    path = tmp_path / "p.json"
    p.save(path)
    assert Profile.load(path) == p
    # a machine twice as slow: every CPU time doubles, the link stays
    slow = p.scaled(2.0)
    assert (slow.compute, slow.params[1].ready, slow.coding_cpu["none"]) == (0.22, 0.04, 0.002)
    assert slow.link == p.link
    data = json.loads(path.read_text())
    for change, words in [({"version": 99}, "version 99"), ({"forward": -1}, "forward"),
                          ({"params": []}, "params is empty"),
                          ({"plans": {"wfbp": [[0]]}}, "wfbp plan must hold every"),
                          ({"peer_wait": {"int8": -0.1}}, r"peer_wait\['int8'\] is negative")]:
        path.write_text(json.dumps({**data, **change}))
        with pytest.raises(ValueError, match=words):
            Profile.load(path)
    path.write_text(json.dumps({"forward": 1}))
    with pytest.raises(ValueError, match="not a hemiola advise profile"):
        Profile.load(path)


def test_a_profile_written_before_peer_wait_was_named_so_still_loads(tmp_path: Path) -> None:
    """Committed profiles (docs/results) call ``peer_wait`` ``meeting``: it
    is read under that name, with the same numbers, and saved under the new
    one; a profile giving both names is refused."""
    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    path = results / "advise-worlds-2026-11-28-mlp-small-150mbit.profile.json"
    data = json.loads(path.read_text())
    profile = Profile.load(path)
    assert data["meeting"] and profile.peer_wait == data["meeting"]
    written = tmp_path / "p.json"
    profile.save(written)
    again = json.loads(written.read_text())
    assert "meeting" not in again and again["peer_wait"] == data["meeting"]
    written.write_text(json.dumps({**again, "meeting": data["meeting"]}))
    with pytest.raises(ValueError, match="both peer_wait and meeting"):
        Profile.load(written)


def test_predicting_a_cluster_from_a_written_profile(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # A profile written by hand (no measurements but times and sizes).
    path = tmp_path / "hand.json"
    path.write_text(json.dumps({
        "forward": 0.03, "backward": 0.06, "step": 0.01,
        "params": [{"numel": 1_000_000, "rows": 1000, "need": 0.0, "ready": 0.06},
                   {"numel": 4_000_000, "rows": 2000, "need": 0.01, "ready": 0.02}]}))
    args = argparse.Namespace(world=64, rate=10.0, latency_us=25.0, gpus_per_node=8,
                              intra_rate=1200.0, algorithm="best", sharing=1, profile=str(path),
                              model=None, repeats=1, save_profile=None)
    assert advise.cli._predict_elsewhere(args) == 0
    out = capsys.readouterr().out
    assert "Predicted at 64 ranks, 8 per node, 10 Gbit/s" in out
    assert out.count("utilisation") == 12 + 1 + 4 and "Use: hemiola.wrap(" in out
    # sharded's memory at 64 ranks, counted: 4 + 12/64 bytes per parameter of 5M
    assert "4 + 12/N = 4.2 bytes per parameter (20.0 MiB for these 5.00M parameters) " \
        "against DDP's 16 and more (76.3 MiB" in out
    args.rate = None
    with pytest.raises(ValueError, match="give --rate"):
        advise.cli._predict_elsewhere(args)


def test_a_flop_clock_profile_places_reads_and_gradients() -> None:
    from hemiola.bench.advise_scale import flop_profile

    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(100, 200), nn.ReLU(), nn.Linear(200, 10))
        x, y = torch.randn(64, 100), torch.randint(0, 10, (64,))
    p = flop_profile(net, lambda m: nn.functional.cross_entropy(m(x), y), 0.3)
    assert p.forward + p.backward == pytest.approx(0.3)
    # forward: 2*64*100*200 + 2*64*200*10 FLOPs; backward: both weights'
    # gradients and the second layer's input gradient (the input needs none)
    forward, backward = 2 * 64 * (100 * 200 + 200 * 10), 2 * 64 * (100 * 200 + 2 * 200 * 10)
    assert p.backward / p.forward == pytest.approx(backward / forward)
    w0, b0, w1, b1 = p.params
    assert w0.need == 0.0 and 0 < w1.need < p.forward
    assert 0 < w1.ready < w0.ready <= p.backward
    assert p.meta["device"] == "cuda" and [q.rows for q in p.params] == [200, 0, 10, 0]


def test_measuring_says_what_it_measures(capsys: pytest.CaptureFixture[str]) -> None:
    from hemiola.advise.measure import Progress
    Progress(3, 0).step("the bare steps")
    Progress(3, 1).step("the bare steps")  # other ranks stay quiet
    err = capsys.readouterr().err
    assert err.count("hemiola advise: measuring the bare steps (1/3, ") == 1


def test_streaming_prediction_with_a_replica_per_node() -> None:
    # Two nodes of four GPUs: a replica is a node. Its inner step is wfbp
    # over the node's link (NVLink-class: its all-reduce hides), and the
    # outer sync crosses the nodes' link once per fragment, as one rank per
    # node would: the same as a run of 2 ranks on that link, plus the inner
    # step's own cost.
    p = _profile(coding_cpu={"int8": 0.004}, overhead={"streaming-sync": 0.006})
    nodes = Network(8, bandwidth=1e6, latency=0.0, gpus_per_node=4)
    inside, across = model.replica_networks(nodes)
    assert inside is not None and (inside.world, inside.bandwidth) == (4, nodes.intra_bandwidth)
    assert (across.world, across.bandwidth) == (2, 1e6)
    alone = Network(2, bandwidth=1e6, latency=0.0)
    inner = model.predict_one(p, inside, "wfbp", "none")
    assert inner >= p.free_compute
    for f, tau in ((1, 0), (2, 1)):
        assert model.streaming_step(p, nodes, 10, f, tau) == pytest.approx(
            model.streaming_step(p, alone, 10, f, tau) - p.free_compute + inner)
    # one node, or one GPU per node: every rank a replica, as before
    assert model.replica_networks(Network(4, 1e6, gpus_per_node=4)) == (
        None, Network(4, 1e6, gpus_per_node=4))
    assert model.replica_networks(alone)[0] is None

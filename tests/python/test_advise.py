"""``hemiola advise``: it measures, predicts every configuration, runs the one
it picks and reports both; bad --model values are refused with the form."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hemiola import advise
from hemiola.launch import run_local


def small_model() -> tuple[nn.Module, object]:
    """A --model factory: (model, loss_fn)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return model, lambda m: nn.functional.cross_entropy(m(x), y)


def test_advise_measures_predicts_and_checks_its_choice() -> None:
    results = run_local(advise.advise_rank, 2, "test_advise:small_model", None, 3, 4,
                        timeout_s=300)
    r0, r1 = results[0], results[1]
    # The ranks agree on the measurements, so on the choice.
    assert r0["measured"] == r1["measured"]
    assert r0["predictions"] == r1["predictions"]
    predictions = r0["predictions"]
    assert len(predictions) == 3 * len(advise.CODINGS)
    assert [p["seconds"] for p in predictions] == sorted(p["seconds"] for p in predictions)
    assert all(p["seconds"] > 0 for p in predictions)
    m = r0["measured"]
    assert 0 < m["forward"] < m["compute"]
    assert set(m["reduce"]) == {name for name, _ in advise.CODINGS}
    assert all(v > 0 for v in m["reduce"].values())
    assert r0["run_seconds"] > 0
    assert r0["choice"] in predictions
    text = advise.report(r0, 2)
    assert "Use: hemiola.wrap(model, optimizer, schedule=" in text
    assert "measured against" in text


@pytest.mark.parametrize("spec,words", [
    ("nocolon", "MODULE:FUNCTION"), ("test_advise:missing", "no function"),
])
def test_bad_model_specs_are_refused(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        advise.load_factory(spec)


def _profile(nbytes: list[int], first_cap: int = 1 << 20,
             cap: int = 25 << 20) -> list[tuple[float, float]]:
    """bucket_profile over the engine's own plan of float32 gradients of `nbytes`."""
    from hemiola._native import C

    engine = C.Engine(0, 1, C.MemoryStore())
    specs = [(int(C.DType.float32), n // 4, f"p{i}") for i, n in enumerate(nbytes)]
    plan = engine.make_reducer(specs, cap, first_cap, record_order=False).buckets()
    return advise.bucket_profile(nbytes, plan)


def test_bucket_profile_follows_ddps_rule() -> None:
    mib = 1 << 20
    # registration order; backward (and the buckets) run from the last
    profile = _profile([10 * mib, 10 * mib, 10 * mib, mib // 2, mib // 2], cap=15 * mib)
    # first bucket: the two halves (reaches 1 MiB); then 10 + 10 reaches 15;
    # the last 10 MiB closes at the end
    assert profile == [(1 / 31, 1 / 31), (20 / 31, 21 / 31), (10 / 31, 1.0)]
    assert advise.bucket_profile([], []) == []
    assert sum(s for s, _ in _profile([12, 20, 28], first_cap=16, cap=16)) == 1.0


def test_predictions_follow_the_model() -> None:
    # Communication longer than the computation, even compressed: decoupled
    # hides the most of it, with the smallest all-reduce.
    m = advise.Measured(compute=0.1, forward=0.03, buckets=[(0.25, 0.25), (0.75, 1.0)],
                        reduce={"none": 0.3, "fp16": 0.2, "int8": 0.15, "powersgd": 0.14},
                        compute_under={name: 0.12 for name, _ in advise.CODINGS})
    predictions = advise.predict(m)
    best = predictions[0]
    assert (best.schedule, best.coding) == ("decoupled", "powersgd")
    assert best.seconds == pytest.approx(0.14)
    # int8 is within 5%? No (0.15 > 0.147): the fastest is the advice.
    assert advise.choose(predictions) == best
    by = {(p.schedule, p.coding): p.seconds for p in predictions}
    # bucket 0 ready at 0.25 b, reduced by 0.25 b + 0.25 r; bucket 1 starts
    # then (it is ready at b = 0.07 < 0.0925), and takes 0.75 r
    assert by["wfbp", "none"] == pytest.approx(0.03 + 0.25 * 0.07 + 0.3)
    assert by["priority", "none"] == pytest.approx(0.03 + 0.25 * 0.07 + 0.3 - 0.015)
    # a reduction shorter than the backward waits for the last bucket to be ready
    assert by["wfbp", "powersgd"] == pytest.approx(max(0.12, 0.03 + 0.07 + 0.75 * 0.14))
    fast = advise.Measured(compute=0.1, forward=0.03, buckets=[(0.25, 0.25), (0.75, 1.0)],
                           reduce={name: 0.01 for name, _ in advise.CODINGS},
                           compute_under={name: 0.105 for name, _ in advise.CODINGS})
    # Where the computation dominates, every schedule is bounded by it, but
    # wfbp's last bucket still travels after backward (0.75 r = 7.5 ms).
    by = {(p.schedule, p.coding): p.seconds for p in advise.predict(fast)}
    for (schedule, _), seconds in by.items():
        assert seconds == pytest.approx(0.1075 if schedule == "wfbp" else 0.105)
    # A tie: the least compressed, least approximate configuration.
    choice = advise.choose(advise.predict(fast))
    assert (choice.schedule, choice.coding) == ("wfbp", "none")

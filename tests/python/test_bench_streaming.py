"""``hemiola bench streaming``: contender names, the bytes-per-token formula,
and a short run of the whole suite on loopback (two real ranks) whose result
lines carry every field the table reads (no wall-clock assertions)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hemiola.bench import report
from hemiola.bench.record import read_lines
from hemiola.bench.streaming import default_contenders
from hemiola.bench.streaming_rank import CODING_BYTES, Spec, bytes_per_token, parse

ROOT = Path(__file__).resolve().parents[2]
HAVE_TORCHFT = importlib.util.find_spec("torchft") is not None


def bench(*args: str) -> None:
    """``hemiola bench ARGS`` in its own processes; fails the test with its
    output when it fails."""
    out = subprocess.run([sys.executable, "-m", "hemiola", "bench", *args],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_contender_names() -> None:
    assert parse("compute") == Spec("compute", "compute", h=0)
    assert parse("ddp") == Spec("ddp", "ddp")
    assert parse("decoupled+int8") == Spec("decoupled+int8", "hemiola", coding="int8")
    assert parse("streaming-h20-f2t1+int8") == Spec("streaming-h20-f2t1+int8", "streaming",
                                                    20, 2, 1, "int8")
    assert parse("torchft-h50") == Spec("torchft-h50", "torchft", 50)
    assert parse("streaming-h20+int4") == Spec("streaming-h20+int4", "streaming", 20,
                                               coding="int4")
    assert parse("decoupled+int4") == Spec("decoupled+int4", "hemiola", coding="int4")
    assert "F=2 τ=1" in parse("streaming-h20-f2t1").label
    assert parse("torchft-h20-f2t5@lr1m0~mix0.5") == Spec(
        "torchft-h20-f2t5@lr1m0~mix0.5", "torchft", 20, 2, 5, "", 1.0, 0.0, 0.5)
    for bad in ("streaming-h4-f2t2", "torchft-h20+int8", "torchft-h20-auto", "torchft-h10-f3t1",
                "streaming-h10+zip", "nope"):
        with pytest.raises(ValueError):
            parse(bad)
    names = default_contenders([10, 20])
    assert names[:3] == ["compute", "ddp", "decoupled+int8"] and len(names) == 13
    for name in names:
        parse(name)


def test_bytes_per_token() -> None:
    p, tokens = 1000, 100
    # two ranks: a ring all-reduce sends the payload once per rank
    assert bytes_per_token(parse("ddp"), p, 2, tokens) == 4 * p / tokens
    assert bytes_per_token(parse("compute"), p, 2, tokens) == 0.0
    assert bytes_per_token(parse("streaming-h20"), p, 2, tokens) == 4 * p / (20 * tokens)
    int8 = bytes_per_token(parse("streaming-h20-f2t1+int8"), p, 2, tokens)
    assert int8 == pytest.approx(CODING_BYTES["int8"] * p / (20 * tokens))
    # decoupled under AdamW sends its one-byte preview codes as well
    per_step = bytes_per_token(parse("decoupled+int8"), p, 2, tokens, "AdamW")
    assert per_step == pytest.approx((CODING_BYTES["int8"] + 1) * p / tokens)
    # int4: half a byte per element, plus int8's 4-byte scale per 256
    int4 = bytes_per_token(parse("streaming-h20+int4"), p, 2, tokens)
    assert int4 == pytest.approx((0.5 + 4 / 256) * p / (20 * tokens))
    assert bytes_per_token(parse("decoupled+int8"), p, 2, tokens, "SGD") == pytest.approx(
        CODING_BYTES["int8"] * p / tokens)
    assert bytes_per_token(parse("decoupled-own"), p, 2, tokens, "AdamW") == 4 * p / tokens
    # four ranks: 2 (N-1)/N = 1.5 of the payload
    assert bytes_per_token(parse("ddp"), p, 4, tokens) == 1.5 * 4 * p / tokens


def test_streaming_suite_on_loopback(tmp_path: Path) -> None:
    """A few steps of every kind of contender on two ranks over loopback;
    torchft's DiLoCo runs when torchft is installed and is a skipped row otherwise."""
    contenders = ("compute,ddp,decoupled+int8,streaming-h3,streaming-h4-f2t1+int8,torchft-h3,"
                  "torchft-h2")
    bench("streaming", "--rates", "none", "--steps", "6",
          "--eval-every", "3", "--eval-windows", "4", "--contenders", contenders,
          "--port", "29850", "--out", str(tmp_path))
    rows = read_lines(tmp_path / "streaming.jsonl")
    runs = [r for r in rows if r["row"] == "run"]
    expected = contenders.split(",")
    if not HAVE_TORCHFT:
        expected = expected[:-2]
        skipped = [r for r in rows if r["row"] == "skipped"]
        assert [r["contender"] for r in skipped] == ["torchft-h3", "torchft-h2"]
        assert "not installed" in skipped[0]["reason"]
    assert [r["contender"] for r in runs] == expected
    target = runs[0]["target_loss"]
    for r in runs:
        assert (r["suite"], r["rate"], r["world"], r["steps"], r["seed"]) == (
            "streaming", "none", 2, 6, 0)
        assert r["ms_per_step"] > 0 and r["compute_utilisation"] > 0
        # the job's time is its slowest rank's
        assert len(r["ms_per_step_ranks"]) == 2
        assert r["ms_per_step"] == max(r["ms_per_step_ranks"])
        # so is each evaluation's time, and with it the time to the target
        for e in r["evals"][1:]:
            assert len(e["seconds_ranks"]) == 2 and e["seconds"] == max(e["seconds_ranks"])
        assert [e["step"] for e in r["evals"]] == [0, 3, 6]
        assert r["heldout_loss"] == r["evals"][-1]["heldout_loss"] > 0
        assert r["target_loss"] == target
        assert r["bytes_per_token_measured"] is None  # loopback: not measured
        for key in ("date", "commit", "torch", "cpu", "params", "label", "final_train_loss"):
            assert key in r
    by = {r["contender"]: r for r in runs}
    assert by["compute"]["bytes_per_token"] == 0.0 and by["compute"]["compute_utilisation"] == 1
    assert by["ddp"]["bytes_per_token"] == pytest.approx(
        4 * by["ddp"]["params"] / by["ddp"]["tokens_per_rank_step"])
    assert by["streaming-h3"]["bytes_per_token"] == pytest.approx(
        by["ddp"]["bytes_per_token"] / 3)
    assert by["streaming-h3"]["rank0_syncs"] == 2  # after steps 3 and 6
    assert by["streaming-h4-f2t1+int8"]["rank0_inner_steps"] == 6
    if HAVE_TORCHFT:  # two DiLoCo contenders side by side (a lighthouse each)
        assert by["torchft-h2"]["bytes_per_token"] == pytest.approx(
            by["ddp"]["bytes_per_token"] / 2)
    # the worst final loss among the communicating contenders is the default target
    assert max(r["heldout_loss"] for r in runs if r["contender"] != "compute") == target
    table = report.render(rows, "streaming.jsonl")
    assert "hemiola streaming H=3" in table and "torch DDP" in table
    assert ("torchft DiLoCo H=3" in table) if HAVE_TORCHFT else ("skipped" in table)


@pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed")
def test_torchft_is_given_the_same_fragments_delay_mix_and_outer_step(tmp_path: Path) -> None:
    """torchft's DiLoCo with two fragments trains as hemiola's streaming with
    the same H, fragments, delay, merge and outer step: blocking, the same
    held-out loss to float32's precision (the same cut, the same averages);
    with a delay, within 0.5% (torchft sends a fragment tau steps before its
    step and lands it there, hemiola sends at its step and lands it tau
    later). A run that stepped the fragments not being synced (one outer
    optimizer over the whole model) ended far above."""
    pairs = ["h4-f2t0@lr1m0", "h4-f2t1@lr1m0~mix0.5"]
    contenders = ",".join(f"{kind}-{p}" for p in pairs for kind in ("streaming", "torchft"))
    bench("streaming", "--rates", "none", "--steps", "8",
          "--eval-every", "8", "--eval-windows", "16", "--contenders", contenders,
          "--port", "29870", "--out", str(tmp_path))
    loss = {r["contender"]: r["heldout_loss"] for r in read_lines(tmp_path / "streaming.jsonl")
            if r["row"] == "run"}
    for p, rel in zip(pairs, (1e-6, 5e-3)):
        assert loss[f"torchft-{p}"] == pytest.approx(loss[f"streaming-{p}"], rel=rel), loss
        assert loss[f"torchft-{p}"] < 0.9 * 5.545  # trained from ln(256), not thrown back


def test_groups_suite_on_loopback(tmp_path: Path) -> None:
    """Two sites of two ranks on loopback (LOCAL_WORLD_SIZE 2: the groups
    contender's replica_ranks left to its default): the three contenders
    run, and the streaming ones' shared copies are bitwise equal on all four
    ranks."""
    bench("groups", "--rate", "none", "--steps", "6",
          "--block", "3", "--sync-every", "3", "--fragments", "1", "--overlap", "0",
          "--port", "29880", "--out", str(tmp_path))
    rows = {r["contender"]: r for r in read_lines(tmp_path / "groups.jsonl")}
    assert set(rows) == {"inside", "groups", "each"}
    for name in ("groups", "each"):
        assert rows[name]["syncs"] == 2 and rows[name]["shared_spread"] == 0.0, rows[name]
        assert rows[name]["link_bytes_per_sync"] is None  # loopback: no link to count
    assert rows["inside"]["syncs"] == 0
    assert all(r["ms_per_step"] > 0 for r in rows.values())


def test_horizon_intervals() -> None:
    from hemiola.bench.horizon import interval

    assert interval([2.0]) == (2.0, None)
    mean, half = interval([1.0, 2.0, 3.0])
    # t(0.975, 2 degrees of freedom) = 4.3027; standard error 1 / sqrt(3)
    assert mean == 2.0 and half == pytest.approx(4.3027 / 3 ** 0.5, rel=1e-4)


def test_horizon_suite_on_loopback(tmp_path: Path) -> None:
    """Two seeds of the three runs per replica count; the summary pairs each
    contender with DDP and one replica alone on the same seed."""
    bench("horizon", "--task", "lm", "--rate", "none",
          "--steps", "4", "--eval-every", "2", "--eval-windows", "4", "--ddp-timing-steps", "2",
          "--seeds", "2", "--contenders", "compute,streaming-h2@lr1m0", "--port", "29890",
          "--out", str(tmp_path))
    rows = read_lines(tmp_path / "horizon.jsonl")
    runs = [r for r in rows if r["suite"] == "streaming"]
    assert {(r["phase"], r["contender"]) for r in runs} == {
        ("quality", "ddp"), ("ddp-timing", "compute"), ("ddp-timing", "ddp"),
        ("main", "compute"), ("main", "streaming-h2@lr1m0")}
    summary = {r["contender"]: r for r in rows if r["suite"] == "horizon"}
    assert list(summary) == ["compute", "streaming-h2@lr1m0", "ddp"]
    ddp = {r["seed"]: r["heldout_loss"] for r in runs if r["phase"] == "quality"}
    mine = {r["seed"]: r["heldout_loss"] for r in runs if r["contender"] == "streaming-h2@lr1m0"}
    bare = {r["seed"]: r["heldout_loss"] for r in runs
            if r["phase"] == "main" and r["contender"] == "compute"}
    s = summary["streaming-h2@lr1m0"]
    assert s["seeds"] == [10, 11] and s["world"] == 2
    assert s["vs_ddp"][0] == pytest.approx(
        sum(mine[k] / ddp[k] - 1 for k in ddp) / 2)
    assert s["vs_one_replica"][0] == pytest.approx(sum(mine[k] - bare[k] for k in ddp) / 2)
    assert s["vs_ddp"][1] is not None  # two seeds: an interval
    assert summary["ddp"]["vs_ddp"] == [0.0, 0.0]  # (JSON: lists)
    assert summary["compute"]["vs_one_replica"] == [0.0, 0.0]
    # the main run's target was DDP's final loss on its seed
    assert {r["target_loss"] for r in runs if r["phase"] == "main" and r["seed"] == 10} == {ddp[10]}
    table = report.render([r for r in rows if r["suite"] == "horizon"], "horizon.jsonl")
    assert "vs one replica" in table and "hemiola streaming H=2" in table

"""Wire compression (``compression=`` / ``register_comm_hook``): against
torch DDP's hooks, under every schedule, across a checkpoint, and refused
where it cannot work. The codings themselves are checked bit for bit against
references in tests/cpp/test_wire_codec.cpp."""

from __future__ import annotations

import pytest
import torch

import hemiola
from hemiola.launch import run_local

import compression_workers as cw


def test_the_codings_and_where_they_run_come_from_the_engine() -> None:
    from hemiola._native import C
    from hemiola.config import COMPRESSIONS, compression_code

    # hemiola/config.h's Compression, as the binding reports it.
    assert C.compressions() == {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "powersgd": 4,
                                "int4": 5}
    assert COMPRESSIONS == {n: c for n, c in C.compressions().items() if n != "none"}
    assert compression_code(None) == 0 and compression_code("powersgd") == 4
    assert C.codings("cpu") == ["none", "fp16", "bf16", "int8", "powersgd", "int4"]
    assert C.codings("cuda") == ["none", "fp16", "bf16"]
    with pytest.raises(Exception, match="'cpu' or 'cuda'"):
        C.codings("tpu")


@pytest.mark.parametrize("via_hook", [False, True])
def test_fp16_equals_ddp_with_fp16_compress_hook(via_hook: bool) -> None:
    results = run_local(cw.fp16_vs_ddp_hook, 2, "mlp", via_hook, timeout_s=120)
    for r in results.values():
        assert r["compression"] == "fp16"
        # Two ranks: the same casts, the same half-precision sum, bit for bit.
        assert r["max_diff"] == 0.0, r
        assert r["ddp"] == r["hemiola"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("compression", ["fp16", "bf16", "int8", "powersgd", "int4"])
def test_every_schedule_under_compression(world: int, compression: str) -> None:
    runs = {
        schedule: run_local(cw.compressed_run, world, schedule, compression, "mlp", "sgd", 8,
                            timeout_s=240)
        for schedule in ("wfbp", "priority", "decoupled")
    }
    plain = run_local(cw.compressed_run, world, "wfbp", None, "mlp", "sgd", 8, timeout_s=240)
    for schedule, results in runs.items():
        # Ranks bitwise identical.
        for rank in range(1, world):
            for a, b in zip(results[0]["params"], results[rank]["params"]):
                assert torch.equal(a, b), f"{schedule}: rank {rank} differs from rank 0"
        # Close to the uncompressed run, and still training.
        diff = max((a - b).abs().max().item()
                   for a, b in zip(results[0]["params"], plain[0]["params"]))
        assert diff < {"int8": 0.05, "powersgd": 0.1}.get(compression, 0.02), (schedule, diff)
        losses = results[0]["losses"]
        assert sum(losses[-3:]) < sum(losses[:3]), (schedule, losses)
    # priority is exact: the step with what the compressed all-reduce
    # delivered, which is wfbp's (same plan, same codes).
    for a, b in zip(runs["wfbp"][0]["params"], runs["priority"][0]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("schedule,compression",
                         [("wfbp", "int8"), ("priority", "int8"), ("wfbp", "int4")])
def test_int8_checkpoint_carries_the_error_feedback(schedule: str, compression: str) -> None:
    # (decoupled is left out: a fresh wrap's first iteration is synchronous,
    # so even uncompressed its resumed run is not the straight run bit for bit.)
    results = run_local(cw.int8_resume, 2, schedule, 8, 4, {"compression": compression},
                        timeout_s=240)
    for r in results.values():
        assert r["residual_norm"] > 0, r
        assert r["keys"], r
        assert r["resumed_diff"] == 0.0, r
        assert r["forgetful_diff"] > 0.0, r


def test_hooks_hemiola_cannot_honour_are_refused_with_what_to_do() -> None:
    r = run_local(cw.comm_hook_errors, 2, timeout_s=120)[0]
    assert "fp16_compress_hook" in r["custom"] and "compression=" in r["custom"], r
    assert "register powerSGD_hook" in r["batched"], r
    assert "use_error_feedback=False" in r["no-feedback"], r
    assert "use_error_feedback=True" in r["no-feedback"], r
    assert "register bf16_compress_hook" in r["wrapped-fp16-hook"], r
    assert r["fp16-wrapper"] == "fp16" and r["bf16-wrapper"] == "bf16", r
    assert r["allreduce"] == "None"
    assert r["powersgd"] == "powersgd 3 7", r  # the state's rank and first iteration
    assert "before the first backward" in r["late"], r


def test_ranks_that_register_different_hooks_fail_fast() -> None:
    results = run_local(cw.mismatched_hooks, 2, timeout_s=120)
    for message in results.values():
        assert "different hooks" in message and "fp16" in message and "bf16" in message


@pytest.mark.parametrize("options,words", [
    ({"compression": "zip"}, "available"), ({"compression": 8}, "available"),
    ({"compression": "powersgd", "powersgd_rank": 0}, "powersgd_rank"),
    ({"compression": "powersgd", "powersgd_start_iter": -1}, "powersgd_start_iter"),
])
def test_bad_compression_values_are_refused_at_wrap(options: dict[str, object],
                                                     words: str) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=words):
        hemiola.wrap(model, opt, **options)


def test_powersgd_hook_trains_like_ddp_with_it() -> None:
    # Not bit for bit (each draws its own random start for Q), but the same
    # method: both follow the uncompressed run's loss closely.
    r = run_local(cw.powersgd_vs_ddp_hook, 2, timeout_s=180)[0]
    for kind in ("ddp", "hemiola"):
        assert r[kind][-1] < r[kind][0], r
        gap = max(abs(a - b) for a, b in zip(r[kind], r["plain"]))
        assert gap < 0.1 * r["plain"][0], (kind, gap, r)
    assert r["ddp"][:2] == r["hemiola"][:2] == r["plain"][:2]  # warm-up: uncompressed


def test_powersgd_hooks_map_to_powersgd_under_every_schedule() -> None:
    """powerSGD_hook and fp16_compress_wrapper(powerSGD_hook), the default of
    public DDP scripts, registered under priority (whose 4 MiB partitions,
    planned at wrap, would cut the 1100 x 1000 matrix: the buckets are
    planned again), wfbp and decoupled: each is compression='powersgd', bit
    for bit where the schedules are (priority and wfbp), and the wrapper says
    its factors travel in float32."""
    r = run_local(cw.powersgd_hooks_under_every_schedule, 2, timeout_s=180)
    for rank in (0, 1):
        runs = r[rank]
        reference = runs["wrap"]
        for name in ("priority-hook", "priority-fp16-wrapper", "wfbp-hook"):
            assert runs[name]["compression"] == "powersgd", name
            for a, b in zip(runs[name]["params"], reference["params"]):
                assert torch.equal(a, b), name
        assert runs["priority-hook"]["buckets"] == reference["buckets"]
        # one piece: planned again without priority's partitions
        assert sum(b.count("net.2.weight") for b in runs["priority-hook"]["buckets"]) == 1
        moved = max((a - b).abs().max().item() for a, b in
                    zip(reference["params"], runs["uncompressed"]["params"]))
        assert moved > 0, "PowerSGD compressed nothing"
        for name in ("priority-fp16-wrapper", "decoupled-fp16-wrapper"):
            assert any("float32" in w for w in runs[name]["warnings"]), runs[name]["warnings"]
        assert runs["decoupled-fp16-wrapper"]["compression"] == "powersgd"
        assert not runs["priority-hook"]["warnings"]
    for a, b in zip(r[0]["decoupled-fp16-wrapper"]["params"],
                    r[1]["decoupled-fp16-wrapper"]["params"]):
        assert torch.equal(a, b)


"""schedule="streaming" (DiLoCo / Streaming DiLoCo): the math against DiLoCo
written in plain torch, ranks in agreement, exact resume, clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import streaming_workers
import torch

from hemiola.launch import run_local


@pytest.mark.parametrize("name,opt_name", [("mlp", "adamw"), ("transformer", "nesterov")])
def test_blocking_sync_is_diloco(name: str, opt_name: str) -> None:
    results = run_local(streaming_workers.equals_diloco, 2, name, opt_name, 12, 4,
                        timeout_s=240)
    for r in results.values():
        # The engine's outer step is torch's SGD and Gloo's sum is torch's:
        # only the order of the pseudo-gradient's rounding may differ.
        assert r["max_diff"] <= 1e-6, r
        assert r["rank_spread"] == 0.0, r  # every rank holds the shared copy
        assert r["stats"]["syncs"] == 3, r


@pytest.mark.parametrize("compression", [None, "int8"])
def test_check_finite_refuses_a_nan_average_on_every_rank(compression: str | None) -> None:
    results = run_local(streaming_workers.a_nan_is_refused, 2, compression, timeout_s=240)
    for message in results.values():
        assert "holds NaN or infinity in parameter" in message, message
        assert "check_finite=True" in message and "not applied" in message, message


def test_the_shape_is_chosen_from_the_first_syncs_time() -> None:
    from hemiola.streaming_shape import choose
    blocking = choose(wire_ms=10.0, step_ms=100.0, sync_every=20)  # 0.1 steps: 0.5% of H
    assert (blocking.fragments, blocking.overlap) == (1, 0)
    # 3 steps on the wire: 4 fragments of 0.75 steps, each landing 2 steps later
    four = choose(wire_ms=300.0, step_ms=100.0, sync_every=20)
    assert (four.fragments, four.overlap, four.keeps_up) == (4, 2, True)
    # 12 steps: 4 fragments would need 5 steps of overlap (5 * 4 >= 20), 2 need 9
    two = choose(wire_ms=1200.0, step_ms=100.0, sync_every=20)
    assert (two.fragments, two.overlap) == (2, 9)
    slow = choose(wire_ms=5000.0, step_ms=100.0, sync_every=20)  # 50 steps: cannot hide
    assert (slow.fragments, slow.overlap, slow.keeps_up) == (1, 19, False)
    assert "compression='int8'" in slow.reason


@pytest.mark.parametrize("forced", [None, (2, 1), (3, 0)])
def test_left_out_fragments_and_overlap_are_chosen_after_the_first_sync(
        forced: tuple[int, int] | None) -> None:
    results = run_local(streaming_workers.auto_shape_keeps_shared_identical, 2, forced, 20,
                        timeout_s=240)
    shapes = {(r["stats"]["fragments"], r["stats"]["overlap"]) for r in results.values()}
    assert len(shapes) == 1, results  # rank 0's choice on every rank
    fragments, overlap = shapes.pop()
    if forced is not None:
        assert (fragments, overlap) == forced
    else:  # it depends on the machine's load: any shape the rule allows
        assert overlap * fragments < 6 and fragments in (1, 2, 4), results
    for r in results.values():
        assert r["shared_spread"] == 0.0, r
        assert r["fragments"] == fragments, r


def test_a_chosen_shape_resumes_exactly(tmp_path: Path) -> None:
    results = run_local(streaming_workers.auto_shape_resumes, 2, (2, 1), 9, 16, str(tmp_path),
                        timeout_s=240)
    for r in results.values():
        assert r["max_diff"] == 0.0, r


def test_a_streaming_checkpoint_is_checked_before_anything_is_restored(tmp_path: Path) -> None:
    results = run_local(streaming_workers.hostile_loads, 2, str(tmp_path), timeout_s=240)
    nan = [results[r]["nan on rank 1"] for r in (0, 1)]
    assert "holds NaN or infinity" in nan[1] and "shared[0] (fragment 0)" in nan[1], nan
    assert "another rank refused" in nan[0], nan  # rank 0 raises too, not a hang
    for r in (0, 1):
        assert "step count differs" in results[r]["rank 1 a step later"], results[r]
        assert "outer_momentum[1] (fragment 1) has 1 elements" in results[r]["one element"]
        assert results[r]["good"] == "", results[r]
    assert "saved by 3 replicas" in results[0]["saved by 3"], results[0]  # resumes, loudly
    assert results[1]["saved by 3"] == "", results[1]


def test_average_parameters_gives_every_rank_the_same_model_now() -> None:
    results = run_local(streaming_workers.average_now, 2, timeout_s=240)
    for r in results.values():
        assert r["before"] > 0.0, r  # between syncs the ranks differ
        assert r["after"] == 0.0 and r["off_mean"] <= 1e-6, r
        assert r["syncs"] >= 4, r  # the schedule goes on


def test_a_run_that_never_syncs_says_so() -> None:
    results = run_local(streaming_workers.a_run_shorter_than_sync_every, 2, timeout_s=240)
    assert len(results[0]) == 1 and "5 inner steps and no sync" in results[0][0], results
    assert results[1] == []  # said once, by rank 0


def test_the_defaults_average_and_mix_overlapped_fragments() -> None:
    # chosen on tuning seeds (docs/streaming.md, "Choosing the options")
    from hemiola import Config
    from hemiola.streaming import merge_mix
    config = Config(schedule="streaming")
    assert (config.outer_lr, config.outer_momentum) == (1.0, 0.0)
    assert merge_mix(None, 0) < 0  # blocking: the shared copy itself
    assert merge_mix(None, 5) == 0.5  # overlapped: Streaming DiLoCo's mix
    assert merge_mix("eager", 5) < 0 and merge_mix(0.25, 0) == 0.25


def test_the_mixing_merge_is_torchfts_lerp() -> None:
    # Streaming DiLoCo's merge (torchft's fragment_update_alpha): the new
    # shared copy lerped toward the local parameters; the ranks then differ.
    results = run_local(streaming_workers.equals_diloco, 2, "mlp", "adamw", 12, 4, 0.5,
                        timeout_s=240)
    for r in results.values():
        assert r["max_diff"] <= 1e-6, r
        assert r["rank_spread"] > 0.0, r  # each keeps half of its own progress
        assert r["stats"]["syncs"] == 3, r


@pytest.mark.parametrize("options", [
    {"sync_every": 6, "fragments": 3, "overlap": 1},
    {"sync_every": 4, "fragments": 2, "overlap": 1, "compression": "int8"},
    {"sync_every": 4, "fragments": 2, "overlap": 1, "compression": "int4"},
])
def test_overlapped_fragments_keep_the_shared_copy_identical(options: dict[str, object]) -> None:
    results = run_local(streaming_workers.overlap_keeps_shared_identical, 3, options, 13,
                        timeout_s=240)
    for r in results.values():
        assert r["shared_spread"] == 0.0, r  # after every inner step
        assert r["shared_changes"] >= 2 * int(options["fragments"]) - 1, r
        assert r["fragments"] == options["fragments"], r
        assert r["stats"]["syncs"] >= 2 * int(options["fragments"]) - 1, r


@pytest.mark.parametrize("options,stop", [
    ({"sync_every": 4, "fragments": 1, "overlap": 0}, 6),
    ({"sync_every": 6, "fragments": 2, "overlap": 2, "compression": "int8"}, 4),
    ({"sync_every": 6, "fragments": 2, "overlap": 2, "compression": "int4"}, 4),
])
def test_resume_repeats_the_uninterrupted_run(tmp_path: Path, options: dict[str, object],
                                              stop: int) -> None:
    results = run_local(streaming_workers.resume_repeats_the_run, 2, options, stop, 13,
                        str(tmp_path), timeout_s=240)
    for r in results.values():
        assert r["max_diff"] == 0.0, r
    if options.get("overlap"):
        # Stopped while fragment 0 (sent after step 3) was still on the wire.
        assert all(r["in_flight_at_stop"] == 0 for r in results.values()), results


def test_the_gpu_paths_host_copy_changes_nothing_on_the_cpu() -> None:
    # A GPU model's parameters reach the engine through a host copy that only
    # the fragments a step sends or lands cross; run on the CPU, that copy
    # must give the run the engine makes reading the parameters in place.
    options = {"sync_every": 6, "fragments": 3, "overlap": 1, "compression": "int8"}
    results = run_local(streaming_workers.host_copy_is_the_same_run, 2, options, 13, "cpu",
                        timeout_s=240)
    for r in results.values():
        assert r["max_diff"] == 0.0, r
        assert r["syncs"] >= 5 and r["moved"] > 1e-3, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_model_streams_as_the_cpu_model() -> None:
    # Three ranks share the GPU (the outer wire is the engine's Gloo); the
    # inner AdamW runs on the GPU, so only float rounding may differ.
    options = {"sync_every": 6, "fragments": 3, "overlap": 1, "compression": "int8"}
    results = run_local(streaming_workers.host_copy_is_the_same_run, 3, options, 13, "cuda",
                        timeout_s=300)
    for r in results.values():
        assert r["max_diff"] < 1e-4, r
        assert r["syncs"] >= 5 and r["moved"] > 1e-3, r


def test_a_comm_hook_is_refused_on_every_rank_saying_what_to_use() -> None:
    messages = run_local(streaming_workers.comm_hook_refused, 2)
    assert sorted(messages) == [0, 1]
    for message in messages.values():
        assert "reduces no gradients" in message, message
        assert "compression='fp16', 'bf16', 'int8' or 'int4'" in message, message
        assert "schedule='wfbp'" in message, message


@pytest.mark.parametrize("option, values", [("fragments", [1, 2]), ("outer_lr", [0.7, 0.5]),
                                            ("sync_every", [8, 9])])
def test_options_that_differ_across_ranks_are_refused_on_every_rank(
        option: str, values: list[object]) -> None:
    messages = run_local(streaming_workers.mismatched_options, 2, option, values)
    for message in messages.values():
        assert "differs from rank 0's" in message and "'streaming'" in message, message


def test_an_outer_step_that_is_not_finite_is_refused() -> None:
    import hemiola

    for option, bad in (("outer_lr", float("inf")), ("outer_lr", float("nan")),
                        ("outer_momentum", -0.1), ("outer_lr", "0.7")):
        with pytest.raises(ValueError, match=f"{option} must be a finite number"):
            hemiola.Config(schedule="streaming", **{option: bad})
    for bad in (1.5, -0.1, float("nan"), True, "0.5", "lazy"):
        with pytest.raises(ValueError, match="mix must be None"):
            hemiola.Config(schedule="streaming", mix=bad)


def test_refuses_with_a_message_that_says_what_to_do() -> None:
    messages = run_local(streaming_workers.refusals, 1)[0]
    assert "needs a torch.optim.Optimizer" in messages[0] or "needs your optimizer" in messages[0]
    assert "must cover every trainable parameter" in messages[1]
    assert "overlap" in messages[2] and "one fragment is on the wire" in messages[2]
    assert "'int8'" in messages[3]


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_replica_groups_are_diloco_over_groups_that_average_every_step(name: str) -> None:
    # 2 groups of 2 ranks: DDP inside each group, DiLoCo across the groups,
    # each rank of a group averaging half of every fragment.
    results = run_local(streaming_workers.groups_equal_diloco, 4, 2, name, 9, 3, timeout_s=300)
    for r in results.values():
        assert r["max_diff"] <= 1e-6, r
        assert r["rank_spread"] == 0.0, r  # all four ranks hold the shared copy
        assert r["stats"]["syncs"] == 3, r
        assert r["stats"]["replica_ranks"] == 2, r


@pytest.mark.parametrize("options", [
    {"sync_every": 4, "fragments": 2, "overlap": 1, "compression": "int8", "replica_ranks": 2},
    {"sync_every": 6, "fragments": 3, "overlap": 1, "replica_ranks": 2},
])
def test_replica_groups_keep_the_shared_copy_identical_in_flight(
        options: dict[str, object]) -> None:
    results = run_local(streaming_workers.overlap_keeps_shared_identical, 4, options, 13,
                        timeout_s=300)
    for r in results.values():
        assert r["shared_spread"] == 0.0, r
        assert r["shared_changes"] >= 2 * int(options["fragments"]) - 1, r


def test_replica_groups_resume_exactly(tmp_path: Path) -> None:
    options = {"sync_every": 6, "fragments": 2, "overlap": 2, "compression": "int8",
               "replica_ranks": 2}
    results = run_local(streaming_workers.resume_repeats_the_run, 4, options, 4, 13,
                        str(tmp_path), timeout_s=300)
    for r in results.values():
        assert r["max_diff"] == 0.0, r


def test_replica_ranks_default_to_a_node_when_the_run_spans_nodes() -> None:
    from hemiola.replica_groups import replica_ranks
    assert replica_ranks(None, 8, {"LOCAL_WORLD_SIZE": "4"}) == 4  # two nodes of four
    assert replica_ranks(None, 4, {"LOCAL_WORLD_SIZE": "4"}) == 1  # one node: a replica each
    assert replica_ranks(None, 4, {}) == 1
    assert replica_ranks(2, 4, {}) == 2
    with pytest.raises(ValueError, match="does not divide the 4 ranks"):
        replica_ranks(3, 4, {})
    with pytest.raises(ValueError, match="one replica"):
        replica_ranks(4, 4, {})
    from hemiola.config import Config
    with pytest.raises(ValueError, match="replica_ranks must be an integer"):
        Config(schedule="streaming", replica_ranks=0)


def test_a_step_the_grad_scaler_skips_on_one_rank_is_still_counted() -> None:
    # Each rank's gradients are its own under streaming: rank 1 overflows
    # once and its scaler skips that step. Passed to hemiola.wrap, the skip
    # is counted, so both ranks sync after the same iterations (without it
    # rank 1 would end a sync behind, and rank 0 wait at the last one until
    # timeout_s).
    results = run_local(streaming_workers.streaming_with_a_skipping_scaler, 2, True, timeout_s=120)
    assert results[1]["skipped"] == 1 and results[0]["skipped"] == 0
    for r in results.values():
        assert r["inner_steps"] == 12 and r["syncs"] == 3
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)  # the last sync (after iteration 12) made them equal

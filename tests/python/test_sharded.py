"""schedule='sharded': exact (bitwise wfbp, and so DDP's math) with each rank
holding 1/N of the gradients and optimizer state; real ranks over real Gloo."""

from __future__ import annotations

import pytest
import torch

from hemiola.launch import run_local

import sharded_workers
import workers


@pytest.mark.parametrize("world,model,optimizer", [
    (2, "cnn", "nesterov"), (3, "mlp", "sgd"), (3, "transformer", "adamw"),
    (3, "mlp", "sgd-groups"), (4, "mlp", "sgd"), (4, "transformer", "adamw"),
])
def test_equals_wfbp_bit_for_bit(world: int, model: str, optimizer: str) -> None:
    # fusion_mb 1/64: many buckets, most parameters cut across ranks' chunks;
    # the CNN has BatchNorm buffers; sgd-groups two param groups and an LR
    # scheduler.
    results = run_local(sharded_workers.sharded_matches_wfbp, world, model, optimizer, 5,
                        timeout_s=300)
    for rank, r in results.items():
        assert r["moved"] > 1e-3, "training did not move the parameters"
        assert r["params"] == 0.0 and r["losses"] == 0.0, f"rank {rank}: {r}"


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_half_precision_reduce_scatters_equal_wfbp_with_the_same_compression(
        compression: str) -> None:
    # DDP's fp16/bf16 hook, bit for bit, cut in two; the parameters are
    # gathered in float32 (every rank holds the same values).
    results = run_local(sharded_workers.sharded_matches_wfbp, 3, "transformer", "adamw", 4,
                        None, compression, timeout_s=300)
    for r in results.values():
        assert r["compression_moved"] > 0, "the compression changed nothing: no test"
        assert r["params"] == 0.0 and r["losses"] == 0.0, r


@pytest.mark.parametrize("world,compression,levels", [(2, "int8", 127), (3, "int8", 127),
                                                      (3, "int4", 7)])
def test_coded_reduce_scatters_deliver_each_ranks_coded_gradient(
        world: int, compression: str, levels: int) -> None:
    # Each rank codes its gradient with its own scale per block of 256
    # (max |v| / levels) and the owner averages the decoded records: each
    # rank's error is at most half its scale, so the average's is at most half
    # the largest scale (the engine's test checks the records bit for bit);
    # the residuals keep the rest, laid out again by the first step's plan.
    results = run_local(sharded_workers.coded_gradients, world, compression, timeout_s=300)
    largest_scale = max(r["local"] for r in results.values()) / levels
    for r in results.values():
        assert 0 < r["error"] <= largest_scale / 2 * 1.001, r
        assert r["residual_buckets"] > 1 and 0 < r["residual_max"] <= largest_scale, r
        # AdamW normalises each step: the runs stay close but are not equal
        assert 0 < r["params_apart"] < 0.05, r


@pytest.mark.parametrize("world,model,optimizer", [(2, "mlp", "sgd"), (3, "transformer", "adamw")])
def test_clipping_follows_wfbp_within_the_norms_rounding(world: int, model: str,
                                                         optimizer: str) -> None:
    # The norm is summed over the shards in float64 where torch sums each
    # tensor's norm in float32: the coefficient can differ in its last bits.
    results = run_local(sharded_workers.sharded_matches_wfbp, world, model, optimizer, 5, 0.05,
                        timeout_s=300)
    for r in results.values():
        # (AdamW normalises the gradient: clipping moves it less than SGD)
        assert r["clipping_moved"] > 1e-4, "clipping at 0.05 changed nothing: no test"
        assert r["params"] <= 2e-7, r


def test_gradients_and_optimizer_state_exist_for_the_shard_only() -> None:
    results = run_local(sharded_workers.state_is_sharded, 3, timeout_s=300)
    model_elements = results[0]["model_elements"]
    for r in results.values():
        assert r["grads_left"] == 0, "a parameter kept its full .grad after backward"
        # AdamW: exp_avg and exp_avg_sq for the shard's elements only
        assert r["state_elements"] == 2 * r["shard_elements"]
        assert r["shard_elements"] <= model_elements / 3 * 1.1
        # model.averaged_gradients() gathers wfbp's averaged .grad, bitwise
        assert r["averaged_vs_wfbp"] == 0.0
    assert sum(r["shard_elements"] for r in results.values()) == model_elements


@pytest.mark.parametrize("how", ["full", "shard"])
def test_a_checkpoint_resumes_bit_for_bit(how: str) -> None:
    results = run_local(sharded_workers.resumed, 3, how, timeout_s=300)
    for r in results.values():
        assert r["moved"] > 1e-3
        assert r["resume_diff"] == 0.0, r
        # the full state is wfbp's (torch's) optimizer state, every parameter
        assert r["state_vs_wfbp"] == 0.0
        assert r["states"] == r["params"]
        assert r["full_keys"] == ["exp_avg", "exp_avg_sq", "step"]


def test_int8_residuals_go_with_a_skipped_step_and_a_loaded_full_state() -> None:
    # an overflow on one rank skips the step everywhere: what the codings
    # dropped of those gradients goes too; a full state (no rank's own
    # residuals in it) restarts them at zero
    results = run_local(sharded_workers.residuals_after, 2, timeout_s=120)
    for r in results.values():
        good, skipped, again, loaded = r["counts"]
        assert good > 1 and skipped == 0 and again == good and loaded == 0, r
        assert r["scale"] == 2.0 ** 7  # backed off once, alike


def test_a_shard_checkpoint_resumes_int8_bit_for_bit() -> None:
    # the residuals (what each rank's coding still owes) are in the shard,
    # laid out by the plan it was cut by
    results = run_local(sharded_workers.resumed, 2, "shard", "int8", timeout_s=300)
    for r in results.values():
        assert r["moved"] > 1e-3
        assert r["resume_diff"] == 0.0, r


def test_a_shard_loads_only_on_the_rank_that_saved_it() -> None:
    results = run_local(sharded_workers.shard_loaded_elsewhere, 2, timeout_s=120)
    assert results[0] == "loaded"
    assert "saved with rank 0 (now 1)" in results[1]


def test_gradient_accumulation_with_no_sync_equals_wfbp() -> None:
    ref = run_local(sharded_workers.no_sync_then_step, 3, "wfbp", timeout_s=120)
    got = run_local(sharded_workers.no_sync_then_step, 3, "sharded", timeout_s=120)
    for rank in ref:
        assert sharded_workers.max_diff(ref[rank], got[rank]) == 0.0


def test_unused_and_irregular_modules_equal_wfbp() -> None:
    # find_unused_parameters, a module used twice, a transposed tied weight,
    # a branch taken every other step.
    ref = run_local(workers.irregular_model, 3, "wfbp", "adamw", 4, timeout_s=120)
    got = run_local(workers.irregular_model, 3, "sharded", "adamw", 4, timeout_s=120)
    for rank in ref:
        assert sharded_workers.max_diff(ref[rank], got[rank]) == 0.0


def test_a_parameter_read_before_its_all_gather_is_refused_by_name() -> None:
    results = run_local(workers.read_order_changes, 2, "sharded", timeout_s=120)
    for message in results.values():
        assert "'layer.weight'" in message or "'layer.bias'" in message
        assert "read before its all-gather landed" in message


@pytest.mark.parametrize("case,words", [
    ("optimizer", "Adafactor is not one of the optimizers whose step is element-wise"),
    ("scaler", "step with scaler.step(optimizer), not optimizer.step()"),
    ("step without backward", "no synchronised backward since the last step"),
    ("non-contiguous", "is not contiguous"),
    ("powersgd", "compresses its reduce-scatters with 'fp16', 'bf16', 'int8' or 'int4'"),
])
def test_misuse_is_refused_saying_what_to_do(case: str, words: str) -> None:
    results = run_local(sharded_workers.refusal, 2, case, timeout_s=120)
    for message in results.values():
        assert words in message, message


def test_state_dict_of_a_wrapped_model_is_the_modules() -> None:
    results = run_local(workers.rank0_only_evaluation, 2, "sharded", True, timeout_s=120)
    plain = run_local(workers.rank0_only_evaluation, 2, "sharded", False, timeout_s=120)
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], plain[0])


def test_the_full_optimizer_state_asked_on_rank_0_alone_says_every_rank_must_ask() -> None:
    results = run_local(sharded_workers.state_dict_on_rank_0_only, 2, timeout_s=120)
    assert results[1] == "not called"
    assert "every rank must call it: rank(s) [1] did not" in results[0]

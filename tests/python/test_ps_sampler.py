"""hemiola.ps.SharedBatchSampler: every sample of an epoch trained exactly
once, by whichever worker asks first; refused where a straggler's smaller
share would stall the job."""

from __future__ import annotations

import ps_workers
import pytest
import torch

import hemiola.ps
from hemiola.launch import run_local


@pytest.mark.parametrize("drop_last", [False, True])
def test_each_epoch_is_shared_out_exactly_once_and_the_fast_worker_takes_more(
        drop_last: bool) -> None:
    size, batch, epochs = 203, 8, 3
    out = run_local(ps_workers.shared_batches, 3, size, batch, epochs, drop_last, 0.01,
                    timeout_s=120)
    fast, slow = out[1], out[2]
    whole = size // batch
    for epoch in range(epochs + 1):  # the last pass is epoch 0 again
        seed_epoch = epoch if epoch < epochs else 0
        mine, theirs = fast["passes"][epoch], slow["passes"][epoch]
        taken = [i for b in mine + theirs for i in b]
        order = torch.randperm(size, generator=torch.Generator().manual_seed(5 + seed_epoch))
        expected = order[:whole * batch] if drop_last else order
        assert sorted(taken) == sorted(expected.tolist())  # each sample exactly once
        # every batch is a slice of the epoch's permutation, as it was cut
        cuts = {tuple(expected[i:i + batch].tolist()) for i in range(0, len(expected), batch)}
        assert {tuple(b) for b in mine + theirs} == cuts
        assert len(mine) > len(theirs), (len(mine), len(theirs))
    fast_total = sum(len(p) for p in fast["passes"])
    assert fast_total > 2 * sum(len(p) for p in slow["passes"])
    assert fast["len"] == slow["len"] == -(-(whole if drop_last else whole + 1) // 2)


@pytest.mark.parametrize("consistency", ["bsp", "ssp"])
def test_refused_where_every_worker_must_train_as_many_batches(consistency: str) -> None:
    with pytest.raises(ValueError, match="DistributedSampler"):
        hemiola.ps.SharedBatchSampler(100, 10, consistency=consistency)


@pytest.mark.parametrize("served", ["bsp", "asp"])
def test_checked_against_the_servers_consistency(served: str) -> None:
    """Told 'asp' while the servers run bsp, the first pass refuses, before a
    fast worker could wait on a straggler out of batches."""
    out = run_local(ps_workers.shared_batches_against_servers, 3, served, timeout_s=120)
    for worker in (out[1], out[2]):
        if served == "bsp":
            assert "servers run 'bsp'" in worker["error"]
            assert "consistency='asp'" in worker["error"]
        else:
            assert worker["error"] is None

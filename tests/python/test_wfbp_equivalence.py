"""hemiola's wfbp schedule is numerically torch DDP: same parameters after K
steps, same seeds and data shards, real ranks over real Gloo."""

from __future__ import annotations

import pytest

from hemiola.launch import run_local

import workers

# 1 byte: every tensor its own bucket; 16 KiB: a few buckets; 1 GiB: one.
FUSION_MB = [1 / (1 << 20), 1 / 64, 1024.0]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("model", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_matches_ddp(world: int, model: str, optimizer: str) -> None:
    results = run_local(workers.equivalence_sweep, world, model, optimizer, FUSION_MB,
                        timeout_s=240)
    for rank, sweep in results.items():
        buckets = {mb: r["buckets"] for mb, r in sweep.items()}
        # The thresholds really changed the plan: 1 byte gives one bucket per
        # parameter, 1 GiB a single bucket.
        assert buckets[FUSION_MB[0]] > buckets[FUSION_MB[1]] >= buckets[FUSION_MB[2]] == 1
        for mb, r in sweep.items():
            assert r["keys_equal"], "state_dict keys differ from the unwrapped module's"
            assert r["max_diff"] < 2e-5, (
                f"rank {rank}, fusion {mb} MB: {r['worst']} differs from DDP by {r['max_diff']}"
            )
            assert r["hemiola"] == pytest.approx(r["ddp"], rel=1e-4, abs=1e-5)

"""docs/scale.md's validations of ``hemiola advise``'s model: against
published scaling results (``hemiola bench advise --published``) and against
the H200 rows (``--gpu-rows``), each against hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hemiola.advise.collective import Network
from hemiola.advise.profile import Param, Profile
from hemiola.bench import advise_gpu, published

GPU_ROWS = Path(__file__).resolve().parents[2] / advise_gpu.RESULTS


def hand_profile() -> Profile:
    """30 ms of computation; one 1000x1000 float32 matrix whose gradient is
    ready only when backward ends (nothing to overlap)."""
    return Profile(forward=0.01, backward=0.02, step=0.0,
                   params=[Param(1_000_000, 4, 1000, need=0.0, ready=0.02)],
                   meta={"device": "cuda"})


def test_the_efficiency_is_the_computation_over_computation_plus_the_exposed_ring() -> None:
    config = published.Published("hand", gpus=2, gpus_per_node=1, rate_gbit=8,
                                 efficiency=0.9, source="by hand")
    # 2 ranks: 2 alpha + 4 MB at 1 GB/s, all after backward
    comm = 2 * published.LATENCY + 4e6 / 1e9
    assert published.predicted_efficiency(config, hand_profile()) == \
        pytest.approx(0.03 / (0.03 + comm), rel=1e-6)


def test_the_published_inputs_make_a_prediction() -> None:
    assert published.single_gpu_seconds("Inception V3") == pytest.approx(64 / 142)
    p = published.profile_of("Inception V3", 64 / 142)
    assert p.compute == pytest.approx(64 / 142) and p.step == 0.0
    assert p.nbytes == 4 * 23_834_568
    for c in published.CONFIGURATIONS:
        if c.model == "Inception V3":
            assert 0 < published.predicted_efficiency(c, p) <= 1
    # at 25 Gbit/s the 512-GPU ring's latencies cost more than the 128-GPU one's
    small, large = (published.predicted_efficiency(c, p) for c in published.CONFIGURATIONS
                    if c.model == "Inception V3")
    assert large < small


def test_the_link_is_what_one_all_reduce_of_two_ranks_gives() -> None:
    assert advise_gpu.link_bandwidth(1e8, 0.1 + 2 * advise_gpu.LATENCY) == pytest.approx(1e9)


def test_ddps_powersgd_hook_is_one_bucket_sent_after_backward() -> None:
    net = Network(2, 1e9, latency=advise_gpu.LATENCY)
    # rank 2 of a 1000x1000 matrix: P and Q of 1000x2 floats, one all-reduce each
    one = 2 * advise_gpu.LATENCY + 8000 / 1e9
    assert advise_gpu.predict_variant(hand_profile(), net, "ddp_powersgd") == \
        pytest.approx(0.03 + 2 * one, rel=1e-6)


def test_the_h200_rows_are_predicted_between_the_bounds() -> None:
    rows = [json.loads(line) for line in
            (GPU_ROWS / "run2" / "gpu_speed.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["rate"] == "20gbit"]
    out = {r["variant"]: r for r in advise_gpu.compare(rows)}
    compute = next(r["median_ms"] for r in rows if r["variant"] == "compute")
    comm = next(r["median_ms"] for r in rows if r["variant"] == "comm")
    ddp = out["ddp"]["predicted_ms"]
    # overlapped with backward: no less than either, no more than both
    assert max(compute, comm) <= ddp < compute + comm
    assert out["hemiola_wfbp+fp16"]["predicted_ms"] < ddp
    assert out["ddp"]["measured_ms"] == pytest.approx(80.78, abs=0.01)


def test_docs_scale_md_holds_what_the_code_prints() -> None:
    doc = (GPU_ROWS.parents[1] / "scale.md").read_text()
    assert published.table() in doc, "docs/scale.md: rerun hemiola bench advise --published"
    assert advise_gpu.table(GPU_ROWS) in doc, "docs/scale.md: rerun hemiola bench advise --gpu-rows"

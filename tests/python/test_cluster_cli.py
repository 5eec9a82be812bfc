"""The ``hemiola cluster`` command line and the compare grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hemiola.cli import main
from hemiola.cluster import ClusterConfig, WorkloadConfig, compare


def test_simulate_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["cluster", "simulate", "--workload", "paper", "--jobs", "40", "--seed", "3",
               "--nodes", "8", "--gpus-per-node", "4", "--placement", "lwf:2",
               "--comm", "srsf:2", "--fidelity", "task", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("mean_jct_ms", "median_jct_ms", "p99_jct_ms", "makespan_ms", "gpu_utilization"):
        assert d[key] > 0
    assert d["placement"] == "lwf:2" and d["comm"] == "srsf:2" and d["jobs"] == 40


def test_simulate_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "simulate", "--jobs", "20", "--fidelity", "iteration"]) == 0
    assert "mean_jct_ms" in capsys.readouterr().out


def test_simulate_bad_trace_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.csv"
    p.write_text("timestamp,duration,num_gpus\n2017-10-09 07:01:55,10,two\n")
    assert main(["cluster", "simulate", "--trace", str(p)]) == 2
    assert "bad.csv line 2: column 'num_gpus'" in capsys.readouterr().err


def test_compare_grid_writes_table_and_plots(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    rc = main(["cluster", "compare", "--jobs", "30", "--placements", "first-fit,lwf",
               "--kappas", "1,4", "--comms", "srsf:1,ada-srsf", "--seeds", "2",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 2
    assert {r["placement"] for r in rows} == {"first-fit", "lwf:1", "lwf:4"}
    table = (out / "table.md").read_text()
    assert "| lwf:4 | ada-srsf |" in table
    for name in ("jct_cdf.png", "utilization.png"):
        assert (out / name).stat().st_size > 1000


def test_compare_api_same_jobs_per_seed() -> None:
    rows = compare(WorkloadConfig(jobs=25), ClusterConfig(), ["first-fit"], ["srsf:1"],
                   [0, 0], progress=False)
    assert rows[0]["mean_jct_ms"] == rows[1]["mean_jct_ms"]


def test_binned_utilization_is_exact() -> None:
    from hemiola.cluster.compare import binned_utilization

    # 1.0 on [0, 10), 0.5 on [10, 30), 0 at 30: two bins of 15 ms.
    centres, means = binned_utilization([0.0, 10.0, 30.0], [1.0, 0.5, 0.0], bins=2)
    assert centres == [7.5, 22.5]
    assert means[0] == pytest.approx((10 * 1.0 + 5 * 0.5) / 15)
    assert means[1] == pytest.approx(0.5)


def test_srsf1_never_shares_and_srsf2_does() -> None:
    from hemiola.cluster import PolicyConfig, simulate

    one = simulate(WorkloadConfig(seed=2), ClusterConfig(), PolicyConfig("lwf:4", "srsf:1"))
    two = simulate(WorkloadConfig(seed=2), ClusterConfig(), PolicyConfig("lwf:4", "srsf:2"))
    assert one.transfers > 0 and one.shared_transfer_starts == 0
    assert two.shared_transfer_starts > 0


def test_compare_bad_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["cluster", "compare", "--seeds", "abc"])
    assert e.value.code == 2
    assert "comma list of seeds, got 'abc'" in capsys.readouterr().err


def test_compare_threads_give_identical_rows() -> None:
    args = (WorkloadConfig(jobs=40), ClusterConfig(), ["first-fit", "random", "lwf:2"],
            ["srsf:1", "ada-srsf"], [0, 1])
    one = compare(*args, progress=False, workers=1)
    two = compare(*args, progress=False, workers=2)
    keys = ("placement", "comm", "seed", "mean_jct_ms", "makespan_ms", "gpu_utilization")
    assert [[r[k] for k in keys] for r in one] == [[r[k] for k in keys] for r in two]

"""``hemiola bench``: its suites write stamped rows with median and p10-p90,
``report`` turns them into tables and regenerates the documentation, and
docs/benchmarks.md is what its committed rows give."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hemiola.bench import report
from hemiola.bench.record import percentiles, read_lines, write_lines

ROOT = Path(__file__).resolve().parents[2]
STAMP = ("date", "commit", "hemiola", "torch", "cpu", "cpus")


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hemiola", "bench", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_percentiles() -> None:
    assert percentiles([5.0]) == {"median": 5.0, "p10": 5.0, "p90": 5.0}
    s = percentiles(float(v) for v in range(11))  # 0..10
    assert s == {"median": 5.0, "p10": 1.0, "p90": 9.0}
    with pytest.raises(ValueError, match="no samples"):
        percentiles([])


def test_rate_labels() -> None:
    assert report.rate_label("1gbit") == "1 Gbit/s"
    assert report.rate_label("500mbit") == "500 Mbit/s"
    assert report.rate_label("none") == "no limit"


def test_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match=r"r.jsonl:2: not a JSON line"):
        read_lines(path)


def test_speed_suite_on_loopback(tmp_path: Path) -> None:
    """Two real ranks over loopback: every variant measured in the same run."""
    out = bench("speed", "--rates", "none", "--models", "cnn", "--iterations", "4", "--blocks",
                "2", "--schedules", "wfbp,priority+fp16", "--baselines", "compute,ddp,ddp_fp16",
                "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = read_lines(tmp_path / "speed.jsonl")
    variants = [r["variant"] for r in rows]
    assert variants == ["compute", "ddp", "ddp_fp16", "hemiola_wfbp", "hemiola_priority+fp16",
                        "comm", "comm_torch"]
    for r in rows:
        assert all(k in r for k in STAMP), r
        assert (r["suite"], r["rate"], r["model"], r["world"]) == ("speed", "none", "cnn", 2)
        assert r["samples"] == 4
        assert 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
    ddp = next(r for r in rows if r["variant"] == "ddp")
    assert ddp["vs_ddp"] == 1.0
    wfbp = next(r for r in rows if r["variant"] == "hemiola_wfbp")
    assert wfbp["vs_ddp"] == pytest.approx(wfbp["median_ms"] / ddp["median_ms"])
    assert next(r for r in rows if r["variant"] == "comm")["vs_ddp"] is None
    table = report.render(rows, "speed.jsonl")
    assert f"| hemiola wfbp | {wfbp['median_ms']:.1f} ({wfbp['p10_ms']:.1f}–" in table
    assert f"commit `{rows[0]['commit']}`" in table


def test_fsdp2_units_are_the_blocks() -> None:
    """fully_shard goes on each block, as FSDP2 users apply it: the layers of
    the MLP, the conv-BN-ReLU blocks of the CNN, each transformer layer."""
    from hemiola.bench.fsdp import shard_units
    from hemiola.bench.speed import make_model

    def units(name: str) -> list[str]:
        return [type(u).__name__ for u in shard_units(make_model(name, 4, 32)[0])]

    assert units("mlp") == ["Linear"] * 5
    assert units("cnn") == ["Sequential"] * 4 + ["Linear"]
    assert units("transformer") == ["Embedding", "TransformerEncoderLayer",
                                    "TransformerEncoderLayer", "Linear"]


#: A rank of the FSDP2-against-DDP check: each model trained 4 SGD steps on
#: this rank's own batch under DDP and under the fsdp2 baseline.
FSDP2_RANK = """
import torch, torch.distributed as dist, hemiola
from hemiola.bench.ddp import ddp_with_hook
from hemiola.bench.fsdp import fully_shard_model
from hemiola.bench.netlab import print_result
from hemiola.bench.speed import make_model
torch.set_num_threads(1)
hemiola.init()
rank = dist.get_rank()
out = {}
for name in ("cnn", "transformer"):
    for kind in ("ddp", "fsdp2"):
        model, x, y = make_model(name)
        x = x + rank if x.is_floating_point() else (x + rank) % 8000
        model = ddp_with_hook(model) if kind == "ddp" else fully_shard_model(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                 for p in model.parameters()]
        out[f"{name}-{kind}"] = {"losses": losses,
                                 "params": torch.cat([p.flatten() for p in whole]).tolist()}
print_result(out)
dist.destroy_process_group()
"""


def test_fsdp2_baseline_trains_as_ddp() -> None:
    """Two ranks on different data: the fsdp2 baseline's losses and
    parameters are DDP's (to float32 rounding), and the ranks agree."""
    from hemiola.bench.netlab import Loopback, parse_result

    outputs = Loopback(2).run_ranks([sys.executable, "-c", FSDP2_RANK], 29570, 300)
    ranks = [parse_result(o) for o in outputs]
    for name in ("cnn", "transformer"):
        ddp, fsdp2 = ranks[0][f"{name}-ddp"], ranks[0][f"{name}-fsdp2"]
        assert fsdp2["losses"][-1] < fsdp2["losses"][0], name
        assert fsdp2["losses"] == pytest.approx(ddp["losses"], rel=1e-6), name
        assert fsdp2["params"] == pytest.approx(ddp["params"], rel=1e-5, abs=1e-6), name
        assert ranks[1][f"{name}-fsdp2"]["params"] == fsdp2["params"], name


def test_speed_suite_with_fsdp2_and_sharded(tmp_path: Path) -> None:
    out = bench("speed", "--rates", "none", "--models", "cnn", "--iterations", "2", "--blocks",
                "1", "--schedules", "sharded", "--baselines", "ddp,fsdp2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = read_lines(tmp_path / "speed.jsonl")
    assert [r["variant"] for r in rows] == ["ddp", "fsdp2", "hemiola_sharded", "comm",
                                            "comm_torch"]
    assert rows[1]["label"] == "torch FSDP2 (fully_shard, ZeRO-2)"
    assert "| torch FSDP2 (fully_shard, ZeRO-2) |" in report.render(rows, "speed.jsonl")


def test_memory_suite(tmp_path: Path) -> None:
    """Each variant in fresh ranks: peaks measured, and the tensors counted
    exactly: DDP whole, FSDP2 1/N of everything, sharded whole parameters
    and 1/N of the gradients and of AdamW's moments (over the ranks)."""
    out = bench("memory", "--worlds", "2", "--baselines", "ddp,fsdp2", "--schedules", "sharded",
                "--width", "64", "--layers", "2", "--iterations", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["variant"]: r for r in read_lines(tmp_path / "memory.jsonl")}
    assert list(rows) == ["ddp", "fsdp2", "hemiola_sharded"]
    for r in rows.values():
        assert all(k in r for k in STAMP), r
        assert (r["suite"], r["world"], r["malloc"]) == ("memory", 2, "mmap")
        assert r["ranks_agree"] and r["loss_last"] < r["loss_first"], r["variant"]
        assert all(p["peak_reset"] and p["peak_bytes"] > 0 for p in r["ranks"]), r["variant"]
        assert r["peak_bytes_per_param"] == max(p["peak_bytes_per_param"] for p in r["ranks"])
    params = rows["ddp"]["params"]

    def total(variant: str, kind: str) -> float:
        """Bytes per parameter of `kind` summed over the ranks."""
        return sum(p["tensor_bytes"][kind] for p in rows[variant]["ranks"]) / params

    assert rows["ddp"]["tensor_bytes"]["grads"] == 4 * params
    assert rows["ddp"]["tensor_bytes_per_param"] == pytest.approx(16, rel=1e-4)
    assert rows["ddp"]["expected_bytes_per_param"] == 20
    assert (total("fsdp2", "params"), total("fsdp2", "grads")) == (4, 4)
    assert total("fsdp2", "state") == pytest.approx(8, rel=1e-4)  # and the step counts
    sharded = rows["hemiola_sharded"]
    assert sharded["tensor_bytes"]["params"] == 4 * params  # whole on every rank
    assert total("hemiola_sharded", "grads") == 4
    assert total("hemiola_sharded", "state") == pytest.approx(8, rel=1e-3)
    assert sharded["buckets"] >= 1 and sharded["expected_bytes_per_param"] > 10
    table = report.render(list(rows.values()), "memory.jsonl")
    assert "| hemiola sharded |" in table and "mmap malloc" in table


def _rows(tmp_path: Path, suite: str = "speed") -> Path:
    base: dict[str, Any] = {"suite": suite, "rate": "1gbit", "model": "mlp", "world": 2,
                            "samples": 20, "params": 9_000_000, "batch": 384, "grad_mb": 36.0,
                            "p10_ms": 1.0, "p90_ms": 3.0}
    rows = [{**base, "variant": "ddp", "label": "torch DDP", "median_ms": 2.0, "vs_ddp": 1.0},
            {**base, "variant": "hemiola_wfbp", "label": "hemiola wfbp", "median_ms": 1.5,
             "vs_ddp": 0.75},
            {**base, "model": "cnn", "variant": "ddp", "label": "torch DDP", "median_ms": 9.0,
             "vs_ddp": 1.0}]
    return write_lines(tmp_path / "results" / "speed.jsonl", rows)


def test_report_regenerates_blocks(tmp_path: Path) -> None:
    _rows(tmp_path)
    doc = tmp_path / "bench.md"
    doc.write_text("# Title\n\n<!-- bench-report results/speed.jsonl model=mlp -->\nstale\n"
                   "<!-- /bench-report -->\n\nprose stays\n")
    check = bench("report", "--doc", str(doc), "--check")
    assert check.returncode == 1 and "differ" in check.stdout
    assert "stale" in doc.read_text()  # --check changes nothing
    assert bench("report", "--doc", str(doc)).returncode == 0
    text = doc.read_text()
    assert "stale" not in text and text.endswith("<!-- /bench-report -->\n\nprose stays\n")
    assert "| hemiola wfbp | 1.5 (1.0–3.0) | 0.75 |" in text
    assert "**cnn**" not in text  # the filter kept the mlp rows only
    assert "rows: `results/speed.jsonl`" in text
    again = bench("report", "--doc", str(doc), "--check")
    assert again.returncode == 0 and "up to date" in again.stdout


@pytest.mark.parametrize(("block", "message"), [
    ("missing.jsonl", "names missing.jsonl, which is not a file"),
    ("results/speed.jsonl model=nothing", "no rows match model=nothing"),
    ("results/speed.jsonl model", "filter 'model' is not key=value"),
])
def test_report_refuses_bad_blocks(tmp_path: Path, block: str, message: str) -> None:
    _rows(tmp_path)
    doc = tmp_path / "bench.md"
    doc.write_text(f"<!-- bench-report {block} -->\n<!-- /bench-report -->\n")
    out = bench("report", "--doc", str(doc))
    assert out.returncode == 2 and message in out.stdout, out.stdout


def test_report_refuses_unknown_suite(tmp_path: Path) -> None:
    rows = read_lines(_rows(tmp_path))
    with pytest.raises(report.ReportError, match="no table for suite 'nope'"):
        report.render([{**r, "suite": "nope"} for r in rows], "x.jsonl")
    mixed = [rows[0], {**rows[1], "suite": "ps"}]
    with pytest.raises(report.ReportError, match="rows of 2 suites"):
        report.render(mixed, "x.jsonl")


def test_cluster_suite(tmp_path: Path) -> None:
    out = bench("cluster", "--seeds", "2", "--jobs", "24", "--placements", "first-fit,lwf:1",
                "--comms", "srsf:1,ada-srsf", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = read_lines(tmp_path / "cluster.jsonl")
    assert [(r["placement"], r["comm"]) for r in rows] == [
        ("first-fit", "srsf:1"), ("first-fit", "ada-srsf"), ("lwf:1", "srsf:1"),
        ("lwf:1", "ada-srsf")]
    assert rows[0]["jct_vs_baseline"] == {"median": 1.0, "p10": 1.0, "p90": 1.0}
    for r in rows:
        s = r["mean_jct_s"]
        assert r["seeds"] == 2 and 0 < s["p10"] <= s["median"] <= s["p90"]
    assert "| lwf:1 | ada-srsf |" in report.render(rows, "cluster.jsonl")


def test_convergence_suite(tmp_path: Path) -> None:
    out = bench("convergence", "--tasks", "digits", "--schedules", "wfbp,decoupled",
                "--seeds", "2", "--steps", "6", "--world-size", "2", "--evals", "2",
                "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = read_lines(tmp_path / "convergence.jsonl")
    summaries = [r for r in rows if r["row"] == "summary"]
    assert [r["schedule"] for r in summaries] == ["wfbp", "decoupled"]
    acc = summaries[1]["test_accuracy"]
    runs = [r["test_accuracy"] for r in rows
            if r["row"] == "run" and r["schedule"] == "decoupled"]
    assert acc["median"] == pytest.approx(sum(runs) / 2)  # two seeds: the median is the mean
    assert acc["p10"] == pytest.approx(min(runs) + 0.1 * abs(runs[1] - runs[0]))
    assert "| decoupled |" in report.render(rows, "convergence.jsonl")


@pytest.mark.parametrize("name", ["benchmarks.md", "gpu.md"])
def test_committed_doc_matches_its_rows(name: str) -> None:
    """Every table of docs/benchmarks.md and docs/gpu.md is what its committed rows give."""
    doc = ROOT / "docs" / name
    specs = [m.group("spec") for m in report.BLOCK.finditer(doc.read_text())]
    assert len(specs) >= 4, f"docs/{name} lost its generated tables"
    out = bench("report", "--doc", str(doc), "--check")
    assert out.returncode == 0, out.stdout
    for spec in specs:
        path = doc.parent / spec.split()[0]
        assert all(k in json.loads(path.read_text().splitlines()[0]) for k in STAMP), path


def test_ps_table_names_the_model_and_the_link_when_not_the_defaults() -> None:
    spread = {"median": 0.5, "p10": 0.4, "p90": 0.6}
    row = {"suite": "ps", "row": "summary", "workers": 4, "slowdown": 4.0, "scheme": "eager",
           "seeds": 3, "reached": 3, "target": 0.95, "lr": 0.02, "ms_per_iteration": spread,
           "final_accuracy": spread}
    assert report.ps_table([row]).startswith("Target 95% test accuracy, lr 0.02; median")
    wide = report.ps_table([{**row, "model": "wide-mlp", "rate": "1gbit"}])
    assert wide.startswith("digits wide-mlp, 1 Gbit/s links. Target 95%")
    assert report.ps_table([{**row, "rate": "1gbit"}]).startswith("1 Gbit/s links. Target")
    assert "| 4 | 4× | eager | 0.5 (0.4–0.6) | – | – | 3/3 | 50.0 (40.0–60.0) |" in wide

"""hemiola.hf.Trainer under real ``torchrun`` with 2 CPU ranks (hf_script.py,
run as a user runs a script), compared with transformers' own Trainer, which
uses DDP there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hemiola.launch import free_port  # noqa: E402 - after the skips

SCRIPT = Path(__file__).with_name("hf_script.py")


def launch(out: Path, trainer: str, *args: str) -> subprocess.CompletedProcess[str]:
    """hf_script.py under torchrun, 2 ranks."""
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT),
               "--trainer", trainer, "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=out, env=env)


def train(tmp_path: Path, trainer: str, *args: str) -> dict[str, Any]:
    out = tmp_path / trainer
    run = launch(out, trainer, *args)
    if trainer == "stock" and run.returncode != 0 and "Signal 6 (SIGABRT)" in run.stderr:
        # The peer (transformers' own DDP over torch's Gloo; hemiola takes no
        # part in it) aborts after training in about one run in five here,
        # "terminate called without an active exception", at 0f4cc9a as well
        # (5 runs: 1 abort; ending the script with destroy_process_group()
        # did not stop it: 8 runs, 1 abort). Its reference is taken again.
        out = tmp_path / "stock-again"
        run = launch(out, trainer, *args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result: dict[str, Any] = torch.load(out / "result.pt")
    assert result["steps"] == 6 and result["rank_spread"] == 0.0
    assert "model.safetensors" in result["saved"]
    return result


def difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max((a["params"][k].double() - b["params"][k].double()).abs().max().item()
               for k in a["params"])


def test_equals_the_trainers_own_ddp_with_accumulation_and_clipping(tmp_path: Path) -> None:
    """Accumulation 2 and clipping at 0.5, which clips here: wfbp is the stock
    Trainer's DDP bit for bit, and so is priority, which clips the averaged
    gradient by torch's own total norm (the engine's, accumulated in double,
    left it 1.06e-6 apart); decoupled trains to within its approximation."""
    common = ("--accumulate", "2", "--clip", "0.5")
    stock = train(tmp_path, "stock", *common)
    assert stock["wrapped"] == "DistributedDataParallel"
    # sharded clips by a norm summed over the shards in float64: within 1e-6.
    for trainer, tolerance in (("wfbp", 0.0), ("priority", 0.0), ("decoupled", 1e-2),
                               ("sharded", 1e-6)):
        ours = train(tmp_path, trainer, *common)
        assert ours["wrapped"] == "DataParallel"
        assert difference(ours, stock) <= tolerance, trainer
        assert ours["eval_loss"] == pytest.approx(stock["eval_loss"], rel=1e-2), trainer
        assert ours["grad_norms"] == pytest.approx(stock["grad_norms"], rel=1e-2), trainer


def test_sharded_checkpoints_hold_the_whole_optimizer_state(tmp_path: Path) -> None:
    """The Trainer writes optimizer.pt from rank 0 alone; under sharded the
    state is gathered from every rank's shard, and the file holds every
    parameter's state, as the stock Trainer's does."""
    stock = train(tmp_path, "stock", "--save-every", "3")
    ours = train(tmp_path, "sharded", "--save-every", "3")
    assert list(ours["optimizer_states"]) == ["checkpoint-3", "checkpoint-6"]
    assert ours["optimizer_states"] == stock["optimizer_states"]
    assert set(ours["optimizer_states"].values()) == {ours["parameters"]}
    assert difference(ours, stock) == 0.0


def test_a_trainer_left_undistributed_under_torchrun_fails_saying_what_to_pass(
        tmp_path: Path) -> None:
    """transformers on a machine without a GPU is not distributed unless told
    use_cpu=True; each rank would train alone. hemiola.hf.Trainer fails at
    once on every rank, naming the fix."""
    run = launch(tmp_path / "undistributed", "priority", "--no-use-cpu")
    assert run.returncode != 0
    assert run.stderr.count("use_cpu=True to TrainingArguments") >= 2, run.stderr[-5000:]
    assert "launched as 2 ranks" in run.stderr

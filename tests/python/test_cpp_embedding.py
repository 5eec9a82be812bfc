"""C++ programs find the installed engine with find_package(hemiola), link it
without Python or libtorch, and run across real processes: a plain all-reduce
and gradient reducer, and a training loop under each schedule."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import hemiola

EXAMPLES = Path(__file__).resolve().parents[2] / "cpp" / "examples"

needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


def _build(example: str, binary: str, tmp_path: Path) -> Path:
    build = tmp_path / f"build-{example}"
    subprocess.run(
        ["cmake", "-S", str(EXAMPLES / example), "-B", str(build),
         f"-DCMAKE_PREFIX_PATH={hemiola.cmake_prefix_path()}"],
        check=True, capture_output=True, text=True,
    )
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True, text=True)
    path = build / binary
    # The executable must not pull in Python or libtorch.
    libs = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
    assert "libhemiola.so" in libs
    assert "libpython" not in libs and "libtorch" not in libs
    return path


def _run_ranks(binary: Path, world: int, tmp_path: Path, *args: str) -> list[str]:
    """Runs `world` ranks of `binary` (RANK WORLD STORE ARGS...); their stdout."""
    store = tempfile.mkdtemp(prefix="hemiola-store-", dir=tmp_path)
    procs = [
        subprocess.Popen([str(binary), str(r), str(world), store, *args], env=dict(os.environ),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outputs.append(out)
    return outputs


@needs_cmake
def test_cpp_example_builds_against_installed_package_and_runs(tmp_path: Path) -> None:
    binary = _build("allreduce", "allreduce_example", tmp_path)
    outputs = _run_ranks(binary, 3, tmp_path)
    for r, out in enumerate(outputs):
        # average of 1..3 = 2; w0 = mean(0, 2, 4) = 2; b0 = 1; w1 = mean(0, 1, 2) = 1
        assert f"rank {r}/3: allreduce average 2.000, gradients 2.000 1.000 1.000" in out, out


@needs_cmake
def test_cpp_training_runs_priority_and_decoupled_with_the_engines_optimizer(
        tmp_path: Path) -> None:
    binary = _build("training", "training_example", tmp_path)
    checksums: dict[str, str] = {}
    for schedule in ("sync", "priority", "decoupled"):
        outputs = _run_ranks(binary, 2, tmp_path, schedule, "60")
        sums = {re.search(rf"{schedule} checksum (\S+)", out).group(1) for out in outputs}
        assert len(sums) == 1, (schedule, outputs)  # exact parameters agree on every rank
        checksums[schedule] = sums.pop()
        losses = [float(x) for x in re.findall(r"rank 0 step \d+ loss (\S+)", outputs[0])]
        assert losses[-1] < 0.05 * losses[0], (schedule, losses)  # it trains
        if schedule == "decoupled":
            approx = float(re.search(r"approximate reads (\S+)", outputs[0]).group(1))
            assert 0.0 < approx <= 1.0, outputs[0]
    # priority is synchronous SGD with another timing: bitwise the same (two
    # ranks: every averaged element is (a + b) / 2 whatever the bucketing).
    assert checksums["priority"] == checksums["sync"]
    assert checksums["decoupled"] != checksums["sync"]

"""A C++ program finds the installed engine with find_package(hemiola), links
it without Python or libtorch, and all-reduces across real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import hemiola

EXAMPLE = Path(__file__).resolve().parents[2] / "cpp" / "examples" / "allreduce"


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cpp_example_builds_against_installed_package_and_runs(tmp_path: Path) -> None:
    build = tmp_path / "build"
    subprocess.run(
        ["cmake", "-S", str(EXAMPLE), "-B", str(build),
         f"-DCMAKE_PREFIX_PATH={hemiola.cmake_prefix_path()}"],
        check=True, capture_output=True, text=True,
    )
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True, text=True)
    binary = build / "allreduce_example"
    # The executable must not pull in Python or libtorch.
    libs = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    assert "libhemiola.so" in libs
    assert "libpython" not in libs and "libtorch" not in libs

    store = tempfile.mkdtemp(prefix="hemiola-store-", dir=tmp_path)
    world = 3
    env = dict(os.environ)
    procs = [
        subprocess.Popen([str(binary), str(r), str(world), store], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outputs.append(out)
    for r, out in enumerate(outputs):
        # average of 1..3 = 2; w0 = mean(0, 2, 4) = 2; b0 = 1; w1 = mean(0, 1, 2) = 1
        assert f"rank {r}/3: allreduce average 2.000, gradients 2.000 1.000 1.000" in out, out

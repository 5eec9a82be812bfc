"""The documented wheel step: ``pip wheel`` then ``auditwheel repair`` gives a
self-contained manylinux wheel whose Gloo (and Gloo's own dependencies) are
vendored, so it imports and runs without Debian's libgloo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import numpy as np
import hemiola
from hemiola._native import C
engine = C.Engine(0, 1, C.MemoryStore())
a = np.ones(8, dtype=np.float32)
engine.all_reduce(a.ctypes.data, int(C.DType.float32), 8, C.ReduceOp.average).wait()
assert a[0] == 1.0
gloo = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgloo" in line})
print(hemiola.__file__)
print("\\n".join(gloo))
"""


@pytest.mark.skipif(shutil.which("auditwheel") is None, reason="auditwheel is not installed")
def test_repaired_wheel_vendors_gloo_and_runs(tmp_path: Path) -> None:
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    env.pop("CUDACXX", None)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), "-Ccmake.define.HEMIOLA_WITH_CUDA=OFF"],
        check=True, capture_output=True, env=env,
    )
    wheel = next((tmp_path / "dist").glob("hemiola-*.whl"))
    subprocess.run(["auditwheel", "repair", str(wheel), "-w", str(tmp_path / "wheelhouse")],
                   check=True, capture_output=True)
    repaired = next((tmp_path / "wheelhouse").glob("hemiola-*manylinux*.whl"))
    names = zipfile.ZipFile(repaired).namelist()
    assert any("hemiola.libs/libgloo" in n for n in names), names

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site),
                    str(repaired)], check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", CHECK], check=True, capture_output=True,
                         text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)))
    module, *gloo = out.stdout.strip().splitlines()
    assert module.startswith(str(site)), f"imported {module}, not the repaired wheel"
    # The only Gloo in the process is the vendored copy, not /usr/lib/libgloo.
    assert gloo and all("hemiola.libs" in path for path in gloo), gloo

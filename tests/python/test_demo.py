"""The README's main job, `hemiola demo`, end to end (all-reduce and parameter server)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hemiola import demo


def test_demo_command_trains() -> None:
    out = subprocess.run([sys.executable, "-m", "hemiola", "demo", "--epochs", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy = float(out.stdout.split("test accuracy: ")[1].split("%")[0])
    assert accuracy > 80.0, out.stdout


@pytest.mark.parametrize("ps", ["bsp", "eager"])
def test_demo_through_a_parameter_server(ps: str) -> None:
    results = demo.run(world_size=2, epochs=1, ps=ps)
    assert sorted(results) == [1, 2]  # rank 0 served
    for r in results.values():
        assert len(r.losses) > 0 and all(loss == loss for loss in r.losses)  # no NaN
    if ps == "bsp":  # synchronous: it learns as fast as all-reduce
        assert min(r.test_accuracy for r in results.values()) > 0.5

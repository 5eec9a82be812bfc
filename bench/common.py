"""Shared helpers of the benchmarks: result files, medians, environment."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    """Where a result was measured: the date, the commit of this checkout
    (with "+dirty" when it has uncommitted changes), the torch and hemiola
    builds, the CPU, and the GPU when one is visible."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    stamp: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                             "commit": commit, "cpu": cpu, "cpus": os.cpu_count()}
    try:
        import torch

        stamp["torch"] = torch.__version__
        if torch.cuda.is_available():
            stamp["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return stamp


def write_results(name: str, rows: list[dict[str, Any]]) -> Path:
    """Writes `rows` as JSON lines to bench/results/<name>.jsonl, each with the
    environment() stamp (and returns the path)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    stamp = environment()
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps({**row, **stamp}) + "\n")
    return path


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles (the values themselves when fewer than 2)."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], deciles[-1]


def split_ahead(scheme: str) -> tuple[str, float | None]:
    """A --schemes entry "NAME@F" as (NAME, F), F being eager's
    ``PSConfig.ahead_fraction``; without "@F", (NAME, None): the learned plan."""
    name, _, ahead = scheme.partition("@")
    return name, float(ahead) if ahead else None

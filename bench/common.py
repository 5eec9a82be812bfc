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


def write_results(name: str, rows: list[dict[str, Any]]) -> Path:
    """Writes `rows` as JSON lines to bench/results/<name>.jsonl (and returns the path)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.jsonl"
    stamp = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
             "cpus": os.cpu_count()}
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps({**row, **stamp}) + "\n")
    return path


def median(values: list[float]) -> float:
    return statistics.median(values)


def split_ahead(scheme: str) -> tuple[str, float | None]:
    """A --schemes entry "NAME@F" as (NAME, F), F being eager's
    ``PSConfig.ahead_fraction``; without "@F", (NAME, None): the learned plan."""
    name, _, ahead = scheme.partition("@")
    return name, float(ahead) if ahead else None

"""What every benchmark result carries: where it was measured (the environment
stamp) and how its samples spread (median with the 10th and 90th
percentiles), written as JSON lines that ``hemiola bench report`` reads back."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Where results go unless ``--out`` says otherwise (relative to the working
#: directory; a checkout ignores it in git).
DEFAULT_OUT = Path("bench") / "results"


def commit(where: Path | None = None) -> str:
    """The commit of the git checkout at `where` (the working directory by
    default), with "+dirty" when tracked files have uncommitted changes, or
    "unknown" outside a checkout. ``HEMIOLA_BENCH_COMMIT`` overrides it, for a
    copy of the tree whose .git is not the tree's own (the lent GPU machine
    gets the working tree with the session's first HEAD)."""
    if os.environ.get("HEMIOLA_BENCH_COMMIT"):
        return os.environ["HEMIOLA_BENCH_COMMIT"]

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(where or Path.cwd()), *args],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    sha = git("rev-parse", "--short=12", "HEAD")
    if not sha:
        return "unknown"
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Where a result was measured: the date, the host, the commit of the
    checkout it ran in, the hemiola and torch versions, the CPU (model and
    cores) and the GPU when one is visible. Suites add the link rate and the
    world size to each row themselves."""
    from hemiola import __version__

    stamp: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "host": platform.node(), "commit": commit(),
                             "hemiola": __version__, "cpu": cpu_model(),
                             "cpus": os.cpu_count()}
    try:
        import torch

        stamp["torch"] = torch.__version__
        if torch.cuda.is_available():
            stamp["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return stamp


def percentiles(values: Iterable[float]) -> dict[str, float]:
    """``{"median", "p10", "p90"}`` of `values` (inclusive deciles; with one
    value all three are it). Raises ValueError on no values."""
    v = list(values)
    if not v:
        raise ValueError("no samples")
    if len(v) < 2:
        return {"median": v[0], "p10": v[0], "p90": v[0]}
    deciles = statistics.quantiles(v, n=10, method="inclusive")
    return {"median": statistics.median(v), "p10": deciles[0], "p90": deciles[-1]}


def write_lines(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Writes `rows` as JSON lines to `path` (replacing it), each with the
    environment() stamp; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = environment()
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps({**row, **stamp}) + "\n")
    return path


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file, naming the file and line of a bad one."""
    rows = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
    return rows


def split_ahead(scheme: str) -> tuple[str, float | None]:
    """A --schemes entry "NAME@F" as (NAME, F), F being eager's
    ``PSConfig.ahead_fraction``; without "@F", (NAME, None): the learned plan."""
    name, _, ahead = scheme.partition("@")
    return name, float(ahead) if ahead else None

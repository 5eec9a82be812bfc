"""``hemiola advise``'s model against the GPU rows measured on an H200
(docs/gpu.md; docs/scale.md, "On a GPU"):

    hemiola bench advise --gpu-rows

Two ranks shared the GPU under MPS (half its SMs each) and reduced over Gloo
staged through host memory, on a ``tc`` link of 5 or 20 Gbit/s. From each
file and rate, a profile is built the way docs/scale.md's tables are: ResNet-50
(batch 64) on the FLOP clock, its iteration the bare model's median measured
there (``compute``: the optimizer step inside it); the link's bandwidth is
what the measured all-reduce of all the gradients alone (``comm``, one 102 MB
all-reduce through the engine, staging copies included) gives at 2 ranks,
``m / (t - 2 alpha)`` with the model's 25 us per message (only one message
size was measured, so latency and bandwidth cannot be told apart). What a GPU
profile lacks is counted as nothing: the engine's per-configuration overhead
(``overhead``: hooks, landings, the staging of each bucket beyond the bytes),
contention, coding costs (fp16 and PowerSGD run as kernels).

Each measured variant is predicted as the model's configuration:
DDP as ``wfbp`` (DDP's buckets are the model's ``wfbp`` plan), DDP's fp16
hook as ``wfbp+fp16``, DDP's PowerSGD hook (rank 2, one bucket) as
``wfbp+powersgd`` with a single bucket, hemiola's schedules as themselves.
The one-rank rows (``gpu_overhead.jsonl``) have nothing to reduce: the model
predicts the bare model's time, and the difference is the overhead a profile
measured on the job's machine would carry.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from hemiola.advise import model
from hemiola.advise.collective import Network
from hemiola.advise.profile import Profile
from hemiola.bench.advise_scale import flop_profile, resnet50

#: Where the H200 rows are, from the checkout's root (the wheel ships no docs).
RESULTS = Path("docs") / "results" / "gpu"
FILES = ("run1/gpu_speed.jsonl", "run2/gpu_speed.jsonl", "ab/ab0.jsonl", "ab/ab1.jsonl",
         "ab/ab2.jsonl")
LATENCY = 25e-6
#: measured variant -> (schedule, coding, one bucket)
VARIANTS = {
    "ddp": ("wfbp", "none", False),
    "ddp_fp16": ("wfbp", "fp16", False),
    "ddp_powersgd": ("wfbp", "powersgd", True),
    "hemiola_wfbp": ("wfbp", "none", False),
    "hemiola_priority": ("priority", "none", False),
    "hemiola_decoupled": ("decoupled", "none", False),
    "hemiola_wfbp+fp16": ("wfbp", "fp16", False),
    "hemiola_decoupled+fp16": ("decoupled", "fp16", False),
}


def resnet50_profile(seconds: float, batch: int = 64) -> Profile:
    """ResNet-50 at `batch` on the FLOP clock, one iteration in `seconds`."""
    with torch.device("meta"):
        net = resnet50()
        x = torch.randn(batch, 3, 224, 224)
        y = torch.randint(0, 1000, (batch,))
    return flop_profile(net, lambda m: F.cross_entropy(m(x), y), seconds,
                        memory_bandwidth=math.inf)


def link_bandwidth(nbytes: float, seconds: float, latency: float = LATENCY) -> float:
    """Bytes per second of each rank's link from one all-reduce of `nbytes`
    at 2 ranks taking `seconds` (ring: ``2 alpha + m / bw``)."""
    return nbytes / (seconds - 2 * latency)


def predict_variant(profile: Profile, net: Network, variant: str) -> float:
    """Seconds per iteration the model predicts for a measured `variant`."""
    schedule, coding, one_bucket = VARIANTS[variant]
    if one_bucket:
        profile = replace(profile, plans={schedule: [list(range(len(profile.params)))]})
    return model.predict_one(profile, net, schedule, coding)


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Predicted against measured for every known variant of `rows` (one
    speed file), per rate."""
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        at = {r["variant"]: r for r in rows if r["rate"] == rate}
        compute, comm = at["compute"]["median_ms"] / 1e3, at["comm"]["median_ms"] / 1e3
        profile = resnet50_profile(compute, at["compute"]["batch"])
        bandwidth = link_bandwidth(profile.nbytes, comm)
        net = Network(at["compute"]["world"], bandwidth, latency=LATENCY)
        for variant, row in at.items():
            if variant not in VARIANTS:
                continue
            predicted = predict_variant(profile, net, variant)
            measured = row["median_ms"] / 1e3
            out.append({"rate": rate, "variant": variant, "label": row["label"],
                        "compute_ms": 1e3 * compute, "link_gbit": 8 * bandwidth / 1e9,
                        "predicted_ms": 1e3 * predicted, "measured_ms": 1e3 * measured,
                        "p10_ms": row["p10_ms"], "p90_ms": row["p90_ms"],
                        "error": predicted / measured - 1, "commit": row["commit"]})
    return out


def _group(variant: str) -> str:
    if variant.startswith("hemiola"):
        return "hemiola"
    return "torch DDP" if variant == "ddp" else "torch DDP with a hook"


def table(results: Path = RESULTS) -> str:
    """The two-rank rows of every file of FILES and the one-rank rows of
    run 2, predicted against measured; markdown."""
    head = ["rows", "link (measured Gbit/s)", "configuration", "predicted ms",
            "measured ms (p10–p90)", "error"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    errors: dict[str, list[float]] = {"torch DDP": [], "torch DDP with a hook": [],
                                      "hemiola": []}
    for name in FILES:
        rows = [json.loads(line) for line in (results / name).read_text().splitlines()]
        for r in compare(rows):
            errors[_group(r["variant"])].append(r["error"])
            lines.append(f"| {name} | {r['rate']} ({r['link_gbit']:.1f}) | {r['label']} | "
                         f"{r['predicted_ms']:.1f} | {r['measured_ms']:.1f} "
                         f"({r['p10_ms']:.1f}–{r['p90_ms']:.1f}) | {100 * r['error']:+.0f}% |")
    for who, e in errors.items():
        lines.append(f"\n{who}: {len(e)} rows, within 10% of measured: "
                     f"{sum(abs(x) <= 0.1 for x in e)}; errors {100 * min(e):+.0f}% to "
                     f"{100 * max(e):+.0f}%.")
    lines += ["", "| one rank (run2/gpu_overhead.jsonl) | predicted ms | measured ms | error |",
              "| --- | --- | --- | --- |"]
    rows = [json.loads(line) for line in
            (results / "run2" / "gpu_overhead.jsonl").read_text().splitlines()]
    bare = next(r["ms"] for r in rows if r["variant"] == "bare")
    for r in rows:
        lines.append(f"| {r['variant']} | {bare:.2f} | {r['ms']:.2f} | "
                     f"{100 * (bare / r['ms'] - 1):+.1f}% |")
    return "\n".join(lines)

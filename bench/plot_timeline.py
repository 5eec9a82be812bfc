"""Plots a hemiola timeline (Chrome trace JSON from ``model.timeline()`` or
``hemiola demo --timeline PATH``) as a PNG: one row per lane (compute, comm),
coloured by kind, so you can see what overlapped with what.

    hemiola demo --schedule decoupled --timeline run.json
    python bench/plot_timeline.py run.json --last-ms 60 -o run.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "step": "#8172b2",
           "correction": "#c44e52", "wait": "#bbbbbb", "allreduce": "#dd8452",
           "collective": "#937860", "preview": "#da8bc3"}


def plot(trace_path: Path, out: Path, last_ms: float | None) -> Path:
    events = json.loads(trace_path.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    end = max(e["ts"] + e["dur"] for e in spans)
    start = end - last_ms * 1000 if last_ms else min(e["ts"] for e in spans)
    rows = sorted(lanes, key=lambda t: lanes[t])
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(rows)))
    # Whole passes first, per-module forwards on top of them.
    spans.sort(key=lambda e: e["name"].startswith("forward ") and e["cat"] == "forward")
    for row, tid in enumerate(rows):
        for e in spans:
            if e["tid"] != tid or e["ts"] + e["dur"] < start:
                continue
            is_module = e["name"].startswith("forward ") and e["cat"] == "forward"
            height, offset = (0.35, 0.05) if is_module else (0.8, -0.4)
            ax.broken_barh([((e["ts"] - start) / 1000, max(e["dur"], 1) / 1000)],
                           (row + offset, height), color=COLOURS.get(e["cat"], "#999999"),
                           edgecolor="none")
    ax.set_yticks(range(len(rows)), [lanes[t] for t in rows])
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, (end - start) / 1000)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()],
              labels=list(COLOURS), ncol=len(COLOURS), loc="upper center",
              bbox_to_anchor=(0.5, 1.22), frameon=False)
    ax.set_title(trace_path.name, pad=34)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("-o", "--output", type=Path)
    parser.add_argument("--last-ms", type=float, help="plot only the last N ms")
    args = parser.parse_args()
    out = plot(args.trace, args.output or args.trace.with_suffix(".png"), args.last_ms)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

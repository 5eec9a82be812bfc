"""Tables from benchmark result lines, and the documentation regenerated from
them, so every number in docs/benchmarks.md names the run that measured it.

    hemiola bench report                       # rewrite docs/benchmarks.md's tables
    hemiola bench report --check               # exit 1 when a table is out of date
    hemiola bench report bench/results/speed.jsonl   # print the tables of a file

A generated block in a Markdown file is

    <!-- bench-report results/speed-1gbit.jsonl model=mlp -->
    (anything: replaced by the table and its provenance)
    <!-- /bench-report -->

naming a JSON-lines file relative to the Markdown file and optional
``key=value`` filters on its rows. The rows' ``suite`` picks the table: one
per suite of ``hemiola bench``.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hemiola.bench.record import read_lines

Rows = list[dict[str, Any]]

BLOCK = re.compile(r"(<!-- bench-report (?P<spec>[^\n]*?) -->\n)(?P<body>.*?)"
                   r"(<!-- /bench-report -->)", re.DOTALL)
DEFAULT_DOC = Path("docs") / "benchmarks.md"


class ReportError(ValueError):
    """A block names a missing file, rows of no known suite, or a filter that matches nothing."""


def _table(head: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def _spread(s: dict[str, float], fmt: str = ".1f", scale: float = 1.0) -> str:
    """'median (p10–p90)' of a percentiles() dict."""
    return (f"{scale * s['median']:{fmt}} ({scale * s['p10']:{fmt}}–"
            f"{scale * s['p90']:{fmt}})")


def rate_label(rate: str) -> str:
    """A tc rate as a reader writes it: "1gbit" -> "1 Gbit/s", "none" -> "no limit"."""
    if rate == "none":
        return "no limit"
    match = re.fullmatch(r"([\d.]+)([kmg])bit", rate)
    return f"{match.group(1)} {match.group(2).upper()}bit/s" if match else rate


def speed_table(rows: Rows) -> str:
    """Per model: one line per variant, per rate its median ms (p10–p90) and
    its ratio to DDP's median at that rate."""
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        rates = list(dict.fromkeys(r["rate"] for r in mine))
        head = ["configuration"]
        for rate in rates:
            head += [f"ms, {rate_label(rate)}", "× DDP"]
        lines = []
        for variant in dict.fromkeys(r["variant"] for r in mine):
            cells = [next(r["label"] for r in mine if r["variant"] == variant)]
            for rate in rates:
                r = next((r for r in mine if (r["rate"], r["variant"]) == (rate, variant)), None)
                if r is None:
                    cells += ["–", "–"]
                    continue
                cells.append(f"{r['median_ms']:.1f} ({r['p10_ms']:.1f}–{r['p90_ms']:.1f})")
                cells.append(f"{r['vs_ddp']:.2f}" if r["vs_ddp"] is not None else "–")
            lines.append(cells)
        first = mine[0]
        title = (f"**{model}** ({first['params'] / 1e6:.1f}M parameters, "
                 f"{first['grad_mb']:.1f} MB of gradients, batch {first['batch']} per rank, "
                 f"{first['world']} ranks, {first['samples']} iterations per variant):")
        parts.append(title + "\n\n" + _table(head, lines))
    return "\n\n".join(parts)


def convergence_table(rows: Rows) -> str:
    """Per task: one line per schedule, each metric's median (p10–p90) over
    seeds and its difference from wfbp's mean."""
    from hemiola.bench.tasks import HEADLINE, metrics_of

    summaries = [r for r in rows if r.get("row") == "summary"]
    parts = []
    for task in dict.fromkeys(r["task"] for r in summaries):
        mine = [r for r in summaries if r["task"] == task]
        # the headline and one more (perplexity is the held-out loss again)
        metrics = [m for m in metrics_of(task) if m != "heldout_perplexity"][:2]
        head = ["schedule"]
        for m in metrics:
            head += [m.replace("_", " "), "vs wfbp"]
        head += ["ms / step", "target reached"]
        # decoupled's preview: the share of approximate reads that were previews
        previews = any("rank0_preview_read_fraction" in r for r in mine)
        if previews:
            head.append("preview reads")
        lines = []
        for r in mine:
            cells = [r["schedule"]]
            for m in metrics:
                scale, fmt = (100.0, ".2f") if m == "test_accuracy" else (1.0, ".4f")
                cells.append(_spread(r[m], fmt, scale))
                diff = r[m].get("vs_wfbp")
                unit = " pts" if m == "test_accuracy" else "%"
                cells.append("–" if diff is None else f"{diff:+.2f}{unit}")
            cells += [_spread(r["ms_per_step"]), r["target_reached"]]
            if previews:
                fraction = r.get("rank0_preview_read_fraction")
                cells.append("–" if fraction is None else _spread(fraction, ".2f"))
            lines.append(cells)
        first = mine[0]
        target = HEADLINE[task]
        clipped = f", clipped at {first['clip']:g}" if first.get("clip") else ""
        title = (f"**{task}** ({len(first['seeds'])} seeds, {first['world']} ranks, "
                 f"{first['steps']} steps{clipped}; target: {target.metric} "
                 f"{'≥' if target.higher_is_better else '≤'} {target.target:g}):")
        parts.append(title + "\n\n" + _table(head, lines))
    return "\n\n".join(parts)


def ps_table(rows: Rows) -> str:
    """One line per workers, slowdown and scheme: median (p10–p90) over seeds."""
    summaries = [r for r in rows if r.get("row") == "summary"]
    head = ["workers", "straggler", "scheme", "ms / iteration", "iterations to target",
            "seconds to target", "reached", "final accuracy %"]
    lines = []
    for r in summaries:
        lines.append([str(r["workers"]), f"{r['slowdown']:g}×", r["scheme"],
                      _spread(r["ms_per_iteration"]),
                      _spread(r["iterations_to_target"], ".0f") if "iterations_to_target" in r
                      else "–",
                      _spread(r["seconds_to_target"], ".2f") if "seconds_to_target" in r else "–",
                      f"{r['reached']}/{r['seeds']}",
                      _spread(r["final_accuracy"], ".1f", 100.0)])
    first = summaries[0]
    # The model and the link, where they are not the defaults (the CNN, loopback).
    setting = []
    if first.get("model", "cnn") != "cnn":
        setting.append(f"digits {first['model']}")
    if first.get("rate", "none") != "none":
        setting.append(f"{rate_label(first['rate'])} links")
    prefix = ", ".join(setting) + ". " if setting else ""
    return (f"{prefix}Target {100 * first['target']:.0f}% test accuracy, lr {first['lr']:g}; "
            f"median (p10–p90) over {first['seeds']} seed(s):\n\n" + _table(head, lines))


def cluster_table(rows: Rows) -> str:
    """One line per (placement, comm): mean JCT, its ratio to first-fit/SRSF(1)
    on the same jobs, and the makespan; median (p10–p90) over seeds."""
    head = ["placement", "communication", "mean JCT (s)", "× first-fit, srsf:1",
            "makespan (s)"]
    lines = [[r["placement"], r["comm"], _spread(r["mean_jct_s"]),
              _spread(r["jct_vs_baseline"], ".3f") if "jct_vs_baseline" in r else "–",
              _spread(r["makespan_s"], ".0f")] for r in rows]
    first = rows[0]
    return (f"{first['jobs']} jobs on {first['nodes']} × {first['gpus_per_node']} GPUs, "
            f"median (p10–p90) over {first['seeds']} seeds:\n\n" + _table(head, lines))


def advise_table(rows: Rows) -> str:
    """Per model, rate and world size: each configuration's predicted and
    measured time, the advice and the fastest measured marked. Rows of the
    advise before its predictions per configuration (one advice per rate, no
    ``config``) render as they did: one line per rate."""
    if not any("config" in r for r in rows):
        head = ["link", "advice", "predicted ms", "measured ms", "error"]
        lines = [[rate_label(r["rate"]), f"`{r['choice']}`", f"{r['predicted_ms']:.1f}",
                  f"{r['measured_ms']:.1f}", f"{100 * r['error']:+.1f}%"] for r in rows]
        return f"{rows[0]['world']} ranks:\n\n" + _table(head, lines)
    parts = []
    for key in dict.fromkeys((r["model"], r["rate"], r["world"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["rate"], r["world"]) == key]
        first = mine[0]
        source = ("its own profile" if first["profile_world"] == first["world"]
                  else f"the profile measured at {first['profile_world']} ranks")
        intro = (f"**{key[0]}** at {rate_label(key[1])}, {key[2]} ranks, predicted from "
                 f"{source} (computation {first['compute_ms']:.1f} ms; load average "
                 f"{first['load_before']:.1f}–{first['load_after']:.1f}; ")
        if "measured_rounds_ms" in first:
            parts.append(intro + _advise_rounds(mine))
            continue
        head = ["configuration", "predicted ms", "measured ms", "error",
                "bare step then", "predicted at that load", "error"]
        lines = [[_config_cell(r), f"{r['predicted_ms']:.1f}",
                  f"{r['measured_ms']:.1f}", f"{100 * r['error']:+.1f}%",
                  f"{r['bare_now_ms']:.1f}", f"{r['predicted_now_ms']:.1f}",
                  f"{100 * r['error_now']:+.1f}%"] for r in mine]
        worst = max(abs(r["error_now"]) for r in mine)
        parts.append(intro + f"largest error at the trials' load {100 * worst:.0f}%):\n\n"
                     + _table(head, lines))
    return "\n\n".join(parts)


def _config_cell(r: dict[str, Any]) -> str:
    return (f"`{r['config']}`" + (" **advised**" if r["advised"] else "")
            + (" (fastest)" if r["fastest"] else ""))


def _advise_rounds(rows: Rows) -> str:
    """One cell of a grid run with ``--rounds``: each configuration's median
    over its rounds and their range, predicted from the profile and at the
    computation measured during the trials."""
    head = ["configuration", "predicted ms", "measured ms (rounds' range)", "error",
            "predicted at the trials' computation", "error"]
    lines = [[_config_cell(r), f"{r['predicted_ms']:.1f}",
              f"{r['measured_ms']:.1f} ({min(r['measured_rounds_ms']):.1f}–"
              f"{max(r['measured_rounds_ms']):.1f})", f"{100 * r['error']:+.1f}%",
              f"{r['predicted_trials_ms']:.1f}", f"{100 * r['error_trials']:+.1f}%"]
             for r in rows]
    return (f"{len(rows[0]['measured_rounds_ms'])} rounds; bare step during the trials "
            f"{rows[0]['bare_trials_ms']:.1f} ms):\n\n" + _table(head, lines))


def streaming_table(rows: Rows) -> str:
    """Per task and rate: one line per contender, each metric's mean over seeds
    (± the standard deviation over seeds of time, utilisation and loss when
    there are several; ``hemiola bench streaming``); skipped contenders are
    named below."""
    import statistics

    def mean(values: list[Any]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.fmean(known) if len(known) == len(values) and known else None

    def cell(value: float | None, fmt: str) -> str:
        return "–" if value is None else f"{value:{fmt}}"

    def spread(values: list[Any], fmt: str) -> str:
        """The mean, and ± the standard deviation over seeds when several."""
        m = mean(values)
        if m is None or len(values) < 2:
            return cell(m, fmt)
        return f"{m:{fmt}} ± {statistics.stdev(values):{fmt}}"

    runs = [r for r in rows if r.get("row") == "run"]
    parts = []
    for task, rate in dict.fromkeys((r["task"], r["rate"]) for r in runs):
        mine = [r for r in runs if (r["task"], r["rate"]) == (task, rate)]
        head = ["contender", "ms / step", "compute utilisation", "bytes / token (formula)",
                "bytes / token (measured)", "held-out loss", "s to target"]
        lines = []
        for name in dict.fromkeys(r["contender"] for r in mine):
            rs = [r for r in mine if r["contender"] == name]
            reached = [r["seconds_to_target"] for r in rs]
            label = rs[0]["label"] + (" ¹" if rs[0]["kind"] == "compute" else "")
            lines.append([
                label, spread([r["ms_per_step"] for r in rs], ".1f"),
                spread([r["compute_utilisation"] for r in rs], ".2f"),
                cell(mean([r["bytes_per_token"] for r in rs]), ".0f"),
                cell(mean([r["bytes_per_token_measured"] for r in rs]), ".0f"),
                spread([r["heldout_loss"] for r in rs], ".4f"),
                cell(mean(reached), ".1f") + ("" if None not in reached else
                                               f" ({sum(v is not None for v in reached)}"
                                               f"/{len(reached)} reached)")])
        first = mine[0]
        seeds = sorted({r["seed"] for r in mine})
        targets = sorted({round(r["target_loss"], 4) for r in mine if r["target_loss"]})
        title = (f"**{task}** at {rate_label(rate)} ({first['params'] / 1e6:.2f}M parameters, "
                 f"{first['world']} ranks, {first['steps']} steps of "
                 f"{first['tokens_per_rank_step']} tokens per rank, {len(seeds)} seed(s); "
                 f"held-out loss on {first['eval_windows']} windows after each block of "
                 f"{first['eval_every']} steps; target loss "
                 f"{', '.join(f'{t:g}' for t in targets)}):")
        note = ("\n\n¹ each rank trains alone: its loss is at 1/"
                f"{first['world']} of the tokens per model.")
        if not any(r["kind"] == "compute" for r in mine):
            note = ""
        parts.append(title + "\n\n" + _table(head, lines) + note)
    for r in rows:
        if r.get("row") == "skipped":
            parts.append(f"{r['label']}: skipped ({r['reason']}).")
    return "\n\n".join(parts)


def _interval(value: Any, fmt: str, scale: float = 1.0, sign: bool = False) -> str:
    """'mean ± half-width' of a (mean, 95% half-width or None) pair."""
    if value is None:
        return "–"
    mean, half = value
    head = f"{scale * mean:{'+' if sign else ''}{fmt}}"
    return head if half is None else f"{head} ± {scale * half:{fmt}}"


def horizon_table(rows: Rows) -> str:
    """Per task, rate and replica count: each contender's held-out loss at
    equal inner steps (and against DDP and one replica alone, paired by seed),
    at equal wall-clock, its time per step and its time to DDP's final loss;
    mean ± the 95% t-interval's half-width over the seeds (``hemiola bench
    horizon``)."""
    rows = [r for r in rows if r.get("row") == "summary"]
    parts = []
    for task, rate, world in dict.fromkeys((r["task"], r["rate"], r["world"]) for r in rows):
        mine = [r for r in rows if (r["task"], r["rate"], r["world"]) == (task, rate, world)]
        first = mine[0]
        head = ["contender", "ms / step", "held-out loss", "vs DDP", "vs one replica",
                f"loss at {_interval(first['budget_s'], '.0f')} s", "vs one replica then",
                "s to DDP's loss"]
        lines = [[r["label"], _interval(r["ms_per_step"], ".1f"),
                  _interval(r["heldout_loss"], ".4f"),
                  _interval(r["vs_ddp"], ".2f", 100, sign=True) + "%",
                  _interval(r["vs_one_replica"], ".4f", sign=True),
                  _interval(r["loss_at_budget"], ".4f"),
                  _interval(r["at_budget_vs_one_replica"], ".4f", sign=True),
                  _interval(r["seconds_to_target"], ".0f")
                  + ("" if r["reached"] == len(r["seeds"]) else
                     f" ({r['reached']}/{len(r['seeds'])} reached)")]
                 for r in mine]
        seeds = ", ".join(map(str, first["seeds"]))
        parts.append(
            f"**{task}** at {rate_label(rate)}, {world} replicas ({first['params'] / 1e6:.1f}M "
            f"parameters, {first['steps']} inner steps of {first['tokens_per_rank_step']} tokens "
            f"per replica; seeds {seeds}; held-out loss on {first['eval_windows']} windows every "
            f"{first['eval_every']} steps; DDP's loss at equal steps from loopback, its time "
            f"per step at the rate):\n\n" + _table(head, lines))
    return "\n\n".join(parts)


def memory_table(rows: Rows) -> str:
    """One line per variant; per world size its peak resident memory of
    training in bytes per parameter (the largest over the ranks, and their
    range), its tensors after the step (parameters + gradients + optimizer
    state) and what was expected (``hemiola bench memory``)."""
    worlds = list(dict.fromkeys(r["world"] for r in rows))
    head = ["configuration"]
    for world in worlds:
        head += [f"peak B/param, {world} ranks (ranks)", "tensors (p + g + s)", "expected"]
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        cells = [mine[0]["label"]]
        for world in worlds:
            r = next((r for r in mine if r["world"] == world), None)
            if r is None:
                cells += ["–", "–", "–"]
                continue
            each = [p["peak_bytes_per_param"] for p in r["ranks"]]
            t = {k: v / r["params"] for k, v in r["tensor_bytes"].items()}
            expected = r.get("expected_bytes_per_param")
            cell = "–" if expected is None else f"{expected:.1f}"
            if r.get("expected_largest_bucket_bytes_per_param") is not None:
                cell += f" ({r['expected_largest_bucket_bytes_per_param']:.1f})"
            cells += [f"{r['peak_bytes_per_param']:.2f} ({min(each):.2f}–{max(each):.2f})",
                      f"{r['tensor_bytes_per_param']:.2f} ({t['params']:.1f} + "
                      f"{t['grads']:.2f} + {t['state']:.2f})", cell]
        lines.append(cells)
    first = rows[0]
    return (f"{first['model']} ({first['params'] / 1e6:.1f}M float32 parameters), "
            f"{first['optimizer']}, {first['iterations']} iterations, loopback, "
            f"{first.get('malloc', 'default')} malloc; expected in parentheses: with the "
            "largest bucket in place of fusion_mb:\n\n" + _table(head, lines))


RENDERERS: dict[str, Callable[[Rows], str]] = {
    "speed": speed_table, "convergence": convergence_table, "ps": ps_table,
    "cluster": cluster_table, "advise": advise_table, "streaming": streaming_table,
    "memory": memory_table, "horizon": horizon_table}


def provenance(rows: Rows, source: str) -> str:
    """One line: where and when the rows were measured, and from which file."""
    stamps = {(r.get("commit", "unknown"), r.get("torch", "?"), r.get("cpu", "?"),
               r.get("cpus", "?"), r.get("gpu")) for r in rows}
    dates = sorted(r["date"] for r in rows if "date" in r)
    described = []
    for commit, torch, cpu, cpus, gpu in sorted(stamps, key=str):
        described.append(f"commit `{commit}`, torch {torch}, {cpu} ({cpus} cores)"
                         + (f", {gpu}" if gpu else ""))
    when = dates[0][:10] if dates else "undated"
    return f"<sub>Measured {when}; " + "; ".join(described) + f"; rows: `{source}`.</sub>"


def render(rows: Rows, source: str) -> str:
    """The table(s) of `rows` (one suite) and their provenance line."""
    suites = {r.get("suite") for r in rows}
    if len(suites) != 1:
        raise ReportError(f"{source}: rows of {len(suites)} suites ({sorted(map(str, suites))}); "
                          "a block renders one")
    suite = suites.pop()
    if suite not in RENDERERS:
        raise ReportError(f"{source}: no table for suite {suite!r}; known: {', '.join(RENDERERS)}")
    return RENDERERS[suite](rows) + "\n\n" + provenance(rows, source)


def select(rows: Rows, filters: list[str], source: str) -> Rows:
    """The rows whose fields equal every ``key=value`` of `filters` (as text)."""
    for f in filters:
        key, sep, value = f.partition("=")
        if not sep:
            raise ReportError(f"{source}: filter {f!r} is not key=value")
        rows = [r for r in rows if str(r.get(key)) == value]
    if not rows:
        raise ReportError(f"{source}: no rows match {' '.join(filters)}")
    return rows


def regenerate(doc: Path) -> str:
    """`doc`'s text with every bench-report block rendered from its file."""
    text = doc.read_text()

    def block(match: re.Match[str]) -> str:
        spec = shlex.split(match.group("spec"))
        if not spec:
            raise ReportError(f"{doc}: a bench-report block names no file")
        path = doc.parent / spec[0]
        if not path.is_file():
            raise ReportError(f"{doc}: bench-report names {spec[0]}, which is not a file "
                              f"(looked for {path})")
        rows = select(read_lines(path), spec[1:], spec[0])
        return match.group(1) + render(rows, spec[0]) + "\n" + match.group(4)

    return BLOCK.sub(block, text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", type=Path,
                        help="result files to print as tables (default: regenerate --doc)")
    parser.add_argument("--doc", type=Path, default=DEFAULT_DOC,
                        help=f"the Markdown file whose bench-report blocks to regenerate "
                             f"(default {DEFAULT_DOC})")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when --doc is not what its rows give")


def run(args: argparse.Namespace) -> int:
    try:
        if args.files:
            for path in args.files:
                print(render(read_lines(path), str(path)) + "\n")
            return 0
        if not args.doc.is_file():
            raise ReportError(f"{args.doc} is not a file (run from the checkout, or pass --doc)")
        new = regenerate(args.doc)
    except (ReportError, ValueError, OSError) as e:
        print(f"hemiola bench report: {e}")
        return 2
    blocks = len(BLOCK.findall(new))
    if new == args.doc.read_text():
        print(f"{args.doc}: {blocks} tables, all up to date")
        return 0
    if args.check:
        print(f"{args.doc}: tables differ from their rows; run `hemiola bench report`")
        return 1
    args.doc.write_text(new)
    print(f"{args.doc}: regenerated {blocks} tables")
    return 0

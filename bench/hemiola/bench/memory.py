"""Peak memory of training per rank, in bytes per parameter: hemiola's
schedules against torch DDP and FSDP2, in one run.

    hemiola bench memory                               # 2 and 4 ranks, every variant
    hemiola bench memory --worlds 2 --schedules sharded --baselines ddp

Every variant trains the same float32 model, the bench's transformer
widened (:func:`hemiola.bench.speed.make_model`'s ``transformer`` at width
512 and 6 layers: 27.1M parameters, its largest tensors the 8000-row
embedding and output layer), with AdamW, for ``--iterations`` iterations on
``N`` ranks over loopback, for each ``N`` of ``--worlds``. The variants are
the bare model (``compute``: each rank alone, no communication), the
baselines ``ddp`` and ``fsdp2`` (:mod:`hemiola.bench.fsdp`,
``reshard_after_forward=False``) and ``hemiola_<contender>`` for each of
``--schedules`` (``sharded-static`` is ``sharded`` with
``rebuild_buckets=False``).

The peak resident set (``VmHWM``) is per process, so every variant runs in
fresh interpreters, one per rank. Each rank joins the process group, trains
a small model of the same kind for two steps (so the code pages of the
kernels, which count as resident, are in before the measurement), resets its
peak (``/proc/self/clear_refs``), reads its resident size (``VmRSS``), then
builds the model, wraps it, trains, and reads ``VmHWM``. Its peak is the
difference: everything the training made resident (parameters, gradients,
optimizer state, communication buffers, activations, the wrapper's engine).

Beside it, the tensors the rank holds after its last step, counted exactly:
its parameters (FSDP2: its shards), its gradients (``.grad``; FSDP2: their
shards; ``sharded``: its shard of the averaged gradients) and the tensors of
``optimizer.state``. What is neither (buffers inside DDP's reducer and
hemiola's engine, FSDP2's whole parameters during forward and backward,
activations) is the difference.

For ``sharded`` the expected bound is 4 + 12/N bytes per parameter (whole
parameters, 1/N of the gradients and of AdamW's two moments) plus its bucket
buffers, at most 2 x ``buckets_in_flight`` x ``fusion_mb`` (``hemiola.Config``'s
with ``--hemiola-options``; reduce-scatters and all-gathers in flight); a
bucket holds at least one whole tensor, so the bound is also given with the
largest bucket of its plan in place of ``fusion_mb``. Each result row is
one variant at one world size; its ``peak_bytes_per_param`` is the largest
over the ranks, each rank's own is in ``ranks``.

The allocator decides what stays resident. torch allocates CPU tensors with
glibc's malloc, whose mmap threshold grows to the largest block freed (up to
32 MiB): afterwards blocks below it come from the heap and stay resident when
freed, so the resident set grows with fragmentation (FSDP2's all-gathers
and reduce-scatters, freed and allocated every iteration, took it to 25.6
bytes per parameter at 2 ranks, against 12.1 with the threshold fixed).
By default (``--malloc mmap``) the ranks run with
``MALLOC_MMAP_THRESHOLD_=131072``: every block above 128 KiB is a mapping of
its own, returned when freed, so the peak is what training held at once;
``--malloc default`` measures glibc's default behaviour.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hemiola.bench.contender import DDP, FSDP2, VARIANTS, Contender
from hemiola.bench.netlab import Loopback, parse_result, rank_main
from hemiola.bench.record import DEFAULT_OUT, write_lines

#: The model: the bench's transformer (width, layers; vocabulary 8000)
#: widened to 27.1M parameters, and the batch each rank trains on.
WIDTH = 512
LAYERS = 6
BATCH = 4
SEQUENCE = 32
#: How the variants that are not contenders read in a table.
LABELS = {"compute": "bare model (no communication)"}
BASELINES: dict[str, Contender | None] = {"compute": None, "ddp": Contender(DDP),
                                          "fsdp2": Contender(FSDP2)}
DEFAULT_BASELINES = "compute,ddp,fsdp2"
DEFAULT_SCHEDULES = "wfbp,priority,sharded,sharded-static"
#: ``--malloc``: the environment of the ranks for each choice
MALLOC = {"mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}, "default": {}}
#: AdamW's hyper-parameters, the same for every variant.
LR = 1e-3
WEIGHT_DECAY = 0.01


def contenders(baselines: list[str], schedules: list[str]) -> dict[str, Contender | None]:
    """The variants of a run by their row names: the baselines, then
    ``hemiola_<contender>`` for each of `schedules`."""
    return {**{b: BASELINES[b] for b in baselines},
            **{f"hemiola_{s}": Contender.parse(s) for s in schedules}}


def contender_named(name: str) -> Contender | None:
    """The contender a rank is told by name ("": the bare model)."""
    if not name:
        return None
    return Contender(FSDP2) if name == FSDP2 else Contender.parse(name)


# ---- one rank ----------------------------------------------------------------


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes (/proc/self/status)."""
    text = Path("/proc/self/status").read_text()
    found = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.M))
    return {key: 1024 * int(kb) for key, kb in found.items()}


def _reset_peak() -> bool:
    """Sets VmHWM to the current resident size (Linux: 5 into clear_refs);
    False when this kernel or sandbox refuses it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    now = _status()
    return now["VmHWM"] - now["VmRSS"] < 1 << 20


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct tensors of `tensors` (each counted once; a
    DTensor by its local shard)."""
    from torch.distributed.tensor import DTensor

    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        key = (t.data_ptr(), t.numel())
        if t.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def tensor_accounting(model: Any, optimizer: Any) -> dict[str, int]:
    """The bytes of parameters, gradients and optimizer state this rank holds
    now (after a step): see the module docstring."""
    import torch

    params = list(model.parameters())
    grads = _bytes(p.grad for p in params if p.grad is not None)
    stats = model.stats() if hasattr(model, "stats") else {}
    if "shard_elements" in stats:  # sharded: its shard of the averaged gradients
        grads += int(stats["shard_elements"]) * params[0].element_size()
    state = _bytes(v for s in optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))
    return {"params": _bytes(params), "grads": grads, "state": state}


def _bucket_bytes(model: Any) -> list[int]:
    """A hemiola-wrapped model's bucket sizes in bytes (its current plan)."""
    sizes = {n: p.numel() * p.element_size() for n, p in model.module.named_parameters()}
    return [sum(sizes[n] for n in bucket) for bucket in model.buckets()]


def _model(config: dict[str, Any], width: int, layers: int) -> tuple[Any, Any, Any]:
    """The transformer at `width` and `layers` and this rank's batch."""
    import torch

    from hemiola.bench.speed import TinyLM

    torch.manual_seed(0)
    model = TinyLM(width, layers)
    tokens = torch.randint(0, 8000, (config["batch"], config["sequence"] + 1),
                           generator=torch.Generator().manual_seed(1 + config["rank"]))
    return model, tokens[:, :-1], tokens[:, 1:].flatten()


def worker(config: dict[str, Any]) -> dict[str, Any]:
    """One rank of one variant (RANK, WORLD_SIZE and MASTER_* in the
    environment): its peak resident memory of training, its tensors after
    the last step, its losses and iteration times."""
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh  # noqa: F401  (imported before the measurement)
    import torch.distributed.fsdp  # noqa: F401
    from torch import nn

    import hemiola
    from hemiola.bench.ddp import ddp_with_hook
    from hemiola.bench.fsdp import fully_shard_model

    torch.set_num_threads(1)
    hemiola.init()
    config = {**config, "rank": dist.get_rank()}
    contender = contender_named(config["contender"])

    def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              n: int) -> tuple[list[float], list[float]]:
        losses, times = [], []
        for _ in range(n):
            start = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
        return losses, times

    # Warm-up: the kernels' code pages and the allocator's arenas, on a small model.
    small, x, y = _model(config, 64, 1)
    train(small, torch.optim.AdamW(small.parameters(), lr=LR), x, y, 2)
    del small, x, y
    gc.collect()
    dist.barrier()
    reset = _reset_peak()
    before = _status()["VmRSS"]

    model, x, y = _model(config, config["width"], config["layers"])
    params = sum(p.numel() for p in model.parameters())
    if contender is not None and contender.is_ddp:
        model = ddp_with_hook(model)
    if contender is not None and contender.is_fsdp2:
        model = fully_shard_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    if contender is not None and not contender.is_torch:
        schedule, options = contender.wrap_arguments()
        model, opt = hemiola.wrap(model, opt, schedule=schedule,
                                  **{**config["hemiola_options"], **options})
    losses, times = train(model, opt, x, y, config["iterations"])
    if hasattr(model, "synchronize"):
        model.synchronize()
    after = _status()
    result: dict[str, Any] = {
        "rank": config["rank"], "params": params, "peak_reset": reset,
        "rss_before": before, "rss_after": after["VmRSS"], "hwm": after["VmHWM"],
        "peak_bytes": after["VmHWM"] - before, "tensors": tensor_accounting(model, opt),
        "losses": losses, "ms": [1e3 * t for t in times]}
    if contender is not None and not contender.is_torch:
        result["bucket_bytes"] = _bucket_bytes(model)
    # Every rank holds the same parameters: a float64 sum of them to compare.
    with torch.no_grad():
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        result["param_sum"] = float(sum(p.double().sum() for p in whole))
    return result


# ---- the run -----------------------------------------------------------------


def _expected(variant: str, contender: Contender | None, world: int, params: int,
              options: dict[str, Any], largest_bucket: int | None) -> dict[str, Any]:
    """What a variant should take, in bytes per parameter (float32, AdamW),
    where the design says: the bare model 16 (parameters, gradients, two
    moments), DDP 20 (and its buckets' copy of the gradients), FSDP2 4 + 16/N
    (whole parameters from forward to backward, and shards of parameters,
    gradients and moments), ``sharded`` 4 + 12/N and its bucket buffers."""
    if contender is None:
        return {"expected_bytes_per_param": 16.0}
    if contender.is_ddp:
        return {"expected_bytes_per_param": 20.0}
    if contender.is_fsdp2:
        return {"expected_bytes_per_param": 4 + 16 / world}
    schedule, wrap_options = contender.wrap_arguments()
    if schedule != "sharded":
        return {"expected_bytes_per_param": None}
    from hemiola.config import Config

    config = Config(schedule=schedule, **{**options, **wrap_options})
    buffers = 2 * config.buckets_in_flight * config.fusion_bytes
    out: dict[str, Any] = {"expected_bytes_per_param": 4 + 12 / world + buffers / params,
                           "buffer_bytes": buffers, "fusion_bytes": config.fusion_bytes,
                           "buckets_in_flight": config.buckets_in_flight}
    if largest_bucket is not None:
        largest = 2 * config.buckets_in_flight * max(config.fusion_bytes, largest_bucket)
        out["expected_largest_bucket_bytes_per_param"] = 4 + 12 / world + largest / params
    return out


def row_of(variant: str, contender: Contender | None, world: int, ranks: list[dict[str, Any]],
           config: dict[str, Any]) -> dict[str, Any]:
    """One row: the variant at `world` ranks, its largest peak over the ranks
    in bytes per parameter, each rank's numbers, and what was expected."""
    params = ranks[0]["params"]
    per_rank = []
    for r in ranks:
        t = r["tensors"]
        tensors = t["params"] + t["grads"] + t["state"]
        per_rank.append({
            "rank": r["rank"], "peak_bytes": r["peak_bytes"],
            "peak_bytes_per_param": r["peak_bytes"] / params,
            "tensor_bytes": t, "tensor_bytes_per_param": tensors / params,
            "other_bytes_per_param": (r["peak_bytes"] - tensors) / params,
            "rss_before": r["rss_before"], "rss_after": r["rss_after"], "hwm": r["hwm"],
            "peak_reset": r["peak_reset"], "losses": r["losses"], "param_sum": r["param_sum"],
            "median_ms": statistics.median(r["ms"])})
    worst = max(per_rank, key=lambda p: p["peak_bytes_per_param"])
    buckets = ranks[0].get("bucket_bytes")
    largest = max(buckets) if buckets else None
    sums = {r["param_sum"] for r in ranks}
    return {
        "suite": "memory", "variant": variant, "world": world, "rate": "none",
        "label": LABELS[variant] if contender is None else contender.label,
        "model": f"transformer-{config['width']}x{config['layers']}", "params": params,
        "batch": config["batch"], "sequence": config["sequence"], "optimizer": "AdamW",
        "iterations": config["iterations"], "malloc": config["malloc"],
        "peak_bytes_per_param": worst["peak_bytes_per_param"],
        "tensor_bytes_per_param": worst["tensor_bytes_per_param"],
        "other_bytes_per_param": worst["other_bytes_per_param"],
        "tensor_bytes": worst["tensor_bytes"], "buckets": len(buckets) if buckets else None,
        "largest_bucket_bytes": largest,
        "ranks_agree": len(sums) == 1 if contender is not None else None,
        "loss_first": statistics.fmean(r["losses"][0] for r in ranks),
        "loss_last": statistics.fmean(r["losses"][-1] for r in ranks),
        **_expected(variant, contender, world, params, config["hemiola_options"], largest),
        "hemiola_options": config["hemiola_options"], "ranks": per_rank}


def print_table(rows: list[dict[str, Any]]) -> None:
    """Per world size: each variant's largest peak over the ranks and its
    tensors after the step, in bytes per parameter, and what was expected."""
    for world in dict.fromkeys(r["world"] for r in rows):
        mine = [r for r in rows if r["world"] == world]
        print(f"\n{world} ranks, {mine[0]['params'] / 1e6:.1f}M parameters, AdamW, "
              f"{mine[0]['malloc']} malloc (bytes per parameter; peak: the largest over the "
              "ranks):")
        print(f"  {'variant':36s} {'peak':>6s} {'ranks':>13s} {'tensors':>8s} "
              f"{'(p+g+s)':>15s} {'other':>6s} {'expected':>14s}  loss")
        for r in mine:
            each = [p["peak_bytes_per_param"] for p in r["ranks"]]
            t = {k: v / r["params"] for k, v in r["tensor_bytes"].items()}
            expected = r["expected_bytes_per_param"]
            cell = "" if expected is None else f"{expected:.1f}"
            if r.get("expected_largest_bucket_bytes_per_param") is not None:
                cell += f" ({r['expected_largest_bucket_bytes_per_param']:.1f})"
            agree = {True: "", False: " RANKS DIFFER", None: ""}[r["ranks_agree"]]
            print(f"  {r['label']:36s} {r['peak_bytes_per_param']:6.2f} "
                  f"{min(each):6.2f}-{max(each):<6.2f} {r['tensor_bytes_per_param']:8.2f} "
                  f"{t['params']:4.1f}+{t['grads']:4.1f}+{t['state']:4.1f} "
                  f"{r['other_bytes_per_param']:6.2f} {cell:>14s}  "
                  f"{r['loss_first']:.3f}->{r['loss_last']:.3f}{agree}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--schedules", default=DEFAULT_SCHEDULES,
                        help=f"hemiola schedules or variants ({', '.join(VARIANTS)}); default "
                             f"{DEFAULT_SCHEDULES}")
    parser.add_argument("--baselines", default=DEFAULT_BASELINES,
                        help=f"comma-separated, of {', '.join(BASELINES)} (default "
                             f"{DEFAULT_BASELINES})")
    parser.add_argument("--hemiola-options", type=json.loads, default={}, metavar="JSON",
                        help="more keyword arguments of hemiola.wrap, e.g. "
                             "'{\"buckets_in_flight\": 1}'")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--malloc", choices=list(MALLOC), default="mmap",
                        help="mmap (default): every block above 128 KiB its own mapping, "
                             "returned when freed; default: glibc's dynamic threshold "
                             "(fragmentation stays resident)")
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per rank")
    parser.add_argument("--sequence", type=int, default=SEQUENCE, help="tokens per sequence")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per variant and world")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--name", default="memory", help="results go to OUT/NAME.jsonl")


def run(args: argparse.Namespace) -> int:
    schedules = [s for s in args.schedules.split(",") if s]
    baselines = [b for b in args.baselines.split(",") if b]
    if set(baselines) - set(BASELINES):
        raise SystemExit(f"--baselines: any of {', '.join(BASELINES)}")
    try:
        runs = contenders(baselines, schedules)
    except ValueError as e:
        raise SystemExit(f"--schedules: {e}") from None
    if any(c is not None and c.is_ddp for v, c in runs.items() if v.startswith("hemiola_")):
        raise SystemExit("--schedules: torch DDP is a baseline (--baselines)")
    worlds = [int(w) for w in args.worlds.split(",") if w]
    if args.iterations < 2:
        raise SystemExit("--iterations must be at least 2 (the first builds the state)")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    config = {"width": args.width, "layers": args.layers, "batch": args.batch,
              "sequence": args.sequence, "iterations": args.iterations,
              "hemiola_options": args.hemiola_options, "malloc": args.malloc}
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    os.environ.update(MALLOC[args.malloc])  # the ranks' (read when they start)
    rows: list[dict[str, Any]] = []
    for world in worlds:
        for k, (variant, contender) in enumerate(runs.items()):
            print(f"{variant} on {world} ranks ({args.malloc} malloc) ...", flush=True)
            name = "" if contender is None else contender.name
            out = Loopback(world).run_ranks(
                [sys.executable, "-m", "hemiola.bench.memory", "--worker",
                 json.dumps({**config, "contender": name})], 29600 + k, args.timeout_s)
            ranks = [parse_result(o) for o in out]
            rows.append(row_of(variant, contender, world, ranks, config))
    print_table(rows)
    path = write_lines(args.out / f"{args.name}.jsonl", rows)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    rank_main(worker, "memory")

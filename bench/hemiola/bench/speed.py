"""Iteration time of every hemiola schedule against what a DDP user runs
today, over a real rate-limited link or over loopback, in one run.

    hemiola bench speed                                  # 1 and 5 Gbit/s, the slow-link MLP
    hemiola bench speed --rates none --models cnn,transformer   # no limit: the overhead

For each rate, the ranks run in network namespaces joined through veth pairs
limited by ``tc tbf`` (:mod:`hemiola.bench.netlab`, needs root); ``none``
runs them on loopback (no root). One fresh interpreter per rank; rank 0 hosts
torch's TCPStore, and every rank's Gloo (torch's and hemiola's) binds its
link. Each rank alternates blocks of iterations of every variant, in
alternating order, with a barrier before each block, so a drift in machine
load touches every variant alike:

- baselines: ``compute`` (the bare model, no communication), ``ddp`` (torch
  DistributedDataParallel over Gloo) and the communication hooks DDP users run
  on slow links, ``ddp_fp16`` (``fp16_compress_hook``) and ``ddp_powersgd``
  (``powerSGD_hook``, rank 2; one bucket): :func:`hemiola.bench.ddp.ddp_with_hook`;
  ``fsdp2``, torch's ``fully_shard`` with ``reshard_after_forward=False``
  (ZeRO-2, the peer of ``sharded``; CPU only): :mod:`hemiola.bench.fsdp`;
- ``hemiola_<contender>`` for each :class:`~hemiola.bench.contender.Contender`
  of ``--schedules`` (``<schedule>+<compression>`` with that ``compression``);
  PowerSGD starts after ``--powersgd-start`` iterations in DDP and hemiola alike;
- ``comm``: one all-reduce (average) through a hemiola engine of a flat float32
  buffer as large as all the gradients, no computation; ``comm_torch``: the same
  through torch's Gloo.

DDP and hemiola use their own default buckets unless ``--fusion-mb`` sets both
caps. Each result row is one variant at one rate: rank 0's median iteration
time with its 10th and 90th percentiles, its ratio to DDP, the lower bound
max(compute, comm), and the environment stamp. ``hemiola bench report`` makes
the tables of docs/benchmarks.md from these rows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hemiola.bench.contender import DDP, FSDP2, VARIANTS, Contender
from hemiola.bench.ddp import ddp_with_hook
from hemiola.bench.fsdp import fully_shard_model
from hemiola.bench.netlab import Loopback, Network, parse_result, rank_main
from hemiola.bench.record import DEFAULT_OUT, percentiles, write_lines

#: Width and batch of the ``mlp`` model: 9.4M parameters (37.8 MB of float32
#: gradients, whose all-reduce takes about 1.5x the compute at 1 Gbit/s on the
#: 2-core development machine), the slow-link setting of issue 26.
MLP_WIDTH = 1536
MLP_BATCH = 384
MODELS = {
    "mlp": "9.4M-parameter MLP (37.8 MB of gradients): communication > computation at 1 Gbit/s",
    "cnn": "0.39M-parameter CNN with BatchNorm, batch 16 of 32x32 images",
    "transformer": "5.7M-parameter 2-layer transformer LM, 8 x 64 tokens",
    "resnet50": "torchvision ResNet-50 (25.6M parameters, 102 MB of gradients), batch 64 "
                "of 224x224 images: for a GPU (--device cuda)",
}

#: The configurations a user compares against, in the order of the tables, by
#: their names in --baselines and in the rows: the bare model (None), then torch
#: DDP with each hook.
BASELINES: dict[str, Contender | None] = {
    "compute": None,
    "ddp": Contender(DDP),
    "ddp_fp16": Contender(DDP, "fp16"),
    "ddp_bf16": Contender(DDP, "bf16"),
    "ddp_powersgd": Contender(DDP, "powersgd"),
    "fsdp2": Contender(FSDP2),
}
DEFAULT_BASELINES = "compute,ddp,ddp_fp16,ddp_powersgd"
#: How the variants that are not contenders read in a table.
LABELS = {"compute": "bare model (no communication)",
          "comm": "all-reduce alone (hemiola engine)",
          "comm_torch": "all-reduce alone (torch Gloo)"}


def make_model(name: str, mlp_batch: int = MLP_BATCH,
               mlp_width: int = MLP_WIDTH) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model of MODELS and one batch for it (per rank), the same on every rank."""
    torch.manual_seed(0)
    if name == "mlp":
        from hemiola.advise import slow_link_mlp

        model: nn.Module = slow_link_mlp(mlp_width)
        return model, torch.randn(mlp_batch, mlp_width), torch.randint(0, 10, (mlp_batch,))
    if name == "cnn":
        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU())
        model = nn.Sequential(block(3, 32), block(32, 64), nn.MaxPool2d(2), block(64, 128),
                              nn.MaxPool2d(2), block(128, 256), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(256, 10))
        return model, torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    if name == "transformer":
        model = TinyLM()
        tokens = torch.randint(0, 8000, (8, 65))
        return model, tokens[:, :-1], tokens[:, 1:].flatten()
    if name == "resnet50":
        import torchvision

        return (torchvision.models.resnet50(), torch.randn(64, 3, 224, 224),
                torch.randint(0, 1000, (64,)))
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


class TinyLM(nn.Module):
    """The ``transformer`` of MODELS (the defaults: 5.7M parameters); the
    memory suite widens it."""

    def __init__(self, width: int = 256, layers: int = 2, vocab: int = 8000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(width, vocab)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.embed(t))).flatten(0, 1)


def timed_iterations(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                     y: torch.Tensor, n: int) -> list[float]:
    """Seconds of each of `n` training iterations (zero_grad, forward, backward,
    step); on a GPU each ends when the device has finished its work.

    ``priority`` and ``decoupled`` leave the last iteration's reductions in
    flight (they overlap the next iteration). The block ends by landing them
    (``synchronize()``), timed into its last iteration: otherwise they would
    finish during the next variant's block, slowing it on the shared link,
    and this variant's next block would start with nothing to wait for."""
    cuda = x.is_cuda
    drain = getattr(model, "synchronize", None)
    times = []
    for i in range(n):
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i == n - 1 and drain is not None:
            drain()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def contenders(config: dict[str, Any]) -> dict[str, Contender | None]:
    """The variants of a run by their row names: the baselines, then
    ``hemiola_<contender>`` for each of the schedules."""
    return {**{b: BASELINES[b] for b in config["baselines"]},
            **{f"hemiola_{s}": Contender.parse(s) for s in config["schedules"]}}


def _build(contender: Contender | None,
           config: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor,
                                            torch.Tensor]:
    """The model of `contender` (None: the bare model), its optimizer and batch."""
    import hemiola

    model, x, y = make_model(config["model"], config["mlp_batch"], config["mlp_width"])
    device = torch.device(config["device"])
    model, x, y = model.to(device), x.to(device), y.to(device)
    if contender is not None and contender.is_ddp:
        model = ddp_with_hook(model, contender.compression,
                              powersgd_start=config["powersgd_start"],
                              bucket_cap_mb=config["fusion_mb"])
    if contender is not None and contender.is_fsdp2:
        model = fully_shard_model(model)  # the optimizer goes over its shards
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if contender is not None and not contender.is_torch:
        schedule, wrap_options = contender.wrap_arguments()
        options = {**config["hemiola_options"], **wrap_options}
        if contender.compression == "powersgd":
            options.setdefault("powersgd_start_iter", config["powersgd_start"])
        if config["fusion_mb"] is not None:
            options["fusion_mb"] = config["fusion_mb"]
        if device.type == "cuda":
            # Several ranks share the one GPU: NCCL refuses that, so both DDP
            # (torch's Gloo) and hemiola stage CUDA tensors through the host.
            options.setdefault("gpu_backend", "gloo")
        model, opt = hemiola.wrap(model, opt, schedule=schedule,
                                  timeline=config["timeline"] is not None, **options)
    return model, opt, x, y


def write_timelines(prefix: str, runs: dict[str, Any], variants: dict[str, Any],
                    writer: bool) -> None:
    """Rank 0 writes each hemiola contender's engine timeline and, beside them,
    torch's profile of one DDP iteration (``PREFIX-ddp.json``; every rank runs
    that iteration, since its all-reduces need them all)."""
    import torch.distributed as dist

    if "ddp" in variants:
        dist.barrier()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if variants["ddp"][2].is_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            timed_iterations(*variants["ddp"], 1)
        if writer:
            profile.export_chrome_trace(f"{prefix}-ddp.json")
    if writer:
        for variant, (model, *_) in variants.items():
            contender = runs[variant]
            if contender is not None and not contender.is_torch:
                Path(f"{prefix}-{contender.name}.json").write_text(model.timeline())


def worker(config: dict[str, Any]) -> dict[str, Any]:
    """One rank (RANK, WORLD_SIZE, MASTER_* and GLOO_SOCKET_IFNAME in the
    environment): every variant in alternating blocks; returns each variant's
    iteration times in ms."""
    import torch.distributed as dist

    import hemiola
    from hemiola._native import C
    from hemiola.distributed import new_engine
    from hemiola.engine_tensors import dtype_code

    torch.set_num_threads(1)
    hemiola.init()
    runs = contenders(config)
    variants = {v: _build(c, config) for v, c in runs.items()}
    bare = variants.get("compute") or _build(None, config)
    params = sum(p.numel() for p in bare[0].parameters() if p.requires_grad)
    engine, _store = new_engine(timeout_s=300.0)
    flat = torch.zeros(params, dtype=torch.float32)

    def comm(n: int, torch_gloo: bool) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            if torch_gloo:
                dist.all_reduce(flat)
                flat.div_(dist.get_world_size())
            else:
                engine.all_reduce(flat.data_ptr(), dtype_code(torch.float32), flat.numel(),
                                  C.ReduceOp.average).wait()
            times.append(time.perf_counter() - start)
        return times

    def block(variant: str, n: int) -> list[float]:
        if variant.startswith("comm"):
            return comm(n, torch_gloo=variant == "comm_torch")
        return timed_iterations(*variants[variant], n)

    order = [*variants, "comm", "comm_torch"]
    for variant in order:  # warm-up (and DDP's bucket rebuild)
        block(variant, 2)
    samples: dict[str, list[float]] = {v: [] for v in order}
    blocks = config["blocks"]
    for b in range(blocks):
        per_block = config["iterations"] // blocks + (b < config["iterations"] % blocks)
        for variant in order if b % 2 == 0 else reversed(order):
            dist.barrier()
            samples[variant] += block(variant, per_block)
    dist.barrier()
    if config["timeline"] is not None:
        write_timelines(config["timeline"], runs, variants, dist.get_rank() == 0)
    return {"params": params, "batch": int(bare[2].shape[0]),
            "ms": {v: [1e3 * t for t in s] for v, s in samples.items()}}


def rows_of(result: dict[str, Any], rate: str, model: str, world: int,
            config: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant: median and p10-p90 in ms, the ratio to DDP's median
    and to the lower bound max(compute, comm)."""
    stats = {v: percentiles(ms) for v, ms in result["ms"].items()}
    ddp = stats["ddp"]["median"] if "ddp" in stats else None
    compute = stats["compute"]["median"] if "compute" in stats else None
    bound = max(compute, stats["comm"]["median"]) if compute is not None else None
    runs = contenders(config)
    rows = []
    for variant, s in stats.items():
        rows.append({
            "suite": "speed", "rate": rate, "model": model, "world": world,
            "variant": variant,
            "label": LABELS[variant] if variant in LABELS else runs[variant].label,
            "median_ms": s["median"], "p10_ms": s["p10"], "p90_ms": s["p90"],
            "samples": len(result["ms"][variant]),
            "vs_ddp": s["median"] / ddp if ddp and not variant.startswith("comm") else None,
            "bound_ms": bound, "params": result["params"], "batch": result["batch"],
            "grad_mb": 4 * result["params"] / 1e6, "fusion_mb": config["fusion_mb"],
            "device": config["device"],
            "mps_percent": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            "powersgd_start": config["powersgd_start"],
            "hemiola_options": config["hemiola_options"]})
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars per model: one group per rate, one bar per variant (median,
    whiskers p10-p90). Returns None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        rates = list(dict.fromkeys(r["rate"] for r in mine))
        variants = list(dict.fromkeys(r["variant"] for r in mine))
        width = 0.8 / len(variants)
        for k, variant in enumerate(variants):
            vrows = [next(r for r in mine if r["rate"] == rate and r["variant"] == variant)
                     for rate in rates]
            heights = [r["median_ms"] for r in vrows]
            errors = [[r["median_ms"] - r["p10_ms"] for r in vrows],
                      [r["p90_ms"] - r["median_ms"] for r in vrows]]
            ax.bar([i + k * width for i in range(len(rates))], heights, width, yerr=errors,
                   label=vrows[0]["label"], capsize=2)
        ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(rates))], rates)
        ax.set_title(f"{model} ({mine[0]['world']} ranks)")
        ax.set_ylabel("iteration time (ms), median and p10-p90")
    axes[0][0].legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(rows: list[dict[str, Any]]) -> None:
    """Per rate and model: each variant's median [p10-p90] and ratio to DDP."""
    for rate, model in dict.fromkeys((r["rate"], r["model"]) for r in rows):
        print(f"\n{model} at {rate}:")
        for r in rows:
            if (r["rate"], r["model"]) != (rate, model):
                continue
            ratio = f"{r['vs_ddp']:.2f}x DDP" if r["vs_ddp"] is not None else ""
            print(f"  {r['label']:40s} {r['median_ms']:8.1f} ms  "
                  f"[{r['p10_ms']:.1f}-{r['p90_ms']:.1f}]  {ratio}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hemiola.config import SCHEDULES

    parser.add_argument("--rates", default="1gbit,5gbit",
                        help="tc rates, comma-separated (default 1gbit,5gbit; needs root); "
                             "'none' runs on loopback without a limit")
    parser.add_argument("--models", default="mlp", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"hemiola schedules (default: {','.join(SCHEDULES)}) or "
                             f"variants ({','.join(VARIANTS)}); SCHEDULE+COMPRESSION wraps "
                             "with that compression, e.g. decoupled+int8")
    parser.add_argument("--baselines", default=DEFAULT_BASELINES,
                        help=f"comma-separated, of {', '.join(BASELINES)} (default "
                             f"{DEFAULT_BASELINES}; torch allows ddp_bf16 only with NCCL)")
    parser.add_argument("--hemiola-options", type=json.loads, default={}, metavar="JSON",
                        help="more keyword arguments of hemiola.wrap, e.g. '{\"fusion_mb\": 8}'")
    parser.add_argument("--iterations", type=int, default=20,
                        help="measured iterations per variant (after 2 of warm-up)")
    parser.add_argument("--blocks", type=int, default=4,
                        help="alternating blocks the iterations are split into")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--fusion-mb", type=float, default=None,
                        help="bucket cap in MiB of DDP and hemiola; default: each library's own")
    parser.add_argument("--powersgd-start", type=int, default=2,
                        help="iterations before PowerSGD compresses, DDP and hemiola alike "
                             "(default 2: the measured iterations are all compressed)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda: every rank trains on the one GPU (cuda:0) and "
                             "DDP and hemiola reduce over Gloo staged through the host")
    parser.add_argument("--mlp-batch", type=int, default=MLP_BATCH)
    parser.add_argument("--mlp-width", type=int, default=MLP_WIDTH)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per rate and model")
    parser.add_argument("--timeline", metavar="DIR",
                        help="write rank 0's timeline of each hemiola schedule here "
                             "(<rate>-<model>-<schedule>.json)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--name", default="speed", help="results go to OUT/NAME.jsonl and .png")


def run(args: argparse.Namespace) -> int:

    schedules = [s for s in args.schedules.split(",") if s]
    for schedule in schedules:
        try:
            contender = Contender.parse(schedule)
        except ValueError as e:
            raise SystemExit(f"--schedules: {e}") from None
        if contender.is_ddp:
            raise SystemExit("--schedules: torch DDP is a baseline (--baselines)")
    baselines = [b for b in args.baselines.split(",") if b]
    if set(baselines) - set(BASELINES):
        raise SystemExit(f"--baselines: any of {', '.join(BASELINES)}")
    if "fsdp2" in baselines and args.device != "cpu":
        raise SystemExit("--baselines fsdp2 runs on the CPU (over Gloo) only")
    models = [m for m in args.models.split(",") if m]
    if set(models) - set(MODELS):
        raise SystemExit(f"--models: any of {', '.join(MODELS)}")
    if args.iterations < args.blocks:
        raise SystemExit("--iterations must be at least --blocks")
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the namespaces are removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Rank 0 hosts the store itself (torch's env:// default).
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rows: list[dict[str, Any]] = []
    for rate in args.rates.split(","):
        net = Loopback(args.world_size) if rate == "none" else Network(args.world_size, rate)
        with net:
            for k, model in enumerate(models):
                timeline = None
                if args.timeline:
                    Path(args.timeline).mkdir(parents=True, exist_ok=True)
                    timeline = str(Path(args.timeline).resolve() / f"{rate}-{model}")
                config = {"model": model, "device": args.device, "schedules": schedules,
                          "baselines": baselines,
                          "iterations": args.iterations, "blocks": args.blocks,
                          "mlp_batch": args.mlp_batch, "mlp_width": args.mlp_width,
                          "fusion_mb": args.fusion_mb, "powersgd_start": args.powersgd_start,
                          "hemiola_options": args.hemiola_options, "timeline": timeline}
                print(f"{model} at {rate}: {len(baselines) + len(schedules) + 2} variants x "
                      f"{args.iterations} iterations on {args.world_size} ranks ...", flush=True)
                out = net.run_ranks([sys.executable, "-m", "hemiola.bench.speed", "--worker",
                                     json.dumps(config)], 29500 + k, args.timeout_s)
                rows += rows_of(parse_result(out[0]), rate, model, args.world_size, config)
    print_table(rows)
    path = write_lines(args.out / f"{args.name}.jsonl", rows)
    picture = plot(rows, args.out / f"{args.name}.png")
    print(f"\nwrote {path}" + (f" and {picture}" if picture else ""))
    return 0


if __name__ == "__main__":
    rank_main(worker, "speed")

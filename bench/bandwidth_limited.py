"""Iteration time over a real, rate-limited network on one machine: torch DDP,
each hemiola schedule, compute alone and communication alone, in the same run.

    python bench/bandwidth_limited.py --rates 1gbit,5gbit --iterations 20

Needs root. For each rate, N network namespaces are joined through veth pairs
limited by ``tc tbf`` (bench/netlab.py); for each model, one fresh interpreter
per rank runs inside its namespace. Rank 0 hosts torch's TCPStore (env://) at
its namespace's address, and every rank's Gloo (torch's and hemiola's) binds
its veth. Each rank alternates blocks of iterations of every variant, with a
barrier before each block:

- ``ddp``: torch DistributedDataParallel over Gloo, and the communication
  hooks DDP users run on slow links (``--baselines``): ``ddp_fp16``
  (``fp16_compress_hook``) and ``ddp_powersgd`` (``powerSGD_hook``, rank 2,
  2 warm-up steps; one bucket, see ``worker``);
- ``hemiola_<schedule>``: ``hemiola.wrap(..., schedule=<schedule>)``, for each
  schedule in ``--schedules`` (default: all of ``hemiola.config.SCHEDULES``);
  ``<schedule>+<compression>`` wraps with ``compression=<compression>``;
- ``compute``: the bare model, no communication;
- ``comm``: one all-reduce (average) through a hemiola engine of a flat
  float32 buffer as large as all the gradients, no computation;
  ``comm_torch``: the same through torch's Gloo (``dist.all_reduce``).

DDP and hemiola use their own default buckets (25 MiB, the first 1 MiB) unless
``--fusion-mb`` sets both caps.
The lower bound of an iteration is max(compute, comm) (medians). Rank 0's
medians are reported, with their 10th and 90th percentiles
(``<variant>_ms_p10_p90``) and the environment (commit, torch, CPU) in every
row. Writes bench/results/bandwidth_limited.jsonl and .png and prints a table.
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
from common import RESULTS, median, spread, write_results
from netlab import Network, parse_result, print_result
from torch import nn
from wfbp_vs_ddp import _iterations
from wfbp_vs_ddp import make_model as make_wfbp_model

#: Width and batch of the ``mlp`` model: 9.4M parameters (37.8 MB of float32
#: gradients, whose all-reduce takes about 1.5x the compute at 1 Gbit/s), the
#: slow-link setting of issue 26 (see bench/BANDWIDTH.md).
MLP_WIDTH = 1536
MLP_BATCH = 384
MODELS = {
    "mlp": "9.4M-parameter MLP (37.8 MB of gradients): communication > computation at 1 Gbit/s",
    "cnn": "0.39M-parameter CNN (1.6 MB of gradients): computation dominates",
}


def make_model(name: str, mlp_batch: int,
               mlp_width: int = 1024) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model of MODELS and one batch for it (per rank), the same on every rank."""
    if name == "cnn":  # bench/wfbp_vs_ddp.py's CNN, batch 16 of 32x32 images
        return make_wfbp_model("cnn")
    if name == "mlp":  # four width x width layers and a classifier
        from hemiola.advise import slow_link_mlp

        model = slow_link_mlp(mlp_width)
        x = torch.randn(mlp_batch, mlp_width)
        y = torch.randint(0, 10, (mlp_batch,))
        return model, x, y
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


#: The DDP configurations a user on a slow link runs today (``--baselines``).
BASELINES = {
    "ddp": "torch DDP",
    "ddp_fp16": "torch DDP + fp16_compress_hook",
    "ddp_bf16": "torch DDP + bf16_compress_hook",
    "ddp_powersgd": "torch DDP + PowerSGD (rank 2, 2 warm-up steps)",
}


def register_ddp_hook(model: nn.Module, variant: str) -> None:
    """Registers the communication hook of a BASELINES entry on a DDP model."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if variant == "ddp_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif variant == "ddp_bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif variant == "ddp_powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                       start_powerSGD_iter=2)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
    elif variant != "ddp":
        raise ValueError(f"unknown baseline {variant!r}; known: {', '.join(BASELINES)}")


def worker(config: dict[str, Any]) -> dict[str, Any]:
    """One rank (RANK, WORLD_SIZE, MASTER_* and GLOO_SOCKET_IFNAME in the environment)."""
    import torch.distributed as dist

    import hemiola
    from hemiola._native import C
    from hemiola.distributed import new_engine
    from hemiola.tensors import dtype_code

    torch.set_num_threads(1)
    hemiola.init()
    name, schedules = config["model"], config["schedules"]
    variants: dict[str, tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]] = {}
    for variant in [*config["baselines"], *[f"hemiola_{s}" for s in schedules], "compute"]:
        model, x, y = make_model(name, config["mlp_batch"], config["mlp_width"])
        if variant.startswith("ddp"):
            # PowerSGD's hook issues its later all-reduces from Gloo's completion
            # threads, so with two buckets the ranks can issue them in different
            # orders (a collective mismatch): one bucket keeps it correct on CPU.
            cap = 1e6 if variant == "ddp_powersgd" else config["fusion_mb"]
            model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
            register_ddp_hook(model, variant)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if variant.startswith("hemiola_"):
            schedule, _, compression = variant[len("hemiola_"):].partition("+")
            options = dict(config["hemiola_options"])
            if compression:
                options["compression"] = compression
            if config["fusion_mb"] is not None:
                options["fusion_mb"] = config["fusion_mb"]
            model, opt = hemiola.wrap(model, opt, schedule=schedule,
                                      timeline=config["timeline"] is not None, **options)
        variants[variant] = (model, opt, x, y)
    params = sum(p.numel() for p in variants["compute"][0].parameters() if p.requires_grad)
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
        model, opt, x, y = variants[variant]
        return _iterations(model, opt, x, y, n)

    order = [*variants, "comm", "comm_torch"]
    for variant in order:  # warm-up (and bucket rebuild)
        block(variant, 2)
    samples: dict[str, list[float]] = {v: [] for v in order}
    blocks = config["blocks"]
    for b in range(blocks):
        per_block = config["iterations"] // blocks + (b < config["iterations"] % blocks)
        for variant in order if b % 2 == 0 else reversed(order):
            dist.barrier()
            samples[variant] += block(variant, per_block)
    dist.barrier()
    if config["timeline"] is not None and dist.get_rank() == 0:
        for variant, (model, *_) in variants.items():
            if variant.startswith("hemiola_"):
                Path(f"{config['timeline']}-{variant[len('hemiola_'):]}.json").write_text(
                    model.timeline())
    return {"params": params, "batch": int(variants["compute"][2].shape[0]),
            **{f"{v}_ms": 1e3 * median(s) for v, s in samples.items()},
            **{f"{v}_ms_p10_p90": [1e3 * x for x in spread(s)] for v, s in samples.items()}}


def run_model(net: Network, model: str, rate: str, args: argparse.Namespace,
              port: int) -> dict[str, Any]:
    """Runs the ranks of one model inside `net`'s namespaces; returns rank 0's medians."""
    timeline = None
    if args.timeline:
        Path(args.timeline).mkdir(parents=True, exist_ok=True)
        timeline = str(Path(args.timeline).resolve() / f"{rate}-{model}")
    config = {"model": model, "schedules": args.schedules, "baselines": args.baselines,
              "iterations": args.iterations, "blocks": args.blocks, "mlp_batch": args.mlp_batch,
              "mlp_width": args.mlp_width, "fusion_mb": args.fusion_mb,
              "hemiola_options": args.hemiola_options, "timeline": timeline}
    result = net.run_ranks([sys.executable, __file__, "--worker", json.dumps(config)], port,
                           args.timeout_s)[0]
    return dict(parse_result(result))


def compared(baselines: list[str], schedules: list[str]) -> list[str]:
    """The variants a row compares against DDP: the other baselines, then hemiola's."""
    return [b for b in baselines if b != "ddp"] + [f"hemiola_{s}" for s in schedules]


def summarise(rate: str, model: str, world: int, baselines: list[str], schedules: list[str],
              iterations: int, result: dict[str, Any]) -> dict[str, Any]:
    """A result row: the medians, the lower bound and every variant's ratios."""
    bound = max(result["compute_ms"], result["comm_ms"])
    row = {"bench": "bandwidth_limited", "rate": rate, "model": model, "world": world,
           "iterations": iterations, **result, "grad_mb": 4 * result["params"] / 1e6,
           "lower_bound_ms": bound, "ddp_vs_bound": result["ddp_ms"] / bound}
    for v in compared(baselines, schedules):
        ms = result[f"{v}_ms"]
        row[f"{v}_vs_ddp"] = ms / result["ddp_ms"]
        row[f"{v}_vs_bound"] = ms / bound
    return row


def print_table(rows: list[dict[str, Any]], baselines: list[str], schedules: list[str]) -> None:
    """A markdown table of every row (times in ms, and each variant's ratio to DDP)."""
    variants = compared(baselines, schedules)
    head = ["rate", "model", "compute", "comm", "bound", "DDP"]
    for v in variants:
        label = v.removeprefix("hemiola_")
        head += [label, f"{label}/DDP"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["rate"], r["model"], *(f"{r[k]:.1f}" for k in
                 ("compute_ms", "comm_ms", "lower_bound_ms", "ddp_ms"))]
        for v in variants:
            cells += [f"{r[f'{v}_ms']:.1f}", f"{r[f'{v}_vs_ddp']:.2f}"]
        print("| " + " | ".join(cells) + " |")


def plot(rows: list[dict[str, Any]], baselines: list[str], schedules: list[str],
         path: Path) -> None:
    """Grouped bars: per model, one group per rate, one bar per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    keys = ["compute_ms", "comm_ms", "lower_bound_ms", *[f"{b}_ms" for b in baselines],
            *[f"hemiola_{s}_ms" for s in schedules]]
    labels = ["compute alone", "comm alone", "lower bound", *[BASELINES[b] for b in baselines],
              *[f"hemiola {s}" for s in schedules]]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    width = 0.8 / len(keys)
    for ax, model in zip(axes[0], models):
        mrows = [r for r in rows if r["model"] == model]
        for k, (key, label) in enumerate(zip(keys, labels)):
            ax.bar([i + k * width for i in range(len(mrows))], [r[key] for r in mrows], width,
                   label=label, hatch="//" if key == "lower_bound_ms" else None)
        ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(mrows))],
                      [r["rate"] for r in mrows])
        ax.set_title(f"{model} ({mrows[0]['world']} ranks)")
        ax.set_ylabel("median iteration time (ms)")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    from hemiola.config import SCHEDULES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1gbit,5gbit", help="tc rates, comma-separated")
    parser.add_argument("--models", default=",".join(MODELS), help=", ".join(MODELS))
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"hemiola schedules (default: all of {', '.join(SCHEDULES)}); "
                             "SCHEDULE+COMPRESSION wraps with that compression, e.g. "
                             "decoupled+fp16")
    parser.add_argument("--baselines", default="ddp,ddp_fp16,ddp_powersgd",
                        help=f"DDP configurations, ddp first; known: {', '.join(BASELINES)} "
                             "(torch allows ddp_bf16 only with NCCL)")
    parser.add_argument("--hemiola-options", type=json.loads, default={}, metavar="JSON",
                        help="more keyword arguments of hemiola.wrap, e.g. "
                             "'{\"first_bucket_mb\": 8}'")
    parser.add_argument("--iterations", type=int, default=20,
                        help="measured iterations per variant (after 2 of warm-up)")
    parser.add_argument("--blocks", type=int, default=4,
                        help="alternating blocks the iterations are split into")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--fusion-mb", type=float, default=None,
                        help="bucket cap in MiB of DDP (bucket_cap_mb) and hemiola (fusion_mb); "
                             "default: each library's own (25 MiB, the first bucket 1 MiB; "
                             "torch DDP caps its first bucket at 1 MiB only when bucket_cap_mb "
                             "is not given)")
    parser.add_argument("--mlp-batch", type=int, default=MLP_BATCH)
    parser.add_argument("--mlp-width", type=int, default=MLP_WIDTH)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per rate and model")
    parser.add_argument("--timeline", metavar="DIR",
                        help="write rank 0's timeline of each hemiola schedule here "
                             "(<rate>-<model>-<schedule>.json; plot with bench/plot_timeline.py)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print_result(worker(json.loads(args.worker)))
        import torch.distributed as dist

        dist.destroy_process_group()  # torch's Gloo thread must not outlive the interpreter
        return
    args.schedules = [s for s in args.schedules.split(",") if s]
    unknown = sorted({s.partition("+")[0] for s in args.schedules} - set(SCHEDULES))
    if unknown:
        parser.error(f"unknown schedule(s) {', '.join(unknown)}; known: {', '.join(SCHEDULES)}")
    args.baselines = [b for b in args.baselines.split(",") if b]
    if not args.baselines or args.baselines[0] != "ddp" or set(args.baselines) - set(BASELINES):
        parser.error(f"--baselines: ddp first, then any of {', '.join(BASELINES)}")
    if args.iterations < args.blocks:
        parser.error("--iterations must be at least --blocks")
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the namespaces are removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Rank 0 hosts the store itself (torch's env:// default).
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rows = []
    for rate in args.rates.split(","):
        with Network(args.world_size, rate) as net:
            for k, model in enumerate(args.models.split(",")):
                result = run_model(net, model, rate, args, port=29500 + k)
                rows.append(summarise(rate, model, args.world_size, args.baselines,
                                      args.schedules, args.iterations, result))
                print(f"{rate:>7s} {model:4s}: " + "  ".join(
                    f"{key[:-3]} {value:.1f} ms" for key, value in result.items()
                    if key.endswith("_ms")), flush=True)
    print_table(rows, args.baselines, args.schedules)
    path = write_results("bandwidth_limited", rows)
    plot(rows, args.baselines, args.schedules, RESULTS / "bandwidth_limited.png")
    print(f"wrote {path} and {RESULTS / 'bandwidth_limited.png'}")


if __name__ == "__main__":
    main()

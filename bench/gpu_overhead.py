"""Engine overhead per iteration on one GPU, ResNet-50, one rank.

    python bench/gpu_overhead.py [--batch 64] [--iterations 30] [--rounds 3] [--out DIR]

Trains torchvision's ResNet-50 (161 parameter tensors, 25.6M parameters) with
SGD on random data and times an iteration (forward, backward, step) for: the
bare model (no data parallelism at all), torch DDP (NCCL), and hemiola's
schedules over NCCL (``SCHEDULE:torch`` steps with torch's optimizer,
``native_optimizer=False``, instead of the engine's updater;
``SCHEDULE:multi`` with the engine's multi-tensor steps,
``HEMIOLA_MULTI_TENSOR_STEPS=1``). With one rank
every all-reduce is a copy, so the difference to the bare model is what the
engine itself costs: hooks, copies into the fusion buffers, the reduction, the
unpack, and stream waits. The target is <= 1% of the iteration. Variants
alternate over several rounds and each is the median round; timing uses CUDA-
synchronised wall clock. Needs a GPU, torchvision and a CUDA build of hemiola;
writes OUT/gpu_overhead.jsonl (default bench/results).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import hemiola
from hemiola.bench.record import DEFAULT_OUT, write_lines

Step = Callable[[], None]


def make_step(variant: str, batch: int) -> tuple[Step, torch.nn.Module]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    run: torch.nn.Module = model
    if variant == "ddp":
        group = dist.new_group(backend="nccl")
        run = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    elif variant != "bare":
        schedule, _, path = variant.partition(":")
        if path == "multi":  # read when the updater is made, inside wrap
            os.environ["HEMIOLA_MULTI_TENSOR_STEPS"] = "1"
        try:
            run, opt = hemiola.wrap(model, opt, schedule=schedule, gpu_backend="nccl",
                                    native_optimizer=False if path == "torch" else None)
        finally:
            os.environ.pop("HEMIOLA_MULTI_TENSOR_STEPS", None)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(run(x), y)
        loss.backward()
        opt.step()

    return step, run


def time_iterations(step: Step, iterations: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iterations * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="bare,ddp,wfbp,priority,decoupled")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    store = tempfile.mktemp(prefix="hemiola-overhead-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    variants = args.variants.split(",")
    steps = {}
    for v in variants:
        steps[v] = make_step(v, args.batch)
        for _ in range(10):  # warm-up: cuDNN autotuning, bucket rebuild, allocator
            steps[v][0]()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            times[v].append(time_iterations(steps[v][0], args.iterations))
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{v} {times[v][-1]:.2f} ms" for v in variants),
            flush=True,
        )
    bare = statistics.median(times["bare"]) if "bare" in times else float("nan")
    rows = []
    print(f"{'variant':10} {'ms/iter':>9} {'vs bare':>9}")
    for v in variants:
        ms = statistics.median(times[v])
        rows.append(
            {
                "variant": v,
                "ms": ms,
                "rounds": times[v],
                "overhead": ms / bare - 1,
                "batch": args.batch,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
            }
        )
        print(f"{v:10} {ms:9.2f} {ms / bare - 1:+9.2%}")
    path = write_lines(args.out / "gpu_overhead.jsonl", rows)
    print("device:", torch.cuda.get_device_name(), "| written", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Ranks started with ``mp.spawn`` (no torchrun) keep torch's default of one
thread per core each: time per iteration of torch DDP with its fp16 hook and
of hemiola ``wfbp`` with fp16 on the wire, on torch's MNIST example network,
2 ranks on loopback, in alternating runs.

    python bench/oversubscribed.py                 # hemiola fits the threads (the default)
    python bench/oversubscribed.py --keep-threads  # OMP_NUM_THREADS=<cores>: as before the fit

Prints one JSON line per run: the median and the median forward, backward and
step of the iterations after the first five.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from hemiola.launch import free_port


class MnistNet(nn.Module):
    """pytorch/examples' mnist/main.py network."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def rank_main(rank: int, world: int, kind: str, iterations: int, port: int,
              results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = MnistNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if kind == "ddp+fp16-hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        run: nn.Module = nn.parallel.DistributedDataParallel(model)
        run.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        import hemiola
        run, opt = hemiola.wrap(model, opt, schedule="wfbp", compression="fp16")
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
    phases = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(run(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    if rank == 0:
        kept = phases[5:]
        results.put({
            "kind": kind, "threads": torch.get_num_threads(),
            "median_ms": round(1e3 * statistics.median(sum(p) for p in kept), 1),
            "forward_backward_step_ms": [round(1e3 * statistics.median(p[i] for p in kept), 1)
                                         for i in range(3)]})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-threads", action="store_true",
                        help="set OMP_NUM_THREADS to the core count, so hemiola keeps them")
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.pop("OMP_NUM_THREADS", None)
    if args.keep_threads:
        os.environ["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    ctx = mp.get_context("spawn")
    for _ in range(args.repeats):
        for kind in ("ddp+fp16-hook", "hemiola wfbp+fp16"):
            results = ctx.Queue()
            mp.spawn(rank_main, args=(2, kind, args.iterations, free_port(), results), nprocs=2)
            print(json.dumps({**results.get(), "omp_num_threads":
                              os.environ.get("OMP_NUM_THREADS")}), flush=True)


if __name__ == "__main__":
    main()

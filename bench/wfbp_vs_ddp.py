"""Iteration time of hemiola's ``wfbp`` against torch DDP, both over Gloo, in
the same run: each rank alternates blocks of DDP and hemiola iterations on the
same model and data, and the medians are compared.

    python bench/wfbp_vs_ddp.py              # 2 ranks, a CNN and a transformer

Writes bench/results/wfbp_vs_ddp.jsonl and prints a table.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from common import median, write_results
from torch import nn

import hemiola
from hemiola.launch import run_local


def make_model(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model and one batch for it (per rank)."""
    torch.manual_seed(0)
    if name == "cnn":  # ~1.2M parameters, 32x32 images
        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU())
        model = nn.Sequential(block(3, 32), block(32, 64), nn.MaxPool2d(2), block(64, 128),
                              nn.MaxPool2d(2), block(128, 256), nn.AdaptiveAvgPool2d(1),
                              nn.Flatten(), nn.Linear(256, 10))
        x = torch.randn(16, 3, 32, 32)
        y = torch.randint(0, 10, (16,))
    elif name == "transformer":  # ~3.5M parameters
        class LM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(8000, 256)
                layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
                self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
                self.out = nn.Linear(256, 8000)

            def forward(self, t: torch.Tensor) -> torch.Tensor:
                return self.out(self.blocks(self.embed(t))).flatten(0, 1)

        model = LM()
        tokens = torch.randint(0, 8000, (8, 65))
        x, y = tokens[:, :-1], tokens[:, 1:].flatten()
    else:
        raise ValueError(name)
    return model, x, y


def _iterations(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def bench_rank(rank: int, world: int, name: str, rounds: int, per_round: int) -> dict[str, Any]:
    hemiola.init()
    variants: dict[str, tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]] = {}
    for variant in ("ddp", "hemiola", "compute"):
        model, x, y = make_model(name)
        if variant == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if variant == "hemiola":
            model, opt = hemiola.wrap(model, opt)
        variants[variant] = (model, opt, x, y)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for model, opt, x, y in variants.values():  # warm-up (and bucket rebuild)
        _iterations(model, opt, x, y, 3)
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for v in order:
            dist.barrier()
            model, opt, x, y = variants[v]
            samples[v] += _iterations(model, opt, x, y, per_round)
    params = sum(p.numel() for p in variants["compute"][0].parameters())
    return {"params": params, **{f"{v}_ms": 1e3 * median(s) for v, s in samples.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,transformer")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        result = run_local(bench_rank, args.world_size, name, args.rounds, args.per_round,
                           timeout_s=1800)[0]
        row = {"bench": "wfbp_vs_ddp", "model": name, "world": args.world_size, **result,
               "ratio": result["hemiola_ms"] / result["ddp_ms"]}
        rows.append(row)
        print(f"{name:12s} {result['params'] / 1e6:5.1f}M params  DDP {result['ddp_ms']:7.1f} ms  "
              f"hemiola wfbp {result['hemiola_ms']:7.1f} ms  ratio {row['ratio']:.3f}  "
              f"(compute alone {result['compute_ms']:.1f} ms)")
    print(f"wrote {write_results('wfbp_vs_ddp', rows)}")


if __name__ == "__main__":
    main()

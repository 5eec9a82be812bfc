"""Python work per parameter per iteration, for each schedule: how many Python
function calls and how many native (C / C++) calls one steady-state training
iteration (forward, backward, optimizer.step) makes, divided by the number of
parameters, and the time per iteration, on one CPU rank.

    python bench/python_overhead.py [--layers 64] [--width 64] [--iterations 20] [--blocks 7]
                                    [--optimizer sgd|rmsprop]

The model is a deep, narrow MLP (2 parameters per layer), so that the work per
parameter, not the arithmetic, sets the time. torch DDP and a bare model (no
wrapper) run in the same invocation for reference. Calls are counted with
``sys.setprofile`` over one iteration (the "call" and "c_call" events of the
thread that trains; the engine's own threads run no Python), minus the same
count for the bare model, so that what remains is the wrapper's own work.

``--optimizer rmsprop`` trains with torch's RMSprop, which the engine does not
step itself: ``priority`` and ``decoupled`` land it through the updater's
external stepper (torch's own step, called once per landing group), as
``/torch-step`` (``native_optimizer=False``) lands SGD.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hemiola


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(layers)))


def _variant(name: str, layers: int, width: int,
             optimizer: str) -> tuple[Callable[[], None], int]:
    """A training iteration of `name` and the model's parameter count."""
    module = _model(layers, width)
    opt: Any = (torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)
                if optimizer == "sgd" else torch.optim.RMSprop(module.parameters(), lr=1e-3))
    model: nn.Module = module
    if name == "ddp":
        model = nn.parallel.DistributedDataParallel(module)
    elif name != "bare":
        schedule, _, rest = name.partition("/")
        model, opt = hemiola.wrap(module, opt, schedule=schedule,
                                  native_optimizer=rest != "torch-step")
    x = torch.randn(32, width)

    def iteration() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return iteration, sum(1 for _ in module.parameters())


def _count(iteration: Callable[[], None]) -> tuple[int, int]:
    counts = {"call": 0, "c_call": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in counts:
            counts[event] += 1

    sys.setprofile(profile)
    try:
        iteration()
    finally:
        sys.setprofile(None)
    return counts["call"], counts["c_call"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=20, help="per block")
    parser.add_argument("--blocks", type=int, default=7,
                        help="blocks of iterations per variant, alternating between "
                             "variants; the median block is reported")
    parser.add_argument("--optimizer", choices=("sgd", "rmsprop"), default="sgd")
    args = parser.parse_args()
    hemiola.init()  # a one-rank process group (DDP needs one too)
    names = ["bare", "ddp", "wfbp", "priority", "priority/torch-step", "decoupled",
             "decoupled/torch-step"]
    runs: dict[str, Callable[[], None]] = {}
    counts: dict[str, tuple[int, int]] = {}
    params = 0
    for name in names:
        iteration, params = _variant(name, args.layers, args.width, args.optimizer)
        for _ in range(3):  # warm-up: first iterations rebuild buckets, learn landing points
            iteration()
        counts[name] = _count(iteration)
        runs[name] = iteration
    # Alternating blocks, so that a slow spell of a shared machine hits every
    # variant alike.
    blocks: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.blocks):
        for name, iteration in runs.items():
            start = time.perf_counter()
            for _ in range(args.iterations):
                iteration()
            blocks[name].append((time.perf_counter() - start) / args.iterations * 1e3)
    bare_py, bare_c = counts["bare"]
    print(f"{params} parameters ({args.layers} layers of {args.width}), {args.optimizer}, "
          "one CPU rank; "
          "calls per parameter per iteration beyond the bare model's; ms per iteration: "
          f"median of {args.blocks} alternating blocks of {args.iterations}")
    print(f"{'variant':<22} {'python calls':>12} {'native calls':>12} {'ms/iteration':>13}")
    for name in names:
        py, c = counts[name]
        print(f"{name:<22} {(py - bare_py) / params:>12.1f} {(c - bare_c) / params:>12.1f} "
              f"{statistics.median(blocks[name]):>13.2f}")


if __name__ == "__main__":
    main()

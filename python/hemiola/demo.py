"""``hemiola demo``: train a small CNN on scikit-learn's digits on local CPU ranks.

Spawns `world_size` processes on this machine (as torchrun would), wraps the
model with :func:`hemiola.wrap`, and reports loss, test accuracy and throughput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import hemiola
from hemiola.launch import run_local


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 digit images (BatchNorm, no conv bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
                                  nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (1,797 8x8 images), scaled to [0, 1], split 80/20."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        raise SystemExit("the demo needs scikit-learn: pip install scikit-learn") from e
    data = sk_load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(y))
    train, test = perm[:split], perm[split:]
    return x[train], y[train], x[test], y[test]


@dataclass(frozen=True)
class DemoResult:
    losses: list[float]
    test_accuracy: float
    seconds: float
    samples: int


def _train(rank: int, world: int, schedule: str, epochs: int, batch_size: int,
           timeline_path: str | None, ps: str | None = None) -> DemoResult | None:
    from tqdm import tqdm

    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = load_digits()
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if ps is not None:  # rank 0 serves; ranks 1.. are workers 0..
        from hemiola import ps as hemiola_ps

        config = hemiola_ps.PSConfig(consistency=ps, num_servers=1)
        role = hemiola_ps.role(1)
        if role.is_server:
            hemiola_ps.serve(config, role)
            return None
        model, optimizer = hemiola_ps.wrap(model, optimizer, config)
        rank, world, schedule = role.worker_index, role.num_workers, f"ps/{ps}"
    else:
        hemiola.init()
        model, optimizer = hemiola.wrap(model, optimizer, schedule=schedule,
                                        timeline=timeline_path is not None)
    loss_fn = nn.CrossEntropyLoss()
    # Each rank trains on its own shard of every epoch's shuffled data.
    steps_per_epoch = len(y_train) // (batch_size * world)
    losses: list[float] = []
    bar = tqdm(total=epochs * steps_per_epoch, desc=f"{schedule} x{world} ranks",
               disable=rank != 0, unit="step")
    start = time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        mine = order[rank::world]
        for step in range(steps_per_epoch):
            idx = mine[step * batch_size:(step + 1) * batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}")
            bar.update()
    seconds = time.perf_counter() - start
    bar.close()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if ps is not None:
        model.close()
    elif timeline_path is not None and rank == 0:
        with open(timeline_path, "w") as f:
            f.write(model.timeline())
    return DemoResult(losses, accuracy, seconds, epochs * steps_per_epoch * batch_size * world)


def run(world_size: int = 2, schedule: str = "wfbp", epochs: int = 5, batch_size: int = 32,
        timeline_path: str | None = None, ps: str | None = None) -> dict[int, DemoResult]:
    """Trains on `world_size` local ranks (with `ps`, on `world_size` workers and
    one parameter server); returns each trainer's result, by rank."""
    world = world_size + (1 if ps is not None else 0)
    results = run_local(_train, world, schedule, epochs, batch_size, timeline_path, ps,
                        timeout_s=1800)
    return {r: v for r, v in results.items() if v is not None}


def main(args: Any) -> int:
    if args.ps is not None and args.timeline:
        raise SystemExit("--timeline records the all-reduce engine; it does not apply to --ps")
    results = run(args.world_size, args.schedule, args.epochs, args.batch_size, args.timeline,
                  args.ps)
    r0 = results[min(results)]
    n = len(r0.losses)
    first = sum(r0.losses[: max(1, n // 10)]) / max(1, n // 10)
    last = sum(r0.losses[-max(1, n // 10):]) / max(1, n // 10)
    if args.ps is None:
        print(f"schedule {args.schedule}, {args.world_size} ranks, {n} steps of "
              f"{args.batch_size} samples per rank")
    else:
        print(f"parameter server ({args.ps}), 1 server + {args.world_size} workers, {n} steps "
              f"of {args.batch_size} samples per worker")
    print(f"loss: {first:.3f} (first 10% of steps) -> {last:.3f} (last 10%)")
    # Through a parameter server, buffers (BatchNorm statistics) stay each worker's own.
    which = "rank 0; identical on every rank" if args.ps is None else "worker 0"
    print(f"test accuracy: {100 * r0.test_accuracy:.1f}% ({which})")
    print(f"throughput: {r0.samples / r0.seconds:.0f} samples/s, "
          f"{1000 * r0.seconds / n:.1f} ms per iteration")
    if args.timeline:
        print(f"timeline (open in chrome://tracing or ui.perfetto.dev): {args.timeline}")
    return 0


def register(commands: Any) -> None:
    """Adds ``hemiola demo`` to the CLI."""
    p = commands.add_parser("demo", help="train a small CNN on local CPU ranks (no arguments "
                                         "needed)")
    p.add_argument("--world-size", type=int, default=2, help="number of local ranks (default 2)")
    p.add_argument("--schedule", default="wfbp", help="communication schedule (default wfbp)")
    p.add_argument("--epochs", type=int, default=5, help="epochs (default 5)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--timeline", metavar="PATH", help="write rank 0's engine timeline here")
    p.add_argument("--ps", metavar="CONSISTENCY", choices=("bsp", "asp", "ssp", "eager"),
                   help="train through one parameter server instead of all-reduce, with "
                        "this consistency model (bsp, asp, ssp, eager)")
    p.set_defaults(run=main)

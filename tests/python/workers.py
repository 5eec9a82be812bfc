"""Functions that run inside each rank process (see launch.run_ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from models import loss_of, make_batch, make_model, make_optimizer
from torch import nn

import hemiola


def _train(model: nn.Module, opt: torch.optim.Optimizer, name: str, rank: int, world: int,
           steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = make_batch(name, step, rank, world)
        opt.zero_grad()
        loss = loss_of(name, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def hemiola_vs_ddp(rank: int, world: int, model_name: str, opt_name: str, fusion_mb: float,
                   steps: int = 5) -> dict[str, Any]:
    """Trains the same model with torch DDP and with hemiola wfbp; returns the
    largest parameter difference and both loss curves."""
    hemiola.init()
    torch.manual_seed(0)
    ref = make_model(model_name)
    ddp = nn.parallel.DistributedDataParallel(ref)
    ddp_losses = _train(ddp, make_optimizer(opt_name, ddp.parameters()), model_name, rank, world,
                        steps)

    torch.manual_seed(0)
    mine = make_model(model_name)
    opt = make_optimizer(opt_name, mine.parameters())
    model, opt = hemiola.wrap(mine, opt, fusion_mb=fusion_mb, first_bucket_mb=min(fusion_mb, 1.0),
                              timeout_s=60)
    hemi_losses = _train(model, opt, model_name, rank, world, steps)

    diffs = {
        n: (a - b).abs().max().item()
        for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items())
        if a.is_floating_point()
    }
    worst = max(diffs, key=lambda n: diffs[n])
    return {"max_diff": diffs[worst], "worst": worst, "ddp": ddp_losses, "hemiola": hemi_losses,
            "buckets": len(model.buckets()), "keys_equal": list(ref.state_dict()) ==
            list(model.state_dict())}


def params_after(rank: int, world: int, model_name: str, steps: int) -> list[torch.Tensor]:
    hemiola.init()
    torch.manual_seed(rank)  # different initial weights: wrap must broadcast rank 0's
    m = make_model(model_name)
    model, opt = hemiola.wrap(m, make_optimizer("sgd", m.parameters()), timeout_s=60)
    _train(model, opt, model_name, rank, world, steps)
    dist.barrier()
    return [p.detach().clone() for p in model.parameters()]

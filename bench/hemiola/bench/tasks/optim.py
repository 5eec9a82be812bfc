"""What the tasks' optimizers share: weight-decay parameter groups and the
learning-rate schedule (linear warmup, then cosine decay)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups with weight decay on matrices, embeddings and convolution
    kernels, none on biases and norms."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float,
                  min_lr_fraction: float) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over `warmup_fraction` of the steps, then cosine decay to
    `min_lr_fraction` of the learning rate at `total_steps`."""
    warmup = max(1, int(warmup_fraction * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return min_lr_fraction + (1 - min_lr_fraction) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

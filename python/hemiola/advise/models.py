"""What ``hemiola advise`` measures: the user's model (``--model
MODULE:FUNCTION``) or the built-in MLP."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LossFn = Callable[[nn.Module], torch.Tensor]
#: what a --model factory returns: (model, loss_fn) or (model, loss_fn, make_optimizer)
Factory = Callable[[], tuple[Any, ...]]


@dataclass
class Workload:
    """A model, one training batch's loss, and the optimizer to train it with."""

    model: nn.Module
    loss_fn: LossFn
    make_optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """SGD with momentum: what the advice checks when the factory names none."""
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def slow_link_mlp(width: int = 1536) -> nn.Sequential:
    """Four width x width layers and a 10-way classifier (9.4M parameters at
    1536): the model of issue 26's slow-link setting and of
    hemiola.bench.speed, seeded the same on every rank."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def builtin_mlp(width: int = 1536, batch: int = 384) -> tuple[nn.Module, LossFn]:
    """slow_link_mlp with one random batch per rank."""
    model = slow_link_mlp(width)
    x = torch.randn(batch, width)
    y = torch.randint(0, 10, (batch,))
    return model, lambda m: nn.functional.cross_entropy(m(x), y)


def load_factory(spec: str | None) -> Factory:
    """``MODULE:FUNCTION`` imported, or the built-in MLP for None."""
    if spec is None:
        return builtin_mlp
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--model must be MODULE:FUNCTION (e.g. mypkg.models:make), got {spec!r}")
    factory = getattr(importlib.import_module(module), name, None)
    if not callable(factory):
        raise ValueError(f"{spec}: {module} has no function {name!r}")
    return factory  # type: ignore[no-any-return]


def make_workload(factory: Factory) -> Workload:
    """Calls `factory`, checking what it returned."""
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError("a --model function returns (model, loss_fn) or (model, loss_fn, "
                         f"make_optimizer), not {type(made).__name__}")
    model, loss_fn, *rest = made
    if not isinstance(model, nn.Module) or not callable(loss_fn):
        raise ValueError("a --model function returns (model, loss_fn): an nn.Module and a "
                         "function of the model returning one batch's loss")
    make_optimizer = rest[0] if rest else default_optimizer
    if not callable(make_optimizer):
        raise ValueError("the third value a --model function returns is make_optimizer: a "
                         "function of the parameters returning a torch.optim.Optimizer")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise ValueError(f"hemiola advise measures CPU models for now (this one is on "
                         f"{', '.join(sorted(devices)) or 'no parameters'}): its compressions "
                         "run on host buckets only; a profile written for a GPU predicts with "
                         "--profile")
    return Workload(model, loss_fn, make_optimizer)

"""Predictions at 8-1024 GPUs for ResNet-50 and a GPT-2-124M-class model
(docs/scale.md), from profiles built by counting FLOPs, not by timing.

No GPU is at hand here, so each model's profile is written from two inputs:
its own FLOPs, counted per operation on the meta device
(``torch.utils.flop_counter``), which place every module's first read in the
forward and every gradient's arrival in the backward on a FLOP clock; and one
measured or stated time per iteration that turns FLOPs into seconds:

- ResNet-50 (torchvision's architecture, 25.6M parameters), batch 64 of
  224x224 images per GPU, float32: 58.6 ms per iteration, the bare model as
  measured on an H200 shared by two ranks (MPS 50%; docs/gpu.md);
- GPT-2-124M (12 layers, 768 wide, tied embeddings), 8 sequences of 1024
  tokens per GPU: its FLOPs at 400 TFLOP/s (an H100 at 40% of its dense bf16
  peak: a stated assumption, not a measurement).

The optimizer step is memory-bound: 16 bytes per parameter at 3 TB/s. On a GPU
the engine's CPU work does not slow the computation (contention 0), fp16
coding is a kernel (no CPU cost counted), and only the codings that run on a
GPU (none, fp16) are predicted; measured overheads are none (so these are
lower bounds by the overheads docs/scale.md's validation found).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from hemiola.advise.profile import Param, Profile
from hemiola.bench.tasks.models import Block

#: GPT-2's stated FLOP rate (an H100 at 40% of its dense bf16 peak)
GPT_FLOPS = 400e12
STEP_BYTES_PER_PARAM = 16
HBM = 3e12


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.down = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False),
                                   nn.BatchNorm2d(out)) if stride != 1 or cin != out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


def resnet50(classes: int = 1000) -> nn.Sequential:
    """torchvision's ResNet-50 (25,557,032 parameters)."""
    return resnet((3, 4, 6, 3), classes)


def resnet(depths: tuple[int, int, int, int], classes: int = 1000) -> nn.Sequential:
    """torchvision's bottleneck ResNet with `depths` blocks per stage
    ((3, 4, 6, 3): ResNet-50; (3, 4, 23, 3): ResNet-101)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in zip((64, 128, 256, 512), depths, (1, 2, 2, 2), strict=True):
        for b in range(blocks):
            layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class GPT2(nn.Module):
    """GPT-2 small: 124M parameters with the output layer tied to the embedding."""

    def __init__(self, vocab: int = 50257, dim: int = 768, layers: int = 12, heads: int = 12,
                 context: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position(torch.arange(tokens.shape[1],
                                                            device=tokens.device))
        return F.linear(self.norm(self.blocks(h)), self.embed.weight)


def flop_profile(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor],
                 seconds: float | None, flops_per_second: float = GPT_FLOPS,
                 memory_bandwidth: float = HBM) -> Profile:
    """A GPU profile of `model` (built on the meta device) from its FLOPs:
    the forward, backward and every parameter's need and ready points on a
    FLOP clock, scaled so that forward and backward take `seconds` (None:
    the FLOPs at `flops_per_second`); the optimizer step reads and writes
    STEP_BYTES_PER_PARAM per parameter at `memory_bandwidth` bytes/s."""
    params = [p for p in model.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    need: dict[int, float] = {}
    ready: dict[int, float] = {}
    with FlopCounterMode(display=False) as counter:
        def read(own: list[int]) -> None:
            for i in own:
                need.setdefault(i, counter.get_total_flops())

        handles: list[Any] = []
        for m in model.modules():
            own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
            if own:
                handles.append(m.register_forward_pre_hook(lambda *_, own=own: read(own)))
        def produced(i: int) -> None:
            ready.setdefault(i, counter.get_total_flops())

        for i, p in enumerate(params):
            handles.append(p.register_post_accumulate_grad_hook(lambda _, i=i: produced(i)))
        loss = loss_fn(model)
        forward_flops = counter.get_total_flops()
        loss.backward()
        total = counter.get_total_flops()
    for h in handles:
        h.remove()
    per_flop = (seconds if seconds is not None else total / flops_per_second) / total
    backward_flops = total - forward_flops
    numel = sum(p.numel() for p in params)
    return Profile(
        forward=forward_flops * per_flop, backward=backward_flops * per_flop,
        step=STEP_BYTES_PER_PARAM * numel / memory_bandwidth,
        params=[Param(p.numel(), 4, p.shape[0] if p.dim() > 1 else 0,
                      need.get(i, 0.0) * per_flop,
                      (ready.get(i, total) - forward_flops) * per_flop)
                for i, p in enumerate(params)],
        meta={"device": "cuda", "flops": total, "source": "FLOP clock"})


def resnet50_profile() -> Profile:
    with torch.device("meta"):
        model = resnet50()
        x = torch.randn(64, 3, 224, 224)
        y = torch.randint(0, 1000, (64,))
    profile = flop_profile(model, lambda m: F.cross_entropy(m(x), y), 0.0586)
    profile.meta["model"] = "ResNet-50, batch 64, 58.6 ms on half an H200 (measured)"
    return profile


def gpt2_profile() -> Profile:
    with torch.device("meta"):
        model = GPT2()
        tokens = torch.randint(0, 50257, (8, 1025))
    x, y = tokens[:, :-1], tokens[:, 1:]
    profile = flop_profile(model, lambda m: F.cross_entropy(m(x).flatten(0, 1), y.flatten()),
                           None)
    profile.meta["model"] = "GPT-2-124M, 8 x 1024 tokens, FLOPs at 400 TFLOP/s (assumed)"
    return profile


WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
RATES_GBIT = (10, 25, 100)
GPUS_PER_NODE = 8
#: columns of the table: configurations by name
COLUMNS = ("wfbp+none", "priority+none", "decoupled+none", "wfbp+fp16", "decoupled+fp16")


def table(profile: Profile, error: float) -> str:
    """Compute utilisation (the bare step over the predicted step) of each
    configuration, per world size and rate, with the streaming advice where
    it fires; a markdown table."""
    from hemiola.advise import choice, model
    from hemiola.advise.collective import Network

    head = ["Gbit/s", "GPUs", *[f"`{c}`" for c in COLUMNS],
            "advice: predicted step, utilisation (range)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for rate in RATES_GBIT:
        for world in WORLDS:
            net = Network(world, rate * 1e9 / 8, latency=25e-6, gpus_per_node=GPUS_PER_NODE,
                          intra_bandwidth=1200e9 / 8, algorithm="best")
            preds = model.predict(profile, net)
            by = {p.name: p.seconds for p in preds}
            best = choice.choose_predicted(preds)
            advice = choice.streaming_advice(profile.compute, best.seconds,
                                             model.predict_streaming(profile, net))
            chosen = advice if advice is not None else best
            u = choice.utilisation(profile.compute, chosen.seconds)
            cells = [f"{choice.utilisation(profile.compute, by[c]):.2f}" for c in COLUMNS]
            low, high = u / (1 + error), min(1.0, u / (1 - error))
            lines.append(f"| {rate} | {world} | " + " | ".join(cells)
                         + f" | `{chosen.name}` {1e3 * chosen.seconds:.1f} ms: {u:.2f} "
                         f"({low:.2f}–{high:.2f}) |")
    return "\n".join(lines)

"""``hemiola advise``'s model against published scaling results that no one
here measured (docs/scale.md, "Against published results"):

    hemiola bench advise --published

Each configuration takes the publication's hardware as inputs: the time of
one iteration on one GPU (images per second at the stated batch), the
network rate per server, the GPUs per server; the model's FLOPs place every
gradient on a FLOP clock (:func:`hemiola.bench.advise_scale.flop_profile`).
The prediction is ``wfbp`` with no compression (the reduction overlapped
with backward, as Horovod's), over a ring all-reduce (what NCCL 2, Horovod's
collective then, ran), 25 us per message (the project's stated assumption,
as in docs/scale.md's tables; not from the publication), and the scaling
efficiency is the single GPU's time over the predicted time at N GPUs
(throughput at N over N times one GPU's). Nothing is fitted to the reported
results: the inputs are the publication's, the model's constants are its
own.

Sources (the address of the copy read; see docs/scale.md):

- HOROVOD_512: Horovod's docs/benchmarks.rst, "512-GPU Benchmark": "128
  servers with 4 Pascal GPUs each connected by a RoCE-capable 25 Gbit/s
  network. Horovod achieves 90% scaling efficiency for both Inception V3 and
  ResNet-101, and 68% scaling efficiency for VGG-16"; run with
  tf_cnn_benchmarks, ``--batch_size 64``.
- HOROVOD_128: Horovod's README as first published (2017; the copy kept in
  github.com/alsrgv/horovod, its author's): "32 servers with 4 Pascal GPUs
  each connected by RoCE-capable 25 Gbit/s network: Horovod achieves 90%
  scaling efficiency for both Inception V3 and ResNet-101, and 79% scaling
  efficiency for VGG-16".
- TF_P100: neither Horovod page states one GPU's speed. The TensorFlow
  benchmarks page (tensorflow/docs, site/en/r1/guide/performance/
  benchmarks.md, "Details for NVIDIA DGX-1 (NVIDIA Tesla P100)", training on
  synthetic data, 1 GPU, batch 64, May 2017) gives, with the same
  tf_cnn_benchmarks: Inception V3 142, VGG16 154, ResNet-152 91.8 images/s.
  A secondary source for Horovod's machines (their "Pascal GPUs" are not
  named further). ResNet-101 is not in that table: its time is ResNet-152's
  scaled by the two models' FLOPs (computed here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from hemiola.advise import model
from hemiola.advise.collective import Network
from hemiola.advise.profile import Profile
from hemiola.bench.advise_scale import flop_profile, resnet
from hemiola.bench.published_models import inception_v3, vgg16

HOROVOD_512 = "Horovod docs/benchmarks.rst (512 GPUs)"
HOROVOD_128 = "Horovod README, 2017 (128 GPUs)"
TF_P100 = "TensorFlow benchmarks, DGX-1 P100, 1 GPU"

#: images per second of one P100 at batch 64 (TF_P100)
P100_IMAGES_PER_SECOND = {"Inception V3": 142.0, "VGG-16": 154.0, "ResNet-152": 91.8}
BATCH = 64
#: the project's assumption of one message's cost (docs/scale.md)
LATENCY = 25e-6

ARCHITECTURES: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "Inception V3": (inception_v3, 299),
    "VGG-16": (vgg16, 224),
    "ResNet-101": (lambda: resnet((3, 4, 23, 3)), 224),
    "ResNet-152": (lambda: resnet((3, 8, 36, 3)), 224),
}


@dataclass(frozen=True)
class Published:
    """One published data-parallel configuration and its reported result."""

    model: str
    gpus: int
    gpus_per_node: int
    #: Gbit/s of each server's link
    rate_gbit: float
    #: throughput at `gpus` over `gpus` times one GPU's, as reported
    efficiency: float
    source: str


CONFIGURATIONS = (
    Published("Inception V3", 128, 4, 25, 0.90, HOROVOD_128),
    Published("ResNet-101", 128, 4, 25, 0.90, HOROVOD_128),
    Published("VGG-16", 128, 4, 25, 0.79, HOROVOD_128),
    Published("Inception V3", 512, 4, 25, 0.90, HOROVOD_512),
    Published("ResNet-101", 512, 4, 25, 0.90, HOROVOD_512),
    Published("VGG-16", 512, 4, 25, 0.68, HOROVOD_512),
)


def _flops(name: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    make, size = ARCHITECTURES[name]
    with torch.device("meta"):
        net = make()
        x = torch.randn(BATCH, 3, size, size)
        y = torch.randint(0, 1000, (BATCH,))
    return net, lambda m: F.cross_entropy(m(x), y)


def single_gpu_seconds(name: str) -> float:
    """One iteration on one P100 (TF_P100); ResNet-101 from ResNet-152's by
    their FLOPs."""
    if name in P100_IMAGES_PER_SECOND:
        return BATCH / P100_IMAGES_PER_SECOND[name]
    reference = "ResNet-152"
    ratio = profile_of(name, 1.0).meta["flops"] / profile_of(reference, 1.0).meta["flops"]
    return ratio * BATCH / P100_IMAGES_PER_SECOND[reference]


def profile_of(name: str, seconds: float) -> Profile:
    """`name` at batch BATCH on the FLOP clock, one iteration in `seconds`
    (the optimizer step inside it: the measured time includes it)."""
    net, loss = _flops(name)
    profile = flop_profile(net, loss, seconds, memory_bandwidth=math.inf)
    profile.meta["model"] = name
    return profile


def predicted_efficiency(config: Published, profile: Profile, algorithm: str = "ring") -> float:
    """The single GPU's time over the predicted ``wfbp`` step at
    `config.gpus`."""
    net = Network(config.gpus, config.rate_gbit * 1e9 / 8, latency=LATENCY,
                  gpus_per_node=config.gpus_per_node, algorithm=algorithm)
    return profile.compute / model.predict_one(profile, net, "wfbp", "none")


def table() -> str:
    """Every configuration of CONFIGURATIONS, predicted against reported; a
    markdown table."""
    head = ["model", "GPUs (per server)", "Gbit/s", "1 GPU, ms (batch 64)", "gradients, MB",
            "reported efficiency", "predicted (ring)", "error", "predicted (best algorithm)",
            "source"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    profiles: dict[str, Profile] = {}
    errors = []
    for c in CONFIGURATIONS:
        if c.model not in profiles:
            profiles[c.model] = profile_of(c.model, single_gpu_seconds(c.model))
        p = profiles[c.model]
        ring = predicted_efficiency(c, p)
        best = predicted_efficiency(c, p, "best")
        errors.append(ring / c.efficiency - 1)
        lines.append(f"| {c.model} | {c.gpus} ({c.gpus_per_node}) | {c.rate_gbit:g} | "
                     f"{1e3 * p.compute:.0f} | {p.nbytes / 1e6:.0f} | {c.efficiency:.2f} | "
                     f"{ring:.2f} | {100 * (ring / c.efficiency - 1):+.1f}% | {best:.2f} | "
                     f"{c.source} |")
    worst = max(errors, key=abs)
    lines.append(f"\nWithin 20% of the reported efficiency: {sum(abs(e) <= 0.2 for e in errors)} "
                 f"of {len(errors)}; within 10%: {sum(abs(e) <= 0.1 for e in errors)}; "
                 f"largest error {100 * worst:+.0f}%.")
    return "\n".join(lines)

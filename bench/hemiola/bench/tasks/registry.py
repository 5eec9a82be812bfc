"""The convergence tasks by name (``TASKS``), each with fixed hyper-parameters
that are the same for every contender, and each one's headline metric
(``HEADLINE``) and reported metrics (``metrics_of``).

- ``digits``: scikit-learn's digits (1,797 8x8 images, fixed 80/20 split), a
  CNN with BatchNorm (``hemiola.demo.DigitsCNN``), SGD with momentum and weight
  decay. Metrics: test accuracy, final train loss.
- ``lm``: a byte-level decoder-only transformer language model (tied
  embeddings, no dropout), AdamW with linear warmup and cosine decay, trained
  on ``load_corpus()``. Metrics: held-out loss (nats per byte) and perplexity,
  final train loss.
- ``char``: nanoGPT's ``shakespeare_char`` recipe scaled to a CPU (a GPT with
  tied embeddings, AdamW with betas 0.9/0.99, warmup + cosine to a tenth) on
  ``load_source()``, one token per character. Metrics as ``lm`` (nats per
  character).
- ``shapes`` and ``shapes-adamw``: a small ResNet (BasicBlocks, BatchNorm) on
  ``load_shapes()`` (fixed 6,000/1,500 split), with SGD with momentum, resp.
  AdamW, both with warmup and cosine decay. Metrics: test accuracy, test loss,
  final train loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from hemiola.bench.tasks.data import (
    SHAPES,
    corpus_info,
    load_corpus,
    load_packages,
    load_shapes,
    load_source,
    packages_info,
    shapes_info,
    source_info,
)
from hemiola.bench.tasks.models import ByteLM, CharGPT, SmallResNet
from hemiola.bench.tasks.optim import decay_groups, warmup_cosine
from hemiola.demo import DigitsCNN, load_digits


class Task:
    """What the training loop needs from a task. Subclasses are dataclasses
    whose fields are the hyper-parameters."""

    name: str
    epochs: int
    batch_size: int  # per rank

    def model(self) -> nn.Module:
        """A fresh model (the caller seeds torch first)."""
        raise NotImplementedError

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer of `model`'s parameters."""
        raise NotImplementedError

    def lr_scheduler(self, optimizer: torch.optim.Optimizer,
                     total_steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The learning-rate schedule, built on the optimizer ``hemiola.wrap`` returned."""
        return None

    def epoch_samples(self, seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All training inputs and targets of one epoch, before shuffling."""
        raise NotImplementedError

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of `model` on the batch (x, y)."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics; called in eval mode under ``torch.no_grad()``."""
        raise NotImplementedError

    def steps_per_epoch(self, world: int) -> int:
        """Optimizer steps in one epoch on `world` ranks (the last partial batch is dropped)."""
        x, _ = self.epoch_samples(0, 0)
        return len(x) // (self.batch_size * world)


class ImageClassification(Task):
    """A task on a fixed split ``self.data`` = (x_train, y_train, x_test,
    y_test): every epoch is the whole training set, cross-entropy loss, test
    accuracy and loss held out."""

    data: tuple[torch.Tensor, ...]

    def epoch_samples(self, seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[0], self.data[1]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        x_test, y_test = self.data[2], self.data[3]
        logits = model(x_test)
        return {"test_accuracy": (logits.argmax(1) == y_test).float().mean().item(),
                "test_loss": F.cross_entropy(logits, y_test).item()}


#: The digits MLPs by name: their layer widths, input first.
DIGITS_MLPS = {"mlp": (64, 96, 48, 10), "wide-mlp": (64, 512, 512, 10)}
DIGITS_ARCHITECTURES = ("cnn", *DIGITS_MLPS)


@dataclass
class DigitsTask(ImageClassification):
    """``hemiola.demo.DigitsCNN`` on scikit-learn's digits, SGD with momentum.

    The 80/20 split is fixed (``load_digits(seed=0)``) whatever the run's seed.
    ``architecture="mlp"`` trains a 64-96-48-10 MLP instead of the CNN (no
    BatchNorm, so no buffer of a worker's own); ``"wide-mlp"`` a 64-512-512-10
    one (300k parameters, 1.2 MB of float32: enough that a 1 Gbit/s link, not
    the computation, sets the pace).
    """

    name: str = "digits"
    epochs: int = 5
    batch_size: int = 16
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    architecture: str = "cnn"
    data: tuple[torch.Tensor, ...] = field(default_factory=lambda: load_digits(seed=0),
                                           repr=False)

    def model(self) -> nn.Module:
        widths = DIGITS_MLPS.get(self.architecture)
        if widths is not None:
            layers: list[nn.Module] = [nn.Flatten()]
            for fan_in, fan_out in zip(widths, widths[1:]):
                layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
            return nn.Sequential(*layers[:-1])  # no ReLU after the logits
        if self.architecture != "cnn":
            raise ValueError(f"digits: architecture must be one of {DIGITS_ARCHITECTURES}, "
                             f"got {self.architecture!r}")
        return DigitsCNN()

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)


@dataclass
class LMTask(Task):
    """A byte-level transformer LM on ``load_corpus()``, AdamW, warmup + cosine.

    The last `heldout_fraction` of the corpus is held out. Each epoch cuts the
    training bytes into windows of ``context + 1`` bytes (overlapping by one,
    so every byte is predicted once) from an offset drawn from (seed, epoch).
    Weight decay applies to matrices and embeddings, not to biases or norms.
    """

    name: str = "lm"
    epochs: int = 2
    batch_size: int = 8
    dim: int = 128
    layers: int = 3
    heads: int = 4
    context: int = 64
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1
    heldout_fraction: float = 0.1
    tokens: torch.Tensor = field(
        default_factory=lambda: torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8)
        .long(), repr=False)

    @property
    def split(self) -> int:
        return int(len(self.tokens) * (1 - self.heldout_fraction))

    def model(self) -> nn.Module:
        return ByteLM(self.dim, self.layers, self.heads, self.context)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(decay_groups(model, self.weight_decay), lr=self.lr,
                                 betas=self.betas)

    def lr_scheduler(self, optimizer: torch.optim.Optimizer,
                     total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
        return warmup_cosine(optimizer, total_steps, self.warmup_fraction, self.min_lr_fraction)

    def windows(self, data: torch.Tensor, offset: int) -> torch.Tensor:
        """Windows of ``context + 1`` bytes starting at offset, offset + context, ..."""
        return data[offset:].unfold(0, self.context + 1, self.context)

    def epoch_samples(self, seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * seed + epoch + 1)
        offset = int(torch.randint(self.context, (1,), generator=g))
        w = self.windows(self.tokens[: self.split], offset)
        return w[:, :-1], w[:, 1:]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        w = self.windows(self.tokens[self.split:], 0)
        total, count = 0.0, 0
        for chunk in w.split(256):
            logits = model(chunk[:, :-1])
            total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(),
                                     reduction="sum").item()
            count += chunk[:, 1:].numel()
        loss = total / count
        return {"heldout_loss": loss, "heldout_perplexity": math.exp(loss),
                "heldout_bits_per_byte": loss / math.log(2)}


def encode_source() -> tuple[torch.Tensor, str]:
    """``load_source()`` as one token per character (ids in the sorted order
    of the characters present), and those characters."""
    text = load_source()
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), chars


@dataclass
class CharTask(LMTask):
    """nanoGPT's character-level recipe (``config/train_shakespeare_char.py``)
    on ``load_source()``: the GPT smaller (4 layers of 128, 4 heads, context 64
    rather than 6 x 384, 6 heads, 256; batch 12 rather than 64, to train on a
    CPU), AdamW lr 1e-3 with betas (0.9, 0.99), weight decay 0.1 on matrices and
    embeddings, warmup then cosine to a tenth (nanoGPT: 1e-3 to 1e-4), no
    dropout and no gradient clipping (every contender alike). Windows, split
    and evaluation as ``LMTask``'s, over characters."""

    name: str = "char"
    epochs: int = 1
    batch_size: int = 12
    dim: int = 128
    layers: int = 4
    heads: int = 4
    context: int = 64
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1
    heldout_fraction: float = 0.1
    tokens: torch.Tensor = field(default_factory=lambda: encode_source()[0], repr=False)

    @property
    def vocabulary(self) -> int:
        """How many distinct characters the corpus has (ids 0..vocabulary-1)."""
        return int(self.tokens.max()) + 1

    def model(self) -> nn.Module:
        return CharGPT(self.vocabulary, self.dim, self.layers, self.heads, self.context)


@dataclass
class CodeTask(LMTask):
    """A 10.8M-parameter byte-level LM (``LMTask``'s transformer, 6 layers of
    384, 6 heads, context 64) on ``load_packages()``: the standard library's
    packages, a corpus no option of hemiola was tuned on. Batch 4 windows
    (256 bytes) per rank and step, so that 3000 steps at 8 replicas fit a
    CPU; AdamW lr 1e-3, betas (0.9, 0.95), weight decay 0.1, warmup then
    cosine to a tenth (nanoGPT's recipe, its lr at this width). Windows, split
    and evaluation as ``LMTask``'s."""

    name: str = "code"
    epochs: int = 1
    batch_size: int = 4
    dim: int = 384
    layers: int = 6
    heads: int = 6
    context: int = 64
    lr: float = 1e-3
    tokens: torch.Tensor = field(
        default_factory=lambda: torch.frombuffer(bytearray(load_packages()), dtype=torch.uint8)
        .long(), repr=False)


@dataclass
class ShapesBase(ImageClassification):
    """``SmallResNet`` on ``load_shapes()`` with warmup + cosine decay; the
    subclasses choose the optimizer.

    The 6,000/1,500 split is fixed (``load_shapes(seed=0)``) whatever the run's
    seed.
    """

    name: str = "shapes"
    epochs: int = 10
    batch_size: int = 32
    widths: tuple[int, ...] = (16, 32, 64)
    blocks: int = 1  # per stage
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.0
    data: tuple[torch.Tensor, ...] = field(default_factory=lambda: load_shapes(seed=0),
                                           repr=False)

    def model(self) -> nn.Module:
        return SmallResNet(self.widths, self.blocks, len(SHAPES))

    def lr_scheduler(self, optimizer: torch.optim.Optimizer,
                     total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
        return warmup_cosine(optimizer, total_steps, self.warmup_fraction, self.min_lr_fraction)


@dataclass
class ShapesTask(ShapesBase):
    """``ShapesBase`` with SGD with momentum; weight decay on every parameter."""

    name: str = "shapes"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)


@dataclass
class ShapesAdamWTask(ShapesBase):
    """``ShapesBase`` with AdamW; decoupled weight decay on convolution kernels
    and the classifier's matrix, none on biases and BatchNorm."""

    name: str = "shapes-adamw"
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.05

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(decay_groups(model, self.weight_decay), lr=self.lr,
                                 betas=self.betas)


TASKS: dict[str, type[Task]] = {"digits": DigitsTask, "lm": LMTask, "char": CharTask,
                                "code": CodeTask, "shapes": ShapesTask,
                                "shapes-adamw": ShapesAdamWTask}


@dataclass(frozen=True)
class Headline:
    """A task's main held-out metric, and the value that counts as converged."""

    metric: str
    higher_is_better: bool
    target: float


HEADLINE: dict[str, Headline] = {"digits": Headline("test_accuracy", True, 0.97),
                                 "lm": Headline("heldout_loss", False, 2.1),
                                 "char": Headline("heldout_loss", False, 2.0),
                                 # (DDP at 2 replicas: 1.466 after 3000 steps, seed 10)
                                 "code": Headline("heldout_loss", False, 1.5),
                                 "shapes": Headline("test_accuracy", True, 0.85),
                                 "shapes-adamw": Headline("test_accuracy", True, 0.85)}


def metrics_of(task: str) -> list[str]:
    """The final metrics reported for `task`, headline first."""
    image = ["test_accuracy", "test_loss", "final_train_loss"]
    return {"digits": image, "shapes": image, "shapes-adamw": image,
            "lm": ["heldout_loss", "heldout_perplexity", "final_train_loss"],
            "char": ["heldout_loss", "heldout_perplexity", "final_train_loss"],
            "code": ["heldout_loss", "heldout_perplexity", "final_train_loss"]}[task]


#: where a task's data came from, for the results file
DATA_INFO: dict[str, Callable[[], dict[str, Any]]] = {
    "lm": corpus_info, "char": source_info, "code": packages_info, "shapes": shapes_info,
    "shapes-adamw": shapes_info}

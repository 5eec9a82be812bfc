"""The tasks of the convergence benchmark (:mod:`hemiola.bench.convergence`), and the
function each rank runs.

Small tasks, each with fixed hyper-parameters that are the same for every
schedule:

- ``digits``: scikit-learn's digits (1,797 8x8 images, fixed 80/20 split), a
  CNN with BatchNorm (``hemiola.demo.DigitsCNN``), SGD with momentum and weight
  decay. Metrics: test accuracy, final train loss.
- ``lm``: a byte-level decoder-only transformer language model (tied
  embeddings, no dropout), AdamW with linear warmup and cosine decay, trained
  on the text of Python's own language reference as shipped in the standard
  library (``pydoc_data.topics``: ~466 KB, no download). Metrics: held-out loss
  (nats per byte) and perplexity, final train loss.
- ``shapes`` and ``shapes-adamw``: a small ResNet (BasicBlocks, BatchNorm) on
  a structured synthetic image task (``load_shapes``: 10 kinds of shape in
  random colours, positions and sizes, a low-contrast distractor, pixel noise;
  fixed 6,000/1,500 split), with SGD with momentum, resp. AdamW, both with
  warmup and cosine decay. Metrics: test accuracy, test loss, final train loss.

A rank trains on its own shard of each epoch's shuffled samples: every epoch
is a permutation seeded by (seed, epoch), identical on every rank, of which
rank r takes elements r, r + world, ... The per-rank batch size is fixed, so
the global batch is ``world * batch_size``.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import hemiola
from hemiola.demo import DigitsCNN, load_digits

# ---- the text corpus --------------------------------------------------------


def load_corpus() -> bytes:
    """The text of Python's language reference (``pydoc_data.topics``) as UTF-8.

    The topics are joined in sorted order, so the bytes are the same on every
    call for a given Python version (``corpus_info`` records which).
    """
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


def corpus_info() -> dict[str, Any]:
    """Where the corpus came from and its fingerprint, for the results file."""
    import sys

    data = load_corpus()
    return {"corpus": "pydoc_data.topics", "python": sys.version.split()[0],
            "corpus_bytes": len(data), "corpus_sha256": hashlib.sha256(data).hexdigest()[:16]}


# ---- the synthetic images ---------------------------------------------------

#: The classes of ``load_shapes``: each is inside/outside in the shape's own
#: frame (u to the right, v downwards; a shape spans about [-1, 1]^2).
SHAPES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "disc": lambda u, v: u * u + v * v <= 1.0,
    "square": lambda u, v: torch.maximum(u.abs(), v.abs()) <= 0.8,
    "triangle": lambda u, v: (v <= 0.75) & (u.abs() <= 0.55 * (v + 0.95)),
    "plus": lambda u, v: (((u.abs() <= 0.28) | (v.abs() <= 0.28))
                          & (torch.maximum(u.abs(), v.abs()) <= 0.95)),
    "ring": lambda u, v: (u * u + v * v <= 1.0) & (u * u + v * v >= 0.3),
    "horizontal bar": lambda u, v: (u.abs() <= 1.0) & (v.abs() <= 0.32),
    "vertical bar": lambda u, v: (u.abs() <= 0.32) & (v.abs() <= 1.0),
    "diamond": lambda u, v: u.abs() + v.abs() <= 1.05,
    "L": lambda u, v: (((u >= -0.8) & (u <= -0.3) & (v.abs() <= 0.9))
                       | ((v >= 0.4) & (v <= 0.9) & (u.abs() <= 0.8))),
    "X": lambda u, v: ((((u - v).abs() <= 0.38) | ((u + v).abs() <= 0.38))
                       & (torch.maximum(u.abs(), v.abs()) <= 0.85)),
}


def draw_shapes(kinds: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, size: torch.Tensor,
                angle: torch.Tensor, res: int) -> torch.Tensor:
    """Masks (n, 1, res, res) of one shape per image: kind (an index into
    ``SHAPES``), centre in pixels, half-width in pixels, rotation in radians."""
    n = len(kinds)
    grid = torch.arange(res, dtype=torch.float32) + 0.5
    x = grid.view(1, 1, res) - cx.view(n, 1, 1)
    y = grid.view(1, res, 1) - cy.view(n, 1, 1)
    cos, sin, scale = angle.cos().view(n, 1, 1), angle.sin().view(n, 1, 1), size.view(n, 1, 1)
    u, v = (cos * x + sin * y) / scale, (cos * y - sin * x) / scale
    masks = torch.zeros(n, res, res, dtype=torch.bool)
    for kind, inside in enumerate(SHAPES.values()):
        mine = kinds == kind
        masks[mine] = inside(u[mine], v[mine])
    return masks.unsqueeze(1).float()


def offset_colours(background: torch.Tensor, low: float, high: float,
                   g: torch.Generator) -> torch.Tensor:
    """For each RGB colour in `background` (n, 3), in [0, 1], a random colour at a
    distance drawn from [low, high] (less where a channel is clipped)."""
    direction = torch.randn(background.shape, generator=g)
    # away from the nearer end of each channel, so that little is clipped
    direction = (-direction.abs() * torch.sign(background - 0.5)
                 / direction.norm(dim=1, keepdim=True))
    distance = low + (high - low) * torch.rand(len(background), 1, generator=g)
    return (background + distance * direction).clamp(0.0, 1.0)


def load_shapes(train: int = 6000, test: int = 1500, res: int = 24, noise: float = 0.2,
                sizes: tuple[float, float] = (3.5, 7.5), faint: tuple[float, float] = (0.1, 0.2),
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A synthetic 10-class image task: which of ``SHAPES`` is in the picture.

    Each RGB image (3 x res x res) holds one shape of its class (half-width
    drawn from `sizes`, in pixels; rotated by up to 0.3 rad; inside the image)
    in a random foreground colour on a random background colour (RGB distance
    0.3-0.7), over a smaller low-contrast distractor of a random kind
    (half-width 2-4.5 pixels, RGB distance from the background drawn from
    `faint`, any rotation, anywhere, possibly clipped), plus Gaussian pixel
    noise of std `noise`. Each image is then standardised per channel, so that
    neither colour nor brightness carries information about the class.
    Deterministic in `seed`; returns x_train, y_train, x_test, y_test.
    """
    g = torch.Generator().manual_seed(seed)
    n = train + test

    def uniform(low: float | torch.Tensor, high: float | torch.Tensor) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=g)

    y = torch.randint(len(SHAPES), (n,), generator=g)
    size = uniform(*sizes)
    margin = size  # a shape turned by <= 0.3 rad spans about +-1.05 of its size
    shape = draw_shapes(y, uniform(margin, res - margin), uniform(margin, res - margin),
                        size, uniform(-0.3, 0.3), res)
    distractor = draw_shapes(torch.randint(len(SHAPES), (n,), generator=g), uniform(0, res),
                             uniform(0, res), uniform(2.0, 4.5), uniform(-math.pi, math.pi), res)
    background = torch.rand(n, 3, generator=g)
    foreground = offset_colours(background, 0.3, 0.7, g).view(n, 3, 1, 1)
    faint_colour = offset_colours(background, *faint, g).view(n, 3, 1, 1)
    x = torch.lerp(background.view(n, 3, 1, 1).expand(n, 3, res, res), faint_colour, distractor)
    x = torch.lerp(x, foreground, shape)
    x = x + noise * torch.randn(n, 3, res, res, generator=g)
    x = (x - x.mean((2, 3), keepdim=True)) / (x.std((2, 3), keepdim=True) + 0.05)
    return x[:train], y[:train], x[train:], y[train:]


def shapes_info() -> dict[str, Any]:
    """A fingerprint of ``load_shapes()``, for the results file (it depends on
    torch's random number generators)."""
    x_train, y_train, x_test, y_test = load_shapes()
    digest = hashlib.sha256()
    for t in (x_train, y_train, x_test, y_test):
        digest.update(t.numpy().tobytes())
    return {"data": "load_shapes()", "torch": torch.__version__,
            "data_sha256": digest.hexdigest()[:16]}


# ---- models -----------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
                   .permute(2, 0, 3, 1, 4))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    """A decoder-only transformer over bytes; the output layer is the embedding."""

    def __init__(self, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next byte at every position: (batch, length, 256)."""
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        return F.linear(self.norm(self.blocks(h)), self.embed.weight)


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm, plus the input
    (through a strided 1x1 convolution with BatchNorm where the shape changes)."""

    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A CIFAR-style ResNet: a 3x3 stem, stages of ``BasicBlock``s (the first
    block of every stage but the first halves the resolution), global average
    pooling, a linear classifier."""

    def __init__(self, widths: tuple[int, ...], blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, channels = [], widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(channels, width, stride))
                channels = width
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


# ---- tasks ------------------------------------------------------------------


class Task:
    """What the training loop needs from a task. Subclasses are dataclasses
    whose fields are the hyper-parameters."""

    name: str
    epochs: int
    batch_size: int  # per rank

    def model(self) -> nn.Module:
        raise NotImplementedError

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    def lr_scheduler(self, optimizer: torch.optim.Optimizer,
                     total_steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The learning-rate schedule, built on the optimizer ``hemiola.wrap`` returned."""
        return None

    def epoch_samples(self, seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All training inputs and targets of one epoch, before shuffling."""
        raise NotImplementedError

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics; called in eval mode under ``torch.no_grad()``."""
        raise NotImplementedError

    def steps_per_epoch(self, world: int) -> int:
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


TASKS: dict[str, type[Task]] = {"digits": DigitsTask, "lm": LMTask, "shapes": ShapesTask,
                                "shapes-adamw": ShapesAdamWTask}



@dataclass(frozen=True)
class Headline:
    """A task's main held-out metric, and the value that counts as converged."""

    metric: str
    higher_is_better: bool
    target: float


HEADLINE: dict[str, Headline] = {"digits": Headline("test_accuracy", True, 0.97),
                                 "lm": Headline("heldout_loss", False, 2.1),
                                 "shapes": Headline("test_accuracy", True, 0.85),
                                 "shapes-adamw": Headline("test_accuracy", True, 0.85)}


# ---- one rank's run ---------------------------------------------------------


@dataclass
class RankResult:
    """What one rank returns. Step losses are this rank's own (its shard)."""

    losses: list[float]
    evals: list[dict[str, float]]  # rank 0 only: {"step": ..., metric: ...}
    final: dict[str, float]  # rank 0 only: the last evaluation
    train_seconds: float  # the training loop, evaluation excluded
    steps: int
    stats: dict[str, float]  # the wrapped model's stats()


def _evaluate(model: nn.Module, task: Task) -> dict[str, float]:
    """Rank 0 alone evaluates: through the wrapped module, as DDP scripts do
    (a forward of the wrapper may broadcast buffers, a collective).
    ``model.eval()`` on the wrapper lands pending updates first."""
    model.eval()
    with torch.no_grad():
        metrics = task.evaluate(getattr(model, "module", model))
    model.train()
    return metrics


#: schedules with options, as they appear in benchmark tables
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # corrections land only when the in-flight bound forces them: the
    # approximation is read every iteration, as when communication takes the
    # whole next iteration
    "decoupled-late": ("decoupled", {"correct_on_arrival": False}),
    # the approximate step from the rank's own gradient alone, without the
    # preview (the default for SGD; Adam and AdamW take a preview by default)
    "decoupled-own": ("decoupled", {"preview": False}),
}


def ddp_with_hook(model: nn.Module, compression: str) -> nn.Module:
    """torch DDP with the communication hook that does what hemiola's
    `compression` does ("": none; PowerSGD: rank 2 from iteration 10, as
    hemiola's defaults, in one bucket: over Gloo its chained all-reduces race
    between two)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if compression == "powersgd":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1000)
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        return ddp
    ddp = nn.parallel.DistributedDataParallel(model)
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    if compression:
        ddp.register_comm_hook(None, hooks[compression])
    return ddp


def train_rank(rank: int, world: int, task_name: str, schedule: str, seed: int,
               epochs: int | None = None, max_steps: int | None = None,
               evals: int = 10, clip: float | None = None) -> RankResult:
    """Trains `task_name` with `schedule` on this rank (run by ``run_local``).

    Args:
        epochs: Overrides the task's number of epochs.
        max_steps: Overrides the number of optimizer steps (which otherwise is
            epochs x steps per epoch); a learning-rate schedule follows it.
        evals: Evaluations (on rank 0) spread evenly over training, plus one
            before the first step. ``model.synchronize()``, where the wrapped
            model has it, is called on every rank before each.
        clip: Clips the gradients' global 2-norm to this after backward (as
            nanoGPT does), with ``model.clip_grad_norm_`` on a hemiola model and
            ``torch.nn.utils.clip_grad_norm_`` on DDP.
    """
    hemiola.init()
    task = TASKS[task_name]()
    n_epochs = task.epochs if epochs is None else epochs
    total = n_epochs * task.steps_per_epoch(world) if max_steps is None else max_steps
    eval_steps = {round(total * i / evals) for i in range(evals + 1)}

    torch.manual_seed(seed)
    model = task.model()
    base, _, compression = schedule.partition("+")  # e.g. "wfbp+int8", "ddp+powersgd"
    if base == "ddp":  # torch DDP, with the hook of that compression
        model = ddp_with_hook(model, compression)
        optimizer = task.optimizer(model)
    else:
        name, options = VARIANTS.get(base, (base, {}))
        if compression:
            options = {**options, "compression": compression}
        model, optimizer = hemiola.wrap(model, task.optimizer(model), schedule=name, **options)
    scheduler = task.lr_scheduler(optimizer, total)

    losses: list[float] = []
    history: list[dict[str, float]] = []
    seconds = 0.0

    def maybe_evaluate(step: int) -> None:
        if step in eval_steps:
            if hasattr(model, "synchronize"):
                model.synchronize()
            if rank == 0:
                # seconds: training time so far, evaluations excluded
                history.append({"step": step, "seconds": seconds, **_evaluate(model, task)})

    maybe_evaluate(0)
    step, epoch = 0, 0
    while step < total:
        x_all, y_all = task.epoch_samples(seed, epoch)
        g = torch.Generator().manual_seed(1_000_003 * seed + epoch)
        mine = torch.randperm(len(x_all), generator=g)[rank::world]
        for i in range(min(len(x_all) // (task.batch_size * world), total - step)):
            idx = mine[i * task.batch_size:(i + 1) * task.batch_size]
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = task.loss(model, x_all[idx], y_all[idx])
            loss.backward()
            if clip is not None:
                if hasattr(model, "clip_grad_norm_"):
                    model.clip_grad_norm_(clip)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            losses.append(loss.item())
            seconds += time.perf_counter() - start
            step += 1
            maybe_evaluate(step)
        epoch += 1
    stats = model.stats() if hasattr(model, "stats") else {}
    return RankResult(losses, history, history[-1] if history else {}, seconds, step, stats)

"""The tasks of the convergence benchmark (bench/convergence.py), and the
function each rank runs.

Two small real tasks, each with fixed hyper-parameters that are the same for
every schedule:

- ``digits``: scikit-learn's digits (1,797 8x8 images, fixed 80/20 split), a
  CNN with BatchNorm (``hemiola.demo.DigitsCNN``), SGD with momentum and weight
  decay. Metrics: test accuracy, final train loss.
- ``lm``: a byte-level decoder-only transformer language model (tied
  embeddings, no dropout), AdamW with linear warmup and cosine decay, trained
  on the text of Python's own language reference as shipped in the standard
  library (``pydoc_data.topics``: ~466 KB, no download). Metrics: held-out loss
  (nats per byte) and perplexity, final train loss.

A rank trains on its own shard of each epoch's shuffled samples: every epoch
is a permutation seeded by (seed, epoch), identical on every rank, of which
rank r takes elements r, r + world, ... The per-rank batch size is fixed, so
the global batch is ``world * batch_size``.
"""

from __future__ import annotations

import hashlib
import math
import time
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


@dataclass
class DigitsTask(Task):
    """``hemiola.demo.DigitsCNN`` on scikit-learn's digits, SGD with momentum.

    The 80/20 split is fixed (``load_digits(seed=0)``) whatever the run's seed.
    """

    name: str = "digits"
    epochs: int = 5
    batch_size: int = 16
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    data: tuple[torch.Tensor, ...] = field(default_factory=lambda: load_digits(seed=0),
                                           repr=False)

    def model(self) -> nn.Module:
        return DigitsCNN()

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)

    def epoch_samples(self, seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[0], self.data[1]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        x_test, y_test = self.data[2], self.data[3]
        logits = model(x_test)
        return {"test_accuracy": (logits.argmax(1) == y_test).float().mean().item(),
                "test_loss": F.cross_entropy(logits, y_test).item()}


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
        params = list(model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": self.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)

    def lr_scheduler(self, optimizer: torch.optim.Optimizer,
                     total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
        warmup = max(1, int(self.warmup_fraction * total_steps))

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            cosine = 0.5 * (1 + math.cos(math.pi * progress))
            return self.min_lr_fraction + (1 - self.min_lr_fraction) * cosine

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

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


TASKS: dict[str, type[Task]] = {"digits": DigitsTask, "lm": LMTask}



@dataclass(frozen=True)
class Headline:
    """A task's main held-out metric, and the value that counts as converged."""

    metric: str
    higher_is_better: bool
    target: float


HEADLINE: dict[str, Headline] = {"digits": Headline("test_accuracy", True, 0.97),
                                 "lm": Headline("heldout_loss", False, 2.1)}


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
}


def train_rank(rank: int, world: int, task_name: str, schedule: str, seed: int,
               epochs: int | None = None, max_steps: int | None = None,
               evals: int = 10) -> RankResult:
    """Trains `task_name` with `schedule` on this rank (run by ``run_local``).

    Args:
        epochs: Overrides the task's number of epochs.
        max_steps: Overrides the number of optimizer steps (which otherwise is
            epochs x steps per epoch); a learning-rate schedule follows it.
        evals: Evaluations (on rank 0) spread evenly over training, plus one
            before the first step. ``model.synchronize()``, where the wrapped
            model has it, is called on every rank before each.
    """
    hemiola.init()
    task = TASKS[task_name]()
    n_epochs = task.epochs if epochs is None else epochs
    total = n_epochs * task.steps_per_epoch(world) if max_steps is None else max_steps
    eval_steps = {round(total * i / evals) for i in range(evals + 1)}

    torch.manual_seed(seed)
    model = task.model()
    name, options = VARIANTS.get(schedule, (schedule, {}))
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

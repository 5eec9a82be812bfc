"""Small real models for the multi-rank tests: an MLP, a CNN with BatchNorm and
a transformer language model with tied embeddings."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                 nn.Linear(64, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PeekMLP(nn.Module):
    """Reads its first layer's weight in its own forward before calling that
    layer: the first read of ``fc1.weight`` is not in ``fc1``'s forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = x + 10.0 * self.fc1.weight.mean(0)
        return self.fc2(torch.relu(self.fc1(shifted)))


class CNN(nn.Module):
    # Convolutions before BatchNorm have no bias (as in ResNets), except in
    # CNNWithCancelledBias: BatchNorm cancels it, so its gradient is pure
    # rounding noise that Adam amplifies into lr-sized steps, making any two
    # reduction orders, or any two Adam steps not equal bit for bit, disagree.
    bias = False

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1, bias=self.bias), nn.BatchNorm2d(8), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class CNNWithCancelledBias(CNN):
    bias = True


class TinyTransformerLM(nn.Module):
    """Decoder-only LM; the output projection is tied to the embedding.

    Blocks have no biases (as in LLaMA-style models): the key bias of attention
    has an exactly-zero true gradient (softmax ignores a constant shift), so its
    computed gradient is rounding noise that Adam amplifies into lr-sized steps,
    and no two reduction orders would agree on it.
    """

    def __init__(self, vocab: int = 50, dim: int = 32, layers: int = 2, context: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=64, dropout=0.0,
                                           batch_first=True, bias=False)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.out(self.norm(h))


def make_model(name: str) -> nn.Module:
    return {"mlp": MLP, "peek": PeekMLP, "cnn": CNN,
            "cnn-bias": CNNWithCancelledBias, "transformer": TinyTransformerLM}[name]()


def make_batch(name: str, step: int, rank: int, world: int, batch: int = 8
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s shard of global batch `step` (same data whatever the world)."""
    g = torch.Generator().manual_seed(1000 + step)
    if name in ("mlp", "peek"):
        x = torch.randn(batch * world, 20, generator=g)
        y = torch.randint(0, 5, (batch * world,), generator=g)
    elif name in ("cnn", "cnn-bias"):
        x = torch.randn(batch * world, 1, 8, 8, generator=g)
        y = torch.randint(0, 10, (batch * world,), generator=g)
    else:
        tokens = torch.randint(0, 50, (batch * world, 17), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    return x[rank::world], y[rank::world]


def loss_of(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "transformer":
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]),
                                           target.reshape(-1))
    return nn.functional.cross_entropy(output, target)


def make_optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)  # type: ignore[arg-type]
    if name == "nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True,  # type: ignore[arg-type]
                               weight_decay=1e-4)
    if name == "plain_sgd":  # no momentum: a step is a function of one gradient
        return torch.optim.SGD(params, lr=0.05, weight_decay=1e-4)  # type: ignore[arg-type]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)  # type: ignore[arg-type]
    raise ValueError(name)

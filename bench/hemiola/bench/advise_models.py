"""Models ``hemiola bench advise`` checks ``hemiola advise`` on, besides its
built-in MLP: two the project has not tuned anything for, unlike the
benchmarks' own (factories for ``--model``, seeded alike on every rank, one
batch per rank).

- ``lm``: a causal transformer LM with untied embeddings (10.3M parameters,
  GPT-2-style blocks, 4096 tokens, 4 x 64 tokens per rank);
- ``cnn``: a depthwise-separable convolutional net with a VGG-style
  classifier (5.5M parameters, most of them in the fully connected head,
  batch 32 of 32x32 images).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from hemiola.bench.tasks.models import Block


class CausalLM(nn.Module):
    """Token and position embeddings, pre-norm causal blocks, a separate head."""

    def __init__(self, vocab: int = 4096, dim: int = 384, layers: int = 4, heads: int = 6,
                 context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.position(positions)
        return self.head(self.norm(self.blocks(h)))


def _separable(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cin, 3, padding=1, groups=cin, bias=False),
                         nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


def separable_cnn(classes: int = 100) -> nn.Sequential:
    """Separable convolutions down to 4x4x256, then two 1024-wide layers."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        _separable(32, 64), nn.MaxPool2d(2), _separable(64, 128), _separable(128, 128),
        nn.MaxPool2d(2), _separable(128, 256), _separable(256, 256), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, classes))


def lm() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """``--model hemiola.bench.advise_models:lm``."""
    torch.manual_seed(0)
    model = CausalLM()
    tokens = torch.randint(0, 4096, (4, 65))
    x, y = tokens[:, :-1], tokens[:, 1:]
    return model, lambda m: F.cross_entropy(m(x).flatten(0, 1), y.flatten())


def cnn() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """``--model hemiola.bench.advise_models:cnn``."""
    torch.manual_seed(0)
    model = separable_cnn()
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 100, (32,))
    return model, lambda m: F.cross_entropy(m(x), y)


def mlp_small() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The built-in MLP at width 768 (2.4M parameters, batch 128): small
    enough that 4 ranks on 2 cores stay bound by a 100-200 Mbit/s link."""
    from hemiola.advise import builtin_mlp

    return builtin_mlp(768, 128)


#: --models names: the factory spec each rank imports
MODELS = {"mlp": None, "lm": f"{__name__}:lm", "cnn": f"{__name__}:cnn",
          "mlp-small": f"{__name__}:mlp_small"}

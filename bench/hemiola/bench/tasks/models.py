"""The models of the convergence tasks that are not ``hemiola.demo``'s: a
byte-level decoder-only transformer (``ByteLM``), nanoGPT's GPT for the
character-level task (``CharGPT``) and a CIFAR-style ResNet (``SmallResNet``)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def causal_attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal self-attention of `heads` heads from the fused query, key and
    value projections `qkv` (batch, length, 3 * dim); (batch, length, dim)."""
    b, t, d3 = qkv.shape
    d = d3 // 3
    q, k, v = qkv.view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attended.transpose(1, 2).reshape(b, t, d)


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
        x = x + self.proj(causal_attention(self.qkv(self.norm1(x)), self.heads))
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


class GPTBlock(nn.Module):
    """nanoGPT's block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``, with
    nanoGPT's names (c_attn, c_proj, c_fc) and bias-free LayerNorms."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim, bias=False)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.attn_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim, bias=False)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_proj(causal_attention(self.c_attn(self.ln_1(x)), self.heads))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class CharGPT(nn.Module):
    """nanoGPT's GPT (Karpathy's ``model.py``, the ``shakespeare_char``
    configuration's shape) written out for the character-level task: token and
    learned position embeddings, pre-norm blocks, a final LayerNorm, the output
    layer tied to the token embedding; weights N(0, 0.02), the residual
    projections N(0, 0.02 / sqrt(2 * layers)), biases zero. No dropout (the
    contenders of a run share one process: dropout would draw from one
    generator in an order that depends on the contenders)."""

    def __init__(self, vocabulary: int, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocabulary, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.Sequential(*[GPTBlock(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next character at every position: (batch, length, vocabulary)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.h(self.wte(tokens) + self.wpe(positions))
        return F.linear(self.ln_f(h), self.wte.weight)


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

"""Where priority/decoupled land a parameter: learnt from the first forward."""

from __future__ import annotations

import torch
from torch import nn

from hemiola.forward_gate import ForwardGate

from models import TinyTransformerLM


def _gate(model: nn.Module) -> tuple[ForwardGate, list[tuple[int, list[int]]], dict[str, int]]:
    params = [p for p in model.parameters() if p.requires_grad]
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    calls: list[tuple[int, list[int]]] = []
    return ForwardGate(model, params, lambda g, indices: calls.append((g, indices))), \
        calls, index


def test_landing_points_follow_the_first_read_not_the_module_tree() -> None:
    model = TinyTransformerLM()
    gate, calls, index = _gate(model)
    tokens = torch.randint(0, 50, (2, 16))
    with gate.scope():
        model(tokens)
    # MultiheadAttention reads out_proj.weight without calling out_proj.
    attention = model.blocks.layers[0].self_attn
    assert gate.gate_of[index["blocks.layers.0.self_attn.out_proj.weight"]] is attention
    # The tied output weight is read first by the embedding.
    assert gate.gate_of[index["embed.weight"]] is model.embed
    # A parameter the outer forward reads itself lands at the very start.
    assert gate.gate_of[index["pos"]] is model
    assert gate.gate_of[index["blocks.layers.1.linear2.weight"]] is model.blocks.layers[1].linear2

    # From then on each landing point asks for its parameters before its
    # forward, by its gate number, every parameter once per forward.
    calls.clear()
    with gate.scope():
        model(tokens)
    landed = sorted(i for _, indices in calls for i in indices)
    assert landed == list(range(len(index)))
    assert all(gate.gates[g] == indices for g, indices in calls)
    assert gate.gates[0] == list(range(len(index)))  # gate 0: everything
    assert sorted(g for g, _ in calls) == list(range(1, len(gate.gates)))


def test_parameters_not_read_in_the_first_forward_land_at_its_start() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.b(x) if use_b else self.a(x)

    model = Branchy()
    gate, calls, index = _gate(model)
    with gate.scope():
        model(torch.randn(2, 4), False)
    assert gate.gate_of[index["a.weight"]] is model.a
    assert gate.gate_of[index["b.weight"]] is model


def test_no_learning_without_gradients() -> None:
    model = nn.Linear(3, 3)
    gate, calls, _ = _gate(model)
    with torch.no_grad(), gate.scope():
        model(torch.randn(1, 3))
    assert all(m is model for m in gate.gate_of.values())  # not learnt: the root
    assert calls == [(0, [0, 1])]  # until learnt, the root lands everything (gate 0)

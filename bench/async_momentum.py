"""Momentum under asynchrony, without the network: a sequential simulation of
asynchronous SGD in which every gradient is `delay` updates stale.

    python bench/async_momentum.py                      # delays 1-3, every rule, 2 seeds
    python bench/async_momentum.py --delays 2 --rules plain compensated --seeds 4

Two workers take turns on `hemiola demo`'s model and data (DigitsCNN on
scikit-learn's digits, batch 32 per worker, 5 epochs, SGD lr 0.05, momentum
0.9: the demo's settings). Each update applies one worker's gradient,
computed on the parameters `delay` updates old, at the staleness rule's
factor 1/(1 + delay), as hemiola.ps's servers would with every push equally
stale. What differs is how the momentum is treated (``--rules``):

- ``plain``: the momentum as given (hemiola.ps before momentum compensation).
- ``compensated``: momentum / (1 + delay) (hemiola.ps's
  ``PSConfig(momentum_rule="compensated")``, the default until 2026-11-26).
- ``mitliagkas``: momentum - delay / (1 + delay), subtracting the implicit
  momentum of asynchrony (Mitliagkas et al., 2016).
- ``dana``: the gradient is computed at a look-ahead of the stale parameters
  by the momentum of the `delay` updates to come (DANA, Hakimi et al., 2019).
- ``dc``: the gradient is delay-compensated, g + g * g * (w_now - w_stale)
  (DC-ASGD, Zheng et al., 2017, lambda = 1).

Prints test accuracy and the mean training loss of the last 20 steps per run.
Deterministic: the same command prints the same numbers.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch import nn
from tqdm import tqdm

from hemiola.demo import DigitsCNN, load_digits

RULES = ("plain", "compensated", "mitliagkas", "dana", "dc")


def momentum_of(rule: str, momentum: float, delay: int) -> float:
    if rule == "compensated":
        return momentum / (1 + delay)
    if rule == "mitliagkas":
        return max(0.0, momentum - delay / (1 + delay))
    return momentum


def simulate(rule: str, delay: int, seed: int, lr: float = 0.05, momentum: float = 0.9,
             workers: int = 2, batch: int = 32, epochs: int = 5) -> tuple[float, float]:
    """Test accuracy and mean loss of the last 20 steps of one run."""
    torch.manual_seed(seed)
    x, y, x_test, y_test = load_digits()
    model = DigitsCNN()
    params = list(model.parameters())
    buf = [torch.zeros_like(p) for p in params]
    # (parameters, momentum buffers) after each of the last delay + 1 updates
    history = [([p.detach().clone() for p in params], [b.clone() for b in buf])]
    factor = 1.0 / (1 + delay)
    mu = momentum_of(rule, momentum, delay)
    ahead = lr * factor * sum(mu ** j for j in range(1, delay + 1))
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    steps = len(y) // (batch * workers)
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for step, w in itertools.product(range(steps), range(workers)):
            idx = order[w::workers][step * batch:(step + 1) * batch]
            stale_w, stale_buf = history[max(0, len(history) - 1 - delay)]
            with torch.no_grad():
                for p, s, b in zip(params, stale_w, stale_buf):
                    p.copy_(s if rule != "dana" else s - ahead * b)
            model.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            losses.append(loss.item())
            with torch.no_grad():
                now = history[-1][0]
                new = []
                for p, current, stale, b in zip(params, now, stale_w, buf):
                    g = p.grad
                    if rule == "dc":
                        g = g + g * g * (current - stale)
                    b.mul_(mu).add_(g)
                    new.append(current - lr * factor * b)
                history = (history + [(new, [b.clone() for b in buf])])[-(delay + 2):]
    with torch.no_grad():
        for p, v in zip(params, history[-1][0]):
            p.copy_(v)
        model.eval()
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return accuracy, sum(losses[-20:]) / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    plan = list(itertools.product(args.delays, args.rules))
    rows = []
    for delay, rule in tqdm(plan, desc="async momentum", unit="rule"):
        runs = [simulate(rule, delay, seed) for seed in range(args.seeds)]
        rows.append((delay, rule, runs))
    print(f"\n{'delay':>5} {'rule':>12}  test accuracy % per seed   final loss per seed")
    for delay, rule, runs in rows:
        acc = " ".join(f"{100 * a:5.1f}" for a, _ in runs)
        loss = " ".join(f"{v:5.3f}" for _, v in runs)
        print(f"{delay:>5} {rule:>12}  {acc:<26} {loss}")


if __name__ == "__main__":
    main()

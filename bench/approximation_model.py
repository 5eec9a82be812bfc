"""A single-process model of ``decoupled``'s approximation, for trying
approximate steps quickly: N virtual ranks take turns on one CPU, each
computing its gradient at its own approximate parameters, and the exact
AdamW step lands before the next step (every read approximate, as with
``correct_on_arrival=False``). The task, data shards, model and learning-rate
schedule are hemiola.bench.tasks's LM (hemiola bench convergence's), so the exact
variant is wfbp's trajectory, up to the order of floating-point sums.

    python bench/approximation_model.py --variant own --seed 0
    python bench/approximation_model.py --variant preview --seeds 3

Variants of the gradient the approximate step of rank i takes:
  exact    the average (what wfbp reads; the reference)
  own      the rank's own gradient (decoupled without a preview)
  delay    none: the forward reads the previous exact parameters
  preview  the engine's preview (cpp/src/engine/preview.h): own gradient
           minus its own coding plus the coded average; --levels L (default
           floor(127 / world)), codes over +-range RMS of the previous
           average (default 5 sqrt(world), the engine's; per tensor, or per
           --block elements); --no-remainder
           drops the own gradient's remainder

--exact-fraction p lets each rank read each tensor exact with probability p,
as corrections that land on arrival make some reads.

Prints the held-out loss per seed and their mean. About a minute per seed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call

from hemiola.bench.tasks import LMTask

Grads = dict[str, torch.Tensor]


def adamw(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, lr: float,
          step: int, decay: float, betas: tuple[float, float], eps: float = 1e-8,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's AdamW step, out of place: (parameter, exp_avg, exp_avg_sq)."""
    b1, b2 = betas
    m = m * b1 + (1 - b1) * g
    v = v * b2 + (1 - b2) * g * g
    denom = (v / (1 - b2 ** step)).sqrt() + eps
    return w * (1 - lr * decay) - lr * (m / (1 - b1 ** step)) / denom, m, v


def block_rms(reference: torch.Tensor, block: int = 0) -> torch.Tensor:
    """Per element of `reference` (flattened), the RMS of its block of
    `block` elements (0: of the whole tensor)."""
    ref = reference.reshape(-1)
    if block and ref.numel() > block:
        pad = (-ref.numel()) % block
        ref_blocks = F.pad(ref, (0, pad)).view(-1, block)
        return ref_blocks.pow(2).mean(1).sqrt().repeat_interleave(block)[: ref.numel()]
    return ref.pow(2).mean().sqrt().expand_as(ref)


def code(g: torch.Tensor, rms: torch.Tensor, levels: int, span: float) -> torch.Tensor:
    """The preview's coding of g, dequantised: s * clamp(rint(g / s), -L, L),
    with s = span * rms / L (`rms` per element of g, flattened)."""
    flat = g.reshape(-1)
    scale = span * rms / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    coded = (flat / safe).round().clamp(-levels, levels) * scale
    return coded.view_as(g)


def approximate_grads(variant: str, grads: list[Grads], mean: Grads, rms: Grads | None,
                      args: argparse.Namespace) -> list[Grads] | None:
    """The gradient each rank's approximate step takes (None: no step)."""
    if variant == "exact":
        return [mean] * len(grads)
    if variant == "own":
        return grads
    if variant == "delay":
        return None
    if rms is None:  # no scale yet: the engine previews from the third iteration
        return grads
    world = len(grads)
    levels = args.levels or 127 // world
    coded = [{n: code(g[n], rms[n], levels, args.range) for n in g} for g in grads]
    coded_mean = {n: sum(c[n] for c in coded) / world for n in mean}
    if args.no_remainder:
        return [coded_mean] * world
    # --own-front K: the first K tensors the forward reads take no preview
    # (a forward that does not wait for the previews backward produces last);
    # --exact-front K: they take the average (a forward that waits for their
    # full reduction).
    own = set(list(mean)[:args.own_front])
    exact = set(list(mean)[:args.exact_front])
    return [{n: g[n] if n in own else mean[n] if n in exact else g[n] - c[n] + coded_mean[n]
             for n in g} for g, c in zip(grads, coded)]


def run(variant: str, seed: int, args: argparse.Namespace) -> tuple[float, float]:
    """Trains the LM on `args.world` virtual ranks: the final held-out loss,
    and how far the approximate steps' gradients were from the average,
    sqrt(sum |a - mean|^2 / sum |mean|^2) over ranks, tensors and steps (the
    engine's model.stats()["preview_error"] for the preview)."""
    torch.set_num_threads(1)
    task = LMTask()
    world = args.world
    total = task.epochs * task.steps_per_epoch(world)
    torch.manual_seed(seed)
    model = task.model()
    names = [n for n, _ in model.named_parameters()]
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    decay = {n: task.weight_decay if w[n].dim() >= 2 else 0.0 for n in names}
    m = {n: torch.zeros_like(w[n]) for n in names}
    v = {n: torch.zeros_like(w[n]) for n in names}
    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=task.lr)
    schedule = task.lr_scheduler(holder, total)
    live = [dict(w) for _ in range(world)]
    # --exact-back f: the tensors last in forward order, f of the elements,
    # read exact on every rank (as in the engine, whose back layers' reductions
    # arrive first), the others approximate.
    exact_back: set[str] = set()
    total_numel = sum(w[n].numel() for n in names)
    for n in reversed(names):
        if sum(w[k].numel() for k in exact_back) + w[n].numel() > args.exact_back * total_numel:
            break
        exact_back.add(n)
    history: list[Grads] = []  # the newest averages, newest last
    luck = torch.Generator().manual_seed(seed)
    distance = norm = 0.0
    step, epoch = 0, 0
    while step < total:
        x_all, y_all = task.epoch_samples(seed, epoch)
        g = torch.Generator().manual_seed(1_000_003 * seed + epoch)
        order = torch.randperm(len(x_all), generator=g)
        for i in range(min(len(x_all) // (task.batch_size * world), total - step)):
            grads = []
            for r in range(world):  # hemiola.bench.tasks's shards
                idx = order[r::world][i * task.batch_size:(i + 1) * task.batch_size]
                params = {n: live[r][n].clone().requires_grad_(True) for n in names}
                out = functional_call(model, params, (x_all[idx],))
                loss = F.cross_entropy(out.flatten(0, 1), y_all[idx].flatten())
                grads.append(dict(zip(names, torch.autograd.grad(loss, list(params.values())))))
            lr, step = schedule.get_last_lr()[0], step + 1
            mean = {n: sum(gr[n] for gr in grads) / world for n in names}
            previous = history[-args.scale_lag] if len(history) >= args.scale_lag else None
            rms = None if previous is None else \
                {n: block_rms(previous[n], args.block) for n in names}
            approx = approximate_grads(variant, grads, mean, rms, args)
            # As the engine counts it: only steps that took a preview.
            counted = approx if variant != "preview" or previous is not None else None
            for a in counted or []:
                distance += sum(float((a[n] - mean[n]).pow(2).sum()) for n in names)
                norm += sum(float(mean[n].pow(2).sum()) for n in names)
            live = [dict(w) if approx is None else
                    {n: adamw(w[n], m[n], v[n], a[n], lr, step, decay[n], task.betas)[0]
                     for n in names} for a in (approx or [None] * world)]
            for n in names:
                w[n], m[n], v[n] = adamw(w[n], m[n], v[n], mean[n], lr, step, decay[n],
                                         task.betas)
            # Some reads find the exact step landed (corrections on arrival),
            # on each rank independently.
            for r in range(world):
                for n in names:
                    if n in exact_back or (args.exact_fraction and float(
                            torch.rand(1, generator=luck)) < args.exact_fraction):
                        live[r][n] = w[n]
            history = [*history[-(args.scale_lag - 1):], mean] if args.scale_lag > 1 else [mean]
            holder.step()
            schedule.step()
        epoch += 1
    model.load_state_dict(w, strict=False)
    model.eval()
    with torch.no_grad():
        return task.evaluate(model)["heldout_loss"], (distance / norm) ** 0.5 if norm else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="own",
                        choices=["exact", "own", "delay", "preview"])
    parser.add_argument("--seed", type=int, help="one seed (default: --seeds)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1")
    parser.add_argument("--world", type=int, default=4, help="virtual ranks (default 4)")
    parser.add_argument("--levels", type=int, default=0, help="preview: code magnitude L")
    parser.add_argument("--range", type=float,
                        help="preview: codes span +-range RMS of a block's previous average "
                             "(default 5 * sqrt(world), the engine's preview_range)")
    parser.add_argument("--block", type=int, default=64,
                        help="preview: one scale per this many elements (0: per tensor; "
                             "default 64, the engine's)")
    parser.add_argument("--scale-lag", type=int, default=1,
                        help="preview: scales from the average this many iterations back "
                             "(default 1, the engine's)")
    parser.add_argument("--exact-fraction", type=float, default=0.0,
                        help="each rank reads each tensor exact with this probability "
                             "(a correction that landed first), independently")
    parser.add_argument("--exact-back", type=float, default=0.0, metavar="F",
                        help="the tensors last in forward order, at most F of the elements, "
                             "read exact on every rank (the engine's pattern of landings)")
    for flag, what in (("--own-front", "their own gradient"), ("--exact-front", "the average")):
        parser.add_argument(flag, type=int, default=0, metavar="K",
                            help=f"preview: the first K parameter tensors (in forward order) "
                                 f"take {what} instead")
    parser.add_argument("--no-remainder", action="store_true",
                        help="preview: the coded average alone")
    args = parser.parse_args()
    if args.range is None:
        args.range = 5.0 * args.world ** 0.5
    seeds = [args.seed] if args.seed is not None else list(range(args.seeds))
    losses = []
    for seed in seeds:
        start = time.perf_counter()
        loss, error = run(args.variant, seed, args)
        losses.append(loss)
        print(f"{args.variant} seed {seed}: held-out loss {loss:.4f}, approximate gradient's "
              f"relative error {error:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{args.variant}: mean {statistics.fmean(losses):.4f} over {len(losses)} seed(s)")


if __name__ == "__main__":
    main()

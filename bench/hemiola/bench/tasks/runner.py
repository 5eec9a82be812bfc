"""One rank's training run of a convergence task (``train_rank``).

A rank trains on its own shard of each epoch's shuffled samples: every epoch
is a permutation seeded by (seed, epoch), identical on every rank, of which
rank r takes elements r, r + world, ... The per-rank batch size is fixed, so
the global batch is ``world * batch_size``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

import hemiola
from hemiola.bench.contender import Contender
from hemiola.bench.ddp import ddp_with_hook
from hemiola.bench.tasks.registry import TASKS, Task


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


def train_rank(rank: int, world: int, task_name: str, schedule: str, seed: int,
               epochs: int | None = None, max_steps: int | None = None,
               evals: int = 10, clip: float | None = None) -> RankResult:
    """Trains `task_name` with the contender named `schedule` (e.g. ``wfbp``,
    ``decoupled+int8``, ``ddp+powersgd``: see ``Contender.parse``) on this rank
    (run by ``run_local``).

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
    contender = Contender.parse(schedule)
    if contender.is_ddp:
        model = ddp_with_hook(model, contender.compression)
        optimizer = task.optimizer(model)
    else:
        name, options = contender.wrap_arguments()
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

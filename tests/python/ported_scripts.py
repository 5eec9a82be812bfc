"""Three public DDP training scripts, ported to hemiola, run inside each rank.

Each follows the pattern of a well-known script closely, at a tiny size:

- ``tutorial``: the PyTorch DDP tutorial's ``multigpu_torchrun.py`` (a
  Trainer class, DistributedSampler, snapshots of ``model.module.state_dict()``
  every epoch, resume from the snapshot before wrapping).
- ``imagenet``: pytorch/examples' ``imagenet/main.py`` on fake data (a CNN
  with BatchNorm, SGD with momentum and weight decay, StepLR, evaluation with
  ``model.eval()`` and ``torch.no_grad()`` every epoch, checkpoints of model,
  optimizer and scheduler, resume).
- ``nanogpt``: nanoGPT's ``train.py`` (a GPT, AdamW with decay / no-decay
  groups, a cosine schedule with warm-up written into ``param_groups``,
  gradient accumulation through ``model.require_backward_grad_sync``, bf16
  autocast, a GradScaler, clipping, ``torch.compile``, checkpoints through
  ``raw_model = model.module``, periodic evaluation).

``kind`` is ``"ddp"`` (the original) or a hemiola schedule. The port is the
two-line change (``DDP(model)`` becomes ``hemiola.wrap(model, optimizer,
...)``) plus, where a schedule needs it, what the README's "Migrating from
DDP" says: the optimizer is built before wrapping, clipping goes through
``model.clip_grad_norm_``, and a GradScaler is passed to ``wrap``.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import hemiola


def _wrap(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer,
          grad_scaler: torch.amp.GradScaler | None = None) -> tuple[nn.Module, Any]:
    """The two-line change. ``decoupled-late``: decoupled with
    ``correct_on_arrival=False`` (a trajectory independent of timing).
    ``streaming``: DiLoCo every 3 inner steps, its default outer step;
    ``streaming-avg``: the same with an outer step that only averages (lr 1,
    no momentum), which on identical data is one rank's training. Under
    streaming the inner step is the script's own, so its GradScaler stays
    the script's (docs/streaming.md)."""
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model), optimizer
    options: dict[str, Any] = {}
    if kind == "decoupled-late":
        kind, options = "decoupled", {"correct_on_arrival": False}
    if kind.startswith("streaming"):
        options = {"sync_every": 3, "fragments": 1, "overlap": 0}  # blocking: equal ranks
        if kind == "streaming-avg":
            options |= {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}
        kind, grad_scaler = "streaming", None
    return hemiola.wrap(model, optimizer, schedule=kind, grad_scaler=grad_scaler,
                        fusion_mb=1 / 64, timeout_s=60, **options)


def _clip(kind: str, model: nn.Module, max_norm: float) -> None:
    if kind == "ddp":
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    else:
        model.clip_grad_norm_(max_norm)


def _save(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _load(raw: bytes) -> Any:
    return torch.load(io.BytesIO(raw), weights_only=False)


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1).double() for v in state.values()
                      if v.is_floating_point()])


# ---- the DDP tutorial -----------------------------------------------------------


class _TutorialDataset(Dataset):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g))
                     for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


class _Trainer:
    def __init__(self, kind: str, model: nn.Module, train_data: DataLoader,
                 optimizer: torch.optim.Optimizer, snapshot: bytes | None) -> None:
        self.epochs_run = 0
        self.snapshots: list[bytes] = []
        if snapshot is not None:  # loaded into the plain model, before wrapping
            loaded = _load(snapshot)
            model.load_state_dict(loaded["MODEL_STATE"])
            self.epochs_run = loaded["EPOCHS_RUN"]
        self.train_data = train_data
        self.model, self.optimizer = _wrap(kind, model, optimizer)
        self.losses: list[float] = []

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        self.snapshots.append(_save({"MODEL_STATE": self.model.module.state_dict(),
                                     "EPOCHS_RUN": epoch + 1}))

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            self._save_snapshot(epoch)


def tutorial(rank: int, world: int, kind: str, same_data: bool, stop_after: int = 4,
             resume: bytes | None = None, total_epochs: int = 4) -> dict[str, Any]:
    """Trains until `stop_after` epochs (resuming from snapshot `resume`);
    returns the snapshots taken and the losses."""
    hemiola.init()
    torch.manual_seed(0)
    dataset = _TutorialDataset(256)
    sampler = DistributedSampler(dataset, num_replicas=1 if same_data else world,
                                 rank=0 if same_data else rank, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = _Trainer(kind, model, loader, optimizer, resume)
    trainer.train(min(stop_after, total_epochs))
    return {"snapshots": trainer.snapshots, "losses": trainer.losses}


# ---- the ImageNet example ---------------------------------------------------------


def _resnetish() -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    return nn.Sequential(block(3, 8), nn.MaxPool2d(2), block(8, 16),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _fake_imagenet(size: int, seed: int) -> TensorDataset:
    """datasets.FakeData's idea: random images with random labels, plus a
    class-dependent offset so that there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (size,), generator=g)
    images = torch.randn(size, 3, 12, 12, generator=g) + labels.view(-1, 1, 1, 1) * 0.1
    return TensorDataset(images, labels)


def imagenet(rank: int, world: int, kind: str, same_data: bool, stop_after: int = 3,
             resume: bytes | None = None, epochs: int = 3) -> dict[str, Any]:
    hemiola.init()
    torch.manual_seed(0)
    model = _resnetish()
    criterion = nn.CrossEntropyLoss()
    # The example builds the optimizer after wrapping; priority and decoupled
    # take over its step, so the port builds it first.
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    model, optimizer = _wrap(kind, model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    start_epoch = 0
    if resume is not None:
        checkpoint = _load(resume)
        start_epoch = checkpoint["epoch"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    train_set = _fake_imagenet(192, 1)
    val_set = _fake_imagenet(64, 2)
    sampler = DistributedSampler(train_set, num_replicas=1 if same_data else world,
                                 rank=0 if same_data else rank, seed=5)
    train_loader = DataLoader(train_set, batch_size=16, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=32)  # every rank evaluates everything
    losses: list[float] = []
    val_losses: list[float] = []
    checkpoints: list[bytes] = []
    for epoch in range(start_epoch, min(stop_after, epochs)):
        sampler.set_epoch(epoch)
        model.train()
        for images, target in train_loader:
            loss = criterion(model(images), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        total = 0.0
        with torch.no_grad():
            for images, target in val_loader:
                total += criterion(model(images), target).item()
        val_losses.append(total / len(val_loader))
        scheduler.step()
        checkpoints.append(_save({"epoch": epoch + 1, "state_dict": model.state_dict(),
                                  "optimizer": optimizer.state_dict(),
                                  "scheduler": scheduler.state_dict()}))
    return {"losses": losses, "val_losses": val_losses, "checkpoints": checkpoints}


# ---- nanoGPT ------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class _GPT(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 32, layers: int = 2, context: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(_Block(dim, 2) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.blocks:
            x = block(x, mask)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=lr, betas=(0.9, 0.95))


def _get_batch(step: int, rank: int, batch: int = 4, context: int = 16
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A byte-level 'corpus': a fixed pseudo-random text with structure."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, 200, (batch,), generator=g)
    text = (torch.arange(260) * 7 % 32)
    x = torch.stack([text[s:s + context] for s in starts])
    y = torch.stack([text[s + 1:s + 1 + context] for s in starts])
    return x, y


def nanogpt(rank: int, world: int, kind: str, same_data: bool, max_iters: int = 6,
            compile_model: str = "", scaler_enabled: bool = False,
            overflow_at: int = -1) -> dict[str, Any]:
    """nanoGPT's loop. `compile_model`: "before" / "after" wrapping or "";
    `scaler_enabled`: a live GradScaler (float32 weights, as fp16 would need);
    `overflow_at`: rank 1's loss becomes inf at that iteration (a scaled
    gradient that overflows on one rank only)."""
    hemiola.init()
    torch.manual_seed(0)
    learning_rate, min_lr, warmup_iters, lr_decay_iters = 3e-3, 3e-4, 2, max_iters
    grad_accum, grad_clip = 2, 1.0
    model = _GPT()
    optimizer = model.configure_optimizers(0.1, learning_rate)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_enabled, init_scale=2.0**8)
    if compile_model == "before":
        model = torch.compile(model)
    model, optimizer = _wrap(kind, model, optimizer, scaler)
    if compile_model == "after":
        model = torch.compile(model)
    raw_model = model.module  # nanoGPT keeps this for checkpoints
    sync_flag_owner = getattr(model, "_orig_mod", model) if compile_model == "after" else model
    ctx = torch.amp.autocast(device_type="cpu", dtype=torch.bfloat16)

    def get_lr(it: int) -> float:
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        losses = [model(*_get_batch(10_000 + k, 0)).item() for k in range(2)]
        model.train()
        return sum(losses) / len(losses)

    losses: list[float] = []
    evals: list[float] = []
    data_rank = 0 if same_data else rank
    for it in range(max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        if it % 3 == 0:
            evals.append(estimate_loss())
        for micro_step in range(grad_accum):
            sync_flag_owner.require_backward_grad_sync = micro_step == grad_accum - 1
            x, y = _get_batch(it * grad_accum + micro_step, data_rank)
            with ctx:
                loss = model(x, y) / grad_accum
            if it == overflow_at and rank == 1 and micro_step == 0:
                loss = loss * math.inf
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            _clip(kind, model, grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * grad_accum)
    checkpoint = {k: v.clone() for k, v in raw_model.state_dict().items()}
    evals.append(estimate_loss())
    dist.barrier()
    return {"losses": losses, "evals": evals, "flat": _flat(checkpoint)}


def variants(rank: int, world: int, script: str, runs: list[tuple[Any, ...]]
             ) -> list[dict[str, Any]]:
    """Runs `script` once per argument tuple in `runs`, in one process."""
    fn = {"tutorial": tutorial, "imagenet": imagenet, "nanogpt": nanogpt}[script]
    return [fn(rank, world, *args) for args in runs]

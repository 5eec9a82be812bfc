"""A Lightning training script, run by test_lightning.py as a user runs one:
``python lightning_script.py --strategy NAME --out DIR [options]`` (with the
``pytorch_lightning`` package, or ``lightning.pytorch`` when the environment
says ``LIGHTNING_PACKAGE=lightning.pytorch``); Lightning's
own launcher starts the second rank. Rank 0 writes the final parameters (and
the logged metrics) to DIR/result.pt."""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hemiola.lightning  # noqa: F401 - registers strategy="hemiola", "hemiola_priority", ...

#: the Lightning package the script is written against (LIGHTNING_PACKAGE:
#: lightning.pytorch or pytorch_lightning)
pl = importlib.import_module(os.environ.get("LIGHTNING_PACKAGE", "pytorch_lightning"))


class Regressor(pl.LightningModule):
    """A small MLP with a BatchNorm, SGD with momentum and a step LR schedule."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                 nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        self.optimizer = optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1).float(), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1).float(), y),
                 sync_dist=True)

    def configure_optimizers(self) -> object:
        if self.optimizer == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) - x[:, 4:8].prod(1)).tanh()
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every N steps")
    p.add_argument("--resume", help="a checkpoint to resume from")
    p.add_argument("--options", type=json.loads, default=None, metavar="JSON",
                   help="HemiolaStrategy(schedule=STRATEGY, **JSON) instead of the name")
    args = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, workers=True)
    model = Regressor(args.optimizer)
    callbacks = []
    if args.ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=args.out, every_n_train_steps=args.ckpt_every, save_top_k=-1,
            filename="{step}"))
    strategy: object = args.strategy
    if args.options is not None:
        strategy = hemiola.lightning.HemiolaStrategy(schedule=args.strategy, **args.options)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip or None,
        precision=args.precision, callbacks=callbacks, logger=False,
        enable_checkpointing=bool(args.ckpt_every), enable_progress_bar=False,
        enable_model_summary=False, deterministic=True, num_sanity_val_steps=0)
    loader = DataLoader(data(), batch_size=16, shuffle=True)
    val = DataLoader(data(64), batch_size=32)
    trainer.fit(model, loader, val, ckpt_path=args.resume)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.global_rank == 0:
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"params": params, "metrics": metrics, "steps": trainer.global_step,
                    "world": trainer.world_size},
                   Path(args.out) / "result.pt")
    # Lightning's DDPStrategy leaves the process group to the interpreter's exit,
    # where torch's Gloo thread can abort the process; a script ends it first.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

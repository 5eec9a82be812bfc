"""``hemiola.hf.Trainer``: the Hugging Face Transformers ``Trainer`` with
hemiola's data parallelism instead of DDP.

    from hemiola.hf import Trainer
    trainer = Trainer(model=model, args=args, train_dataset=data, schedule="priority")
    trainer.train()

Launch as the Trainer is launched (``torchrun --nproc-per-node N train.py``).
Everything else is the Trainer's: its optimizer and LR scheduler, gradient
accumulation (through the wrapped model's ``no_sync``), ``max_grad_norm``
(through the schedule's clipping), bf16 autocast, evaluation, checkpoints
and resume. Needs ``pip install 'hemiola[hf]'`` (transformers, accelerate).

How it fits, without patching transformers or accelerate: the Trainer
builds its optimizer, then calls ``_wrap_model``; when that returns a model
other than the one it was given, the Trainer skips ``accelerator.prepare`` for
the model (no DDP) and prepares only the optimizer. This class's
``_wrap_model`` asks accelerate for the model's autocast and placement alone
(``prepare_model(..., evaluation_mode=True)``, no DDP) and returns
``hemiola.wrap``'s model; ``priority`` and ``decoupled`` take over the raw
optimizer's step before the Trainer wraps it in accelerate's. Clipping and
the logged gradient norm go through ``model.clip_grad_norm_``: the stock path
edits ``.grad`` in place, which ``priority`` and ``decoupled`` (whose update
applies the reduced gradient) refuse. ``_wrap_model``, ``_clip_grad_norm``
and ``_get_grad_norm`` are the Trainer's own methods, overridden; they are
not its documented extension points and may change between releases
(written against transformers 5.24 and accelerate 1.15).

Not supported: DeepSpeed and FSDP (they replace DDP too), and several GPUs in
one process (``torch.nn.DataParallel``; use one process per GPU).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import torch
import transformers
from torch import nn

from hemiola.config import Config
from hemiola.data_parallel import DataParallel
from hemiola.distributed import destroy_process_group_if_initialized
from hemiola.streaming import StreamingParallel
from hemiola.wrapping import wrap

__all__ = ["Trainer"]


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose model is wrapped by :func:`hemiola.wrap`.

    Args:
        schedule: ``"wfbp"`` (DDP's behaviour), ``"priority"``,
            ``"decoupled"`` or ``"sharded"``; see :class:`hemiola.Config`.
        hemiola_options: other fields of :class:`hemiola.Config` (they may
            also be passed as keyword arguments, e.g. ``fusion_mb=8``).
        Everything else: as ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, schedule: str = "wfbp",
                 hemiola_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        options = dict(hemiola_options or {})
        for name in [k for k in kwargs if k in Config.__dataclass_fields__]:
            options[name] = kwargs.pop(name)
        Config.from_kwargs(schedule=schedule, **options)  # bad options fail here, not later
        self.hemiola_schedule = schedule
        self.hemiola_options = options
        #: the wrapped model, once train() has wrapped it
        self.hemiola_model: DataParallel | StreamingParallel | None = None
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("hemiola.hf.Trainer replaces DDP; it cannot be combined with "
                             "DeepSpeed or FSDP (use transformers.Trainer for those)")

    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Any = None) -> nn.Module:
        if isinstance(model, (DataParallel, StreamingParallel)):  # a later train() call
            return model
        if not training:
            # evaluate() and predict() run the module itself: exact parameters first.
            if self.hemiola_model is not None:
                self.hemiola_model.synchronize()
            return super()._wrap_model(model, training, dataloader)
        self._refuse_undistributed()
        if self.args.n_gpu > 1:
            raise ValueError("hemiola.hf.Trainer runs one device per process: launch with "
                             "torchrun --nproc-per-node N (not several GPUs in one process)")
        # Autocast (bf16/fp16), torch.compile and device placement, without DDP.
        model = self.accelerator.prepare_model(model, evaluation_mode=True)
        if self.hemiola_schedule == "wfbp":
            wrapped = wrap(model, schedule="wfbp", **self.hemiola_options)
        else:
            if self.optimizer is None:
                raise RuntimeError("hemiola.hf.Trainer: the Trainer built no optimizer before "
                                   "wrapping the model (a transformers version this class "
                                   "does not know?)")
            # The raw torch optimizer: the Trainer wraps it in accelerate's only
            # after this returns, and accelerate's step calls the one taken over.
            # Under streaming the scaler stays accelerate's (each rank skips
            # its own overflowed steps); hemiola counts the skipped ones.
            scaler = self.accelerator.scaler
            wrapped, _ = wrap(model, self.optimizer, schedule=self.hemiola_schedule,
                              grad_scaler=scaler, **self.hemiola_options)
        self.hemiola_model = wrapped
        # accelerate made the process group and leaves it to interpreter exit,
        # where torch's Gloo thread can abort the process: take it down first.
        atexit.register(destroy_process_group_if_initialized)
        return wrapped

    def _refuse_undistributed(self) -> None:
        """Launched as several ranks (torchrun's WORLD_SIZE) while the
        Trainer is not distributed: it would neither split the data nor
        count the other ranks, so each rank would train alone on the whole
        dataset. On a machine without a GPU that is what transformers does
        unless told ``use_cpu=True``."""
        launched = int(os.environ.get("WORLD_SIZE", "1") or "1")
        if launched <= 1 or self.args.world_size == launched:
            return
        hint = ("pass use_cpu=True to TrainingArguments (--use_cpu on the command line): "
                "on a machine without a GPU transformers is not distributed without it"
                if not torch.cuda.is_available() else
                "check TrainingArguments (e.g. use_cpu, or a device setting that keeps the "
                "Trainer from torch.distributed)")
        raise RuntimeError(
            f"hemiola.hf.Trainer: launched as {launched} ranks (WORLD_SIZE={launched}) but "
            f"the Trainer is not distributed (world_size={self.args.world_size}, "
            f"parallel_mode={self.args.parallel_mode.value}): each rank would train alone on "
            f"the whole dataset. {hint[0].upper()}{hint[1:]}.")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.hemiola_schedule == "sharded" and not self.args.should_save:
            # The full optimizer state is gathered from every rank's shard (a
            # collective): the ranks that do not write take part here, the
            # writing one inside the stock method's optimizer.state_dict().
            self.optimizer.state_dict()
        super()._save_optimizer_and_scheduler(output_dir)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        if isinstance(model, DataParallel) and self.hemiola_schedule != "wfbp":
            # The schedule clips the averaged gradient when its update lands.
            return model.clip_grad_norm_(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)  # wfbp: the averaged .grad, as with DDP

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if (grad_norm is None and isinstance(model, DataParallel)
                and self.hemiola_schedule != "wfbp"):
            # The stock path measures with clip_grad_norm_(params, inf), an in-place
            # edit of the local .grad; the schedule's (inf clips nothing) gives the
            # averaged gradient's norm, read when logged.
            return model.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm)

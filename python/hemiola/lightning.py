"""PyTorch Lightning strategy: hemiola's schedules under ``Trainer``.

    import hemiola.lightning
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="hemiola_decoupled")
    trainer = pl.Trainer(strategy=hemiola.lightning.HemiolaStrategy(schedule="priority",
                                                                     compression="fp16"))

:class:`HemiolaStrategy` is Lightning's DDP strategy (same launchers, process
group, ``reduce``/``barrier``/``broadcast``, checkpoints) with the model
wrapped by :func:`hemiola.wrap` instead of ``DistributedDataParallel``.
Importing this module registers ``strategy="hemiola"`` (``wfbp``),
``"hemiola_priority"`` and ``"hemiola_decoupled"``. Needs the
``pytorch-lightning`` package (``pip install 'hemiola[lightning]'``).

What Lightning does on its own keeps working: ``fit``/``validate``/``test``/
``predict``, ``ckpt_path`` resume, ``accumulate_grad_batches`` (through the
wrapped model's ``no_sync``), ``gradient_clip_val`` (norm: clipped through
the schedule, so ``priority`` and ``decoupled`` clip the averaged gradient),
``precision="bf16-mixed"`` and ``"16-mixed"`` (the GradScaler is handed to
the schedule), LR schedulers and ``self.log(..., sync_dist=True)``. Several
optimizers, manual optimization and value clipping work under ``wfbp`` and
are refused, saying why, under the schedules that run the update themselves.
"""

from __future__ import annotations

import atexit
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.overrides.distributed import _sync_module_states
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn

from hemiola.config import SCHEDULES, Config
from hemiola.data_parallel import DataParallel
from hemiola.distributed import destroy_process_group_if_initialized
from hemiola.streaming import StreamingParallel
from hemiola.wrapping import wrap

__all__ = ["HemiolaStrategy"]


class HemiolaStrategy(DDPStrategy):
    """Data-parallel training under Lightning with a hemiola schedule.

    Args:
        schedule: ``"wfbp"`` (DDP's math), ``"priority"``, ``"decoupled"`` or ``"streaming"``
            (see :class:`hemiola.Config`).
        **options: Any other field of :class:`hemiola.Config` (``fusion_mb``,
            ``compression``, ``timeout_s``, ...), checked here, at
            construction. Lightning's own DDP options (``process_group_backend``,
            ``timeout``, ``start_method``, ...) go to :class:`DDPStrategy`.
    """

    strategy_name = "hemiola"

    def __init__(self, schedule: str = "wfbp", *, start_method: str = "popen",
                 process_group_backend: str | None = None, timeout: Any = None,
                 **options: Any) -> None:
        # Bad options fail here, in the launching process, not in every rank.
        Config.from_kwargs(schedule=schedule, **options)
        self._schedule = schedule
        self._options = options
        ddp: dict[str, Any] = {"start_method": start_method,
                               "process_group_backend": process_group_backend}
        if timeout is not None:
            ddp["timeout"] = timeout
        super().__init__(**ddp)

    @property
    def schedule(self) -> str:
        return self._schedule

    # ---- setup -------------------------------------------------------------

    def setup_distributed(self) -> None:
        super().setup_distributed()
        # Lightning leaves the process group to the interpreter's exit, where
        # torch's Gloo thread can abort the process ("terminate called without
        # an active exception"); take it down first, as hemiola.init does.
        atexit.register(destroy_process_group_if_initialized)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            # The optimizers first: priority and decoupled take over their step.
            self.setup_optimizers(trainer)
            self._wrap_for_fitting()
        else:
            # No gradients: rank 0's parameters and buffers, as DDP's strategy does.
            _sync_module_states(self.model)
        self.setup_precision_plugin()

    def _wrap_for_fitting(self) -> None:
        module = self.lightning_module
        assert module is not None
        # priority and decoupled take over optimizer.step(); streaming only
        # watches it (the inner step is the optimizer's own, and Lightning's
        # clipping and loss scaling stay right as they are).
        deferred = self._schedule in ("priority", "decoupled")
        needs_optimizer = self._schedule != "wfbp"
        if deferred and not module.automatic_optimization:
            raise ValueError(
                f"HemiolaStrategy(schedule={self._schedule!r}) runs optimizer.step() itself, "
                "which manual optimization cannot hand over; use schedule='wfbp' (DDP's math) "
                "or automatic optimization")
        if needs_optimizer and len(self.optimizers) != 1:
            raise ValueError(
                f"HemiolaStrategy(schedule={self._schedule!r}) steps one optimizer (it got "
                f"{len(self.optimizers)}); with several, use schedule='wfbp'")
        scaler = getattr(self.precision_plugin, "scaler", None) if deferred else None
        optimizer = self.optimizers[0] if needs_optimizer else None
        wrapped, _ = wrap(module, optimizer, self._schedule, grad_scaler=scaler,
                          **self._options)
        self.model = wrapped
        if deferred:
            self._clip_through(wrapped)

    def _clip_through(self, wrapped: DataParallel) -> None:
        """Lightning clips with torch.nn.utils.clip_grad_norm_ on .grad (and
        refuses to when the optimizer's step unscales itself, as a taken-over
        step declares); under priority and decoupled the schedule must see the
        call to clip what it applies. Under wfbp Lightning's own clipping is
        right as it is (the averaged .grad), so this is not installed."""
        schedule = self._schedule

        def clip_gradients(optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
                           gradient_clip_algorithm: Any = None) -> None:
            if not clip_val or clip_val <= 0:
                return
            if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)) == "value":
                raise ValueError(
                    f"gradient_clip_algorithm='value' edits each rank's .grad, which "
                    f"schedule={schedule!r} does not apply (it applies the averaged gradient); "
                    "clip by norm (the default) or use schedule='wfbp'")
            wrapped.clip_grad_norm_(float(clip_val))

        self.precision_plugin.clip_gradients = clip_gradients  # type: ignore[method-assign]

    # ---- what DDPStrategy does with a DistributedDataParallel ---------------

    def configure_ddp(self) -> None:
        raise RuntimeError("HemiolaStrategy wraps the model with hemiola.wrap, not DDP")

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: the wrapped model's ``no_sync``."""
        if isinstance(self.model, (DataParallel, StreamingParallel)):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state with every pending update landed (exact)."""
        if isinstance(self.model, (DataParallel, StreamingParallel)):
            self.model.synchronize()
        return super().lightning_module_state_dict()

    def teardown(self) -> None:
        if isinstance(self.model, (DataParallel, StreamingParallel)):
            self.model.synchronize()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for schedule in SCHEDULES:
            name = "hemiola" if schedule == "wfbp" else f"hemiola_{schedule}"
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"hemiola's {schedule!r} schedule (hemiola.lightning)",
                    schedule=schedule)


HemiolaStrategy.register_strategies(StrategyRegistry)

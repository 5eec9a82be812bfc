"""``hemiola.wrap``: the one call users make."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from hemiola.config import Config
from hemiola.data_parallel import DataParallel
from hemiola.distributed import new_engine

OptimizerT = TypeVar("OptimizerT")


def wrap(
    model: nn.Module, optimizer: OptimizerT, schedule: str = "wfbp", **options: Any
) -> tuple[DataParallel, OptimizerT]:
    """Makes `model` data-parallel across the ranks of the default process group.

    Call it on every rank with the same model. ``torch.distributed`` is
    initialised from torchrun's environment if needed (see :func:`hemiola.init`).

    Args:
        model: Any ``nn.Module`` on the CPU or on one GPU (one GPU per rank
            with NCCL; ``gpu_backend='gloo'`` lets ranks share one).
        optimizer: The optimizer over ``model``'s parameters; returned as is
            for ``schedule="wfbp"``; for ``"priority"`` and ``"decoupled"`` its
            ``step``, ``state_dict`` and ``load_state_dict`` are taken over
            (same object). Clip with ``wrapped_model.clip_grad_norm_``.
        schedule: See :class:`hemiola.Config`.
        **options: Any other field of :class:`hemiola.Config` (``fusion_mb``,
            ``first_bucket_mb``, ``timeout_s``, ``find_unused_parameters``, ...).

    Returns:
        ``(wrapped_model, optimizer)``. Train as usual: forward, ``loss.backward()``,
        ``optimizer.step()`` (under ``wfbp`` gradients come back averaged; the
        other schedules apply the averaged gradient in their own time).
    """
    config = Config.from_kwargs(schedule=schedule, **options)
    engine, store = new_engine(config.timeout_s, timeline=config.timeline,
                               gpu_backend=config.gpu_backend)
    wrapped = DataParallel(model, config, engine, store)
    return wrapped, wrapped._schedule.wrap_optimizer(optimizer)

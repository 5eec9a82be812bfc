"""``hemiola.wrap``: the one call users make."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist
from torch import nn

from hemiola.config import Config
from hemiola.data_parallel import WRAPPED_MARK, DataParallel
from hemiola.distributed import init, new_engine, new_subgroup_engines
from hemiola.elastic.replica import ElasticReplica, group_name
from hemiola.replica_groups import replica_ranks
from hemiola.streaming import StreamingParallel
from hemiola.threads import fit_threads

OptimizerT = TypeVar("OptimizerT")


class _NoOptimizer:
    """The default of wrap's `optimizer`: not passed at all (the DDP habit)."""

    def __repr__(self) -> str:
        return "<no optimizer>"


_NO_OPTIMIZER: Any = _NoOptimizer()


@overload
def wrap(model: nn.Module, *, schedule: str = "wfbp",
         grad_scaler: torch.amp.GradScaler | None = None, **options: Any) -> DataParallel: ...


@overload
def wrap(model: nn.Module, optimizer: OptimizerT, schedule: str = "wfbp",
         grad_scaler: torch.amp.GradScaler | None = None,
         **options: Any) -> tuple[DataParallel, OptimizerT]: ...


def wrap(
    model: nn.Module, optimizer: Any = _NO_OPTIMIZER, schedule: str = "wfbp",
    grad_scaler: torch.amp.GradScaler | None = None, **options: Any
) -> Any:
    """Makes `model` data-parallel across the ranks of the default process group.

    Call it on every rank with the same model. ``torch.distributed`` is
    initialised from torchrun's environment if needed (see :func:`hemiola.init`).

    Args:
        model: Any ``nn.Module`` on the CPU or on one GPU (one GPU per rank
            with NCCL; ``gpu_backend='gloo'`` lets ranks share one).
        optimizer: The optimizer over ``model``'s parameters; returned as is
            for ``schedule="wfbp"``; for ``"priority"`` and ``"decoupled"`` its
            ``step``, ``state_dict`` and ``load_state_dict`` are taken over
            (same object), and it must hold every trainable parameter (one
            that lacks some is refused, naming them: use a param group per
            part). Clip with ``wrapped_model.clip_grad_norm_``.
        schedule: See :class:`hemiola.Config`.
        grad_scaler: The ``torch.amp.GradScaler`` that scales this model's
            loss, if any. Needed by ``"priority"`` and ``"decoupled"``
            (``wfbp`` works without it, like DDP): each rank reduces its
            gradients unscaled, and a step is skipped on every rank when any
            rank overflowed. ``scaler.step(optimizer)`` without it raises.
            Under ``"streaming"`` each rank keeps its own scaler and skips
            its own overflowed steps; pass it so that a skipped step is
            still counted (else the rank that skipped ends a sync behind).
        **options: Any other field of :class:`hemiola.Config` (``fusion_mb``,
            ``first_bucket_mb``, ``timeout_s``, ``find_unused_parameters``, ...).

    Returns:
        ``(wrapped_model, optimizer)``. Train as usual: forward, ``loss.backward()``,
        ``optimizer.step()`` (under ``wfbp`` gradients come back averaged in
        ``.grad``, as with DDP; the other schedules apply the averaged
        gradient in their own time, inside the engine, and **``.grad`` keeps
        this rank's own gradient**: log the averaged gradient's norm from what
        ``wrapped_model.clip_grad_norm_`` returns (``float("inf")`` clips
        nothing), and step once per backward: a second ``optimizer.step()``
        from the same ``.grad`` is refused, since the ranks would differ).
        Without an optimizer argument (``model = hemiola.wrap(model)``, as
        with DDP) only the wrapped model, for ``wfbp``: the other schedules
        run the update themselves and refuse, saying what to pass.
    """
    config = Config.from_kwargs(schedule=schedule, **options)
    model_only = optimizer is _NO_OPTIMIZER
    if model_only:
        if config.schedule != "wfbp":
            raise TypeError(
                f"schedule={config.schedule!r} {_STEPS_ITSELF[config.schedule]}, so it "
                "needs your optimizer: model, optimizer = hemiola.wrap(model, optimizer, "
                f"schedule={config.schedule!r}) (build the optimizer over model.parameters() "
                "first). schedule='wfbp' wraps without one: model = hemiola.wrap(model)")
        optimizer = None
    _refuse_double_wrapping(model, optimizer)
    wrapped: DataParallel | StreamingParallel
    if config.schedule == "streaming":
        wrapped = _streaming(model, optimizer, config, grad_scaler)
    else:
        engine, store = new_engine(config.timeout_s, timeline=config.timeline,
                                   gpu_backend=config.gpu_backend)
        fit_threads(engine)
        wrapped = DataParallel(model, config, engine, store, grad_scaler, optimizer)
        optimizer = wrapped._schedule.wrap_optimizer(optimizer)
    # Plain attributes, outside nn.Module's registries (no state_dict entry).
    object.__setattr__(model, WRAPPED_MARK, True)
    if optimizer is not None:
        object.__setattr__(optimizer, WRAPPED_MARK, True)
    return wrapped if model_only else (wrapped, optimizer)


def _streaming(model: nn.Module, optimizer: Any, config: Config,
               grad_scaler: torch.amp.GradScaler | None) -> StreamingParallel:
    """``schedule="streaming"``: every rank a replica, or replica groups of
    ``config.replica_ranks`` ranks (hemiola.replica_groups)."""
    init(config.timeout_s)
    if config.coordinator is not None:
        return _elastic_streaming(model, optimizer, config, grad_scaler)
    ranks = replica_ranks(config.replica_ranks, dist.get_world_size())
    config = dataclasses.replace(config, replica_ranks=ranks)
    engine_options = {"timeline": config.timeline, "gpu_backend": config.gpu_backend}
    if ranks == 1:
        engine, store = new_engine(config.timeout_s, **engine_options)
        fit_threads(engine)
        return StreamingParallel(model, config, engine, store, optimizer,
                                 grad_scaler=grad_scaler)
    group, group_store, across, store = new_subgroup_engines(ranks, config.timeout_s,
                                                             **engine_options)
    fit_threads(group)
    return StreamingParallel(model, config, across, store, optimizer,
                             group=(group, group_store), grad_scaler=grad_scaler)


def _elastic_streaming(model: nn.Module, optimizer: Any, config: Config,
                       grad_scaler: torch.amp.GradScaler | None) -> StreamingParallel:
    """``streaming`` with ``coordinator``: this launch (one process, or the
    ranks of one ``torchrun``) is one replica group of an elastic run
    (hemiola.elastic)."""
    places, place = dist.get_world_size(), dist.get_rank()
    if config.replica_ranks not in (None, places):
        raise ValueError(f"coordinator= makes each launch one replica: its {places} rank(s) "
                         f"are the replica group, so replica_ranks={config.replica_ranks} does "
                         "not apply (leave it out); start one launch per replica")
    config = dataclasses.replace(config, replica_ranks=places)
    name = [group_name(config)]
    if places > 1:
        dist.broadcast_object_list(name, src=0)  # the launch's rank 0 names it
    replica = ElasticReplica(config, name[0], place, places)
    engine_options = {"timeline": config.timeline, "gpu_backend": config.gpu_backend}
    group = None
    if places > 1:
        group = new_engine(config.timeout_s, **engine_options)  # the launch's ranks
        fit_threads(group[0])
    elif not replica.joining:  # a collective: the members of a running run are not in it
        fit_threads(replica.engine)
    return StreamingParallel(model, config, replica.engine, replica.store, optimizer,
                             group=group, elastic=replica, grad_scaler=grad_scaler)


#: Why a schedule other than wfbp cannot wrap without the optimizer.
_STEPS_ITSELF = {
    "priority": "applies the averaged gradients itself (each layer's update as it arrives)",
    "decoupled": "applies the averaged gradients itself (an approximate step, then the exact one)",
    "sharded": ("steps each rank's shard of the parameters with your optimizer (its state "
                "exists for the shard only)"),
    "streaming": ("takes your optimizer's inner steps and averages the parameters' progress "
                  "every sync_every steps"),
}


def _refuse_double_wrapping(model: nn.Module, optimizer: object) -> None:
    """Wrapping twice would reduce every gradient twice (or take the
    optimizer's step over twice): refuse it, naming what to pass instead."""
    if isinstance(model, (DataParallel, StreamingParallel)):
        raise ValueError(
            "this model is already wrapped by hemiola.wrap; use it as it is (wrap once; "
            "to change options, wrap the original module, model.module, in a new process)"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "this model is wrapped by torch DistributedDataParallel; pass the module itself "
            "(ddp_model.module) to hemiola.wrap instead of wrapping twice"
        )
    for name, sub in model.named_modules():
        if isinstance(sub, (DataParallel, nn.parallel.DistributedDataParallel)) or getattr(
                sub, WRAPPED_MARK, False):
            where = f"its submodule {name!r}" if name else "it"
            raise ValueError(
                f"{where} is already wrapped by hemiola.wrap (or DDP): each parameter may be "
                "reduced by one wrapper only; wrap the outermost module once"
            )
    if getattr(optimizer, WRAPPED_MARK, False):
        raise ValueError(
            "this optimizer was already passed to hemiola.wrap; build a new optimizer for "
            "another wrapped model"
        )

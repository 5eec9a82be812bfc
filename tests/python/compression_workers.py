"""Rank functions of tests/python/test_compression.py (see hemiola.launch.run_local)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import hemiola

from models import make_model
from workers import _optimizer, _train, schedule_run


def fp16_vs_ddp_hook(rank: int, world: int, model_name: str, via_hook: bool,
                     steps: int = 6) -> dict[str, Any]:
    """torch DDP + fp16_compress_hook against hemiola wfbp with compression
    'fp16' (given to wrap, or through register_comm_hook), same data."""
    hemiola.init()
    torch.manual_seed(0)
    ref = make_model(model_name)
    ddp = nn.parallel.DistributedDataParallel(ref)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    ddp_losses = _train(ddp, _optimizer("sgd", ddp.parameters()), model_name, rank, world,
                        range(steps))
    torch.manual_seed(0)
    mine = make_model(model_name)
    options: dict[str, Any] = {} if via_hook else {"compression": "fp16"}
    model, opt = hemiola.wrap(mine, _optimizer("sgd", mine.parameters()), timeout_s=60,
                              **options)
    if via_hook:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    losses = _train(model, opt, model_name, rank, world, range(steps))
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), mine.parameters()))
    scale = max(a.abs().max().item() for a in ref.parameters())
    return {"max_diff": diff, "scale": scale, "ddp": ddp_losses, "hemiola": losses,
            "compression": model.config.compression}


def compressed_run(rank: int, world: int, schedule: str, compression: str | None,
                   model_name: str, opt_name: str, steps: int) -> dict[str, Any]:
    """schedule_run with one compression and the same plan for every schedule
    (one bucket cap, no partitions), each rank on its own data."""
    return schedule_run(rank, world, schedule, model_name, opt_name, steps, False,
                        compression=compression, partition_mb=0.0, powersgd_start_iter=2)


def int8_resume(rank: int, world: int, schedule: str, steps: int, cut: int,
                options: dict[str, Any]) -> dict[str, Any]:
    """int8 compression (or `options["compression"]`): `steps` steps
    straight, against `cut` steps, a checkpoint (model, optimizer and comm
    state), a fresh wrap that loads it, and the rest. Returns how far the
    resumed runs end from the straight one."""
    hemiola.init()

    def fresh(saved: dict[str, Any] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        # A resume loads into the plain model and optimizer before wrapping,
        # as DDP scripts do; the comm state goes into the wrapped model.
        torch.manual_seed(0)
        m = make_model("mlp")
        o = _optimizer("sgd", m.parameters())
        if saved is not None:
            m.load_state_dict(saved["model"])
            o.load_state_dict(copy.deepcopy(saved["optimizer"]))
        return hemiola.wrap(m, o, schedule=schedule,
                            **{"compression": "int8", "fusion_mb": 1 / 64, "timeout_s": 60,
                               **options})

    model, opt = fresh()
    _train(model, opt, "mlp", rank, world, range(steps))
    model.synchronize()
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt = fresh()
    _train(model, opt, "mlp", rank, world, range(cut))
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": copy.deepcopy(opt.state_dict()), "comm": model.comm_state_dict()}
    residual_norm = sum(v.norm().item() for v in saved["comm"].values())
    model, opt = fresh(saved)
    model.load_comm_state_dict(saved["comm"])
    _train(model, opt, "mlp", rank, world, range(cut, steps))
    model.synchronize()
    resumed = [p.detach().clone() for p in model.parameters()]
    # Without the comm state the resumed run differs (so the check above can fail).
    model, opt = fresh(saved)
    _train(model, opt, "mlp", rank, world, range(cut, steps))
    model.synchronize()
    forgetful = [p.detach().clone() for p in model.parameters()]
    return {
        "resumed_diff": max((a - b).abs().max().item() for a, b in zip(straight, resumed)),
        "forgetful_diff": max((a - b).abs().max().item() for a, b in zip(straight, forgetful)),
        "residual_norm": residual_norm, "keys": sorted(saved["comm"]),
    }


def comm_hook_errors(rank: int, world: int) -> dict[str, str]:
    """What register_comm_hook says to hooks it cannot honour."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    hemiola.init()
    out = {}
    m = make_model("mlp")
    model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), timeout_s=60)
    for name, state, hook in [
        ("custom", None, lambda state, bucket: bucket.buffer()),
        ("batched", powersgd.PowerSGDState(None), powersgd.batched_powerSGD_hook),
        ("no-feedback", powersgd.PowerSGDState(None, use_error_feedback=False,
                                               warm_start=False), powersgd.powerSGD_hook),
        ("wrapped-fp16-hook", None,
         default_hooks.bf16_compress_wrapper(default_hooks.fp16_compress_hook)),
    ]:
        try:
            model.register_comm_hook(state, hook)
            out[name] = "accepted"
        except NotImplementedError as e:
            out[name] = str(e)
    for name, hook in [("fp16-wrapper", default_hooks.fp16_compress_wrapper),
                       ("bf16-wrapper", default_hooks.bf16_compress_wrapper)]:
        model.register_comm_hook(None, hook(default_hooks.allreduce_hook))
        out[name] = str(model.config.compression)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    out["allreduce"] = str(model.config.compression)
    state = powersgd.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=7)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    out["powersgd"] = (f"{model.config.compression} {model.config.powersgd_rank} "
                       f"{model.config.powersgd_start_iter}")
    _train(model, opt, "mlp", rank, world, range(1))
    try:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        out["late"] = "accepted"
    except RuntimeError as e:
        out["late"] = str(e)
    return out


def powersgd_vs_ddp_hook(rank: int, world: int, steps: int = 12) -> dict[str, Any]:
    """torch DDP + powerSGD_hook against hemiola wfbp through the same
    register_comm_hook call (rank 2, compressed from iteration 2)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    hemiola.init()
    losses = {}
    for kind in ("ddp", "hemiola"):
        torch.manual_seed(0)
        m = make_model("mlp")
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        if kind == "ddp":  # one bucket: torch's PowerSGD over Gloo races between two
            model = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=1000)
            opt = _optimizer("sgd", model.parameters())
        else:
            model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), timeout_s=60)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        losses[kind] = _train(model, opt, "mlp", rank, world, range(steps))
    plain = []
    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), timeout_s=60)
    plain = _train(model, opt, "mlp", rank, world, range(steps))
    return {**losses, "plain": plain}


def mismatched_hooks(rank: int, world: int) -> str:
    """Rank 0 registers fp16, the others bf16."""
    hemiola.init()
    m = make_model("mlp")
    model, _ = hemiola.wrap(m, _optimizer("sgd", m.parameters()), timeout_s=60)
    hook = default_hooks.fp16_compress_hook if rank == 0 else default_hooks.bf16_compress_hook
    try:
        model.register_comm_hook(None, hook)
    except RuntimeError as e:
        return str(e)
    return "accepted"


class WideMLP(nn.Module):
    """An MLP whose middle matrix (1100 x 1000) is above priority's 4 MiB
    partition (make_batch("mlp") data)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 1000), nn.ReLU(), nn.Linear(1000, 1100),
                                 nn.ReLU(), nn.Linear(1100, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def powersgd_hooks_under_every_schedule(rank: int, world: int, steps: int = 4
                                        ) -> dict[str, Any]:
    """PowerSGD from the hooks a DDP script registers, powerSGD_hook and
    fp16_compress_wrapper(powerSGD_hook), against compression='powersgd'
    given to wrap: the parameters of each run, and the warnings raised."""
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    hemiola.init()
    runs: dict[str, Any] = {}
    for name, schedule, hook in [
        ("wrap", "priority", None), ("priority-hook", "priority", powersgd.powerSGD_hook),
        ("priority-fp16-wrapper", "priority",
         default_hooks.fp16_compress_wrapper(powersgd.powerSGD_hook)),
        ("wfbp-hook", "wfbp", powersgd.powerSGD_hook),
        ("decoupled-fp16-wrapper", "decoupled",
         default_hooks.fp16_compress_wrapper(powersgd.powerSGD_hook)),
    ]:
        torch.manual_seed(0)
        m = WideMLP()
        options: dict[str, Any] = {"compression": "powersgd", "powersgd_rank": 2,
                                   "powersgd_start_iter": 2} if hook is None else {}
        model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule=schedule,
                                  timeout_s=60, **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if hook is not None:
                model.register_comm_hook(powersgd.PowerSGDState(
                    None, matrix_approximation_rank=2, start_powerSGD_iter=2), hook)
        _train(model, opt, "mlp", rank, world, range(steps))
        model.synchronize()
        runs[name] = {"params": [p.detach().clone() for p in m.parameters()],
                      "compression": model.config.compression,
                      "buckets": model.buckets(),
                      "warnings": [str(w.message) for w in caught]}
    torch.manual_seed(0)
    m = WideMLP()
    model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule="wfbp",
                              timeout_s=60)
    _train(model, opt, "mlp", rank, world, range(steps))
    runs["uncompressed"] = {"params": [p.detach().clone() for p in m.parameters()]}
    return runs

"""Rank functions of tests/python/test_sharded.py (run by hemiola.launch's
run_local: one process per rank, real Gloo over loopback)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import hemiola

from models import loss_of, make_batch, make_model
from workers import _optimizer, schedule_run


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def sharded_matches_wfbp(rank: int, world: int, model_name: str, opt_name: str, steps: int,
                         clip: float | None = None,
                         compression: str | None = None) -> dict[str, float]:
    """Different data per rank: sharded is exact, so it must follow wfbp
    (with the same `compression`). The largest parameter and loss
    differences, and how far training (and clipping, with `clip`) moved the
    parameters."""
    a = schedule_run(rank, world, "wfbp", model_name, opt_name, steps, False, clip,
                     compression=compression)
    b = schedule_run(rank, world, "sharded", model_name, opt_name, steps, False, clip,
                     compression=compression)
    start = schedule_run(rank, world, "wfbp", model_name, opt_name, 0, False)
    out = {"params": max_diff(a["params"], b["params"]),
           "losses": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
           "moved": max_diff(a["params"], start["params"])}
    if compression is not None:
        plain = schedule_run(rank, world, "wfbp", model_name, opt_name, steps, False)
        out["compression_moved"] = max_diff(a["params"], plain["params"])
    if clip is not None:
        unclipped = schedule_run(rank, world, "wfbp", model_name, opt_name, steps, False)
        out["clipping_moved"] = max_diff(a["params"], unclipped["params"])
    return out


def state_is_sharded(rank: int, world: int) -> dict[str, Any]:
    """AdamW on the transformer: after each backward no parameter holds a
    .grad; after the steps, the elements of optimizer state this rank holds,
    the model's, and the averaged gradients against wfbp's .grad."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("transformer")
    model, opt = hemiola.wrap(m, _optimizer("adamw", m.parameters()), schedule="sharded",
                              fusion_mb=1 / 16, timeout_s=60)
    grads_left = 0
    for step in range(3):
        x, y = make_batch("transformer", step, rank, world)
        opt.zero_grad()
        loss_of("transformer", model(x), y).backward()
        grads_left += sum(p.grad is not None for p in m.parameters())
        averaged = model.averaged_gradients()
        opt.step()
    per_element = sum(v.numel() for entry in opt.state.values() for v in entry.values()
                      if isinstance(v, torch.Tensor) and v.dim() == 1)
    # wfbp's averaged .grad of the same fourth... the same third backward
    torch.manual_seed(0)
    r = make_model("transformer")
    ref, ref_opt = hemiola.wrap(r, _optimizer("adamw", r.parameters()), schedule="wfbp",
                                fusion_mb=1 / 16, timeout_s=60)
    for step in range(3):
        x, y = make_batch("transformer", step, rank, world)
        ref_opt.zero_grad()
        loss_of("transformer", ref(x), y).backward()
        if step < 2:
            ref_opt.step()
    diff = max((averaged[n] - p.grad).abs().max().item() for n, p in r.named_parameters())
    return {"grads_left": grads_left, "state_elements": per_element,
            "model_elements": sum(p.numel() for p in m.parameters()),
            "shard_elements": model.stats()["shard_elements"], "averaged_vs_wfbp": diff}


def resumed(rank: int, world: int, how: str, compression: str | None = None) -> dict[str, Any]:
    """AdamW on the transformer, 3 steps, a checkpoint (`how`: "full", every
    rank's optimizer.state_dict(), rank 0's loaded by all; "shard", each
    rank's shard_state_dict()), 3 more steps; then a fresh wrap loads the
    checkpoint before its first step and takes the same 3 steps. Both ends,
    and the full state against wfbp's optimizer state at the checkpoint.
    `compression` (sharded only): int8's residuals travel in the shard."""
    hemiola.init()

    def wrapped(schedule: str = "sharded") -> tuple[nn.Module, nn.Module, Any]:
        torch.manual_seed(0)
        m = make_model("transformer")
        model, opt = hemiola.wrap(m, _optimizer("adamw", m.parameters()), schedule=schedule,
                                  fusion_mb=1 / 16, timeout_s=60,
                                  compression=compression if schedule == "sharded" else None)
        return m, model, opt

    def train(model: nn.Module, opt: Any, steps: range) -> None:
        for step in steps:
            x, y = make_batch("transformer", step, rank, world)
            opt.zero_grad()
            loss_of("transformer", model(x), y).backward()
            opt.step()

    m, model, opt = wrapped()
    train(model, opt, range(3))
    full = opt.state_dict()  # every rank: a collective
    # (a state_dict holds references to the live state, as torch's does: a
    # checkpoint in memory is a deep copy, as one written to a file is)
    saved = copy.deepcopy({"model": model.state_dict(),
                           "optimizer": full if how == "full" else opt.shard_state_dict()})
    train(model, opt, range(3, 6))
    model.synchronize()
    straight = [p.detach().clone() for p in m.parameters()]

    # wfbp's state at the checkpoint, for the full state's values
    w, wmodel, wopt = wrapped("wfbp")
    train(wmodel, wopt, range(3))
    reference = wopt.state_dict()
    state_diff = max(
        (full["state"][k][key] - v).abs().max().item()
        for k, entry in reference["state"].items() for key, v in entry.items())

    m2, model2, opt2 = wrapped()
    model2.load_state_dict(saved["model"])
    if how == "full":
        opt2.load_state_dict(saved["optimizer"])
    else:
        opt2.load_shard_state_dict(saved["optimizer"])
    train(model2, opt2, range(3, 6))
    model2.synchronize()
    again = [p.detach().clone() for p in m2.parameters()]
    return {"resume_diff": max_diff(straight, again), "state_vs_wfbp": state_diff,
            "full_keys": sorted(full["state"][0]), "states": len(full["state"]),
            "params": len(straight), "moved": max_diff(straight, [
                v for k, v in saved["model"].items() if k in dict(m.named_parameters())])}


def coded_gradients(rank: int, world: int, compression: str) -> dict[str, Any]:
    """The transformer under sharded with `compression` (int8/int4) beside
    wfbp in float32, AdamW, 4 steps: the first step's averaged gradients
    against the exact average (one coding of each rank's gradient apart),
    the residuals, and how far the parameters end apart."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("transformer")
    x, y = make_batch("transformer", 0, rank, world)
    loss_of("transformer", m(x), y).backward()  # this rank's own first gradient
    local = max(p.grad.abs().max().item() for p in m.parameters())
    runs = {}
    for schedule, coding in (("sharded", compression), ("wfbp", None)):
        torch.manual_seed(0)
        m = make_model("transformer")
        model, opt = hemiola.wrap(m, _optimizer("adamw", m.parameters()), schedule=schedule,
                                  fusion_mb=1 / 64, first_bucket_mb=1 / 64, timeout_s=60,
                                  compression=coding)
        first = None
        for step in range(4):
            x, y = make_batch("transformer", step, rank, world)
            opt.zero_grad()
            loss_of("transformer", model(x), y).backward()
            if step == 0:
                first = model.averaged_gradients() if schedule == "sharded" else {
                    n: p.grad.clone() for n, p in m.named_parameters()}
            opt.step()
        model.synchronize()
        runs[schedule] = (first, [p.detach().clone() for p in m.parameters()], model)
    coded, exact = runs["sharded"][0], runs["wfbp"][0]
    residuals = runs["sharded"][2]._schedule.residuals()
    return {"error": max((coded[n] - g).abs().max().item() for n, g in exact.items()),
            "largest": max(g.abs().max().item() for g in exact.values()), "local": local,
            "residual_buckets": len(residuals),
            "residual_max": max(r.abs().max().item() for r in residuals.values()),
            "params_apart": max_diff(runs["sharded"][1], runs["wfbp"][1])}


def residuals_after(rank: int, world: int) -> dict[str, Any]:
    """int8 under a GradScaler: how many buckets owe a residual after a good
    step, after a step skipped for an overflow on rank 1 alone, after the
    next good step, and after a full optimizer state is loaded."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule="sharded",
                              compression="int8", grad_scaler=scaler, fusion_mb=1 / 64,
                              first_bucket_mb=1 / 64, timeout_s=60)
    counts = []
    for step in range(3):
        x, y = make_batch("mlp", step, rank, world)
        opt.zero_grad()
        loss = loss_of("mlp", model(x), y)
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        counts.append(len(model._schedule.residuals()))
    full = opt.state_dict()
    opt.load_state_dict(full)
    counts.append(len(model._schedule.residuals()))
    return {"counts": counts, "scale": scaler.get_scale()}


def _one_step(rank: int, world: int, timeout_s: float) -> tuple[nn.Module, Any]:
    """The test MLP wrapped under sharded (SGD), after one step."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule="sharded",
                              timeout_s=timeout_s)
    x, y = make_batch("mlp", 0, rank, world)
    loss_of("mlp", model(x), y).backward()
    opt.step()
    return model, opt


def shard_loaded_elsewhere(rank: int, world: int) -> str:
    """A shard saved by rank 0 loaded on every rank: refused on the others."""
    model, opt = _one_step(rank, world, timeout_s=60)
    shard = opt.shard_state_dict()
    shard["hemiola_shard"]["rank"] = 0
    try:
        opt.load_shard_state_dict(shard)
    except ValueError as e:
        return str(e)
    return "loaded"


def no_sync_then_step(rank: int, world: int, schedule: str) -> list[torch.Tensor]:
    """Two micro-batches inside no_sync and one synchronised, then the step,
    for 3 steps."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule=schedule,
                              fusion_mb=1 / 64, timeout_s=60)
    for step in range(3):
        opt.zero_grad()
        for micro in range(3):
            x, y = make_batch("mlp", 3 * step + micro, rank, world)
            loss = loss_of("mlp", model(x), y) / 3
            if micro < 2:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    model.synchronize()
    return [p.detach().clone() for p in m.parameters()]


def refusal(rank: int, world: int, case: str) -> str:
    """What a misuse under sharded raises (the message), or "no error"."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    try:
        if case == "optimizer":
            hemiola.wrap(m, torch.optim.Adafactor(m.parameters()), schedule="sharded",
                         timeout_s=30)
        elif case == "scaler":  # a GradScaler given, its step bypassed
            scaler = torch.amp.GradScaler("cpu")
            model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule="sharded",
                                      grad_scaler=scaler, timeout_s=30)
            x, y = make_batch("mlp", 0, rank, world)
            scaler.scale(loss_of("mlp", model(x), y)).backward()
            opt.step()
        elif case == "step without backward":
            model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule="sharded",
                                      timeout_s=30)
            opt.step()
        elif case == "powersgd":
            hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule="sharded",
                         compression="powersgd", timeout_s=30)
        elif case == "non-contiguous":
            m.net[0].weight = nn.Parameter(m.net[0].weight.detach().t().contiguous().t())
            hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule="sharded",
                         timeout_s=30)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def state_dict_on_rank_0_only(rank: int, world: int) -> str:
    """DDP's habit, ``if rank == 0: torch.save(optimizer.state_dict())``:
    under sharded the full state is a collective, so rank 0 alone is told so
    (within timeout_s here, at most 30 s)."""
    model, opt = _one_step(rank, world, timeout_s=5)
    if rank != 0:
        return "not called"
    try:
        opt.state_dict()
    except RuntimeError as e:
        return str(e)
    return "no error"

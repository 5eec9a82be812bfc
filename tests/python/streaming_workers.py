"""Rank functions for tests/python/test_streaming.py: the streaming schedule
against DiLoCo written out in plain torch (torchft's algorithm: the outer
gradient is the last synchronised parameters minus the local ones, averaged
with torch.distributed, stepped by torch's SGD with Nesterov momentum)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import hemiola

from models import loss_of, make_batch, make_model, make_optimizer


def _inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, name: str, step: int,
                rank: int, world: int, device: str = "cpu") -> float:
    x, y = (t.to(device) for t in make_batch(name, step, rank, world))
    opt.zero_grad()
    loss = loss_of(name, model(x), y)
    loss.backward()
    opt.step()
    return float(loss)


def _diloco_reference(rank: int, world: int, name: str, opt_name: str, steps: int,
                      sync_every: int, mix: float | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = make_model(name)
    opt = make_optimizer(opt_name, model.parameters())
    shared = copy.deepcopy(model)
    outer = torch.optim.SGD(shared.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for step in range(1, steps + 1):
        _inner_step(model, opt, name, step, rank, world)
        if step % sync_every == 0:
            with torch.no_grad():
                for s, p in zip(shared.parameters(), model.parameters()):
                    s.grad = s - p
                    dist.all_reduce(s.grad)
                    s.grad /= world
                outer.step()
                for s, p in zip(shared.parameters(), model.parameters()):
                    # Streaming DiLoCo's mix as torchft merges: the shared
                    # copy lerped toward the local parameters.
                    p.copy_(s if mix is None else s.detach().lerp(p, mix))
    return [p.detach().clone() for p in model.parameters()]


def equals_diloco(rank: int, world: int, name: str, opt_name: str, steps: int,
                  sync_every: int, mix: float | None = None) -> dict[str, Any]:
    hemiola.init()
    reference = _diloco_reference(rank, world, name, opt_name, steps, sync_every, mix)
    torch.manual_seed(0)
    model = make_model(name)
    opt = make_optimizer(opt_name, model.parameters())
    model, opt = hemiola.wrap(model, opt, schedule="streaming", sync_every=sync_every, mix=mix,
                              fragments=1, overlap=0,  # blocking, with DiLoCo's outer step
                              outer_lr=0.7, outer_momentum=0.9)
    for step in range(1, steps + 1):
        _inner_step(model, opt, name, step, rank, world)
    ours = [p.detach().clone() for p in model.parameters()]
    gathered = [torch.cat([p.flatten() for p in ours]) for _ in range(world)]
    dist.all_gather(gathered, torch.cat([p.flatten() for p in ours]))
    return {
        "max_diff": max(float((a - b).abs().max()) for a, b in zip(ours, reference)),
        "rank_spread": max(float((g - gathered[0]).abs().max()) for g in gathered),
        "stats": model.stats(),
    }


def _run(name: str, rank: int, world: int, options: dict[str, Any], steps: range,
         model: torch.nn.Module | None = None, opt: torch.optim.Optimizer | None = None,
         ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if model is None:
        torch.manual_seed(0)
        base = make_model(name)
        model, opt = hemiola.wrap(base, make_optimizer("adamw", base.parameters()),
                                  schedule="streaming", **options)
    assert opt is not None
    for step in steps:
        _inner_step(model, opt, name, step, rank, world)
    return model, opt


def resume_repeats_the_run(rank: int, world: int, options: dict[str, Any], stop: int,
                           steps: int, tmp: str) -> dict[str, Any]:
    hemiola.init()
    name = "mlp"
    whole, _ = _run(name, rank, world, options, range(1, steps + 1))
    expected = [p.detach().clone() for p in whole.parameters()]
    first, opt = _run(name, rank, world, options, range(1, stop + 1))
    in_flight = first._streamer.in_flight_fragment
    path = f"{tmp}/rank{rank}.pt"
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, path)
    torch.manual_seed(1)  # a different start: the checkpoint must replace it all
    base = make_model(name)
    resumed, opt2 = hemiola.wrap(base, make_optimizer("adamw", base.parameters()),
                                 schedule="streaming", **options)
    checkpoint = torch.load(path, weights_only=False)
    resumed.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    _run(name, rank, world, options, range(stop + 1, steps + 1), resumed, opt2)
    got = [p.detach().clone() for p in resumed.parameters()]
    return {"max_diff": max(float((a - b).abs().max()) for a, b in zip(got, expected)),
            "in_flight_at_stop": in_flight}


def overlap_keeps_shared_identical(rank: int, world: int, options: dict[str, Any],
                                   steps: int) -> dict[str, Any]:
    """The shared copy's largest difference across the ranks, taken after
    every inner step (so after each sync lands), and how many steps changed it."""
    hemiola.init()
    model, opt = _run("transformer", rank, world, options, range(1, 2))

    def shared() -> torch.Tensor:
        s = model._streamer  # read anew: a shape chosen after the first sync replaces it
        return torch.cat([torch.frombuffer(s.shared_view(f), dtype=torch.float32).clone()
                          for f in range(len(s.fragments()))])

    spread, changed, last = 0.0, 0, shared()
    for step in range(2, steps + 2):
        if step <= steps:
            _run("transformer", rank, world, options, range(step, step + 1), model, opt)
        else:
            model.synchronize()  # the last fragment in flight lands
        now = shared()
        gathered = [torch.empty_like(now) for _ in range(world)]
        dist.all_gather(gathered, now)
        spread = max([spread, *(float((g - gathered[0]).abs().max()) for g in gathered)])
        changed += int(not torch.equal(now, last))
        last = now
    return {"shared_spread": spread, "shared_changes": changed,
            "stats": model.stats(), "fragments": len(model._streamer.fragments())}


def _host_copied(name: str, options: dict[str, Any], device: str,
                 ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The streaming model built as hemiola.wrap builds it, on `device`, with
    the GPU path's host copy of the parameters (on the CPU too)."""
    from hemiola.config import Config
    from hemiola.distributed import new_engine
    from hemiola.streaming import StreamingParallel

    torch.manual_seed(0)
    base = make_model(name).to(device)
    opt = make_optimizer("adamw", base.parameters())
    config = Config.from_kwargs(schedule="streaming", **options)
    engine, store = new_engine(config.timeout_s)
    return StreamingParallel(base, config, engine, store, opt, host_copy=True), opt


def host_copy_is_the_same_run(rank: int, world: int, options: dict[str, Any], steps: int,
                              device: str) -> dict[str, Any]:
    """The GPU path's host copy (on `device`) against the CPU model the
    engine reads in place, over the same steps."""
    hemiola.init()
    name = "transformer"
    torch.manual_seed(0)
    initial = make_model(name)
    direct, _ = _run(name, rank, world, options, range(1, steps + 1))
    copied, opt = _host_copied(name, options, device)
    for step in range(1, steps + 1):
        _inner_step(copied, opt, name, step, rank, world, device)
    copied.synchronize()
    pairs = list(zip(direct.parameters(), copied.parameters()))
    return {"max_diff": max(float((a - b.cpu()).abs().max()) for a, b in pairs),
            "moved": max(float((a - b).abs().max()) for a, b in
                         zip(direct.parameters(), initial.parameters())),
            "syncs": copied.stats()["syncs"]}


def refusals(rank: int, world: int) -> list[str]:
    hemiola.init()
    out = []
    model = make_model("mlp")
    for call in (
        lambda: hemiola.wrap(model, schedule="streaming"),
        lambda: hemiola.wrap(model, torch.optim.SGD(list(model.parameters())[:1], lr=0.1),
                             schedule="streaming"),
        lambda: hemiola.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             schedule="streaming", sync_every=4, fragments=2, overlap=2),
        lambda: hemiola.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             schedule="streaming", compression="powersgd"),
    ):
        try:
            call()
            out.append("accepted")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    return out


def comm_hook_refused(rank: int, world: int) -> str:
    """DDP's register_comm_hook on a streaming model: what it raises."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hemiola.init()
    model = make_model("mlp")
    model, _ = hemiola.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            schedule="streaming")
    try:
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return "accepted"
    except RuntimeError as e:
        return str(e)


def mismatched_options(rank: int, world: int, option: str, values: list[object]) -> str:
    """Rank r wraps with `option` = values[r]: what wrap raises."""
    hemiola.init()
    model = make_model("mlp")
    try:
        options = {"sync_every": 8, option: values[rank]}
        hemiola.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), schedule="streaming",
                     **options)
        return "accepted"
    except ValueError as e:
        return str(e)


def _groups_reference(rank: int, world: int, ranks: int, name: str, steps: int,
                      sync_every: int) -> list[torch.Tensor]:
    """DiLoCo across replica groups in plain torch: inside a group of `ranks`
    consecutive ranks the gradients are averaged every step (as DDP does),
    across the groups the pseudo-gradients every `sync_every` steps."""
    groups = world // ranks
    inside = [dist.new_group(list(range(g * ranks, (g + 1) * ranks))) for g in range(groups)]
    across = [dist.new_group(list(range(j, world, ranks))) for j in range(ranks)]
    mine, place = inside[rank // ranks], across[rank % ranks]
    torch.manual_seed(0)
    model = make_model(name)
    opt = make_optimizer("adamw", model.parameters())
    shared = copy.deepcopy(model)
    outer = torch.optim.SGD(shared.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for step in range(1, steps + 1):
        x, y = make_batch(name, step, rank, world)
        opt.zero_grad()
        loss_of(name, model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mine)
            p.grad /= ranks
        opt.step()
        if step % sync_every == 0:
            with torch.no_grad():
                for s, p in zip(shared.parameters(), model.parameters()):
                    s.grad = s - p
                    dist.all_reduce(s.grad, group=place)
                    s.grad /= groups
                outer.step()
                for s, p in zip(shared.parameters(), model.parameters()):
                    p.copy_(s)
    return [p.detach().clone() for p in model.parameters()]


def groups_equal_diloco(rank: int, world: int, ranks: int, name: str, steps: int,
                        sync_every: int) -> dict[str, Any]:
    """Replica groups of `ranks` ranks, blocking syncs, against the plain torch
    reference; with the ranks' spread and what each averaged on the wire."""
    hemiola.init()
    reference = _groups_reference(rank, world, ranks, name, steps, sync_every)
    model, _ = _run(name, rank, world, {"sync_every": sync_every, "replica_ranks": ranks,
                                        "fragments": 1, "overlap": 0, "outer_lr": 0.7,
                                        "outer_momentum": 0.9}, range(1, steps + 1))
    ours = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(ours) for _ in range(world)]
    dist.all_gather(gathered, ours)
    expected = torch.cat([p.flatten() for p in reference])
    return {"max_diff": float((ours - expected).abs().max()),
            "rank_spread": max(float((g - gathered[0]).abs().max()) for g in gathered),
            "stats": model.stats()}


def a_nan_is_refused(rank: int, world: int, compression: str | None) -> str:
    """Rank 1's parameters turn NaN after inner step 1; the sync after step 2
    (check_finite=True) must raise on every rank, before anything is applied."""
    hemiola.init()
    torch.manual_seed(0)
    base = make_model("mlp")
    model, opt = hemiola.wrap(base, make_optimizer("adamw", base.parameters()),
                              schedule="streaming", sync_every=2, check_finite=True,
                              compression=compression)
    _inner_step(model, opt, "mlp", 1, rank, world)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    try:
        _inner_step(model, opt, "mlp", 2, rank, world)
    except FloatingPointError as e:
        return str(e)
    return f"no error; parameters finite: {all(bool(torch.isfinite(p).all()) for p in before)}"


def _force_shape(forced: tuple[int, int] | None) -> None:
    """Makes the choice after the first sync `forced` (fragments, overlap)
    whatever the wire measured, so a test does not depend on the machine."""
    if forced is None:
        return
    import hemiola.streaming as streaming
    from hemiola.streaming_shape import Shape

    streaming.choose = lambda *_: Shape(forced[0], forced[1], "forced by the test")


def auto_shape_keeps_shared_identical(rank: int, world: int, forced: tuple[int, int] | None,
                                      steps: int) -> dict[str, Any]:
    _force_shape(forced)
    return overlap_keeps_shared_identical(rank, world, {"sync_every": 6}, steps)


def auto_shape_resumes(rank: int, world: int, forced: tuple[int, int], stop: int, steps: int,
                       tmp: str) -> dict[str, Any]:
    _force_shape(forced)
    return resume_repeats_the_run(rank, world, {"sync_every": 6}, stop, steps, tmp)


def a_run_shorter_than_sync_every(rank: int, world: int) -> list[str]:
    """5 inner steps at the default sync_every=100: no sync ever happens."""
    import gc
    import warnings

    hemiola.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = _run("mlp", rank, world, {}, range(1, 6))
        del model, opt
        gc.collect()
    return [str(w.message) for w in caught if "no sync" in str(w.message)]


def hostile_loads(rank: int, world: int, tmp: str) -> dict[str, str]:
    """Checkpoints saved per rank after inner steps 5 and 6 (a fragment in
    flight), then loaded wrongly into a fresh model; each case's message on
    this rank ("" where the load went through)."""
    import warnings

    hemiola.init()
    options = {"sync_every": 4, "fragments": 2, "overlap": 1}
    model, opt = _run("mlp", rank, world, options, range(1, 6))
    at5 = copy.deepcopy(opt.state_dict())
    _run("mlp", rank, world, options, range(6, 7), model, opt)
    at6 = copy.deepcopy(opt.state_dict())
    torch.manual_seed(1)
    base = make_model("mlp")
    fresh, opt2 = hemiola.wrap(base, make_optimizer("adamw", base.parameters()),
                               schedule="streaming", **options)

    def attempt(state: dict[str, Any]) -> str:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt2.load_state_dict(copy.deepcopy(state))
            except ValueError as e:
                return str(e)
        return " | ".join(str(w.message) for w in caught if "checkpoint" in str(w.message))

    out = {}
    nan = copy.deepcopy(at6)
    if rank == 1:
        nan["hemiola_streaming"]["shared"][0][3] = float("nan")
    out["nan on rank 1"] = attempt(nan)
    out["rank 1 a step later"] = attempt(at5 if rank == 0 else at6)
    small = copy.deepcopy(at6)
    small["hemiola_streaming"]["outer_momentum"][1] = torch.zeros(1)
    out["one element"] = attempt(small)
    resized = copy.deepcopy(at6)
    resized["hemiola_streaming"]["replicas"] = 3
    out["saved by 3"] = attempt(resized)
    out["good"] = attempt(at6)
    return out


def average_now(rank: int, world: int) -> dict[str, float]:
    """Between syncs the ranks differ; average_parameters() makes them equal
    (to the mean of what they held), and training goes on."""
    hemiola.init()
    options = {"sync_every": 4, "fragments": 2, "overlap": 1}
    model, opt = _run("mlp", rank, world, options, range(1, 7))

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    def spread(t: torch.Tensor) -> float:
        every = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(every, t)
        return max(float((e - every[0]).abs().max()) for e in every)

    before = flat()
    mean = before.clone()
    dist.all_reduce(mean)
    mean /= world
    model.average_parameters()
    after = flat()
    out = {"before": spread(before), "after": spread(after),
           "off_mean": float((after - mean).abs().max())}
    _run("mlp", rank, world, options, range(7, 12), model, opt)
    out["syncs"] = model.stats()["syncs"]
    return out


def streaming_with_a_skipping_scaler(rank: int, world: int, passed: bool) -> dict[str, Any]:
    """streaming with a GradScaler whose step rank 1 skips once (its loss
    overflowed at iteration 3): passed to hemiola.wrap, the skipped step is
    counted, so both ranks sync after the same iterations and end together."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    opt = make_optimizer("sgd", m.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    model, opt = hemiola.wrap(m, opt, schedule="streaming", sync_every=4, fragments=1,
                              overlap=0, grad_scaler=scaler if passed else None, timeout_s=60)
    skipped = 0
    for step in range(12):
        x, y = make_batch("mlp", step, rank, world)
        opt.zero_grad()
        loss = loss_of("mlp", model(x), y)
        if rank == 1 and step == 3:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
    stats = model.stats()
    return {"skipped": skipped, "inner_steps": stats["inner_steps"], "syncs": stats["syncs"],
            "params": [p.detach().clone() for p in m.parameters()]}

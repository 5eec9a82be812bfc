"""Functions that run inside each rank process (see hemiola.launch.run_local)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hemiola

from models import loss_of, make_batch, make_model, make_optimizer


def _train(model: nn.Module, opt: torch.optim.Optimizer, name: str, rank: int, world: int,
           steps: int | range) -> list[float]:
    """Trains steps 0..steps-1 (or the steps of a range: a resumed run)."""
    losses = []
    for step in range(steps) if isinstance(steps, int) else steps:
        x, y = make_batch(name, step, rank, world)
        opt.zero_grad()
        loss = loss_of(name, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def hemiola_vs_ddp(rank: int, world: int, model_name: str, opt_name: str, fusion_mb: float,
                   steps: int = 5) -> dict[str, Any]:
    """Trains the same model with torch DDP and with hemiola wfbp; returns the
    largest parameter difference and both loss curves."""
    hemiola.init()
    torch.manual_seed(0)
    ref = make_model(model_name)
    ddp = nn.parallel.DistributedDataParallel(ref)
    ddp_losses = _train(ddp, make_optimizer(opt_name, ddp.parameters()), model_name, rank, world,
                        steps)

    torch.manual_seed(0)
    mine = make_model(model_name)
    opt = make_optimizer(opt_name, mine.parameters())
    model, opt = hemiola.wrap(mine, opt, fusion_mb=fusion_mb, first_bucket_mb=min(fusion_mb, 1.0),
                              timeout_s=60)
    hemi_losses = _train(model, opt, model_name, rank, world, steps)

    diffs = {
        n: (a - b).abs().max().item()
        for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items())
        if a.is_floating_point()
    }
    worst = max(diffs, key=lambda n: diffs[n])
    return {"max_diff": diffs[worst], "worst": worst, "ddp": ddp_losses, "hemiola": hemi_losses,
            "buckets": len(model.buckets()), "keys_equal": list(ref.state_dict()) ==
            list(model.state_dict())}


def params_after(rank: int, world: int, model_name: str, steps: int) -> list[torch.Tensor]:
    hemiola.init()
    torch.manual_seed(rank)  # different initial weights: wrap must broadcast rank 0's
    m = make_model(model_name)
    model, opt = hemiola.wrap(m, make_optimizer("sgd", m.parameters()), timeout_s=60)
    _train(model, opt, model_name, rank, world, steps)
    dist.barrier()
    return [p.detach().clone() for p in model.parameters()]


def equivalence_sweep(rank: int, world: int, model_name: str, opt_name: str,
                      fusion_mbs: list[float]) -> dict[float, dict[str, Any]]:
    """hemiola_vs_ddp for several fusion thresholds in one process."""
    return {mb: hemiola_vs_ddp(rank, world, model_name, opt_name, mb) for mb in fusion_mbs}


def broadcast_at_wrap(rank: int, world: int) -> dict[str, Any]:
    hemiola.init()
    torch.manual_seed(100 + rank)  # every rank starts from different weights
    m = make_model("cnn")
    with torch.no_grad():
        m.features[1].running_mean.fill_(float(rank))  # and different buffers
    model, _ = hemiola.wrap(m, None, timeout_s=30)
    flat = torch.cat([t.reshape(-1).float() for t in m.state_dict().values()])
    return {"flat": flat, "running_mean": m.features[1].running_mean.clone()}


class _OddBuffers(nn.Module):
    """An odd number of float32 parameters and buffers before an int64 buffer
    (its bytes land at an offset that is not a multiple of 8 when packed)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)  # 12 parameters
        self.register_buffer("odd", torch.full((7,), float(rank)))
        self.register_buffer("count", torch.tensor([rank * 1000 + 7], dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.count += 1
                self.odd += 0.5
        return self.lin(x) + self.odd[:3]


def odd_buffers(rank: int, world: int, schedule: str) -> dict[str, torch.Tensor]:
    """Wrap and train two steps: buffers of any dtypes and offsets follow rank 0."""
    hemiola.init()
    torch.manual_seed(rank)
    m = _OddBuffers(rank)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    model, opt = hemiola.wrap(m, opt, schedule=schedule, timeout_s=30)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    model.synchronize()
    return {"odd": m.odd.clone(), "count": m.count.clone(), "weight": m.lin.weight.detach().clone()}


def buffers_lane_order(rank: int, world: int, schedule: str) -> list[str]:
    """Train the BatchNorm CNN four steps with the engine's timeline on; the
    engine's collectives of the last two steps, in the order they ran."""
    import json

    hemiola.init()
    torch.manual_seed(0)
    m = make_model("cnn")
    opt = make_optimizer("sgd", m.parameters())
    model, opt = hemiola.wrap(m, opt, schedule=schedule, timeout_s=30, timeline=True)
    for step in range(4):
        x, y = make_batch("cnn", step, rank, world)
        opt.zero_grad()
        loss_of("cnn", model(x), y).backward()
        opt.step()
    model.synchronize()
    events = json.loads(model.timeline())["traceEvents"]
    lane = sorted((e for e in events if e.get("ph") == "X" and e.get("tid") == 0
                   and e.get("cat") in ("allreduce", "collective")), key=lambda e: e["ts"])
    return [e["name"] for e in lane if "(iteration 2)" in e["name"]
            or "(iteration 3)" in e["name"] or e["name"].startswith("broadcast")][-64:]


def no_sync_accumulation(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Two micro-batches under no_sync + one synced == one batch of all three."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    model, _ = hemiola.wrap(m, None, timeout_s=30)
    for micro in range(3):
        x, y = make_batch("mlp", micro, rank, world)
        loss = loss_of("mlp", model(x), y) / 3
        if micro < 2:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
    accumulated = {n: p.grad.clone() for n, p in m.named_parameters()}
    # Reference: the gradient of the mean loss over every rank's three micro-batches.
    torch.manual_seed(0)
    ref = make_model("mlp")
    total = 0.0
    for r in range(world):
        for micro in range(3):
            x, y = make_batch("mlp", micro, r, world)
            total = total + loss_of("mlp", ref(x), y) / 3
    (total / world).backward()
    reference = {n: p.grad for n, p in ref.named_parameters()}
    return {n: (accumulated[n] - reference[n]).abs().max() for n in reference}


class TwoBranch(nn.Module):
    """Branch `b` is used only when the input says so: an unused-parameter case."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.frozen(self.a(x))
        return self.b(h) if use_b else h


def unused_parameters(rank: int, world: int, find_unused: bool, pattern: str) -> dict[str, Any]:
    """pattern: "all" (no rank uses b), "rank0" (only rank 0 uses b)."""
    hemiola.init()
    torch.manual_seed(0)
    m = TwoBranch()
    model, _ = hemiola.wrap(m, None, find_unused_parameters=find_unused, timeout_s=10)
    x = torch.full((2, 4), float(rank + 1))
    use_b = pattern == "rank0" and rank == 0
    model(x, use_b).sum().backward()
    out: dict[str, Any] = {"a": m.a.weight.grad.clone(),
                           "b": None if m.b.weight.grad is None else m.b.weight.grad.clone(),
                           "frozen": m.frozen.weight.grad}
    # A second iteration must work too.
    model(x, use_b).sum().backward()
    return out


def _build(model_name: str, channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    m = make_model(model_name)
    return m.to(memory_format=torch.channels_last) if channels_last else m


def tied_and_noncontiguous(rank: int, world: int) -> dict[str, float]:
    """Tied weights and channels_last (non-contiguous) gradients against DDP."""
    hemiola.init()
    results = {}
    for name in ("transformer", "channels_last"):
        model_name = "transformer" if name == "transformer" else "cnn"
        channels_last = name == "channels_last"
        ref = nn.parallel.DistributedDataParallel(_build(model_name, channels_last))
        mine, _ = hemiola.wrap(_build(model_name, channels_last), None, fusion_mb=0.01,
                               timeout_s=30)
        for model in (ref, mine):
            x, y = make_batch(model_name, 0, rank, world)
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            loss_of(model_name, model(x), y).backward()
        results[name] = max(
            (a.grad - b.grad).abs().max().item()
            for a, b in zip(ref.module.parameters(), mine.module.parameters())
        )
    return results


def dtype_reduction(rank: int, world: int) -> dict[str, float]:
    """Gradients of float64 / float16 / bfloat16 parameters are averaged."""
    hemiola.init()
    out = {}
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.float32):
        lin = nn.Linear(8, 8, bias=False).to(dtype)
        model, _ = hemiola.wrap(lin, None, timeout_s=30)
        lin.weight.grad = None
        x = torch.full((1, 8), float(rank + 1), dtype=dtype)
        model(x).sum().backward()
        # d(sum(W x))/dW[i,j] = x_j = rank + 1, so the average is (world + 1) / 2.
        expected = (world + 1) / 2
        out[str(dtype)] = (lin.weight.grad.double() - expected).abs().max().item()
    return out


def mismatched_model(rank: int, world: int) -> str:
    hemiola.init()
    m = nn.Sequential(nn.Linear(4, 8 if rank != 1 else 9), nn.Linear(8 if rank != 1 else 9, 2))
    hemiola.wrap(m, None, timeout_s=20)
    return "wrapped"


def killed_rank(rank: int, world: int, victim: int, timeout_s: float, schedule: str = "wfbp",
                optimizer: str = "sgd") -> str:
    """Trains; `victim` dies (SIGKILL) at step 3. Survivors must raise."""
    import os
    import signal
    import time

    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.wrap(m, make_optimizer(optimizer, m.parameters()), timeout_s=timeout_s,
                              fusion_mb=0.001, schedule=schedule)
    for step in range(100):
        if rank == victim and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = make_batch("mlp", step, rank, world)
        opt.zero_grad()
        start = time.monotonic()
        try:
            loss_of("mlp", model(x), y).backward()
            opt.step()  # (decoupled waits here, or in the next forward)
        except Exception as e:
            elapsed = time.monotonic() - start
            return f"raised after {elapsed:.2f}s at step {step}: {type(e).__name__}: {e}"
    return "finished without error"


def stalled_rank(rank: int, world: int, timeout_s: float) -> str:
    """Rank 1 stalls (alive, not communicating) long past the timeout."""
    import time

    hemiola.init()
    m = make_model("mlp")
    model, _ = hemiola.wrap(m, None, timeout_s=timeout_s)
    x, y = make_batch("mlp", 0, rank, world)
    if rank == 1:
        time.sleep(timeout_s * 2 + 8)
        return "slept"
    start = time.monotonic()
    try:
        loss_of("mlp", model(x), y).backward()
    except Exception as e:
        return f"raised after {time.monotonic() - start:.2f}s: {type(e).__name__}: {e}"
    return "finished without error"


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    if name == "nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "adamw-fast":
        return torch.optim.AdamW(params, lr=1e-2)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3, momentum=0.5)
    if name == "adam-amsgrad":  # L2 decay, amsgrad, other betas and eps
        return torch.optim.Adam(params, lr=2e-3, betas=(0.8, 0.99), eps=1e-6,
                                weight_decay=1e-2, amsgrad=True)
    if name == "sgd-groups":  # two groups with their own options; dampening, maximize
        ps = list(params)
        return torch.optim.SGD([{"params": ps[::2], "lr": 0.05, "weight_decay": 1e-3},
                                {"params": ps[1::2], "lr": 0.02, "dampening": 0.3}],
                               momentum=0.9, maximize=True)
    raise ValueError(name)


def schedule_run(rank: int, world: int, schedule: str, model_name: str, opt_name: str,
                 steps: int, same_data: bool, clip: float | None = None,
                 use_closure: bool = False, **options: Any) -> dict[str, Any]:
    """Trains with `schedule`; returns the parameters after synchronize() and
    the losses. `same_data`: every rank sees the same batch (rank 0's shard);
    `clip`: model.clip_grad_norm_(clip) before every step; `use_closure`:
    forward and backward run in the closure passed to ``optimizer.step``."""
    hemiola.init()
    device = torch.device(options.pop("device", "cpu"))
    dtype = getattr(torch, options.pop("dtype", "float32"))
    torch.manual_seed(0)
    m = make_model(model_name).to(device=device, dtype=dtype)
    opt = _optimizer(opt_name, m.parameters())
    model, opt = hemiola.wrap(m, opt, schedule=schedule, **{"fusion_mb": 1 / 64, "timeout_s": 60,
                                                             **options})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    losses = []
    for step in range(steps):
        x, y = make_batch(model_name, step, 0 if same_data else rank, world)
        x, y = x.to(device), y.to(device)
        if x.is_floating_point():
            x = x.to(dtype)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = loss_of(model_name, model(x), y)
            loss.backward()
            if clip is not None:
                model.clip_grad_norm_(clip)
            return loss

        if use_closure:
            loss = opt.step(closure)
        else:
            loss = closure()
            opt.step()
        sched.step()
        losses.append(loss.item())
    model.synchronize()
    return {"params": [p.detach().cpu().clone() for p in m.parameters()], "losses": losses,
            "state": {k: v.cpu().clone() for k, v in model.state_dict().items()},
            "stats": model.stats()}


def preview_clip_coefficients(rank: int, world: int, steps: int,
                              clip: float) -> list[dict[str, float]]:
    """decoupled with the preview, clipping at `clip`, different data per
    rank: per iteration, the coefficient the preview step was scaled by,
    this rank's own coefficient, and the exact one (torch's rule on the
    averaged gradient's norm, read once the iteration has landed)."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("transformer")
    model, opt = hemiola.wrap(m, _optimizer("adamw", m.parameters()), schedule="decoupled",
                              preview=True, fusion_mb=1 / 64, timeout_s=60)
    schedule = model._schedule
    rows = []
    for step in range(steps):
        x, y = make_batch("transformer", step, rank, world)
        opt.zero_grad()
        loss_of("transformer", model(x), y).backward()
        iteration = schedule._finished
        norm = model.clip_grad_norm_(clip)
        local = schedule._local_norms[iteration]
        rows.append({"preview": schedule._clip[iteration].preview_coef,
                     "local": min(1.0, clip / (local + 1e-6)), "norm": norm})
        opt.step()
    model.synchronize()
    for row in rows:
        row["exact"] = min(1.0, clip / (float(row.pop("norm")) + 1e-6))
    return rows


def preview_defaults(rank: int, world: int) -> dict[str, Any]:
    """Whether decoupled takes a preview, per optimizer and option; "warned"
    where asking for one warns."""
    hemiola.init()
    out: dict[str, Any] = {}
    for label, opt_name, options in [("adamw", "adamw", {}), ("sgd", "sgd", {}),
                                     ("sgd+preview", "sgd", {"preview": True}),
                                     ("rmsprop+preview", "rmsprop", {"preview": True})]:
        m = make_model("mlp")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, _ = hemiola.wrap(m, _optimizer(opt_name, m.parameters()),
                                    schedule="decoupled", **options)
        if any("takes no preview" in str(w.message) for w in caught):
            out[label] = "warned"
        else:
            out[label] = model._schedule.preview
    return out


def schedule_run_with(rank: int, world: int, schedule: str, model_name: str, opt_name: str,
                      steps: int, same_data: bool, options: dict[str, Any]) -> dict[str, Any]:
    """schedule_run with its keyword options as one dict (run_local passes
    positional arguments only)."""
    return schedule_run(rank, world, schedule, model_name, opt_name, steps, same_data,
                        **options)


def schedules_agree(rank: int, world: int, model_name: str, opt_name: str,
                    steps: int, partition_mb: float | None = None,
                    options: dict[str, Any] | None = None) -> dict[str, float]:
    """With identical data on every rank, decoupled must equal wfbp.
    `options`: decoupled's wrap options, and `clip` (both schedules)."""
    options = dict(options or {})
    clip = options.pop("clip", None)
    a = schedule_run(rank, world, "wfbp", model_name, opt_name, steps, True, clip)
    b = schedule_run(rank, world, "decoupled", model_name, opt_name, steps, True, clip,
                     partition_mb=partition_mb, **options)
    return _agreement(a, b)


def _agreement(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """How far two schedule_run results are apart."""
    return {
        "max_param_diff": max((x - y).abs().max().item()
                              for x, y in zip(a["params"], b["params"])),
        "max_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
    }


def gpu_matches_cpu(rank: int, world: int, schedule: str, model_name: str, opt_name: str,
                    steps: int, gpu_backend: str, native: bool = False) -> dict[str, float]:
    """Trains with `schedule` on the CPU and on the GPU (through `gpu_backend`;
    `native`: the GPU run steps with the engine's updater, else with torch's);
    returns how far the two runs' parameters and losses are apart."""
    # Full float32 on the GPU (no TF32), so the two runs differ by rounding only.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    options: dict[str, Any] = {}
    if schedule == "decoupled-on-bound":  # corrections land independently of timing
        schedule, options = "decoupled", {"correct_on_arrival": False}
    cpu = schedule_run(rank, world, schedule, model_name, opt_name, steps, False, **options)
    options["native_optimizer"] = native
    gpu = schedule_run(rank, world, schedule, model_name, opt_name, steps, False, device="cuda",
                       gpu_backend=gpu_backend, **options)
    return {
        **_agreement(cpu, gpu),
        "moved": max((a - b).abs().max().item()  # training changed the parameters at all
                     for a, b in zip(cpu["params"], _initial_params(model_name))),
    }


def gpu_clipped_matches_cpu(rank: int, world: int, schedule: str, model_name: str,
                            opt_name: str, steps: int, gpu_backend: str,
                            clip: float) -> dict[str, float]:
    """gpu_matches_cpu with model.clip_grad_norm_(clip) before every step and
    the engine's steps on the GPU (HEMIOLA_DEVICE_CLIP, set by the caller,
    decides where the coefficient is computed)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    timing = {"correct_on_arrival": False} if schedule == "decoupled" else {}
    cpu = schedule_run(rank, world, schedule, model_name, opt_name, steps, False, clip, **timing)
    gpu = schedule_run(rank, world, schedule, model_name, opt_name, steps, False, clip,
                       device="cuda", gpu_backend=gpu_backend, native_optimizer=True, **timing)
    return {
        **_agreement(cpu, gpu),
        "moved": max((a - b).abs().max().item()
                     for a, b in zip(cpu["params"], _initial_params(model_name))),
    }


def gpu_schedules_agree(rank: int, world: int, model_name: str, opt_name: str, steps: int,
                        gpu_backend: str, native: bool = False) -> dict[str, float]:
    """schedules_agree on the GPU: decoupled (corrections on arrival) against
    wfbp, every rank seeing the same data (`native`: decoupled steps with the
    engine's updater)."""
    gpu = {"device": "cuda", "gpu_backend": gpu_backend}
    a = schedule_run(rank, world, "wfbp", model_name, opt_name, steps, True, **gpu)
    b = schedule_run(rank, world, "decoupled", model_name, opt_name, steps, True, **gpu,
                     native_optimizer=native)
    return _agreement(a, b)


def multi_tensor_steps_agree(rank: int, world: int, schedule: str, model_name: str,
                             opt_name: str, steps: int, device: str,
                             gpu_backend: str = "auto") -> dict[str, float]:
    """The engine's steps one parameter at a time against multi-tensor steps
    (HEMIOLA_MULTI_TENSOR_STEPS), on the same data: the same arithmetic per
    element, so the runs must agree bit for bit. `repeat` is how far two runs
    without the switch are apart: the comparison means something only if 0."""
    torch.backends.cudnn.deterministic = True  # else backward alone may differ
    # decoupled: corrections land in step(), independently of network timing
    timing = {"correct_on_arrival": False} if schedule == "decoupled" else {}
    runs = []
    for flag in ("0", "0", "1"):
        os.environ["HEMIOLA_MULTI_TENSOR_STEPS"] = flag
        runs.append(schedule_run(rank, world, schedule, model_name, opt_name, steps, False,
                                 device=device, gpu_backend=gpu_backend,
                                 native_optimizer=True, **timing))
    os.environ.pop("HEMIOLA_MULTI_TENSOR_STEPS")
    return {**_agreement(runs[0], runs[2]), "repeat": _agreement(runs[0], runs[1])}


def _initial_params(model_name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach().clone() for p in make_model(model_name).parameters()]


class Residual(nn.Module):
    """Not a layer-by-layer stack: a residual block, one module used twice in
    a forward, tied weights, and a branch used only in some iterations."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(20, 32)
        self.shared = nn.Linear(32, 32)  # used twice per forward
        self.norm = nn.LayerNorm(32)
        self.sometimes = nn.Linear(32, 32)
        self.out = nn.Linear(32, 20, bias=False)
        self.back = nn.Linear(20, 32, bias=False)
        self.back.weight = nn.Parameter(self.out.weight.t().contiguous())
        self.out2 = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = h + self.shared(torch.relu(self.shared(h)))  # residual, module used twice
        h = self.norm(h)
        if step % 2 == 0:
            h = h + self.sometimes(h)
        h = h + self.back(self.out(h))
        return self.out2(h)


def irregular_model(rank: int, world: int, schedule: str, opt_name: str,
                    steps: int) -> list[torch.Tensor]:
    hemiola.init()
    torch.manual_seed(0)
    m = Residual()
    opt = _optimizer(opt_name, m.parameters())
    model, opt = hemiola.wrap(m, opt, schedule=schedule, find_unused_parameters=True,
                              fusion_mb=1 / 256, timeout_s=60)
    for step in range(steps):
        x, y = make_batch("mlp", step, rank, world)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x, step), y).backward()
        opt.step()
    model.synchronize()
    return [p.detach().clone() for p in m.parameters()]


def priority_matches_wfbp(rank: int, world: int, model_name: str, opt_name: str,
                          steps: int, partition_mb: float | None = None,
                          clip: float | None = None, use_closure: bool = False) -> float:
    """Different data per rank: priority is exact, so it must follow wfbp
    (which is given no closure: torch's own step runs it)."""
    a = schedule_run(rank, world, "wfbp", model_name, opt_name, steps, False, clip)
    b = schedule_run(rank, world, "priority", model_name, opt_name, steps, False, clip,
                     use_closure, partition_mb=partition_mb)
    return max((x - y).abs().max().item() for x, y in zip(a["params"], b["params"]))


def grad_edited_before_step(rank: int, world: int, schedule: str) -> str:
    """torch's own clip_grad_norm_ between backward and step: an edit of
    .grad that priority/decoupled would not apply; must raise, not ignore."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule=schedule,
                              timeout_s=60)
    for step in range(3):
        x, y = make_batch("mlp", step, rank, world)
        opt.zero_grad()
        loss_of("mlp", model(x), y).backward()
        if step == 2:
            nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        try:
            opt.step()
        except RuntimeError as e:
            return str(e)
    return "no error"


class SometimesFunctional(nn.Module):
    """Calls `layer` in the first iteration, later reads its weight
    functionally from the outer forward: the module learnt as the place to
    update `layer.weight` no longer runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(20, 5)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        if step == 0:
            return self.layer(x)
        return nn.functional.linear(x, self.layer.weight, self.layer.bias)


def read_order_changes(rank: int, world: int, schedule: str) -> str:
    hemiola.init()
    torch.manual_seed(0)
    m = SometimesFunctional()
    model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule=schedule,
                              timeout_s=60)
    try:
        for step in range(4):
            x, y = make_batch("mlp", step, rank, world)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x, step), y).backward()
            opt.step()
    except RuntimeError as e:
        return str(e)
    model.synchronize()
    return "trained"


def accumulate_without_no_sync(rank: int, world: int, schedule: str, same_data: bool,
                               steps: int = 4) -> list[torch.Tensor]:
    """Two synchronised backward passes per optimizer.step() (no no_sync):
    the gradients accumulate, as under DDP. `schedule` "ddp" is torch's."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    opt = _optimizer("sgd", m.parameters())
    if schedule == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(m)
    else:
        model, opt = hemiola.wrap(m, opt, schedule=schedule, fusion_mb=1 / 64, timeout_s=60)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(2):
            x, y = make_batch("mlp", 2 * step + micro, 0 if same_data else rank, world)
            loss_of("mlp", model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.state_dict().values()]


def non_finite_gradient(rank: int, world: int, schedule: str) -> str:
    """check_finite=True; rank 1's loss is NaN at step 2: every rank must
    raise naming a parameter, not apply the gradient."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule=schedule,
                              check_finite=True, timeout_s=60)
    before = None
    try:
        for step in range(5):
            x, y = make_batch("mlp", step, rank, world)
            opt.zero_grad()
            loss = loss_of("mlp", model(x), y)
            if step == 2 and rank == 1:
                loss = loss * float("nan")
            loss.backward()
            if step == 2:
                before = [p.detach().clone() for p in m.parameters()]
            opt.step()
            model(x)  # priority lands in the next forward
    except FloatingPointError as e:
        untouched = all(torch.isfinite(p).all() for p in m.parameters())
        return f"{e} | finite parameters: {untouched} | had a step: {before is not None}"
    return "no error"


def clip_norms(rank: int, world: int, schedule: str, read: str,
               options: dict[str, Any] | None = None) -> dict[str, list[float]]:
    """Four SGD steps on different data per rank, clipping at 0.5: the norms
    model.clip_grad_norm_ returned, read at once ("now", before
    optimizer.step()) or after the loop ("later"), and this rank's own
    gradient norm before clipping."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model("mlp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    model, opt = hemiola.wrap(m, opt, schedule=schedule, timeout_s=30, **(options or {}))
    returned, local = [], []
    for step in range(4):
        x, y = make_batch("mlp", step, rank, world)
        opt.zero_grad()
        loss_of("mlp", model(x), y).backward()
        local.append(float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])))
        norm = model.clip_grad_norm_(0.5)
        returned.append(norm.item() if read == "now" else norm)
        opt.step()
    return {"returned": [float(n) for n in returned], "local": local}


def second_step(rank: int, world: int) -> dict[str, Any]:
    """optimizer.step() twice after one backward under priority and
    decoupled (issue 41: the ranks' models used to differ, silently): what
    the second step raised, and the parameters after going on the allowed
    way (zero_grad(set_to_none=False) then a step, which steps from zeros on
    every rank alike, as DDP would, and one more iteration)."""
    hemiola.init()
    out: dict[str, Any] = {}
    for schedule in ("priority", "decoupled"):
        torch.manual_seed(0)
        m = make_model("mlp")
        model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule=schedule,
                                  timeout_s=60)
        message = "no error"
        for step in range(3):
            x, y = make_batch("mlp", step, rank, world)
            opt.zero_grad()
            loss_of("mlp", model(x), y).backward()
            opt.step()
            if step == 1:
                try:
                    opt.step()
                except RuntimeError as e:
                    message = str(e)
                opt.zero_grad(set_to_none=False)
                opt.step()
        model.synchronize()
        out[schedule] = {"message": message,
                         "params": [p.detach().clone() for p in m.parameters()]}
    return out


def threads_fitted_to_host(rank: int, world: int) -> dict[str, Any]:
    """Wraps twice with torch's default of a thread per core: once with
    OMP_NUM_THREADS unset (as under mp.spawn), once with it set."""
    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {"cores": cores}
    for case in ("unset", "set"):
        if case == "unset":
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = str(cores)
        torch.set_num_threads(cores)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hemiola.wrap(nn.Linear(4, 2), timeout_s=60)
        out[case] = {"threads": torch.get_num_threads(),
                     "warnings": [str(w.message) for w in caught]}
    return out


def striped_equals_one_connection(rank: int, world: int, schedule: str) -> dict[str, Any]:
    """`schedule` on a 1 MB model (one bucket, large enough to be striped),
    each rank on its own data, with one Gloo connection and then with
    HEMIOLA_GLOO_STRIPES=2; returns how far the two runs' parameters are
    apart and the engine's communicator name in the striped run."""
    runs, names = [], []
    for stripes in ("1", "2"):
        os.environ["HEMIOLA_GLOO_STRIPES"] = stripes
        hemiola.init()
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
        model, opt = hemiola.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                  schedule=schedule, fusion_mb=4, first_bucket_mb=4)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(4):
            x, y = torch.randn(16, 256, generator=g), torch.randn(16, 256, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        model.synchronize()
        runs.append([p.detach().clone() for p in m.parameters()])
        names.append(model._bound.engine.transport)
    os.environ.pop("HEMIOLA_GLOO_STRIPES")
    return {"max_diff": max((a - b).abs().max().item() for a, b in zip(*runs)),
            "moved": max((a - b).abs().max().item()
                         for a, b in zip(runs[1], _initial_linear_stack())),
            "names": names}


def _initial_linear_stack() -> list[torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    return [p.detach().clone() for p in m.parameters()]


def dropped_models_freed(rank: int, world: int, schedule: str) -> list[bool]:
    """Wraps, trains and drops a model three times in one process: whether
    each wrapped model, its module and its parameters were freed (torch keeps
    parameter hooks in C++, out of the garbage collector's sight)."""
    import gc
    import weakref

    freed = []
    options = {"sync_every": 2} if schedule == "streaming" else {}
    for _ in range(3):
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        wrapped, opt = hemiola.wrap(model, opt, schedule=schedule, timeout_s=60, **options)
        for _ in range(2):
            opt.zero_grad()
            wrapped(torch.randn(8, 16)).sum().backward()
            opt.step()
        wrapped.synchronize()
        refs = [weakref.ref(wrapped), weakref.ref(model), weakref.ref(model[0].weight)]
        del wrapped, opt, model
        gc.collect()
        freed.append(all(r() is None for r in refs))
    return freed


def rank0_only_evaluation(rank: int, world: int, schedule: str, evaluate: bool) -> torch.Tensor:
    """A BatchNorm model trained 3 epochs of 3 steps; with `evaluate`, rank 0
    alone evaluates through the wrapped model and takes a state_dict after
    every epoch (the habit ``if rank == 0: evaluate(model)``). Returns the
    final parameters."""
    hemiola.init()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    model, opt = hemiola.wrap(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9),
                              schedule=schedule, timeout_s=30)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        for _ in range(3):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if evaluate and rank == 0:
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 8))
            model.train()
            model.state_dict()
    model.synchronize()
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def averaged_gradients_per_schedule(rank: int, world: int) -> dict[str, Any]:
    """Every schedule trained alike from the same start on rank-own batches:
    after each backward, model.averaged_gradients() and grad_norm(), and
    wfbp's .grad (DDP's) for reference."""
    hemiola.init()
    out: dict[str, Any] = {}
    for schedule in ("wfbp", "priority", "decoupled"):
        torch.manual_seed(0)
        m = make_model("mlp")
        model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule=schedule,
                                  fusion_mb=1 / 64, timeout_s=60)
        grads, norms, local = [], [], []
        for step in range(4):
            x, y = make_batch("mlp", step, rank, world)
            opt.zero_grad()
            loss_of("mlp", model(x), y).backward()
            averaged = model.averaged_gradients()
            grads.append({n: g.clone() for n, g in averaged.items()})
            norms.append(float(model.grad_norm()))
            local.append({n: p.grad.clone() for n, p in m.named_parameters()})
            opt.step()
        model.synchronize()
        out[schedule] = {"grads": grads, "norms": norms, "local": local}
    return out


def edited_grad_then_step_again(rank: int, world: int) -> dict[str, str]:
    """backward, step, .grad edited in place (p.grad.mul_(0.5)), step again:
    DDP applies the edited average on every rank; under priority and
    decoupled .grad is local, so the second step must be refused (it used to
    train the ranks apart: max relative difference 0.68 to 1.1)."""
    hemiola.init()
    out = {}
    for schedule in ("wfbp", "priority", "decoupled"):
        torch.manual_seed(0)
        m = make_model("mlp")
        model, opt = hemiola.wrap(m, _optimizer("sgd", m.parameters()), schedule=schedule,
                                  timeout_s=60)
        x, y = make_batch("mlp", 0, rank, world)
        opt.zero_grad()
        loss_of("mlp", model(x), y).backward()
        opt.step()
        for p in m.parameters():
            p.grad.mul_(0.5)
        try:
            opt.step()
            out[schedule] = "stepped"
        except RuntimeError as e:
            out[schedule] = str(e)
        model.synchronize()
    return out


"""``hemiola advise``: which schedule, bucket size and compression fit this
model on this network, from measurements made here, then a check.

Run it where the job will run, with its ranks::

    torchrun --nproc-per-node 2 -m hemiola advise --model mypkg.models:make
    hemiola advise --local 2                 # two local ranks, the built-in MLP

``--model MODULE:FACTORY`` names a function returning ``(model, loss_fn)``:
``loss_fn(model)`` runs one training batch's forward and returns the loss
(each rank its own batch). Every rank measures, with one thread per rank
as training would run:

- the computation alone: forward, backward and SGD step of the bare model,
  and the forward alone;
- one all-reduce of all the model's gradients through the engine, for each
  compression (none, fp16, int8, powersgd);
- the computation while that all-reduce runs, because on a small machine
  communication takes CPU from computation.

The prediction per configuration (``c``: computation while communicating,
``f``: the forward, ``b``: the rest of the computation, ``r``: the all-reduce):

- ``wfbp``: ``max(c, f + max(b, e))``, where ``e`` is when the last bucket's
  reduction ends: DDP's buckets (the first closes at 1 MiB, the others at
  the bucket cap, once reached) are reduced one after another, bucket k
  starting once backward has produced its gradients (its bytes' share of
  ``b``, the last parameters first) and the bucket before it has gone, and
  taking its bytes' share of ``r``;
- ``priority``: the same less ``f/2``: the front layers' share of the next
  forward runs under the tail of the reduction. (Its smaller buckets do not
  start the reduction measurably earlier on a machine where communication
  and computation share the cores, so ``e`` is taken with DDP's buckets.)
- ``decoupled``: ``max(c, r)``: the reduction has the whole next iteration.

The advice is the configuration predicted fastest, or, among those within 5%
of it, the least compressed and then the least approximate schedule; it is run
for a few iterations and its measured time printed beside the prediction. The
ranks agree on every number (rank 0's measurements, broadcast), so they pick
the same configuration.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hemiola.config import compression_code

#: what a --model factory returns
Factory = Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]
#: compressions tried, as (name, Config.compression)
CODINGS: list[tuple[str, str | None]] = [("none", None), ("fp16", "fp16"), ("int8", "int8"),
                                         ("powersgd", "powersgd")]


def slow_link_mlp(width: int = 1536) -> nn.Sequential:
    """Four width x width layers and a 10-way classifier (9.4M parameters at
    1536): the model of issue 26's slow-link setting and of
    hemiola.bench.speed, seeded the same on every rank."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def builtin_mlp(width: int = 1536, batch: int = 384) -> tuple[nn.Module,
                                                              Callable[[nn.Module], torch.Tensor]]:
    """slow_link_mlp with one random batch per rank."""
    model = slow_link_mlp(width)
    x = torch.randn(batch, width)
    y = torch.randint(0, 10, (batch,))
    return model, lambda m: nn.functional.cross_entropy(m(x), y)


def load_factory(spec: str | None) -> Factory:
    """``MODULE:FUNCTION`` imported, or the built-in MLP for None."""
    if spec is None:
        return builtin_mlp
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--model must be MODULE:FUNCTION (e.g. mypkg.models:make), got {spec!r}")
    factory = getattr(importlib.import_module(module), name, None)
    if not callable(factory):
        raise ValueError(f"{spec}: {module} has no function {name!r}")
    return factory  # type: ignore[no-any-return]


@dataclass
class Measured:
    """Rank 0's measurements, in seconds (medians)."""

    compute: float
    forward: float
    #: per bucket in reduction order: (share of the gradient bytes, share of
    #: the backward after which its gradients are ready); see bucket_profile
    buckets: list[tuple[float, float]]
    reduce: dict[str, float]  # per coding
    compute_under: dict[str, float]  # per coding: the computation while it reduces


@dataclass
class Prediction:
    schedule: str
    coding: str
    seconds: float


class _Reduction:
    """One all-reduce of every gradient through a reducer (the engine thread
    does it; start() returns at once)."""

    def __init__(self, reducer: Any, grads: list[torch.Tensor]) -> None:
        self.reducer = reducer
        self.grads = grads

    def start(self) -> int:
        for i in reversed(range(len(self.grads))):  # backward order
            self.reducer.mark_ready(i, self.grads[i].data_ptr())
        return int(self.reducer.finish_marking())

    def run(self) -> None:
        self.reducer.wait(self.start())


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _training_step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor],
                   optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    loss_fn(model).backward()
    optimizer.step()


def measure(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], repeats: int
            ) -> Measured:
    """Every rank measures (collectively: the reductions need all ranks);
    rank 0's numbers are broadcast so the ranks agree."""
    from hemiola.distributed import new_engine
    from hemiola.tensors import broadcast_tensors, dtype_code

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    _training_step(model, loss_fn, optimizer)  # warm-up
    compute = _median_time(lambda: _training_step(model, loss_fn, optimizer), repeats)
    forward = _median_time(lambda: loss_fn(model), repeats)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.randn_like(p) for p in params]
    specs = [(dtype_code(p.dtype), p.numel(), f"p{i}", p.shape[0] if p.dim() > 1 else 0)
             for i, p in enumerate(params)]
    engine, _ = new_engine(timeout_s=300.0)
    reduce: dict[str, float] = {}
    under: dict[str, float] = {}
    plan: list[list[int]] = []
    for name, coding in CODINGS:
        # DDP's buckets: 25 MiB, the first 1 MiB (the same plan for every coding).
        reduction = _Reduction(engine.make_reducer(
            specs, 25 << 20, 1 << 20, record_order=False,
            compression=compression_code(coding), powersgd_start_iteration=0), grads)
        plan = reduction.reducer.buckets()
        reduction.run()  # warm-up (and PowerSGD's first Q)
        engine.barrier().wait()
        reduce[name] = _median_time(reduction.run, repeats)
        engine.barrier().wait()
        # The computation's own time, measured while a reduction runs beside it.
        samples = []
        for _ in range(repeats):
            iteration = reduction.start()
            t0 = time.perf_counter()
            _training_step(model, loss_fn, optimizer)
            samples.append(time.perf_counter() - t0)
            reduction.reducer.wait(iteration)
        under[name] = statistics.median(samples)
    numbers = torch.tensor([compute, forward,
                            *[reduce[n] for n, _ in CODINGS], *[under[n] for n, _ in CODINGS]],
                           dtype=torch.float64)
    broadcast_tensors(engine, [numbers])
    values = numbers.tolist()
    k = len(CODINGS)
    return Measured(values[0], values[1],
                    bucket_profile([p.numel() * p.element_size() for p in params], plan),
                    {n: values[2 + i] for i, (n, _) in enumerate(CODINGS)},
                    {n: values[2 + k + i] for i, (n, _) in enumerate(CODINGS)})


def bucket_profile(nbytes: list[int], buckets: list[list[int]]) -> list[tuple[float, float]]:
    """The engine's `buckets` (parameter indices, in reduction order) over
    parameters of `nbytes` (registration order), as (share of all bytes,
    share of the backward after which the bucket is ready). Backward produces
    the last parameters first, and a parameter's share of the bytes stands
    for its share of the backward time: a bucket is ready once its
    earliest-registered parameter is."""
    total = sum(nbytes)
    if total == 0:
        return []
    return [(sum(nbytes[i] for i in b) / total, sum(nbytes[min(b):]) / total) for b in buckets]


def predict(m: Measured) -> list[Prediction]:
    """Every schedule x coding, fastest first (see the module docstring)."""
    out = []
    f = m.forward
    b = max(0.0, m.compute - m.forward)
    for coding, r in m.reduce.items():
        c = m.compute_under[coding]
        end = 0.0
        for share, ready in m.buckets:  # one reduction after another, each once ready
            end = max(end, ready * b) + share * r
        wfbp = f + max(b, end)
        out.append(Prediction("wfbp", coding, max(c, wfbp)))
        out.append(Prediction("priority", coding, max(c, wfbp - f / 2)))
        out.append(Prediction("decoupled", coding, max(c, r)))
    return sorted(out, key=lambda p: p.seconds)


#: how far a configuration departs from DDP's math, least first: on a
#: near-tie the advice takes the more faithful one
_CODING_ORDER = {name: k for k, (name, _) in enumerate(CODINGS)}
_SCHEDULE_ORDER = {"wfbp": 0, "priority": 1, "decoupled": 2}
#: "near": within this fraction of the fastest prediction
NEAR = 0.05
#: what each compression costs in accuracy, as measured (docs/benchmarks.md)
CAVEATS = {
    "fp16": "fp16: half precision on the wire, as DDP's fp16_compress_hook",
    "int8": "int8: one byte per element with error feedback; on the byte-level LM with "
            "AdamW +0.7% held-out loss against uncompressed (3 seeds)",
    "powersgd": "powersgd: rank-2 approximation with error feedback; on the byte-level LM "
                "with AdamW +15% held-out loss (torch DDP's PowerSGD hook alike): check "
                "your model's convergence before adopting it",
}


def choose(predictions: list[Prediction]) -> Prediction:
    """The configuration to use: among those predicted within NEAR of the
    fastest, the least compressed, then the least approximate schedule."""
    fastest = min(p.seconds for p in predictions)
    near = [p for p in predictions if p.seconds <= fastest * (1 + NEAR)]
    return min(near, key=lambda p: (_CODING_ORDER[p.coding], _SCHEDULE_ORDER[p.schedule]))


def run_configuration(factory: Factory, choice: Prediction, fusion_mb: float | None,
                      iterations: int) -> float:
    """Trains `iterations` (after 3 of warm-up) with the chosen configuration;
    median seconds per iteration on this rank."""
    import hemiola

    model, loss_fn = factory()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    compression = None if choice.coding == "none" else choice.coding
    wrapped, optimizer = hemiola.wrap(model, optimizer, schedule=choice.schedule,
                                      compression=compression, fusion_mb=fusion_mb,
                                      powersgd_start_iter=0)
    for _ in range(3):
        _training_step(wrapped, loss_fn, optimizer)
    seconds = _median_time(lambda: _training_step(wrapped, loss_fn, optimizer), iterations)
    wrapped.synchronize()
    return seconds


def advise_rank(rank: int, world: int, model_spec: str | None, fusion_mb: float | None,
                repeats: int, iterations: int) -> dict[str, Any]:
    """One rank's part (also under torchrun: rank and world from its environment)."""
    import hemiola

    hemiola.init()
    torch.set_num_threads(1)
    factory = load_factory(model_spec)
    model, loss_fn = factory()
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise ValueError(f"hemiola advise measures CPU models for now (this one is on "
                         f"{', '.join(sorted(devices))}): its compressions run on host buckets "
                         "only")
    measured = measure(model, loss_fn, repeats)
    predictions = predict(measured)
    choice = choose(predictions)
    seconds = run_configuration(factory, choice, fusion_mb, iterations)
    return {"measured": measured.__dict__, "predictions": [p.__dict__ for p in predictions],
            "choice": choice.__dict__, "run_seconds": seconds}


def report(result: dict[str, Any], world: int) -> str:
    """What rank 0 prints."""
    m = result["measured"]
    lines = [f"{world} ranks. Measured here (medians): computation {1e3 * m['compute']:.1f} ms "
             f"(forward {1e3 * m['forward']:.1f} ms); all-reduce of all gradients:"]
    for name, _ in CODINGS:
        lines.append(f"  {name:9s} {1e3 * m['reduce'][name]:8.1f} ms   (computation meanwhile "
                     f"{1e3 * m['compute_under'][name]:.1f} ms)")
    lines.append("Predicted time per iteration:")
    for p in result["predictions"]:
        compression = "" if p["coding"] == "none" else f", compression={p['coding']!r}"
        lines.append(f"  {1e3 * p['seconds']:8.1f} ms  schedule={p['schedule']!r}{compression}")
    best = result["choice"]
    measured = result["run_seconds"]
    error = measured / best["seconds"] - 1
    compression = "" if best["coding"] == "none" else f", compression={best['coding']!r}"
    lines.append(f"Use: hemiola.wrap(model, optimizer, schedule={best['schedule']!r}"
                 f"{compression})")
    if best["coding"] in CAVEATS:
        lines.append(f"  ({CAVEATS[best['coding']]})")
    lines.append(f"Checked: {1e3 * measured:.1f} ms per iteration measured against "
                 f"{1e3 * best['seconds']:.1f} ms predicted ({100 * error:+.0f}%).")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import os

    from hemiola.launch import run_local

    if args.local:
        results = run_local(advise_rank, args.local, args.model, args.fusion_mb, args.repeats,
                            args.iterations, timeout_s=1800)
        print(report(results[0], args.local))
        return 0
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    result = advise_rank(rank, world, args.model, args.fusion_mb, args.repeats, args.iterations)
    if rank == 0:
        print(report(result, world))
    return 0


def register(commands: Any) -> None:
    """Adds ``hemiola advise`` to the CLI."""
    p = commands.add_parser("advise", help="measure this model on this network and say which "
                                           "schedule and compression to use")
    p.add_argument("--model", metavar="MODULE:FUNCTION",
                   help="a function returning (model, loss_fn); default: a 9.4M-parameter MLP")
    p.add_argument("--local", type=int, metavar="N",
                   help="spawn N local ranks instead of running as one rank of torchrun")
    p.add_argument("--fusion-mb", type=float, default=None,
                   help="bucket cap of the checking run (default: the schedule's own)")
    p.add_argument("--repeats", type=int, default=5, help="repetitions per measurement")
    p.add_argument("--iterations", type=int, default=10,
                   help="iterations of the chosen configuration that check the prediction")
    p.set_defaults(run=main)

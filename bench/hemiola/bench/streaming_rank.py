"""One rank of ``hemiola bench streaming`` (:mod:`hemiola.bench.streaming`):
every contender of a run trained side by side in this process, in alternating
blocks of steps, on the same batches from the same initial parameters.

A contender is named (``parse``):

- ``compute``: the bare model, no communication (each rank alone on its shard);
- ``ddp``: torch DistributedDataParallel over Gloo;
- a :class:`~hemiola.bench.contender.Contender` with a per-step schedule, e.g.
  ``decoupled+int8``;
- ``streaming-hH[-fFtT|-auto][+CODING][@lrLmM][~mixA]``: ``hemiola.wrap(schedule="streaming",
  sync_every=H, fragments=F, overlap=T, compression=CODING, mix=A)`` (``-auto``:
  fragments and overlap left out, chosen after the first sync);
- ``torchft-hH[-fFtT][@lrLmM][~mixA]``: torchft's ``torchft.local_sgd.DiLoCo``
  with F fragments (``torchft_fragments``: the parameters in registration order
  cut into F contiguous pieces of about equal size, as hemiola cuts them, but
  at whole tensors) and ``fragment_sync_delay`` T, each fragment one bucket;
  each rank a replica group of one with its own TCPStore, a
  ``torchft.Manager`` and rank 0 hosting the ``LighthouseServer``. Float32
  only: its quantisation needs triton (GPU kernels).

Every inner optimizer is the task's (AdamW, warmup + cosine); every outer one
is SGD, by default DiLoCo's (lr 0.7, momentum 0.9, Nesterov); ``@lrLmM`` sets
its learning rate L and momentum M (Nesterov when M > 0): ``@lr1m0`` is plain
averaging of the models (local SGD). ``~mixA`` merges a landed fragment as
Streaming DiLoCo does, ``A * local + (1 - A) * shared`` (torchft's
``fragment_update_alpha``); without it hemiola's merge is its eager one and
torchft's its default (alpha 0: the shared copy).
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: ``streaming-h20-f2t1+int8`` / ``torchft-h20``
LOW_COMM = re.compile(r"(?P<kind>streaming|torchft)-h(?P<h>\d+)"
                      r"(?:-f(?P<f>\d+)t(?P<t>\d+)|(?P<auto>-auto))?(?:\+(?P<coding>\w+))?"
                      r"(?:@lr(?P<lr>[0-9.]+)m(?P<m>[0-9.]+))?(?:~mix(?P<mix>[0-9.]+))?")
#: bytes per element on the wire of each coding (int8 and int4: one float32
#: scale per 256 elements)
CODING_BYTES = {"": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 256,
                "int4": 0.5 + 4.0 / 256}
#: DiLoCo's outer optimizer, torchft's and hemiola's default alike
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


@dataclass(frozen=True)
class Spec:
    """What a contender name means: its kind (compute, ddp, hemiola, streaming,
    torchft), the hemiola contender name for per-step ones, H (1 for per-step,
    0 for compute), fragments, overlap (tau) and the wire's coding."""

    name: str
    kind: str
    h: int = 1
    fragments: int | None = 1  # None (with overlap None): left to hemiola (-auto)
    overlap: int | None = 0
    coding: str = ""
    outer_lr: float = OUTER["lr"]  # type: ignore[assignment]
    outer_momentum: float = OUTER["momentum"]  # type: ignore[assignment]
    mix: float | None = None  # the merge's alpha; None: the library's default merge

    @property
    def outer(self) -> dict[str, Any]:
        """The outer SGD's arguments (Nesterov whenever it has momentum)."""
        return {"lr": self.outer_lr, "momentum": self.outer_momentum,
                "nesterov": self.outer_momentum > 0}

    @property
    def label(self) -> str:
        """How the contender reads in a table."""
        if self.kind == "compute":
            return "bare model (1 rank's computation, no communication)"
        if self.kind == "ddp":
            return "torch DDP (per step)"
        if self.kind == "hemiola":
            from hemiola.bench.contender import Contender

            return Contender.parse(self.name).label + " (per step)"
        lib = "torchft DiLoCo" if self.kind == "torchft" else "hemiola streaming"
        shape = ""
        if self.fragments is None:
            shape = ", F and τ chosen after the first sync"
        elif self.fragments > 1 or self.overlap:
            shape = f", F={self.fragments} τ={self.overlap}"
        outer = ""
        if (self.outer_lr, self.outer_momentum) != (OUTER["lr"], OUTER["momentum"]):
            outer = (", averaging (outer lr 1, no momentum)"
                     if (self.outer_lr, self.outer_momentum) == (1.0, 0.0) else
                     f", outer lr {self.outer_lr:g} momentum {self.outer_momentum:g}")
        mix = "" if self.mix is None else f", mix {self.mix:g}"
        return (f"{lib} H={self.h}{shape}" + (f" + {self.coding}" if self.coding else "")
                + outer + mix)


def parse(name: str) -> Spec:
    """The :class:`Spec` of contender `name`; ValueError when unknown."""
    if name in ("compute", "ddp"):
        return Spec(name, name, h=0 if name == "compute" else 1)
    m = LOW_COMM.fullmatch(name)
    if m:
        h, f, t = int(m["h"]), int(m["f"] or 1), int(m["t"] or 0)
        auto = bool(m["auto"])
        coding = m["coding"] or ""
        if coding not in CODING_BYTES:
            raise ValueError(f"{name}: unknown coding {coding!r}; known: "
                             f"{', '.join(c for c in CODING_BYTES if c)}")
        if m["kind"] == "torchft" and (coding or auto):
            raise ValueError(f"{name}: torchft's DiLoCo sends float32 on a CPU (its "
                             "should_quantize needs triton's GPU kernels) and has no chosen "
                             "shape: write torchft-hH[-fFtT][@lrLmM][~mixA]")
        if m["kind"] == "torchft" and f and h % f:
            raise ValueError(f"{name}: torchft's DiLoCo needs H to be a multiple of F")
        if h < 1 or f < 1 or (t and t * f >= h):
            raise ValueError(f"{name}: needs H >= 1, F >= 1 and tau < H/F")
        lr = float(m["lr"]) if m["lr"] else OUTER["lr"]
        momentum = float(m["m"]) if m["m"] else OUTER["momentum"]
        if not (0 < lr and 0 <= momentum < 1):  # type: ignore[operator]
            raise ValueError(f"{name}: the outer lr must be positive and its momentum in [0, 1)")
        mix = float(m["mix"]) if m["mix"] else None
        if mix is not None and not 0 <= mix <= 1:
            raise ValueError(f"{name}: the mix must be in [0, 1]")
        return Spec(name, m["kind"], h, None if auto else f,  # type: ignore[arg-type]
                    None if auto else t, coding, lr, momentum, mix)
    from hemiola.bench.contender import Contender

    contender = Contender.parse(name)  # raises ValueError on unknown names
    if contender.is_ddp or contender.schedule == "streaming":
        raise ValueError(f"{name}: write ddp, or streaming-hH[-fFtT][+CODING]")
    return Spec(name, "hemiola", coding=contender.compression)


def previews(spec: Spec, optimizer: str) -> bool:
    """Whether `spec` sends decoupled's preview codes too: ``decoupled`` (not
    ``decoupled-own``) with an Adam-family inner optimizer (named `optimizer`)."""
    if spec.kind != "hemiola" or optimizer not in ("Adam", "AdamW"):
        return False
    from hemiola.bench.contender import Contender

    schedule, options = Contender.parse(spec.name).wrap_arguments()
    return schedule == "decoupled" and options.get("preview") is not False


def bytes_per_token(spec: Spec, params: int, world: int, tokens_per_step: int,
                    optimizer: str = "") -> float:
    """Bytes one rank sends per token it trains, by the formula
    2 (N-1)/N * P * b / (H * tokens per rank per step): an all-reduce (ring)
    of P elements of b bytes sends 2 (N-1)/N of them per rank; per-step
    methods do that every step (H = 1), DiLoCo once per H steps (its F
    fragments add up to the model). b is the coding's (``CODING_BYTES``),
    plus 1 where decoupled's preview sends its one-byte codes too
    (``previews``). 0 for the bare model."""
    if spec.kind == "compute":
        return 0.0
    if spec.coding not in CODING_BYTES:
        return math.nan
    b = CODING_BYTES[spec.coding] + (1.0 if previews(spec, optimizer) else 0.0)
    return 2 * (world - 1) / world * params * b / (spec.h * tokens_per_step)


def tx_bytes(iface: str) -> int | None:
    """Bytes this network namespace has sent through `iface` (/proc/self/net/dev)."""
    try:
        for line in Path("/proc/self/net/dev").read_text().splitlines():
            name, sep, counters = line.partition(":")
            if sep and name.strip() == iface:
                return int(counters.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class Run:
    """One contender's training state and what is measured of it."""

    spec: Spec
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: int = 0
    seconds: float = 0.0  # training wall time, evaluations excluded
    step_ms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    #: this rank's `seconds` at each evaluation after the first (every rank)
    eval_seconds: list[float] = field(default_factory=list)
    tx: int = 0  # bytes sent through the rank's link during its blocks
    closers: list[Any] = field(default_factory=list)


class TorchFT:
    """What torchft's DiLoCo needs on this rank, per torchft contender k: a
    lighthouse (rank 0 hosts them all, at port + 20 + k: a lighthouse forms
    its quorums from every replica that heartbeats to it), a TCPStore of this
    rank's own (port + 30 + 2k + rank: every lighthouse numbers its quorums
    from 1, and a quorum's process group meets under that number in the
    store) and a Manager (port + 50 + 2k + rank; a replica group of one rank:
    replica ``bench<rank>``, group rank 0). At most ``MAX`` contenders."""

    MAX = 10

    def __init__(self, rank: int, world: int, port: int, contenders: int) -> None:
        from torchft.coordination import LighthouseServer

        if contenders > self.MAX:
            raise ValueError(f"at most {self.MAX} torchft contenders, got {contenders}")
        self.rank, self.world, self.port = rank, world, port
        self.addr = _own_address()
        self.master = os.environ["MASTER_ADDR"]
        self.lighthouses = []
        if rank == 0:
            self.lighthouses = [LighthouseServer(bind=f"{self.addr}:{port + 20 + k}",
                                                 min_replicas=world)
                                for k in range(contenders)]
        self.stores = [dist.TCPStore(self.addr, port + 30 + 2 * k + rank, is_master=True,
                                     wait_for_workers=False) for k in range(contenders)]
        self.managers = 0

    def wrap(self, model: nn.Module, inner: torch.optim.Optimizer, spec: Spec) -> list[Any]:
        """A Manager and an entered ``DiLoCo`` around `model` and `inner` with
        `spec`'s H, fragments, delay, outer step and mix; returns what closes
        them, in order."""
        from torchft import Manager
        from torchft.local_sgd import DiLoCo
        from torchft.process_group import ProcessGroupGloo

        k = self.managers
        self.managers += 1
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=300)), load_state_dict=None,
            state_dict=None, min_replica_size=self.world, use_async_quorum=False,
            replica_id=f"bench{self.rank}", store_addr=self.addr,
            store_port=self.port + 30 + 2 * k + self.rank,
            lighthouse_addr=f"http://{self.master}:{self.port + 20 + k}",
            rank=0, world_size=1, port=self.port + 50 + 2 * k + self.rank,
            hostname=self.addr, init_sync=False, timeout=timedelta(seconds=300),
            quorum_timeout=timedelta(seconds=300))
        fragments = spec.fragments or 1
        pieces = torchft_fragments(model, fragments) if fragments > 1 else [model]
        # one outer optimizer per fragment: a single one over the whole model
        # would also step the fragments not being synced, with whatever
        # .grad holds then (the last inner gradient)
        outer = [torch.optim.SGD(piece.parameters(), **spec.outer) for piece in pieces]
        diloco = DiLoCo(manager, pieces, inner, outer, sync_every=spec.h, pin_memory=False,
                        use_bucketization=True, fragment_sync_delay=spec.overlap or 0,
                        fragment_update_alpha=spec.mix or 0.0)
        diloco.__enter__()
        return [lambda: diloco.__exit__(None, None, None), lambda: manager.shutdown(wait=False)]

    def close(self) -> None:
        """Shuts the lighthouses down (rank 0)."""
        for lighthouse in self.lighthouses:
            lighthouse.shutdown()


def torchft_fragments(model: nn.Module, count: int) -> list[nn.Module]:
    """`model`'s parameters cut into `count` contiguous modules of about equal
    size for torchft's DiLoCo (each holds the model's own Parameter objects;
    a tensor belongs to the piece its first element falls in)."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in params)
    pieces = [nn.Module() for _ in range(count)]
    seen = 0
    for name, p in params:
        k = min(count - 1, seen * count // total)
        pieces[k].register_parameter(name.replace(".", "__"), p)
        seen += p.numel()
    if any(not list(piece.parameters()) for piece in pieces):
        raise ValueError(f"the model has too few parameter tensors for {count} fragments")
    return pieces


def _own_address() -> str:
    """This rank's address on its link: rank 0's is MASTER_ADDR; under netlab
    rank r has 10.233.0.(r + 1); on loopback every rank has 127.0.0.1."""
    master = os.environ["MASTER_ADDR"]
    if master.startswith("127."):
        return master
    head, _, _ = master.rpartition(".")
    return f"{head}.{int(os.environ['RANK']) + 1}"


def build(spec: Spec, task: Any, total: int, seed: int, ft: TorchFT | None) -> Run:
    """`spec`'s model (seeded: the same initial parameters for every
    contender), optimizer and learning-rate schedule."""
    import hemiola
    from hemiola.bench.contender import Contender
    from hemiola.bench.ddp import ddp_with_hook

    torch.manual_seed(seed)
    model = task.model()
    closers: list[Any] = []
    if spec.kind == "ddp":
        model = ddp_with_hook(model)
    optimizer = task.optimizer(model)
    if spec.kind == "hemiola":
        schedule, options = Contender.parse(spec.name).wrap_arguments()
        model, optimizer = hemiola.wrap(model, optimizer, schedule=schedule, **options)
    elif spec.kind == "streaming":
        model, optimizer = hemiola.wrap(
            model, optimizer, schedule="streaming", sync_every=spec.h,
            fragments=spec.fragments, overlap=spec.overlap, compression=spec.coding or None,
            outer_lr=spec.outer_lr, outer_momentum=spec.outer_momentum,
            outer_nesterov=spec.outer_momentum > 0, mix=spec.mix)
    elif spec.kind == "torchft":
        if ft is None:
            raise RuntimeError("torchft is not set up on this rank")
        closers = ft.wrap(model, optimizer, spec)
    return Run(spec, model, optimizer, task.lr_scheduler(optimizer, total), closers=closers)


def evaluate(run: Run, task: Any, windows: int) -> float:
    """Held-out loss of rank 0's parameters on the first `windows` held-out windows."""
    import torch.nn.functional as F

    module = getattr(run.model, "module", run.model)
    w = task.windows(task.tokens[task.split:], 0)[:windows]
    total, count = 0.0, 0
    module.eval()
    with torch.no_grad():
        for chunk in w.split(128):
            logits = module(chunk[:, :-1])
            total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(),
                                     reduction="sum").item()
            count += chunk[:, 1:].numel()
    module.train()
    return total / count


def block(run: Run, task: Any, batches: Any, n: int, iface: str) -> None:
    """`n` steps of `run`, each timed; the block ends by landing what is still
    on the wire (``synchronize()``), timed into its last step."""
    drain = getattr(run.model, "synchronize", None)
    sent = tx_bytes(iface)
    for i in range(n):
        x, y = batches(run.step)
        start = time.perf_counter()
        run.optimizer.zero_grad()
        loss = task.loss(run.model, x, y)
        loss.backward()
        run.optimizer.step()
        run.scheduler.step()
        if i == n - 1 and drain is not None:
            drain()
        elapsed = time.perf_counter() - start
        run.seconds += elapsed
        run.step_ms.append(1e3 * elapsed)
        run.losses.append(loss.item())
        run.step += 1
    after = tx_bytes(iface)
    if sent is not None and after is not None:
        run.tx += after - sent


def worker(config: dict[str, Any]) -> dict[str, Any]:
    """One rank (RANK, WORLD_SIZE, MASTER_*, GLOO_SOCKET_IFNAME set): every
    contender of ``config["contenders"]`` for ``config["steps"]`` steps in
    alternating blocks of ``config["eval_every"]``, rank 0 evaluating each at
    every block's end. Returns rank 0's measurements per contender, and every
    rank's training seconds (``seconds_ranks``)."""
    import hemiola
    from hemiola.bench.tasks import TASKS

    torch.set_num_threads(1)
    hemiola.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    task = TASKS[config["task"]]()
    seed, total, every = config["seed"], config["steps"], config["eval_every"]
    specs = [parse(c) for c in config["contenders"]]
    ft = None
    if any(s.kind == "torchft" for s in specs):
        ft = TorchFT(rank, world, int(os.environ["MASTER_PORT"]),
                     sum(s.kind == "torchft" for s in specs))
        dist.barrier()  # the lighthouse is up before any Manager dials it
    runs = [build(s, task, total, seed, ft) for s in specs]

    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    per_epoch = max(1, len(task.epoch_samples(seed, 0)[0]) // (task.batch_size * world))

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step not in cache:
            epoch, i = divmod(step, per_epoch)
            x_all, y_all = task.epoch_samples(seed, epoch)
            g = torch.Generator().manual_seed(1_000_003 * seed + epoch)
            mine = torch.randperm(len(x_all), generator=g)[rank::world]
            idx = mine[i * task.batch_size:(i + 1) * task.batch_size]
            cache[step] = (x_all[idx], y_all[idx])
        return cache[step]

    iface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    progress = config.get("progress")
    if rank == 0:
        for run in runs:
            run.evals.append({"step": 0, "seconds": 0.0,
                              "heldout_loss": evaluate(run, task, config["eval_windows"])})
    done = 0
    while done < total:
        n = min(every, total - done)
        order = runs if (done // every) % 2 == 0 else runs[::-1]
        for run in order:
            dist.barrier()
            block(run, task, batches, n, iface)
            run.eval_seconds.append(run.seconds)
            if rank == 0:
                run.evals.append({"step": run.step, "seconds": run.seconds,
                                  "heldout_loss": evaluate(run, task, config["eval_windows"])})
        done += n
        if progress and rank == 0:
            Path(progress).write_text(str(done))
    dist.barrier()
    # The job goes at its slowest rank's pace, whatever the method: the
    # rows' times are the slowest rank's (rank 0 alone would hide a peer's
    # slower computation in the bare model and show it as waiting elsewhere).
    seconds_ranks: list[Any] = [None] * world  # all_gather_object fills every entry
    dist.all_gather_object(seconds_ranks, [(run.seconds, run.eval_seconds) for run in runs])
    if rank == 0:  # each evaluation's time is the slowest rank's too
        for k, run in enumerate(runs):
            for i, evaluation in enumerate(run.evals[1:]):
                evaluation["seconds_ranks"] = [s[k][1][i] for s in seconds_ranks]
                evaluation["seconds"] = max(evaluation["seconds_ranks"])
    params = sum(p.numel() for p in getattr(runs[0].model, "module", runs[0].model).parameters()
                 if p.requires_grad)
    out = {"params": params, "tokens_per_step": task.batch_size * task.context,
           "optimizer": type(task.optimizer(task.model())).__name__,
           "iface": iface, "runs": {}}
    for k, run in enumerate(runs):
        stats = run.model.stats() if hasattr(run.model, "stats") else {}
        out["runs"][run.spec.name] = {
            "seconds": run.seconds, "step_ms": run.step_ms, "losses": run.losses,
            "seconds_ranks": [s[k][0] for s in seconds_ranks],
            "evals": run.evals, "tx_bytes": run.tx if iface != "lo" else None,
            "stats": {k: float(v) for k, v in stats.items()}}
    for run in runs:
        for close in run.closers:
            close()
    if ft is not None:
        dist.barrier()
        ft.close()
    return out

"""``schedule="streaming"``: low-communication training (DiLoCo, Streaming
DiLoCo) on the engine's :class:`~hemiola._C.Streamer`.

Each rank steps its own optimizer (the inner one: any ``torch.optim``
optimizer, untouched) on its own data; gradients never travel. After every
inner step the engine counts it and, every ``sync_every`` steps per fragment,
averages the fragment's pseudo-gradient (the shared copy minus this rank's
parameters) on a wire of its own and steps the shared copy with the outer
optimizer (SGD, DiLoCo's lr 0.7, momentum 0.9, Nesterov); see
``cpp/include/hemiola/streamer.h`` for the math and docs/streaming.md for
when to use it.

The engine's streamer reads and writes host memory. A CPU model's parameters
are that memory; a GPU model gets a host copy of its parameters, and only the
fragments a step sends or lands cross the bus, around that step (one
fragment per ``sync_every / fragments`` steps), so the shared copy, the outer
momentum and the coding all live on the host and take no GPU memory.

A replica may be a group of ranks (``replica_ranks``; hemiola.replica_groups):
inside it every inner step's gradients are averaged as ``wfbp`` averages
them, by a :class:`~hemiola.DataParallel` over the group's engine, and the
streamer averages across groups, each rank carrying its piece of every
fragment.

The optimizer's ``state_dict()`` carries the streaming state (the shared
copy, the outer momentum, the coding's residuals, the step count and the
fragment in flight) under ``"hemiola_streaming"``, so a checkpoint of the
model and the optimizer resumes the run exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hemiola._native import C
from hemiola.config import RESIDUAL_CODINGS, STREAMING_CODINGS, Config, compression_code, spelled
from hemiola.data_parallel import DataParallel
from hemiola.elastic.replica import ElasticReplica
from hemiola.engine_tensors import broadcast_tensors, dtype_code
from hemiola.streaming_checkpoint import agree_across_ranks, check_layout, warn_if_resized
from hemiola.streaming_shape import FirstSyncProbe, announce, choose
from hemiola.validate import check_module, check_same_model

#: the optimizer state_dict key that holds the streaming state
STATE_KEY = "hemiola_streaming"

log = logging.getLogger("hemiola")


#: the default merge's a for a fragment that travelled under later steps
#: (Streaming DiLoCo's; it measured ahead of the eager merge: docs/streaming.md)
DEFAULT_MIX = 0.5


def merge_mix(mix: float | str | None, overlap: int) -> float:
    """The engine's ``StreamerOptions::mix`` for ``Config.mix`` (negative:
    the eager merge, which after a blocking sync is the shared copy)."""
    if mix is None:
        return DEFAULT_MIX if overlap > 0 else -1.0
    return -1.0 if mix == "eager" else float(mix)


def _warn_if_never_synced(streamer: Any, sync_every: int, rank: int) -> None:
    steps = streamer.inner_steps
    if steps and not streamer.syncs and rank == 0:
        warnings.warn(
            f"hemiola streaming: {steps} inner steps and no sync (sync_every={sync_every}): "
            "each rank ended with its own parameters. Set sync_every below the run's length "
            "(it counts optimizer steps), or use a per-step schedule for a run this short.",
            stacklevel=1)


class StreamingParallel(nn.Module):
    """The wrapped model of ``schedule="streaming"`` (made by
    :func:`hemiola.wrap`). Forward and backward are the module's own; the
    parameters are broadcast from rank 0 when wrapped and synchronised by the
    engine after the optimizer's steps. ``state_dict()`` is the module's own."""

    def __init__(self, module: nn.Module, config: Config, engine: C.Engine, store: C.Store,
                 optimizer: torch.optim.Optimizer, host_copy: bool | None = None,
                 group: tuple[C.Engine, C.Store] | None = None,
                 elastic: ElasticReplica | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        """`engine`: across the replicas. `group`: this rank's replica group's
        engine and store (None: the rank is a replica alone). `elastic`: the
        membership of an elastic run (`engine` is its epoch's).
        `grad_scaler`: the GradScaler that steps the optimizer, whose skipped
        steps are counted too (:meth:`_count_skipped_steps`). `host_copy`:
        keep a host copy of the parameters for the engine (None: when the
        model is not on the CPU; True on a CPU model runs the GPU path's
        copies on the CPU, for tests)."""
        super().__init__()
        device = check_module(module)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("schedule='streaming' needs a torch.optim.Optimizer (the inner "
                            f"optimizer), got {type(optimizer).__name__}")
        self.module = module
        self._config = config
        self._engine = engine
        self._elastic = elastic
        check_same_model(engine, store, module, config)
        if elastic is None or not elastic.joining:
            # Across the groups first: then the first rank of every group
            # holds rank 0's values, and the group's broadcast (DataParallel's)
            # hands them to the rest. (A group joining an elastic run is
            # handed the shared copy instead, once its streamer exists.)
            broadcast_tensors(engine, [*module.parameters(), *module.buffers()])
        #: what forward runs: inside a group, the group's per-step schedule
        #: (kept out of the module registry: the module's state is self.module's)
        inner: nn.Module = module
        if group is not None:
            check_same_model(group[0], group[1], module, config)
            per_step = dataclasses.replace(config, schedule="wfbp", compression=None,
                                           coordinator=None)
            inner = DataParallel(module, per_step, group[0], group[1], None, optimizer)
        object.__setattr__(self, "_inner", inner)
        self._group = None if group is None else group[0]
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        covered = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [n for n, p in named if id(p) not in covered]
        if missing:
            raise ValueError(f"the optimizer does not step parameter(s) {missing[:4]}: under "
                             "schedule='streaming' it must cover every trainable parameter of "
                             "the model (build it over model.parameters())")
        for n, p in named:
            if not p.is_contiguous():
                raise ValueError(f"parameter {n!r} is not contiguous; the engine reads "
                                 "parameters in place (make it contiguous before wrapping)")
        self._params = [p for _, p in named]
        if host_copy is None:
            host_copy = device.type != "cpu"
        #: what the engine reads and writes: the parameters, or their host copy
        self._host = ([p.detach().to("cpu", copy=True) for p in self._params] if host_copy
                      else self._params)
        self._streamed = [(n, h.data_ptr(), dtype_code(h.dtype), h.numel())
                          for (n, _), h in zip(named, self._host)]
        # Fragments and overlap left out: blocking with one fragment until the
        # first sync has been timed (streaming_shape.py).
        shape_left_out = config.fragments is None and config.overlap is None
        self._probe = (FirstSyncProbe(config.sync_every)
                       if shape_left_out and elastic is None else None)
        if shape_left_out and elastic is not None:
            log.info("hemiola streaming: elastic, so fragments=1 and overlap=0 (choosing them "
                     "takes every replica at the first sync; set them to overlap the wire)")
        self._streamer = self._make_streamer(config.fragments or 1, config.overlap or 0)
        self._hooks = [
            optimizer.register_step_post_hook(lambda *_: self._on_optimizer_step()),
            optimizer.register_state_dict_post_hook(self._save_into),
            optimizer.register_load_state_dict_pre_hook(self._take_from),
        ]
        self._hooks.append(
            optimizer.register_load_state_dict_post_hook(lambda *_: self._restore()))
        self._pending_load: dict[str, Any] | None = None
        self._fragment_params = self._streamer.fragments()
        #: waited_ms and host_ms of a streamer replaced by _reshape
        self._waited_before_ms = 0.0
        self._host_before_ms = 0.0
        # A run shorter than sync_every never synchronises: say so when the
        # model goes (or the interpreter ends), rather than end apart silently.
        self._never_synced = weakref.finalize(
            self, _warn_if_never_synced, self._streamer, config.sync_every,
            dist.get_rank() if dist.is_initialized() else 0)
        self._stepped_since_update = False
        if grad_scaler is not None:
            self._count_skipped_steps(grad_scaler)
        if elastic is not None:
            elastic.attach(self)

    def _make_streamer(self, fragments: int, overlap: int) -> Any:
        config = self._config
        return C.make_streamer(
            self._engine, self._streamed, sync_every=config.sync_every, fragments=fragments,
            overlap=overlap, outer_lr=config.outer_lr, outer_momentum=config.outer_momentum,
            outer_nesterov=(config.outer_momentum > 0 if config.outer_nesterov is None
                            else config.outer_nesterov),
            compression=compression_code(config.compression), mix=merge_mix(config.mix, overlap),
            check_finite=config.check_finite, group=self._group,
            confirm=self._elastic is not None)

    @property
    def config(self) -> Config:
        """The configuration the model was wrapped with."""
        return self._config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner(*args, **kwargs)

    @property
    def replica_ranks(self) -> int:
        """Ranks per replica (1: every rank a replica of its own)."""
        return 1 if self._group is None else self._group.world_size

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's accumulation idiom: in a replica group, the group's gradients
        are not averaged inside it; alone, nothing travels per step anyway."""
        if isinstance(self._inner, DataParallel):
            with self._inner.no_sync():
                yield
        else:
            yield

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """DDP's ``register_comm_hook`` does not apply: no gradient travels
        under ``streaming`` (each rank steps alone; the parameters' progress
        is averaged every ``sync_every`` steps). Refused, saying what to use."""
        raise RuntimeError(
            "register_comm_hook: schedule='streaming' reduces no gradients (each rank takes its "
            "inner steps alone and the parameters' progress is averaged every sync_every "
            "steps), so DDP's communication hooks do not apply. To compress the averages, "
            "wrap with compression="
            + spelled(tuple(name for name in STREAMING_CODINGS if name != "none"))
            + "; to keep a hook, use a per-step schedule (schedule='wfbp', 'priority' or "
            "'decoupled').")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips this rank's gradients by their global norm: the inner step is
        local, so this is torch's ``clip_grad_norm_`` over the module's
        parameters (what a DiLoCo worker clips), here so that a script that
        clips through the wrapped model runs under every schedule."""
        return nn.utils.clip_grad_norm_(self._params, max_norm, norm_type)

    def synchronize(self) -> None:
        """Waits for the fragment on the wire (it still lands after its
        step). The ranks' parameters stay their own: between syncs they
        differ. For the same parameters on every rank now (an evaluation or a
        save mid-run), call :meth:`average_parameters`."""
        if self._elastic is not None:
            self._elastic.wait(self)
        else:
            self._streamer.wait_in_flight()

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Collective: every rank's parameters become the replicas' average,
        now, so that every rank holds the same model (the blocking sync a DDP
        user expects before an evaluation or a save mid-run). Nothing of the
        schedule changes: the shared copy and the outer momentum stay, the
        fragment in flight still lands after its step (merged onto the
        averaged values), and the syncs go on as before."""
        self._streamer.wait_in_flight()
        average = C.ReduceOp.average
        for param, host in zip(self._params, self._host):
            if host is not param:
                host.copy_(param)
            self._engine.all_reduce(host.data_ptr(), dtype_code(host.dtype), host.numel(),
                                    average).wait()
            if host is not param:
                param.copy_(host)

    def stats(self) -> dict[str, float]:
        """Inner steps, syncs so far, how long steps waited for averages
        (``waited_ms``) and worked on the syncs besides (``host_ms``), the
        ranks per replica, and the fragments and overlap in use."""
        s = self._streamer
        options = s.options()
        elastic = {} if self._elastic is None else {
            "epoch": float(self._elastic.epoch.number),
            "replicas": float(self._elastic.epoch.world),
            "membership_changes": float(len(self._elastic.recoveries)),
            "stall_s": float(sum(r.stall_s for r in self._elastic.recoveries))}
        return {**elastic, "inner_steps": float(s.inner_steps), "syncs": float(s.syncs),
                "waited_ms": float(s.waited_ms) + self._waited_before_ms,
                "host_ms": float(s.host_ms) + self._host_before_ms,
                "replica_ranks": float(self.replica_ranks),
                "fragments": float(options["fragments"]), "overlap": float(options["overlap"])}

    def timeline(self) -> str:
        """Chrome trace JSON of engine events (``timeline=True`` to record):
        the outer lane's averages of each fragment."""
        return self._engine.timeline_json()

    def fragments(self) -> list[list[str]]:
        """The parameters of each fragment, by name (a large one may be cut
        across two)."""
        names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        return [[names[i] for i in f] for f in self._streamer.fragments()]

    def _on_optimizer_step(self) -> None:
        self._stepped_since_update = True
        self._after_inner_step()

    def _count_skipped_steps(self, scaler: torch.amp.GradScaler) -> None:
        """A GradScaler skips ``optimizer.step()`` on a rank whose gradients
        overflowed, and here the gradients are each rank's own: one rank
        would count a step fewer and end at a different sync than the others
        (after ``timeout_s``, blaming a rank). So the step is counted at
        ``scaler.update()`` when the optimizer did not step since the last
        one: the schedule stays in step, that rank's parameters unchanged."""
        original = scaler.update
        model = weakref.ref(self)

        def update(new_scale: float | torch.Tensor | None = None) -> None:
            original(new_scale)
            me = model()
            if me is None:
                return
            if not me._stepped_since_update:
                me._after_inner_step()  # the scaler skipped it: counted, nothing moved
            me._stepped_since_update = False

        scaler.update = update  # type: ignore[method-assign]

    @torch.no_grad()
    def _after_inner_step(self) -> None:
        probe = self._probe
        if probe is not None:
            probe.before_step(self._streamer.inner_steps + 1)
        self._count_inner_step()
        if probe is not None and self._streamer.inner_steps >= probe.sync_every:
            self._probe = None
            self._choose_shape(probe)

    def _choose_shape(self, probe: FirstSyncProbe) -> None:
        """After the first (blocking, one-fragment) sync: the fragments and
        overlap that hide the measured wire time, rank 0's choice on every
        rank (streaming_shape.py)."""
        shape = choose(self._streamer.waited_ms, probe.step_ms(), self._config.sync_every)
        agreed = torch.tensor([shape.fragments, shape.overlap], dtype=torch.int64)
        broadcast_tensors(self._engine, [agreed])  # across the replicas
        if self._group is not None:
            broadcast_tensors(self._group, [agreed])  # and inside each one
        fragments, overlap = (int(v) for v in agreed)
        announce(shape, dist.get_rank())  # rank 0's, which every rank now has
        if (fragments, overlap) != (1, 0):
            self._reshape(fragments, overlap)

    def _reshape(self, fragments: int, overlap: int) -> None:
        """A new streamer with `fragments` and `overlap` in place of the
        blocking one-fragment one, between syncs (nothing in flight): the
        shared copy, the outer momentum, the step count and the residuals
        carried over. The one fragment's layout is the parameters in order,
        and so is the new fragments' one after another (one dtype)."""
        old = self._streamer
        self._never_synced.detach()  # it has synced; and the old streamer may go
        if len({p.dtype for p in self._params}) != 1:
            log.info("hemiola streaming: the parameters have several dtypes; the fragments "
                     "and overlap stay as they are")
            return
        dtype = self._params[0].dtype
        shared = torch.frombuffer(old.shared_view(0), dtype=dtype).clone()
        momentum = torch.frombuffer(old.outer_momentum_view(0), dtype=dtype).clone()
        started = old.momentum_started()[0]
        residuals = self._residuals()
        kept = None if residuals is None else [r.clone() for r in residuals]
        steps, waited, host = old.inner_steps, old.waited_ms, old.host_ms
        self._streamer = new = self._make_streamer(fragments, overlap)
        self._waited_before_ms += waited
        self._host_before_ms += host
        at = 0
        for f in range(len(new.fragments())):
            s_view, m_view = self._views(f)
            s_view.copy_(shared[at:at + s_view.numel()])
            m_view.copy_(momentum[at:at + m_view.numel()])
            at += s_view.numel()
        new.restore(steps, [started] * len(new.fragments()), -1, 0)
        mine = self._residuals()
        if kept is not None and mine is not None:
            for ours, theirs in zip(mine, kept):
                ours.copy_(theirs)
        self._fragment_params = new.fragments()

    def _step_streamer(self) -> None:
        if self._elastic is None:
            self._streamer.after_inner_step()
        else:
            self._elastic.step(self)

    def _copy_host_to_params(self) -> None:
        if self._host is not self._params:
            for param, host in zip(self._params, self._host):
                param.copy_(host)

    def _count_inner_step(self) -> None:
        if self._host is self._params:
            self._step_streamer()
            return
        # Only the fragments this step sends or lands are read or written:
        # those cross (whole parameters: a parameter cut across two
        # fragments is refreshed whole, and written back unchanged where
        # the step did not touch it).
        touched = sorted({i for f in self._streamer.next_step_fragments()
                          for i in self._fragment_params[f]})
        for i in touched:
            self._host[i].copy_(self._params[i])
        self._step_streamer()
        for i in touched:
            self._params[i].copy_(self._host[i])

    # ---- checkpoints, through the optimizer's state_dict -------------------

    def _views(self, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._streamer
        dtype = self._fragment_dtype(f)
        return (torch.frombuffer(s.shared_view(f), dtype=dtype),
                torch.frombuffer(s.outer_momentum_view(f), dtype=dtype))

    def _fragment_dtype(self, f: int) -> torch.dtype:
        return self._params[self._streamer.fragments()[f][0]].dtype

    def _residuals(self) -> list[torch.Tensor] | None:
        if self._config.compression not in RESIDUAL_CODINGS:
            return None
        out = []
        for i, p in enumerate(self._params):
            view = self._streamer.residual_view(i)
            out.append(torch.empty(0) if view is None or p.dtype != torch.float32
                       else torch.frombuffer(view, dtype=torch.float32))
        return out

    def _save_into(self, _optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        s = self._streamer
        fragment = s.in_flight_fragment
        in_flight = None
        if fragment >= 0:
            dtype = self._fragment_dtype(fragment)
            in_flight = {
                "fragment": fragment, "step": s.in_flight_step,
                "average": torch.frombuffer(s.in_flight_average_view(), dtype=dtype).clone(),
                "base": torch.frombuffer(s.in_flight_base_view(), dtype=dtype).clone(),
            }
        residuals = self._residuals()
        options = s.options()
        state[STATE_KEY] = {
            "fragments": options["fragments"], "overlap": options["overlap"],
            "replicas": self._engine.world_size, "replica_ranks": self.replica_ranks,
            "inner_steps": s.inner_steps,
            "momentum_started": list(s.momentum_started()),
            "shared": [self._views(f)[0].clone() for f in range(len(s.fragments()))],
            "outer_momentum": [self._views(f)[1].clone() for f in range(len(s.fragments()))],
            "residuals": None if residuals is None else [r.clone() for r in residuals],
            "in_flight": in_flight,
        }
        return state

    def _take_from(self, _optimizer: Any, state: dict[str, Any]) -> None:
        # torch's own load would choke on the extra key: take it out first.
        self._pending_load = state.pop(STATE_KEY, None)

    def _restore(self) -> None:
        saved, self._pending_load = self._pending_load, None
        if saved is None:
            return
        if (self._probe is not None and "fragments" in saved
                and (saved["fragments"], saved["overlap"]) != (1, 0)):
            # Saved after the fragments and overlap were chosen: take them.
            self._probe = None
            self._reshape(saved["fragments"], saved["overlap"])
        s = self._streamer
        count = len(s.fragments())
        s.wait_in_flight()
        # Everything is checked, on every rank alike, before anything is written.
        views = [self._views(f)[0] for f in range(count)]
        mine = self._residuals()
        refused = None
        try:
            check_layout(saved, [v.numel() for v in views], [v.dtype for v in views],
                         None if mine is None else [r.numel() for r in mine])
        except (ValueError, KeyError, TypeError) as e:
            refused = str(e) if isinstance(e, ValueError) else (
                f"the checkpoint's streaming state is not one hemiola saved ({e!r})")
        agree_across_ranks([self._engine] + ([self._group] if self._group else []), saved,
                           refused)
        if dist.get_rank() == 0:
            warn_if_resized(saved, self._engine.world_size, self.replica_ranks)
        for f in range(count):
            shared, momentum = self._views(f)
            shared.copy_(saved["shared"][f])
            momentum.copy_(saved["outer_momentum"][f])
        if mine is not None and saved["residuals"] is not None:
            for ours, theirs in zip(mine, saved["residuals"]):
                ours.copy_(theirs)
        in_flight = saved["in_flight"]
        fragment, step = (-1, 0) if in_flight is None else (in_flight["fragment"],
                                                              in_flight["step"])
        s.restore(saved["inner_steps"], saved["momentum_started"], fragment, step)
        if in_flight is not None:
            dtype = self._fragment_dtype(fragment)
            torch.frombuffer(s.in_flight_average_view(), dtype=dtype).copy_(in_flight["average"])
            torch.frombuffer(s.in_flight_base_view(), dtype=dtype).copy_(in_flight["base"])

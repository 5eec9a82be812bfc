"""The worker side: a module wrapper that pushes gradients per tensor as
backward produces them and pulls parameters per module as forward needs them."""

from __future__ import annotations

import atexit
import contextlib
import time
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hemiola._native import C
from hemiola.forward_gate import ForwardGate
from hemiola.hooks import weak_hook
from hemiola.hyper import group_hyper
from hemiola.ps.ahead import AheadPlan
from hemiola.ps.config import PSConfig
from hemiola.ps.job_token import job_token
from hemiola.ps.roles import Role, rendezvous_store

_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}


def _optimizer_kind(optimizer: Any) -> str:
    kind = _OPTIMIZERS.get(type(optimizer))
    if kind == "adam" and any(g.get("decoupled_weight_decay") for g in optimizer.param_groups):
        kind = "adamw"  # torch.optim.Adam(decoupled_weight_decay=True) is AdamW
    if kind is None:
        raise ValueError(
            f"hemiola.ps runs the optimizer on the servers and supports torch.optim.SGD, Adam "
            f"and AdamW; got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        if group.get("maximize") or group.get("amsgrad") or group.get("differentiable"):
            raise ValueError("hemiola.ps does not support maximize, amsgrad or differentiable "
                             "optimizers")
    return kind


class ParameterServerModel(nn.Module):
    """A module trained through parameter servers. Create it with
    :func:`hemiola.ps.wrap`.

    Forward is the wrapped module's forward; before a submodule runs, it waits
    for the pull of its own parameters only. Each parameter's gradient is
    pushed as soon as backward has accumulated it; ``optimizer.step()``
    finishes the iteration (the servers run the optimizer) and requests the
    next parameters in the order the last forward used them.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, config: PSConfig,
                 worker: Role) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.role = worker
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        for name, p in named:
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(
                    f"parameter {name!r} is {p.dtype} on {p.device}"
                    f"{'' if p.is_contiguous() else ', non-contiguous'}: hemiola.ps trains "
                    "contiguous float32 CPU parameters")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._kind = _optimizer_kind(optimizer)
        self._optimizer = optimizer
        self._group_of = self._groups_of_params(optimizer)

        store, iface, master = rendezvous_store(config.timeout_s)
        with job_token(worker, store, config.timeout_s) as token:
            self._client = C.ps.Client(
                worker_index=worker.worker_index, num_workers=worker.num_workers,
                num_servers=worker.num_servers, consistency=config.consistency,
                staleness_rule=config.rule(self._kind), optimizer=self._kind,
                partition_elems=config.partition_elems, timeout_s=config.timeout_s,
                names=self._names, numels=[p.numel() for p in self._params], store=store,
                iface=iface, master_addr=master, token=token,
                local_correction=config.local_correction,
                momentum_rule=config.momentum_rule)
        self._hypers = [group_hyper(g) for g in optimizer.param_groups]
        initial = [p.data_ptr() for p in self._params] if worker.worker_index == 0 else []
        self._client.initialize(
            initial, [self._hypers[g] for g in self._group_of])
        n = len(self._params)
        self._pending = [True] * n  # a pull is outstanding; the next forward takes it
        # eager: pulls for the next iteration, requested when this forward ended;
        # they become takeable at optimizer.step() (so a second forward before
        # backward can never overwrite parameters that autograd saved).
        self._prefetching = [False] * n
        self._requested_ahead = [False] * n  # the pending pull was requested ahead
        self._ahead = AheadPlan([p.numel() for p in self._params], config.ahead_fraction)
        self._learning_ahead = config.consistency == "eager" and config.ahead_fraction is None
        self._step_time = time.perf_counter()
        self._pushed = [False] * n  # pushed in this iteration
        self._accumulated = [False] * n  # got gradient under no_sync() since the last push
        self._sync = True
        self._order: list[int] = []  # first use in the last forward that took pulls
        self._order_stale = True  # the next pull taken starts a new order
        self._grad_forward = False  # a forward with autograd ran since the last step
        self._closed = False
        self.synchronize()  # every worker starts from worker 0's parameters

        self._hooks = [module.register_forward_pre_hook(self._on_forward)]
        if config.consistency == "eager":
            self._hooks.append(module.register_forward_hook(self._after_forward))
        # Which module's forward waits for which pull: the module that reads
        # the parameter first, learnt in the first training forward, as the
        # all-reduce schedules do (nn.MultiheadAttention reads out_proj.weight
        # without calling out_proj, for example). Registered after _on_forward,
        # which must run first.
        self._gate = ForwardGate(module, self._params, self._take_pulls)
        for p in self._params:
            self._hooks.append(p.register_post_accumulate_grad_hook(weak_hook(self._on_grad)))
        optimizer.step = types.MethodType(self._optimizer_step, optimizer)
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- set-up helpers -----------------------------------------------------

    def _groups_of_params(self, optimizer: torch.optim.Optimizer) -> list[int]:
        group_of: dict[int, int] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._index:
                    raise ValueError("the optimizer holds a trainable parameter that is not a "
                                     "parameter of the wrapped model")
                group_of[id(p)] = g
        missing = [n for n, p in zip(self._names, self._params) if id(p) not in group_of]
        if missing:
            raise ValueError(f"parameters {missing[:3]} are trainable but not in the optimizer")
        return [group_of[id(p)] for p in self._params]

    # ---- hooks ----------------------------------------------------------------

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        # Learning-rate schedules change param_groups between iterations: the
        # pushes of this iteration carry the values in effect now.
        for g, group in enumerate(self._optimizer.param_groups):
            h = group_hyper(group)
            if h != self._hypers[g]:
                for i, gi in enumerate(self._group_of):
                    if gi == g:
                        self._client.set_hyper(i, h)  # refuses a setting the servers would
                self._hypers[g] = h
        if torch.is_grad_enabled():
            self._grad_forward = True

    def _take_pulls(self, gate: int, indices: list[int]) -> None:
        for i in indices:
            self._take_pull(i)

    def _take_pull(self, i: int) -> None:
        if self._pending[i]:
            waited = self._client.wait_pull(i, self._params[i].data_ptr())
            if self._learning_ahead and not self._requested_ahead[i]:
                self._ahead.waited(i, waited)
            self._pending[i] = False
            if self._order_stale:  # the first pull this forward takes
                self._order, self._order_stale = [], False
            self._order.append(i)

    def _on_grad(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        if not self._sync:
            self._accumulated[i] = True  # pushed by the synced backward, or at step()
            return
        name = self._names[i]
        if self._pending[i]:
            raise RuntimeError(
                f"parameter {name!r} got a gradient while its pull was still pending: this "
                "forward read it before the module that read it first in the first training "
                "forward ran. Call model.synchronize() before a forward whose order of "
                "parameter reads differs.")
        if self._pushed[i]:
            raise RuntimeError(
                f"parameter {name!r} got a second gradient in one iteration: call "
                "optimizer.step() between backward passes, or accumulate under model.no_sync()")
        self._push(i)

    def _push(self, i: int) -> None:
        grad = self._params[i].grad
        if grad is None or grad.is_sparse:
            raise ValueError(f"parameter {self._names[i]!r}: hemiola.ps needs dense gradients")
        grad = grad.contiguous()
        self._client.push(i, grad.data_ptr())
        self._pushed[i] = True
        self._accumulated[i] = False

    def _forward_order(self) -> list[int]:
        """Parameter indices in the order the last forward took them, then the rest."""
        taken = set(self._order)
        return self._order + [i for i in range(len(self._params)) if i not in taken]

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """eager: request the front layers' next parameters now. The server
        answers at once, before this iteration's pushes arrive, so the replies
        stream in under backward and the next forward need not wait for them;
        the other layers are pulled at optimizer.step(), after their push."""
        if not (self._sync and module.training and torch.is_grad_enabled()):
            return  # evaluation, or a micro-batch under no_sync(): not the end of an iteration
        for i in self._ahead.choose(self._forward_order()):
            if not self._pending[i] and not self._prefetching[i]:
                self._client.pull(i, True)
                self._prefetching[i] = True

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("hemiola.ps does not support optimizer closures")
        for i in range(len(self._params)):
            if self._pushed[i]:
                continue
            if self._accumulated[i] and self._params[i].grad is not None:
                self._push(i)  # gradient from no_sync() micro-batches only
            else:
                self._client.push_none(i)  # unused this iteration: counts, contributes nothing
        # Front layers first: the next forward needs them first. A parameter
        # whose pull is still pending (unused lately) is pulled again: in bsp
        # the pending reply may be a round old.
        for i in self._forward_order():
            self._requested_ahead[i] = self._prefetching[i]
            if self._prefetching[i]:  # eager: requested when the forward ended
                self._prefetching[i] = False
            else:
                self._client.pull(i)
            self._pending[i] = True
        self._pushed = [False] * len(self._params)
        self._order_stale = True
        self._grad_forward = False
        if self._learning_ahead:
            now = time.perf_counter()
            self._ahead.iteration_ended(now - self._step_time)
            self._step_time = now

    # ---- public API -------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._gate.scope():  # the first training forward is observed
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without pushing."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def synchronize(self) -> None:
        """Waits for every push to be applied and every requested pull to land in
        the parameters."""
        self._client.flush()
        for i in range(len(self._params)):
            # A value a forward with autograd took since the last step is what
            # its backward will use: it stays until optimizer.step().
            in_use = self._grad_forward and not self._pending[i]
            if self.config.consistency == "eager" and not self._prefetching[i] and not in_use:
                # An eager reply asked ahead was answered before this worker's
                # last push and corrected locally: ask again, now that every
                # push is applied, for the servers' values. (A pull requested
                # ahead, between a forward and optimizer.step(), stays for the
                # next forward.)
                self._client.pull(i)
                self._pending[i] = True
            if self._pending[i]:
                self._client.wait_pull(i, self._params[i].data_ptr())
                self._pending[i] = False

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict, after :meth:`synchronize`."""
        self.synchronize()
        return self.module.state_dict(*args, **kwargs)

    def version(self) -> int:
        """How many updates the servers had applied to the parameters this worker
        last received (in ``bsp``: completed rounds; asynchronous: pushes)."""
        return int(self._client.version(0))

    def snapshot(self) -> None:
        """Asks every server to write its snapshot (``PSConfig.snapshot_dir``) now."""
        self._client.snapshot()

    def push_records(self) -> list[dict[str, Any]]:
        """The newest 4096 applied gradient pushes (one per shard) of this worker,
        oldest first: the tensor, the version its gradient
        was computed on, the version it was applied at, the staleness tau and the
        learning-rate factor the staleness rule gave it."""
        return [{"tensor": self._names[r.tensor], "key": r.key, "computed_on": r.computed_on,
                 "applied_at": r.applied_at, "staleness": r.staleness, "lr_factor": r.lr_factor}
                for r in self._client.push_records()]

    def pulled_ahead(self) -> list[str]:
        """``eager``: the parameters whose next values are pulled when the
        forward ends, ahead of this worker's push (``PSConfig.ahead_fraction``);
        the others are pulled after their push. Empty for other models."""
        if self.config.consistency != "eager":
            return []
        return [self._names[i] for i in self._ahead.choose(self._forward_order())]

    def staleness(self) -> dict[str, Any]:
        """This worker's staleness statistics over all applied gradient pushes
        (one per shard): ``pushes``, ``mean``, ``max``, ``histogram`` {tau:
        count} and ``mean_lr_factor``."""
        return dict(self._client.staleness())

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "the servers hold the parameters of a hemiola.ps model: load the state into the "
            "module before hemiola.ps.wrap (worker 0's values initialise the servers), or "
            "restart the servers from a snapshot (PSConfig(restore=True))")

    def close(self) -> None:
        """Waits for the last pushes and pulls (so the parameters hold the last
        update), then leaves the job (servers stop when every worker has left)
        and removes the hooks. Called at exit if you do not."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._gate.remove()
            self._client.close()


def _close_at_exit(ref: weakref.ref[ParameterServerModel]) -> None:
    model = ref()
    if model is not None:
        with contextlib.suppress(Exception):  # the job may already have failed
            model.close()

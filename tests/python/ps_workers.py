"""Functions that run inside each rank of a parameter-server job (see
hemiola.launch.run_local). Ranks 0..S-1 are servers, the rest workers."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

import hemiola
import hemiola.ps

from models import loss_of, make_batch, make_model, make_optimizer


def server_or_none(config: hemiola.ps.PSConfig) -> dict[str, Any] | None:
    """Serves if this rank is a server (returning its stats), else None."""
    r = hemiola.ps.role(config.num_servers)
    if not r.is_server:
        return None
    stats = hemiola.ps.serve(config, r)
    return {"server": r.server_index, "pushes_applied": stats.pushes_applied,
            "rejected": stats.rejected, "dead_workers": list(stats.dead_workers),
            "snapshots": stats.snapshots}


def train(rank: int, world: int, options: dict[str, Any], model_name: str, opt_name: str,
          steps: int, delays: dict[int, float] | None = None, same_batch: bool = False
          ) -> dict[str, Any]:
    """Trains `model_name` for `steps` iterations; worker i reads batch shard i
    (of batch 0 every time when `same_batch`, a task the model can learn).
    `delays` maps a worker index to seconds slept per iteration (a straggler)."""
    config = hemiola.ps.PSConfig.from_kwargs(**options)
    served = server_or_none(config)
    if served is not None:
        return served
    r = hemiola.ps.role(config.num_servers)
    torch.manual_seed(0 if r.worker_index == 0 else 100 + rank)  # wrap must use worker 0's
    m = make_model(model_name)
    model, opt = hemiola.ps.wrap(m, make_optimizer(opt_name, m.parameters()), config)
    losses = []
    ahead_after_step = []  # the tensors pulled ahead, as each optimizer.step() left the plan
    for step in range(steps):
        x, y = make_batch(model_name, 0 if same_batch else step, r.worker_index, r.num_workers)
        opt.zero_grad()
        loss = loss_of(model_name, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ahead_after_step.append(sorted(model.pulled_ahead()))
        if delays and r.worker_index in delays:
            time.sleep(delays[r.worker_index])
    model.synchronize()
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    out = {"worker": r.worker_index, "params": params, "losses": losses,
           "records": model.push_records(), "staleness": model.staleness(),
           "pulled_ahead": model.pulled_ahead(), "ahead_after_step": ahead_after_step}
    model.close()
    model(x)  # after close the hooks are gone: a plain local forward
    try:
        opt.step()
        out["step_after_close"] = None
    except ValueError as e:
        out["step_after_close"] = str(e)
    return out


def train_keeping_every_pull_ahead(rank: int, world: int, *args: Any) -> dict[str, Any]:
    """``train`` with eager's learned plan moving every tensor ahead on trial
    after its warm-up (3 iterations) and two timed ones (any wait counts as a
    stall), at step 5, and keeping them there after an untimed iteration and
    two timed ones, at step 8: the tensors switch from pulls after the push
    to corrected pulls ahead in the middle of the run."""
    import hemiola.ps.ahead

    hemiola.ps.ahead.STALL_SHARE = -1.0
    hemiola.ps.ahead.TRIAL_ITERATIONS = 2
    hemiola.ps.ahead.KEEP_GAIN = -math.inf
    return train(rank, world, *args)


def train_moving_every_pull_ahead_and_back(rank: int, world: int, *args: Any) -> dict[str, Any]:
    """As ``train_keeping_every_pull_ahead``, but the trial never pays: at
    step 8 every tensor goes back to its pull after the push."""
    import hemiola.ps.ahead

    hemiola.ps.ahead.STALL_SHARE = -1.0
    hemiola.ps.ahead.TRIAL_ITERATIONS = 2
    hemiola.ps.ahead.KEEP_GAIN = math.inf
    return train(rank, world, *args)


def synchronize_between_forward_and_backward(rank: int, world: int) -> dict[str, Any] | None:
    """eager, 2 workers. Worker 0 calls synchronize() (as state_dict() does)
    between each forward and its backward, after giving worker 1 time to push:
    the values the forward read must stay, or backward would use others."""
    config = hemiola.ps.PSConfig(consistency="eager", num_servers=1, timeout_s=60)
    served = server_or_none(config)
    if served is not None:
        return served
    r = hemiola.ps.role(1)
    torch.manual_seed(0)
    m = make_model("mlp")
    model, opt = hemiola.ps.wrap(m, make_optimizer("sgd", m.parameters()), config)
    changed = []
    for step in range(6 if r.worker_index == 0 else 60):
        x, y = make_batch("mlp", step, r.worker_index, r.num_workers)
        opt.zero_grad()
        loss = loss_of("mlp", model(x), y)
        if r.worker_index == 0:
            read = [p.detach().clone() for p in m.parameters()]
            time.sleep(0.05)  # worker 1 pushes meanwhile
            model.synchronize()
            changed.append(any(not torch.equal(a, p) for a, p in zip(read, m.parameters())))
        loss.backward()
        opt.step()
    model.close()
    return {"worker": r.worker_index, "changed": changed}


def wfbp_train(rank: int, world: int, model_name: str, opt_name: str, steps: int
               ) -> dict[str, torch.Tensor]:
    """The all-reduce reference: hemiola wfbp on `world` ranks, same batches."""
    hemiola.init()
    torch.manual_seed(0)
    m = make_model(model_name)
    model, opt = hemiola.wrap(m, make_optimizer(opt_name, m.parameters()), timeout_s=60)
    for step in range(steps):
        x, y = make_batch(model_name, step, rank, world)
        opt.zero_grad()
        loss_of(model_name, model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def scheduled_staleness(rank: int, world: int, consistency: str, local_correction: bool
                        ) -> dict[str, Any] | None:
    """Two workers, one server. Worker 1 runs its forward on version 0, then
    waits (through the store) until worker 0 has had 3 pushes applied before
    its backward pushes: its gradient must be reported with tau = 3. Worker 0
    pulls after its own push in asp (taus 0, 0, 0); in eager it pulls before
    its own push lands (every pull ahead, ahead_fraction 1), so the schedule
    gives it taus 0, 1, 1, unless it corrects locally for its own push (then
    0, 0, 0)."""

    config = hemiola.ps.PSConfig(consistency=consistency, num_servers=1, timeout_s=30,
                                 local_correction=local_correction, ahead_fraction=1.0,
                                 staleness_rule="inverse")  # SGD's default here is "none"
    served = server_or_none(config)
    if served is not None:
        return served
    r = hemiola.ps.role(1)
    store = _store()
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    model, opt = hemiola.ps.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), config)
    x = torch.ones(2, 3)
    if r.worker_index == 1:
        y = model(x)  # computed on version 0; backward pushes it
        store.set("w1_forward", "1")
        store.wait(["w0_pushed_3"])
        y.sum().backward()
        opt.step()
        model.synchronize()
    else:
        store.wait(["w1_forward"])
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        model.synchronize()
        store.set("w0_pushed_3", "1")
    out = {"worker": r.worker_index, "records": model.push_records(),
           "staleness": model.staleness()}
    model.close()
    return out


def _store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False)


def _wrapped_mlp(config: hemiola.ps.PSConfig, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """(role, module, wrapped model, optimizer) of the test MLP on a worker."""
    r = hemiola.ps.role(config.num_servers)
    torch.manual_seed(seed)
    m = make_model("mlp")
    model, opt = hemiola.ps.wrap(m, make_optimizer("sgd", m.parameters()), config)
    return r, m, model, opt


def _mlp_step(model: Any, opt: Any, step: int, r: Any) -> None:
    x, y = make_batch("mlp", step, r.worker_index, r.num_workers)
    opt.zero_grad()
    loss_of("mlp", model(x), y).backward()
    opt.step()


def worker_dies(rank: int, world: int, consistency: str) -> dict[str, Any] | None:
    """Worker 1 is killed (SIGKILL) after 3 iterations; the others go on for 12."""
    import signal

    config = hemiola.ps.PSConfig(consistency=consistency, num_servers=1, timeout_s=30)
    served = server_or_none(config)
    if served is not None:
        return served
    r, _, model, opt = _wrapped_mlp(config)

    def before(step: int) -> None:
        if r.worker_index == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    return _steps_or_error(r, model, opt, 12, before)


def _steps_or_error(r: Any, model: Any, opt: Any, steps: int,
                    before: Callable[[int], None]) -> dict[str, Any]:
    """`steps` iterations of the test MLP on this worker, `before(step)`
    first in each; the iterations done and the error that ended them (None:
    none), as the worker's result."""
    done = 0
    try:
        for step in range(steps):
            before(step)
            _mlp_step(model, opt, step, r)
            done += 1
        model.synchronize()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"worker": r.worker_index, "done": done, "error": f"{type(e).__name__}: {e}"}
    model.close()
    return {"worker": r.worker_index, "done": done, "error": None}


def snapshot_then_server_dies(rank: int, world: int, snapshot_dir: str) -> dict[str, Any] | None:
    """bsp, 2 workers: after 5 iterations worker 0 asks for a snapshot, records
    the parameters, and kills the server; the workers must then fail naming it."""
    import signal

    config = hemiola.ps.PSConfig(consistency="bsp", num_servers=1, timeout_s=30,
                                 snapshot_dir=snapshot_dir)
    store = _store()
    if hemiola.ps.role(1).is_server:
        store.set("server_pid", str(os.getpid()))
    served = server_or_none(config)
    if served is not None:
        return served
    r, m, model, opt = _wrapped_mlp(config)
    snapshot = None
    try:
        for step in range(10):
            _mlp_step(model, opt, step, r)
            if step == 4:
                model.synchronize()
                if r.worker_index == 0:
                    model.snapshot()
                    snapshot = {n: p.detach().clone() for n, p in m.named_parameters()}
                    os.kill(int(store.get("server_pid")), signal.SIGKILL)
        model.synchronize()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"worker": r.worker_index, "snapshot": snapshot, "error": f"{type(e).__name__}: {e}"}
    return {"worker": r.worker_index, "snapshot": snapshot, "error": None}


def restart_from_snapshot(rank: int, world: int, snapshot_dir: str) -> dict[str, Any] | None:
    """The restarted job: fresh random models, servers restored from the snapshot."""
    config = hemiola.ps.PSConfig(consistency="bsp", num_servers=1, timeout_s=30,
                                 snapshot_dir=snapshot_dir, restore=True)
    served = server_or_none(config)
    if served is not None:
        return served
    # Seed 1234, not the snapshot's values: the restore must overwrite them.
    r, m, model, opt = _wrapped_mlp(config, seed=1234)
    restored = {n: p.detach().clone() for n, p in m.named_parameters()}
    for step in range(5, 8):
        _mlp_step(model, opt, step, r)
    model.synchronize()
    out = {"worker": r.worker_index, "restored": restored, "records": model.push_records()}
    model.close()
    return out


def mismatched_models(rank: int, world: int) -> dict[str, Any] | None:
    config = hemiola.ps.PSConfig(consistency="bsp", num_servers=1, timeout_s=20)
    served = server_or_none(config)
    if served is not None:
        return served
    r = hemiola.ps.role(1)
    name = "mlp" if r.worker_index == 0 else "cnn"
    m = make_model(name)
    model, opt = hemiola.ps.wrap(m, make_optimizer("sgd", m.parameters()), config)
    # The first registered may finish wrap before the other registers: its
    # first bsp round, which needs the other, then fails.
    x, y = make_batch(name, 0, r.worker_index, r.num_workers)
    loss_of(name, model(x), y).backward()
    opt.step()
    model.synchronize()
    return {"worker": r.worker_index}


def through_cli(rank: int, world: int) -> dict[str, Any] | None:
    """Rank 0 serves through the ``hemiola ps-server`` entry point."""
    from hemiola.cli import main

    if rank == 0:
        assert main(["ps-server", "--num-servers", "1", "--consistency", "asp",
                     "--timeout-s", "30"]) == 0
        return None
    return train(rank, world, {"consistency": "asp", "num_servers": 1, "timeout_s": 30}, "mlp",
                 "sgd", 3)


def shared_batches(rank: int, world: int, dataset_size: int, batch_size: int, epochs: int,
                   drop_last: bool, slow_s: float) -> dict[str, Any] | None:
    """Workers pass over `epochs` epochs of a SharedBatchSampler (the last
    worker sleeping `slow_s` per batch), then over epoch 0 once more; rank 0
    (the server's place) takes no part. Returns each pass's batches."""
    r = hemiola.ps.role(1)
    if r.is_server:
        return None
    sampler = hemiola.ps.SharedBatchSampler(dataset_size, batch_size, consistency="eager",
                                            seed=5, drop_last=drop_last, timeout_s=30)
    group = hemiola.ps.worker_group(1, timeout_s=30)
    slow = r.worker_index == r.num_workers - 1
    passes = []
    for epoch in [*range(epochs), 0]:
        torch.distributed.barrier(group=group)  # both start each pass together
        sampler.set_epoch(epoch)
        taken = []
        for batch in sampler:
            taken.append(batch)
            if slow:
                time.sleep(slow_s)
        passes.append(taken)
    return {"worker": r.worker_index, "passes": passes, "len": len(sampler)}


def shared_batches_against_servers(rank: int, world: int, served: str
                                   ) -> dict[str, Any] | None:
    """The servers run `served`; each worker wraps the test MLP, then builds a
    SharedBatchSampler told 'asp' and takes its first batch. Returns the error
    that raised, if any."""
    config = hemiola.ps.PSConfig(consistency=served, num_servers=1, timeout_s=30)
    served_stats = server_or_none(config)
    if served_stats is not None:
        return served_stats
    r, _, model, _ = _wrapped_mlp(config)
    sampler = hemiola.ps.SharedBatchSampler(40, 10, consistency="asp", timeout_s=30)
    error = None
    try:
        next(iter(sampler))
    except ValueError as e:
        error = str(e)
    model.close()
    return {"worker": r.worker_index, "error": error}


def server_paused(rank: int, world: int, consistency: str, pause_s: float) -> dict[str, Any] | None:
    """Worker 0 stops the server (SIGSTOP) for `pause_s`, a little less than
    timeout_s, after 4 iterations, then wakes it (SIGCONT); every worker
    trains its 10 iterations. The server's watchdog must not blame the
    workers whose messages queued unread while it was stopped."""
    import signal

    config = hemiola.ps.PSConfig(consistency=consistency, num_servers=1, timeout_s=4)
    if rank == 0:
        _store().set("test_server_pid", str(os.getpid()))
    served = server_or_none(config)
    if served is not None:
        return served
    r, _, model, opt = _wrapped_mlp(config)

    def before(step: int) -> None:
        if r.worker_index == 0 and step == 4:
            pid = int(_store().get("test_server_pid"))
            os.kill(pid, signal.SIGSTOP)
            time.sleep(pause_s)
            os.kill(pid, signal.SIGCONT)

    return _steps_or_error(r, model, opt, 10, before)

"""BytePS's ``example/pytorch/train_mnist_byteps.py``, ported to hemiola.ps,
run inside each rank (tests/python/test_ported_byteps_mnist.py).

The example, as BytePS users run it: the classic MNIST ``Net`` (two
convolutions, ``Dropout2d``, dropout, ``log_softmax``), SGD with the learning
rate scaled by the number of workers and momentum 0.5, a
``DistributedSampler`` per worker with ``set_epoch``, a log line every
``log_interval`` batches (``loss.item()``), and after every epoch a test pass
over each worker's share of the test set (``model.eval()``, no ``no_grad``)
whose loss and accuracy are averaged across workers (``bps.push_pull``).

The port is what docs/migrating.md says for BytePS and Horovod users:

- ``bps.init()`` / ``rank()`` / ``size()`` become :func:`hemiola.ps.role`'s
  worker index and worker count; rank 0 serves (BytePS launches its servers
  apart: here the same script branches).
- ``bps.DistributedOptimizer(optimizer, named_parameters=...)`` and
  ``broadcast_parameters`` / ``broadcast_optimizer_state`` become one
  ``hemiola.ps.wrap(model, optimizer, consistency=...)`` (worker 0's initial
  parameters win; the servers hold the optimizer state).
- ``bps.push_pull(metric)`` becomes ``dist.all_reduce(metric, group=...)`` on
  :func:`hemiola.ps.worker_group`, then a division by the worker count.

MNIST needs a download; scikit-learn's digits, resized to MNIST's 28x28 and
normalised as the example normalises MNIST, take its place. ``kind="ddp"``
runs the same script with torch DDP: what BytePS's synchronous semantics
(gradients averaged over the workers each step) compute; ``"wfbp"``,
``"priority"`` and ``"decoupled"`` run it as a Horovod user would port it,
through ``hemiola.wrap`` (Horovod's example has this script's shape).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hemiola
import hemiola.ps
from hemiola.demo import load_digits
from hemiola.launch import run_local

LR = 0.01  # the example's defaults
MOMENTUM = 0.5
BATCH_SIZE = 64
TEST_BATCH_SIZE = 1000
LOG_INTERVAL = 10
SEED = 42  # the example's --seed
ALL_REDUCE = ("ddp", "wfbp", "priority", "decoupled")  # every rank a worker


class Net(nn.Module):
    """The example's network, unchanged (``log_softmax`` over the classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def _datasets() -> tuple[TensorDataset, TensorDataset]:
    """Digits at MNIST's size and normalisation (the example's transforms)."""
    x_train, y_train, x_test, y_test = load_digits(seed=0)

    def mnist_like(x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
        return (x - 0.1307) / 0.3081

    return TensorDataset(mnist_like(x_train), y_train), TensorDataset(mnist_like(x_test), y_test)


def byteps_mnist(rank: int, world: int, kind: str, epochs: int = 3, slow_s: float = 0.0,
                 shared: bool = False, seed: int = SEED) -> dict[str, Any] | None:
    """Runs the example: ``kind`` is ``"ddp"`` or a hemiola schedule (every
    rank a worker, as under Horovod) or a hemiola.ps consistency (rank 0 a
    server, the others workers). The last
    worker sleeps `slow_s` after each batch (a straggler). Returns, per
    worker, the log's losses, the averaged test loss and accuracy per epoch,
    the final parameters and, for the parameter server, the staleness. With
    `shared`, the training batches come from :class:`hemiola.ps.SharedBatchSampler`
    (whichever worker asks first) instead of ``DistributedSampler``."""
    if kind in ALL_REDUCE:
        hemiola.init()
        worker, workers, group = rank, world, None
    else:
        role = hemiola.ps.role(num_servers=1)
        if role.is_server:  # BytePS starts its servers apart; here the script branches
            hemiola.ps.serve(hemiola.ps.PSConfig(consistency=kind, timeout_s=120))
            return None
        worker, workers = role.worker_index, role.num_workers
        group = hemiola.ps.worker_group(num_servers=1, timeout_s=120)
    torch.manual_seed(seed)

    train_dataset, test_dataset = _datasets()
    train_sampler: DistributedSampler | hemiola.ps.SharedBatchSampler
    if shared:
        train_sampler = hemiola.ps.SharedBatchSampler(len(train_dataset), BATCH_SIZE,
                                                      consistency=kind, seed=seed)
        train_loader = DataLoader(train_dataset, batch_sampler=train_sampler)
    else:
        train_sampler = DistributedSampler(train_dataset, num_replicas=workers, rank=worker)
        train_loader = DataLoader(train_dataset, batch_size=BATCH_SIZE, sampler=train_sampler)
    test_sampler = DistributedSampler(test_dataset, num_replicas=workers, rank=worker)
    test_loader = DataLoader(test_dataset, batch_size=TEST_BATCH_SIZE, sampler=test_sampler)

    model: nn.Module = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * workers, momentum=MOMENTUM)
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind in ALL_REDUCE:  # Horovod's DistributedOptimizer, with a hemiola schedule
        model, optimizer = hemiola.wrap(model, optimizer, schedule=kind, timeout_s=120)
    else:
        model, optimizer = hemiola.ps.wrap(model, optimizer, consistency=kind, timeout_s=120)

    losses: list[float] = []
    batches: list[int] = []  # trained per epoch
    tests: list[dict[str, float]] = []
    straggler = slow_s > 0 and worker == workers - 1

    def train(epoch: int) -> None:
        model.train()
        train_sampler.set_epoch(epoch)
        trained = 0  # a shared sampler may leave a worker no batch at all
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if straggler:
                time.sleep(slow_s)
            if batch_idx % LOG_INTERVAL == 0:
                losses.append(loss.item())
            trained += 1
        batches.append(trained)

    def metric_average(val: float) -> float:
        tensor = torch.tensor(val)
        dist.all_reduce(tensor, group=group)
        return tensor.item() / workers

    def test() -> None:
        model.eval()
        test_loss = 0.0
        test_accuracy = 0.0
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).float().sum().item()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        tests.append({"loss": metric_average(test_loss),
                      "accuracy": metric_average(test_accuracy)})

    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        train(epoch)
        test()
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "worker": worker, "losses": losses, "batches": batches, "tests": tests, "seconds": seconds,
        "state": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}
    if kind not in ALL_REDUCE:
        result["staleness"] = model.staleness()
        model.close()
    return result


def run_workers(kind: str, epochs: int, slow_s: float = 0.0, shared: bool = False,
                seed: int = SEED, timeout_s: float = 300) -> list[dict[str, Any]]:
    """One job of :func:`byteps_mnist` on 2 workers (and 1 server for
    hemiola.ps): the workers' results, worker 0 first."""
    world = 2 if kind in ALL_REDUCE else 3
    out = run_local(byteps_mnist, world, kind, epochs, slow_s, shared, seed, timeout_s=timeout_s)
    return [out[r] for r in range(world) if out[r] is not None]

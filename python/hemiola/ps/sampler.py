"""Batches handed out from one queue per epoch, to whichever worker asks
first: what lets an asynchronous parameter-server job go at its fast workers'
pace in an epoch-based script.

With ``DistributedSampler`` every worker owns a fixed 1/N of an epoch, so a
straggler's share sets the epoch's length whatever the consistency model: the
fast workers finish theirs and wait (at the epoch's metric all-reduce, or at
the next epoch's end). Here a worker claims the epoch's next batch with one
atomic counter in the job's rendezvous store, so a worker twice as fast
trains about twice as many batches, and every sample is still trained once
per epoch (if every claimed batch is used: see SharedBatchSampler).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from hemiola.ps.roles import CONSISTENCY_KEY, ps_store
from hemiola.ps.roles import role as _role


class SharedBatchSampler(Sampler[list[int]]):
    """A batch sampler (``DataLoader(dataset, batch_sampler=...)``) whose
    epoch's batches go to whichever worker asks first.

    Each epoch is one permutation of ``range(dataset_size)`` (seeded by `seed`
    and the epoch of :meth:`set_epoch`, the same on every worker), cut into
    batches of `batch_size` (the last one shorter unless `drop_last`); a
    worker's iterator claims the next unclaimed batch each time it is asked,
    and ends when none is left. Every worker must create its samplers in the
    same order and iterate each epoch the same number of times: every
    iteration begins a pass (a peek with ``next(iter(loader))`` is one), and
    the n-th pass of a worker shares the n-th pass's batches of the others.

    A batch is trained once per pass if every claimed batch is used: a loop
    left with ``break`` drops the batches it claimed and did not reach, and a
    ``DataLoader`` with ``num_workers > 0`` claims ``prefetch_factor x
    num_workers`` batches ahead (a straggler then holds a few at an epoch's
    end). ``len()`` is a worker's even share of the batches: a fast worker
    trains more of them, a straggler fewer, so a schedule sized by
    ``len(loader)`` (``OneCycleLR(total_steps=...)``) must be sized by
    :attr:`batches_per_epoch` / workers with a margin, or by the epoch.

    ``asp`` and ``eager`` only: a ``bsp`` round needs every worker's
    gradient and ``ssp`` holds a worker at most `staleness_bound` pushes
    ahead of the slowest, so there every worker must train the same number
    of batches (``DistributedSampler``).
    """

    def __init__(self, dataset_size: int, batch_size: int, *, consistency: str,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 num_servers: int = 1, timeout_s: float = 300.0) -> None:
        _refuse_unless_asynchronous(consistency, "")
        if dataset_size < 1 or batch_size < 1:
            raise ValueError(f"dataset_size ({dataset_size}) and batch_size ({batch_size}) "
                             "must be positive")
        role = _role(num_servers)
        if role.is_server:
            raise RuntimeError(f"rank {role.rank} is a server: only workers sample batches")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_workers = role.num_workers
        self.consistency = consistency
        self._checked = False  # against the servers' consistency, at the first pass
        self.epoch = 0
        self._store = ps_store(timeout_s)
        # The n-th sampler on every worker shares the n-th queue.
        sampler_id = self._store.add(f"batch_samplers/{role.worker_index}", 1)
        self._prefix = f"batches/{sampler_id}"
        self._passes: dict[int, int] = {}  # epoch -> passes this worker began over it

    @property
    def batches_per_epoch(self) -> int:
        """The batches of one pass, over all workers together."""
        whole, rest = divmod(self.dataset_size, self.batch_size)
        return whole if self.drop_last or rest == 0 else whole + 1

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation the next pass hands out (as
        ``DistributedSampler.set_epoch``)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.batches_per_epoch / self.num_workers)

    def _check_servers(self) -> None:
        """Refuses a job whose servers run another consistency than this
        sampler was told (by the first pass the model is wrapped, so the
        servers have published theirs; a sampler iterated before that, with
        no server up yet, is not checked)."""
        if self._checked or not self._store.check([CONSISTENCY_KEY]):
            return
        served = self._store.get(CONSISTENCY_KEY).decode()
        if served != self.consistency:
            _refuse_unless_asynchronous(
                served, f" (it was built with consistency={self.consistency!r}, but the "
                        f"servers run {served!r})")
        self._checked = True

    def __iter__(self) -> Iterator[list[int]]:
        self._check_servers()
        epoch = self.epoch
        passes = self._passes.get(epoch, 0)
        self._passes[epoch] = passes + 1
        key = f"{self._prefix}/{epoch}/{passes}"
        if self.shuffle:
            order = torch.randperm(self.dataset_size,
                                   generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.dataset_size)
        total = self.batches_per_epoch
        while True:
            batch = self._store.add(key, 1) - 1  # claimed by this worker alone
            if batch >= total:
                return
            yield order[batch * self.batch_size:(batch + 1) * self.batch_size].tolist()


def _refuse_unless_asynchronous(consistency: str, mismatch: str) -> None:
    if consistency not in ("asp", "eager"):
        raise ValueError(
            f"SharedBatchSampler with consistency={consistency!r}{mismatch}: it hands a "
            "straggler fewer batches than the others, but a bsp round needs every worker's "
            "gradient and ssp holds a worker at most staleness_bound pushes ahead of the "
            "slowest, so a fast worker would wait for pushes the straggler, out of batches, "
            "never makes. Use it with 'asp' or 'eager'; with bsp and ssp every worker trains "
            "the same number of batches (DistributedSampler)")

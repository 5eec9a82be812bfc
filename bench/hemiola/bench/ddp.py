"""The baseline of the suites: torch DistributedDataParallel with the
communication hook that does what a hemiola compression does."""

from __future__ import annotations

from torch import nn

from hemiola.config import Config

#: compression ("": none) -> how torch DDP with its hook reads in a table
LABELS = {"": "torch DDP", "fp16": "torch DDP + fp16_compress_hook",
          "bf16": "torch DDP + bf16_compress_hook", "powersgd": "torch DDP + PowerSGD (rank 2)"}
#: iterations before PowerSGD compresses, unless told: hemiola's own default
POWERSGD_START = Config.powersgd_start_iter


def ddp_with_hook(model: nn.Module, compression: str = "", *,
                  powersgd_start: int = POWERSGD_START,
                  bucket_cap_mb: float | None = None) -> nn.parallel.DistributedDataParallel:
    """`model` in torch DDP with the hook of `compression` (a key of ``LABELS``).

    Args:
        powersgd_start: ``compression="powersgd"``: iterations before it
            compresses (``start_powerSGD_iter``); it is rank 2, as hemiola's.
        bucket_cap_mb: DDP's bucket cap; None: torch's default. PowerSGD
            always gets one bucket: its hook issues its later all-reduces from
            Gloo's completion threads, so with two buckets the ranks can issue
            them in different orders (a collective mismatch).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if compression not in LABELS:
        raise ValueError(f"torch DDP has no hook for {compression!r}; "
                         f"known: {', '.join(c for c in LABELS if c)}")
    if compression == "powersgd":
        bucket_cap_mb = 1e6
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if compression == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                       start_powerSGD_iter=powersgd_start)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    elif compression:
        hooks = {"fp16": default_hooks.fp16_compress_hook,
                 "bf16": default_hooks.bf16_compress_hook}
        ddp.register_comm_hook(None, hooks[compression])
    return ddp

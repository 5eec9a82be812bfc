"""torch DDP's communication hooks, mapped to the engine's wire compression.

A DDP script that registers one of torch's standard hooks ports unchanged:
``model.register_comm_hook(state, hook)`` on a wrapped model sets
:attr:`hemiola.Config.compression` to what the hook does, and the engine
compresses natively (no Python runs per bucket). Any other hook is refused,
saying which are understood.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _known_hooks() -> dict[Any, str | None]:
    """torch's stateless hooks that have a native equivalent: hook -> compression."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        default_hooks.allreduce_hook: None,
        default_hooks.fp16_compress_hook: "fp16",
        default_hooks.bf16_compress_hook: "bf16",
    }


UNDERSTOOD = ("allreduce_hook (no compression), fp16_compress_hook (compression='fp16'), "
              "bf16_compress_hook (compression='bf16') from "
              "torch.distributed.algorithms.ddp_comm_hooks.default_hooks, and powerSGD_hook "
              "(compression='powersgd') from ...ddp_comm_hooks.powerSGD_hook")


def _powersgd_options(state: Any) -> dict[str, int]:
    """The Config options a PowerSGDState asks for; refuses what differs from
    what the engine does."""
    refused = []
    if not getattr(state, "use_error_feedback", True):
        refused.append("use_error_feedback=False")
    if not getattr(state, "warm_start", True):
        refused.append("warm_start=False")
    if getattr(state, "min_compression_rate", 2) != 2:
        refused.append(f"min_compression_rate={state.min_compression_rate}")
    if refused:
        raise NotImplementedError(
            f"hemiola's PowerSGD always uses error feedback, warm start and "
            f"min_compression_rate=2; this state sets {', '.join(refused)}")
    return {"powersgd_rank": int(state.matrix_approximation_rank),
            "powersgd_start_iter": int(state.start_powerSGD_iter)}


def compression_of(state: object, hook: Any) -> tuple[str | None, dict[str, int]]:
    """The ``Config.compression`` that does what `hook` does and the options
    its state asks for, or a clear error for a hook (or a state) hemiola
    cannot honour."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if hook is powersgd.powerSGD_hook:
        group = getattr(state, "process_group", None)
        _check_group(group)
        return "powersgd", _powersgd_options(state)
    known = _known_hooks()
    if hook not in known:
        name = getattr(hook, "__qualname__", None) or type(hook).__name__
        raise NotImplementedError(
            f"hemiola maps torch's standard communication hooks onto its engine and cannot "
            f"run an arbitrary one ({name}). Understood: {UNDERSTOOD}. Or pass "
            "compression='fp16' | 'bf16' | 'int8' | 'powersgd' to hemiola.wrap.")
    _check_group(state)
    return known[hook], {}


def _check_group(group: object) -> None:
    if group is not None and dist.is_initialized() and group is not dist.group.WORLD:
        raise ValueError("register_comm_hook: hemiola reduces over all ranks; the hook's "
                         "process group must be None or the default group")

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
    """torch's hooks that have a native equivalent: hook -> compression."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        default_hooks.allreduce_hook: None,
        default_hooks.fp16_compress_hook: "fp16",
        default_hooks.bf16_compress_hook: "bf16",
    }


UNDERSTOOD = ("allreduce_hook (no compression), fp16_compress_hook (compression='fp16'), "
              "bf16_compress_hook (compression='bf16') from "
              "torch.distributed.algorithms.ddp_comm_hooks.default_hooks")


def compression_of(state: object, hook: Any) -> str | None:
    """The ``Config.compression`` that does what `hook` does, or a clear
    error for a hook (or a state) hemiola cannot honour."""
    known = _known_hooks()
    if hook not in known:
        name = getattr(hook, "__qualname__", None) or type(hook).__name__
        if "powerSGD" in str(name):
            raise NotImplementedError(
                f"hemiola does not implement PowerSGD yet ({name}); its native compressions "
                "are 'fp16', 'bf16' and 'int8' (one byte per element with error feedback, "
                "a quarter of the bytes): hemiola.wrap(..., compression='int8')")
        raise NotImplementedError(
            f"hemiola maps torch's standard communication hooks onto its engine and cannot "
            f"run an arbitrary one ({name}). Understood: {UNDERSTOOD}. Or pass "
            "compression='fp16' | 'bf16' | 'int8' to hemiola.wrap.")
    group = state
    if group is not None and dist.is_initialized() and group is not dist.group.WORLD:
        raise ValueError("register_comm_hook: hemiola reduces over all ranks; the hook's state "
                         "must be None or the default process group")
    return known[hook]

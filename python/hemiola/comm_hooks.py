"""torch DDP's communication hooks, mapped to the engine's wire compression.

A DDP script that registers one of torch's standard hooks ports unchanged:
``model.register_comm_hook(state, hook)`` on a wrapped model sets
:attr:`hemiola.Config.compression` to what the hook does, and the engine
compresses natively (no Python runs per bucket). Any other hook is refused,
saying which are understood.
"""

from __future__ import annotations

import warnings
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
              "bf16_compress_hook (compression='bf16'), fp16_compress_wrapper or "
              "bf16_compress_wrapper around allreduce_hook (the same) or around powerSGD_hook "
              "(compression='powersgd', factors in float32) from "
              "torch.distributed.algorithms.ddp_comm_hooks.default_hooks, and powerSGD_hook "
              "(compression='powersgd') from ...ddp_comm_hooks.powerSGD_hook")

#: the wrappers of default_hooks, by the name of the function they return
WRAPPERS = {"fp16_compress_wrapper_hook": "fp16", "bf16_compress_wrapper_hook": "bf16"}


def _wrapped(hook: Any) -> tuple[str, Any] | None:
    """(half type, inner hook) of ``fp16_compress_wrapper(inner)`` or
    ``bf16_compress_wrapper(inner)``; None for any other hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    code = getattr(hook, "__code__", None)
    half = WRAPPERS.get(getattr(code, "co_name", ""))
    if half is None or getattr(hook, "__module__", None) != default_hooks.__name__ \
            or code.co_freevars != ("hook",):
        return None
    return half, hook.__closure__[0].cell_contents


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
            f"min_compression_rate=2; this state sets {', '.join(refused)}. Use "
            "PowerSGDState(..., use_error_feedback=True, warm_start=True, "
            "min_compression_rate=2) (torch's defaults), or compression='fp16' | 'int8'")
    return {"powersgd_rank": int(state.matrix_approximation_rank),
            "powersgd_start_iter": int(state.start_powerSGD_iter)}


def compression_of(state: object, hook: Any) -> tuple[str | None, dict[str, int]]:
    """The ``Config.compression`` that does what `hook` does and the options
    its state asks for, or a clear error for a hook (or a state) hemiola
    cannot honour, saying what to use instead."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    wrapped = _wrapped(hook)
    if wrapped is not None:
        half, inner = wrapped
        if inner is powersgd.powerSGD_hook:
            # PowerSGD with its factors (and the tensors it sends whole) cast
            # to half: the engine's PowerSGD keeps them in float32, more exact
            # at twice the bytes of the factors.
            warnings.warn(
                f"hemiola: {half}_compress_wrapper(powerSGD_hook) runs as compression="
                "'powersgd', whose low-rank factors travel in float32 (twice the bytes of "
                f"torch's {half} factors, and not rounded to {half}); for half-precision "
                f"gradients without PowerSGD register {half}_compress_hook", stacklevel=3)
            return compression_of(state, inner)
        if compression_of(state, inner)[0] is not None:
            raise NotImplementedError(
                f"hemiola maps {half}_compress_wrapper around allreduce_hook or powerSGD_hook "
                f"only; register {half}_compress_hook (compression='{half}') or "
                "powerSGD_hook instead")
        return half, {}
    if hook is powersgd.powerSGD_hook:
        group = getattr(state, "process_group", None)
        _check_group(group)
        return "powersgd", _powersgd_options(state)
    if hook is powersgd.batched_powerSGD_hook:
        raise NotImplementedError(
            "hemiola does not run batched_powerSGD_hook (one low-rank approximation of a "
            "whole bucket folded into a square matrix); register powerSGD_hook, which "
            "approximates each gradient matrix (compression='powersgd' in hemiola), or "
            "fp16_compress_hook (compression='fp16')")
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

"""The on/off switches of the updater's GPU path that wait for a GPU run
before they become the default (docs/gpu.md), read from the environment
when an updater is made."""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    """Environment variable `name` as a switch: ``1`` on, ``0`` or unset off."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: use 1 (on) or 0 (off)")
    return raw == "1"


def multi_tensor_steps() -> bool:
    """``HEMIOLA_MULTI_TENSOR_STEPS=1``: the engine steps a landing group's
    parameters in multi-tensor calls (on a GPU one launch per up to 24
    parameters; UpdaterOptions::multi_tensor_steps; on the CPU the same
    result)."""
    return _flag("HEMIOLA_MULTI_TENSOR_STEPS")


def device_clip_norms() -> bool:
    """``HEMIOLA_DEVICE_CLIP=1``: on a GPU, clipping's coefficient is
    computed on the device and read there by the steps, so the host never
    waits for a reduction to clip (UpdaterOptions::device_clip_norms)."""
    return _flag("HEMIOLA_DEVICE_CLIP")

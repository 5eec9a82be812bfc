"""``hemiola.clip_grad_norm_``: one clipping call for a wrapped or a plain module."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def clip_grad_norm_(module: nn.Module | Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clips gradients by their global norm, whether or not the model is wrapped.

    A script that trains unwrapped in one process and wrapped under
    ``torchrun`` (nanoGPT does) calls this in both cases:

    - a :class:`hemiola.DataParallel` (what ``hemiola.wrap`` returns): its
      ``clip_grad_norm_``, which clips what the schedule will apply (under
      ``priority`` and ``decoupled`` the averaged gradient, when it lands);
    - any other module (plain, or torch's DDP): ``torch.nn.utils.clip_grad_norm_``
      over its parameters;
    - parameters or tensors: ``torch.nn.utils.clip_grad_norm_`` over them.

    A module that *contains* a wrapped model is refused: clip through the
    wrapped model itself, so the schedule sees the call.
    """
    from hemiola.data_parallel import DataParallel

    if isinstance(module, DataParallel):
        return module.clip_grad_norm_(max_norm, norm_type)
    if isinstance(module, nn.Module):
        inner = next((name for name, m in module.named_modules() if isinstance(m, DataParallel)),
                     None)
        if inner is not None:
            raise ValueError(f"submodule {inner!r} is a hemiola-wrapped model: call "
                             f"hemiola.clip_grad_norm_ on it (the object hemiola.wrap returned), "
                             "so its schedule clips the gradients it applies")
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, norm_type)
    return torch.nn.utils.clip_grad_norm_(module, max_norm, norm_type)

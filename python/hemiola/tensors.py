"""Turning torch tensors into the engine's non-owning references."""

from __future__ import annotations

import torch

from hemiola._native import C

#: torch dtypes whose gradients the engine reduces.
GRAD_DTYPES: dict[torch.dtype, int] = {
    torch.float32: int(C.DType.float32),
    torch.float64: int(C.DType.float64),
    torch.float16: int(C.DType.float16),
    torch.bfloat16: int(C.DType.bfloat16),
}

UINT8 = int(C.DType.uint8)


def dtype_code(dtype: torch.dtype) -> int:
    """The engine's code for a gradient dtype; a clear error for any other."""
    try:
        return GRAD_DTYPES[dtype]
    except KeyError:
        supported = ", ".join(str(d).replace("torch.", "") for d in GRAD_DTYPES)
        raise ValueError(
            f"hemiola reduces gradients of dtype {supported}; got {dtype}"
        ) from None


def check_cpu(tensor: torch.Tensor, what: str) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{what} is on {tensor.device}; this build of hemiola reduces CPU tensors "
            "(the CUDA/NCCL path is not built in: see hemiola.build_info())"
        )


def broadcast_tensors(engine: C.Engine, tensors: list[torch.Tensor], root: int = 0) -> None:
    """Broadcasts `tensors` (any dtypes) from `root`, coalesced into one byte buffer."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors or engine.world_size == 1:
        return
    for t in tensors:
        check_cpu(t, "a broadcast tensor")
    with torch.no_grad():
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
        engine.broadcast(flat.data_ptr(), UINT8, flat.numel(), root).wait()
        if engine.rank != root:
            offset = 0
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                chunk = flat[offset : offset + nbytes].view(t.dtype).view(t.shape)
                t.copy_(chunk)
                offset += nbytes

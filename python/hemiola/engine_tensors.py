"""Turning torch tensors into the engine's non-owning references."""

from __future__ import annotations

import ctypes

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


def model_device(named: list[tuple[str, torch.Tensor]]) -> torch.device:
    """The one device every tensor of `named` is on: the CPU or one CUDA
    device (of a CUDA build). A clear error otherwise."""
    devices = {t.device for _, t in named}
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        where = {str(t.device): name for name, t in named}
        listed = ", ".join(f"{name!r} on {d}" for d, name in sorted(where.items()))
        raise ValueError(
            f"the model's parameters and buffers are on several devices ({listed}); "
            "hemiola reduces a model that lives on one device: move it with .to(device) "
            "(one GPU per rank)"
        )
    device = devices.pop()
    if device.type == "cuda":
        if not hasattr(C, "cuda"):
            raise ValueError(
                f"the model is on {device}, but this build of hemiola has no CUDA support "
                "(see hemiola.build_info()): reinstall it where nvcc is on the PATH"
            )
        return torch.device("cuda", device.index if device.index is not None else 0)
    if device.type != "cpu":
        raise ValueError(f"the model is on {device}; hemiola reduces CPU and CUDA tensors")
    return device


def stream_of(device: torch.device) -> int:
    """The handle of `device`'s current stream (0 on the CPU): where work the
    engine must follow was enqueued, and where its results will be read."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.current_stream(device).cuda_stream)


class _DeviceMemory:
    """Exposes engine-owned device memory to torch (``__cuda_array_interface__``)."""

    def __init__(self, pointer: int, numel: int, typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "data": (pointer, False), "shape": (numel,), "typestr": typestr,
            "version": 3, "stream": None,
        }


_TYPESTR = {torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2"}


def device_view(pointer: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and typed like `like` over engine memory at `pointer`
    on `like`'s CUDA device (no copy; valid while the engine keeps it)."""
    numel = like.numel()
    if like.dtype == torch.bfloat16:  # no typestr for bfloat16: view its bits
        raw = torch.as_tensor(_DeviceMemory(pointer, numel, "<i2"), device=like.device)
        return raw.view(torch.bfloat16).view(like.shape)
    memory = _DeviceMemory(pointer, numel, _TYPESTR[like.dtype])
    return torch.as_tensor(memory, device=like.device).view(like.shape)


def engine_view(pointer: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and typed like `like` over engine memory at `pointer`,
    on `like`'s device: host memory on the CPU, device memory on a GPU (no
    copy; valid while the engine keeps it)."""
    if like.device.type == "cuda":
        return device_view(pointer, like)
    nbytes = like.numel() * like.element_size()
    if nbytes == 0:
        return torch.empty_like(like)
    memory = (ctypes.c_char * nbytes).from_address(pointer)
    return torch.frombuffer(memory, dtype=like.dtype).view(like.shape)


def _one_cuda_device(tensors: list[torch.Tensor]) -> torch.device | None:
    """The CUDA device every one of `tensors` is on, or None."""
    devices = {t.device for t in tensors}
    if len(devices) == 1:
        (device,) = devices
        if device.type == "cuda":
            return device
    return None


def pack_bytes(tensors: list[torch.Tensor],
               fill: bool = True) -> tuple[torch.Tensor, list[int]]:
    """`tensors` (any dtypes and devices) copied into one host byte buffer,
    each starting at a multiple of 16 bytes so that its bytes can be viewed as
    its dtype again (an int64 after an odd number of float32s could not);
    returns the buffer and each tensor's offset. See :func:`unpack_bytes`.

    Tensors on one GPU are packed there and copied to the host at once (one
    synchronisation, not one per tensor). `fill=False`: only the layout (a
    zeroed buffer), for a rank that receives a broadcast and reads nothing."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // 16) * 16
    flat = torch.zeros(end, dtype=torch.uint8)
    if not fill:
        return flat, offsets
    device = _one_cuda_device(tensors)
    stage = flat if device is None else torch.zeros(end, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for t, offset in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            stage[offset:offset + nbytes] = t.detach().contiguous().reshape(-1).view(
                torch.uint8).to(stage.device)
        if stage is not flat:
            flat.copy_(stage)
    return flat, offsets


def unpack_bytes(flat: torch.Tensor, offsets: list[int], tensors: list[torch.Tensor]) -> None:
    """Copies what :func:`pack_bytes` laid out in `flat` back into `tensors`
    (onto one GPU in one copy when they are all there)."""
    device = _one_cuda_device(tensors)
    with torch.no_grad():
        source = flat if device is None else flat.to(device)
        for t, offset in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            t.copy_(source[offset:offset + nbytes].view(t.dtype).view(t.shape))


def broadcast_tensors(engine: C.Engine, tensors: list[torch.Tensor], root: int = 0) -> None:
    """Broadcasts `tensors` (any dtypes) from `root`, coalesced into one byte
    buffer. The engine's own collectives take host memory: CUDA tensors are
    staged (this runs at wrap time and for buffers, not per gradient)."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors or engine.world_size == 1:
        return
    flat, offsets = pack_bytes(tensors, fill=engine.rank == root)
    engine.broadcast(flat.data_ptr(), UINT8, flat.numel(), root).wait()
    if engine.rank != root:
        unpack_bytes(flat, offsets, tensors)


def all_gather_rows(engine: C.Engine, mine: torch.Tensor) -> torch.Tensor:
    """Collective: every rank's 1-D CPU tensor `mine` (int64 or float64, of
    the same length on every rank), as the rows of a (world, length) tensor."""
    codes = {torch.int64: int(C.DType.int64), torch.float64: int(C.DType.float64)}
    mine = mine.contiguous()
    every = torch.empty(engine.world_size, mine.numel(), dtype=mine.dtype)
    engine.all_gather(mine.data_ptr(), every.data_ptr(), codes[mine.dtype], mine.numel()).wait()
    return every


def raise_if_not_finite(named: list[tuple[str, torch.Tensor]], iteration: int) -> None:
    """``check_finite``: raises naming the first of the `named` averaged
    gradients that holds NaN or infinity. One pass when all are finite."""
    tensors = [t for _, t in named]
    if not tensors or bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, 2.0))):
        return
    for name, t in named:
        if not bool(torch.isfinite(t).all()):
            raise FloatingPointError(
                f"hemiola: the averaged gradient of parameter {name!r} holds NaN or infinity "
                f"in iteration {iteration} (check_finite=True); it was not applied. Some "
                "rank's loss diverged or overflowed: lower the learning rate, check the "
                "inputs, or scale fp16 losses with a GradScaler (grad_scaler=...)."
            )

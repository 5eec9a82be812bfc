"""The square root torch's CPU kernels take, for the engine's Adam step.

torch's ``Tensor.sqrt()`` on CPU float32 and float64 tensors is not always
IEEE's correctly rounded root: the x86-64 wheels compute it with MKL's vector
math (``vsSqrt``/``vdSqrt``), which differs from it in the last bit for about
one input in six (float32) or one in seventy (float64). The engine's Adam
step takes a square root of the second moment, so to be torch's step bit for
bit it must take torch's. This module finds that function in torch's own
library and hands its address to the engine, after checking on probe data
that it gives exactly what ``torch.sqrt`` gives; where torch's root is the
correctly rounded one, or its own cannot be found and checked, the engine
keeps ``std::sqrt`` (then the step matches torch's within one unit in the last
place of the root, as before).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

import numpy as np
import torch

#: the probe's length: long enough for every code path of a vector library
#: (blocks, remainders) and to find a difference that one input in seventy shows
_PROBE = 40_961


class VectorSqrt(NamedTuple):
    """Addresses of the float32 and float64 vector roots (0: ``std::sqrt``)."""

    f32: int
    f64: int


@functools.cache
def torch_sqrt() -> VectorSqrt:
    """The vector roots that make the engine's CPU sqrt equal torch's, checked."""
    return VectorSqrt(_find(torch.float32, "VSSQRT_"), _find(torch.float64, "VDSQRT_"))


def _find(dtype: torch.dtype, symbol: str) -> int:
    probe = torch.rand(_PROBE, dtype=dtype, generator=torch.Generator().manual_seed(0))
    probe[: _PROBE // 2] *= 1e-6  # small second moments, as Adam's are
    expected = probe.sqrt()
    if torch.equal(expected, torch.from_numpy(np.sqrt(probe.numpy()))):
        return 0  # torch's root is IEEE's: std::sqrt is it
    function = _symbol(symbol)
    if function is None:
        return 0
    out = torch.empty_like(probe)
    count = ctypes.c_int64(probe.numel())  # read as MKL_INT, 32 or 64 bits (little-endian)
    function(ctypes.byref(count), ctypes.c_void_p(probe.data_ptr()),
             ctypes.c_void_p(out.data_ptr()))
    if not torch.equal(out, expected):
        return 0
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def _symbol(name: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return getattr(ctypes.CDLL(library), name)  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None

"""hemiola: data-parallel training that schedules communication under computation.

Quick start (launch with ``torchrun --nproc-per-node 2 train.py``)::

    import hemiola
    model, optimizer = hemiola.wrap(model, optimizer, schedule="wfbp")
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # gradients come back averaged
        optimizer.step()
"""

from __future__ import annotations

from pathlib import Path

from hemiola._native import C

__version__: str = C.__version__

HemiolaError = C.HemiolaError
HemiolaTimeoutError = C.HemiolaTimeoutError


def build_info() -> str:
    """What this build compiled in (Gloo, CUDA, NCCL), and why not."""
    return C.build_info()


def cmake_prefix_path() -> str:
    """Pass to CMake as ``-DCMAKE_PREFIX_PATH`` so ``find_package(hemiola)`` works."""
    return str(Path(__file__).resolve().parent)


def __getattr__(name: str) -> object:
    # torch is imported lazily: the cluster simulator and the C++ package
    # helpers work without it.
    if name in ("wrap", "init", "Config", "DataParallel", "clip_grad_norm_"):
        from hemiola import clipping, config, data_parallel, distributed, wrapping

        return {
            "wrap": wrapping.wrap,
            "init": distributed.init,
            "Config": config.Config,
            "DataParallel": data_parallel.DataParallel,
            "clip_grad_norm_": clipping.clip_grad_norm_,
        }[name]
    raise AttributeError(f"module 'hemiola' has no attribute {name!r}")


__all__ = [
    "Config",
    "DataParallel",
    "HemiolaError",
    "HemiolaTimeoutError",
    "build_info",
    "clip_grad_norm_",
    "cmake_prefix_path",
    "init",
    "wrap",
]

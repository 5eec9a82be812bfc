"""Loads the native extension so that its Gloo can never bind to torch's.

libtorch exports its own (newer, incompatible) Gloo symbols. If torch is loaded
with ``RTLD_GLOBAL`` (``TORCH_USE_RTLD_GLOBAL=1``), a plain import of our
extension would let our Gloo references resolve to torch's copy, and collectives
crash. Loading the extension with ``RTLD_DEEPBIND`` puts its own dependency tree
(libhemiola, libgloo) ahead of the global scope for every symbol it looks up,
whatever was imported before or after.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType


def _load() -> ModuleType:
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_NOW | os.RTLD_LOCAL | getattr(os, "RTLD_DEEPBIND", 0))
    try:
        from hemiola import _C
    finally:
        sys.setdlopenflags(flags)
    return _C


C = _load()

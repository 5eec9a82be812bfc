"""``decoupled``: the reduction of iteration t runs under iteration t+1, which
computes on approximate parameters (the exact ones stepped with this rank's
own gradient, or with a preview's estimate of the average); the exact step
lands as soon as it has arrived and no forward still needs the approximate
value, at the latest in ``optimizer.step()`` (the engine's decoupled policy;
docs/schedules.md)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from hemiola.schedules.engine_optimizer import KINDS
from hemiola.schedules.updater_schedule import UpdaterSchedule

if TYPE_CHECKING:
    from hemiola.bound_model import BoundModel
    from hemiola.config import Config

#: the optimizers ``decoupled`` takes a preview for when ``Config.preview`` is None
PREVIEW_BY_DEFAULT = ("adam", "adamw")


class Decoupled(UpdaterSchedule):
    """``decoupled`` on the engine's updater: ``UpdaterSchedule`` plus what the
    local step and the preview need. Buffers land at the end of the next
    backward or in ``synchronize()``, not in ``optimizer.step()``
    (docs/schedules.md#buffers)."""

    @classmethod
    def reducer_needs(cls, config: Config, optimizer: Any,
                      device: torch.device) -> tuple[int, bool]:
        in_flight = config.in_flight
        preview = config.preview
        if preview is None:
            preview = KINDS.get(type(optimizer)) in PREVIEW_BY_DEFAULT and in_flight == 1
        takes = bool(preview) and device.type != "cuda" and in_flight == 1
        if config.preview and not takes:
            warnings.warn("hemiola: preview=True is implemented for CPU models with "
                          "in_flight=1 only; this model takes no preview", stacklevel=6)
        return in_flight, takes

    def __init__(self, bound: BoundModel, optimizer: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(bound, optimizer, grad_scaler)
        #: this rank's gradient norm of the newest clipped iterations
        self._local_norms: dict[int, float] = {}

    def _local_pointer(self, index: int, grad: torch.Tensor) -> int:
        # The local step reads this gradient. unsupported() sends
        # non-contiguous parameters to the external stepper, and a contiguous
        # parameter's gradient is contiguous, so the engine's own step never
        # needs a copy here: refuse one.
        if self._kind is not None and not grad.is_contiguous():
            raise ValueError(
                f"parameter {self.bound.names[index]!r} has a non-contiguous gradient; the "
                "engine's own optimizer step reads it in place. Make the parameter's gradient "
                "contiguous or pass native_optimizer=False to hemiola.wrap.")
        return super()._local_pointer(index, grad)

    def _preview_clip(self, iteration: int, local_norm: torch.Tensor, max_norm: float) -> float:
        # Without a preview nothing reads the local norm (on a GPU, reading
        # it would wait for the device each step).
        if not self.preview:
            return 1.0
        # The averaged gradient's norm is not known until its reduction has
        # arrived, and it is smaller than one rank's (averaging cancels noise):
        # clipping the preview by this rank's norm would shorten its step. So
        # its estimate is this rank's norm times the ratio the newest iteration
        # with a known average had, and the coefficient torch's rule for it.
        own_norm = float(local_norm)
        ratio = 1.0
        for before, own in sorted(self._local_norms.items(), reverse=True):
            averaged = self.recorded_clip_norm(before)
            if averaged is not None and own > 0.0:
                ratio = averaged / own
                break
        self._local_norms = {it: own for it, own in self._local_norms.items()
                             if it >= iteration - 4}
        self._local_norms[iteration] = own_norm
        return min(1.0, max_norm / (own_norm * ratio + 1e-6))

    def stats(self) -> dict[str, float]:
        if self._updater is None:
            return {}
        stats = {"approximate_read_fraction": self._updater.approximate_read_fraction()}
        if self.preview:
            stats["preview_read_fraction"] = self._updater.preview_read_fraction()
            stats["preview_error"] = self.bound.reducer.preview_error()
        return stats

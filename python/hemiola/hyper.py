"""One torch.optim param group's hyper-parameters as the engine reads them
(``hemiola._C.optim.Hyper``, hemiola/optimizer.h's ``OptimizerHyper``): the
schedules' updater and the parameter server take the same object."""

from __future__ import annotations

from typing import Any

from hemiola._native import C


def group_hyper(group: dict[str, Any]) -> Any:
    """`group`'s hyper-parameters with torch.optim's names and defaults (a
    key the optimizer lacks reads as torch's default, or as the value that
    turns the option off). Read every step, so LR schedulers keep working."""
    beta1, beta2 = group.get("betas", (0.9, 0.999))
    return C.optim.Hyper(
        lr=float(group["lr"]), momentum=float(group.get("momentum", 0.0)),
        dampening=float(group.get("dampening", 0.0)),
        weight_decay=float(group.get("weight_decay", 0.0)),
        nesterov=bool(group.get("nesterov", False)), maximize=bool(group.get("maximize", False)),
        beta1=float(beta1), beta2=float(beta2), eps=float(group.get("eps", 1e-8)),
        amsgrad=bool(group.get("amsgrad", False)))

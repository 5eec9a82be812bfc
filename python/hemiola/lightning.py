"""PyTorch Lightning strategy: hemiola's schedules under ``Trainer``.

    import hemiola.lightning
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="hemiola_decoupled")
    trainer = L.Trainer(strategy=hemiola.lightning.HemiolaStrategy(schedule="priority",
                                                                    compression="fp16"))

:class:`HemiolaStrategy` is Lightning's DDP strategy (same launchers, process
group, ``reduce``/``barrier``/``broadcast``, checkpoints) with the model
wrapped by :func:`hemiola.wrap` instead of ``DistributedDataParallel``.
Importing this module registers ``strategy="hemiola"`` (``wfbp``),
``"hemiola_priority"``, ``"hemiola_decoupled"`` and ``"hemiola_streaming"``
in each Lightning package installed: ``lightning`` (``import lightning as L``,
``lightning.pytorch``) and ``pytorch-lightning`` (``import pytorch_lightning
as pl``). The two are separate copies of Lightning whose classes do not mix,
so there is one strategy class per package (:func:`strategy_class`);
``HemiolaStrategy(...)`` makes the one for the package the calling code uses
(see :func:`caller_package`).

What Lightning does on its own keeps working: ``fit``/``validate``/``test``/
``predict``, ``ckpt_path`` resume, ``accumulate_grad_batches`` (through the
wrapped model's ``no_sync``), ``gradient_clip_val`` (norm: clipped through
the schedule, so ``priority`` and ``decoupled`` clip the averaged gradient),
``precision="bf16-mixed"`` and ``"16-mixed"`` (the GradScaler is handed to
the schedule), LR schedulers and ``self.log(..., sync_dist=True)``. Several
optimizers, manual optimization and value clipping work under ``wfbp`` and
are refused, saying why, under the schedules that run the update themselves.
"""

from __future__ import annotations

import abc
import atexit
import importlib
import inspect
import types
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch

from hemiola.config import SCHEDULES, Config
from hemiola.data_parallel import DataParallel
from hemiola.distributed import destroy_process_group_if_initialized
from hemiola.streaming import StreamingParallel
from hemiola.wrapping import wrap

__all__ = ["HemiolaStrategy", "strategy_class"]

#: the Lightning packages, newest first: ``lightning`` (whose trainer is
#: ``lightning.pytorch``) and ``pytorch-lightning``
PACKAGES = ("lightning.pytorch", "pytorch_lightning")


class _OnePackage(abc.ABCMeta):
    """Calling :class:`HemiolaStrategy` makes its class for one Lightning
    package (:func:`strategy_class`). Done here, not in ``__new__``, so that
    the signature tools read (LightningCLI's jsonargparse) is ``__init__``'s.
    An ABCMeta: the package classes also derive from Lightning's ABCs."""

    def __call__(cls, *args: Any, lightning_package: str | None = None, **kwargs: Any) -> Any:
        if cls is HemiolaStrategy:
            cls = strategy_class(lightning_package or caller_package())
        elif lightning_package not in (None, cls.package):  # type: ignore[attr-defined]
            raise ValueError(f"{cls.__name__} is {cls.package}'s strategy, "  # type: ignore[attr-defined]
                             f"not {lightning_package}'s")
        return super().__call__(*args, lightning_package=lightning_package, **kwargs)


class HemiolaStrategy(metaclass=_OnePackage):
    """Data-parallel training under Lightning with a hemiola schedule.

    An instance is an instance of Lightning's ``DDPStrategy`` too, of the
    package that ``lightning_package`` names (by default the one the calling
    code uses, see :func:`caller_package`).

    Args:
        schedule: ``"wfbp"`` (DDP's math), ``"priority"``, ``"decoupled"`` or ``"streaming"``
            (see :class:`hemiola.Config`).
        lightning_package: ``"lightning.pytorch"`` or ``"pytorch_lightning"``:
            whose ``Trainer`` will run it (None: found as said above).
        **options: Any other field of :class:`hemiola.Config` (``fusion_mb``,
            ``compression``, ``timeout_s``, ...), checked here, at
            construction. Lightning's own DDP options (``process_group_backend``,
            ``timeout``, ``start_method``, ...) go to ``DDPStrategy``.
    """

    strategy_name = "hemiola"
    #: the package this class belongs to (set on each package's class)
    package = ""
    _lightning: types.SimpleNamespace  # what the package's class uses of it

    def __init__(self, schedule: str = "wfbp", *, start_method: str = "popen",
                 process_group_backend: str | None = None, timeout: Any = None,
                 lightning_package: str | None = None, **options: Any) -> None:
        # Bad options fail here, in the launching process, not in every rank.
        Config.from_kwargs(schedule=schedule, **options)
        self._schedule = schedule
        self._options = options
        ddp: dict[str, Any] = {"start_method": start_method,
                               "process_group_backend": process_group_backend}
        if timeout is not None:
            ddp["timeout"] = timeout
        super().__init__(**ddp)  # type: ignore[call-arg]  # DDPStrategy's: next in the MRO

    @property
    def schedule(self) -> str:
        return self._schedule

    # ---- setup -------------------------------------------------------------

    def setup_distributed(self) -> None:
        super().setup_distributed()  # type: ignore[misc]
        # Lightning leaves the process group to the interpreter's exit, where
        # torch's Gloo thread can abort the process ("terminate called without
        # an active exception"); take it down first, as hemiola.init does.
        atexit.register(destroy_process_group_if_initialized)

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == self._lightning.TrainerFn.FITTING:
            # The optimizers first: priority and decoupled take over their step.
            self.setup_optimizers(trainer)
            self._wrap_for_fitting()
        else:
            # No gradients: rank 0's parameters and buffers, as DDP's strategy does.
            self._lightning.sync_module_states(self.model)
        self.setup_precision_plugin()

    def _wrap_for_fitting(self) -> None:
        module = self.lightning_module
        assert module is not None
        # priority, decoupled and sharded take over optimizer.step(); streaming only
        # watches it (the inner step is the optimizer's own, and Lightning's
        # clipping and loss scaling stay right as they are).
        deferred = self._schedule in ("priority", "decoupled", "sharded")
        needs_optimizer = self._schedule != "wfbp"
        if deferred and not module.automatic_optimization:
            raise ValueError(
                f"HemiolaStrategy(schedule={self._schedule!r}) runs optimizer.step() itself, "
                "which manual optimization cannot hand over; use schedule='wfbp' (DDP's math) "
                "or automatic optimization")
        if needs_optimizer and len(self.optimizers) != 1:
            raise ValueError(
                f"HemiolaStrategy(schedule={self._schedule!r}) steps one optimizer (it got "
                f"{len(self.optimizers)}); with several, use schedule='wfbp'")
        scaler = getattr(self.precision_plugin, "scaler", None) if deferred else None
        optimizer = self.optimizers[0] if needs_optimizer else None
        options = dict(self._options)
        if (self._schedule == "streaming" and options.get("replica_ranks") is None
                and self.num_nodes > 1):
            # A replica per node (Lightning need not set LOCAL_WORLD_SIZE,
            # which hemiola's own default reads): each node's ranks average
            # every step, the nodes every sync_every steps.
            options["replica_ranks"] = len(self.parallel_devices or [None])
        wrapped, _ = wrap(module, optimizer, self._schedule, grad_scaler=scaler, **options)
        self.model = wrapped
        if deferred:
            self._clip_through(wrapped)

    def _clip_through(self, wrapped: DataParallel) -> None:
        """Lightning clips with torch.nn.utils.clip_grad_norm_ on .grad (and
        refuses to when the optimizer's step unscales itself, as a taken-over
        step declares); under priority and decoupled the schedule must see the
        call to clip what it applies. Under wfbp Lightning's own clipping is
        right as it is (the averaged .grad), so this is not installed."""
        schedule = self._schedule

        def clip_gradients(optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
                           gradient_clip_algorithm: Any = None) -> None:
            if not clip_val or clip_val <= 0:
                return
            if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)) == "value":
                raise ValueError(
                    f"gradient_clip_algorithm='value' edits each rank's .grad, which "
                    f"schedule={schedule!r} does not apply (it applies the averaged gradient); "
                    "clip by norm (the default) or use schedule='wfbp'")
            wrapped.clip_grad_norm_(float(clip_val))

        self.precision_plugin.clip_gradients = clip_gradients  # type: ignore[method-assign]

    # ---- what DDPStrategy does with a DistributedDataParallel ---------------

    def configure_ddp(self) -> None:
        raise RuntimeError("HemiolaStrategy wraps the model with hemiola.wrap, not DDP")

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: the wrapped model's ``no_sync``."""
        if isinstance(self.model, (DataParallel, StreamingParallel)):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state with every pending update landed (exact)."""
        if isinstance(self.model, (DataParallel, StreamingParallel)):
            self.model.synchronize()
        return super().lightning_module_state_dict()

    def teardown(self) -> None:
        if isinstance(self.model, (DataParallel, StreamingParallel)):
            self.model.synchronize()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for schedule in SCHEDULES:
            name = "hemiola" if schedule == "wfbp" else f"hemiola_{schedule}"
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"hemiola's {schedule!r} schedule (hemiola.lightning)",
                    schedule=schedule)


_CLASSES: dict[str, type] = {}


def strategy_class(package: str) -> type:
    """:class:`HemiolaStrategy` for `package` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``): a subclass of it and of that package's
    ``DDPStrategy``, registered in that package's ``StrategyRegistry``.
    Subclass this one to extend the strategy."""
    if package not in PACKAGES:
        raise ValueError(f"unknown Lightning package {package!r}: use one of {PACKAGES}")
    if package not in _CLASSES:
        try:
            strategies = importlib.import_module(f"{package}.strategies")
        except ImportError as e:
            install = "lightning" if package == "lightning.pytorch" else "pytorch-lightning"
            raise ImportError(f"hemiola.lightning: {package} is not installed "
                              f"(pip install {install})") from e
        lightning = types.SimpleNamespace(
            TrainerFn=importlib.import_module(f"{package}.trainer.states").TrainerFn,
            sync_module_states=importlib.import_module(
                f"{package}.overrides.distributed")._sync_module_states)
        # A module-level name of its own, so that instances pickle (Lightning's
        # spawn launchers send the strategy to the new processes).
        name = f"HemiolaStrategy_{package.replace('.', '_')}"
        cls = type(name, (HemiolaStrategy, strategies.DDPStrategy),
                   {"__module__": __name__, "__qualname__": name,
                    "__doc__": HemiolaStrategy.__doc__, "package": package,
                    "_lightning": lightning})
        cls.register_strategies(strategies.StrategyRegistry)
        # HemiolaStrategy itself makes this package's class when called, so
        # it counts as this package's Strategy too (an ABC's virtual
        # subclass): LightningCLI's --trainer.strategy=hemiola.lightning.
        # HemiolaStrategy checks issubclass before it instantiates.
        strategies.Strategy.register(HemiolaStrategy)
        globals()[name] = _CLASSES[package] = cls
    return _CLASSES[package]


def installed_packages() -> list[str]:
    """The Lightning packages that import here, newest first."""
    found = []
    for package in PACKAGES:
        try:
            strategy_class(package)
        except ImportError:
            continue
        found.append(package)
    return found


def _package_of(value: Any) -> str | None:
    """The Lightning package `value` (a module, class or object) comes from."""
    try:
        name = value.__name__ if isinstance(value, types.ModuleType) else \
            getattr(value, "__module__", None) or type(value).__module__
    except Exception:  # noqa: BLE001 - an object whose attributes raise: not Lightning's
        return None
    if not isinstance(name, str):
        return None
    if name == "lightning" or name.startswith("lightning.pytorch"):
        return "lightning.pytorch"
    if name == "pytorch_lightning" or name.startswith("pytorch_lightning."):
        return "pytorch_lightning"
    return None


def caller_package() -> str:
    """The Lightning package whose ``Trainer`` a new ``HemiolaStrategy()``
    is for: the only one installed; else the one the calling code uses (its
    local, then global, names hold ``lightning``, ``pytorch_lightning`` or
    something of theirs, and not of both), looking outwards through the
    calling frames; else ``lightning.pytorch``, Lightning's own name since
    2.0. ``HemiolaStrategy(lightning_package=...)`` says it outright."""
    installed = installed_packages()
    if len(installed) == 1:
        return installed[0]
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__name__") != __name__:
            for names in (frame.f_locals, frame.f_globals):
                used = {_package_of(v) for v in list(names.values())} - {None}
                if len(used) == 1:
                    return used.pop()  # type: ignore[return-value]
        frame = frame.f_back
    return PACKAGES[0]


if not installed_packages():  # (which registers the strategy names in each)
    raise ImportError("hemiola.lightning needs Lightning: pip install lightning (or "
                      "pytorch-lightning)")

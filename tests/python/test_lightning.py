"""hemiola.lightning.HemiolaStrategy under a real ``pytorch_lightning.Trainer``:
2 CPU processes started by Lightning's own launcher (lightning_script.py,
run as a user runs a script), compared with Lightning's DDPStrategy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

import hemiola.lightning  # noqa: E402 - after the skip
from hemiola.lightning import HemiolaStrategy  # noqa: E402

SCRIPT = Path(__file__).with_name("lightning_script.py")


def fit(tmp_path: Path, name: str, strategy: str, *args: str,
        options: dict[str, Any] | None = None) -> dict[str, Any]:
    out = tmp_path / name
    out.mkdir()
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--out", str(out), *args]
    if options is not None:
        command += ["--options", json.dumps(options)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=out)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "overridden after learning rate scheduler" not in run.stderr
    result: dict[str, Any] = torch.load(out / "result.pt")
    assert result["world"] == 2
    return result


def max_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a["params"].keys() == b["params"].keys()
    return max((a["params"][k].double() - b["params"][k].double()).abs().max().item()
               for k in a["params"])


def test_wfbp_priority_and_sharded_equal_lightnings_ddp(tmp_path: Path) -> None:
    """Two epochs with gradient accumulation, norm clipping, an LR schedule
    and sync_dist logging: the parameters DDPStrategy reaches."""
    common = ("--accumulate", "2", "--clip", "0.5")
    ddp = fit(tmp_path, "ddp", "ddp", *common)
    for strategy in ("hemiola", "hemiola_priority", "hemiola_sharded"):
        ours = fit(tmp_path, strategy, strategy, *common)
        assert ours["steps"] == ddp["steps"] == 8
        assert max_difference(ours, ddp) < 1e-6, strategy
        assert ours["metrics"]["val_loss"] == pytest.approx(ddp["metrics"]["val_loss"], rel=1e-5)


def test_decoupled_with_accumulation_clipping_and_bf16(tmp_path: Path) -> None:
    common = ("--accumulate", "2", "--clip", "0.5", "--precision", "bf16-mixed")
    ddp = fit(tmp_path, "ddp", "ddp", *common)
    ours = fit(tmp_path, "decoupled", "hemiola_decoupled", *common)
    assert ours["steps"] == ddp["steps"]
    # The convergence tolerance of docs/benchmarks.md: losses within 5%.
    assert ours["metrics"]["val_loss"] == pytest.approx(ddp["metrics"]["val_loss"], rel=0.05)
    assert 0 < max_difference(ours, ddp) < 0.1  # it trained, on approximate parameters


@pytest.mark.parametrize(("schedule", "options"), [
    ("hemiola_priority", None),
    ("decoupled", {"correct_on_arrival": False}),
    ("hemiola_sharded", None),
])
def test_resume_from_a_checkpoint_equals_the_uninterrupted_fit(
        tmp_path: Path, schedule: str, options: dict[str, Any] | None) -> None:
    straight = fit(tmp_path, "straight", schedule, "--ckpt-every", "8", options=options)
    ckpt = tmp_path / "straight" / "step=8.ckpt"
    assert ckpt.is_file()
    resumed = fit(tmp_path, "resumed", schedule, "--resume", str(ckpt), options=options)
    assert resumed["steps"] == straight["steps"] == 16
    assert max_difference(resumed, straight) == 0.0


def test_streaming_fits_and_resumes_from_rank_0s_checkpoint(tmp_path: Path) -> None:
    """Lightning saves rank 0's state only. Under streaming the ranks' live
    parameters and inner optimizer states differ between syncs, so a resume
    gives every rank rank 0's (the shared copy and the outer state are
    everyone's): it continues training, but is not the uninterrupted run bit
    for bit (docs/streaming.md; plain scripts that save per rank are)."""
    options = {"sync_every": 4, "fragments": 2, "overlap": 1}
    straight = fit(tmp_path, "straight", "streaming", "--ckpt-every", "8", options=options)
    ckpt = tmp_path / "straight" / "step=8.ckpt"
    assert ckpt.is_file()
    resumed = fit(tmp_path, "resumed", "streaming", "--resume", str(ckpt), options=options)
    assert resumed["steps"] == straight["steps"] == 16
    assert resumed["metrics"]["val_loss"] == pytest.approx(straight["metrics"]["val_loss"],
                                                           rel=0.1)


def test_names_are_registered_and_options_checked_at_construction() -> None:
    from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

    for name, schedule in (("hemiola", "wfbp"), ("hemiola_priority", "priority"),
                           ("hemiola_decoupled", "decoupled")):
        assert StrategyRegistry[name]["init_params"] == {"schedule": schedule}
        registered = StrategyRegistry[name]["strategy"]
        assert registered is hemiola.lightning.strategy_class("pytorch_lightning")
        assert issubclass(registered, HemiolaStrategy) and issubclass(registered, DDPStrategy)
    # this module uses pytorch_lightning: HemiolaStrategy() is its strategy
    assert isinstance(HemiolaStrategy(), DDPStrategy)
    with pytest.raises(TypeError, match="fusion_MB"):
        HemiolaStrategy(schedule="priority", fusion_MB=3)
    with pytest.raises(ValueError, match="unknown schedule 'fastest'"):
        HemiolaStrategy(schedule="fastest")
    assert hemiola.lightning.HemiolaStrategy(compression="fp16").schedule == "wfbp"


class _TwoOptimizers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 1)
        self.b = torch.nn.Linear(2, 1)
        self.automatic_optimization = False

    def training_step(self, batch: Any, _: int) -> None:
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward((self.a(batch[0]) * self.b(batch[0])).sum())
        for opt in self.optimizers():
            opt.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.a.parameters(), lr=0.1),
                torch.optim.SGD(self.b.parameters(), lr=0.1)]


class _OneOptimizer(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        return self.a(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_in_process(strategy: HemiolaStrategy, module: pl.LightningModule | None = None,
                    **trainer: Any) -> None:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)),
                                       batch_size=2)
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
               enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, **trainer).fit(module or _TwoOptimizers(), data)


def test_manual_optimization_works_under_wfbp_and_is_refused_otherwise() -> None:
    _fit_in_process(HemiolaStrategy(schedule="wfbp"))
    with pytest.raises(ValueError, match="manual optimization cannot hand over"):
        _fit_in_process(HemiolaStrategy(schedule="priority"))


def test_value_clipping_works_under_wfbp_and_is_refused_otherwise() -> None:
    clip = {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}
    _fit_in_process(HemiolaStrategy(schedule="wfbp"), _OneOptimizer(), **clip)
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value' edits each rank"):
        _fit_in_process(HemiolaStrategy(schedule="decoupled"), _OneOptimizer(), **clip)
    # by norm, in process (one rank): through the schedule
    _fit_in_process(HemiolaStrategy(schedule="decoupled"), _OneOptimizer(),
                    gradient_clip_val=0.5)


def _one_layer_module(lightning: Any) -> type:
    """A one-layer LightningModule of `lightning` (either package) with SGD."""

    class Module(lightning.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.a(batch[0]).pow(2).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module


def test_lightning_pytorch_takes_the_names_and_an_instance() -> None:
    """Lightning's own examples import lightning.pytorch (the `lightning`
    package), a copy of Lightning whose classes are not pytorch_lightning's:
    both the registered name and HemiolaStrategy(...) made in code that
    uses it must be accepted by its Trainer and train through hemiola (one
    process; the two-rank runs above are pytorch_lightning's)."""
    L = pytest.importorskip("lightning.pytorch")  # noqa: N806 - Lightning's own name for it
    Module = _one_layer_module(L)  # noqa: N806 - a class

    assert L.strategies.StrategyRegistry["hemiola_priority"]["strategy"] is \
        hemiola.lightning.strategy_class("lightning.pytorch")
    strategy = HemiolaStrategy(schedule="priority")  # this frame's locals hold L
    assert isinstance(strategy, L.strategies.DDPStrategy)
    assert not isinstance(strategy, pl.strategies.DDPStrategy)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)),
                                       batch_size=2)
    for chosen in ("hemiola_priority", strategy):
        module = Module()
        before = module.a.weight.detach().clone()
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=chosen, max_steps=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(module, data)
        assert isinstance(trainer.strategy, HemiolaStrategy)
        assert trainer.strategy.schedule == "priority"
        assert getattr(trainer.optimizers[0], "_hemiola_wrapped", False)  # taken over
        assert not torch.equal(module.a.weight, before)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_cli_takes_the_strategy_by_its_class_path(package: str) -> None:
    """``--trainer.strategy=hemiola.lightning.HemiolaStrategy`` in either
    package's LightningCLI (jsonargparse checks that the path is a Strategy
    and reads its options from ``__init__``)."""
    pytest.importorskip("jsonargparse")
    import importlib

    cli_module = importlib.import_module(f"{package}.cli")
    cli = cli_module.LightningCLI(
        _one_layer_module(importlib.import_module(package)), run=False, save_config_callback=None,
        args=["--trainer.strategy=hemiola.lightning.HemiolaStrategy",
              "--trainer.strategy.schedule=priority", "--trainer.strategy.fusion_mb=2",
              "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, hemiola.lightning.strategy_class(package))
    assert strategy.schedule == "priority" and strategy._options["fusion_mb"] == 2.0

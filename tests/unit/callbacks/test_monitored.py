"""A misspelt ``monitor`` stops the fit right after the sanity check, before its first training step; a monitor
of a training metric (which no sanity check logs) or of an existing validation metric does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks.early_stopping import EarlyStopping
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.cli import main
from ember.errors import UsageError


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train/loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())
        self.log("val/acc", torch.tensor(0.5))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path: Path, callback: Any, sanity_steps: int = 2) -> Net:
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = ember.Trainer(
        max_epochs=2, callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, num_sanity_val_steps=sanity_steps,
    )  # fmt: skip
    module = Net()
    trainer.fit(module, loader, loader)
    return module


@pytest.mark.parametrize(
    "callback",
    [
        lambda: EarlyStopping(monitor="val/los"),
        lambda: EarlyStopping(monitor="val_loss"),
        lambda: ModelCheckpoint(monitor="val/ac", mode="max"),
    ],
)
def test_a_misspelt_monitor_stops_the_fit_before_its_first_step(tmp_path: Path, callback: Any) -> None:
    made = callback()
    owner = type(made).__name__
    module = Net()
    with pytest.raises(UsageError, match=rf"^{owner}\(monitor='{made.monitor}'\): .*did you mean 'val/(loss|acc)'"):
        loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
        trainer = ember.Trainer(
            max_epochs=2, callbacks=[made], logger=False, enable_progress_bar=False, default_root_dir=tmp_path
        )
        trainer.fit(module, loader, loader)
    assert module.steps == 0


@pytest.mark.parametrize("monitor", ["val/loss", "train/loss"])
def test_a_monitor_of_a_logged_or_training_metric_trains(tmp_path: Path, monitor: str) -> None:
    assert fit(tmp_path, EarlyStopping(monitor=monitor, patience=5)).steps == 4


def test_without_a_sanity_check_the_callbacks_own_check_applies(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="did you mean 'val/loss'"):  # at the first validation, as before
        fit(tmp_path, EarlyStopping(monitor="val/los"), sanity_steps=0)


def test_the_cli_says_it_in_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[3] / "configs" / "digits.yaml"
    callbacks = "trainer.callbacks=[{_target_: ember.callbacks.EarlyStopping, monitor: val/los}]"
    assert main(["fit", "-c", str(config), callbacks, "trainer.logger=false", "trainer.max_epochs=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ember: error: EarlyStopping(monitor='val/los'): the validation logs no such metric; ")
    assert "did you mean 'val/loss'?" in err[-1] and not any("Traceback" in line for line in err)

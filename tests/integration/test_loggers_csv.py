"""A real fit: metrics.csv rows equal, value for value, what the trainer sent to every logger."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import GradientMonitor, LearningRateMonitor
from ember.loggers import CSVLogger, Logger


class Spy(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append({"step": float(step), **metrics})


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.loss_fn = nn.MSELoss()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train/abs_err", (self.model(batch[0]) - batch[1]).abs().mean(), on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)}}


def test_csv_rows_equal_the_values_sent_to_the_loggers(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)
    spy = Spy()
    trainer = ember.Trainer(
        max_epochs=3,
        log_every_n_steps=2,
        default_root_dir=tmp_path,
        logger=[CSVLogger(), spy],
        callbacks=[LearningRateMonitor(logging_interval="step"), GradientMonitor()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    train, val = TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:])
    trainer.fit(Net(), DataLoader(train, batch_size=4), DataLoader(val, batch_size=4))
    with open(trainer.run_dir / "metrics.csv", newline="") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    assert rows == spy.rows  # float -> CSV text -> float is exact
    names = set().union(*rows)
    assert names == {
        "step",
        "epoch",
        "train/loss",
        "train/abs_err_step",
        "train/abs_err_epoch",
        "val/loss",
        "lr-SGD",
        "train/grad_norm",
    }
    assert [r["step"] for r in rows if "val/loss" in r] == [7, 15, 23]  # after steps 8, 16, 24: their rows
    assert [r["lr-SGD"] for r in rows if "lr-SGD" in r] == [0.1] * 4 + [0.1 * 0.9] * 4 + [0.1 * 0.9 * 0.9] * 4
    assert [r for r in rows if "val/loss" in r][-1]["val/loss"] == trainer.callback_metrics["val/loss"]

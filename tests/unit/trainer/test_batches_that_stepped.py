"""The loggers' step axis (``FitState.batches_that_stepped``) across a resume, and in checkpoints of older versions.

Under manual optimization it counts batches while ``global_step`` counts every ``step()`` call, so it is
checkpointed on its own: a resumed fit logs at the steps the uninterrupted fit logs at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.trainer.loop import FitState


class TwoOptimizers(ember.TrainingModule):
    """Manual optimization: both optimizers step on even batches, the first alone on odd ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        a, b = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.second(torch.tanh(self.first(x))), y)
        self.manual_backward(loss)
        a.step()
        if batch_idx % 2 == 0:
            b.step()
        a.zero_grad()
        b.zero_grad()
        self.log("loss", loss, on_step=True, on_epoch=True)

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.first.parameters(), lr=0.1), torch.optim.SGD(self.second.parameters(), lr=0.1)]


class Rows(ember.loggers.Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, list[str]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, sorted(k for k in metrics if k != "epoch")))


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(20, 3, generator=g), torch.randn(20, 1, generator=g)), batch_size=4)


def fit(epochs: int, directory: Path, ckpt_path: Path | None = None) -> tuple[ember.Trainer, Rows]:
    logger = Rows()
    trainer = ember.Trainer(
        max_epochs=epochs, log_every_n_steps=2, logger=logger, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[ModelCheckpoint(directory, save_top_k=-1)],
    )  # fmt: skip
    trainer.fit(TwoOptimizers(), data(), ckpt_path=ckpt_path)
    return trainer, logger


def test_a_resumed_manual_fit_logs_at_the_steps_of_the_uninterrupted_one(tmp_path: Path) -> None:
    whole, whole_rows = fit(3, tmp_path / "whole")
    assert whole.global_step == 3 * (2 + 1 + 2 + 1 + 2)  # 5 batches per epoch
    assert whole.progress.batches_that_stepped == 15
    first, _ = fit(1, tmp_path / "parts")
    assert (first.global_step, first.progress.batches_that_stepped) == (8, 5)
    resumed, resumed_rows = fit(3, tmp_path / "parts", ckpt_path=tmp_path / "parts" / "epoch=0-step=8")
    assert resumed.global_step == whole.global_step and resumed.progress.batches_that_stepped == 15
    assert resumed_rows.rows == [row for row in whole_rows.rows if row[0] >= 5]
    assert [s for s, names in resumed_rows.rows if names == ["loss_step"]] == [5, 7, 9, 11, 13]
    assert [s for s, names in resumed_rows.rows if names == ["loss_epoch"]] == [9, 14]


def test_a_checkpoint_of_an_older_version_counts_its_optimizer_steps() -> None:
    state = FitState()
    state.load_state_dict({"epoch": 2, "global_step": 12, "batch_idx": 0, "validated_after": -1})
    assert (state.global_step, state.batches_that_stepped) == (12, 12)
    state.load_state_dict({**state.state_dict(), "global_step": 20, "batches_that_stepped": 10})
    assert (state.global_step, state.batches_that_stepped) == (20, 10)


class Due(ember.Callback):
    """Records ``trainer.logs_this_batch`` at each training batch's start."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_batch_start(self, trainer: ember.Trainer, module: ember.TrainingModule, batch: Any, idx: int) -> None:
        self.seen.append(trainer.logs_this_batch)


def test_logs_this_batch_follows_the_loggers_axis_under_manual_optimization(tmp_path: Path) -> None:
    """Three optimizer steps per two batches: the batches the loggers write are every third batch, as the rows
    show, and `logs_this_batch` (which LearningRateMonitor, ThroughputMonitor and GradientMonitor read) says so
    for exactly those batches."""
    due, logger = Due(), Rows()
    trainer = ember.Trainer(
        max_epochs=2, log_every_n_steps=3, logger=logger, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[due],
    )  # fmt: skip
    trainer.fit(TwoOptimizers(), data())
    assert due.seen == [(batch + 1) % 3 == 0 for batch in range(10)]
    assert [s for s, names in logger.rows if names == ["loss_step"]] == [2, 5, 8]

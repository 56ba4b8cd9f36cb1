"""ProgressLine and ModelSummary print what they promise, on global zero."""

from __future__ import annotations

import io

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelSummary, ProgressLine
from ember.callbacks.model_summary import count_parameters, summarize


class Regressor(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
        self.model[1].weight.requires_grad_(False)
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


def test_progress_lines_per_epoch_and_inside(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stream = io.StringIO()
    trainer = ember.Trainer(
        max_epochs=2,
        callbacks=[ProgressLine(every_n_batches=2, stream=stream)],
        logger=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), loader(), loader(8))
    lines = stream.getvalue().splitlines()
    assert [line.split("  train/loss")[0] for line in lines] == [
        "epoch 1/2  step 2  batch 2/4",
        "epoch 1/2  step 4",  # the epoch line covers the last batch
        "epoch 2/2  step 6  batch 2/4",
        "epoch 2/2  step 8",
    ]
    last = trainer.progress_bar_metrics
    assert set(last) == {"train/loss", "val/loss"}
    assert f"val/loss {last['val/loss']:.4g}" in lines[-1]
    stream.truncate(0)
    stream.seek(0)
    trainer.test(Regressor(), loader(8))
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("test  test/loss ") and "train/loss" not in line


def test_model_summary_counts() -> None:
    module = Regressor()
    assert count_parameters(module) == (4 * 3 + 3 + 3 + 1, 4 * 3 + 3 + 1)
    text = summarize(module)
    rows = [line.split() for line in text.splitlines()]
    assert rows[0] == ["name", "type", "params", "trainable"]
    assert rows[1] == ["model", "Sequential", "19", "16"]
    assert rows[-2] == ["total", "Regressor", "19", "16"]
    assert rows[-1] == [f"{19 * 4 / 1e6:.2f}", "MB", "of", "parameters"]


def test_model_summary_prints_at_fit_start() -> None:
    stream = io.StringIO()
    trainer = ember.Trainer(max_steps=1, callbacks=[ModelSummary(stream)], logger=False, enable_progress_bar=False)
    trainer.fit(Regressor(), loader())
    assert stream.getvalue() == summarize(Regressor()) + "\n"

"""A tiny classifier and its data, as a user would write them: no configure_optimizers.

The optimizer comes from the config's ``optimizer`` / ``lr_scheduler`` sections. ``hang_at_epoch``
lets a test stop the run at a known point (after the previous epoch's checkpoint) and kill it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember


class Net(ember.TrainingModule):
    """An MLP on 4 features, 3 classes; logs val/acc, test/acc and the learning rate of each epoch."""

    def __init__(self, hidden: int = 16, hang_at_epoch: int | None = None, marker: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 3))
        self.loss_fn = nn.CrossEntropyLoss()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.log("lr", lr, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate("val", batch)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluate("test", batch)

    def _evaluate(self, stage: str, batch: Any) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{stage}/loss", self.loss_fn(logits, y))
        self.log(f"{stage}/acc", (logits.argmax(-1) == y).float().mean())

    def on_train_epoch_start(self) -> None:
        if self.hparams.hang_at_epoch == self.current_epoch:
            Path(self.hparams.marker).write_text(str(self.global_step))
            time.sleep(120)  # the test kills the process here


class ExampleNet(Net):
    """`Net` with an example input: exportable without a data section (``ember export --module``)."""

    example_input_array = torch.zeros(2, 4)


class Blobs(ember.DataModule):
    """Gaussian points labelled by their largest of the first 3 coordinates; a fixed 75/25 split."""

    def __init__(self, n: int = 128, batch_size: int = 16, seed: int = 0) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.n, 4, generator=g)
        y = x[:, :3].argmax(-1)
        n_val = self.n // 4
        self.val_set = TensorDataset(x[:n_val], y[:n_val])
        self.train_set = TensorDataset(x[n_val:], y[n_val:])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=32)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()

"""A small model and data for the tuning tests: BatchNorm (buffers), dropout (random draws), a shuffling
loader with its own generator kept by the datamodule (so a finder that forgets to restore it is caught)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember


class Net(ember.TrainingModule):
    def __init__(self, lr: float = 0.05, hidden: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(
            nn.Linear(8, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 3)
        )
        self.loss_fn = nn.CrossEntropyLoss()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


class Blobs(ember.DataModule):
    """Three Gaussian blobs in 8 dimensions; the training loader reuses one generator across epochs and fits."""

    def __init__(self, batch_size: int = 16, n: int = 192, seed: int = 0) -> None:
        self.batch_size, self.n = batch_size, n
        self.generator = torch.Generator().manual_seed(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        labels = torch.randint(0, 3, (n,), generator=gen)
        centers = torch.randn(3, 8, generator=gen) * 2
        self.x = centers[labels] + torch.randn(n, 8, generator=gen)
        self.y = labels

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(self.x, self.y)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, generator=self.generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:64], self.y[:64]), batch_size=32)


def quiet_trainer(**options: Any) -> ember.Trainer:
    defaults: dict[str, Any] = {
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
    }
    return ember.Trainer(**{**defaults, **options})


@pytest.fixture
def tiny() -> Iterator[tuple[type[Net], type[Blobs], Callable[..., ember.Trainer]]]:
    """(Net, Blobs, quiet_trainer), with the global random streams put back afterwards."""
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        ember.seed_everything(0)
        yield Net, Blobs, quiet_trainer
    random.setstate(python)
    np.random.set_state(numpy_state)

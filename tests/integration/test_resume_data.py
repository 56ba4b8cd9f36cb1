"""Resuming torchdata's StatefulDataLoader and iterable datasets that keep their own position."""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Linear(8, 1))
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class StopAt(ember.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


class Counting(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Yields 20 samples from a seeded stream; its position is its state."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while self.position < 20:
            g = torch.Generator().manual_seed(self.position)
            x = torch.randn(3, generator=g)
            self.position += 1
            yield x, x.sum(0, keepdim=True)
        self.position = 0  # the next epoch starts over

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def fit(root: Path, make_loader: Any, stop: int | None = None, ckpt_path: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    module = Net()
    callbacks: list[ember.Callback] = [ModelCheckpoint(every_n_train_steps=1)]
    if stop is not None:
        callbacks.append(StopAt(stop))
    trainer = ember.Trainer(
        max_epochs=3,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        run_name="net",
    )
    trainer.fit(module, make_loader(), ckpt_path=ckpt_path)
    return module


def resumed_equals_uninterrupted(tmp_path: Path, make_loader: Any, stop: int) -> bool:
    full = fit(tmp_path / "full", make_loader)
    fit(tmp_path / "split", make_loader, stop=stop)
    torch.manual_seed(999)
    random.seed(3)
    resumed = fit(tmp_path / "split", make_loader, ckpt_path="last")
    return all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters(), strict=True))


def test_stateful_dataloader_over_a_shuffled_dataset(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make_loader() -> StatefulDataLoader:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(30, 3, generator=g), torch.randn(30, 1, generator=g))
        return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert resumed_equals_uninterrupted(tmp_path, make_loader, stop=11)  # 8 batches per epoch: mid-epoch 2


def test_stateful_dataloader_over_an_iterable_dataset(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert resumed_equals_uninterrupted(tmp_path, lambda: StatefulDataLoader(Counting(), batch_size=3), stop=9)


def test_iterable_dataset_with_state_resumes_mid_epoch(tmp_path: Path) -> None:
    assert resumed_equals_uninterrupted(tmp_path, lambda: DataLoader(Counting(), batch_size=3), stop=9)

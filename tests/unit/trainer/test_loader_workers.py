"""The worker processes of ``persistent_workers=True`` loaders end with the fit (`ember.trainer.data.release_workers`).

PyTorch stops such workers when the loader is freed. A fit's loaders are freed by the garbage collector (the
trainer, its loop and the loaders refer to each other), and there the queues that would tell the workers to stop
are finalized first: each worker was then waited for 5 s and killed, at whatever later moment the collector ran
(10 s for two workers, in the middle of the next fit of a sweep, say). Every fit now stops them as it ends.
"""

from __future__ import annotations

import gc
import multiprocessing
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        self.log("val/loss", self.layer(x).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def persistent_loader() -> DataLoader:
    data = TensorDataset(torch.randn(16, 3, generator=torch.Generator().manual_seed(0)))
    return DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)


class WorkerPids(ember.Callback):
    """The pids of the worker processes of the fit's loaders, seen while training."""

    def __init__(self) -> None:
        self.pids: set[int] = set()

    def on_train_batch_end(self, trainer: ember.Trainer, *args: Any) -> None:
        for loader in [trainer.train_dataloader, *trainer.fit_loop.val_loaders]:
            iterator = getattr(loader, "_iterator", None)
            self.pids |= {worker.pid for worker in getattr(iterator, "_workers", [])}


def alive(pids: set[int]) -> set[int]:
    return pids & {child.pid for child in multiprocessing.active_children()}


def test_a_fit_stops_the_persistent_workers_of_its_loaders_as_it_ends() -> None:
    seen = WorkerPids()
    train, val = persistent_loader(), persistent_loader()
    trainer = ember.Trainer(max_epochs=2, callbacks=[seen], **QUIET)
    trainer.fit(Net(), train, val)
    assert len(seen.pids) == 4  # two workers each for the training and the validation loader
    assert alive(seen.pids) == set()  # stopped when fit returned, not whenever the collector frees the loaders
    del trainer
    gc.collect()


def test_a_fit_that_raises_stops_them_too() -> None:
    class Interrupt(WorkerPids):
        def on_train_batch_end(self, trainer: ember.Trainer, *args: Any) -> None:
            super().on_train_batch_end(trainer, *args)
            if trainer.global_step == 2:
                raise ValueError("planted")

    seen = Interrupt()
    trainer = ember.Trainer(max_epochs=2, callbacks=[seen], **QUIET)
    with pytest.raises(ValueError, match="planted"):
        trainer.fit(Net(), persistent_loader())
    assert seen.pids and alive(seen.pids) == set()


def test_a_loader_whose_workers_were_stopped_serves_the_next_fit_as_a_new_loader_would() -> None:
    """The loader starts new workers for its next use; the second fit equals one on a loader never used."""
    reused = persistent_loader()

    def fit(loader: DataLoader) -> torch.Tensor:
        ember.seed_everything(3)
        module = Net()
        ember.Trainer(max_epochs=2, **QUIET).fit(module, loader)
        return module.layer.weight.detach().clone()

    fit(reused)
    assert torch.equal(fit(reused), fit(persistent_loader()))


def test_loaders_replaced_by_a_reload_stop_their_workers() -> None:
    class Reloading(Net):
        def __init__(self) -> None:
            super().__init__()
            self.loaders: list[DataLoader] = []

        def train_dataloader(self) -> DataLoader:
            self.loaders.append(persistent_loader())
            return self.loaders[-1]

    seen = WorkerPids()
    module = Reloading()
    ember.Trainer(max_epochs=3, reload_dataloaders_every_n_epochs=1, callbacks=[seen], **QUIET).fit(module)
    assert len(module.loaders) == 3 and len(seen.pids) == 6
    assert alive(seen.pids) == set()

"""A small regression workload with planted poison batches, for the rewind tests (docs/rewind.md).

`PoisonData` holds ``n`` samples of a linear target with noise; the samples in `poison` have their inputs
scaled by 1e4, so a batch holding one has a loss many orders of magnitude above the others. `loader` shuffles
with its own seeded generator; `batch_ids` gives the sample ids of the first epoch's batches, so a test can
plant poison at known batch positions. `Without` is the batch sampler of the reference runs: the loader's own
batches with the ones at some positions left out (so the samples of those batches are removed from the data,
and every other batch is the one the full loader yields). Imported by the DDP worker as well.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler

import ember

FEATURES, HIDDEN = 8, 16
LOADER_SEED = 11


class PoisonData(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int, poison: frozenset[int] = frozenset(), seed: int = 0) -> None:
        w = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(1000))  # the same target for every seed
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=g)
        scale = torch.ones(n, 1)
        scale[sorted(poison)] = 1e4
        self.x = self.x * scale
        self.poison = poison

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]


class ResumableStream(IterableDataset[tuple[Tensor, Tensor]]):
    """`PoisonData` as an iterable of unknown length that saves and restores its position (state_dict /
    load_state_dict), so a rewind can go back in it."""

    def __init__(self, data: PoisonData) -> None:
        self.data, self.position = data, 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        while self.position < len(self.data):
            self.position += 1
            yield self.data[self.position - 1]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class Without:
    """The batches of ``BatchSampler(RandomSampler(...))`` without those at epoch positions `drop` in the epochs
    listed (every draw still made): samples removed from the data the way a rewind leaves them out."""

    def __init__(self, inner: BatchSampler, drop: dict[int, set[int]]) -> None:
        self.inner, self.drop, self.epoch = inner, drop, 0

    def __len__(self) -> int:
        return len(self.inner) - len(self.drop.get(self.epoch, ()))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        drop = self.drop.get(self.epoch, set())
        return (b for i, b in enumerate(self.inner) if i not in drop)


def loader(data: Dataset[Any], batch_size: int, drop: dict[int, set[int]] | None = None) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(LOADER_SEED)
    if drop is None:
        return DataLoader(data, batch_size=batch_size, shuffle=True, generator=generator)
    sampler = BatchSampler(RandomSampler(data, generator=generator), batch_size, drop_last=False)
    return DataLoader(data, batch_sampler=Without(sampler, drop), generator=generator)


def batch_ids(n: int, batch_size: int) -> list[list[int]]:
    """The sample ids of each batch of `loader`'s first epoch (the same draws, on a fresh generator)."""
    indices = list(range(n))
    return [[int(i) for i in b] for b in loader(indices, batch_size)]  # type: ignore[arg-type]


class Regressor(ember.TrainingModule):
    def __init__(self, lr: float = 0.05, momentum: float = 0.0, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Dropout(dropout), nn.Linear(HIDDEN, 1))
        self.loss_fn = nn.MSELoss()
        self.lr, self.momentum = lr, momentum
        self.losses: list[float] = []  # every trained batch's loss, for the docs' figure (read after fit)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        if self.record_losses:
            self.losses.append(float(loss.detach()))  # a host sync per step: only when a figure asks for the curve
        return loss

    record_losses = False

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("val/loss", self.loss_fn(self.model(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def params(module: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def val_loss(module: nn.Module, data: PoisonData) -> float:
    with torch.no_grad():
        value = float(nn.functional.mse_loss(module.model(data.x), data.y))  # type: ignore[operator]
    return value if math.isfinite(value) else math.inf

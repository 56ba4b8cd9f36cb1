"""Data position pieces: set_epoch is called every epoch, sample_generator is a pure function of its keys."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ember
from ember.seed import sample_generator


class EpochAware(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        self.epochs: list[int] = []
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)
        self.epoch = epoch

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(2, generator=sample_generator(index, self.epoch, seed=3))
        return noise, noise.sum(0, keepdim=True)


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_set_epoch_is_called_before_every_training_epoch() -> None:
    dataset = EpochAware()
    trainer = ember.Trainer(
        max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
    )
    trainer.fit(Net(), DataLoader(dataset, batch_size=4, shuffle=True))
    assert dataset.epochs == [0, 1, 2]


def test_sample_generator_depends_only_on_its_keys() -> None:
    first = torch.rand(4, generator=sample_generator(5, epoch=2, seed=7))
    torch.manual_seed(123)  # the global stream does not matter
    again = torch.rand(4, generator=sample_generator(5, epoch=2, seed=7))
    assert torch.equal(first, again)
    others = [torch.rand(4, generator=sample_generator(*keys)) for keys in ((6, 2, 7), (5, 3, 7), (5, 2, 8))]
    assert all(not torch.equal(first, other) for other in others)


def test_a_whole_evaluation_epoch_iterates_the_loader_to_its_end_like_a_for_loop() -> None:
    """8 samples in batches of 4: the sampler's final draw happens only when the loader is asked once more."""
    from ember.trainer.data import limited

    def loader() -> DataLoader:
        return DataLoader(EpochAware(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))

    raw, ours = loader(), loader()
    for _ in range(2):
        raw_batches = [batch for batch in raw]
        our_batches = list(limited(ours, len(ours)))
        assert all(torch.equal(a[0], b[0]) for a, b in zip(raw_batches, our_batches, strict=True))
    assert torch.equal(raw.generator.get_state(), ours.generator.get_state())
    cut = loader()
    assert len(list(limited(cut, 1))) == 1


def test_a_warning_says_set_epoch_does_not_reach_persistent_workers() -> None:
    def fit(persistent: bool) -> None:
        quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer = ember.Trainer(max_epochs=1, **quiet)
        loader = DataLoader(EpochAware(), batch_size=4, num_workers=2, persistent_workers=persistent)
        trainer.fit(Net(), loader)

    with pytest.warns(RuntimeWarning, match="persistent_workers=True: each worker keeps the copy"):
        fit(persistent=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fit(persistent=False)

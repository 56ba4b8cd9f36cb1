"""nonfinite_loss: "error" names the bad step without a per-step sync; "skip" drops those batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.trainer.numerics import NonFiniteLoss

QUIET: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


class Poisoned(ember.TrainingModule):
    """Its loss is NaN on the batches whose index is in `bad`."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)
        self.bad = bad
        self.steps_seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_seen.append(self.global_step)
        loss = nn.functional.mse_loss(self.model(batch[0]), batch[1])
        return loss * float("nan") if batch_idx in self.bad else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(40, 2, generator=g), torch.randn(40, 1, generator=g)), batch_size=4)


def test_error_is_raised_at_the_next_sync_and_names_the_step() -> None:
    module = Poisoned(bad={2})  # optimizer step 3
    trainer = ember.Trainer(max_epochs=1, nonfinite_loss="error", log_every_n_steps=5, **QUIET)
    with pytest.raises(NonFiniteLoss, match="inf or NaN at optimizer step 3"):
        trainer.fit(module, loader())
    # Checked where the trainer syncs anyway: after step 5, not at step 3.
    assert trainer.global_step == 5


def test_skip_drops_the_bad_batches_and_their_steps() -> None:
    torch.manual_seed(0)
    module = Poisoned(bad={2, 7})
    trainer = ember.Trainer(max_epochs=1, nonfinite_loss="skip", **QUIET)
    trainer.fit(module, loader())
    assert trainer.global_step == 8  # 10 batches, 2 skipped
    assert trainer.finite_guard.skipped_batches == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_off_by_default_and_bad_value() -> None:
    trainer = ember.Trainer(max_epochs=1, **QUIET)
    trainer.fit(Poisoned(bad={0}), loader())  # NaN weights, no error: the guard is opt-in
    with pytest.raises(ValueError, match="nonfinite_loss='always'"):
        ember.Trainer(nonfinite_loss="always")

"""Training epoch aggregates are ready when on_train_epoch_end and epoch schedulers run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember


class Constant(ember.TrainingModule):
    """Logs a per-batch value whose epoch mean is known: batches of 4, 4, 2 with values 1, 2, 3."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.seen: list[dict[str, float]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.log("train/value", float(batch_idx + 1), on_step=False, on_epoch=True)
        return (self.w * batch[0]).sum() * 0 + self.w**2

    def on_train_epoch_end(self) -> None:
        self.seen.append(self.trainer.callback_metrics)

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "train/value"}}


def test_epoch_mean_visible_in_hook_and_to_plateau_scheduler() -> None:
    loader = DataLoader(TensorDataset(torch.ones(10)), batch_size=4)
    trainer = ember.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False)
    module = Constant()
    trainer.fit(module, loader)
    expected = (1 * 4 + 2 * 4 + 3 * 2) / 10
    assert [seen["train/value"] for seen in module.seen] == [pytest.approx(expected)] * 3
    # The metric never improves after epoch 1, so with patience 0 the LR halves after epochs 2 and 3.
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.25

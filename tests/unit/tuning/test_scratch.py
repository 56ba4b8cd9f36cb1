"""`ember.tuning.scratch.Snapshot` on lazy modules: what a scratch run initialises is recorded before it trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.tuning import lr_find
from ember.tuning.scratch import Snapshot


class LateLazy(ember.TrainingModule):
    """A lazy head that joins in only from the second optimizer step on; records its values when first used."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(5, 3)
        self.late = nn.LazyLinear(3)
        self.loss_fn = nn.CrossEntropyLoss()
        self.late_at_first_use: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        if self.trainer.global_step < 1:
            return out
        out = out + self.late(out)
        if self.late_at_first_use is None:
            self.late_at_first_use = self.late.weight.detach().clone()
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss: torch.Tensor = self.loss_fn(self(x), y)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_snapshot_knows_its_lazy_tensors_until_they_are_initialised() -> None:
    module = LateLazy()
    snapshot = Snapshot.take(module)
    assert snapshot.lazy == {"late.weight", "late.bias"} and "body.weight" in snapshot.tensors
    snapshot.capture_initialised()  # nothing initialised yet: nothing recorded
    assert snapshot.lazy == {"late.weight", "late.bias"} and "late.weight" not in snapshot.tensors
    module.late(torch.zeros(2, 3))
    snapshot.capture_initialised()
    assert not snapshot.lazy and torch.equal(snapshot.tensors["late.weight"], module.late.weight)


def test_a_lazy_layer_initialised_at_a_later_step_comes_back_as_it_was_initialised(tmp_path: Path) -> None:
    x = torch.randn(32, 5, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :3].argmax(-1)), batch_size=8)
    options: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
    module = LateLazy()
    body = module.body.weight.detach().clone()
    lr_find(ember.Trainer(default_root_dir=tmp_path, **options), module, loader, num_steps=4, plot=False, verbose=False)
    assert module.late_at_first_use is not None  # first used at step 1, then trained for two steps
    assert torch.equal(module.late.weight, module.late_at_first_use) and torch.equal(module.body.weight, body)

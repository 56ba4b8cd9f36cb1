"""The finders (``ember tune lr``, ``ember tune batch-size``) never fail where a fit would not, and never give a
misleading answer (issue "Never blocked, never silently wrong", item 7).

- A module with lazy parameters (``nn.LazyLinear``) is tuned like any other: the finder's first batch
  initialises them as a fit's first step would, and the module comes back with those initial values.
- ``tune batch-size`` on an empty data set says the data set is empty and what to do (it said "init_size=2 is
  above the limit 1").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rel_helpers import assert_one_line_error, make_project, run_cli
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.tuning import lr_find, scale_batch_size

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)


class LazyNet(ember.TrainingModule):
    """A lazy first layer (its input width is known only from the data) before an ordinary one."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 3))
        self.loss_fn = nn.CrossEntropyLoss()
        self.first_seen: torch.Tensor | None = None  # the lazy weight as the first training step used it

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(batch, batch_idx)
        if self.first_seen is None:
            self.first_seen = self.model[0].weight.detach().clone()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=generator)
    return x, x[:, :3].argmax(-1)


def test_lr_find_on_a_lazy_module_restores_its_initial_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = LazyNet()
    eager_before = module.model[2].weight.detach().clone()
    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)  # in order: the first step's batch is x[:8]
    rng = torch.get_rng_state()
    trainer = ember.Trainer(default_root_dir=tmp_path, max_epochs=1, **QUIET)
    result = lr_find(trainer, module, loader, num_steps=30, max_lr=10.0, plot=False, logger=False, verbose=False)
    assert len(result.losses) >= 10 and result.suggestion is not None
    lazy = module.model[0].weight
    assert not isinstance(lazy, nn.parameter.UninitializedParameter) and lazy.shape == (8, 5)
    assert module.first_seen is not None and torch.equal(lazy, module.first_seen)  # as the first step saw it
    with torch.no_grad():  # so the loss of the first step's batch is the first loss recorded
        first = module.loss_fn(module(x[:8]), y[:8])
    assert first.item() == pytest.approx(result.losses[0], rel=1e-6)
    assert torch.equal(module.model[2].weight, eager_before) and torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in module.parameters())
    trainer.fit(module, loader)  # and it trains afterwards
    assert trainer.global_step == len(loader)


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_scale_batch_size_on_a_lazy_module_restores_its_initial_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = LazyNet()
    x, y = data()
    trainer = ember.Trainer(default_root_dir=tmp_path, **QUIET)
    result = scale_batch_size(trainer, module, DataLoader(TensorDataset(x, y), batch_size=4), max_size=32)
    assert result.batch_size == 32 and [t.batch_size for t in result.trials] == [2, 4, 8, 16, 32]
    assert module.first_seen is not None and module.model[0].weight.shape == (8, 5)
    assert torch.equal(module.model[0].weight, module.first_seen)  # five trials trained it, each was undone


@pytest.mark.usefixtures("clean_imports")
def test_tune_batch_size_on_an_empty_data_set_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The datamodule's shuffling loader cannot even be built on no samples (torch's RandomSampler refuses)."""
    config = make_project(tmp_path)
    args = ["tune", "batch-size", "-c", str(config), "--memory-budget", "1MB", "data.n=0"]
    code, out, err = run_cli(args, capsys)
    assert_one_line_error(err, "the training data set is empty (0 samples)", "check the data")
    assert code == 2 and "scale_batch_size: batch size" not in out  # no trial ran


def test_scale_batch_size_on_an_empty_loader_says_so(tmp_path: Path) -> None:
    empty = DataLoader(TensorDataset(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)), batch_size=4)
    trainer = ember.Trainer(default_root_dir=tmp_path, **QUIET)
    with pytest.raises(ValueError, match=r"^scale_batch_size: the training data set is empty \(0 samples\)"):
        scale_batch_size(trainer, LazyNet(), empty, memory_budget="1MB")

"""One epoch numbering everywhere a user reads it: from 0, as in checkpoint names (``epoch=1-step=8``).

`describe` (the "resuming from ... (epoch N, step S)" and "loading ..." lines) names the epoch a checkpoint was
written in, the number its default name shows, whether it was written at an epoch's end or inside an epoch.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import checkpoint as ckpt


class Regressor(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_describe_names_the_epoch_of_the_checkpoint_name(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 2, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)
    saver = ember.callbacks.ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)  # inside epochs and at ends
    ends = ember.callbacks.ModelCheckpoint(every_n_epochs=1, save_top_k=-1, filename="end-{epoch}-{step}")
    trainer = ember.Trainer(
        max_epochs=3, callbacks=[saver, ends], default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Regressor(), data)
    folder = trainer.run_dir / ckpt.CHECKPOINT_SUBDIR
    names = sorted(p.name for p in ckpt.checkpoints_in(folder))
    # 4 steps an epoch: every 3 steps (3, 6, 9, 12) and each epoch's end (4, 8, 12)
    assert names == [
        "end-epoch=0-step=4", "end-epoch=1-step=8", "end-epoch=2-step=12",
        "epoch=0-step=3", "epoch=1-step=6", "epoch=2-step=12", "epoch=2-step=9",
    ]  # fmt: skip
    for name in names:
        epoch, step = re.search(r"epoch=(\d+)-step=(\d+)", name).groups()  # type: ignore[union-attr]
        assert ckpt.epoch_label(folder / name) == int(epoch), name
        assert ckpt.describe(folder / name) == f"epoch {epoch}, step {step}", name


def test_counts_stay_counts_in_ember_runs_and_the_status_record(tmp_path: Path) -> None:
    """``ember runs``' EPOCHS column and ``status.json`` count epochs completed: 3 for a run whose last
    checkpoint is ``epoch=2-step=12`` (docs/cli.md says so beside the numbering)."""
    from ember import runs
    from ember.checkpoint import run_status

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 2, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)
    trainer = ember.Trainer(max_epochs=3, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                            enable_model_summary=False)  # fmt: skip
    trainer.fit(Regressor(), data)
    (last,) = ckpt.checkpoints_in(trainer.run_dir / ckpt.CHECKPOINT_SUBDIR)
    assert last.name == "epoch=2-step=12" and ckpt.epoch_label(last) == 2
    assert run_status.read_record(trainer.run_dir)["epoch"] == 3  # type: ignore[index]
    listed = runs.describe(trainer.run_dir, tmp_path)
    assert (listed["epochs"], listed["steps"]) == (3, 12)

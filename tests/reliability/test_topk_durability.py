"""Top-k eviction happens only after the newer checkpoint is durable (issue 16, item 4).

With ``save_top_k=k`` the k newest complete checkpoints must exist at every instant. The test makes one
save fail (a full disk, injected into the write) at each possible position and checks, after the run
ends, that the k newest checkpoints completed before it are all there and complete. Before the fix, the
previous ``last`` was deleted when an earlier save finished, using the ranking as the failed (newer)
save had already changed it. `benchmarks/soak.py` checks the same invariant under random kills.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import checkpoint as ckpt
from ember.callbacks import ModelCheckpoint
from ember.checkpoint import writing


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 1)
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), 4)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("failing_save", [2, 3, 5])
def test_the_k_newest_complete_checkpoints_survive_a_failed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool, top_k: int, failing_save: int
) -> None:
    write_files = writing._write_files
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == failing_save + 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_files(*args, **kwargs)

    monkeypatch.setattr(writing, "_write_files", failing)
    folder = tmp_path / "ckpts"
    saver = ModelCheckpoint(folder, filename="{step}", every_n_train_steps=2, save_top_k=top_k, async_save=async_save)
    trainer = ember.Trainer(max_epochs=1, callbacks=[saver], logger=False, enable_progress_bar=False,
                            enable_model_summary=False)  # fmt: skip
    with pytest.raises(Exception, match="No space left on device"):
        trainer.fit(Net(), loader())
    completed = [f"step={2 * (i + 1)}" for i in range(failing_save)]  # the saves before the failing one
    for name in completed[-top_k:]:
        ckpt.check_complete(folder / name)  # raises if it was evicted (or damaged)
    assert (folder / "last").read_text().strip() == completed[-1]

"""Top-k eviction off the training loop: an evicted checkpoint is deleted on a thread of its own, after its
replacement is complete, and every deletion is done when fit returns."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import model_checkpoint
from ember.callbacks.model_checkpoint import ModelCheckpoint


class Tiny(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_evicted_checkpoints_are_deleted_off_the_loop_and_gone_when_fit_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deleted: list[tuple[str, str]] = []
    delete = model_checkpoint.delete_checkpoint

    def recording(path: Path) -> None:
        deleted.append((path.name, threading.current_thread().name))
        delete(path)

    monkeypatch.setattr(model_checkpoint, "delete_checkpoint", recording)
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    saver = ModelCheckpoint(every_n_train_steps=1, save_top_k=2)
    trainer = ember.Trainer(max_steps=6, default_root_dir=tmp_path, callbacks=[saver], logger=False,
                            enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    assert [name for name, _ in deleted] == [f"epoch=0-step={s}" for s in (1, 2, 3, 4)]
    assert {thread for _, thread in deleted} == {"ember-evict"}
    folder = saver.dirpath
    assert folder is not None
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "epoch=1-step=5", "epoch=1-step=6", "last",
    ]  # fmt: skip


def test_an_eviction_does_not_wait_for_the_deletions_before_it_which_end_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first deletion is held: asking for two more returns at once, and the deletions run in the order they
    were asked for; `teardown` waits for all of them."""
    gate, deleted = threading.Event(), []
    delete = model_checkpoint.delete_checkpoint

    def held(path: Path) -> None:
        if path.name == "epoch=0-step=1":
            assert gate.wait(timeout=30), "the gate was never opened"
        delete(path)
        deleted.append(path.name)

    monkeypatch.setattr(model_checkpoint, "delete_checkpoint", held)
    saver = ModelCheckpoint(tmp_path)
    names = [f"epoch=0-step={s}" for s in (1, 2, 3)]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "ember.pt").write_bytes(b"")
    for name in names:
        saver._remove_in_background([str(tmp_path / name)])  # returns while the first deletion is held
    assert deleted == []
    gate.set()
    saver.teardown(ember.Trainer(logger=False), Tiny(), "fit")
    assert deleted == names
    assert list(tmp_path.iterdir()) == []

"""A sync save inside fit: files at the boundary on the loop's thread, durability on a background one.

The loop writes every file of the checkpoint under its temporary name at the
step boundary; the fsyncs, the rename into place and ``last`` then run on a
background thread. The checkpoint is complete when fit returns (and at the next
save), a failure there is raised, and outside fit a save is complete when
``save_checkpoint`` returns.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Trainer, TrainingModule
from ember import checkpoint as ckpt
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import writing

QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


class Net(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)), batch_size=2)


def threads_of(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Which thread staged (wrote the files of) and finished each checkpoint, by name."""
    seen: dict[str, list[str]] = {"stage": [], "finish": []}
    stage, finish = writing.stage_checkpoint, ckpt.StagedCheckpoint.finish

    def logged_stage(path: Path, *args: Any, **kwargs: Any) -> ckpt.StagedCheckpoint:
        seen["stage"].append(f"{path.name}@{threading.current_thread().name}")
        return stage(path, *args, **kwargs)

    def logged_finish(self: ckpt.StagedCheckpoint) -> Path:
        seen["finish"].append(f"{self.path.name}@{threading.current_thread().name}")
        return finish(self)

    monkeypatch.setattr(writing, "stage_checkpoint", logged_stage)
    monkeypatch.setattr(ckpt.StagedCheckpoint, "finish", logged_finish)
    return seen


def test_files_on_the_loop_thread_durability_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = threads_of(monkeypatch)
    main = threading.current_thread().name
    saver = ModelCheckpoint(tmp_path, save_top_k=-1)
    Trainer(max_epochs=3, callbacks=[saver], **QUIET).fit(Net(), loader())
    names = ["epoch=0-step=4", "epoch=1-step=8", "epoch=2-step=12"]
    assert seen["stage"] == [f"{n}@{main}" for n in names]
    assert [entry.split("@")[0] for entry in seen["finish"]] == names
    assert all(not entry.endswith(f"@{main}") for entry in seen["finish"])
    # Complete when fit returns: every checkpoint in place, `last` names the newest, no temporary left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [*names, "last"]
    assert (tmp_path / "last").read_text().strip() == names[-1]
    for n in names:
        ckpt.check_complete(tmp_path / n)


def test_a_save_outside_fit_is_complete_when_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer(max_epochs=1, enable_checkpointing=False, **QUIET)
    trainer.fit(Net(), loader())
    seen = threads_of(monkeypatch)
    trainer.save_checkpoint(tmp_path / "manual", set_last=True)
    main = threading.current_thread().name
    assert seen == {"stage": [f"manual@{main}"], "finish": [f"manual@{main}"]}
    ckpt.check_complete(tmp_path / "manual")
    assert (tmp_path / "last").read_text().strip() == "manual"


def test_a_failure_after_the_files_is_raised_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename of epoch 1's checkpoint fails on the background thread: fit raises it, nothing of it
    remains, epoch 0's checkpoint stays in place and `last` still names it."""
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if str(dst).endswith("epoch=1-step=8"):
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    saver = ModelCheckpoint(tmp_path, save_top_k=-1)
    trainer = Trainer(max_epochs=3, callbacks=[saver], **QUIET)
    with pytest.raises(RuntimeError, match=r"background checkpoint write failed.*Input/output error"):
        trainer.fit(Net(), loader())
    assert trainer.global_step == 12  # raised at the next save (epoch 2's), which is then not written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=4", "last"]
    assert (tmp_path / "last").read_text().strip() == "epoch=0-step=4"
    ckpt.check_complete(tmp_path / "epoch=0-step=4")

"""A sync save inside fit: files at the boundary on the loop's thread, durability on a background one.

The loop writes every file of the checkpoint under its temporary name at the
step boundary; the fsyncs, the rename into place and ``last`` then run on a
background thread, up to ``FINISHES_IN_FLIGHT`` of them one after another. The
checkpoint is complete when fit returns, a failure there is raised (and the
checkpoints staged after it are removed unfinished), and outside fit a save is
complete when ``save_checkpoint`` returns.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Callback, Trainer, TrainingModule
from ember import checkpoint as ckpt
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import manager, writing

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


def loader8() -> DataLoader:
    """8 batches of 1 sample: a step per batch, so every step can save."""
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)), batch_size=1)


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


class Finishes:
    """Records each staged checkpoint's finish (start and end, in order); the finish of `held` waits for `gate`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, held: str) -> None:
        self.gate = threading.Event()
        self.staged: list[tuple[str, int]] = []  # (name, finishes still in flight when it was staged)
        self.events: list[str] = []  # "start NAME" / "end NAME", in order
        self.held = held
        stage, finish = writing.stage_checkpoint, ckpt.StagedCheckpoint.finish

        def logged_stage(path: Path, *args: Any, **kwargs: Any) -> ckpt.StagedCheckpoint:
            self.staged.append((path.name, len(self.staged) - self.ended))
            return stage(path, *args, **kwargs)

        def logged_finish(staged: ckpt.StagedCheckpoint) -> Path:
            self.events.append(f"start {staged.path.name}")
            try:
                if staged.path.name == self.held:
                    assert self.gate.wait(timeout=30), "the gate was never opened"
                return finish(staged)
            finally:
                self.events.append(f"end {staged.path.name}")

        monkeypatch.setattr(writing, "stage_checkpoint", logged_stage)
        monkeypatch.setattr(ckpt.StagedCheckpoint, "finish", logged_finish)

    @property
    def ended(self) -> int:
        return sum(e.startswith("end ") for e in self.events)


class OpenGateAt(Callback):
    """At the end of batch `step` (before its save is written), note which finishes ended, then open the gate
    (and, with `until`, wait for that event of the finishes)."""

    def __init__(self, finishes: Finishes, step: int, until: str = "") -> None:
        self.finishes, self.step, self.until = finishes, step, until
        self.ended_before: list[str] | None = None

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            self.ended_before = [e for e in self.finishes.events if e.startswith("end ")]
            self.finishes.gate.set()
            deadline = time.monotonic() + 30
            while self.until and self.until not in self.finishes.events and time.monotonic() < deadline:
                time.sleep(0.001)


def test_a_save_waits_only_for_the_finishes_before_the_previous_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first checkpoint's finish is held: the loop stages the next ones without waiting for it, up to
    FINISHES_IN_FLIGHT staged at once; the finishes run one after another in the order of the saves."""
    finishes = Finishes(monkeypatch, held="epoch=0-step=1")
    limit = manager.FINISHES_IN_FLIGHT
    gate = OpenGateAt(finishes, step=limit + 1)
    saver = ModelCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=-1)
    Trainer(max_steps=6, callbacks=[saver, gate], **QUIET).fit(Net(), loader8())
    names = [f"epoch=0-step={s}" for s in range(1, 7)]
    assert gate.ended_before == []  # steps 2..limit+1 ran while the first finish was still held
    assert [name for name, _ in finishes.staged] == names
    in_flight = [n for _, n in finishes.staged]
    assert in_flight[:limit] == list(range(limit))  # no wait while fewer than the limit are in flight
    assert max(in_flight) == limit - 1  # the save after them waited for the held one
    assert finishes.events == [f"{what} {n}" for n in names for what in ("start", "end")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [*names, "last"]
    assert (tmp_path / "last").read_text().strip() == names[-1]
    for n in names:
        ckpt.check_complete(tmp_path / n)


def test_a_checkpoint_staged_after_a_failed_one_is_removed_unfinished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finish of step 2's checkpoint fails while step 3's is staged behind it: the next save raises the
    failure, step 3's checkpoint is not put in place (no gap in the saved steps), no temporary is left, and
    `last` still names step 1's."""
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if str(dst).endswith("epoch=0-step=2"):
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    finishes = Finishes(monkeypatch, held="epoch=0-step=2")
    gate = OpenGateAt(finishes, step=4, until="end epoch=0-step=2")
    saver = ModelCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = Trainer(max_steps=6, callbacks=[saver, gate], **QUIET)
    with pytest.raises(RuntimeError, match=r"background checkpoint write failed.*Input/output error"):
        trainer.fit(Net(), loader8())
    assert trainer.global_step == 4  # raised by step 4's save, before it wrote anything
    assert [name for name, _ in finishes.staged] == [f"epoch=0-step={s}" for s in range(1, 4)]
    assert "start epoch=0-step=3" not in finishes.events
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=1", "last"]
    assert (tmp_path / "last").read_text().strip() == "epoch=0-step=1"
    ckpt.check_complete(tmp_path / "epoch=0-step=1")


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
    assert trainer.global_step == 12  # raised at the next save or the end of fit; epoch 2's is not put in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=4", "last"]
    assert (tmp_path / "last").read_text().strip() == "epoch=0-step=4"
    ckpt.check_complete(tmp_path / "epoch=0-step=4")

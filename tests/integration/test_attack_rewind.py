"""SpikeGuard at its edges: settings of the wrong type, a loss that is not one scalar, iterable data that cannot go
back to a snapshot, the stop message of ``max_rewinds=0``, a spike before the warm-up ends, and a spike in the last
steps before a stop (docs/rewind.md)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exactness"))
from rewind_workload import PoisonData, Regressor, ResumableStream, batch_ids, loader

import ember
from ember.callbacks import SpikeGuard
from ember.trainer.rewind import TooManyRewinds

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, max_epochs=1
)
N, BATCH = 24 * 4, 4


def guard(**options: Any) -> SpikeGuard:
    return SpikeGuard(**{"factor": 50, "window": 4, "warmup_steps": 2, "check_every_n_steps": 2,
                         "snapshot_every_n_steps": 2, **options})  # fmt: skip


def trainer(root: Path, *callbacks: Any, **options: Any) -> ember.Trainer:
    return ember.Trainer(default_root_dir=str(root), callbacks=list(callbacks), **{**QUIET, **options})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"factor": "4"}, "factor='4': use a finite number above 1"),
        ({"factor": None}, "factor=None: use a finite number above 1"),
        ({"lr_scale": "0.5"}, "lr_scale='0.5': use a positive number"),
        ({"window": True}, "window=True: use a whole number >= 1"),
        ({"warmup_steps": -1}, "warmup_steps=-1: use a whole number >= 0"),
        ({"warmup_steps": "x"}, "warmup_steps='x': use a whole number >= 0"),
        ({"check_every_n_steps": 2.0}, "check_every_n_steps=2.0: use a whole number >= 1"),
    ],
)
def test_settings_of_the_wrong_type_are_one_line_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^SpikeGuard: {message}") as raised:
        SpikeGuard(**kwargs)
    assert "\n" not in str(raised.value)


class PerSampleLoss(Regressor):
    """Manual optimization whose output's 'loss' is the per-sample loss (any output is allowed there)."""

    def __init__(self) -> None:
        super().__init__(lr=0.02)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizer = self.optimizers()
        x, y = batch
        losses = torch.nn.functional.mse_loss(self.model(x), y, reduction="none").mean(1)
        optimizer.zero_grad()
        self.manual_backward(losses.mean())
        optimizer.step()
        return {"loss": losses.detach()}


def test_a_loss_that_is_not_one_scalar_is_refused_at_the_first_batch(tmp_path: Path) -> None:
    fit = trainer(tmp_path, guard())
    with pytest.raises(ValueError, match=r"^SpikeGuard: training_step's 'loss' is a tensor of shape \(4,\);.*mean"):
        fit.fit(PerSampleLoss(), loader(PoisonData(N), BATCH))
    assert fit.global_step == 1  # refused at once, not at the first check, with a TypeError from deep inside


class ScalarThenPerSampleLoss(PerSampleLoss):
    """A scalar loss at the first batch of each check, a per-sample one after it."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        return {"loss": out["loss"].mean()} if batch_idx % 2 == 0 else out


def test_a_loss_that_stops_being_one_scalar_between_checks_is_refused_at_the_check(tmp_path: Path) -> None:
    fit = trainer(tmp_path, guard())
    with pytest.raises(ValueError, match=r"^SpikeGuard: training_step's 'loss' is a tensor of shape \(4,\);.*mean"):
        fit.fit(ScalarThenPerSampleLoss(), loader(PoisonData(N), BATCH))
    assert fit.global_step == 2  # the check after the second batch, with the first batch's message


class Stream(IterableDataset[Any]):
    """An iterable dataset that cannot report or restore its position."""

    def __init__(self, data: PoisonData) -> None:
        self.data = data

    def __iter__(self) -> Iterator[Any]:
        return (self.data[i] for i in range(len(self.data)))


def test_iterable_data_that_cannot_go_back_is_refused_before_training(tmp_path: Path) -> None:
    """Without a position to go back to, a rewind restarted the stream while the batch count went on from the
    snapshot: the skip list left out clean batches and the poisoned one spiked again until TooManyRewinds."""
    module = Regressor(lr=0.02)
    before = [p.detach().clone() for p in module.parameters()]
    fit = trainer(tmp_path, guard())
    with pytest.raises(ValueError, match=r"IterableDataset \(Stream\) without state_dict\(\)/load_state_dict\(\)"):
        fit.fit(module, DataLoader(Stream(PoisonData(N, frozenset(range(36, 40)))), batch_size=BATCH))
    assert fit.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


class FirstInputs(ember.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append((batch_idx, float(batch[0][0, 0])))


def test_a_rewind_over_iterable_data_that_can_go_back_reads_and_drops_the_left_out_batches(tmp_path: Path) -> None:
    """The end of such an epoch compared its position with an unknown length (inf) as an int: OverflowError."""
    data = PoisonData(N, frozenset(range(36, 40)))  # the stream's batch 9
    spiky, inputs = guard(), FirstInputs()
    fit = trainer(tmp_path, spiky, inputs)
    fit.fit(Regressor(lr=0.02), DataLoader(ResumableStream(data), batch_size=BATCH))
    assert [(r["spike_step"], r["restored_step"], r["skipped_batches"]) for r in spiky.rewinds] == [
        (10, 8, [[0, 8], [0, 9]])
    ]
    assert fit.global_step == N // BATCH - 2
    first_of = {i: float(data[i * BATCH][0][0]) for i in range(N // BATCH)}
    after = inputs.seen[10:]  # batches 0-9, then the epoch reopened at batch 8 with 8 and 9 left out
    assert after == [(i, first_of[i]) for i in range(10, N // BATCH)]


def test_max_rewinds_zero_names_the_one_spike(tmp_path: Path) -> None:
    ids = batch_ids(N, BATCH)
    fit = trainer(tmp_path, guard(max_rewinds=0))
    with pytest.raises(TooManyRewinds) as raised:
        fit.fit(Regressor(lr=0.02), loader(PoisonData(N, frozenset(ids[8])), BATCH))
    assert str(raised.value).startswith("SpikeGuard: the loss spiked at step 9; max_rewinds=0. The fit went back")


def test_a_spike_in_the_last_steps_of_a_fit_ending_at_max_steps_is_caught(tmp_path: Path) -> None:
    """max_steps=11 with a check every 2 steps: the fit's last step is not a checking step, so a spike there was
    never read and the fit ended with the poisoned parameters."""
    ids = batch_ids(N, BATCH)
    spiky = guard()
    module = Regressor(lr=0.02)
    trainer(tmp_path, spiky, max_steps=11).fit(module, loader(PoisonData(N, frozenset(ids[10])), BATCH))
    assert [(r["spike_step"], r["restored_step"], r["skipped_batches"]) for r in spiky.rewinds] == [(11, 10, [[0, 10]])]
    assert module.trainer.global_step == 11  # went back to step 10 and trained one more step on the next batch
    assert max(float(p.detach().abs().max()) for p in module.parameters()) < 100


def test_a_spike_before_the_warm_up_ends_is_left_out(tmp_path: Path) -> None:
    """A finite spike at the first batch, before the detector has a median: the check after it renewed the snapshot,
    which then held the spike's damage, so every rewind went back to it and the fit stopped with TooManyRewinds.
    Until a check has judged losses against a median, the snapshot stays the fit's start."""
    ids = batch_ids(N, BATCH)
    spiky = guard()
    module = Regressor(lr=0.02)
    trainer(tmp_path, spiky).fit(module, loader(PoisonData(N, frozenset(ids[0])), BATCH))
    assert len(spiky.rewinds) == 1, spiky.rewinds
    rewind = spiky.rewinds[0]
    assert rewind["restored_step"] == 0  # the start: no warm-up check renewed the snapshot
    assert [0, 0] in rewind["skipped_batches"]
    assert rewind["skipped_samples"][:BATCH] == ids[0]
    assert module.trainer.global_step == N // BATCH - len(rewind["skipped_batches"])
    assert max(float(p.detach().abs().max()) for p in module.parameters()) < 100


class StopAt(ember.Callback):
    """Sets ``trainer.should_stop`` at the end of step `step` (it comes after the guard in the callback list)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_a_spike_in_the_last_steps_before_a_callback_stops_the_fit_is_caught(tmp_path: Path) -> None:
    """should_stop at step 11 with a check every 2 steps: the spike at step 11 was never read and the fit ended
    (and saved ``last``) with the poisoned parameters."""
    ids = batch_ids(N, BATCH)
    spiky = guard()
    module = Regressor(lr=0.02)
    fit = trainer(tmp_path, spiky, StopAt(11), enable_checkpointing=True, max_epochs=2)
    fit.fit(module, loader(PoisonData(N, frozenset(ids[10])), BATCH))
    assert [(r["spike_step"], r["restored_step"], r["skipped_batches"]) for r in spiky.rewinds] == [(11, 10, [[0, 10]])]
    assert fit.global_step == 11  # back to step 10, one more step on batch 11, then the stop still held
    assert fit.progress.stop_reason == "should_stop"
    assert max(float(p.detach().abs().max()) for p in module.parameters()) < 100
    resumed = trainer(tmp_path, max_steps=12, enable_checkpointing=True)
    resumed.fit(Regressor(lr=0.02), loader(PoisonData(N, frozenset(ids[10])), BATCH), ckpt_path="last")
    assert resumed.progress.skipped_positions() == [[0, 10]]  # `last` is the rewound run, with its skip list
    assert resumed.global_step == 12


class SlowBatch(ember.Callback):
    """Sleeps before batch `batch_idx` until the fit's `max_time_s` is spent (counted from ``on_train_start``,
    after the fit's clock started)."""

    def __init__(self, batch_idx: int, max_time_s: float) -> None:
        self.batch_idx, self.max_time_s, self.started = batch_idx, max_time_s, 0.0
        self.steps_before: int | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.started = time.monotonic()

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch_idx and self.steps_before is None:
            self.steps_before = trainer.global_step
            time.sleep(max(0.0, self.started + self.max_time_s + 0.05 - time.monotonic()))


def test_a_spike_in_the_last_steps_before_max_time_is_caught(tmp_path: Path) -> None:
    ids = batch_ids(N, BATCH)
    spiky, slow = guard(), SlowBatch(10, max_time_s=2.0)
    module = Regressor(lr=0.02)
    fit = trainer(tmp_path, spiky, slow, max_time=2.0, max_epochs=2)
    fit.fit(module, loader(PoisonData(N, frozenset(ids[10])), BATCH))
    assert slow.steps_before == 10  # the first 10 steps ran within the budget
    assert [(r["spike_step"], r["restored_step"], r["skipped_batches"]) for r in spiky.rewinds] == [(11, 10, [[0, 10]])]
    assert fit.global_step == 11
    assert fit.progress.stop_reason == "max_time"
    assert max(float(p.detach().abs().max()) for p in module.parameters()) < 100

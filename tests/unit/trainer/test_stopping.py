"""When does fit stop, and how many batches, steps and validation runs happen on the way.

Every test counts hook calls with `Recorder`; sanity-check validation is told
apart from real validation through ``trainer.sanity_checking``.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Callback, Trainer, TrainingModule

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)


def loader(num_batches: int, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(num_batches)
    x = torch.randn(num_batches * batch_size, 4, generator=g)
    y = torch.randn(num_batches * batch_size, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class Net(TrainingModule):
    """A linear regressor; every training step takes `sleep` seconds of `clock`, `skip(batch_idx)` returns None."""

    def __init__(self, sleep: float = 0.0, skip: Any = None, clock: Any = time) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.sleep, self.clock = sleep, clock
        self.skip = skip or (lambda batch_idx: False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.sleep:
            self.clock.sleep(self.sleep)
        if self.skip(batch_idx):
            return None
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        x, y = batch
        return F.mse_loss(self(x), y)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(Callback):
    """Counts what happened, per epoch where it matters."""

    def __init__(self) -> None:
        self.train_batches: list[tuple[int, int]] = []  # (epoch, batch_idx)
        self.optimizer_steps = 0
        self.steps_per_epoch: dict[int, int] = {}
        self.val_runs: list[tuple[int, int]] = []  # (epoch, index of the last train batch before it; -1 if none)
        self.sanity_runs = 0
        self.val_batches = 0
        self.sanity_batches = 0
        self.val_batches_per_run: list[int] = []
        self.epochs_ended: list[int] = []
        self.test_batches = 0
        self.predict_batches = 0
        self._sanity_at_start: bool | None = None
        self._run_batches = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.train_batches.append((trainer.current_epoch, batch_idx))

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.optimizer_steps += 1
        epoch = trainer.current_epoch
        self.steps_per_epoch[epoch] = self.steps_per_epoch.get(epoch, 0) + 1

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        self._sanity_at_start = trainer.sanity_checking
        self._run_batches = 0

    def on_validation_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self._run_batches += 1
        if trainer.sanity_checking:
            self.sanity_batches += 1
        else:
            self.val_batches += 1

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        assert trainer.sanity_checking == self._sanity_at_start
        if trainer.sanity_checking:
            self.sanity_runs += 1
            return
        epoch = trainer.current_epoch
        seen = [b for e, b in self.train_batches if e == epoch]
        self.val_runs.append((epoch, seen[-1] if seen else -1))
        self.val_batches_per_run.append(self._run_batches)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.epochs_ended.append(trainer.current_epoch)

    def on_test_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.test_batches += 1

    def on_predict_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.predict_batches += 1

    def batches_in(self, epoch: int) -> list[int]:
        return [b for e, b in self.train_batches if e == epoch]


def make_trainer(rec: Recorder, **kwargs: Any) -> Trainer:
    options = {**QUIET, "num_sanity_val_steps": 0, **kwargs}
    return Trainer(callbacks=[rec], **options)


# --- max_steps / max_epochs ---------------------------------------------------------


def test_max_steps_stops_mid_epoch() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=3, max_epochs=5)
    trainer.fit(Net(), loader(10), loader(2))
    assert trainer.global_step == 3
    assert rec.optimizer_steps == 3
    assert rec.train_batches == [(0, 0), (0, 1), (0, 2)]
    assert rec.epochs_ended == [0]
    # Stopped mid-epoch without a validation since the last step: one final validation.
    assert rec.val_runs == [(0, 2)]


def test_max_steps_counts_optimizer_steps_not_batches_with_accumulation() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=3, max_epochs=5, accumulate_grad_batches=2)
    trainer.fit(Net(), loader(10))
    assert trainer.global_step == 3
    assert rec.optimizer_steps == 3
    assert rec.batches_in(0) == [0, 1, 2, 3, 4, 5]
    assert rec.epochs_ended == [0]


def test_max_steps_across_epochs_with_a_short_last_window() -> None:
    # 5 batches, windows of 2: [0,1] [2,3] [4] -> 3 steps per epoch.
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=4, accumulate_grad_batches=2)
    trainer.fit(Net(), loader(5))
    assert trainer.global_step == 4
    assert rec.steps_per_epoch == {0: 3, 1: 1}
    assert rec.batches_in(0) == [0, 1, 2, 3, 4]
    assert rec.batches_in(1) == [0, 1]
    assert rec.epochs_ended == [0, 1]


def test_max_steps_spanning_several_epochs() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=12)
    trainer.fit(Net(), loader(5))
    assert trainer.max_epochs is None
    assert trainer.global_step == 12
    assert len(rec.train_batches) == 12
    assert rec.epochs_ended == [0, 1, 2]
    assert rec.batches_in(2) == [0, 1]


def test_max_steps_on_an_epoch_boundary_runs_no_extra_epoch() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=10, max_epochs=5)
    trainer.fit(Net(), loader(5), loader(2))
    assert trainer.global_step == 10
    assert rec.epochs_ended == [0, 1]
    # Epoch-end validation only, no extra "final" one.
    assert rec.val_runs == [(0, 4), (1, 4)]


def test_max_epochs() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=3)
    trainer.fit(Net(), loader(4), loader(2))
    assert rec.epochs_ended == [0, 1, 2]
    assert len(rec.train_batches) == 12
    assert trainer.global_step == rec.optimizer_steps == 12
    assert trainer.current_epoch == 3
    assert rec.val_runs == [(0, 3), (1, 3), (2, 3)]


def test_max_epochs_stops_before_a_larger_max_steps() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=1, max_steps=100)
    trainer.fit(Net(), loader(4))
    assert trainer.global_step == 4
    assert rec.epochs_ended == [0]


def test_default_max_epochs() -> None:
    assert Trainer(**QUIET).max_epochs == 1000
    assert Trainer(max_steps=5, **QUIET).max_epochs is None
    assert Trainer(max_epochs=2, **QUIET).max_epochs == 2


# --- max_time -------------------------------------------------------------------------


class SimulatedClock:
    """The loop's clock (in place of its `time` module), where time passes only in the training steps' `sleep`."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimulatedClock:
    simulated = SimulatedClock()
    monkeypatch.setattr("ember.trainer.loop.time", simulated)
    return simulated


def test_max_time_stops_training_early(clock: SimulatedClock) -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_time=0.25, max_epochs=1)
    trainer.fit(Net(sleep=1 / 16, clock=clock), loader(40), loader(2))
    assert trainer.global_step == 4  # 4 steps of 1/16 s use up the 0.25 s
    assert rec.optimizer_steps == trainer.global_step == len(rec.train_batches)
    assert rec.epochs_ended == [0]
    # Stopped mid-epoch: the final weights are validated once.
    assert len(rec.val_runs) == 1


def test_max_time_stops_across_epochs(clock: SimulatedClock) -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_time=0.25)
    trainer.fit(Net(sleep=1 / 64, clock=clock), loader(3))
    assert trainer.max_epochs == 1000
    assert trainer.global_step == 16  # 16 steps of 1/64 s: 5 epochs of 3 and one step of the sixth
    assert rec.epochs_ended == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("00:00:00:01", 1.0),
        ("01:02:03:04", 93784.0),
        (timedelta(minutes=2), 120.0),
        (timedelta(seconds=1.5), 1.5),
        ({"hours": 1, "minutes": 30}, 5400.0),
        ({"seconds": 2}, 2.0),
        (3, 3.0),
        (0.25, 0.25),
        (None, None),
    ],
)
def test_max_time_forms(value: Any, seconds: float | None) -> None:
    assert Trainer(max_time=value, **QUIET).options.max_time_s == seconds


# --- limit_*_batches -----------------------------------------------------------------


@pytest.mark.parametrize(("limit", "expected"), [(3, 3), (0.5, 5), (1.0, 10), (25, 10), (0.25, 2)])
def test_limit_train_batches(limit: float | int, expected: int) -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=2, limit_train_batches=limit)
    trainer.fit(Net(), loader(10))
    assert rec.batches_in(0) == list(range(expected))
    assert rec.batches_in(1) == list(range(expected))
    assert trainer.global_step == 2 * expected


def test_limit_train_batches_zero_disables_training() -> None:
    rec = Recorder()
    module = Net()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = make_trainer(rec, max_epochs=2, limit_train_batches=0)
    trainer.fit(module, loader(10), loader(2))
    assert rec.train_batches == []
    assert trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


@pytest.mark.parametrize(("limit", "expected"), [(2, 2), (0.25, 2), (0.5, 4), (1.0, 8), (20, 8)])
def test_limit_val_batches(limit: float | int, expected: int) -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=2, limit_val_batches=limit)
    trainer.fit(Net(), loader(3), loader(8))
    assert rec.val_batches_per_run == [expected, expected]
    assert trainer.num_val_batches == [expected]


@pytest.mark.parametrize(("limit", "expected"), [(2, 2), (0.5, 3), (1.0, 6)])
def test_limit_val_batches_in_validate(limit: float | int, expected: int) -> None:
    rec = Recorder()
    trainer = make_trainer(rec, limit_val_batches=limit)
    trainer.validate(Net(), loader(6))
    assert rec.val_batches == expected


@pytest.mark.parametrize(("limit", "expected"), [(2, 2), (0.5, 3), (1.0, 6), (0, 0)])
def test_limit_test_batches(limit: float | int, expected: int) -> None:
    rec = Recorder()
    trainer = make_trainer(rec, limit_test_batches=limit)
    trainer.test(Net(), loader(6))
    assert rec.test_batches == expected


@pytest.mark.parametrize(("limit", "expected"), [(2, 2), (0.5, 3), (1.0, 6)])
def test_limit_predict_batches(limit: float | int, expected: int) -> None:
    rec = Recorder()
    trainer = make_trainer(rec, limit_predict_batches=limit)
    predictions = trainer.predict(Net(), loader(6))
    assert rec.predict_batches == expected
    assert len(predictions) == expected


def test_limits_apply_to_each_eval_dataloader() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, limit_test_batches=2)
    trainer.test(Net(), [loader(5), loader(1)])
    assert rec.test_batches == 2 + 1


# --- validation cadence ------------------------------------------------------------------


def test_val_check_interval_fraction() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=2, val_check_interval=0.25)
    trainer.fit(Net(), loader(8), loader(2))
    assert rec.val_runs == [(0, 1), (0, 3), (0, 5), (0, 7), (1, 1), (1, 3), (1, 5), (1, 7)]
    assert rec.val_batches == 8 * 2


def test_val_check_interval_int_count() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=1, val_check_interval=4)
    trainer.fit(Net(), loader(8), loader(2))
    assert rec.val_runs == [(0, 3), (0, 7)]


def test_val_check_interval_int_that_does_not_divide_the_epoch_also_validates_at_epoch_end() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=1, val_check_interval=3)
    trainer.fit(Net(), loader(10), loader(2))
    assert rec.val_runs == [(0, 2), (0, 5), (0, 8), (0, 9)]


def test_val_check_interval_counts_batches_not_steps_with_accumulation() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=1, val_check_interval=0.5, accumulate_grad_batches=2)
    trainer.fit(Net(), loader(8), loader(2))
    assert rec.val_runs == [(0, 3), (0, 7)]
    assert trainer.global_step == 4


def test_stopping_right_after_a_validation_does_not_validate_again() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=3, val_check_interval=3)
    trainer.fit(Net(), loader(10), loader(2))
    assert rec.val_runs == [(0, 2)]


def test_stopping_between_validations_validates_the_final_weights() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=3, val_check_interval=2)
    trainer.fit(Net(), loader(10), loader(2))
    assert rec.val_runs == [(0, 1), (0, 2)]


def test_check_val_every_n_epoch() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=4, check_val_every_n_epoch=2)
    trainer.fit(Net(), loader(3), loader(2))
    # Epochs 2 and 4 (0-based 1 and 3), at the end of each.
    assert rec.val_runs == [(1, 2), (3, 2)]
    assert rec.epochs_ended == [0, 1, 2, 3]


def test_check_val_every_n_epoch_with_val_check_interval() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=4, check_val_every_n_epoch=2, val_check_interval=0.5)
    trainer.fit(Net(), loader(4), loader(2))
    assert rec.val_runs == [(1, 1), (1, 3), (3, 1), (3, 3)]


def test_no_validation_on_a_skipped_epoch_even_when_stopping_mid_epoch() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=2, check_val_every_n_epoch=2)
    trainer.fit(Net(), loader(5), loader(2))
    assert rec.val_runs == []


def test_no_validation_without_val_dataloaders() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=2, num_sanity_val_steps=2)
    trainer.fit(Net(), loader(3))
    assert rec.val_runs == [] and rec.sanity_runs == 0


# --- sanity check --------------------------------------------------------------------------


@pytest.mark.parametrize(("steps", "expected_batches", "expected_runs"), [(0, 0, 0), (1, 1, 1), (2, 2, 1), (10, 4, 1)])
def test_num_sanity_val_steps(steps: int, expected_batches: int, expected_runs: int) -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=1, num_sanity_val_steps=steps)
    trainer.fit(Net(), loader(3), loader(4))
    assert rec.sanity_batches == expected_batches
    assert rec.sanity_runs == expected_runs
    # The real validation is unaffected.
    assert rec.val_batches == 4 and len(rec.val_runs) == 1
    assert trainer.sanity_checking is False


def test_sanity_check_runs_per_val_dataloader() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=1, num_sanity_val_steps=2)
    trainer.fit(Net(), loader(2), [loader(4), loader(1)])
    assert rec.sanity_batches == 2 + 1
    assert rec.sanity_runs == 1


def test_sanity_check_does_not_train() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=1, num_sanity_val_steps=2)
    trainer.fit(Net(), loader(3), loader(4))
    assert trainer.global_step == 1 and rec.optimizer_steps == 1


@pytest.mark.parametrize(("limit_val", "expected"), [(1, 1), (0, 0)])
def test_sanity_check_respects_limit_val_batches(limit_val: int, expected: int) -> None:
    # Lightning runs min(num_sanity_val_steps, limit_val_batches) sanity batches; 0 disables validation.
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=1, num_sanity_val_steps=2, limit_val_batches=limit_val)
    trainer.fit(Net(), loader(2), loader(4))
    assert rec.sanity_batches == expected
    assert rec.val_batches == expected


# --- fast_dev_run ---------------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "n"), [(True, 1), (3, 3)])
def test_fast_dev_run(flag: bool | int, n: int, tmp_path: Any) -> None:
    rec = Recorder()
    trainer = Trainer(
        fast_dev_run=flag,
        max_epochs=5,
        num_sanity_val_steps=2,
        callbacks=[rec],
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
    )  # logger left at its default (True): fast_dev_run turns it off
    trainer.fit(Net(), loader(10), loader(10))
    assert rec.batches_in(0) == list(range(n))
    assert len(rec.train_batches) == n
    assert trainer.global_step == n
    assert rec.epochs_ended == [0]
    assert rec.sanity_batches == 0 and rec.sanity_runs == 0
    assert rec.val_batches == n and len(rec.val_runs) == 1
    assert trainer.loggers == [] and trainer.logger is None
    assert trainer.enable_checkpointing is False
    assert list(tmp_path.iterdir()) == []

    trainer.test(Net(), loader(10))
    trainer.predict(Net(), loader(10))
    assert rec.test_batches == n and rec.predict_batches == n


# --- trainer.should_stop ------------------------------------------------------------------


class StopAtBatch(Recorder):
    def __init__(self, batch_idx: int) -> None:
        super().__init__()
        self.stop_at = batch_idx

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        if batch_idx == self.stop_at:
            trainer.should_stop = True


class StopAtEpochEnd(Recorder):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.stop_at = epoch

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        super().on_train_epoch_end(trainer, module)
        if trainer.current_epoch == self.stop_at:
            trainer.should_stop = True


def test_should_stop_from_on_train_batch_end() -> None:
    rec = StopAtBatch(3)
    trainer = make_trainer(rec, max_epochs=5)
    trainer.fit(Net(), loader(10), loader(2))
    assert rec.train_batches == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert trainer.global_step == rec.optimizer_steps == 4
    assert rec.epochs_ended == [0]
    assert rec.val_runs == [(0, 3)]


def test_should_stop_inside_an_accumulation_window_finishes_the_window() -> None:
    rec = StopAtBatch(2)
    trainer = make_trainer(rec, max_epochs=5, accumulate_grad_batches=2)
    trainer.fit(Net(), loader(10))
    assert rec.batches_in(0) == [0, 1, 2, 3]
    assert trainer.global_step == rec.optimizer_steps == 2
    assert rec.epochs_ended == [0]


def test_should_stop_from_on_train_epoch_end() -> None:
    rec = StopAtEpochEnd(1)
    trainer = make_trainer(rec, max_epochs=5)
    trainer.fit(Net(), loader(3), loader(2))
    assert rec.epochs_ended == [0, 1]
    assert len(rec.train_batches) == 6
    assert trainer.global_step == 6
    assert trainer.current_epoch == 2
    assert rec.val_runs == [(0, 2), (1, 2)]


def test_should_stop_is_reset_when_fit_starts() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=1)
    trainer.should_stop = True
    trainer.fit(Net(), loader(4))
    assert trainer.global_step == rec.optimizer_steps == 4
    assert rec.epochs_ended == [0]


# --- training_step returning None ----------------------------------------------------------


def test_training_step_returning_none_skips_every_step() -> None:
    rec = Recorder()
    module = Net(skip=lambda batch_idx: True)
    before = [p.detach().clone() for p in module.parameters()]
    trainer = make_trainer(rec, max_epochs=2)
    trainer.fit(module, loader(5))
    assert len(rec.train_batches) == 10
    assert rec.epochs_ended == [0, 1]
    assert trainer.global_step == 0 and rec.optimizer_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert all(p.grad is None for p in module.parameters())


def test_training_step_returning_none_skips_only_that_step() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_epochs=1)
    trainer.fit(Net(skip=lambda batch_idx: batch_idx % 2 == 1), loader(10))
    assert len(rec.train_batches) == 10
    assert trainer.global_step == rec.optimizer_steps == 5


def test_max_steps_counts_only_steps_taken() -> None:
    rec = Recorder()
    trainer = make_trainer(rec, max_steps=3, max_epochs=3)
    trainer.fit(Net(skip=lambda batch_idx: batch_idx % 2 == 0), loader(10))
    # Steps happen after batches 1, 3, 5.
    assert trainer.global_step == 3
    assert rec.batches_in(0) == [0, 1, 2, 3, 4, 5]

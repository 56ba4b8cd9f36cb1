"""Timer: time per stage on a fake clock, the training budget, and a resumed budget."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Timer
from ember.callbacks.timer import parse_duration

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def loader(n: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2), torch.randn(n, 1)), batch_size=2)  # 4 batches


class Ticking(ember.TrainingModule):
    """Each training batch takes 1 s and each validation batch 0.25 s on the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.clock = clock

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.clock.now += 1.0
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.clock.now += 0.25

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.clock.now += 0.5

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def timed(timer: Timer) -> tuple[Timer, FakeClock]:
    clock = FakeClock()
    timer._clock = clock
    return timer, clock


def test_time_per_stage() -> None:
    timer, clock = timed(Timer())
    module = Ticking(clock)
    trainer = ember.Trainer(max_epochs=2, num_sanity_val_steps=0, callbacks=[timer], **QUIET)
    trainer.fit(module, loader(), loader(4))  # 2 x 4 training batches, 2 x 2 validation batches
    assert timer.time_elapsed("train") == 8 * 1.0 + 4 * 0.25
    assert timer.time_elapsed("validate") == 4 * 0.25
    assert timer.start_time("train") == 1000.0 and timer.end_time("train") == 1009.0
    assert timer.time_remaining() is None
    trainer.test(module, loader(4))
    assert timer.time_elapsed("test") == 2 * 0.5
    assert timer.time_elapsed("predict") == 0.0


def test_step_budget_stops_after_the_batch_that_spends_it() -> None:
    timer, clock = timed(Timer(duration=5))
    trainer = ember.Trainer(max_epochs=10, callbacks=[timer], **QUIET)
    trainer.fit(Ticking(clock), loader())
    assert trainer.global_step == 5 and timer.time_elapsed() == 5.0 and timer.time_remaining() == 0.0


def test_epoch_budget_stops_at_the_epoch_end() -> None:
    timer, clock = timed(Timer(duration={"seconds": 6}, interval="epoch"))
    trainer = ember.Trainer(max_epochs=10, callbacks=[timer], **QUIET)
    trainer.fit(Ticking(clock), loader())
    assert (trainer.current_epoch, trainer.global_step) == (2, 8)


def test_state_round_trips_and_a_resumed_run_gets_the_rest_of_the_budget() -> None:
    first, clock = timed(Timer(duration=timedelta(seconds=5)))
    trainer = ember.Trainer(max_steps=3, callbacks=[first], **QUIET)
    trainer.fit(Ticking(clock), loader())
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["time_elapsed"] == {"train": 3.0, "validate": 0.0, "test": 0.0, "predict": 0.0}

    resumed, clock = timed(Timer(duration=5))
    resumed.load_state_dict(state)
    assert resumed.time_elapsed() == 3.0
    trainer = ember.Trainer(max_epochs=10, callbacks=[resumed], **QUIET)
    trainer.fit(Ticking(clock), loader())
    assert trainer.global_step == 2 and resumed.time_elapsed() == 5.0


def test_durations_parse() -> None:
    assert parse_duration("00:01:00:30") == 3630.0
    assert parse_duration(timedelta(minutes=2)) == 120.0
    assert parse_duration({"hours": 1}) == 3600.0
    assert parse_duration(1.5) == 1.5
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        parse_duration("1h")
    with pytest.raises(ValueError, match="positive"):
        Timer(duration=0)
    with pytest.raises(ValueError, match="interval"):
        Timer(interval="batch")

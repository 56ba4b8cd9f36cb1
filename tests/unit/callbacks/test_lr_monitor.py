"""LearningRateMonitor logs exactly what the scheduler set, per param group, at the step that used it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import LearningRateMonitor
from ember.loggers import Logger

QUIET: dict[str, Any] = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


class Spy(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(step, m[name]) for step, m in self.calls if name in m]


def loader(n: int = 20) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)), batch_size=2)


def make_optimizer(a: nn.Module, b: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(
        [{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters(), "lr": 0.03, "momentum": 0.5}],
        lr=0.1,
        momentum=0.9,
        weight_decay=1e-4,
    )


LAMBDAS: list[Callable[[int], float]] = [lambda s: 0.9**s, lambda s: 1.0 / (1 + s)]


class TwoGroups(ember.TrainingModule):
    def __init__(self, interval: str = "step") -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)
        self.interval = interval

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.b(self.a(x)), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = make_optimizer(self.a, self.b)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": self.interval}}


def replay(steps: int) -> list[list[float]]:
    """The lr of each param group used by optimizer steps 1..steps, from a fresh optimizer and scheduler."""
    opt = make_optimizer(nn.Linear(2, 2), nn.Linear(2, 1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS)
    used = []
    for _ in range(steps):
        used.append([g["lr"] for g in opt.param_groups])
        opt.step()
        scheduler.step()
    return used


def test_step_interval_logs_each_groups_lr_used_by_the_logged_steps() -> None:
    spy = Spy()
    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    trainer = ember.Trainer(max_epochs=2, log_every_n_steps=3, logger=spy, callbacks=[monitor], **QUIET)
    trainer.fit(TwoGroups(), loader())  # 10 steps per epoch
    used = replay(20)
    logged_steps = [3, 6, 9, 12, 15, 18]
    assert spy.series("lr-SGD/pg1") == [(s - 1, used[s - 1][0]) for s in logged_steps]  # exact; step s's row: s - 1
    assert spy.series("lr-SGD/pg2") == [(s - 1, used[s - 1][1]) for s in logged_steps]
    assert spy.series("lr-SGD/pg1-momentum") == [(s - 1, 0.9) for s in logged_steps]
    assert spy.series("lr-SGD/pg2-momentum") == [(s - 1, 0.5) for s in logged_steps]
    assert spy.series("lr-SGD/pg1-weight_decay") == [(s - 1, 1e-4) for s in logged_steps]
    # in the same logger rows as the step's loss
    assert [step for step, m in spy.calls if "lr-SGD/pg1" in m] == [step for step, m in spy.calls if "train/loss" in m]
    assert trainer.callback_metrics["lr-SGD/pg1"] == used[17][0]


def test_epoch_interval_logs_the_value_each_epoch_started_with() -> None:
    spy = Spy()
    trainer = ember.Trainer(max_epochs=3, logger=spy, callbacks=[LearningRateMonitor()], **QUIET)
    trainer.fit(TwoGroups(interval="epoch"), loader())
    # epoch e trains with LambdaLR at e: lr0 * 0.9**e and lr1 / (1 + e); logged with the epoch's metrics
    assert spy.series("lr-SGD/pg1") == [(9, 0.1 * 0.9**0), (19, 0.1 * 0.9**1), (29, 0.1 * 0.9**2)]
    assert [v for _, v in spy.series("lr-SGD/pg2")] == pytest.approx([0.03, 0.015, 0.01], rel=1e-15)
    assert "lr-SGD/pg1-momentum" not in spy.calls[-1][1]


def test_adam_momentum_is_beta1_and_names_follow_schedulers_and_duplicates() -> None:
    class TwoOptimizers(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.a, self.b = nn.Linear(2, 1), nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            for opt, layer in zip(self.optimizers(), (self.a, self.b), strict=True):
                opt.zero_grad()
                self.manual_backward(nn.functional.mse_loss(layer(x), y))
                opt.step()

        def configure_optimizers(self) -> Any:
            first = torch.optim.Adam(self.a.parameters(), lr=1e-3, betas=(0.8, 0.99))
            second = torch.optim.Adam(self.b.parameters(), lr=2e-3)
            return [first, second]

    spy = Spy()
    monitor = LearningRateMonitor(logging_interval="step", log_momentum=True)
    trainer = ember.Trainer(max_steps=4, log_every_n_steps=2, logger=spy, callbacks=[monitor], **QUIET)
    trainer.fit(TwoOptimizers(), loader())
    last = {k: v for _, m in spy.calls for k, v in m.items()}
    assert (last["lr-Adam"], last["lr-Adam-momentum"]) == (1e-3, 0.8)
    assert (last["lr-Adam-1"], last["lr-Adam-1-momentum"]) == (2e-3, 0.9)


def test_scheduler_name_is_used() -> None:
    class Named(TwoGroups):
        def configure_optimizers(self) -> Any:
            config = super().configure_optimizers()
            config["lr_scheduler"]["name"] = "my-lr"
            return config

    spy = Spy()
    trainer = ember.Trainer(max_steps=2, log_every_n_steps=1, logger=spy, callbacks=[LearningRateMonitor()], **QUIET)
    trainer.fit(Named(), loader())
    assert spy.series("my-lr/pg1") == [(0, 0.1), (1, 0.1 * 0.9)]


def test_bad_interval() -> None:
    with pytest.raises(ValueError, match="logging_interval"):
        LearningRateMonitor("batch")

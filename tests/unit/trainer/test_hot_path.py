"""What a training step may not do: read the Trainer's options through ``Trainer.__getattr__`` (a failed
attribute lookup, an exception raised and caught inside Python, each time), neither in ember nor in a callback
that reads ``trainer.<option>``. Per-step work is counted as the
difference between a fit of 12 batches and one of 4, so per-epoch and per-run reads cancel out."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Callback, Trainer, TrainingModule
from ember.trainer.trainer import Trainer as TrainerClass


class Auto(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Manual(Auto):
    automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.manual_backward(loss)
        optimizer.step()
        self.log("train/loss", loss)


class Closure(Auto):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)


class BackwardHook(Callback):
    def on_after_backward(self, trainer: Trainer, module: TrainingModule) -> None:
        pass


class ReadsOptions(Callback):
    """A callback reading options every batch, as progress or monitoring callbacks do."""

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, i: int) -> None:
        assert trainer.max_epochs == 1 and trainer.gradient_clip_val is None and trainer.log_every_n_steps > 0


SCENARIOS: dict[str, tuple[type[Auto], dict[str, Any]]] = {
    "a callback reading options": (Auto, {"callbacks": [ReadsOptions()]}),
    "plain": (Auto, {}),
    "general (clipping, accumulation, a backward hook)": (
        Auto,
        {"gradient_clip_val": 1.0, "accumulate_grad_batches": 2, "callbacks": [BackwardHook()]},
    ),
    "manual optimization": (Manual, {}),
    "closure optimizer": (Closure, {"gradient_clip_val": 1.0}),
}


def _option_reads(
    monkeypatch: pytest.MonkeyPatch, module_cls: type[Auto], options: dict[str, Any], batches: int
) -> int:
    reads = [0]
    original = TrainerClass.__getattr__

    def counting(self: Trainer, name: str) -> Any:
        reads[0] += 1
        return original(self, name)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    loader = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4)
    trainer = Trainer(
        max_epochs=1, limit_train_batches=batches, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, **options,
    )  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr(TrainerClass, "__getattr__", counting)
        trainer.fit(module_cls(), loader)
    assert trainer.global_step > 0
    return reads[0]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_step_reads_no_option_through_getattr(monkeypatch: pytest.MonkeyPatch, scenario: str) -> None:
    module_cls, options = SCENARIOS[scenario]
    short = _option_reads(monkeypatch, module_cls, options, 4)
    long = _option_reads(monkeypatch, module_cls, options, 12)
    assert long - short == 0, f"{(long - short) / 8:.2f} reads per batch through Trainer.__getattr__"

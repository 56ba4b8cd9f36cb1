"""Precision plugins: every precision trains digits; 16-mixed skips an inf step and resumes its scaler exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.strategies.precision import KNOWN_PRECISIONS, cast_floating, resolve_precision
from examples.digits import Classifier, DigitsData

QUIET: dict[str, Any] = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


class Fp16Classifier(Classifier):
    """Pure fp16 weights need an Adam epsilon that fp16 can represent (1e-8 rounds to 0)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, eps=1e-4)


def digits_accuracy(precision: str) -> tuple[float, torch.dtype]:
    ember.seed_everything(42)
    trainer = ember.Trainer(max_epochs=6, precision=precision, enable_checkpointing=False, **QUIET)
    module = (Fp16Classifier if precision == "16-true" else Classifier)(epochs=6)
    trainer.fit(module, datamodule=DigitsData(test_fraction=0.0))  # the 80/20 split the band was set on
    return trainer.callback_metrics["val/acc"], next(module.parameters()).dtype


@pytest.mark.slow
def test_every_precision_trains_digits_to_the_fp32_band() -> None:
    reference, dtype = digits_accuracy("32-true")
    assert reference >= 0.93 and dtype == torch.float32
    expected_dtype = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}
    for precision in ("64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"):
        accuracy, dtype = digits_accuracy(precision)
        assert abs(accuracy - reference) <= 0.03, (precision, accuracy, reference)
        assert dtype == expected_dtype.get(precision, torch.float32), precision


def test_names_and_casting() -> None:
    assert resolve_precision("32").name == "32-true"
    for name in KNOWN_PRECISIONS:
        assert resolve_precision(name).name in (name, "32-true")
    batch = {"x": torch.ones(2), "y": torch.arange(2), "t": (torch.zeros(1), "text")}
    cast = cast_floating(batch, torch.float16)
    assert cast["x"].dtype == torch.float16 and cast["y"].dtype == torch.int64
    assert cast["t"][0].dtype == torch.float16 and cast["t"][1] == "text"


class Regressor(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 1)
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class PoisonGradient(ember.Callback):
    """Sets one gradient to inf after the backward of the batch that makes optimizer step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.params_before: dict[int, torch.Tensor] = {}
        self.params_after: dict[int, torch.Tensor] = {}
        self.scales: list[float] = []

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        if trainer.global_step + 1 == self.step:
            module.model.weight.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.params_before[trainer.global_step + 1] = module.model.weight.detach().clone()
        self.scales.append(trainer.strategy.precision.scaler.get_scale())

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.params_after[trainer.global_step] = module.model.weight.detach().clone()


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    # small values: the scaled gradients stay inside fp16 range, so only the poisoned step overflows
    x, y = torch.randn(40, 4, generator=g) * 0.1, torch.randn(40, 1, generator=g) * 0.1
    return DataLoader(TensorDataset(x, y), batch_size=8)


def test_16_mixed_skips_exactly_the_step_with_an_inf_gradient() -> None:
    torch.manual_seed(0)
    poison = PoisonGradient(step=3)
    trainer = ember.Trainer(max_epochs=1, precision="16-mixed", callbacks=[poison], enable_checkpointing=False, **QUIET)
    trainer.fit(Regressor(), loader())
    assert trainer.global_step == 5  # a skipped step still counts as a step
    assert torch.equal(poison.params_before[3], poison.params_after[3])  # step 3 changed nothing
    for step in (1, 2, 4, 5):
        assert not torch.equal(poison.params_before[step], poison.params_after[step])
    assert trainer.callback_metrics["train/skipped_steps"] == 1
    assert poison.scales == [65536.0, 65536.0, 65536.0, 32768.0, 32768.0]  # halved after the skip


def test_16_mixed_scaler_state_resumes_exactly(tmp_path: Path) -> None:
    def run(stop: int | None, ckpt_path: str | None) -> tuple[ember.Trainer, nn.Module]:
        torch.manual_seed(0)
        callbacks: list[ember.Callback] = [PoisonGradient(step=2), ModelCheckpoint(every_n_train_steps=1)]
        if stop is not None:
            callbacks.append(StopAt(stop))
        trainer = ember.Trainer(
            max_epochs=2, precision="16-mixed", callbacks=callbacks, default_root_dir=tmp_path, run_name="r", **QUIET
        )
        module = Regressor()
        trainer.fit(module, loader(), ckpt_path=ckpt_path)
        return trainer, module

    full_trainer, full = run(None, None)
    run(4, None)
    resumed_trainer, resumed = run(None, "last")
    scaler, full_scaler = resumed_trainer.strategy.precision.scaler, full_trainer.strategy.precision.scaler
    assert scaler.state_dict() == full_scaler.state_dict()
    assert scaler.get_scale() == 32768.0
    assert resumed_trainer.callback_metrics["train/skipped_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters(), strict=True))


class StopAt(ember.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True

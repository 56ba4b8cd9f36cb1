"""Bad input fails early with a clear error, and leaves nothing half-done behind.

Every error is checked for its type and its message. Where the error comes
from `fit`, the tests also check that no training happened (``training_step``
not called or no optimizer step, parameters unchanged) and, with the default
CSV logger pointed at ``tmp_path``, that no run directory was created.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
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
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_batches * batch_size, 4, generator=g)
    y = torch.randn(num_batches * batch_size, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class Net(TrainingModule):
    """Counts training steps and optimizer setups; `output(x, y, pred)` picks what training_step returns."""

    def __init__(self, output: Any = None) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.output = output
        self.training_steps = 0
        self.optimizer_setups = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.training_steps += 1
        x, y = batch
        pred = self(x)
        if self.output is not None:
            return self.output(x, y, pred)
        return F.mse_loss(pred, y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        self.optimizer_setups += 1
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StepCounter(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.steps += 1


def snapshot(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def unchanged(module: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def files_under(path: Path) -> list[Path]:
    return sorted(path.rglob("*"))


def logging_trainer(tmp_path: Path, **kwargs: Any) -> Trainer:
    """A trainer with the default CSV logger writing under `tmp_path`."""
    return Trainer(
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


# --- what training_step returns -------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "shape"),
    [
        (lambda x, y, pred: F.mse_loss(pred, y, reduction="none"), r"\(2, 1\)"),
        (lambda x, y, pred: (pred - y).pow(2).sum(dim=1), r"\(2,\)"),
    ],
)
def test_non_scalar_loss(output: Any, shape: str, tmp_path: Path) -> None:
    module = Net(output)
    before = snapshot(module)
    counter = StepCounter()
    trainer = logging_trainer(tmp_path, max_epochs=1, callbacks=[counter])
    with pytest.raises(ValueError, match=rf"shape {shape}.*scalar"):
        trainer.fit(module, loader(3))
    assert module.training_steps == 1
    assert counter.steps == 0 and trainer.global_step == 0
    assert unchanged(module, before)
    assert all(p.grad is None for p in module.parameters())
    assert files_under(tmp_path) == []


def test_non_scalar_loss_in_a_dict() -> None:
    module = Net(lambda x, y, pred: {"loss": (pred - y).abs()})
    with pytest.raises(ValueError, match=r"shape \(2, 1\)"):
        Trainer(max_epochs=1, **QUIET).fit(module, loader(3))


def test_training_step_returning_a_string(tmp_path: Path) -> None:
    module = Net(lambda x, y, pred: "loss")
    before = snapshot(module)
    trainer = logging_trainer(tmp_path, max_epochs=1)
    with pytest.raises(TypeError, match=r"training_step must return a scalar loss tensor.*got str"):
        trainer.fit(module, loader(3))
    assert module.training_steps == 1
    assert trainer.global_step == 0
    assert unchanged(module, before)
    assert files_under(tmp_path) == []


def test_training_step_returning_a_dict_without_loss() -> None:
    module = Net(lambda x, y, pred: {"pred": pred})
    with pytest.raises(TypeError, match="without a 'loss' tensor"):
        Trainer(max_epochs=1, **QUIET).fit(module, loader(3))


def test_loss_that_does_not_require_grad(tmp_path: Path) -> None:
    module = Net(lambda x, y, pred: F.mse_loss(pred, y).detach())
    before = snapshot(module)
    trainer = logging_trainer(tmp_path, max_epochs=1)
    with pytest.raises(RuntimeError, match="does not require grad"):
        trainer.fit(module, loader(3))
    assert module.training_steps == 1
    assert trainer.global_step == 0
    assert unchanged(module, before)
    assert files_under(tmp_path) == []


# --- data --------------------------------------------------------------------------------


def test_empty_train_dataloader(tmp_path: Path) -> None:
    module = Net()
    before = snapshot(module)
    empty = DataLoader(TensorDataset(torch.randn(1, 4), torch.randn(1, 1)), batch_size=2, drop_last=True)
    trainer = logging_trainer(tmp_path, max_epochs=1)
    with pytest.raises(ValueError, match=r"train dataloader is empty"):
        trainer.fit(module, empty)
    assert module.training_steps == 0 and module.optimizer_setups == 0
    assert unchanged(module, before)
    assert files_under(tmp_path) == []


def test_empty_val_dataloader(tmp_path: Path) -> None:
    module = Net()
    empty = DataLoader(TensorDataset(torch.randn(0, 4), torch.randn(0, 1)), batch_size=2)
    trainer = logging_trainer(tmp_path, max_epochs=1)
    with pytest.raises(ValueError, match=r"validation dataloader is empty"):
        trainer.fit(module, loader(2), empty)
    assert module.training_steps == 0
    assert files_under(tmp_path) == []


def test_fit_without_training_data(tmp_path: Path) -> None:
    module = Net()
    trainer = logging_trainer(tmp_path, max_epochs=1)
    with pytest.raises(ValueError, match=r"fit needs training data.*train_dataloaders"):
        trainer.fit(module)
    assert module.training_steps == 0
    assert files_under(tmp_path) == []


def test_fit_with_a_plain_nn_module(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    before = snapshot(model)
    trainer = logging_trainer(tmp_path, max_epochs=1)
    with pytest.raises(TypeError, match=r"expected an ember\.TrainingModule, got Linear"):
        trainer.fit(model, loader(2))  # type: ignore[arg-type]
    assert unchanged(model, before)
    assert files_under(tmp_path) == []
    assert trainer.stage is None


# --- the module -----------------------------------------------------------------------


class NoOptimizers(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.training_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.training_steps += 1
        x, y = batch
        return F.mse_loss(self.layer(x), y)


def test_module_without_configure_optimizers(tmp_path: Path) -> None:
    module = NoOptimizers()
    before = snapshot(module)
    trainer = logging_trainer(tmp_path, max_epochs=1)
    with pytest.raises(
        NotImplementedError,
        match=r"NoOptimizers does not define configure_optimizers\(\); add one.*def configure_optimizers",
    ):
        trainer.fit(module, loader(2))
    assert module.training_steps == 0
    assert unchanged(module, before)
    assert files_under(tmp_path) == []


# --- Trainer options (rejected in __init__) ---------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"precision": "17-weird"}, ValueError, r"precision='17-weird' is not valid.*32-true"),
        ({"precision": 8}, ValueError, r"precision=8 is not valid.*32-true"),
        ({"precision": "bf16"}, ValueError, r"precision='bf16' is not valid.*bf16-mixed"),
        ({"accelerator": "tpu"}, ValueError, r"accelerator='tpu' is not valid.*cpu"),
        ({"devices": 0}, ValueError, r"devices=0: use a positive number of processes"),
        ({"strategy": "horovod"}, ValueError, r"strategy='horovod' is not valid.*ddp, fsdp"),
        ({"val_check_interval": 1.5}, ValueError, r"val_check_interval=1\.5.*\(0, 1\]"),
        ({"val_check_interval": 0.0}, ValueError, r"val_check_interval=0\.0.*\(0, 1\]"),
        ({"val_check_interval": 0}, ValueError, r"val_check_interval=0.*at least 1"),
        ({"val_check_interval": "1"}, TypeError, r"val_check_interval must be"),
        ({"limit_train_batches": 1.5}, ValueError, r"limit_train_batches=1\.5.*\[0, 1\]"),
        ({"limit_val_batches": -1}, ValueError, r"limit_val_batches=-1 must not be negative"),
        ({"limit_test_batches": "all"}, TypeError, r"limit_test_batches must be a fraction"),
        ({"limit_predict_batches": 2.0}, ValueError, r"limit_predict_batches=2\.0"),
        (
            {"accumulate_grad_batches": 0},
            ValueError,
            r"accumulate_grad_batches must be a positive int; got 0$",
        ),
        ({"accumulate_grad_batches": 2.0}, ValueError, r"accumulate_grad_batches must be a positive int"),
        ({"check_val_every_n_epoch": 0}, ValueError, r"check_val_every_n_epoch must be a positive int"),
        ({"log_every_n_steps": 0}, ValueError, r"log_every_n_steps must be a positive int"),
        ({"gradient_clip_algorithm": "foo"}, ValueError, r"gradient_clip_algorithm='foo'.*'norm' or 'value'"),
        ({"max_time": "1 hour"}, ValueError, r"max_time='1 hour'.*DD:HH:MM:SS"),
        ({"max_time": "1:00:00"}, ValueError, r"max_time='1:00:00'.*DD:HH:MM:SS"),
        ({"max_time": 0}, ValueError, r"max_time=0"),
        ({"max_time": -5.0}, ValueError, r"max_time=-5\.0"),
        ({"max_time": True}, ValueError, r"max_time=True"),
        ({"fast_dev_run": -1}, ValueError, r"fast_dev_run must be a positive int"),
    ],
)
def test_bad_trainer_option(kwargs: dict[str, Any], error: type[Exception], match: str, tmp_path: Path) -> None:
    with pytest.raises(error, match=match):
        Trainer(default_root_dir=tmp_path, **kwargs)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize(
    "value",
    [timedelta(seconds=-1), timedelta(0), {"seconds": -30}, "00:00:00:00"],
    ids=["negative-timedelta", "zero-timedelta", "negative-dict", "zero-string"],
)
def test_max_time_must_be_positive_in_every_form(value: Any) -> None:
    # A number <= 0 is rejected; the same budget as a timedelta, dict or string must be too
    # (otherwise fit stops before the first step without a word).
    with pytest.raises(ValueError, match="max_time"):
        Trainer(max_time=value, **QUIET)


def test_max_time_dict_with_an_unknown_key() -> None:
    with pytest.raises((ValueError, TypeError), match=r"max_time.*hour"):
        Trainer(max_time={"hour": 1}, **QUIET)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_accelerator_without_cuda(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"accelerator='cuda' but CUDA is not available.*'cpu'"):
        Trainer(accelerator="cuda", default_root_dir=tmp_path)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("value", [-1.0, -0.5])
def test_negative_gradient_clip_val(value: float) -> None:
    # clip_grad_norm_ with a negative max_norm multiplies the gradients by a negative
    # factor, so SGD would climb the loss. It must be refused up front.
    with pytest.raises(ValueError, match="gradient_clip_val"):
        Trainer(gradient_clip_val=value, max_steps=1, **QUIET).fit(Net(), loader(2))


def test_bad_num_sanity_val_steps() -> None:
    module = Net()
    with pytest.raises(ValueError, match="num_sanity_val_steps"):
        Trainer(num_sanity_val_steps=-2, max_epochs=1, **QUIET).fit(module, loader(2), loader(2))
    assert module.training_steps == 0


def test_tiny_train_fraction_that_rounds_to_zero_batches() -> None:
    # limit_train_batches=0 means "no training"; 0.01 of 10 batches is 0.1 batch and
    # must not silently become "no training" too.
    module = Net()
    with pytest.raises(ValueError, match="limit_train_batches"):
        Trainer(limit_train_batches=0.01, max_epochs=1, **QUIET).fit(module, loader(10))
    assert module.training_steps == 0


# --- options checked against the data (in fit) -----------------------------------------


def test_val_check_interval_larger_than_the_epoch(tmp_path: Path) -> None:
    module = Net()
    before = snapshot(module)
    trainer = logging_trainer(tmp_path, max_epochs=1, val_check_interval=5)
    match = r"val_check_interval=5 is larger than the training epoch \(3 batches\)"
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, loader(3), loader(2))
    assert module.training_steps == 0 and module.optimizer_setups == 0
    assert unchanged(module, before)
    assert files_under(tmp_path) == []


def test_val_check_interval_larger_than_the_limited_epoch() -> None:
    module = Net()
    trainer = Trainer(max_epochs=1, val_check_interval=4, limit_train_batches=3, **QUIET)
    with pytest.raises(ValueError, match=r"larger than the training epoch \(3 batches\); use at most 3"):
        trainer.fit(module, loader(10), loader(2))
    assert module.training_steps == 0


# --- callbacks ----------------------------------------------------------------------------


class Misspelt(Callback):
    def on_train_epoch_ends(self, trainer: Any, module: Any) -> None:
        pass


class MisspeltModule(Net):
    def on_validation_epoch_ned(self) -> None:
        pass


def test_misspelt_callback_hook(tmp_path: Path) -> None:
    module = Net()
    before = snapshot(module)
    trainer = logging_trainer(tmp_path, max_epochs=1, callbacks=[Misspelt()])
    with pytest.raises(
        AttributeError,
        match=r"Misspelt\.on_train_epoch_ends is not an ember hook.*did you mean 'on_train_epoch_end'",
    ):
        trainer.fit(module, loader(2))
    assert module.training_steps == 0
    assert unchanged(module, before)
    assert files_under(tmp_path) == []


def test_misspelt_module_hook() -> None:
    module = MisspeltModule()
    with pytest.raises(AttributeError, match=r"did you mean 'on_validation_epoch_end'"):
        Trainer(max_epochs=1, **QUIET).fit(module, loader(2))
    assert module.training_steps == 0


def test_non_callback_in_callbacks(tmp_path: Path) -> None:
    module = Net()
    trainer = logging_trainer(tmp_path, max_epochs=1, callbacks=[StepCounter(), object()])
    with pytest.raises(TypeError, match=r"callbacks must be ember\.Callback instances; got object"):
        trainer.fit(module, loader(2))
    assert module.training_steps == 0
    assert files_under(tmp_path) == []


def test_failed_setup_leaves_the_trainer_idle() -> None:
    # Errors raised inside the run reset trainer.stage; one raised while the run is
    # being set up (here: building the callback list) must too.
    trainer = Trainer(max_epochs=1, callbacks=[Misspelt()], **QUIET)
    with pytest.raises(AttributeError):
        trainer.fit(Net(), loader(2))
    assert trainer.stage is None

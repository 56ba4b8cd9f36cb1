"""Bitwise parity between ``ember.Trainer.fit`` and a hand-written PyTorch loop.

Each test trains the same seeded model on the same seeded data twice: once with
a plain loop written against the documented semantics, once through ember. The
per-step losses and every final parameter must be *identical* (``torch.equal``),
not merely close: ember adds no arithmetic of its own to the optimization, and
it must not draw from the global RNG (dropout draws from it).

Documented semantics pinned here:

- an epoch-interval scheduler steps once after every training epoch;
- ``accumulate_grad_batches=k``: the optimizer steps at batch indices with
  ``(i + 1) % k == 0`` and at the last batch of the epoch; each micro-batch
  loss is divided by the size of its window (``k``, or the remainder for the
  last, short window);
- ``gradient_clip_val``: ``clip_grad_norm_`` / ``clip_grad_value_`` on the
  optimizer's parameters after ``on_before_optimizer_step`` and before the step;
- validation (sanity check included) neither consumes the global RNG nor
  changes the training order;
- an epoch that is not cut short by a limit is a ``for`` loop over the loader:
  after the last batch the loader is asked once more (the sampler's final draw).

tests/exactness/ checks the same contract over generated configurations.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember

IN_FEATURES, HIDDEN, OUT_FEATURES = 6, 16, 3
MODEL_SEED, DATA_SEED, SHUFFLE_SEED = 1234, 99, 7

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@pytest.fixture(autouse=True)
def _isolate_global_rng():
    """The tests reseed the global RNG; leave the rest of the suite's RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        yield


# --- shared building blocks ---------------------------------------------------------
def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.Tanh(),
        nn.Dropout(p=0.3),
        nn.Linear(HIDDEN, OUT_FEATURES),
    )


def make_dataset(n: int, seed: int = DATA_SEED) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    y = torch.randn(n, OUT_FEATURES, generator=g)
    return TensorDataset(x, y)


def make_train_loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    """A shuffling loader whose order depends only on its own generator."""
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(SHUFFLE_SEED)
    )


def sgd_momentum(model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def raw_fit(
    loader: DataLoader,
    epochs: int,
    make_optimizer: OptimizerFactory,
    make_scheduler: SchedulerFactory | None = None,
    accumulate: int = 1,
    clip: tuple[float, str] | None = None,
) -> tuple[nn.Module, list[torch.Tensor], list[torch.Tensor], int]:
    """The reference loop, written from the documented semantics.

    Returns (model, per-batch losses, per-batch losses as backpropagated, optimizer steps).
    """
    torch.manual_seed(MODEL_SEED)
    model = make_mlp()
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer) if make_scheduler is not None else None
    model.train()
    optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    backpropagated: list[torch.Tensor] = []
    steps = 0
    n = len(loader)
    full = n // accumulate * accumulate
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            window = accumulate if i < full else n - full
            loss = F.mse_loss(model(x), y)
            scaled = loss / window if window > 1 else loss
            scaled.backward()
            losses.append(loss.detach())
            backpropagated.append(scaled.detach())
            if (i + 1) % accumulate == 0 or i + 1 == n:
                if clip is not None:
                    value, algorithm = clip
                    if algorithm == "norm":
                        torch.nn.utils.clip_grad_norm_(model.parameters(), value)
                    else:
                        torch.nn.utils.clip_grad_value_(model.parameters(), value)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
        if scheduler is not None:
            scheduler.step()
    return model, losses, backpropagated, steps


class Regressor(ember.TrainingModule):
    def __init__(self, make_optimizer: OptimizerFactory, make_scheduler: SchedulerFactory | None = None) -> None:
        super().__init__()
        self.model = make_mlp()
        self._make_optimizer = make_optimizer
        self._make_scheduler = make_scheduler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return {"loss": F.mse_loss(self(x), y)}

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("val/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = self._make_optimizer(self.model)
        if self._make_scheduler is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self._make_scheduler(optimizer), "interval": "epoch"},
        }


class Recorder(ember.Callback):
    """Records losses, backpropagated losses, optimizer steps and gradient sizes."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.backpropagated: list[torch.Tensor] = []
        self.optimizer_steps_per_epoch: dict[int, int] = {}
        self.grad_norms_before_clip: list[float] = []
        self.grad_max_abs_before_clip: list[float] = []
        self.grad_norms_after_clip: list[float] = []
        self.grad_max_abs_after_clip: list[float] = []
        self.validation_batches = 0
        self.sanity_validation_batches = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"])

    def on_before_backward(self, trainer, module, loss) -> None:
        self.backpropagated.append(loss.detach().clone())

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        epoch = trainer.current_epoch
        self.optimizer_steps_per_epoch[epoch] = self.optimizer_steps_per_epoch.get(epoch, 0) + 1
        norm, max_abs = _grad_sizes(optimizer)
        self.grad_norms_before_clip.append(norm)
        self.grad_max_abs_before_clip.append(max_abs)

    def on_before_zero_grad(self, trainer, module, optimizer) -> None:
        norm, max_abs = _grad_sizes(optimizer)  # the gradients the step used: clipped
        self.grad_norms_after_clip.append(norm)
        self.grad_max_abs_after_clip.append(max_abs)

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.sanity_checking:
            self.sanity_validation_batches += 1
        else:
            self.validation_batches += 1


def _grad_sizes(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    max_abs = max(g.abs().max().item() for g in grads)
    return norm, max_abs


def ember_fit(
    tmp_path,
    loader: DataLoader,
    epochs: int,
    make_optimizer: OptimizerFactory,
    make_scheduler: SchedulerFactory | None = None,
    val_loader: DataLoader | None = None,
    num_sanity_val_steps: int = 0,
    **trainer_kwargs: Any,
) -> tuple[Regressor, ember.Trainer, Recorder]:
    torch.manual_seed(MODEL_SEED)
    module = Regressor(make_optimizer, make_scheduler)
    recorder = Recorder()
    trainer = ember.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=num_sanity_val_steps,
        default_root_dir=tmp_path,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=val_loader)
    return module, trainer, recorder


def assert_params_equal(raw: nn.Module, module: Regressor) -> None:
    raw_params = dict(raw.named_parameters())
    ember_params = dict(module.model.named_parameters())
    assert raw_params.keys() == ember_params.keys()
    for name, p in raw_params.items():
        assert torch.equal(p, ember_params[name]), f"parameter {name} differs"


# --- 1. plain training: SGD with momentum, StepLR per epoch, dropout ------------------
def test_fit_matches_raw_loop_bitwise(tmp_path):
    dataset = make_dataset(53)  # 53 = 6 * 8 + 5: the last batch is short
    epochs = 3

    raw_model, raw_losses, _, raw_steps = raw_fit(make_train_loader(dataset, 8), epochs, sgd_momentum, step_lr)
    raw_rng = torch.get_rng_state()

    module, trainer, recorder = ember_fit(tmp_path, make_train_loader(dataset, 8), epochs, sgd_momentum, step_lr)
    ember_rng = torch.get_rng_state()

    assert raw_steps == 7 * epochs
    assert trainer.global_step == 7 * epochs
    assert trainer.current_epoch == epochs
    assert len(recorder.losses) == len(raw_losses) == 21
    assert torch.equal(torch.stack(recorder.losses), torch.stack(raw_losses))
    assert_params_equal(raw_model, module)
    # the scheduler stepped once per epoch: 0.1 * 0.5**3
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1 * 0.5**3
    # ember drew nothing from the global RNG beyond the model's own dropout
    assert torch.equal(raw_rng, ember_rng)


# --- 2. gradient accumulation with a short last window -------------------------------
def test_accumulation_with_short_last_window_matches_raw_loop(tmp_path):
    dataset = make_dataset(38)  # batch_size 4 -> 10 batches (9 full + 2), windows 3+3+3+1
    epochs, k = 2, 3

    loader = make_train_loader(dataset, 4)
    assert len(loader) == 10
    raw_model, raw_losses, raw_backprop, raw_steps = raw_fit(loader, epochs, sgd_momentum, accumulate=k)

    module, trainer, recorder = ember_fit(
        tmp_path, make_train_loader(dataset, 4), epochs, sgd_momentum, accumulate_grad_batches=k
    )

    assert raw_steps == 4 * epochs
    assert recorder.optimizer_steps_per_epoch == {0: 4, 1: 4}
    assert trainer.global_step == 4 * epochs
    assert torch.equal(torch.stack(recorder.losses), torch.stack(raw_losses))
    # each micro-batch loss divided by its window size: 3, 3, 3, then 1 for batch 9
    expected_divisors = torch.tensor([3.0] * 9 + [1.0]).repeat(epochs)
    assert torch.equal(torch.stack(recorder.backpropagated), torch.stack(raw_backprop))
    assert torch.equal(torch.stack(recorder.backpropagated), torch.stack(recorder.losses) / expected_divisors)
    assert_params_equal(raw_model, module)


# --- 3. gradient clipping ------------------------------------------------------------
@pytest.mark.parametrize(("algorithm", "clip_val"), [("norm", 0.5), ("value", 0.05)])
def test_gradient_clipping_matches_raw_loop(tmp_path, algorithm, clip_val):
    dataset = make_dataset(53)
    epochs = 2

    def big_lr_sgd(model: nn.Module) -> torch.optim.Optimizer:
        return sgd_momentum(model, lr=0.8)

    raw_model, raw_losses, _, _ = raw_fit(make_train_loader(dataset, 8), epochs, big_lr_sgd, clip=(clip_val, algorithm))
    module, trainer, recorder = ember_fit(
        tmp_path,
        make_train_loader(dataset, 8),
        epochs,
        big_lr_sgd,
        gradient_clip_val=clip_val,
        gradient_clip_algorithm=algorithm,
    )

    assert trainer.global_step == 7 * epochs
    if algorithm == "norm":
        before, after = recorder.grad_norms_before_clip, recorder.grad_norms_after_clip
        assert all(a <= clip_val * (1 + 1e-5) for a in after)
    else:
        before, after = recorder.grad_max_abs_before_clip, recorder.grad_max_abs_after_clip
        assert all(a <= torch.tensor(clip_val).item() for a in after)  # clip_val as float32
    assert len(before) == len(after) == 7 * epochs
    # clipping actually triggered (on_before_optimizer_step sees the unclipped gradients)
    assert sum(b > clip_val for b in before) >= 1
    assert max(before) > max(after)
    assert torch.equal(torch.stack(recorder.losses), torch.stack(raw_losses))
    assert_params_equal(raw_model, module)


# --- 4. validation and the sanity check leave training untouched -----------------------
def test_validation_and_sanity_check_do_not_change_training(tmp_path):
    dataset = make_dataset(53)
    val_dataset = make_dataset(20, seed=DATA_SEED + 1)
    epochs = 3

    raw_model, raw_losses, _, _ = raw_fit(make_train_loader(dataset, 8), epochs, sgd_momentum, step_lr)
    raw_rng = torch.get_rng_state()

    # an ordinary, unshuffled validation loader: 20 samples / 8 -> 3 batches
    val_loader = DataLoader(val_dataset, batch_size=8)
    module, trainer, recorder = ember_fit(
        tmp_path,
        make_train_loader(dataset, 8),
        epochs,
        sgd_momentum,
        step_lr,
        val_loader=val_loader,
        num_sanity_val_steps=2,
    )
    ember_rng = torch.get_rng_state()

    # validation really ran: the sanity check and once after every epoch
    assert recorder.sanity_validation_batches == 2
    assert recorder.validation_batches == 3 * epochs
    assert "val/loss" in trainer.callback_metrics
    assert module.training  # back in train mode after validation
    assert torch.equal(torch.stack(recorder.losses), torch.stack(raw_losses))
    assert_params_equal(raw_model, module)
    assert torch.equal(raw_rng, ember_rng)


# --- 5. a dataset size that is a multiple of the batch size ------------------------------
class _GeneralLoop(ember.Callback):
    """Implements a hook around backward, so the general batch loop runs instead of the plain one."""

    def on_after_backward(self, trainer, module) -> None:
        pass


class _Losses(ember.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"])


@pytest.mark.parametrize("batch_loop", ["plain", "general"])
def test_a_dataset_size_that_is_a_multiple_of_the_batch_size_matches_raw_loop_in_every_epoch(
    tmp_path, monkeypatch, batch_loop
):
    """640 samples in batches of 32: the last batch is complete before the sampler is exhausted.

    A ``for`` loop asks the loader once more after it, which runs the end of
    ``RandomSampler.__iter__`` (one more ``randperm`` from the loader's generator).
    An epoch that took exactly ``len(loader)`` batches skipped that draw, and from
    epoch 2 on every epoch was shuffled differently from the raw loop's.
    """
    from ember.trainer import loop

    ran: list[str] = []
    original = loop.plain_step

    def spy(fit_loop: Any) -> Any:  # which step each epoch takes: the plain one, or the general one (None)
        step = original(fit_loop)
        ran.append("general" if step is None else "plain")
        return step

    monkeypatch.setattr(loop, "plain_step", spy)

    dataset = make_dataset(640)
    epochs = 3
    raw_loader = make_train_loader(dataset, 32)
    raw_model, raw_losses, _, raw_steps = raw_fit(raw_loader, epochs, sgd_momentum)
    raw_rng = torch.get_rng_state()

    torch.manual_seed(MODEL_SEED)
    module = Regressor(sgd_momentum)
    recorder = _Losses()
    callbacks: list[ember.Callback] = [recorder] + ([_GeneralLoop()] if batch_loop == "general" else [])
    loader = make_train_loader(dataset, 32)
    trainer = ember.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )
    trainer.fit(module, loader)

    assert ran == [batch_loop] * epochs
    assert raw_steps == trainer.global_step == 20 * epochs
    assert torch.equal(torch.stack(recorder.losses), torch.stack(raw_losses))
    assert_params_equal(raw_model, module)
    assert torch.equal(torch.get_rng_state(), raw_rng)
    assert torch.equal(loader.generator.get_state(), raw_loader.generator.get_state())


def test_a_limited_epoch_does_not_ask_the_loader_for_more_batches(tmp_path):
    """``limit_train_batches`` cuts the epoch: the loader is asked for exactly that many batches per epoch."""

    class Counted(TensorDataset):
        loads = 0

        def __getitem__(self, index: int) -> Any:
            Counted.loads += 1
            return super().__getitem__(index)

    dataset = make_dataset(64)
    counted = Counted(*dataset.tensors)
    raw_loader = make_train_loader(dataset, 8)
    for _ in range(2):
        for _ in itertools.islice(raw_loader, 3):
            pass
    loader = make_train_loader(counted, 8)
    ember_fit(tmp_path, loader, 2, sgd_momentum, limit_train_batches=3)
    assert Counted.loads == 2 * 3 * 8
    assert torch.equal(loader.generator.get_state(), raw_loader.generator.get_state())

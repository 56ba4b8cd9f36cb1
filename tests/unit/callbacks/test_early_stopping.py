"""EarlyStopping stops at the epoch worked out by hand for each rule, and its state survives torch.save."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import EarlyStopping

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)


def loader(n: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


class Scripted(ember.TrainingModule):
    """Logs ``values[epoch]`` as `name` once per epoch: from validation, or from training when `in_train`."""

    def __init__(self, values: list[float], name: str = "val/loss", in_train: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.values = values
        self.name = name
        self.in_train = in_train
        self.val_runs = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.in_train:
            self.log(self.name, self.values[self.current_epoch], on_step=False, on_epoch=True)
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self.trainer.sanity_checking:
            self.val_runs += batch_idx == 0
        value = 1e9 if self.trainer.sanity_checking else self.values[self.current_epoch]
        self.log(self.name, value)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run(
    values: list[float], stopper: EarlyStopping, validate: bool = True, logged: str | None = None, **kw: Any
) -> tuple[ember.Trainer, Any]:
    module = Scripted(values, logged or stopper.monitor, in_train=not validate)
    trainer = ember.Trainer(max_epochs=len(values), num_sanity_val_steps=0, callbacks=[stopper], **{**QUIET, **kw})
    trainer.fit(module, loader(), loader() if validate else None)
    return trainer, module


@pytest.mark.parametrize(
    ("values", "kwargs", "stopped_epoch", "reason"),
    [
        # best 5, 4; then 4.5 (wait 1), 4.2 (wait 2 = patience): stop in epoch 3
        ([5, 4, 4.5, 4.2, 4.1, 3, 2], dict(patience=2), 3, "did not improve"),
        # min_delta 0.5: 4.6 is not < 5 - 0.5 (wait 1); 4.3 is (best); 4.0, 3.9 are not < 3.8: stop in epoch 4
        ([5, 4.6, 4.3, 4.0, 3.9, 1, 1], dict(patience=2, min_delta=0.5), 4, "did not improve"),
        # max: 0.6 best in epoch 1; 0.55 and an equal 0.6 are no improvement: stop in epoch 3
        ([0.5, 0.6, 0.55, 0.6, 0.59, 0.9], dict(patience=2, mode="max"), 3, "did not improve"),
        # reaching the goal stops at once
        ([1.0, 0.5, 0.09, 0.05], dict(patience=10, stopping_threshold=0.1), 2, "stopping threshold"),
        # max mode: the goal is an upper bound
        ([0.1, 0.96, 0.97], dict(patience=10, mode="max", stopping_threshold=0.95), 1, "stopping threshold"),
        # diverging (worse than 10) stops at once even though patience is long
        ([1.0, 2.0, 11.0, 0.5], dict(patience=10, divergence_threshold=10.0), 2, "divergence threshold"),
        # a NaN stops at once
        ([1.0, math.nan, 0.5, 0.4], dict(patience=10), 1, "not finite"),
        # ... unless check_finite=False: NaN is simply no improvement
        ([1.0, math.nan, math.nan, 0.5], dict(patience=2, check_finite=False), 2, "did not improve"),
    ],
)
def test_stops_in_the_epoch_computed_by_hand(
    values: list[float], kwargs: dict[str, Any], stopped_epoch: int, reason: str
) -> None:
    stopper = EarlyStopping("val/loss", **kwargs)
    trainer, module = run(values, stopper)
    assert stopper.stopped_epoch == stopped_epoch
    assert stopper.stopping_reason is not None and reason in stopper.stopping_reason
    assert trainer.current_epoch == stopped_epoch + 1  # epochs 0..stopped_epoch ran in full
    assert module.val_runs == stopped_epoch + 1


def test_no_stop_while_improving() -> None:
    stopper = EarlyStopping("val/loss", patience=1)
    trainer, _ = run([5, 4, 3, 2], stopper)
    assert stopper.stopped_epoch is None and trainer.current_epoch == 4
    assert (stopper.best_score, stopper.wait_count) == (2.0, 0)


def test_without_validation_it_checks_a_training_metric_at_epoch_end() -> None:
    stopper = EarlyStopping("train/score", mode="max", patience=1)
    trainer, _ = run([0.1, 0.3, 0.2, 0.9], stopper, validate=False)
    assert stopper.stopped_epoch == 2 and trainer.current_epoch == 3


def test_sanity_check_and_trainer_validate_do_not_count() -> None:
    stopper = EarlyStopping("val/loss", patience=1)
    module = Scripted([3.0, 2.0, 1.0])
    trainer = ember.Trainer(max_epochs=3, num_sanity_val_steps=1, callbacks=[stopper], **QUIET)
    trainer.fit(module, loader(), loader())  # the sanity check logs 1e9: it must not become the best
    assert (stopper.best_score, stopper.wait_count, stopper.stopped_epoch) == (1.0, 0, None)
    module.values = [5.0] * 10  # much worse, but trainer.validate is not a check
    trainer.validate(module, loader())
    assert (stopper.best_score, stopper.wait_count) == (1.0, 0)


def test_missing_metric_is_an_error_naming_the_nearest_metric_unless_not_strict() -> None:
    with pytest.raises(KeyError, match=r"'val/los'.*did you mean 'val/loss'"):
        run([1.0, 1.0], EarlyStopping("val/los"), logged="val/loss")
    with pytest.warns(RuntimeWarning, match="not logged"):
        trainer, _ = run([1.0, 1.0], EarlyStopping("val/los", strict=False), logged="val/loss")
    assert trainer.current_epoch == 2


def test_state_round_trips_through_torch_save_and_resumed_checks_continue() -> None:
    values = [5.0, 4.0, 4.5, 4.4, 4.3]
    straight = EarlyStopping("val/loss", patience=3)
    for v in values:
        straight.evaluate(v)
    first = EarlyStopping("val/loss", patience=3)
    for v in values[:3]:
        first.evaluate(v)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state == {"wait_count": 1, "best_score": 4.0, "stopped_epoch": None, "patience": 3}
    resumed = EarlyStopping("val/loss", patience=3)
    resumed.load_state_dict(state)
    results = [resumed.evaluate(v) for v in values[3:]]
    assert results[-1][0] is True and (resumed.wait_count, resumed.best_score) == (3, 4.0)
    assert (straight.wait_count, straight.best_score) == (resumed.wait_count, resumed.best_score)
    assert first.state_key == "EarlyStopping[monitor=val/loss,mode=min]"


def test_mid_epoch_validation_checks_count_and_stop_skips_the_rest_of_the_epoch() -> None:
    class PerRun(Scripted):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            if batch_idx == 0:
                self.val_runs += 1
            self.log("val/loss", self.values[self.val_runs - 1])

    stopper = EarlyStopping("val/loss", patience=2)
    module = PerRun([3.0, 4.0, 5.0, 1.0, 1.0, 1.0])
    trainer = ember.Trainer(max_epochs=3, num_sanity_val_steps=0, val_check_interval=2, callbacks=[stopper], **QUIET)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=2), loader())
    # 8 batches per epoch, validation every 2: runs 1 (best 3), 2 (wait 1), 3 (wait 2: stop) after batch 6
    assert module.val_runs == 3 and stopper.stopped_epoch == 0
    assert trainer.global_step == 6 and trainer.current_epoch == 1


def test_verbose_prints_the_reason() -> None:
    stream = io.StringIO()
    run([1.0, 2.0, 3.0], EarlyStopping("val/loss", patience=2, verbose=True, stream=stream))
    # the third epoch is epoch 2: numbered from 0, as in checkpoint names
    assert stream.getvalue() == (
        "EarlyStopping: val/loss did not improve by more than 0 for 2 checks; best 1; stopping after epoch 2\n"
    )


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping("x", mode="lowest")
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping("x", patience=0)

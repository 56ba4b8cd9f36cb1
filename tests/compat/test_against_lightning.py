"""Each body of `compat_bodies`, written once in Lightning's idiom, trained by Lightning and by ember on the same
data: equal per-step losses and final parameters (bitwise), equal epoch metrics, step counts and learning rates."""

from __future__ import annotations

from pathlib import Path

import pytest
from compat_bodies import (
    AccumulateClipBody,
    ClassifierBody,
    FileDataBody,
    FileDataModuleBody,
    GANBody,
    LBFGSBody,
    OwnLoadersBody,
    PlateauBody,
    classification_data,
    gan_data,
    loader,
    regression_data,
)
from compat_harness import assert_same_run, build, fit_ember, fit_lightning, pl

import ember

# Lightning's advice on workers and batch sizes, and its own use of a deprecated torch name.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]


def both(body: type, *data_fns: object, **options: object) -> None:
    """Fit `body` under each framework with fresh loaders from `data_fns`; the runs must agree."""
    theirs = fit_lightning(build(body, pl.LightningModule), *[fn() for fn in data_fns], **options)  # type: ignore[operator]
    mine = fit_ember(build(body, ember.TrainingModule), *[fn() for fn in data_fns], **options)  # type: ignore[operator]
    assert_same_run(mine, theirs)


def test_classifier_with_prog_bar_logging_and_torchmetrics() -> None:
    both(
        ClassifierBody,
        lambda: loader(classification_data(60, seed=0), batch_size=16),  # 4 batches, the last one short
        lambda: loader(classification_data(30, seed=1), batch_size=8),
        max_epochs=3,
    )


def test_gan_with_two_optimizers_under_manual_optimization() -> None:
    both(GANBody, lambda: loader(gan_data(48), batch_size=12), max_epochs=3)


def test_lbfgs_with_the_closure_built_by_the_trainer() -> None:
    both(
        LBFGSBody,
        lambda: loader(regression_data(32, seed=0), batch_size=8),
        lambda: loader(regression_data(16, seed=1), batch_size=8),
        max_epochs=2,
    )


def test_reduce_lr_on_plateau_with_a_monitor() -> None:
    both(
        PlateauBody,
        lambda: loader(regression_data(40, seed=0), batch_size=8),
        lambda: loader(regression_data(16, seed=1), batch_size=8),
        max_epochs=5,
    )


def test_gradient_accumulation_and_clipping() -> None:
    both(
        AccumulateClipBody,
        lambda: loader(regression_data(48, seed=0), batch_size=8),  # 6 batches: two windows of 3
        lambda: loader(regression_data(16, seed=1), batch_size=8),
        max_epochs=2,
        accumulate_grad_batches=3,
        gradient_clip_val=0.1,
    )


def test_module_defined_dataloaders() -> None:
    both(OwnLoadersBody, max_epochs=2)


def test_datamodule_with_prepare_data_and_setup(tmp_path: Path) -> None:
    (tmp_path / "l").mkdir(), (tmp_path / "e").mkdir()
    theirs_data = build(FileDataBody, pl.LightningDataModule, tmp_path / "l")
    mine_data = build(FileDataBody, ember.DataModule, tmp_path / "e")
    theirs = fit_lightning(build(FileDataModuleBody, pl.LightningModule), theirs_data, max_epochs=2)
    mine = fit_ember(build(FileDataModuleBody, ember.TrainingModule), mine_data, max_epochs=2)  # positional, too
    assert_same_run(mine, theirs)
    assert mine_data.calls == theirs_data.calls == ["prepare_data", "setup:fit"]

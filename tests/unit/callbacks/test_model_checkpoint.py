"""ModelCheckpoint: names, triggers, top-k bookkeeping, ``last``, and its state across a resume.

The module logs a fixed ``val/acc`` per epoch (`SCORES`), so the expected
top-k set is computed by hand from the values the trainer actually reported.
Every fit is a 1-parameter-layer model over 10 batches per epoch: fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Callback, Trainer, TrainingModule
from ember import checkpoint as ckpt
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import manager

QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
SCORES = [0.5, 0.8125, 0.7, 0.9, 0.6]  # val/acc of epochs 0..4
STEPS_PER_EPOCH = 10


def train_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * STEPS_PER_EPOCH, 2, generator=g), torch.randn(2 * STEPS_PER_EPOCH, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=2)


def val_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.ones(2, 2), torch.zeros(2, 1)), batch_size=2)


class Net(TrainingModule):
    def __init__(self, sleep_s: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.hparams.sleep_s:
            time.sleep(self.hparams.sleep_s)
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/acc", SCORES[self.current_epoch % len(SCORES)])

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test/loss", F.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(Callback):
    """What the trainer reported at each epoch end, and where ``last`` pointed at each epoch start."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self.scores: dict[int, float] = {}  # epoch -> val/acc
        self.steps: dict[int, int] = {}  # epoch -> global step at its end
        self.last_at_start: list[tuple[int, str, str]] = []  # (epoch, last names, newest dir on disk)

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if self.directory is not None and (self.directory / "last").exists():
            named = (self.directory / "last").read_text().strip()
            self.last_at_start.append((trainer.current_epoch, named, newest_on_disk(self.directory)))

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if "val/acc" in trainer.callback_metrics:
            self.scores[trainer.current_epoch] = trainer.callback_metrics["val/acc"]
        self.steps[trainer.current_epoch] = trainer.global_step


def dirs(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.is_dir()}


def newest_on_disk(directory: Path) -> str:
    return max(ckpt.checkpoints_in(directory), key=lambda p: ckpt.read_meta(p)["state"]["progress"]["global_step"]).name


def fit(epochs: int, *callbacks: Callback, ckpt_path: str | None = None, module: Net | None = None) -> Trainer:
    trainer = Trainer(max_epochs=epochs, num_sanity_val_steps=0, callbacks=list(callbacks), **QUIET)
    trainer.fit(module or Net(), train_loader(), val_loader(), ckpt_path=ckpt_path)
    return trainer


def name(epoch: int) -> str:
    return f"epoch={epoch}-step={(epoch + 1) * STEPS_PER_EPOCH}"


def test_filename_template_with_metrics(tmp_path: Path) -> None:
    saver = ModelCheckpoint(tmp_path, filename="{epoch}-{step}-{val/acc:.3f}", save_top_k=-1)
    fit(2, saver)
    assert dirs(tmp_path) == {"epoch=0-step=10-val_acc=0.500", "epoch=1-step=20-val_acc=0.812"}
    assert (tmp_path / "last").read_text().strip() == "epoch=1-step=20-val_acc=0.812"


@pytest.mark.parametrize("mode", ["max", "min"])
def test_monitor_keeps_exactly_the_k_best(tmp_path: Path, mode: str) -> None:
    record = Recorder()
    saver = ModelCheckpoint(tmp_path, monitor="val/acc", mode=mode, save_top_k=2)
    fit(5, saver, record)

    assert record.scores == pytest.approx(dict(enumerate(SCORES)))  # logged as float32
    ranked = sorted(record.scores, key=lambda e: record.scores[e], reverse=mode == "max")
    best_two, best = ranked[:2], ranked[0]
    assert dirs(tmp_path) == {name(e) for e in best_two} | {name(4)}  # the k best, plus the newest for `last`
    assert saver.best_model_path == str(tmp_path / name(best))
    assert saver.best_model_score == record.scores[best]
    assert saver.kept == {str(tmp_path / name(e)): record.scores[e] for e in sorted(best_two)}
    assert (tmp_path / "last").read_text().strip() == name(4)
    for directory in dirs(tmp_path):
        ckpt.check_complete(tmp_path / directory)


def test_save_top_k_all_none_and_most_recent(tmp_path: Path) -> None:
    fit(5, ModelCheckpoint(tmp_path / "all", monitor="val/acc", mode="max", save_top_k=-1))
    assert dirs(tmp_path / "all") == {name(e) for e in range(5)}

    none = ModelCheckpoint(tmp_path / "none", monitor="val/acc", mode="max", save_top_k=0)
    fit(5, none)
    assert dirs(tmp_path / "none") == {name(4)}  # only what `last` names
    assert (tmp_path / "none" / "last").read_text().strip() == name(4)
    assert none.kept == {} and none.best_model_path == ""

    recent = ModelCheckpoint(tmp_path / "recent", save_top_k=2)  # no monitor: the k most recent
    fit(5, recent)
    assert dirs(tmp_path / "recent") == {name(3), name(4)}
    assert recent.best_model_path == str(tmp_path / "recent" / name(4))
    assert recent.best_model_score is None


def test_every_n_train_steps(tmp_path: Path) -> None:
    fit(2, ModelCheckpoint(tmp_path, every_n_train_steps=7, save_top_k=-1))
    assert dirs(tmp_path) == {"epoch=0-step=7", "epoch=1-step=14"}  # no epoch-end save besides the step trigger


def test_every_n_epochs(tmp_path: Path) -> None:
    fit(5, ModelCheckpoint(tmp_path, every_n_epochs=2, save_top_k=-1))
    assert dirs(tmp_path) == {name(1), name(3)}


def test_train_time_interval(tmp_path: Path) -> None:
    saver = ModelCheckpoint(tmp_path, train_time_interval=0.05, save_top_k=-1)
    fit(1, saver, module=Net(sleep_s=0.02))
    saved = dirs(tmp_path)
    assert len(saved) >= 1
    assert all(d.startswith("epoch=0-step=") for d in saved)
    # 9 steps sleep >= 180 ms > 50 ms, so the time trigger fired before the epoch's last step (no epoch-end
    # save exists with a time trigger alone, so a mid-epoch directory can only come from it)
    assert any(int(d.split("step=")[1]) < STEPS_PER_EPOCH for d in saved), saved
    for directory in saved:
        ckpt.check_complete(tmp_path / directory)


def test_last_always_names_the_newest(tmp_path: Path) -> None:
    record = Recorder(tmp_path)
    saver = ModelCheckpoint(tmp_path, monitor="val/acc", mode="max", save_top_k=1)  # newest is rarely the best
    fit(5, saver, record)
    # Up to FINISHES_IN_FLIGHT of the newest saves may still be finishing on background threads when an epoch
    # starts (their fsyncs, the rename into place, then `last`, one save after another): `last` may not exist yet
    # at the first epochs' starts, and may name a save up to that many epochs behind, never a newer one than the
    # newest complete checkpoint.
    limit = manager.FINISHES_IN_FLIGHT
    assert len(record.last_at_start) in range(4 - limit, 5)
    for epoch, named, newest in record.last_at_start:
        assert named in {name(epoch - 1 - behind) for behind in range(limit + 1)}, (epoch, named, newest)
        assert int(named.split("step=")[1]) <= int(newest.split("step=")[1]), (epoch, named, newest)
    assert (tmp_path / "last").read_text().strip() == name(4) == newest_on_disk(tmp_path)
    assert saver.last_model_path == str(tmp_path / name(4))
    assert ckpt.newest_valid(tmp_path) == tmp_path / name(4)


def test_save_weights_only(tmp_path: Path) -> None:
    module = Net()
    fit(2, ModelCheckpoint(tmp_path, save_weights_only=True), module=module)
    path = tmp_path / name(1)
    meta = ckpt.read_meta(path)
    assert meta["weights_only"] is True
    assert set(meta["tensor_skeleton"]) == {"module"}
    assert "optimizers" not in meta["state"] and "progress" not in meta["state"]
    assert all(key.startswith("/module/") for key in ckpt.read_metadata(path).state_dict_metadata)
    loaded = Net.load_from_checkpoint(path)
    for key, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_state_dict_round_trip_and_resume_continues_top_k(tmp_path: Path) -> None:
    def saver(directory: Path) -> ModelCheckpoint:
        return ModelCheckpoint(directory, monitor="val/acc", mode="max", save_top_k=2)

    whole = saver(tmp_path / "whole")
    fit(5, whole)

    first = saver(tmp_path / "resumed")
    fit(3, first)
    state = first.state_dict()
    copy = saver(tmp_path / "resumed")
    copy.load_state_dict(state)
    assert copy.state_dict() == state

    second = saver(tmp_path / "resumed")
    trainer = fit(5, second, ckpt_path="last")
    assert trainer.global_step == 5 * STEPS_PER_EPOCH

    def relative(paths: Any) -> Any:
        return {Path(p).name: s for p, s in paths.items()}

    assert relative(second.kept) == relative(whole.kept)
    assert Path(second.best_model_path).name == Path(whole.best_model_path).name == name(3)
    assert second.best_model_score == whole.best_model_score == pytest.approx(0.9)
    assert dirs(tmp_path / "resumed") == dirs(tmp_path / "whole")


def test_monitor_or_field_not_logged_names_the_metric(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="val/missing"):
        fit(1, ModelCheckpoint(tmp_path / "a", monitor="val/missing"))
    with pytest.raises(KeyError, match="val/nope"):
        fit(1, ModelCheckpoint(tmp_path / "b", filename="{epoch}-{val/nope:.2f}"))


def test_ckpt_path_best_in_validate_and_test(tmp_path: Path) -> None:
    module = Net()
    saver = ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=2)  # default dirpath: the run directory
    trainer = Trainer(
        max_epochs=5, num_sanity_val_steps=0, callbacks=[saver], default_root_dir=tmp_path / "runs", **QUIET
    )
    trainer.fit(module, train_loader(), val_loader())
    best = Path(saver.best_model_path)
    assert best.name == name(3)
    _, best_weights = ckpt.read_module_state(best)
    assert not torch.equal(best_weights["layer.weight"], module.layer.weight)  # trained on after the best

    def holds_best(m: Net) -> bool:
        return all(torch.equal(m.state_dict()[k], v) for k, v in best_weights.items())

    evaluated = Net()
    trainer.validate(evaluated, val_loader(), ckpt_path="best")
    assert holds_best(evaluated)
    tested = Net()
    trainer.test(tested, val_loader(), ckpt_path="best")
    assert holds_best(tested)

    # A new trainer (no ModelCheckpoint of its own) finds "best" through the run's last checkpoint.
    fresh = Trainer(default_root_dir=tmp_path / "runs", **QUIET)
    other = Net()
    fresh.test(other, val_loader(), ckpt_path="best")
    assert holds_best(other)

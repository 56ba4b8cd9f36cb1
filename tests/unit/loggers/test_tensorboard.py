"""TensorBoardLogger: event files read back with TensorBoard's own reader."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from ember.loggers import TensorBoardLogger
from ember.loggers.tensorboard import flatten_params


def read(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_scalars_read_back_with_their_steps(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"train/loss": 0.5, "epoch": 0.0}, step=1)
    logger.log_metrics({"train/loss": 0.25, "val/acc": 0.75, "epoch": 0.0}, step=2)
    logger.save()
    acc = read(tmp_path)
    assert set(acc.Tags()["scalars"]) == {"train/loss", "val/acc", "epoch"}
    assert scalars(acc, "train/loss") == [(1, 0.5), (2, 0.25)]
    assert scalars(acc, "val/acc") == [(2, 0.75)]
    logger.finalize("success")


def test_scalars_are_queued_until_a_save_or_until_flush_secs_have_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr("ember.loggers.tensorboard.time.monotonic", lambda: clock[0])
    logger = TensorBoardLogger(tmp_path, flush_secs=30.0)
    logger.log_metrics({"train/loss": 0.5}, step=1)
    assert not list(tmp_path.glob("events.out.tfevents.*"))  # queued: TensorBoard not even opened yet
    clock[0] += 29.0
    logger.log_metrics({"train/loss": 0.25}, step=2)
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    clock[0] += 1.0  # 30 s after the logger was made: this call hands the queue to TensorBoard
    logger.log_metrics({"train/loss": 0.125}, step=3)
    logger.experiment.flush()
    assert scalars(read(tmp_path), "train/loss") == [(1, 0.5), (2, 0.25), (3, 0.125)]
    logger.log_metrics({"train/loss": 0.0625}, step=4)  # the next batch waits for another 30 s or a save
    logger.experiment.flush()
    assert len(scalars(read(tmp_path), "train/loss")) == 3
    logger.save()
    assert [step for step, _ in scalars(read(tmp_path), "train/loss")] == [1, 2, 3, 4]
    logger.finalize("success")


def test_a_full_queue_is_written_without_waiting_for_flush_secs(tmp_path: Path) -> None:
    from ember.loggers.tensorboard import MAX_QUEUED

    logger = TensorBoardLogger(tmp_path, flush_secs=3600.0)
    for step in range(1, MAX_QUEUED):
        logger.log_metrics({"a": float(step)}, step=step)
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    logger.log_metrics({"a": float(MAX_QUEUED)}, step=MAX_QUEUED)  # the queue is full: written now
    logger.experiment.flush()
    assert len(scalars(read(tmp_path), "a")) == MAX_QUEUED
    logger.finalize("success")


def test_queued_scalars_keep_the_wall_time_of_their_logging_call(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    before = time.time()
    logger.log_metrics({"a": 1.0}, step=1)
    after = time.time()
    time.sleep(0.05)
    logger.finalize("success")
    (event,) = read(tmp_path).Scalars("a")
    assert before <= event.wall_time <= after


def test_a_resume_drops_queued_scalars_past_the_checkpoint(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    for step in (1, 2, 3, 4):
        logger.log_metrics({"a": float(step)}, step=step)
    logger.load_state_dict({"step": 2})  # resuming from a checkpoint taken at step 2
    logger.log_metrics({"a": 30.0}, step=3)
    logger.finalize("success")
    assert scalars(read(tmp_path), "a") == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_attached_logger_writes_into_run_dir_tensorboard(tmp_path: Path) -> None:
    logger = TensorBoardLogger()
    logger.attach(tmp_path / "run" / "version_0")
    assert logger.log_dir == tmp_path / "run" / "version_0" / "tensorboard"
    assert not logger.log_dir.exists()  # nothing is created before the first write
    logger.log_metrics({"a": 1.0}, step=1)
    logger.finalize("success")
    assert list(logger.log_dir.glob("events.out.tfevents.*"))
    explicit = TensorBoardLogger(tmp_path / "mine")
    explicit.attach(tmp_path / "ignored")
    assert explicit.log_dir == tmp_path / "mine"


def test_hparams_are_written_at_the_end_with_the_final_metrics_and_without_secrets(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1, "model": {"hidden": 32, "layers": [1, 2]}, "wandb_api_key": "secret"})
    logger.log_metrics({"train/loss": 1.0, "epoch": 0.0}, step=1)
    logger.log_metrics({"val/acc": 0.9, "epoch": 0.0}, step=1)
    logger.finalize("success")
    content = read(tmp_path).PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = {k: getattr(v, v.WhichOneof("kind")) for k, v in session.session_start_info.hparams.items()}
    assert hparams == {"lr": 0.1, "model/hidden": 32.0, "model/layers": "[1, 2]"}
    assert sorted(m.name.tag for m in experiment.metric_infos) == ["train/loss", "val/acc"]


def test_histograms(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    values = torch.tensor([1.0, 2.0, 2.0, 5.0])
    logger.log_histograms({"weights/w": values}, step=3)
    logger.finalize("success")
    (event,) = read(tmp_path).Histograms("weights/w")
    assert (event.step, event.histogram_value.num, event.histogram_value.sum) == (3, 4, 10.0)
    assert (event.histogram_value.min, event.histogram_value.max) == (1.0, 5.0)


def test_resume_purges_events_after_the_checkpoint_step(tmp_path: Path) -> None:
    first = TensorBoardLogger(tmp_path)
    for step in range(1, 6):
        first.log_metrics({"a": float(step)}, step=step)
    first.finalize("failed")
    # A resumed run is a later process: its event file's name (seconds since the epoch, then a per-process
    # counter that sorts as text, so ".10" < ".9") must sort after the first one's, as TensorBoard reads them.
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.02)
    resumed = TensorBoardLogger(tmp_path)
    resumed.load_state_dict({"step": 3})
    resumed.log_metrics({"a": 40.0}, step=4)
    resumed.finalize("success")
    assert scalars(read(tmp_path), "a") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_flatten_params() -> None:
    assert flatten_params({"a": {"b": 1, "c": {"d": None}}, "e": (1, 2), "f": True}) == {
        "a/b": 1,
        "a/c/d": "None",
        "e": "(1, 2)",
        "f": True,
    }
    with pytest.raises(ValueError, match="log_histograms_every_n_steps"):
        TensorBoardLogger(log_histograms_every_n_steps=0)

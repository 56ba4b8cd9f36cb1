"""TensorBoardLogger: event files read back with TensorBoard's own reader."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
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
    assert not list(tmp_path.glob("events.out.tfevents.*"))  # queued: no event file opened yet
    clock[0] += 29.0
    logger.log_metrics({"train/loss": 0.25}, step=2)
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    clock[0] += 1.0  # 30 s after the logger was made: this call hands the queue to TensorBoard
    logger.log_metrics({"train/loss": 0.125}, step=3)
    assert scalars(read(tmp_path), "train/loss") == [(1, 0.5), (2, 0.25), (3, 0.125)]
    logger.log_metrics({"train/loss": 0.0625}, step=4)  # the next batch waits for another 30 s or a save
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
    logger.load_state_dict({"step": 3})  # a checkpoint after optimizer step 3 covers rows 0-2 (step N's row: N - 1)
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
    resumed.load_state_dict({"step": 4})  # covers the rows before step 4
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


# --- ember's own event file, against TensorBoard's writer ----------------------------------------------


def records(path: Path) -> list[bytes]:
    """The serialized events of a TensorBoard event file, with both checksums of each record verified."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        header = data[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8 : at + 12])[0] == masked_crc32c(header)
        event = data[at + 12 : at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length : at + 16 + length])[0] == masked_crc32c(event)
        out.append(event)
        at += 16 + length
    return out


def test_masked_crc32c_equals_tensorboards() -> None:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    from ember.loggers.tensorboard import masked_crc32c

    for data in (b"", b"a", b"123456789", bytes(range(256)) * 3, struct.pack("<Q", 1234567)):
        assert masked_crc32c(data) == reference(data)


def test_event_file_writes_the_bytes_summary_writer_writes(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from ember.loggers.tensorboard import EventFile, hparams_summaries

    metrics = {"train/loss": 0.125, "val/acc": 0.875, "epoch": 2.0}
    params = {"lr": 0.1, "layers": 3, "name": "mlp", "bn": True}
    writer = SummaryWriter(str(tmp_path / "torch"))
    for name, value in metrics.items():
        writer.add_scalar(name, value, 7, walltime=1234.5)
    for summary in hparams_summaries(params, ["train/loss", "val/acc"]):
        writer.file_writer.add_summary(summary, 0, 99.0)
    writer.close()
    mine = EventFile(tmp_path / "ember")
    mine.add_scalars(metrics, 7, 1234.5)
    for summary in hparams_summaries(params, ["train/loss", "val/acc"]):
        mine.add_summary(summary, 0, 99.0)
    mine.close()
    (theirs_file,) = (tmp_path / "torch").iterdir()
    theirs, ours = records(theirs_file), records(mine.path)
    assert len(theirs) == len(ours) == 1 + 3 + 3
    assert ours[1:] == theirs[1:]  # the first event holds the file's creation time


def test_hparams_summaries_equal_torch_hparams() -> None:
    from torch.utils.tensorboard.summary import hparams

    from ember.loggers.tensorboard import hparams_summaries

    params = {"lr": 3e-4, "hidden": 128, "optimizer": "adamw", "amp": False, "skipped": None}
    metrics = ["train/loss", "val/loss"]
    expected = hparams(params, dict.fromkeys(metrics, 0.0))
    assert [s.SerializeToString() for s in hparams_summaries(params, metrics)] == [
        s.SerializeToString() for s in expected
    ]


def test_histograms_and_scalars_share_one_file_and_a_resume_purges_both(tmp_path: Path) -> None:
    first = TensorBoardLogger(tmp_path, log_histograms_every_n_steps=1)
    for step in range(1, 6):
        first.log_metrics({"a": float(step)}, step=step)
        first.log_histograms({"w": torch.full((3,), float(step))}, step=step)
    first.finalize("failed")
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    resumed = TensorBoardLogger(tmp_path, log_histograms_every_n_steps=1)  # in the same second, same process
    resumed.load_state_dict({"step": 4})  # covers the rows before step 4
    resumed.log_metrics({"a": 40.0}, step=4)
    resumed.log_histograms({"w": torch.full((3,), 40.0)}, step=4)
    resumed.finalize("success")
    acc = read(tmp_path)
    assert scalars(acc, "a") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert [(e.step, e.histogram_value.sum) for e in acc.Histograms("w")] == [(1, 3.0), (2, 6.0), (3, 9.0), (4, 120.0)]


@pytest.mark.parametrize("change", ["clock stepped back", "host renamed"])
def test_a_resumed_file_is_read_after_the_earlier_one_whatever_the_clock_or_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """TensorBoard reads a directory's files in name order; the purge only works if the resumed run's file
    comes after the one it purges, also when the clock went back or the host name sorts lower."""
    first = TensorBoardLogger(tmp_path)
    for step in range(1, 6):
        first.log_metrics({"a": float(step)}, step=step)
    first.finalize("failed")
    if change == "clock stepped back":
        earlier = time.time() - 3600.0
        monkeypatch.setattr("ember.loggers.tensorboard.time.time", lambda: earlier)
    else:
        monkeypatch.setattr("ember.loggers.tensorboard.socket.gethostname", lambda: "0")
    resumed = TensorBoardLogger(tmp_path)
    resumed.load_state_dict({"step": 3})  # covers the rows before step 3
    resumed.log_metrics({"a": 30.0}, step=3)
    resumed.finalize("success")
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert scalars(read(tmp_path), "a") == [(1, 1.0), (2, 2.0), (3, 30.0)]


@pytest.mark.parametrize("writes", ["scalars", "histograms", "experiment"])
def test_resumes_in_one_second_purge_right_however_many_writers_the_process_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes: str
) -> None:
    """TensorBoard reads a folder's files in name order. TensorBoard's own writer numbers its files with a
    per-process counter that sorts as text (the 10th file before the 9th): a resumed run's file could be read
    before the one it purges, whichever way the logger writes (its own scalars, histograms, `experiment`)."""
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(8))
    now = time.time()
    monkeypatch.setattr("time.time", lambda: now)  # every file made in the same second
    for run in range(4):  # each run resumes with the rows before step `run + 1` and logs two more steps
        logger = TensorBoardLogger(tmp_path, log_histograms_every_n_steps=1 if writes == "histograms" else None)
        if run:
            logger.load_state_dict({"step": run + 1})  # optimizer step N's row is N - 1
        for step in (run + 1, run + 2):
            value = float(10 * run + step)
            if writes == "experiment":
                logger.experiment.add_scalar("a", value, step)
            else:
                logger.log_metrics({"a": value}, step=step)
            if writes == "histograms":
                logger.log_histograms({"w": torch.full((2,), value)}, step=step)
        logger.finalize("failed")
    acc = read(tmp_path)
    expected = [(1, 1.0), (2, 12.0), (3, 23.0), (4, 34.0), (5, 35.0)]
    assert scalars(acc, "a") == expected
    if writes == "histograms":
        assert [(e.step, e.histogram_value.sum) for e in acc.Histograms("w")] == [(s, 2 * v) for s, v in expected]


def test_experiment_taken_mid_run_writes_into_the_loggers_file(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"a": 1.0}, step=1)
    logger.save()  # the logger's file holds step 1
    logger.experiment.add_scalar("custom", 5.0, 2)
    logger.log_metrics({"a": 2.0}, step=2)
    logger.finalize("success")
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    acc = read(tmp_path)
    assert scalars(acc, "a") == [(1, 1.0), (2, 2.0)]
    assert scalars(acc, "custom") == [(2, 5.0)]


@pytest.mark.slow  # 4 s of CPU on a 2-core machine, with the processes it starts
def test_a_fit_with_the_default_loggers_does_not_import_tensorboards_writer(tmp_path: Path) -> None:
    code = """
import sys, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import ember
class Tiny(ember.TrainingModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.model, self.loss_fn = nn.Linear(4, 2), nn.CrossEntropyLoss()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
trainer = ember.Trainer(max_epochs=2, enable_progress_bar=False, default_root_dir=sys.argv[1])
trainer.fit(Tiny(), data, data)
heavy = [m for m in ("torch.utils.tensorboard", "tensorboard.compat.tensorflow_stub") if m in sys.modules]
print(heavy, trainer.run_dir)
"""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    heavy, run_dir = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert heavy == "[]"
    acc = read(Path(run_dir) / "tensorboard")
    assert [step for step, _ in scalars(acc, "val/loss")] == [3, 7]  # after steps 4 and 8: their rows
    assert set(acc.PluginTagToContent("hparams")) == {
        "_hparams_/experiment",
        "_hparams_/session_start_info",
        "_hparams_/session_end_info",
    }

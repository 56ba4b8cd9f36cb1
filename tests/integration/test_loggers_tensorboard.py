"""A real fit with the default loggers: TensorBoard's reader and a real TensorBoard server show the CSV's values."""

from __future__ import annotations

import contextlib
import csv
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import LearningRateMonitor
from ember.loggers import CSVLogger, TensorBoardLogger


class Classifier(ember.TrainingModule):
    def __init__(self, lr: float = 0.2, hidden: int = 16, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters("lr", "hidden")
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        self.loss_fn = nn.CrossEntropyLoss()
        self.fail_at_step = fail_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise KeyboardInterrupt  # the run is killed here
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
    return DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8), DataLoader(
        TensorDataset(x[64:], y[64:]), batch_size=8
    )


def csv_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric's (step, value) from metrics.csv, rounded to float32 as TensorBoard stores scalars."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if name != "step" and value != "":
                series.setdefault(name, []).append((int(row["step"]), float(np.float32(value))))
    return series


def tb_series(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def fit(root: Path, **kw: Any) -> ember.Trainer:
    trainer = ember.Trainer(
        max_epochs=2,
        log_every_n_steps=3,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[LearningRateMonitor()],
        **kw,
    )
    trainer.fit(Classifier(), *loaders())
    return trainer


def test_default_loggers_write_tensorboard_events_equal_to_the_csv_rows(tmp_path: Path) -> None:
    trainer = fit(tmp_path / "runs")
    assert [type(logger) for logger in trainer.loggers] == [TensorBoardLogger, CSVLogger]
    run_dir = trainer.run_dir
    assert run_dir == tmp_path / "runs" / "classifier" / "version_0"
    events, rows = tb_series(run_dir / "tensorboard"), csv_series(run_dir)
    assert set(events) == {"train/loss", "val/loss", "lr-SGD", "epoch"}
    assert events == rows
    # 8 steps per epoch, logged every 3; validation at each epoch end; the epoch scheduler's lr per epoch
    # (Lightning's axis: optimizer step N's row is step N - 1)
    assert [step for step, _ in events["train/loss"]] == [2, 5, 8, 11, 14]
    assert [step for step, _ in events["val/loss"]] == [7, 15]
    assert events["lr-SGD"] == [(7, np.float32(0.2)), (15, np.float32(0.1))]
    assert events["val/loss"][-1][1] == np.float32(trainer.callback_metrics["val/loss"])
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert set(acc.PluginTagToContent("hparams")) == {
        "_hparams_/experiment",
        "_hparams_/session_start_info",
        "_hparams_/session_end_info",
    }


def test_a_killed_and_resumed_run_reads_as_one_uninterrupted_curve(tmp_path: Path) -> None:
    common: dict[str, Any] = dict(
        max_epochs=2,
        log_every_n_steps=2,
        default_root_dir=tmp_path / "runs",
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    killed = ember.Trainer(**common)
    with pytest.raises(KeyboardInterrupt):
        killed.fit(Classifier(fail_at_step=13), *loaders())  # after the epoch-1 checkpoint (step 8), at step 13
    resumed = ember.Trainer(**common)
    resumed.fit(Classifier(), *loaders(), ckpt_path="last")
    assert resumed.run_dir == killed.run_dir and resumed.global_step == 16
    straight = ember.Trainer(**{**common, "default_root_dir": tmp_path / "straight"})
    straight.fit(Classifier(), *loaders())

    events = tb_series(resumed.run_dir / "tensorboard")
    assert [step for step, _ in events["train/loss"]] == [1, 3, 5, 7, 9, 11, 13, 15]  # 9 and 11 once, not twice
    assert events == csv_series(resumed.run_dir)
    assert events == tb_series(straight.run_dir / "tensorboard")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_a_tensorboard_server_serves_the_same_scalars(tmp_path: Path) -> None:
    trainer = fit(tmp_path / "runs")
    expected = tb_series(trainer.run_dir / "tensorboard")
    port, server_log = free_port(), tmp_path / "tensorboard.log"
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "runs"), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--load_fast", "false", "--reload_interval", "1"]
    base, run = f"http://127.0.0.1:{port}", "classifier/version_0/tensorboard"
    with server_log.open("w") as log:  # a file, not a pipe: the server never blocks on a full pipe
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline, tags = time.monotonic() + 60, {}
            while time.monotonic() < deadline:
                assert server.poll() is None, server_log.read_text()
                with contextlib.suppress(urllib.error.URLError, ConnectionError):  # not listening yet
                    tags = get_json(f"{base}/data/plugin/scalars/tags")
                if set(tags.get(run, {})) >= set(expected):
                    break
                time.sleep(0.25)
            assert set(tags.get(run, {})) == set(expected), tags
            for tag, series in expected.items():
                query = urllib.parse.urlencode({"run": run, "tag": tag})
                served = get_json(f"{base}/data/plugin/scalars/scalars?{query}")  # [[wall_time, step, value], ...]
                assert [(step, value) for _, step, value in served] == series, tag
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)

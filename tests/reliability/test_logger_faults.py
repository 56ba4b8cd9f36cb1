"""Logger faults never stop training (docs/monitoring.md, "When a logger fails"): a tracking server killed
mid-run, an unreachable tracking URI, TensorBoard on a read-only disk and CSV on a full one. Each run must finish
in about the time of a run without the fault, say in one line that a logger is failing, and end with a summary
naming what did not reach the logger and the command that sends it; every value ends up on the server (replayed)
or in the run directory."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.loggers import CSVLogger, Logger, MLflowLogger, TensorBoardLogger, unsent
from ember.loggers import guard as guard_module
from ember.loggers.mlflow import mlflow_key

EPOCHS = 6


class Regressor(ember.TrainingModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)


class Recorder(Logger):
    """The ground truth: every ``log_metrics`` call the trainer made, as (name, step, value)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: set[tuple[str, int, float]] = set()
        self.calls = 0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls += 1
        self.values.update((name, step, float(v)) for name, v in metrics.items())


class Pace(ember.Callback):
    """Each epoch takes at least `epoch_s` (sleeping, not computing), so run times compare; `at_epoch` maps an
    epoch to an action (kill or restart the server) whose own time is counted apart in `spent_s`."""

    def __init__(self, epoch_s: float, at_epoch: dict[int, Any] | None = None) -> None:
        self.epoch_s, self.at_epoch, self.spent_s = epoch_s, at_epoch or {}, 0.0
        self.first_batch_at: float | None = None

    def on_train_batch_start(self, trainer: ember.Trainer, module: ember.TrainingModule, batch: Any, i: int) -> None:
        if self.first_batch_at is None:
            self.first_batch_at = time.monotonic()

    def on_train_epoch_end(self, trainer: ember.Trainer, module: ember.TrainingModule) -> None:
        time.sleep(self.epoch_s)
        action = self.at_epoch.get(trainer.current_epoch)
        if action is not None:
            start = time.monotonic()
            action()
            self.spent_s += time.monotonic() - start


def fit(root: Path, loggers: list[Logger], pace: Pace, **kwargs: Any) -> tuple[ember.Trainer, float]:
    trainer = ember.Trainer(
        max_epochs=EPOCHS, default_root_dir=str(root), run_name="faults", logger=loggers, callbacks=[pace],
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        **kwargs,
    )  # fmt: skip
    start = time.monotonic()
    trainer.fit(Regressor(), loader())
    return trainer, time.monotonic() - start


@pytest.fixture
def quick_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow gives up on a dead server at once (not after its default of minutes of retries), so no call of an
    abandoned logger thread outlives the test; failing loggers are retried every half second."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(guard_module, "RETRY_EVERY_S", 0.5)


# --- a real MLflow server, stopped and started again ------------------------------------------------------------
class Server:
    """``mlflow server`` on a fixed 127.0.0.1 port with an SQLite store that outlives restarts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}",
               "--artifacts-destination", str(self.root / "artifacts"), "--workers", "1"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        # No job runner: its three consumer processes (each importing mlflow) serve nothing ember uses, took 2 s of
        # the start here, and leave a folder in /dev/shm behind.
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        log = open(self.root / "server.log", "ab")  # noqa: SIM115  (the child keeps it)
        self.proc = subprocess.Popen(cmd, cwd=self.root, stdout=log, stderr=log, start_new_session=True, env=env)
        log.close()
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):  # answering API calls, not only /health (the first one is slow)
                query = "api/2.0/mlflow/experiments/search?max_results=1"
                with urllib.request.urlopen(f"{self.url}/{query}", timeout=10) as answer:
                    if answer.status == 200:
                        return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.root / "server.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"mlflow server did not come up (exit {self.proc.poll()}):\n{tail}")
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    (tmp_path / "server").mkdir()
    srv = Server(tmp_path / "server")
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


def on_server(url: str, experiment: str) -> set[tuple[str, int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment} is not on the server"
    (run,) = client.search_runs([exp.experiment_id])
    return {
        (name, m.step, m.value) for name in run.data.metrics for m in client.get_metric_history(run.info.run_id, name)
    }


def as_mlflow(values: set[tuple[str, int, float]]) -> set[tuple[str, int, float]]:
    return {(mlflow_key(name), step, value) for name, step, value in values}


@pytest.mark.slow  # three mlflow server starts (about 5 s each here) and four short fits
@pytest.mark.waits  # for the servers and the paced epochs
def test_a_tracking_server_killed_mid_run_costs_no_time_and_loses_no_metric(
    tmp_path: Path, server: Server, quick_mlflow: None, capfd: pytest.CaptureFixture[str]
) -> None:
    timeout = {"logger_timeout_s": 1.0}
    warm = Recorder()  # the first run of a process pays for imports: not part of the comparison
    fit(tmp_path / "warm", [MLflowLogger("warm", tracking_uri=server.url), warm], Pace(0.0), **timeout)

    clean = Recorder()
    _, clean_s = fit(tmp_path / "clean", [MLflowLogger("clean", tracking_uri=server.url), clean], Pace(0.4), **timeout)
    assert as_mlflow(clean.values) == on_server(server.url, "clean")

    # killed after epoch 1, back (and answering) after epoch 2: the values between are replayed during the run
    back = Recorder()
    pace = Pace(0.4, {1: server.kill, 2: server.start})
    trainer, back_s = fit(tmp_path / "back", [MLflowLogger("back", tracking_uri=server.url), back], pace, **timeout)
    err = capfd.readouterr().err
    assert back_s - pace.spent_s < 3 * clean_s, (back_s, pace.spent_s, clean_s)
    assert err.count("MLflowLogger is failing") == 1, err
    assert "everything else was sent once it answered again" in err, err
    assert as_mlflow(back.values) == on_server(server.url, "back")
    assert not (trainer.run_dir / "unsent").exists() or not list((trainer.run_dir / "unsent").iterdir())

    # killed after epoch 1 and still down at the end: the values are in the run directory, with the command
    down = Recorder()
    pace = Pace(0.4, {1: server.kill})
    trainer, down_s = fit(tmp_path / "down", [MLflowLogger("down", tracking_uri=server.url), down], pace, **timeout)
    err = capfd.readouterr().err
    assert down_s - pace.spent_s < 3 * clean_s, (down_s, pace.spent_s, clean_s)
    summary = [line for line in err.splitlines() if "did not receive" in line]
    assert len(summary) == 1 and "the run's end" in summary[0], err
    command = summary[0].split("send them with: ", 1)[1]
    path = Path(shlex.split(command)[-1])
    assert path.parent == trainer.run_dir / "unsent" and path.is_file()
    server.start()
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert as_mlflow(down.values) == on_server(server.url, "down")


@pytest.mark.waits  # for the calls that hang
def test_an_unreachable_tracking_uri_never_delays_training(
    tmp_path: Path, quick_mlflow: None, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")  # each call hangs about 6 s: past the bound
    fit(tmp_path / "clean", [Recorder()], Pace(0.0))  # the process's first fit pays for imports

    recorder, pace = Recorder(), Pace(0.0)
    logger = MLflowLogger("nowhere", tracking_uri="http://127.0.0.1:9")
    begin = time.monotonic()
    trainer, _ = fit(tmp_path / "run", [logger, recorder], pace, logger_timeout_s=0.5)
    assert pace.first_batch_at is not None
    assert pace.first_batch_at - begin < 0.5 * guard_module.STARTUP_FACTOR  # training did not wait for the logger
    assert trainer.global_step == EPOCHS * 4
    err = capfd.readouterr().err
    assert err.count("MLflowLogger is failing") == 1, err
    (summary,) = [line for line in err.splitlines() if "did not receive" in line]
    assert f"{recorder.calls} metric rows (steps 0-{EPOCHS * 4 - 1})" in summary  # Lightning's axis
    assert "the hyperparameters" in summary and "python -m ember.loggers.replay" in summary, summary
    head, lines = unsent.read(trainer.run_dir / "unsent" / "0-MLflowLogger.jsonl")
    assert head["kwargs"]["tracking_uri"] == "http://127.0.0.1:9"
    kept = {(n, line["step"], v) for line in lines if line["call"] == "log_metrics" for n, v in line["metrics"].items()}
    assert kept == recorder.values
    calls = [line["call"] for line in lines if line["call"] != "log_metrics"]
    assert calls == ["log_hyperparams", *["after_save_checkpoint"] * EPOCHS, "finalize"]
    assert [line["params"] for line in lines if line["call"] == "log_hyperparams"] == [{"lr": 0.05}]


# --- TensorBoard on a read-only disk, CSV on a full one -----------------------------------------------------------
@pytest.fixture
def disks(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A read-only tmpfs and a full one (mounting needs root on Linux, as in CI)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux; tests/unit/loggers/test_guard.py injects the same faults")
    readonly, full = tmp_path / "readonly", tmp_path / "full"
    mounted = []
    for folder, options in ((readonly, "ro,size=1m"), (full, "size=64k")):
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            for m in mounted:
                subprocess.run(["umount", "-l", str(m)], check=False)
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
        mounted.append(folder)
    with contextlib.suppress(OSError), open(full / "filler", "wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()
    try:
        yield readonly, full
    finally:
        for m in mounted:
            subprocess.run(["umount", "-l", str(m)], check=False)


def test_tensorboard_on_a_read_only_disk_and_csv_on_a_full_one_never_stop_training(
    tmp_path: Path, disks: tuple[Path, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    readonly, full = disks
    recorder = Recorder()
    loggers = [TensorBoardLogger(save_dir=readonly / "tb"), CSVLogger(save_dir=full / "csv"), recorder]
    trainer, _ = fit(tmp_path, loggers, Pace(0.0), logger_timeout_s=1.0)
    assert trainer.global_step == EPOCHS * 4
    err = capfd.readouterr().err
    assert err.count("TensorBoardLogger is failing") == 1 and err.count("CSVLogger is failing") == 1, err
    summary = [line for line in err.splitlines() if "did not receive" in line]
    assert len(summary) == 2, err
    for index, name in ((0, "TensorBoardLogger"), (1, "CSVLogger")):
        path = trainer.run_dir / "unsent" / f"{index}-{name}.jsonl"
        assert any(str(path) in line and name in line for line in summary), summary
        _, lines = unsent.read(path)
        kept = {(n, ln["step"], v) for ln in lines if ln["call"] == "log_metrics" for n, v in ln["metrics"].items()}
        assert kept == recorder.values

    # space freed: the one-line command writes every row to metrics.csv
    (full / "filler").unlink()
    assert unsent.replay(trainer.run_dir / "unsent" / "1-CSVLogger.jsonl") > 0
    import csv

    with open(full / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    written = {(k, int(r["step"]), float(v)) for r in rows for k, v in r.items() if k != "step" and v != ""}
    assert written == recorder.values


def test_a_wandb_backend_that_raises_mid_run_gets_every_row_once_when_it_answers_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("wandb", reason="WandbLogger needs wandb")
    from ember.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(guard_module, "RETRY_EVERY_S", 0.05)
    logger, recorder = WandbLogger(project="faults"), Recorder()
    delivered: list[dict[str, Any]] = []
    broken = {"now": False}

    def break_backend() -> None:  # the fault is in the backend object: the wandb run's own log raises
        run = logger.experiment
        original = run.log

        def log(row: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            if broken["now"]:
                raise ConnectionError("wandb backend unavailable")
            delivered.append(dict(row))
            original(row, *args, **kwargs)

        monkeypatch.setattr(run, "log", log)
        broken["now"] = True

    def heal() -> None:
        broken["now"] = False
        time.sleep(0.5)  # a few retries: the kept rows go out while training goes on

    trainer, _ = fit(tmp_path, [logger, recorder], Pace(0.0, {0: break_backend, 2: heal}), logger_timeout_s=2.0)
    assert trainer.global_step == EPOCHS * 4
    err = capfd.readouterr().err
    assert err.count("WandbLogger is failing (ConnectionError: wandb backend unavailable)") == 1, err
    assert "everything else was sent once it answered again" in err
    rows = {(k, int(row["trainer/global_step"]), float(v)) for row in delivered for k, v in row.items()}
    after_break = {v for v in recorder.values if v[1] > 3}  # what was logged once the backend broke (epoch 0 end)
    assert after_break <= {r for r in rows if r[0] != "trainer/global_step"}
    steps = [int(row["trainer/global_step"]) for row in delivered if "train/loss" in row]
    assert len(steps) == len(set(steps))  # each row once: W&B writes each call at once, nothing is sent twice

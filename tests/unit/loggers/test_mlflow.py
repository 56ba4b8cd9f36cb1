"""MLflowLogger: a local SQLite store in the run directory, everything read back with ``MlflowClient``, a resumed
fit that continues the same MLflow run, and a live ``mlflow server`` on 127.0.0.1 reached over HTTP."""

from __future__ import annotations

import contextlib
import os
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
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelCheckpoint
from ember.loggers import MLflowLogger
from ember.loggers.mlflow import MAX_PARAM_LENGTH, chunks, flatten, mlflow_key, param_value

mlflow = pytest.importorskip("mlflow", reason="MLflowLogger needs mlflow: pip install 'ember[mlflow]'")
from mlflow.tracking import MlflowClient  # noqa: E402

EPOCH_STEPS = 4  # 16 training rows in batches of 4


class Regressor(ember.TrainingModule):
    def __init__(self, lr: float = 0.05, hidden: int = 8, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters("lr", "hidden")
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.loss_fn = nn.MSELoss()
        self.fail_at_step = fail_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)
    train = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=4, shuffle=True, generator=torch.Generator())
    return train, DataLoader(TensorDataset(x[16:], y[16:]), batch_size=8)


def trainer(root: Path, max_epochs: int, logger: MLflowLogger, **kwargs: Any) -> ember.Trainer:
    return ember.Trainer(
        max_epochs=max_epochs,
        default_root_dir=root,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def local_client(run_dir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")


def read_artifact(client: MlflowClient, run_id: str, path: str, dst: Path) -> str:
    return Path(client.download_artifacts(run_id, path, str(dst))).read_text(encoding="utf-8")


# --- helpers ---------------------------------------------------------------------------------------------


def test_keys_are_made_valid_for_mlflow() -> None:
    assert mlflow_key("val/acc") == "val/acc"
    assert mlflow_key("val/loss/dataloader_idx_1") == "val/loss/dataloader_idx_1"
    assert mlflow_key("lr-AdamW[0]") == "lr-AdamW_0_"
    assert mlflow_key("/a//b/") == "a/b"
    assert mlflow_key("../x") == "_/x"
    assert mlflow_key("") == "_"
    assert len(mlflow_key("k" * 400)) == 250
    from mlflow.utils.validation import _validate_metric_name

    for name in ("lr-AdamW[0]", "/a//b/", "../x", "é/ü", "a b:c"):
        _validate_metric_name(mlflow_key(name))  # raises on a name MLflow rejects


def test_params_are_flattened_to_dotted_keys_and_cut_to_mlflows_limit() -> None:
    nested = {"trainer": {"max_epochs": 3, "callbacks": [{"_target_": "X"}]}, "module": {"lr": 0.1}, "empty": {}}
    assert flatten(nested) == {
        "trainer.max_epochs": 3,
        "trainer.callbacks": [{"_target_": "X"}],
        "module.lr": 0.1,
        "empty": {},
    }
    assert param_value([1, "a"]) == '[1, "a"]'
    assert param_value(None) == "None" and param_value(0.5) == "0.5"
    long = param_value("x" * 10_000)
    assert len(long) == MAX_PARAM_LENGTH and long.endswith("...")
    assert [len(c) for c in chunks(list(range(250)), 100)] == [100, 100, 50]


# --- local store ---------------------------------------------------------------------------------------------


def test_a_logger_used_directly_writes_params_metrics_and_the_config(tmp_path: Path) -> None:
    logger = MLflowLogger(tags={"team": "vision"})
    run_dir = tmp_path / "runs" / "demo" / "version_3"
    logger.attach(run_dir)
    logger.log_hyperparams({"module": {"lr": 0.1, "api_key": "hunter2"}, "seed": 7, "wandb_token": "t"})
    logger.log_metrics({"train/loss": 1.5, "epoch": 0}, step=1)
    logger.log_metrics({"train/loss": 1.25, "lr-SGD[0]": 0.1}, step=2)
    assert local_client(run_dir).get_run(logger.run_id).data.metrics == {}  # queued until save
    logger.save()
    logger.finalize("success")

    assert logger.tracking_uri == f"sqlite:///{(run_dir / 'mlflow' / 'mlflow.db').resolve()}"
    client = local_client(run_dir)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "version_3"
    assert client.get_experiment(run.info.experiment_id).name == "demo"
    assert run.data.params == {"module.lr": "0.1", "seed": "7"}  # credentials left out
    assert run.data.tags["team"] == "vision"
    assert run.data.tags["ember.run_dir"] == str(run_dir.resolve())
    assert history(client, logger.run_id, "train/loss") == [(1, 1.5), (2, 1.25)]
    assert history(client, logger.run_id, "lr-SGD_0_") == [(2, 0.1)]
    config = yaml.safe_load(read_artifact(client, logger.run_id, "config.yaml", tmp_path / "dl"))
    assert config == {"module": {"lr": 0.1}, "seed": 7}
    artifacts = Path(client.get_experiment(run.info.experiment_id).artifact_location.removeprefix("file://"))
    assert artifacts == (run_dir / "mlflow" / "artifacts").resolve()  # in the run dir, not in the cwd
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlartifacts").exists()


def test_a_fit_logs_steps_epochs_the_config_and_the_best_checkpoint(tmp_path: Path) -> None:
    logger = MLflowLogger()
    checkpoints = ModelCheckpoint(monitor="val/loss", filename="{epoch}-{val/loss:.4f}")
    t = trainer(tmp_path / "runs", 3, logger, callbacks=[checkpoints])
    t.run_config = {"trainer": {"max_epochs": 3}, "module": {"_target_": "tests.Regressor", "lr": 0.05}}
    t.fit(Regressor(), *loaders())

    client = local_client(t.run_dir)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "regressor"  # the ember run name
    assert run.data.params == {"trainer.max_epochs": "3", "module._target_": "tests.Regressor", "module.lr": "0.05"}
    train = history(client, logger.run_id, "train/loss")
    assert [step for step, _ in train] == list(range(3 * EPOCH_STEPS))  # every step, Lightning's axis: from 0
    val = history(client, logger.run_id, "val/loss")
    assert [step for step, _ in val] == [EPOCH_STEPS - 1, 2 * EPOCH_STEPS - 1, 3 * EPOCH_STEPS - 1]  # every epoch
    assert val[-1][1] == pytest.approx(t.callback_metrics["val/loss"], rel=1e-6)

    best = Path(checkpoints.best_model_path).resolve()
    assert run.data.tags["ember.best_checkpoint"] == str(best)
    assert run.data.tags["ember.last_checkpoint"] == str(Path(checkpoints.last_model_path).resolve())
    record = yaml.safe_load(read_artifact(client, logger.run_id, "best_checkpoint.json", tmp_path / "dl"))
    assert record["path"] == str(best)
    assert record["score"] == pytest.approx(checkpoints.best_model_score)
    assert record["score"] == pytest.approx(min(value for _, value in val), rel=1e-6)
    config = yaml.safe_load(read_artifact(client, logger.run_id, "config.yaml", tmp_path / "dl2"))
    assert config == t.run_config


def test_log_checkpoints_copies_the_best_checkpoint_into_the_artifacts(tmp_path: Path) -> None:
    logger = MLflowLogger(log_checkpoints=True)
    checkpoints = ModelCheckpoint(monitor="val/loss")
    t = trainer(tmp_path / "runs", 2, logger, callbacks=[checkpoints])
    t.fit(Regressor(), *loaders())
    client = local_client(t.run_dir)
    best = Path(checkpoints.best_model_path)
    listed = {a.path for a in client.list_artifacts(logger.run_id, f"checkpoints/{best.name}")}
    assert {f"checkpoints/{best.name}/{p.name}" for p in best.iterdir()} == listed


@pytest.mark.slow  # 3 s of CPU on a 2-core machine, with the processes it starts
def test_a_resumed_fit_continues_the_same_mlflow_run(tmp_path: Path) -> None:
    # Uninterrupted reference: 4 epochs in its own root.
    reference = MLflowLogger()
    full = trainer(tmp_path / "full", 4, reference)
    full.fit(Regressor(), *loaders())
    ref_client = local_client(full.run_dir)

    # Interrupted by Ctrl-C in epoch 3 (after the epoch-2 checkpoint), then resumed from "last".
    first = MLflowLogger()
    stopped = trainer(tmp_path / "runs", 4, first)
    with pytest.raises(KeyboardInterrupt):
        stopped.fit(Regressor(fail_at_step=2 * EPOCH_STEPS + 1), *loaders())
    client = local_client(stopped.run_dir)
    assert client.get_run(first.run_id).info.status == "KILLED"

    second = MLflowLogger()
    resumed = trainer(tmp_path / "runs", 4, second)
    resumed.fit(Regressor(), *loaders(), ckpt_path="last")
    assert resumed.run_dir == stopped.run_dir
    assert second.run_id == first.run_id
    runs = client.search_runs([first.experiment_id])
    assert [r.info.run_id for r in runs] == [first.run_id]  # one MLflow run, not two
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["ember.resumed_at_step"] == str(2 * EPOCH_STEPS)
    # Exact resume: the resumed run's curves equal the uninterrupted run's, step for step.
    for key in ("train/loss", "val/loss"):
        got = dict(history(client, first.run_id, key))
        assert got == dict(history(ref_client, reference.run_id, key)), key
    # A test on the same trainer continues the run too.
    resumed.test(Regressor(), loaders()[1], ckpt_path="last")
    assert "test/loss" in client.get_run(first.run_id).data.metrics
    assert [r.info.run_id for r in client.search_runs([first.experiment_id])] == [first.run_id]


def test_resume_from_a_path_finds_the_saved_store(tmp_path: Path) -> None:
    first = MLflowLogger()
    t = trainer(tmp_path / "runs", 1, first)
    t.fit(Regressor(), *loaders())
    last = (t.run_dir / "checkpoints" / "last").read_text().strip()
    second = MLflowLogger()
    resumed = trainer(tmp_path / "runs", 2, second)
    resumed.fit(Regressor(), *loaders(), ckpt_path=t.run_dir / "checkpoints" / last)
    assert resumed.run_dir != t.run_dir  # a new version folder ...
    assert second.tracking_uri == first.tracking_uri  # ... but the saved run's store
    assert second.run_id == first.run_id
    val = history(local_client(t.run_dir), first.run_id, "val/loss")
    assert [step for step, _ in val] == [EPOCH_STEPS - 1, 2 * EPOCH_STEPS - 1]  # the epochs' last steps' rows
    assert not (resumed.run_dir / "mlflow").exists()


def test_a_changed_config_on_resume_keeps_the_first_params_with_a_warning(tmp_path: Path) -> None:
    logger = MLflowLogger()
    logger.attach(tmp_path / "runs" / "x" / "version_0")
    logger.log_hyperparams({"lr": 0.1, "epochs": 2})
    logger.finalize("success")
    again = MLflowLogger()
    again.attach(tmp_path / "runs" / "x" / "version_0")
    again.load_state_dict({**logger.state_dict(), "step": 8})
    with pytest.warns(RuntimeWarning, match="keeps its first value of epochs"):
        again.log_hyperparams({"lr": 0.1, "epochs": 4, "new": 1})
    again.finalize("success")
    params = local_client(tmp_path / "runs" / "x" / "version_0").get_run(logger.run_id).data.params
    assert params == {"lr": "0.1", "epochs": "2", "new": "1"}


# --- a live server ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """``mlflow server`` on 127.0.0.1 with an SQLite backend and proxied artifacts; stopped (its whole process
    group) on exit."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{root / 'server.db'}",
        "--artifacts-destination",
        str(root / "server-artifacts"),
        "--workers",
        "1",
    ]
    log = open(root / "server.log", "wb")  # noqa: SIM115  (closed below)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    # No job runner: its three consumer processes (each importing mlflow) serve nothing ember uses, took 2 s of
    # the start here, and leave a folder in /dev/shm behind.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (root / "server.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"mlflow server did not come up (exit {proc.poll()}):\n{tail}")
            time.sleep(0.25)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@pytest.mark.slow
@pytest.mark.waits  # for the mlflow server to start
def test_a_fit_logs_to_a_live_mlflow_server_over_http(tmp_path: Path) -> None:
    with mlflow_server(tmp_path) as url:
        logger = MLflowLogger(experiment_name="served", tracking_uri=url)
        checkpoints = ModelCheckpoint(monitor="val/loss")
        t = trainer(tmp_path / "runs", 2, logger, callbacks=[checkpoints])
        t.fit(Regressor(), *loaders())
        client = MlflowClient(tracking_uri=url)
        run = client.get_run(logger.run_id)
        assert run.info.status == "FINISHED"
        assert client.get_experiment(run.info.experiment_id).name == "served"
        assert run.data.params == {"lr": "0.05", "hidden": "8"}  # the module's hparams (no YAML config)
        assert [s for s, _ in history(client, logger.run_id, "train/loss")] == list(range(2 * EPOCH_STEPS))
        assert [s for s, _ in history(client, logger.run_id, "val/loss")] == [EPOCH_STEPS - 1, 2 * EPOCH_STEPS - 1]
        record = yaml.safe_load(read_artifact(client, logger.run_id, "best_checkpoint.json", tmp_path / "dl"))
        assert record["path"] == str(Path(checkpoints.best_model_path).resolve())
        served = history(client, logger.run_id, "val/loss")
    # The server stored everything in its own SQLite file and artifact folder, none in the run dir.
    assert not (t.run_dir / "mlflow").exists()
    assert list((tmp_path / "server-artifacts").rglob("best_checkpoint.json"))
    offline = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'server.db'}")
    assert history(offline, logger.run_id, "val/loss") == served


def test_importing_the_loggers_leaves_mlflow_alone() -> None:
    code = "import sys, ember.loggers; print('mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""A real fit logging to W&B offline: the run's history and config, read back with wandb's own reader, and a
resumed fit that continues the same run id. No network: WANDB_MODE=offline (tests/conftest.py) decides the mode
before any connectivity check, and the check itself is made to fail the test if reached."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.loggers import CSVLogger, WandbLogger
from ember.loggers import wandb as wandb_module
from ember.loggers.wandb import STEP_METRIC


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(wandb_module, "_reachable", lambda url, timeout_s: pytest.fail("tried to reach W&B"))


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
    x, y = torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g)
    return DataLoader(TensorDataset(x[:32], y[:32]), batch_size=4), DataLoader(
        TensorDataset(x[32:], y[32:]), batch_size=8
    )


def read_run(run_file: Path) -> list[dict[str, Any]]:
    """Every record of a ``.wandb`` file, decoded by wandb's own reader: ``wandb leet inspect --json``.

    Runs the wandb-core command that CLI runs, directly (0.1 s instead of 1-2 s
    of Python start-up); falls back to the CLI if wandb-core's arguments change.
    """
    from wandb.util import get_core_path

    core = [get_core_path(), "leet", "inspect", "--no-observability", "--json"]
    fast = [*core, "--run-file", str(run_file), str(run_file.parent.parent)]
    out = subprocess.run(fast, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        cli = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def history(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record["type"] == "history":
            item = record["history"]["item"]
            for name, value in item.items():
                if not name.startswith("_") and name != STEP_METRIC:
                    series.setdefault(name, []).append((item[STEP_METRIC], value))
    return series


def csv_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if name != "step" and value != "":
                series.setdefault(name, []).append((int(row["step"]), float(value)))
    return series


def trainer(root: Path, **kw: Any) -> ember.Trainer:
    logger = WandbLogger(project="ember-it", name="regressor", tags=["it"])
    return ember.Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        default_root_dir=root,
        logger=[logger, CSVLogger()],
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_offline_fit_history_and_config_equal_what_was_logged(tmp_path: Path) -> None:
    fitted = trainer(tmp_path / "runs", enable_checkpointing=False)
    fitted.fit(Regressor(), *loaders())
    (run_file,) = (fitted.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = read_run(run_file)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    logger = fitted.loggers[0]
    assert isinstance(logger, WandbLogger)
    assert (run["run_id"], run["project"], run["display_name"], run["tags"]) == (
        logger.run_id,
        "ember-it",
        "regressor",
        ["it"],
    )
    config = {k: v for r in records if r["type"] == "config" for k, v in r["config"].get("update", {}).items()}
    config.update(run["config"]["update"])
    assert (config["lr"], config["hidden"]) == (0.05, 8)
    logged = history(records)
    assert logged == csv_series(fitted.run_dir)  # every value at every step, exactly as the CSV has it
    assert [step for step, _ in logged["train/loss"]] == [1, 3, 5, 7, 9, 11, 13, 15]  # step N's row: N - 1
    assert [step for step, _ in logged["val/loss"]] == [7, 15]
    assert logged["val/loss"][-1][1] == fitted.callback_metrics["val/loss"]
    assert records[-1]["type"] == "exit" and records[-1]["exit"]["exit_code"] == 0


def test_a_resumed_fit_continues_the_same_run(tmp_path: Path) -> None:
    killed = trainer(tmp_path / "runs")
    with pytest.raises(KeyboardInterrupt):
        killed.fit(Regressor(fail_at_step=11), *loaders())  # the epoch-1 checkpoint is at step 8
    first_id = killed.loggers[0].state_dict()["run_id"]
    resumed = trainer(tmp_path / "runs")
    resumed.fit(Regressor(), *loaders(), ckpt_path="last")
    assert resumed.run_dir == killed.run_dir and resumed.global_step == 16
    assert resumed.loggers[0].state_dict()["run_id"] == first_id

    files = sorted((resumed.run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 2 and all(f.name == f"run-{first_id}.wandb" for f in files)
    before, after = (read_run(f) for f in files)
    assert before[-1]["exit"]["exit_code"] == 1 and after[-1]["exit"]["exit_code"] == 0
    assert [r["run"]["run_id"] for r in after if r["type"] == "run"] == [first_id]
    assert [step for step, _ in history(before)["train/loss"]] == [1, 3, 5, 7, 9]
    assert [step for step, _ in history(after)["train/loss"]] == [9, 11, 13, 15]  # W&B plots by trainer/global_step
    for path in resumed.run_dir.rglob("*"):  # the checkpoint holds the run id only, never a credential
        if path.is_file() and path.suffix in (".pt", ".yaml", ".json"):
            assert b"api_key" not in path.read_bytes()

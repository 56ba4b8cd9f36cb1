"""``ember tune lr|batch-size`` and ``trainer.profiler`` from YAML, end to end on the digits example.

One real ``ember tune lr`` process checks the command, its output and its run directory; one real
``ember tune batch-size`` process, shared by the tests of its output, checks that command; the rest runs
in-process through `ember.cli.main` (the same code without an interpreter start-up).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ember.cli import main

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "digits.yaml"
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.fixture
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [str(REPO), *sys.path])


@pytest.mark.slow  # 10 s of CPU on a 2-core machine, with the processes it starts
def test_tune_lr_prints_the_suggestion_and_writes_its_run(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "ember", "tune", "lr", "-c", str(DIGITS), "--num-steps", "40", *QUIET]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    override = next(line for line in lines if "use it with" in line).split("use it with ")[1]
    key, value = override.split("=")
    assert key == "module.lr" and 1e-8 <= float(value) <= 1.0
    run_dir = tmp_path / "runs" / "classifier" / "version_0"
    assert lines[-1] == f"lr_find: run dir {Path('runs/classifier/version_0')}"
    with open(run_dir / "lr_find.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 40 or "diverged" in done.stdout
    suggested = [float(r["lr"]) for r in rows if f"{float(r['lr']):.3g}" == value]
    assert suggested, "the printed suggestion is one of the learning rates tried"
    assert (run_dir / "lr_find.png").stat().st_size > 10_000
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["module"]["lr"] == 0.003  # the config as given
    assert any((run_dir / "tensorboard").iterdir()) and (run_dir / "metrics.csv").exists()
    assert "Traceback" not in done.stderr


BATCH_SIZE_ARGS = ["tune", "batch-size", "-c", str(DIGITS), "--memory-budget", "400KB", "--steps-per-trial", "2"]


@pytest.fixture(scope="module")
def batch_size_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One ``ember tune batch-size`` process, shared by the tests of its output: (its cwd, what it printed).

    A fresh process: kineto (torch's profiler library) reads its log level once."""
    cwd = tmp_path_factory.mktemp("tune_batch_size")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "ember", *BATCH_SIZE_ARGS, *QUIET], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    return cwd, done


@pytest.mark.slow  # 10 s of CPU on a 2-core machine: the process of `batch_size_run`
def test_tune_batch_size_prints_the_override(batch_size_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    cwd, done = batch_size_run
    assert done.returncode == 0, done.stderr
    out = done.stdout
    answer = int(out.split("largest batch size ")[1].split()[0])
    assert f"use it with data.batch_size={answer}" in out
    verdicts = [line for line in out.splitlines() if line.startswith("scale_batch_size: batch size ")]
    assert any(f"batch size {answer}:" in v and v.endswith("fits") for v in verdicts)
    assert any(f"batch size {answer + 1}:" in v and "does not fit" in v for v in verdicts)
    assert not (cwd / "runs").exists() or not any((cwd / "runs").rglob("*.ckpt"))


@pytest.mark.slow  # 10 s of CPU on a 2-core machine: the process of `batch_size_run`
def test_tune_batch_size_prints_nothing_of_the_profilers_own(
    batch_size_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """Each trial starts and stops torch's profiler; its library (kineto) printed a ``USDT: ... profiler_start``
    line to stderr at each (34 lines for the digits example)."""
    _, done = batch_size_run
    assert done.returncode == 0, done.stderr
    assert "use it with data.batch_size=" in done.stdout
    assert done.stderr == "", done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tune", "lr"], "give the run's config with -c FILE"),
        (["tune", "lr", "-c", str(DIGITS), "--min-lr", "1", "--max-lr", "0.1"], "0 < min_lr < max_lr"),
        (["tune", "lr", "-c", str(DIGITS), "module.lrr=1"], "module.lrr"),
        (["tune", "batch-size", "-c", str(DIGITS), "--memory-budget", "lots"], "--memory-budget: memory budget"),
        (["tune", "batch-size", "-c", str(DIGITS)], "needs memory_budget"),
        (["tune", "batch-size", "-c", str(DIGITS), "--attr", "bs", "--max-size", "4"], "has no attribute 'bs'"),
        (["fit", "-c", str(DIGITS), "trainer.profiler=fancy"], "profiler='fancy'"),
        (["sweep", "-c", str(DIGITS), "--space", "nope.yaml", "--trials", "2"], "nope.yaml: cannot read the sweep"),
        (["sweep", "--space", "s.yaml", "--trials", "2"], "give the base config with -c FILE"),
        (["sweep", "-c", str(DIGITS), "--space", "s.yaml", "--trials", "0"], "--trials, --workers and"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(
    args: list[str], message: str, repo_on_path: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*args, *QUIET]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ember: error: ") and message in err and "\n" not in err


def test_a_profiler_from_yaml(tmp_path: Path, repo_on_path: None, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "-c", str(DIGITS), "trainer.max_epochs=1", "trainer.limit_train_batches=4", *QUIET]
    assert main([*args, "trainer.profiler={kind: pytorch, wait: 0, warmup: 1, active: 2}"]) == 0
    out = capsys.readouterr().out
    assert "profile of fit" in out and "profiler: trace " in out
    profiler_dir = tmp_path / "runs" / "classifier" / "version_0" / "profiler"
    assert sorted(p.name for p in profiler_dir.iterdir()) == ["fit.json", "fit.txt", "trace-fit-rank0-0.json"]
    saved = yaml.safe_load((profiler_dir.parent / "config.yaml").read_text())
    assert saved["trainer"]["profiler"] == {"kind": "pytorch", "wait": 0, "warmup": 1, "active": 2}

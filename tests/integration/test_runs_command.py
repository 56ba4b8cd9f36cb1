"""``ember runs``: one table of a runs directory holding every kind of run, checked against a golden table.

The directory is built once for the module, in process (``ember.cli.main``): a finished fit (then tested, so
an evaluation is listed under it), a fit stopped by EarlyStopping, one stopped by Ctrl-C, one that failed,
one preempted by SIGTERM, a validate-only run, an lr finder run and a sweep trial.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.checkpoint import run_status
from ember.cli import main
from ember.trainer.signals import EXIT_PREEMPTED

PROJECT = Path(__file__).resolve().parent / "cli_project" / "my_project"

CONFIG = """\
seed: 3
trainer:
  max_epochs: 2
  enable_model_summary: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
  callbacks:
    - _target_: ember.callbacks.ModelCheckpoint
      monitor: val/acc
      mode: max
module:
  _target_: my_project.models.Net
  hidden: 8
data:
  _target_: my_project.models.Blobs
  n: 96
  batch_size: 16
optimizer:
  _target_: torch.optim.SGD
  lr: 0.2
"""

STOPS = '''\
import os
import signal

import ember


class StopAt(ember.Callback):
    """At optimizer step `step`: raise Ctrl-C ("ctrl-c"), an error ("error") or send this process SIGTERM."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        if self.how == "ctrl-c":
            raise KeyboardInterrupt
        if self.how == "error":
            raise RuntimeError("loss exploded")
        os.kill(os.getpid(), signal.SIGTERM)
'''

SAVER = "{_target_: ember.callbacks.ModelCheckpoint, monitor: val/acc, mode: max}"

#: The plain-text table, times and metric values normalised (`normalise`).
GOLDEN = Path(__file__).resolve().parent / "runs_table.golden.txt"


def cli(*argv: str) -> int:
    return main(list(argv))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A project folder whose ``runs/`` holds one run of each kind (see the module docstring)."""
    root = tmp_path_factory.mktemp("runs_command")
    shutil.copytree(PROJECT, root / "my_project", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "my_project" / "stops.py").write_text(STOPS)
    (root / "net.yaml").write_text(CONFIG)
    saved_path, saved_cwd = list(sys.path), os.getcwd()
    os.chdir(root)
    sys.path.insert(0, str(root))
    try:
        assert cli("fit", "-c", "net.yaml") == 0  # version_0
        assert cli("test", "-c", "net.yaml", "--ckpt-path", "best", "--run", "version_0") == 0
        early = "{_target_: ember.callbacks.EarlyStopping, monitor: val/acc, mode: max, patience: 1, min_delta: 1.0}"
        assert cli("fit", "-c", "net.yaml", "trainer.max_epochs=5", f"trainer.callbacks=[{SAVER}, {early}]") == 0
        stop = "{_target_: my_project.stops.StopAt, step: %d, how: %s}"
        assert cli("fit", "-c", "net.yaml", f"trainer.callbacks=[{stop % (3, 'ctrl-c')}]") == 130
        with pytest.raises(RuntimeError, match="loss exploded"):
            cli("fit", "-c", "net.yaml", f"trainer.callbacks=[{stop % (2, 'error')}]")
        with pytest.raises(SystemExit) as exited:
            cli("fit", "-c", "net.yaml", f"trainer.callbacks=[{SAVER}, {stop % (3, 'sigterm')}]")
        assert exited.value.code == EXIT_PREEMPTED
        assert cli("validate", "-c", "net.yaml") == 0  # version_5: no checkpoint, a run of its own
        assert cli("tune", "lr", "-c", "net.yaml", "--num-steps", "8", "--no-plot", "trainer.callbacks=[]") == 0
        run_sweep_trial(root)
        yield root
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        for name in [m for m in sys.modules if m.startswith("my_project")]:
            del sys.modules[name]


def run_sweep_trial(root: Path) -> None:
    """One trial of a sweep, as a sweep worker runs it (in this process, on an in-memory study)."""
    import optuna

    from ember.tuning.space import SweepSpace
    from ember.tuning.sweep_worker import run_trial

    (root / "space.yaml").write_text(
        "metric: val/acc\ndirection: maximize\nparameters:\n  module.hidden: {distribution: categorical, values: [4]}\n"
    )
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(direction="maximize")
        spec = {"configs": [str(root / "net.yaml")], "overrides": ["trainer.max_epochs=1"]}
        where = root / "runs" / "sweeps" / "space"
        run_trial(study, study.ask(), spec, SweepSpace.load(root / "space.yaml"), where, os.getppid())
    finally:
        optuna.logging.set_verbosity(verbosity)
    assert study.trials[0].state == optuna.trial.TrialState.COMPLETE


def normalise(table: str) -> str:
    """Times and metric values replaced by placeholders of the same width (columns stay aligned)."""
    table = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d", "YYYY-MM-DD HH:MM", table)
    return re.sub(r"\b\d\.\d{4}\b", "N.NNNN", table)


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_table_of_every_kind_of_run(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert cli("runs", str(runs / "runs")) == 0
    out = capsys.readouterr().out
    assert normalise(out) == GOLDEN.read_text()


def test_json_holds_the_values_the_runs_recorded(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert cli("runs", str(runs / "runs"), "--json") == 0
    listed = {item["run"]: item for item in json.loads(capsys.readouterr().out)}
    first = listed["net/version_0"]
    (evaluation,) = first["evaluations"]
    record = json.loads((runs / "runs/net/version_0/eval" / "test-epoch=1-step=10.json").read_text())
    assert evaluation["metrics"] == record["metrics"]
    assert first["best"] == {"monitor": "val/acc", "score": pytest.approx(record["monitored"]["val/acc"])}
    assert listed["net/version_1"]["changes"][-1] == ["trainer.max_epochs", 2, 5]
    assert listed["net/version_3"]["error"] == "RuntimeError: loss exploded"
    assert (listed["net/version_4"]["status"], listed["net/version_4"]["reason"]) == ("preempted", "SIGTERM")
    assert listed["sweeps/space/trial_000/version_0"]["changes"] == []  # no earlier version of that trial
    # the status record is all the status column reads: every run wrote one, and none is left "running"
    assert sorted(run_status.read_record(runs / "runs" / name)["status"] for name in listed) == sorted(
        item["status"] for item in listed.values()
    )


def test_a_run_whose_process_is_gone_is_failed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    alive, killed = tmp_path / "a" / "version_0", tmp_path / "a" / "version_1"
    run_status.begin(alive, "fit")  # this process: alive
    run_status.begin(killed, "fit")
    record = json.loads((killed / "status.json").read_text())
    record["holder"]["pid"] = 0  # no process
    (killed / "status.json").write_text(json.dumps(record))
    assert cli("runs", str(tmp_path), "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["run"], r["status"], r["reason"]) for r in listed] == [
        ("a/version_0", "running", None),
        ("a/version_1", "failed", "killed"),
    ]


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_no_runs_is_one_line_and_exit_2(tmp_path: Path, make: str, capsys: pytest.CaptureFixture[str]) -> None:
    where = tmp_path / "runs"
    if make == "empty":
        (where / "net").mkdir(parents=True)
    assert cli("runs", str(where)) == 2
    captured = capsys.readouterr()
    expected = "no runs directory" if make == "missing" else "no runs under"
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and expected in captured.err


def test_a_terminal_gets_the_rich_table(
    runs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert cli("runs", str(runs / "runs")) == 0
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out).replace("┃", "│")  # no colours; one rule
    lines = [line for line in out.splitlines() if "│" in line]
    assert lines[0].split("│")[1].strip() == "RUN"
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines[1:]]
    assert [c[:3] for c in cells if c[0].startswith("net/version_4")] == [
        ["net/version_4", "fit", "preempted (SIGTERM)"]
    ]
    assert "eval" in [c[0] for c in cells]

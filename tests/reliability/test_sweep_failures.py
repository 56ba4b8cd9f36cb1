"""``ember sweep`` is never blocked and never silently wrong (issue "Never blocked, never silently wrong", item 6).

- A grid sweep ends cleanly after its last point: no worker crashes (Optuna's ``GridSampler`` stops a study
  with ``Study.stop``, which raises outside ``optimize``).
- Every grid point is run exactly once, also when a worker is killed with SIGKILL in the middle of a trial and
  replaced.
- A damaged ``study.db`` or ``sweep.json`` is one line and exit 2 that says what to do, and changes neither file.
- A search space that could only fail mid-run (infinite bounds, categorical values of mixed types) is refused
  before anything runs; so is ``ember tune lr --max-lr inf``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from rel_helpers import assert_one_line_error, make_project, run_cli

from ember.config import ConfigError
from ember.tuning.space import SweepSpace
from ember.tuning.sweep import STUDY_NAME

REPO = Path(__file__).resolve().parents[2]

#: Trials of 2 short epochs on 48 training points; `hang_once.HangOnce` can stop one of them for good.
BASE = """\
seed: 7
trainer:
  max_epochs: 2
  enable_model_summary: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
  logger: false
  callbacks:
    - _target_: hang_once.HangOnce
      flag: {flag}
module:
  _target_: my_project.models.Net
  hidden: 8
data:
  _target_: my_project.models.Blobs
  n: 64
  batch_size: 16
optimizer:
  _target_: torch.optim.SGD
  lr: 0.1
"""

HANG_ONCE = '''\
"""A callback that hangs a trial in its second epoch while `flag` exists (the test kills it); `flag` holds how
many trials to let through first."""
import os
import time
from pathlib import Path

import ember


class HangOnce(ember.Callback):
    def __init__(self, flag: str) -> None:
        self.flag = Path(flag)

    def on_train_epoch_start(self, trainer, module) -> None:
        if trainer.current_epoch != 1:
            return
        if not self.flag.exists():
            return
        let_through = int(self.flag.read_text())
        if let_through > 0:
            self.flag.write_text(str(let_through - 1))
            return
        taken = self.flag.with_name(self.flag.name + ".taken")
        os.replace(self.flag, taken)  # one trial takes it
        (taken.with_name("hung.pid")).write_text(str(os.getpid()))
        time.sleep(300)
'''

GRID = """\
metric: val/acc
sampler: grid
seed: 0
pruner: none
parameters:
  module.hidden: {values: [4, 6, 8, 10]}
"""

POINTS = [4, 6, 8, 10]


@pytest.fixture
def sweep_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """`tmp_path` with my_project, hang_once.py, base.yaml (no hang unless the test creates ``hang.flag``), grid.yaml;
    ember from this checkout for the sweep's processes."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    make_project(tmp_path, BASE.format(flag=tmp_path / "hang.flag"))
    (tmp_path / "net.yaml").rename(tmp_path / "base.yaml")
    (tmp_path / "hang_once.py").write_text(HANG_ONCE, encoding="utf-8")
    (tmp_path / "grid.yaml").write_text(GRID, encoding="utf-8")
    yield tmp_path
    sys.modules.pop("hang_once", None)  # imported by the in-process runs' config checks


def sweep_command(root: Path, trials: int = len(POINTS)) -> list[str]:
    args = ["-c", str(root / "base.yaml"), "--space", str(root / "grid.yaml"), "--trials", str(trials)]
    return [sys.executable, "-m", "ember", "sweep", *args, "--dir", str(root / "sweep")]


def study_trials(directory: Path) -> list[optuna.trial.FrozenTrial]:
    storage = optuna.storages.RDBStorage(f"sqlite:///{directory / 'study.db'}")
    return optuna.load_study(study_name=STUDY_NAME, storage=storage).get_trials()


def finished_points(trials: list[optuna.trial.FrozenTrial]) -> list[int]:
    return sorted(t.params["module.hidden"] for t in trials if t.state.name in ("COMPLETE", "PRUNED"))


@pytest.mark.slow  # a sweep's worker process: 5-10 s on 2 busy cores
@pytest.mark.usefixtures("clean_imports")
def test_a_grid_sweep_ends_cleanly_after_its_last_point(
    sweep_project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sweep runs in this process (what is tested is its worker, a process of its own either way)."""
    monkeypatch.chdir(sweep_project)
    code, out, err = run_cli(sweep_command(sweep_project)[3:], capsys)
    log = (sweep_project / "sweep" / "logs" / "worker-0.log").read_text()
    assert code == 0, out + err + log
    assert "exited with status" not in err, err
    assert "Traceback" not in log and log.count("== worker 0 starts") == 1, log  # it ran to the end, once
    trials = study_trials(sweep_project / "sweep")
    assert finished_points(trials) == POINTS and len(trials) == len(POINTS)
    assert f"sweep: {len(POINTS)} of {len(POINTS)} trials finished" in out


@pytest.mark.slow  # a sweep whose worker is killed and started again: 25-40 s on 2 busy cores
def test_every_grid_point_runs_once_across_a_worker_killed_mid_trial(sweep_project: Path) -> None:
    """SIGKILL the worker while the second trial, at a generated grid point, runs; the sweep replaces the worker,
    and the finished trials cover the grid exactly once each, the killed point among them."""
    (sweep_project / "hang.flag").write_text("1")
    sweep = subprocess.Popen(
        sweep_command(sweep_project), cwd=sweep_project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pid_file, deadline = sweep_project / "hung.pid", time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline and sweep.poll() is None:
            time.sleep(0.1)
        assert pid_file.exists(), "no trial reached its second epoch"
        hung = [t for t in study_trials(sweep_project / "sweep") if t.state.name == "RUNNING"]
        assert len(hung) == 1 and "retry_of" not in hung[0].user_attrs  # a point the sampler generated
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        out, err = sweep.communicate(timeout=180)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    trials = study_trials(sweep_project / "sweep")
    assert finished_points(trials) == POINTS, [(t.number, t.state.name, t.params) for t in trials]
    assert sweep.returncode == 0, out + err
    assert "worker 0 exited with status -9" in err
    killed = next(t for t in trials if t.number == hung[0].number)
    assert killed.state.name == "FAIL" and killed.user_attrs["stopped"] == "its worker exited with status -9"
    assert "Traceback" not in (sweep_project / "sweep" / "logs" / "worker-0.log").read_text()


def _real_study(path: Path) -> None:
    study = optuna.create_study(storage=f"sqlite:///{path}", study_name=STUDY_NAME, direction="maximize")
    for value in (0.1, 0.2, 0.3):
        trial = study.ask()
        trial.suggest_categorical("module.hidden", POINTS)
        study.tell(trial, value)


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 8)


def _truncated_study(path: Path) -> None:
    _real_study(path)
    path.write_bytes(path.read_bytes()[:5000])


def _foreign_sqlite(path: Path) -> None:
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("create table notes (text)")
    db.close()


def _truncated_json(path: Path) -> None:
    path.write_text('{"configs": ["base.yaml"], "space": {"metr', encoding="utf-8")


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("study.db", _garbage, "is not an Optuna study (file is not a database)"),
        ("study.db", _truncated_study, "is not an Optuna study (database disk image is malformed)"),
        ("study.db", _foreign_sqlite, "is not an Optuna study (an SQLite database without Optuna's tables)"),
        ("sweep.json", _garbage, "is not a sweep record (not UTF-8 JSON"),
        ("sweep.json", _truncated_json, "is not a sweep record (not UTF-8 JSON"),
        ("sweep.json", lambda p: p.write_text("[1, 2]"), "is not a sweep record (no space and base config)"),
    ],
)
@pytest.mark.usefixtures("clean_imports")
def test_a_damaged_study_file_is_one_line_and_exit_2(
    sweep_project: Path, capsys: pytest.CaptureFixture[str], name: str, damage: object, message: str
) -> None:
    directory = sweep_project / "sweep"
    directory.mkdir()
    damage(directory / name)  # type: ignore[operator]
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    code, _, err = run_cli(sweep_command(sweep_project)[3:], capsys)
    line = assert_one_line_error(err, f"{directory / name} {message}", "move it aside")
    assert code == 2, line
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.suffix != ".lock"} == before  # nothing lost
    assert not (directory / "logs").exists()  # no worker started


@pytest.mark.parametrize(
    ("parameter", "message"),
    [
        ("{distribution: log_uniform, min: 1.0e-4, max: .inf}", "parameters.module.hidden.max: expected a finite"),
        ("{distribution: uniform, min: -.inf, max: 1.0}", "parameters.module.hidden.min: expected a finite"),
        ("{distribution: int_uniform, min: 4, max: .inf}", "parameters.module.hidden.max: expected a finite"),
        ("{distribution: uniform, min: .nan, max: 1.0}", "parameters.module.hidden.min: expected a finite"),
        ("{values: [8, 16, wide]}", "parameters.module.hidden.values: values of one type"),
        ("{values: [8, 16.5]}", "parameters.module.hidden.values: values of one type"),
        ("{values: [true, 1]}", "parameters.module.hidden.values: values of one type"),
        ("{values: [0.5, .inf]}", "parameters.module.hidden.values: .inf is not a finite number"),
        ("{values: [8, 16, 8]}", "parameters.module.hidden.values: 8 is listed twice"),
    ],
)
@pytest.mark.usefixtures("clean_imports")
def test_a_space_that_would_fail_mid_run_is_refused_before_anything_runs(
    sweep_project: Path, capsys: pytest.CaptureFixture[str], parameter: str, message: str
) -> None:
    space = sweep_project / "grid.yaml"
    space.write_text(f"metric: val/acc\nsampler: random\nparameters:\n  module.hidden: {parameter}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{space}: {message}")):
        SweepSpace.load(space)  # the check itself
    code, _, err = run_cli([*sweep_command(sweep_project)[3:], "--max-failures", "1"], capsys)
    assert_one_line_error(err, f"{space}: {message}")
    assert code == 2 and not (sweep_project / "sweep").exists()  # nothing ran


@pytest.mark.usefixtures("clean_imports")
@pytest.mark.parametrize("bounds", [["--max-lr", "inf"], ["--min-lr", "1e-3", "--max-lr", "1e400"]])
def test_tune_lr_refuses_non_finite_bounds_before_it_runs(
    sweep_project: Path, capsys: pytest.CaptureFixture[str], bounds: list[str]
) -> None:
    config = make_project(sweep_project / "lr")
    code, out, err = run_cli(["tune", "lr", "-c", str(config), "--no-plot", "--num-steps", "5", *bounds], capsys)
    assert_one_line_error(err, "lr_find: need finite 0 < min_lr < max_lr")
    assert code == 2 and "lr_find:" not in out and not (sweep_project / "lr" / "runs").exists()

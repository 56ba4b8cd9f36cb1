"""``ember sweep`` end to end: worker processes sharing one SQLite study, pruning, the end-of-sweep outputs,
and a sweep killed with SIGKILL mid-trial that the same command then completes without counting twice.

The trials are the digits example cut short (3 epochs of 6 batches). Starting a sweep's processes costs
seconds, so one test kills a sweep, completes it, and then checks everything a finished sweep writes.
Whether the median pruner stops a trial there depends on timing (which values are drawn, and which trials
are complete when another reports), so pruning has its own test, with one worker and a fixed order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from ember.cli import main
from ember.config import ConfigError
from ember.tuning.sweep import STUDY_NAME, file_lock, run_sweep

REPO = Path(__file__).resolve().parents[2]

BASE = """\
seed: 42
trainer:
  max_epochs: 3
  limit_train_batches: 6
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - _target_: ember.callbacks.model_checkpoint.ModelCheckpoint
      monitor: val/acc
      mode: max
module:
  _target_: examples.digits.Classifier
  epochs: ${trainer.max_epochs}
data:
  _target_: examples.digits.DigitsData
"""

SPACE = """\
metric: val/acc
direction: maximize
sampler: {name: random}
seed: 0
pruner: {name: median, n_startup_trials: 1, n_warmup_steps: 0}
parameters:
  module.lr: {distribution: log_uniform, min: 1.0e-4, max: 1.0e-1}
  module.hidden: {distribution: int_uniform, min: 8, max: 64}
"""

#: SPACE with a learning rate low enough to learn nothing in 3 epochs (the pruning test queues 1e-7)
PRUNE_SPACE = SPACE.replace("min: 1.0e-4", "min: 1.0e-7")
assert PRUNE_SPACE != SPACE


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(sys, "path", [str(REPO), *sys.path])
    (tmp_path / "base.yaml").write_text(BASE, encoding="utf-8")
    (tmp_path / "space.yaml").write_text(SPACE, encoding="utf-8")
    return tmp_path / "base.yaml", tmp_path / "space.yaml"


def sweep_command(base: Path, space: Path, trials: int, directory: Path) -> list[str]:
    args = ["-c", str(base), "--space", str(space), "--trials", str(trials), "--workers", "2", "--dir", str(directory)]
    return [sys.executable, "-m", "ember", "sweep", *args]


def load(directory: Path) -> optuna.Study:
    storage = optuna.storages.RDBStorage(f"sqlite:///{directory / 'study.db'}")
    return optuna.load_study(study_name=STUDY_NAME, storage=storage)


def _running_beside_finished(db: Path, n: int) -> bool:
    """Whether the study in `db` has a running trial with its values drawn beside 1 to n - 2 finished ones."""
    if not db.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)) as connection:
            rows = connection.execute(
                "SELECT state, EXISTS (SELECT 1 FROM trial_params p WHERE p.trial_id = t.trial_id) FROM trials t"
            ).fetchall()
    except sqlite3.Error:  # the study is still being created
        return False
    running = [state for state, drawn in rows if state == "RUNNING" and drawn]
    done = [state for state, _ in rows if state in ("COMPLETE", "PRUNED")]
    return bool(running) and 0 < len(done) < n - 1


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials() if t.state.name in ("COMPLETE", "PRUNED")]


def test_a_sweep_refuses_another_space_in_its_directory(files: tuple[Path, Path], tmp_path: Path) -> None:
    base, space = files
    directory = tmp_path / "sweep"
    directory.mkdir()
    (directory / "sweep.json").write_text('{"space": {}, "base": {}}', encoding="utf-8")
    with pytest.raises(ConfigError, match="holds a sweep with another search space"):
        run_sweep([str(base)], [], str(space), trials=2, directory=directory, verbose=False)
    (tmp_path / "grid.yaml").write_text(
        "metric: val/acc\nsampler: grid\nparameters:\n  module.hidden: {values: [8, 16]}\n"
    )
    with pytest.raises(ConfigError, match="has 2 points; ask for at most 2"):
        run_sweep([str(base)], [], str(tmp_path / "grid.yaml"), trials=3, directory=tmp_path / "g", verbose=False)
    (tmp_path / "typo.yaml").write_text("metric: val/acc\nparameters:\n  module.hiden: {values: [8, 16]}\n")
    with pytest.raises(ConfigError, match=r"a trial's config is not valid: .*module\.hiden"):
        run_sweep([str(base)], [], str(tmp_path / "typo.yaml"), trials=3, directory=tmp_path / "t", verbose=False)


#: A callback each trial of the SIGKILL test runs, so that a trial takes long enough (0.3 s an epoch) for the
#: test to see one running beside a finished one: a digits trial of 3 short epochs takes 0.3 s in all once its
#: worker has started, and the test, looking every 50 ms, could miss the moment on a quiet machine.
PACE = """\
import time

import ember


class Pace(ember.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_epoch_end(self, trainer, module):
        time.sleep(self.seconds)
"""


@pytest.mark.slow  # two sweeps of 2 workers each
@pytest.mark.waits  # for the trial to be killed
def test_sigkill_mid_trial_then_the_same_command_finishes_without_counting_twice(
    files: tuple[Path, Path], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 workers, 6 trials; SIGKILL the sweep (only the sweep: its workers must die with it) while a trial runs
    and another has finished; the same command then completes the study, and its outputs are checked."""
    base, space = files
    (tmp_path / "pace.py").write_text(PACE, encoding="utf-8")  # beside the config: its trials import it
    paced = BASE.replace("  callbacks:\n", "  callbacks:\n    - _target_: pace.Pace\n      seconds: 0.3\n")
    assert paced != BASE
    base.write_text(paced, encoding="utf-8")
    directory, n = tmp_path / "sweep", 6
    command = sweep_command(base, space, n, directory)
    log = open(tmp_path / "first.log", "wb")  # noqa: SIM115
    first = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    # A running trial beside a finished one: 36 s after the start on 2 busy cores (load average 8)
    deadline, before = time.monotonic() + 120, []
    try:
        while time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
            if not _running_beside_finished(directory / "study.db", n):
                continue  # asked of SQLite directly: loading the study through Optuna every 50 ms costs seconds
            try:
                trials = load(directory).get_trials()
            except Exception:  # the study is still being created
                continue
            running = [t for t in trials if t.state.name == "RUNNING" and t.params]
            done = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
            if done and running and len(done) < n - 1:
                before = done
                os.kill(first.pid, signal.SIGKILL)  # the sweep, not its workers: they must die with it
                break
    finally:
        if first.poll() is None and not before:
            first.kill()
        first.wait(timeout=60)
        log.close()
    assert before, "never saw a running trial next to a finished one: " + (tmp_path / "first.log").read_text()
    assert first.returncode == -signal.SIGKILL
    with _eventually_free(directory / "workers.lock", seconds=20):
        pass  # the workers died with the sweep
    cut_off = [t for t in load(directory).get_trials() if t.state.name == "RUNNING"]
    assert [t for t in cut_off if t.params], "a trial was running with its values drawn when the sweep was killed"

    # The same command again, in this process: the sweep's own interpreter would only import torch again (its
    # workers are processes either way); `pace` is imported by the config check, from the config's folder.
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.chdir(tmp_path)
        try:
            code = main(command[3:])
        finally:
            sys.modules.pop("pace", None)
    second = capsys.readouterr()
    assert code == 0, second.out + second.err
    study = load(directory)
    trials = study.get_trials()
    done = finished(study)
    assert len(done) == n, [(t.number, t.state.name) for t in trials]
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers))
    run_dirs = [t.user_attrs["run_dir"] for t in done]
    assert len(run_dirs) == len(set(run_dirs))  # no finished trial shares a run with another
    by_number = {t.number: t for t in trials}
    for old in before:  # finished before the kill: kept as they were, not run again
        assert by_number[old.number].datetime_complete == old.datetime_complete
        assert by_number[old.number].state == old.state
    for killed in cut_off:  # cut off: failed, and retried once with the same values under a new number
        now = by_number[killed.number]
        assert now.state.name == "FAIL" and now.user_attrs["stopped"] == "the sweep was stopped while it ran"
        retries = [t for t in trials if t.user_attrs.get("retry_of") == killed.number]
        if not killed.params:  # its worker had asked for it but not drawn its values yet: nothing to repeat
            assert retries == []
            continue
        assert len(retries) == 1 and retries[0].params == killed.params
        assert retries[0].number > killed.number and retries[0] in [t for t in trials if t in done]
    assert f"trial {cut_off[0].number} was running when the sweep stopped" in second.out
    check_outputs(directory, study, second.out, capsys)
    # Running the finished sweep again runs nothing and reports the same.
    try:
        again = run_sweep([str(base)], [], str(space), trials=n, workers=2, directory=directory, verbose=False)
    finally:
        sys.modules.pop("pace", None)
    assert (again.complete + again.pruned, len(load(directory).trials)) == (n, len(trials))


@pytest.mark.slow  # 11 s of CPU on a 2-core machine, with the processes it starts
def test_the_median_pruner_stops_a_clearly_worse_trial(files: tuple[Path, Path], tmp_path: Path, capsys: Any) -> None:
    """One worker runs two trials one after the other: a learning rate that learns first (it completes and sets
    the median), then one that learns nothing, which the median pruner stops at its first validation. The
    order is fixed by queueing both trials' values in the study the sweep then continues."""
    base, _ = files
    space = tmp_path / "prune.yaml"
    space.write_text(PRUNE_SPACE, encoding="utf-8")
    directory = tmp_path / "sweep"
    directory.mkdir()
    good, bad = {"module.lr": 0.05, "module.hidden": 32}, {"module.lr": 1.0e-7, "module.hidden": 32}
    queued = optuna.create_study(
        storage=f"sqlite:///{directory / 'study.db'}", study_name=STUDY_NAME, direction="maximize"
    )
    queued.enqueue_trial(good)
    queued.enqueue_trial(bad)
    capsys.readouterr()
    result = run_sweep([str(base)], [], str(space), trials=2, workers=1, directory=directory, verbose=True)
    stdout = capsys.readouterr().out
    trials = load(directory).get_trials()
    assert [(t.number, t.state.name, t.params) for t in trials] == [(0, "COMPLETE", good), (1, "PRUNED", bad)]
    complete, pruned = trials
    assert complete.user_attrs["epochs"] == 3 and sorted(complete.intermediate_values) == [0, 1, 2]
    assert pruned.user_attrs["epochs"] == 1 and list(pruned.intermediate_values) == [0]  # stopped at step 0
    assert pruned.value == pruned.intermediate_values[0] < complete.intermediate_values[0] - 0.3  # clearly worse
    assert (result.complete, result.pruned, result.failed) == (1, 1, 0)
    assert (result.epochs_run, result.epochs_without_pruning) == (3 + 1, 3 + 3)
    assert "sweep: trial 1 pruned after 1 epochs" in stdout and "sweep: trial 0 complete" in stdout
    assert "sweep: 2 of 2 trials finished (1 complete, 1 pruned; 0 failed)" in stdout
    run_dir = Path(pruned.user_attrs["run_dir"])  # a pruned trial is an ordinary run that stopped early
    assert run_dir == directory / "trial_001" / "version_0" and (run_dir / "checkpoints" / "last").exists()


def check_outputs(directory: Path, study: optuna.Study, stdout: str, capsys: Any) -> None:
    """Every finished trial is an ordinary run with its values; the table, best.yaml and TensorBoard hparams."""
    trials = finished(study)
    assert {t.user_attrs["worker"] for t in trials} == {0, 1}  # both workers ran trials
    pruned = [t for t in trials if t.state.name == "PRUNED"]  # may be none: see test_the_median_pruner_stops_...
    for trial in trials:
        run_dir = Path(trial.user_attrs["run_dir"])
        assert run_dir == directory / f"trial_{trial.number:03d}" / "version_0"
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert saved["module"]["lr"] == trial.params["module.lr"]
        assert saved["module"]["hidden"] == trial.params["module.hidden"]
        assert (run_dir / "checkpoints" / "last").exists() and (run_dir / "metrics.csv").exists()
        # One validation per epoch; a pruned trial stops after the one that pruned it, which may be the last.
        assert trial.user_attrs["epochs"] == len(trial.intermediate_values)
        assert trial.user_attrs["epochs"] <= 3 if trial in pruned else trial.user_attrs["epochs"] == 3
        assert trial.value == pytest.approx(max(trial.intermediate_values.items())[1])  # the last report
    n = len(trials)
    assert "┃ trial" in stdout and f"sweep: {n} of {n} trials finished" in stdout
    best = max((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: (t.value, -t.number))
    assert f"sweep: best trial {best.number}: val/acc {best.value:.4f}" in stdout
    # best.yaml is a complete config that `ember fit -c` takes, with the best values.
    capsys.readouterr()
    assert main(["fit", "-c", str(directory / "best.yaml"), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["module"]["lr"] == best.params["module.lr"]
    assert printed["module"]["hidden"] == best.params["module.hidden"]
    assert printed["trainer"]["default_root_dir"] == "runs" and printed["trainer"]["run_name"] is None
    # TensorBoard's HPARAMS view: one run per finished trial with its values and final metric.
    assert sorted(p.name for p in (directory / "tensorboard").iterdir()) == sorted(
        f"trial_{t.number:03d}" for t in trials
    )
    for trial in trials:
        events = EventAccumulator(str(directory / "tensorboard" / f"trial_{trial.number:03d}"))
        events.Reload()
        content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
        values = {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
        assert values["module.lr"] == pytest.approx(trial.params["module.lr"])
        assert values["state"] == trial.state.name.lower()
        assert events.Scalars("val/acc")[0].value == pytest.approx(trial.value, rel=1e-6)


class _eventually_free:
    """Wait until the lock at `path` can be taken (every worker holding it has exited)."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path, self.seconds = path, seconds

    def __enter__(self) -> None:
        deadline = time.monotonic() + self.seconds
        while True:
            try:
                with file_lock(self.path, blocking=False):
                    return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"workers still hold {self.path} {self.seconds} s after the kill") from None
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        return None

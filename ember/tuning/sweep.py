"""Hyperparameter sweeps on Optuna: ``ember sweep -c base.yaml --space sweep.yaml --trials N --workers K``.

The sweep directory (``--dir``, default ``<trainer.default_root_dir>/sweeps/<space file name>``) holds:

- ``study.db``: the Optuna study in SQLite. The K worker processes share it,
  and a sweep run again with the same command continues it.
- ``sweep.json``: the configs, overrides and space the sweep was started with
  (a rerun with different ones is refused) and the number of trials.
- ``trial_<n>/version_0/``: every trial is an ordinary ember run of the base
  config with the trial's values as overrides: ``config.yaml``, checkpoints,
  TensorBoard and CSV logs.
- ``logs/worker-<k>.log``: what each worker printed (progress lines, tracebacks).
- at the end: ``best.yaml`` (the complete config of the best finished trial,
  for ``ember fit -c``), ``trials.csv`` and ``tensorboard/`` (every trial's
  swept values and final metrics for TensorBoard's HPARAMS tab).

**Counting.** A worker asks Optuna for a trial only while finished (complete or
pruned) plus running trials number fewer than N; the check and the ask happen
under a file lock, so the sweep ends with exactly N finished trials. A trial
that raises is marked failed (its error in the trial's user attributes and the
worker log) and does not count; after ``max_failures`` such errors the sweep
stops. **Resuming.** When the sweep starts and no worker of an earlier run is
alive (each worker holds a shared lock on ``workers.lock`` while it lives, and
dies with the process that started it), every trial still marked running was cut
off by a kill: it is marked failed and its values are queued again, so it is
retried once under a new trial number and never counted twice. Finished trials
are never run again. **Grid.** The workers share the grid's points and queue,
under the same lock, the first point no trial has finished, runs or waits for,
so every point runs once (see `ember.tuning.space`). **Damaged files.** A
``study.db`` that is not an intact Optuna study, or a ``sweep.json`` that is not
a sweep's record, is refused before anything runs, naming the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from ember.config.errors import ConfigError
from ember.tuning.space import SweepSpace, override, trial_values
from ember.tuning.sweep_report import FINISHED, SweepResult, report

STUDY_NAME = "ember-sweep"


def default_directory(base: dict[str, Any], space_path: str | Path) -> Path:
    return Path(base["trainer"]["default_root_dir"]) / "sweeps" / Path(space_path).stem


def open_storage(directory: Path) -> Any:
    """The sweep's Optuna storage: ``directory/study.db`` (SQLite, waiting up to 2 minutes for a lock)."""
    import optuna

    url = f"sqlite:///{(directory / 'study.db').resolve()}"
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})


@contextlib.contextmanager
def file_lock(path: Path, shared: bool = False, blocking: bool = True) -> Iterator[IO[str]]:
    """Hold an flock on `path` (released when the process dies, however it dies). BlockingIOError if not blocking
    and it is taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as handle:
        flags = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        fcntl.flock(handle, flags)
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_base(files: Sequence[str], overrides: Sequence[str], space: SweepSpace) -> dict[str, Any]:
    """The resolved base config; also checks that a trial config (base + a value of every parameter) builds."""
    from ember import config

    config.add_import_roots(files)
    loaded = config.load(files, overrides)
    resolved = config.resolve(loaded)
    config.check(loaded, resolved, "fit")
    trial = [*overrides, *(override(p.key, p.example()) for p in space.parameters.values())]
    try:
        trial_loaded = config.load(files, trial)
        config.check(trial_loaded, config.resolve(trial_loaded), "fit")
    except ConfigError as exc:
        raise ConfigError(f"{space.source}: a trial's config is not valid: {exc}") from exc
    return resolved


def run_sweep(
    config_files: Sequence[str],
    overrides: Sequence[str],
    space_file: str,
    trials: int,
    workers: int = 1,
    directory: str | Path | None = None,
    max_failures: int = 3,
    verbose: bool = True,
) -> SweepResult:
    """Run (or continue) a sweep and report it; see the module docstring. Returns the `SweepResult`."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if trials < 1 or workers < 1 or max_failures < 1:
        raise ConfigError("--trials, --workers and --max-failures must be positive")
    space = SweepSpace.load(space_file)
    grid = space.grid_size()
    if grid is not None and trials > grid:
        raise ConfigError(f"--trials {trials}: the grid of {space_file} has {grid} points; ask for at most {grid}")
    base = load_base(config_files, overrides, space)
    where = Path(directory) if directory is not None else default_directory(base, space_file)
    where.mkdir(parents=True, exist_ok=True)
    spec = {
        "configs": [str(Path(f).resolve()) for f in config_files],
        "overrides": list(overrides),
        "space": space.to_dict(),
        "base": base,
        "trials": trials,
        "max_failures": max_failures,
        "cwd": os.getcwd(),
    }
    try:
        with file_lock(where / "sweep.lock", blocking=False):
            _check_same_sweep(where, spec)
            check_study_file(where / "study.db")
            _write_json(where / "sweep.json", spec)
            with _study_errors(where / "study.db"):
                storage = open_storage(where)
                study = optuna.create_study(
                    storage=storage,
                    study_name=STUDY_NAME,
                    direction=space.direction,  # type: ignore[arg-type]
                    load_if_exists=True,
                )
                _recover(where, storage, study, verbose)
            if _remaining(study, trials, max_failures):
                _run_workers(where, workers, storage, study, space, verbose)
            return report(where, study, space, spec, verbose)
    except BlockingIOError:
        raise ConfigError(f"another `ember sweep` is running in {where}; wait for it or give another --dir") from None


def _remaining(study: Any, trials: int, max_failures: int) -> bool:
    """Whether workers have anything to do (the same rule the workers apply before each trial)."""
    states = [(t.state.name, "error" in t.user_attrs) for t in study.get_trials(deepcopy=False)]
    done = sum(state in FINISHED for state, _ in states)
    errors = sum(state == "FAIL" and error for state, error in states)
    return done < trials and errors < max_failures


def _check_same_sweep(where: Path, spec: dict[str, Any]) -> None:
    path = where / "sweep.json"
    if not path.exists():
        return
    move_aside = f"move it aside (the trials in {where / 'study.db'} are kept) or give another --dir"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not a sweep record (not UTF-8 JSON: {exc}); {move_aside}") from None
    if not isinstance(saved, dict) or not {"space", "base"} <= saved.keys():
        raise ConfigError(f"{path} is not a sweep record (no space and base config); {move_aside}")
    for key, what in (("space", "search space"), ("base", "base config (after overrides)")):
        if saved.get(key) != json.loads(json.dumps(spec[key])):
            raise ConfigError(
                f"{where} holds a sweep with another {what}; run the same command to continue it, or give a new --dir"
            )


def check_study_file(path: Path) -> None:
    """Refuse a ``study.db`` that is not an intact SQLite database holding Optuna's tables (an empty or missing
    file is a new study), before Optuna or SQLAlchemy touch it."""
    import sqlite3

    if not path.exists() or path.stat().st_size == 0:
        return
    db = None
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=120)
        check = db.execute("PRAGMA quick_check").fetchall()
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as exc:
        raise _not_a_study(path, str(exc)) from None
    finally:
        if db is not None:
            db.close()
    if check != [("ok",)]:
        raise _not_a_study(path, f"damaged: {str(check[0][0]).splitlines()[-1]}")
    if tables and not {"studies", "trials"} <= tables:
        raise _not_a_study(path, "an SQLite database without Optuna's tables")


def _not_a_study(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} is not an Optuna study ({why}); move it aside (the sweep then starts again with no trials) "
        "or give another --dir"
    )


@contextlib.contextmanager
def _study_errors(path: Path) -> Iterator[None]:
    """What SQLAlchemy raises for a study file `check_study_file` could not judge, as one line."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as exc:
        raise _not_a_study(path, str(getattr(exc, "orig", None) or exc).splitlines()[0]) from None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    os.replace(partial, path)


def _recover(where: Path, storage: Any, study: Any, verbose: bool) -> None:
    """Fail and requeue the trials a killed run left marked running (no worker of it may still live)."""
    try:
        with file_lock(where / "workers.lock", blocking=False):
            pass
    except BlockingIOError:
        raise ConfigError(
            f"workers of an earlier sweep in {where} are still running (they hold {where / 'workers.lock'}); "
            "wait for them to stop"
        ) from None
    for trial in study.get_trials(deepcopy=False):
        if trial.state.name == "RUNNING":
            fail_and_retry(storage, study, trial, "the sweep was stopped while it ran")
            if verbose:
                print(f"sweep: trial {trial.number} was running when the sweep stopped: failed, queued again")


def fail_and_retry(storage: Any, study: Any, trial: Any, why: str) -> None:
    """Mark a cut-off trial failed and queue its values once more (a retry of a retry is not queued)."""
    from optuna.trial import TrialState

    set_user_attr(storage, study, trial.number, "stopped", why)
    study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
    values = trial_values(trial)
    if "retry_of" not in trial.user_attrs and values:
        study.enqueue_trial(values, user_attrs={"retry_of": trial.number})


def set_user_attr(storage: Any, study: Any, number: int, key: str, value: Any) -> None:
    """Set a user attribute of running trial `number` through the storage (from any process)."""
    study_id = storage.get_study_id_from_name(study.study_name)
    storage.set_trial_user_attr(storage.get_trial_id_from_study_id_trial_number(study_id, number), key, value)


def _run_workers(where: Path, count: int, storage: Any, study: Any, space: SweepSpace, verbose: bool) -> None:
    """Start `count` workers, print trials as they finish, replace a worker that dies (up to 3 times)."""
    (where / "logs").mkdir(exist_ok=True)
    procs = {k: _start_worker(where, k, count) for k in range(count)}
    reported = {t.number for t in study.get_trials(deepcopy=False) if t.state.name in (*FINISHED, "FAIL")}
    restarts = 0
    try:
        while procs:
            time.sleep(0.5)
            _print_finished(study, reported, space, verbose)
            for k, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[k]
                if code != 0:
                    _worker_died(where, storage, study, k, code)
                    if restarts < 3:
                        restarts += 1
                        procs[k] = _start_worker(where, k, count)
        _print_finished(study, reported, space, verbose)
    except BaseException:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise


def _start_worker(where: Path, index: int, count: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))  # the workers share the CPU
    with open(where / "logs" / f"worker-{index}.log", "ab") as log:
        log.write(f"== worker {index} starts at {time.strftime('%Y-%m-%d %H:%M:%S')} ==\n".encode())
        log.flush()
        return subprocess.Popen(
            [sys.executable, "-m", "ember.tuning.sweep_worker", str(where.resolve()), str(index), str(os.getpid())],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )


def _worker_died(where: Path, storage: Any, study: Any, index: int, code: int) -> None:
    log = where / "logs" / f"worker-{index}.log"
    print(f"sweep: worker {index} exited with status {code}; see {log}", file=sys.stderr, flush=True)
    with file_lock(where / "ask.lock"):  # no worker picks the trial's values between failing and queueing them
        for trial in study.get_trials(deepcopy=False):
            if trial.state.name == "RUNNING" and trial.user_attrs.get("worker") == index:
                fail_and_retry(storage, study, trial, f"its worker exited with status {code}")


def _print_finished(study: Any, reported: set[int], space: SweepSpace, verbose: bool) -> None:
    for trial in study.get_trials(deepcopy=False):
        if trial.number in reported or trial.state.name not in (*FINISHED, "FAIL"):
            continue
        reported.add(trial.number)
        if verbose:
            print(describe_trial(trial, space), flush=True)


def describe_trial(trial: Any, space: SweepSpace) -> str:
    """One line per finished trial: state, metric, values."""
    values = ", ".join(f"{k}={_short(v)}" for k, v in trial.params.items())
    seconds = trial.user_attrs.get("seconds")
    took = f" in {seconds:.1f} s" if seconds is not None else ""
    state = trial.state.name
    if state == "FAIL":
        why = trial.user_attrs.get("error") or trial.user_attrs.get("stopped") or "failed"
        return f"sweep: trial {trial.number} failed{took}: {why}"
    metric = f"{space.metric} {trial.value:.4f}" if trial.value is not None else f"{space.metric} ?"
    epochs = trial.user_attrs.get("epochs")
    if state == "PRUNED":
        return f"sweep: trial {trial.number} pruned after {epochs} epochs{took}: {metric} ({values})"
    return f"sweep: trial {trial.number} complete{took}: {metric} ({values})"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)

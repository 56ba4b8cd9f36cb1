"""The sweep's counting rule and its handling of cut-off trials, on an in-memory Optuna study."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from ember.tuning.sweep import _remaining, _worker_died, fail_and_retry
from ember.tuning.sweep_worker import _next_trial


@pytest.fixture
def study() -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction="maximize")


def ask(study: optuna.Study, worker: int = 0) -> optuna.Trial:
    trial = study.ask()
    trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    trial.set_user_attr("worker", worker)
    return trial


def test_finished_plus_running_trials_never_exceed_n(study: optuna.Study) -> None:
    spec = {"trials": 3, "max_failures": 2}
    first, second = _next_trial(study, spec), _next_trial(study, spec)
    study.tell(first, 0.5)
    study.tell(second, state=TrialState.PRUNED)
    third = _next_trial(study, spec)
    assert third is not None and _next_trial(study, spec) is None  # 2 finished + 1 running = 3
    study.tell(third, state=TrialState.FAIL)  # a failure (no error attribute: cut off) frees its place
    assert _next_trial(study, spec) is not None


def test_errors_stop_the_sweep(study: optuna.Study) -> None:
    spec = {"trials": 10, "max_failures": 2}
    for _ in range(2):
        trial = _next_trial(study, spec)
        trial.set_user_attr("error", "ValueError: boom")
        study.tell(trial, state=TrialState.FAIL)
    assert _next_trial(study, spec) is None
    assert not _remaining(study, 10, 2) and _remaining(study, 10, 3)


def test_a_cut_off_trial_is_failed_and_retried_once_with_its_values(study: optuna.Study) -> None:
    trial = ask(study)
    frozen = study.trials[trial.number]
    fail_and_retry(study._storage, study, frozen, "the sweep was stopped while it ran")
    failed, queued = study.trials
    assert failed.state == TrialState.FAIL and failed.user_attrs["stopped"] == "the sweep was stopped while it ran"
    assert queued.state == TrialState.WAITING and queued.user_attrs["retry_of"] == failed.number
    retry = study.ask()
    assert retry.suggest_float("lr", 1e-4, 1e-1, log=True) == failed.params["lr"]
    fail_and_retry(study._storage, study, study.trials[retry.number], "again")  # a retry is not retried again
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.FAIL]


def test_a_dead_worker_fails_only_its_own_running_trial(study: optuna.Study, tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    ask(study, worker=0)
    ask(study, worker=1)
    _worker_died(tmp_path, study._storage, study, 1, -9)
    states = [(t.number, t.state, t.user_attrs.get("retry_of")) for t in study.trials]
    assert states == [(0, TrialState.RUNNING, None), (1, TrialState.FAIL, None), (2, TrialState.WAITING, 1)]
    assert study.trials[1].user_attrs["stopped"] == "its worker exited with status -9"


def test_a_trial_cut_off_before_drawing_values_is_failed_and_not_queued(study: optuna.Study) -> None:
    spec = {"trials": 2, "max_failures": 3}
    asked = _next_trial(study, spec)  # its worker was killed before the space drew the trial's values
    assert asked is not None
    fail_and_retry(study._storage, study, study.trials[asked.number], "the sweep was stopped while it ran")
    assert [(t.state, t.params) for t in study.trials] == [(TrialState.FAIL, {})]  # nothing to repeat
    assert _next_trial(study, spec) is not None and _next_trial(study, spec) is not None  # both places free


GRID = [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}, {"a": 1, "b": "y"}]


def run_point(trial: optuna.Trial) -> dict[str, object]:
    """What a worker does with a grid trial: draw its values (fixed: the point it was queued with)."""
    return {"a": trial.suggest_categorical("a", [1, 2]), "b": trial.suggest_categorical("b", ["x", "y"])}


def test_grid_workers_take_each_point_once_and_stop_after_the_last(study: optuna.Study) -> None:
    spec = {"trials": 3, "max_failures": 3}
    first, second = _next_trial(study, spec, GRID), _next_trial(study, spec, GRID)  # two workers, interleaved
    assert [run_point(first), run_point(second)] == GRID[:2]  # the second is asked before the first drew values
    study.tell(first, 0.5)
    third = _next_trial(study, spec, GRID)
    assert run_point(third) == GRID[2] and _next_trial(study, spec, GRID) is None
    study.tell(second, 0.6)
    study.tell(third, 0.7)  # the last point: nothing raises (Optuna's GridSampler called Study.stop here)
    assert _next_trial(study, {**spec, "trials": 4}, GRID) is None  # every point done: the grid is complete
    assert sorted((t.params["a"], t.params["b"]) for t in study.trials) == [(1, "x"), (1, "y"), (2, "x")]


def test_a_grid_point_cut_off_or_failed_is_the_next_one_run(study: optuna.Study) -> None:
    spec = {"trials": 3, "max_failures": 3}
    cut = _next_trial(study, spec, GRID)  # its worker dies before it draws its values
    fail_and_retry(study._storage, study, study.trials[cut.number], "its worker exited with status -9")
    retry = _next_trial(study, spec, GRID)
    assert retry.number == 1 and run_point(retry) == GRID[0]  # queued again with its point, and asked first
    retry.set_user_attr("error", "ValueError: boom")
    study.tell(retry, state=TrialState.FAIL)  # a trial that raised: its point is free again
    again = _next_trial(study, spec, GRID)
    assert run_point(again) == GRID[0] and "retry_of" not in study.trials[again.number].user_attrs

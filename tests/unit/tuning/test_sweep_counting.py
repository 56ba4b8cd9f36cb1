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

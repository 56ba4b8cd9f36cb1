"""One sweep worker process: ask the shared study for trials and run each as an ordinary ember fit.

Started by `ember.tuning.sweep` as ``python -m ember.tuning.sweep_worker DIR INDEX PARENT_PID``. It
dies with the process that started it (Linux ``PR_SET_PDEATHSIG``; elsewhere it checks its parent
after every validation), holds a shared lock on ``DIR/workers.lock`` while it lives, and stops when
the study has its trials (see the counting rule in `ember.tuning.sweep`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback
from ember.tuning.space import point_key, trial_values

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer
    from ember.tuning.space import SweepSpace

_PR_SET_PDEATHSIG = 1


class TrialReporter(Callback):
    """Reports the sweep's metric to an Optuna trial after every validation; stops the run when it is pruned.

    The step is the validation's index (0, 1, ...). A pruned trial stops like
    any run asked to stop (``trainer.should_stop = True``): its last checkpoint,
    logs and config are complete, and nothing raises.
    """

    def __init__(self, trial: Any, metric: str, parent_pid: int | None = None) -> None:
        self.trial, self.metric, self.parent_pid = trial, metric, parent_pid
        self.reports = 0
        self.last: float | None = None
        self.best: float | None = None
        self.pruned = False

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.sanity_checking:
            return
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            os._exit(1)  # the sweep is gone (systems without PR_SET_PDEATHSIG)
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            raise KeyError(
                f"the sweep's metric {self.metric!r} was not logged at validation; logged: "
                f"{', '.join(sorted(trainer.callback_metrics)) or 'nothing'}"
            )
        self.trial.report(value, self.reports)
        self.reports += 1
        self.last = value
        maximize = self.trial.study.direction.name == "MAXIMIZE"
        if self.best is None or (value > self.best if maximize else value < self.best):
            self.best = value
        if self.trial.should_prune():
            self.pruned = True
            trainer.should_stop = True


def run_trial(study: Any, trial: Any, spec: dict[str, Any], space: SweepSpace, where: Path, parent: int) -> None:
    """Build the trial's config (base + its values), fit it, tell the study how it ended."""
    from optuna.trial import TrialState

    from ember import config
    from ember.commands import build
    from ember.trainer.run import label_command
    from ember.tuning.space import override

    started = time.monotonic()
    trainer: Trainer | None = None
    try:
        params = {key: parameter.suggest(trial) for key, parameter in space.parameters.items()}
        overrides = [
            *spec["overrides"],
            *(override(key, value) for key, value in params.items()),
            override("trainer.default_root_dir", str(where)),
            override("trainer.run_name", f"trial_{trial.number:03d}"),
        ]
        loaded = config.load(spec["configs"], overrides)
        resolved = config.resolve(loaded)
        config.check(loaded, resolved, "fit")
        trainer, module, data = build(resolved)
        label_command(trainer, "sweep trial")
        if trainer.strategy.needs_launch():
            raise config.ConfigError(
                "sweep trials run in one process each: set trainer.devices=1 (--workers runs trials side by side)"
            )
        reporter = TrialReporter(trial, space.metric, parent)
        trainer.user_callbacks.append(reporter)
        trainer.fit(module, datamodule=data)
    except Exception as exc:
        traceback.print_exc()
        trial.set_user_attr("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        _record(trial, trainer, started)
        study.tell(trial, state=TrialState.FAIL)
        return
    _record(trial, trainer, started)
    if reporter.pruned:
        study.tell(trial, state=TrialState.PRUNED)
    elif reporter.last is None or reporter.last != reporter.last:  # never validated, or NaN
        trial.set_user_attr("error", f"no finite value of {space.metric} was reported")
        study.tell(trial, state=TrialState.FAIL)
    else:
        trial.set_user_attr("best", reporter.best)
        study.tell(trial, reporter.last)


def _record(trial: Any, trainer: Trainer | None, started: float) -> None:
    trial.set_user_attr("seconds", round(time.monotonic() - started, 3))
    if trainer is None:
        return
    trial.set_user_attr("epochs", trainer.current_epoch)
    trial.set_user_attr("max_epochs", trainer.max_epochs)
    trial.set_user_attr("metrics", {k: v for k, v in trainer.last_eval_metrics.items() if v == v})
    with contextlib.suppress(RuntimeError):  # RuntimeError: it failed before the run started
        trial.set_user_attr("run_dir", str(trainer.run_dir))


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    where, index, parent = Path(argv[0]), int(argv[1]), int(argv[2])
    _die_with_parent(parent)
    import optuna

    from ember import config
    from ember.tuning.space import SweepSpace
    from ember.tuning.sweep import STUDY_NAME, file_lock, open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = json.loads((where / "sweep.json").read_text(encoding="utf-8"))
    os.chdir(spec["cwd"])
    config.add_import_roots(spec["configs"])
    space = SweepSpace.from_dict(spec["space"], "sweep.json")
    storage = open_storage(where)
    with file_lock(where / "workers.lock", shared=True):
        offset = len(optuna.load_study(study_name=STUDY_NAME, storage=storage).get_trials(deepcopy=False))
        study = optuna.load_study(
            study_name=STUDY_NAME,
            storage=storage,
            sampler=space.make_sampler(index, offset),
            pruner=space.make_pruner(),
        )
        points = space.grid_points() if space.sampler == "grid" else None
        while True:
            with file_lock(where / "ask.lock"):
                trial = _next_trial(study, spec, points)
                if trial is None:
                    return 0
                trial.set_user_attr("worker", index)
            print(f"== trial {trial.number} ==", flush=True)
            run_trial(study, trial, spec, space, where, parent)


def _next_trial(study: Any, spec: dict[str, Any], grid: list[dict[str, Any]] | None = None) -> Any:
    """A new trial, or None when finished + running trials reach the target or too many trials raised.

    With a `grid` (its points, in order) the trial gets the first point no trial has finished, runs or waits
    for (a queued retry) as fixed values; None when there is none. Call it under the ask lock: the choice
    and the ask are one step for all workers.
    """
    trials = study.get_trials(deepcopy=False)
    finished = running = errors = 0
    for trial in trials:
        state = trial.state.name
        finished += state in ("COMPLETE", "PRUNED")
        running += state == "RUNNING"
        errors += state == "FAIL" and "error" in trial.user_attrs
    if finished + running >= spec["trials"] or errors >= spec["max_failures"]:
        return None
    if grid is not None and not any(t.state.name == "WAITING" for t in trials):  # a waiting one is asked first
        taken = {point_key(trial_values(t)) for t in trials if t.state.name in ("COMPLETE", "PRUNED", "RUNNING")}
        point = next((p for p in grid if point_key(p) not in taken), None)
        if point is None:
            return None
        study.enqueue_trial(point)
    return study.ask()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

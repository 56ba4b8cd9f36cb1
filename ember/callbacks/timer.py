"""`Timer`: wall time per stage, and a time budget for training that survives a resume."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

STAGES = ("train", "validate", "test", "predict")


def parse_duration(value: float | str | timedelta | dict[str, int], label: str | None = None) -> float:
    """Seconds from a number, ``"DD:HH:MM:SS"``, a ``timedelta`` or a dict of ``timedelta`` fields; a bad or
    non-positive value is an error that starts with `label`, the option as the user wrote it
    (default ``Timer(duration=...)``)."""
    label = label or f"Timer(duration={value!r})"
    seconds: float | None = None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, dict):
        try:
            seconds = timedelta(**value).total_seconds()
        except TypeError:
            raise ValueError(f"{label}: the keys must be timedelta fields (days, hours, minutes, "
                             "seconds, milliseconds, ...)") from None  # fmt: skip
    elif isinstance(value, str):
        match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", value)
        if match:
            d, h, m, s = map(int, match.groups())
            seconds = timedelta(days=d, hours=h, minutes=m, seconds=s).total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    if seconds is None or not seconds > 0:
        raise ValueError(f"{label}: use a positive duration: seconds (> 0), 'DD:HH:MM:SS', a timedelta or a dict")
    return seconds


class Timer(Callback):
    """Measures the time spent in training, validation, test and predict; optionally stops training after a budget.

    - `time_elapsed` (stage), `time_remaining`, `start_time`, `end_time` tell
      where the time went ("train" counts from ``on_train_start`` to
      ``on_train_end`` and includes validation inside fit; "validate" counts
      every validation run).
    - With ``duration``, training stops once "train" time reaches it, checked
      after every batch (``interval="step"``) or every epoch
      (``interval="epoch"``); with several processes, every ``log_every_n_steps``
      batches, and rank zero's clock decides. Unlike ``Trainer(max_time=...)``, the elapsed time
      is checkpointed, so a resumed run only gets what is left of the budget.
    """

    def __init__(
        self,
        duration: float | str | timedelta | dict[str, int] | None = None,
        interval: str = "step",
        verbose: bool = False,
    ) -> None:
        if interval not in ("step", "epoch"):
            raise ValueError(f"Timer(interval={interval!r}): use 'step' or 'epoch'")
        self.duration_s = parse_duration(duration) if duration is not None else None
        self.interval = interval
        self.verbose = verbose
        self._clock = time.monotonic
        self._start: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(STAGES)
        self._offset: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    def start_time(self, stage: str = "train") -> float | None:
        """Clock reading (``time.monotonic``) when `stage` last started, or None."""
        return self._start[stage]

    def end_time(self, stage: str = "train") -> float | None:
        """Clock reading when `stage` last ended, or None while it runs."""
        return self._end[stage]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in `stage`, including time from before a resume."""
        start, end = self._start[stage], self._end[stage]
        offset = self._offset[stage]
        if start is None:
            return offset
        return offset + ((end if end is not None else self._clock()) - start)

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of ``duration`` (None without a duration)."""
        if self.duration_s is None:
            return None
        return max(0.0, self.duration_s - self.time_elapsed(stage))

    def _begin(self, stage: str) -> None:
        if self._start[stage] is not None and self._end[stage] is not None:  # a later run: bank the previous one
            self._offset[stage] = self.time_elapsed(stage)
        self._start[stage], self._end[stage] = self._clock(), None

    def _finish(self, stage: str) -> None:
        if self._start[stage] is not None:
            self._end[stage] = self._clock()

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Start the training clock."""
        self._begin("train")

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Stop the training clock."""
        self._finish("train")

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Start the validation clock (sanity check excluded)."""
        if not trainer.sanity_checking:
            self._begin("validate")

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Stop the validation clock."""
        if not trainer.sanity_checking:
            self._finish("validate")

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Start the test clock."""
        self._begin("test")

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Stop the test clock."""
        self._finish("test")

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Start the predict clock."""
        self._begin("predict")

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Stop the predict clock."""
        self._finish("predict")

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """With ``interval="step"``, stop once the budget is spent."""
        if self.interval != "step" or self.duration_s is None:
            return
        if trainer.strategy.world_size > 1 and (batch_idx + 1) % trainer.log_every_n_steps:
            return  # several processes agree through a collective: check on the logging cadence only
        self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """With ``interval="epoch"``, stop once the budget is spent."""
        if self.interval == "epoch" and self.duration_s is not None:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        assert self.duration_s is not None
        should_stop = self.time_elapsed("train") >= self.duration_s
        if trainer.strategy.world_size > 1:
            should_stop = bool(trainer.strategy.broadcast(should_stop))  # rank zero's clock decides for all
        if should_stop and not trainer.should_stop:
            trainer.should_stop = True
            if self.verbose and trainer.is_global_zero:
                print(f"Timer: {timedelta(seconds=round(self.duration_s))} of training elapsed; stopping")

    def state_dict(self) -> dict[str, Any]:
        """Seconds spent per stage so far (plain floats)."""
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue counting from the saved times."""
        elapsed = state_dict.get("time_elapsed", {})
        for stage in STAGES:
            self._offset[stage] = float(elapsed.get(stage, 0.0))
            self._start[stage] = self._end[stage] = None

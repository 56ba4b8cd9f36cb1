"""`EarlyStopping`: stop fit when a monitored metric stops improving, reaches a goal, or diverges."""

from __future__ import annotations

import difflib
import math
import sys
import warnings
from typing import TYPE_CHECKING, Any, TextIO

from ember.callbacks.callback import Callback
from ember.callbacks.monitored import check_after_sanity

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


class EarlyStopping(Callback):
    """Sets ``trainer.should_stop`` when `monitor` has not improved for `patience` checks.

    A *check* happens after every validation run inside fit (not in the sanity
    check, not in ``trainer.validate``). Without validation data, or with
    ``check_on_train_epoch_end=True``, it happens at the end of every training
    epoch instead, so a training metric such as ``train/loss_epoch`` can be
    monitored. Each check, in this order:

    1. ``check_finite``: a NaN or infinite value stops at once;
    2. ``stopping_threshold``: a value better than it stops (goal reached);
    3. ``divergence_threshold``: a value worse than it stops (diverged);
    4. a value better than the best so far by more than ``min_delta``
       becomes the best and resets the wait count; otherwise the wait count
       grows, and reaching ``patience`` stops.

    "Better" is lower for ``mode="min"`` and higher for ``mode="max"``. The
    stop takes effect at the end of the current epoch (the epoch's remaining
    batches are skipped when the check ran mid-epoch). The wait count, best
    score and stopped epoch are checkpointed.
    """

    def __init__(
        self,
        monitor: str,
        *,
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_finite: bool = True,
        check_on_train_epoch_end: bool | None = None,
        strict: bool = True,
        verbose: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode={mode!r}): use 'min' or 'max'")
        if patience < 1:
            raise ValueError(f"EarlyStopping(patience={patience!r}): use 1 or more checks")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = abs(min_delta)
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_finite = check_finite
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.strict = strict
        self.verbose = verbose
        self.stream = stream
        self.wait_count = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        #: Epoch (0-based) in which the stop was decided; None while training goes on.
        self.stopped_epoch: int | None = None
        #: Why training stopped, in words; None while training goes on.
        self.stopping_reason: str | None = None
        self._on_epoch_end = False
        self._warned_missing = False

    @property
    def state_key(self) -> str:
        """Includes the monitor and mode, so two instances with different settings keep separate state."""
        return f"EarlyStopping[monitor={self.monitor},mode={self.mode}]"

    def state_dict(self) -> dict[str, Any]:
        """Wait count, best score and stopped epoch (plain Python values)."""
        return {
            "wait_count": self.wait_count,
            "best_score": float(self.best_score),
            "stopped_epoch": self.stopped_epoch,
            "patience": self.patience,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters; ``patience`` and thresholds keep this instance's settings."""
        self.wait_count = int(state_dict["wait_count"])
        self.best_score = float(state_dict["best_score"])
        self.stopped_epoch = state_dict.get("stopped_epoch")

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def evaluate(self, current: float) -> tuple[bool, str | None]:
        """Update the state with one value of the monitored metric; return (stop?, reason)."""
        name = self.monitor
        if self.check_finite and not math.isfinite(current):
            return True, f"{name} = {current} is not finite"
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            return True, f"{name} = {current:.6g} reached the stopping threshold {self.stopping_threshold:g}"
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, current):
            return True, f"{name} = {current:.6g} crossed the divergence threshold {self.divergence_threshold:g}"
        margin = -self.min_delta if self.mode == "min" else self.min_delta
        if self._better(current, self.best_score + margin):
            self.best_score = current
            self.wait_count = 0
            return False, None
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (
                f"{name} did not improve by more than {self.min_delta:g} for {self.wait_count} "
                f"check{'s' * (self.wait_count != 1)}; "
                f"best {self.best_score:.6g}"
            )
        return False, None

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Decide where the check runs: after validation, or at training epoch ends when fit has no validation."""
        if stage != "fit":
            return
        self.stopped_epoch = self.stopping_reason = None
        self._on_epoch_end = bool(self.check_on_train_epoch_end)

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Without validation data, check at the end of every training epoch (unless told otherwise)."""
        if self.check_on_train_epoch_end is None:
            self._on_epoch_end = not any(trainer.num_val_batches)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Check after each validation run inside fit."""
        if not self._on_epoch_end and trainer.stage == "fit" and not trainer.sanity_checking:
            self._check(trainer)

    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """A misspelt `monitor` stops the fit here, before its first step (`callbacks.monitored`)."""
        check_after_sanity(trainer, "EarlyStopping", self.monitor)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Check at the end of each training epoch (without validation, or when asked)."""
        if self._on_epoch_end:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            close = difflib.get_close_matches(self.monitor, list(metrics), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            message = (
                f"EarlyStopping monitors {self.monitor!r}, which was not logged; {hint}"
                f"logged metrics: {sorted(metrics)}"
            )
            if self.strict:
                raise KeyError(message + " (pass strict=False to skip checks without it)")
            if not self._warned_missing:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                self._warned_missing = True
            return
        should_stop, reason = self.evaluate(metrics[self.monitor])
        should_stop = bool(trainer.strategy.broadcast(should_stop))  # every rank stops together
        if should_stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason = reason
            if self.verbose and trainer.is_global_zero:
                print(
                    f"EarlyStopping: {reason}; stopping after epoch {trainer.current_epoch}",
                    file=self.stream or sys.stdout,
                    flush=True,
                )

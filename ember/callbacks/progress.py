"""`ProgressLine`: plain progress output for logs that are not a terminal (CI, SLURM, files).

One line per training epoch and per validate/test run, plus a line inside long
epochs every ``every_n_seconds`` (and, if asked, every ``every_n_percent`` of
the epoch or every ``every_n_batches``). Nothing is redrawn, so the output
reads well in a file. The per-batch cost is a counter compare and a clock read.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def format_metrics(metrics: dict[str, float]) -> str:
    """``name value`` pairs, sorted by name, with 4 significant digits."""
    return "  ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``M:SS`` under an hour)."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def batches_left(trainer: Trainer, done: int, total: float) -> float:
    """Batches this epoch still runs after `done` of `total`: fewer when ``max_steps`` ends the run first
    (each remaining optimizer step takes ``accumulate_grad_batches`` batches)."""
    left = total - done
    if trainer.max_steps >= 0:
        left = min(left, max(trainer.max_steps - trainer.global_step, 0) * trainer.accumulate_grad_batches)
    return left


class ProgressLine(Callback):
    """Prints plain progress lines; the default progress display when stdout is not a terminal.

    - At the end of each training epoch: epoch, optimizer step, every metric
      logged with ``prog_bar=True`` and the epoch's wall time.
    - Inside an epoch, a line when ``every_n_batches`` batches, ``every_n_percent``
      of the epoch or ``every_n_seconds`` passed since the previous line
      (whichever comes first), with the rate and the time left.
    - After ``trainer.validate`` / ``trainer.test``: all their epoch metrics;
      long test and predict runs also print every ``every_n_seconds``.

    Only the global-zero process prints. ``stream`` defaults to ``sys.stdout``.
    """

    def __init__(
        self,
        every_n_batches: int | None = None,
        stream: TextIO | None = None,
        *,
        every_n_percent: float | None = None,
        every_n_seconds: float | None = 30.0,
    ) -> None:
        for name, value in (
            ("every_n_batches", every_n_batches),
            ("every_n_percent", every_n_percent),
            ("every_n_seconds", every_n_seconds),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"ProgressLine({name}={value!r}): use a positive number or None")
        self.every_n_batches = every_n_batches
        self.every_n_percent = every_n_percent
        self.every_n_seconds = every_n_seconds
        self.stream = stream
        self._enabled = True
        self._epoch_start = 0.0
        self._next_batch = math.inf  # batch count at which the next in-epoch line is due
        self._next_time = math.inf  # monotonic time at which the next line is due
        self._last_line_batches = 0
        self._eval_count = 0

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def _prefix(self, trainer: Trainer) -> str:
        # Epochs are numbered from 0, as in checkpoint names (epoch=0-step=5); "/N" names the last one, as
        # Lightning's bars do: "epoch 0/1" then "epoch 1/1" for max_epochs=2.
        last = f"/{trainer.max_epochs - 1}" if trainer.max_epochs is not None else ""
        return f"epoch {trainer.current_epoch}{last}  step {trainer.global_step}"

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Print only on the global-zero process."""
        self._enabled = trainer.is_global_zero

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Start the epoch clock and plan the first in-epoch line."""
        self._epoch_start = time.monotonic()
        self._last_line_batches = 0
        self._plan_next(trainer, 0, self._epoch_start)

    def _plan_next(self, trainer: Trainer, done: int, now: float) -> None:
        due = math.inf
        if self.every_n_batches:
            due = (done // self.every_n_batches + 1) * self.every_n_batches
        total = trainer.epoch_plan.num_batches
        if self.every_n_percent and not math.isinf(total) and total > 0:
            step = total * self.every_n_percent / 100
            k = math.floor(done / step + 1e-9) + 1
            due = min(due, max(done + 1, math.ceil(k * step - 1e-9)))
        self._next_batch = due
        self._next_time = now + self.every_n_seconds if self.every_n_seconds else math.inf

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Print an in-epoch line when one is due."""
        done = batch_idx + 1
        if done < self._next_batch and time.monotonic() < self._next_time:
            return
        now = time.monotonic()
        total = trainer.epoch_plan.num_batches
        if self._enabled and done < total:  # the epoch line covers the last batch
            of = "" if math.isinf(total) else f"/{int(total)}"
            metrics = format_metrics(trainer.progress_bar_metrics)
            left = batches_left(trainer, done, total)
            self._print(f"{self._prefix(trainer)}  batch {done}{of}  {metrics}  [{self._rate(done, left, now)}]")
        self._plan_next(trainer, done, now)

    def _rate(self, done: int, left: float, now: float) -> str:
        elapsed = now - self._epoch_start
        rate = done / elapsed if elapsed > 0 else math.inf
        text = f"{rate:.3g} batches/s"
        if not math.isinf(left) and rate > 0:
            text += f", {format_duration(left / rate)} left"
        return text

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Print the epoch line."""
        elapsed = time.monotonic() - self._epoch_start
        if self._enabled:
            metrics = format_metrics(trainer.progress_bar_metrics)
            self._print(f"{self._prefix(trainer)}  {metrics}  ({elapsed:.2f}s)")

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """After ``trainer.validate``, print its metrics (validation inside fit shows on the epoch line)."""
        if trainer.stage == "validate" and self._enabled:
            self._print(f"validate  {format_metrics(trainer.last_eval_metrics)}")

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Print the test metrics."""
        if self._enabled:
            self._print(f"test  {format_metrics(trainer.last_eval_metrics)}")

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Start the clock for periodic lines of a long test run."""
        self._start_eval()

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Start the clock for periodic lines of a long predict run."""
        self._start_eval()

    def _start_eval(self) -> None:
        self._eval_count = 0
        self._epoch_start = time.monotonic()
        self._next_time = self._epoch_start + self.every_n_seconds if self.every_n_seconds else math.inf

    def on_test_batch_end(self, trainer: Trainer, module: TrainingModule, *args: Any, **kwargs: Any) -> None:
        """Print a line every ``every_n_seconds`` of a test or predict run."""
        self._eval_tick(str(trainer.stage))

    on_predict_batch_end = on_test_batch_end

    def _eval_tick(self, stage: str) -> None:
        self._eval_count += 1
        now = time.monotonic()
        if now >= self._next_time:
            self._next_time = now + (self.every_n_seconds or math.inf)
            if self._enabled:
                self._print(f"{stage}  batch {self._eval_count}  [{self._rate(self._eval_count, math.inf, now)}]")

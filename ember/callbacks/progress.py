"""`ProgressLine`: plain progress output, one line per epoch (and per evaluation)."""

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
    return "  ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))


class ProgressLine(Callback):
    """Prints a line at the end of each training epoch and each validate/test run.

    Epoch lines show the epoch, the optimizer step, every metric logged with
    ``prog_bar=True`` and the epoch's wall time; validate/test lines show all
    their epoch metrics. With ``every_n_batches`` it
    also prints inside an epoch. Only the global-zero process prints. Enabled
    by ``Trainer(enable_progress_bar=True)`` (the default).
    """

    def __init__(self, every_n_batches: int | None = None, stream: TextIO | None = None) -> None:
        self.every_n_batches = every_n_batches
        self.stream = stream
        self._epoch_start = 0.0

    def _print(self, trainer: Trainer, text: str) -> None:
        if trainer.is_global_zero:
            print(text, file=self.stream or sys.stdout, flush=True)

    def _prefix(self, trainer: Trainer) -> str:
        total = f"/{trainer.max_epochs}" if trainer.max_epochs is not None else ""
        return f"epoch {trainer.current_epoch + 1}{total}  step {trainer.global_step}"

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._epoch_start = time.monotonic()

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.every_n_batches and (batch_idx + 1) % self.every_n_batches == 0:
            n = trainer.epoch_plan.num_batches
            of = "" if math.isinf(n) else f"/{int(n)}"
            metrics = format_metrics(trainer.progress_bar_metrics)
            self._print(trainer, f"{self._prefix(trainer)}  batch {batch_idx + 1}{of}  {metrics}")

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        elapsed = time.monotonic() - self._epoch_start
        metrics = format_metrics(trainer.progress_bar_metrics)
        self._print(trainer, f"{self._prefix(trainer)}  {metrics}  ({elapsed:.2f}s)")

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.stage == "validate":
            self._print(trainer, f"validate  {format_metrics(trainer.last_eval_metrics)}")

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._print(trainer, f"test  {format_metrics(trainer.last_eval_metrics)}")

"""`RichProgressBar`: live progress bars in a terminal, redrawn at most ``refresh_rate_hz`` times a second.

``rich`` is imported when the first bar appears. Per batch the callback only
counts and reads the clock; everything else (updating the bars, reading the
``prog_bar`` metrics, which costs a host sync, and drawing) happens in
`_refresh`, at most ``refresh_rate_hz`` times a second.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback
from ember.callbacks.progress import format_metrics

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.progress import Progress, TaskID

    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

_EVAL_TITLES = {"validation": "Validation", "test": "Testing", "predict": "Predicting"}


class RichProgressBar(Callback):
    """Training, validation, test and predict bars with count, rate, elapsed and remaining time, and metrics.

    The default progress display when stdout is a terminal. The training bar
    shows ``Epoch k/N``, the batch count, batches per second, elapsed and
    remaining time, and every metric logged with ``prog_bar=True``. A
    validation bar appears under it while validation runs. With ``leave=True``
    each finished epoch stays on screen as a line. ``trainer.validate`` and
    ``trainer.test`` end with a table of their metrics.

    The display is redrawn at most ``refresh_rate_hz`` times a second (plus
    once when a bar finishes), whatever the step rate. Only the global-zero
    process draws. ``console`` defaults to a ``rich.console.Console()`` on stdout.
    """

    def __init__(self, refresh_rate_hz: float = 10.0, *, leave: bool = True, console: Console | None = None) -> None:
        if not refresh_rate_hz > 0:
            raise ValueError(f"RichProgressBar(refresh_rate_hz={refresh_rate_hz!r}): use a positive rate")
        self.refresh_rate_hz = refresh_rate_hz
        self.leave = leave
        self.console = console
        #: Number of times the display was drawn (for tests and curious users).
        self.refresh_count = 0
        self._interval_s = 1.0 / refresh_rate_hz
        self._enabled = True
        self._progress: Progress | None = None
        self._train_task: TaskID | None = None
        self._eval_task: TaskID | None = None
        self._train_done = 0
        self._train_left = False  # the current epoch's bar was kept as a line
        self._eval_done = 0
        self._next_refresh = 0.0
        self._pending: list[RenderableType] = []  # finished-epoch lines, printed at the next refresh
        self._trainer: Trainer | None = None

    # --- drawing ----------------------------------------------------------------
    def _start(self) -> Progress:
        if self._progress is None:
            self._progress = build_progress(self.console)
            self._progress.start()
            self.refresh_count = 0
            self._next_refresh = 0.0
        return self._progress

    def _stop(self) -> None:
        progress = self._progress
        if progress is None:
            return
        if self._train_task is not None and self._train_left:  # its final state is already a line
            progress.remove_task(self._train_task)
            self._train_task = None
        pending, self._pending = self._pending, []  # printed below the final bars
        self._refresh(force=True)
        progress.stop()
        if pending:
            from rich.console import Group

            progress.console.print(Group(*pending))
        self._progress = None
        self._train_task = self._eval_task = None

    def _refresh(self, force: bool = False) -> None:
        """Bring the bars up to date and draw them, unless the last draw was less than 1/rate ago."""
        now = time.monotonic()
        progress, trainer = self._progress, self._trainer
        if progress is None or trainer is None or (not force and now < self._next_refresh):
            return
        self._next_refresh = now + self._interval_s
        metrics = format_metrics(trainer.progress_bar_metrics)
        if self._train_task is not None:
            progress.update(self._train_task, completed=self._train_done, metrics=metrics)
        if self._eval_task is not None:
            progress.update(self._eval_task, completed=self._eval_done)
        if self._pending:
            from rich.console import Group

            progress.console.print(Group(*self._pending))
            self._pending.clear()
        progress.refresh()
        self.refresh_count += 1

    @staticmethod
    def _total(n: float) -> float | None:
        return None if math.isinf(n) else float(n)

    # --- hooks ----------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Draw only on the global-zero process."""
        self._enabled = trainer.is_global_zero
        self._trainer = trainer

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Draw the final state and stop the display (also after an exception)."""
        self._stop()
        self._trainer = None

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Show the training bar."""
        if self._enabled:
            self._train_task = self._start().add_task("Epoch", total=None, metrics="")

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Reset the training bar for the new epoch."""
        if self._progress is None or self._train_task is None:
            return
        of = f"/{trainer.max_epochs - 1}" if trainer.max_epochs is not None else ""  # numbered from 0: the last
        self._train_done = 0
        self._train_left = False
        self._progress.reset(
            self._train_task,
            total=self._total(trainer.epoch_plan.num_batches),
            description=f"Epoch {trainer.current_epoch}{of}",
        )

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the batch; redraw when a refresh is due."""
        self._train_done = batch_idx + 1
        if time.monotonic() >= self._next_refresh:
            self._refresh()

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """With ``leave=True``, keep the finished epoch's bar as a line (printed at the next refresh)."""
        progress, task = self._progress, self._train_task
        if progress is None or task is None:
            return
        progress.update(task, completed=self._train_done, metrics=format_metrics(trainer.progress_bar_metrics))
        if self.leave:
            self._pending.append(progress.make_tasks_table([t for t in progress.tasks if t.id == task]))
            self._train_left = True
        self._refresh()

    def on_sanity_check_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Show the sanity-check bar."""
        if self._enabled:
            steps = math.inf if trainer.num_sanity_val_steps == -1 else trainer.num_sanity_val_steps
            self._add_eval_task("Sanity check", sum(min(steps, n) for n in trainer.num_val_batches))

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Show the validation bar (the sanity check has its own)."""
        if self._enabled and not trainer.sanity_checking:
            total = sum(trainer.num_val_batches) if trainer.stage == "fit" else _eval_total(trainer)
            self._add_eval_task("Validation", total)

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Show the test bar."""
        if self._enabled:
            self._add_eval_task("Testing", _eval_total(trainer))

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Show the predict bar."""
        if self._enabled:
            self._add_eval_task("Predicting", _eval_total(trainer))

    def _add_eval_task(self, title: str, total: float) -> None:
        progress = self._start()
        if self._eval_task is not None:
            progress.remove_task(self._eval_task)
        self._eval_done = 0
        self._eval_task = progress.add_task(title, total=self._total(total), metrics="")

    def _eval_batch(self) -> None:
        self._eval_done += 1
        if time.monotonic() >= self._next_refresh:
            self._refresh()

    def on_validation_batch_end(self, trainer: Trainer, module: TrainingModule, *args: Any, **kwargs: Any) -> None:
        """Count the batch; redraw when a refresh is due (test and predict batches too)."""
        self._eval_batch()

    on_test_batch_end = on_validation_batch_end
    on_predict_batch_end = on_validation_batch_end

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Inside fit, remove the validation bar; after ``trainer.validate``, complete it and add the metrics table."""
        if self._progress is None or self._eval_task is None:
            return
        if trainer.stage == "fit":
            self._progress.remove_task(self._eval_task)
            self._eval_task = None
        else:
            self._complete_eval_task()
            self._print_metrics(trainer, "Validate")

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Complete the test bar and add the metrics table."""
        self._complete_eval_task()
        self._print_metrics(trainer, "Test")

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Complete the predict bar."""
        self._complete_eval_task()

    def _complete_eval_task(self) -> None:
        """A bar without a known total becomes full once its run is over."""
        if self._progress is not None and self._eval_task is not None:
            self._progress.update(self._eval_task, total=self._eval_done, completed=self._eval_done)

    def _print_metrics(self, trainer: Trainer, title: str) -> None:
        if self._progress is None or not trainer.last_eval_metrics:
            return
        from rich.table import Table

        table = Table(title=f"{title} metrics")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for name, value in sorted(trainer.last_eval_metrics.items()):
            table.add_row(name, f"{value:.6g}")
        self._pending.append(table)


def _eval_total(trainer: Trainer) -> float:
    """Batches of the running validate/test/predict, when the trainer knows them."""
    counts = getattr(trainer, "num_eval_batches", None)
    return sum(counts) if counts else math.inf


def build_progress(console: Console | None = None) -> Progress:
    """A ``rich.progress.Progress`` with ember's columns, drawn only when asked (no refresh thread)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        """Batches per second."""

        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            if speed is None and task.elapsed:  # fewer than two updates so far: the mean rate
                speed = task.completed / task.elapsed
            return Text("" if speed is None else f"{speed:.2f} it/s", style="progress.data.speed")

    class RemainingColumn(ProgressColumn):
        """Time left as ``H:MM:SS``, or ``-:--:--`` while unknown."""

        def render(self, task: Task) -> Text:
            remaining = task.time_remaining
            if remaining is None:
                return Text("-:--:--", style="progress.remaining")
            minutes, seconds = divmod(int(remaining), 60)
            hours, minutes = divmod(minutes, 60)
            return Text(f"{hours}:{minutes:02d}:{seconds:02d}", style="progress.remaining")

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("<"),
        RemainingColumn(),
        RateColumn(),
        TextColumn("{task.fields[metrics]}"),
        console=console or Console(),
        auto_refresh=False,
    )

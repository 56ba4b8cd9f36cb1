"""The ``SummaryWriter`` of `TensorBoardLogger.experiment`, writing into the logger's `EventFile`.

Imported only when a run asks for histograms or for ``experiment`` (``torch.utils.tensorboard`` is a
slow import). TensorBoard's own writer names its files ``<seconds>.<host>.<pid>.<counter>``, and the
counter sorts as text (a process's 10th file sorts before its 9th); as TensorBoard reads a folder's
files in name order, a resumed run's purge could then apply before the events it should discard. Every
event goes through `EventFile` instead, whose names sort in the order the files were made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter

if TYPE_CHECKING:
    from ember.loggers.tensorboard import EventFile


class _EventFileWriter(FileWriter):
    """``FileWriter``'s interface over an `EventFile` (its events are written as they come)."""

    def __init__(self, events: EventFile) -> None:  # no super().__init__(): it would open a file of its own
        self._events = events

    def get_logdir(self) -> str:
        return str(self._events.path.parent)

    def add_event(self, event: Any, step: int | None = None, walltime: float | None = None) -> None:
        event.wall_time = time.time() if walltime is None else walltime
        if step is not None:
            event.step = int(step)
        self._events.add_event(event)

    def flush(self) -> None:
        self._events.flush()

    def close(self) -> None:
        self._events.close()

    def reopen(self) -> None:
        raise RuntimeError("a closed writer opens a new event file on its next write; reopen() is not needed")


class _Writer(SummaryWriter):
    def __init__(self, log_dir: Path, event_file: Callable[[], EventFile]) -> None:
        self._ember_event_file = event_file  # set first: SummaryWriter.__init__ opens the file writer
        super().__init__(str(log_dir))

    def _get_file_writer(self) -> FileWriter:
        if self.all_writers is None or self.file_writer is None:
            writer = _EventFileWriter(self._ember_event_file())
            self.file_writer = writer  # type: ignore[assignment]
            self.all_writers = {writer.get_logdir(): writer}  # type: ignore[assignment]
        return self.file_writer  # type: ignore[return-value]


def summary_writer(log_dir: Path, event_file: Callable[[], EventFile]) -> SummaryWriter:
    """A ``SummaryWriter`` for `log_dir` whose events go to ``event_file()`` (the logger's open file, or a
    new one when it was closed)."""
    return _Writer(log_dir, event_file)

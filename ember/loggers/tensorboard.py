"""`TensorBoardLogger`: scalars, hyperparameters with their final metrics, and histograms.

TensorBoard itself (``torch.utils.tensorboard``) is imported when the first
event is written, so ``import ember`` stays light.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.loggers.logger import Logger, public_params

if TYPE_CHECKING:
    from torch import Tensor
    from torch.utils.tensorboard import SummaryWriter


#: Logging calls queued at most before they are handed to TensorBoard (bounds the queue's memory).
MAX_QUEUED = 1000


class TensorBoardLogger(Logger):
    """Writes TensorBoard event files: one scalar per metric per logging step.

    Without ``save_dir`` the events go to ``<run dir>/tensorboard``, so
    ``tensorboard --logdir runs`` shows every run. Hyperparameters appear in
    TensorBoard's HPARAMS tab together with the final value of every logged
    metric (written when the run finishes). ``log_histograms_every_n_steps=N``
    also writes histograms of every weight and gradient (before clipping)
    every N optimizer steps.

    Scalars are queued and handed to TensorBoard in one batch at the next
    `save` (epoch ends, before checkpoints, at the end of the run), once
    ``flush_secs`` have passed since the last batch (as often as TensorBoard's
    own writer reaches the disk), or at `MAX_QUEUED` queued calls. A logging
    step costs one list append, not TensorBoard's per-event work and
    writer-thread wake-up.

    On resume (`load_state_dict`) events after the checkpoint's step are purged,
    so the curves read as if the run had never stopped.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        *,
        log_histograms_every_n_steps: int | None = None,
        flush_secs: float = 30.0,
    ) -> None:
        super().__init__(save_dir)
        if log_histograms_every_n_steps is not None and log_histograms_every_n_steps < 1:
            raise ValueError(f"log_histograms_every_n_steps={log_histograms_every_n_steps!r}: use a positive int")
        self.log_histograms_every_n_steps = log_histograms_every_n_steps
        self.flush_secs = flush_secs
        self._writer: SummaryWriter | None = None
        self._purge_step: int | None = None
        self._hparams: dict[str, Any] | None = None
        self._hparams_written = False
        self._metric_names: dict[str, None] = {}  # insertion-ordered set
        self._queued: list[tuple[int, float, dict[str, float]]] = []  # (step, wall time, metrics)
        self._next_write = time.monotonic() + flush_secs

    def attach(self, run_dir: Path) -> None:
        """Without ``save_dir``, write into ``<run_dir>/tensorboard``."""
        if self._save_dir is None:
            self._save_dir = Path(run_dir) / "tensorboard"

    @property
    def experiment(self) -> SummaryWriter:
        """The underlying ``torch.utils.tensorboard.SummaryWriter`` (created on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.log_dir), purge_step=self._purge_step, flush_secs=self.flush_secs)
            self._purge_step = None  # purge once, when the resumed run writes its first event
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue one scalar per metric at `step`, stamped with the time of this call."""
        self._queued.append((step, time.time(), metrics))
        if len(self._queued) >= MAX_QUEUED or time.monotonic() >= self._next_write:
            self._write_queued()

    def _write_queued(self) -> None:
        queued, self._queued = self._queued, []
        self._next_write = time.monotonic() + self.flush_secs
        if not queued:
            return
        writer = self.experiment
        for step, wall_time, metrics in queued:
            for name, value in metrics.items():
                writer.add_scalar(name, value, step, walltime=wall_time)
                self._metric_names[name] = None

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Remember the hyperparameters; they are written with the final metrics when the run finishes."""
        self._hparams = flatten_params(public_params(params))

    def log_histograms(self, values: dict[str, Tensor], step: int) -> None:
        """Add a histogram per tensor at `step` (copies each tensor to the CPU)."""
        writer = self.experiment
        for name, tensor in values.items():
            writer.add_histogram(name, tensor.detach().float().cpu(), step)

    def save(self) -> None:
        """Write the queued scalars and flush every event to disk."""
        self._write_queued()
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        """Write the queued scalars, the hyperparameters with the final metrics (once), and close the file."""
        self._write_queued()
        if self._hparams and not self._hparams_written:
            self._write_hparams(self._hparams)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a run: events logged after ``state["step"]`` are purged when writing resumes."""
        self._purge_step = int(state["step"]) + 1
        self._queued = [queued for queued in self._queued if queued[0] < self._purge_step]  # the rest is purged
        if self._writer is not None:  # reopen so the purge marker is written
            self._writer.close()
            self._writer = None

    def _write_hparams(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # The HPARAMS tab reads each metric's value from its scalar curve; the
        # experiment summary only has to name them.
        metrics = {name: 0.0 for name in self._metric_names if name != "epoch"}
        file_writer = self.experiment.file_writer
        assert file_writer is not None  # SummaryWriter opens it in __init__
        for summary in hparams(params, metrics):
            file_writer.add_summary(summary)
        self._hparams_written = True


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become ``a/b`` keys; values TensorBoard cannot show (lists, None, objects) become strings."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{name}/"))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat

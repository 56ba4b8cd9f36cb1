"""The `Logger` interface shared by every logger."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Logger:
    """Receives metrics as floats and hyperparameters; writes them somewhere.

    The trainer calls loggers on the global-zero process only, every
    ``log_every_n_steps`` optimizer steps and at epoch ends. Subclasses
    implement `log_metrics` and may implement the rest.

    A logger built without ``save_dir`` writes into the trainer's run
    directory (``runs/<name>/<version>/``), which the trainer hands over with
    `attach` before the first write.
    """

    def __init__(self, save_dir: str | os.PathLike[str] | None = None) -> None:
        self._save_dir = Path(save_dir) if save_dir is not None else None

    def attach(self, run_dir: Path) -> None:
        """Called by the trainer with its run directory; used when no ``save_dir`` was given."""
        if self._save_dir is None:
            self._save_dir = Path(run_dir)

    @property
    def log_dir(self) -> Path:
        """Folder this logger writes into."""
        if self._save_dir is None:
            raise RuntimeError(f"{type(self).__name__} has no save_dir yet: pass one, or use it inside a Trainer")
        return self._save_dir

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write metrics logged at optimizer step `step`."""
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Write the run's hyperparameters (the resolved config, else the module's hparams)."""

    def save(self) -> None:
        """Flush buffered data to disk (called at epoch ends and before checkpoints)."""

    def finalize(self, status: str) -> None:
        """Close the run; `status` is "success", "failed" or "interrupted"."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this logger's run (e.g. a run id)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the run described by `state`; `state["step"]` is the resumed optimizer step."""

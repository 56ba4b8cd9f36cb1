"""The `Logger` interface and run-directory versioning shared by every logger."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def next_version(root: Path) -> str:
    """``version_N`` with N one past the highest existing ``version_*`` folder in `root`."""
    numbers = [int(m.group(1)) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
    return f"version_{max(numbers, default=-1) + 1}"


class Logger:
    """Receives metrics as floats and hyperparameters; writes them somewhere.

    The trainer calls loggers on the global-zero process only, every
    ``log_every_n_steps`` optimizer steps and at epoch ends. Subclasses
    implement `log_metrics` and may implement the rest.
    """

    @property
    def name(self) -> str:
        return "default"

    @property
    def version(self) -> str:
        return "version_0"

    @property
    def log_dir(self) -> Path | None:
        """Folder this logger writes into (None if it writes nowhere on disk)."""
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write metrics logged at optimizer step `step`."""
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Write the run's hyperparameters (module hparams and config)."""

    def save(self) -> None:
        """Flush buffered data to disk (called at epoch ends)."""

    def finalize(self, status: str) -> None:
        """Close the run; `status` is "success", "failed" or "interrupted"."""

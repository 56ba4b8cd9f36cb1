"""`CSVLogger`: ``metrics.csv`` and ``hparams.yaml`` in the run directory."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any

from ember.loggers.logger import Logger, next_version


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CSVLogger(Logger):
    """Writes one row per logging call to ``<save_dir>/<name>/<version>/metrics.csv``.

    Columns are ``step``, ``epoch`` (when known) and every metric seen so far;
    a metric absent from a row is an empty cell. Rows are buffered and written
    at epoch ends and when the run finishes. ``version=None`` picks the next
    free ``version_N``; the folder is created on the first write.
    """

    def __init__(self, save_dir: str | os.PathLike[str] = "runs", name: str = "default", version: str | None = None):
        self._root = Path(save_dir) / name
        self._name = name
        self._version = version
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = ["step"]
        self._written = 0
        self._header: list[str] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        if self._version is None:
            self._version = next_version(self._root)
        return self._version

    @property
    def log_dir(self) -> Path:
        return self._root / self.version

    @property
    def metrics_path(self) -> Path:
        return self.log_dir / "metrics.csv"

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        row: dict[str, Any] = {"step": step, **metrics}
        for key in row:
            if key not in self._columns:
                self._columns.append(key)
        self._rows.append(row)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from omegaconf import OmegaConf

        self.log_dir.mkdir(parents=True, exist_ok=True)
        text = OmegaConf.to_yaml(OmegaConf.create(_plain(params)))
        _write_atomic(self.log_dir / "hparams.yaml", text)

    def save(self) -> None:
        if len(self._rows) == self._written:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._header == self._columns:  # same columns: append the new rows
            with open(self.metrics_path, "a", encoding="utf-8", newline="") as f:
                self._writer(f).writerows(self._rows[self._written :])
                f.flush()
                os.fsync(f.fileno())
        else:  # a new metric appeared: rewrite the file (atomically) under the wider header
            buffer = io.StringIO()
            writer = self._writer(buffer)
            writer.writeheader()
            writer.writerows(self._rows)
            _write_atomic(self.metrics_path, buffer.getvalue())
            self._header = list(self._columns)
        self._written = len(self._rows)

    def _writer(self, f: Any) -> csv.DictWriter[str]:
        return csv.DictWriter(f, fieldnames=self._columns, lineterminator="\n")

    def finalize(self, status: str) -> None:
        self.save()


def _plain(value: Any) -> Any:
    """Reduce hyperparameters to YAML-safe values (repr for anything exotic)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)

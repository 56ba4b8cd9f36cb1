"""`CSVLogger`: ``metrics.csv`` and ``hparams.yaml`` in the run directory."""

from __future__ import annotations

import csv
import enum
import io
import os
from pathlib import Path
from typing import Any, Literal

from ember.checkpoint.files import atomic_write
from ember.loggers.logger import Logger, public_params


class _Layout(enum.Enum):
    """The default of ``CSVLogger(name=...)``: ember's layout (no name or version folders)."""

    RUN_DIR = "the run directory"

    def __repr__(self) -> str:
        return "<ember's layout: save_dir itself>"


class CSVLogger(Logger):
    """Writes one row per logging call to ``metrics.csv`` (and ``hparams.yaml``).

    Columns are ``step``, ``epoch`` and every metric seen so far; a metric
    absent from a row is an empty cell. Rows and hyperparameters are buffered
    and written at epoch ends, before checkpoints and when the run finishes. Without ``save_dir``
    the files go into the trainer's run directory. On resume, rows logged
    after the checkpoint's step are dropped, so the file reads as if the run
    had never stopped.

    Lightning's layout and keys, on request: with ``name`` or ``version`` the files go to
    ``<save_dir>/<name>/<version>`` as Lightning's ``CSVLogger`` puts them (``name=None`` or ``""``: no name
    folder; ``version`` an int is ``version_<int>``, a string is the folder's name, None is the next free
    ``version_N``). Without either (the default), the files go into ``save_dir`` itself: unlike Lightning,
    whose default ``name`` is ``"lightning_logs"``. ``prefix`` is put before every metric key with a ``-``
    (``prefix="fold0"`` writes ``fold0-train_loss`` and ``fold0-epoch``), as Lightning does.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        name: str | Literal[_Layout.RUN_DIR] | None = _Layout.RUN_DIR,
        version: int | str | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(save_dir)
        if name is not _Layout.RUN_DIR and name is not None and not isinstance(name, str):
            raise TypeError(f"CSVLogger(name={name!r}): use a folder name (a str), or None for none")
        if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))):
            raise TypeError(f"CSVLogger(version={version!r}): use an int (version_<int>), a folder name, or None")
        if not isinstance(prefix, str):
            raise TypeError(f"CSVLogger(prefix={prefix!r}): use a str")
        self._name, self._version, self.prefix = name, version, prefix
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = ["step"]
        self._written = 0
        self._hparams: dict[str, Any] | None = None  # to write at the next save
        self._header: list[str] = []
        self._adopted = False  # whether a metrics.csv already there was read (see `_adopt_existing`)

    @property
    def name(self) -> str:
        """The name folder (``""``: none), as Lightning's ``logger.name``."""
        return "" if self._name is _Layout.RUN_DIR or self._name is None else self._name

    @property
    def version(self) -> int | str | None:
        """The version: given, else the next free ``version_N`` under ``<save_dir>/<name>`` once the folder is
        first asked for; None in ember's layout."""
        if self._version is None and self._name is not _Layout.RUN_DIR:
            self._version = _next_version(super().log_dir / self.name)
        return self._version

    @property
    def log_dir(self) -> Path:
        """``<save_dir>/<name>/<version>`` with a name or version, else ``save_dir`` (or the run directory)."""
        base = super().log_dir
        version = self.version
        if version is None:
            return base
        return base / self.name / (version if isinstance(version, str) else f"version_{version}")

    @property
    def metrics_path(self) -> Path:
        """``<log_dir>/metrics.csv``."""
        return self.log_dir / "metrics.csv"

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer one row (its keys after `prefix`); a metric not seen before adds a column."""
        if self.prefix:
            metrics = {f"{self.prefix}-{key}": value for key, value in metrics.items()}
        row: dict[str, Any] = {"step": step, **metrics}
        for key in row:
            if key not in self._columns:
                self._columns.append(key)
        self._rows.append(row)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Keep the hyperparameters for ``hparams.yaml`` (entries named like credentials are left out).

        The file is written with the rows, at the next `save` (an epoch end, a checkpoint, the run's end),
        so a run's first batch does not wait for a YAML writer's import and an fsync.
        """
        self._hparams = _plain(public_params(params))

    def save(self) -> None:
        """Write ``hparams.yaml`` if new, then the buffered rows: appended when the columns are unchanged, else
        the file is rewritten atomically."""
        if self._hparams is not None:
            import yaml  # PyYAML alone (about 12 ms to import; omegaconf on top of it adds about 40 ms)

            self.log_dir.mkdir(parents=True, exist_ok=True)
            text = yaml.safe_dump(self._hparams, sort_keys=False, default_flow_style=False)  # non-ASCII escaped
            atomic_write(self.log_dir / "hparams.yaml", text)
            self._hparams = None
        if len(self._rows) == self._written:
            return
        self._adopt_existing()
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
            atomic_write(self.metrics_path, buffer.getvalue())
            self._header = list(self._columns)
        self._written = len(self._rows)

    def _adopt_existing(self) -> None:
        """Keep the rows of a ``metrics.csv`` this logger finds in its folder before its first write (testing a
        finished run's checkpoint writes into that run): they come first, and the file is rewritten with them."""
        if self._adopted:
            return
        self._adopted = True
        if self._written or not self.metrics_path.exists():
            return
        columns, rows = self._read()
        self._rows = rows + self._rows
        self._columns = columns + [c for c in self._columns if c not in columns]
        self._header = []

    def _read(self) -> tuple[list[str], list[dict[str, Any]]]:
        with open(self.metrics_path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            return list(reader.fieldnames or ["step"]), [{k: v for k, v in row.items() if v != ""} for row in reader]

    def _writer(self, f: Any) -> csv.DictWriter[str]:
        return csv.DictWriter(f, fieldnames=self._columns, lineterminator="\n")

    def finalize(self, status: str) -> None:
        """Write what is left."""
        self.save()

    def state_dict(self) -> dict[str, Any]:
        """How many rows the checkpoint covers (rows are saved to disk before every checkpoint)."""
        return {"rows": len(self._rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the rows the checkpoint covers; later ones (even at the same step) are replayed.

        Checkpoints without a row count keep the rows up to `state["step"]`.
        """
        self._adopted = True
        if not self.metrics_path.exists():
            return
        self._columns, rows = self._read()
        if "rows" in state:
            self._rows = rows[: state["rows"]]
        else:
            self._rows = [row for row in rows if int(row["step"]) <= state["step"]]
        self._header, self._written = [], 0  # rewrite on the next save


def _next_version(root: Path) -> int:
    """One more than the largest ``version_N`` folder in `root` (0 when there is none), as Lightning counts."""
    numbers = [
        int(path.name[len("version_") :])
        for path in (root.iterdir() if root.is_dir() else [])
        if path.is_dir() and path.name.startswith("version_") and path.name[len("version_") :].isdigit()
    ]
    return max(numbers) + 1 if numbers else 0


def _plain(value: Any) -> Any:
    """Reduce hyperparameters to YAML-safe values (repr for anything exotic)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None:
        return None
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return _plain(value.item())  # a numpy scalar or a 0-d tensor: its Python number
    for kind in (bool, int, float, str):  # subclasses (numpy's float64, an IntEnum) as the plain type
        if isinstance(value, kind):
            return kind(value)
    return repr(value)

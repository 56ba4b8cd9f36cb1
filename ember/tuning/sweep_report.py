"""The end of a sweep: the table of trials, ``best.yaml``, ``trials.csv`` and the TensorBoard HPARAMS view."""

from __future__ import annotations

import csv
import io
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.tuning.space import SweepSpace, override

#: Optuna trial states that count towards a sweep's N trials.
FINISHED = ("COMPLETE", "PRUNED")


@dataclass
class SweepResult:
    """How a sweep ended: the best finished trial, the counts, and where everything was written."""

    directory: Path
    metric: str
    direction: str
    best_number: int | None = None
    best_value: float | None = None
    best_params: dict[str, Any] = field(default_factory=dict)
    best_config: Path | None = None
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    epochs_run: int = 0
    epochs_without_pruning: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pruned_epoch_fraction(self) -> float:
        """Share of the epochs a sweep without pruning would have run that pruning saved."""
        if not self.epochs_without_pruning:
            return 0.0
        return 1.0 - self.epochs_run / self.epochs_without_pruning


def rows_of(study: Any, space: SweepSpace) -> list[dict[str, Any]]:
    """One dict per finished trial, best first (by the last reported value of the metric)."""
    rows = []
    for trial in study.get_trials(deepcopy=False):
        if trial.state.name not in FINISHED or trial.value is None:
            continue
        rows.append(
            {
                "number": trial.number,
                "state": trial.state.name.lower(),
                "value": float(trial.value),
                "params": dict(trial.params),
                "epochs": int(trial.user_attrs.get("epochs", 0)),
                "max_epochs": trial.user_attrs.get("max_epochs"),
                "seconds": trial.user_attrs.get("seconds"),
                "run_dir": trial.user_attrs.get("run_dir"),
                "retry_of": trial.user_attrs.get("retry_of"),
            }
        )
    sign = -1.0 if space.direction == "maximize" else 1.0
    rows.sort(key=lambda row: (sign * row["value"], row["number"]))
    return rows


def report(where: Path, study: Any, space: SweepSpace, spec: dict[str, Any], verbose: bool = True) -> SweepResult:
    """Write ``best.yaml``, ``trials.csv`` and ``tensorboard/``; print the table and the summary."""
    rows = rows_of(study, space)
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    result = SweepResult(where, space.metric, space.direction, rows=rows)
    result.complete, result.pruned, result.failed = (states.count(s) for s in ("COMPLETE", "PRUNED", "FAIL"))
    result.epochs_run = sum(row["epochs"] for row in rows)
    result.epochs_without_pruning = sum(int(row["max_epochs"] or row["epochs"]) for row in rows)
    complete = [row for row in rows if row["state"] == "complete"]
    if complete:
        best = complete[0]
        result.best_number, result.best_value, result.best_params = best["number"], best["value"], best["params"]
        result.best_config = write_best_config(where, spec, best, space)
    write_csv(where / "trials.csv", rows, space)
    write_tensorboard(where / "tensorboard", rows, space)
    if verbose:
        print_table(rows, space)
        print(summary(result, spec), flush=True)
    return result


def summary(result: SweepResult, spec: dict[str, Any]) -> str:
    lines = [
        f"sweep: {result.complete + result.pruned} of {spec['trials']} trials finished ({result.complete} complete, "
        f"{result.pruned} pruned; {result.failed} failed)"
    ]
    if result.epochs_without_pruning:
        lines.append(
            f"sweep: {result.epochs_run} epochs run of {result.epochs_without_pruning} without pruning "
            f"({100 * result.pruned_epoch_fraction:.0f}% saved)"
        )
    if result.best_config is not None:
        lines.append(f"sweep: best trial {result.best_number}: {result.metric} {result.best_value:.4f}")
        lines.append(f"sweep: best config {result.best_config}; train it with: ember fit -c {result.best_config}")
    else:
        lines.append("sweep: no trial completed, so there is no best config")
    lines.append(f"sweep: compare the trials with: tensorboard --logdir {result.directory / 'tensorboard'}")
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]], space: SweepSpace) -> None:
    """A rich table of the finished trials, best first."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sweep: {space.metric} ({space.direction})", title_justify="left")
    for name in ("trial", "state", space.metric, *space.parameters, "epochs", "seconds"):
        table.add_column(name, justify="left" if name == "state" else "right")
    for row in rows:
        values = [_format(row["params"].get(key)) for key in space.parameters]
        seconds = f"{row['seconds']:.1f}" if row["seconds"] is not None else ""
        table.add_row(str(row["number"]), row["state"], f"{row['value']:.4f}", *values, str(row["epochs"]), seconds)
    Console(width=max(100, shutil.get_terminal_size().columns)).print(table)


def _format(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_best_config(where: Path, spec: dict[str, Any], best: dict[str, Any], space: SweepSpace) -> Path:
    """The base config with the best trial's values, resolved, as YAML that ``ember fit -c`` takes."""
    from ember import config

    overrides = [*spec["overrides"], *(override(k, v) for k, v in best["params"].items())]
    resolved = config.resolve(config.load(spec["configs"], overrides))
    header = (
        f"# Best trial ({best['number']}) of the sweep in {where}: {space.metric} = {best['value']:.6g}\n"
        f"# ember fit -c {where / 'best.yaml'}\n"
    )
    path = where / "best.yaml"
    _write_text(path, header + config.to_yaml(resolved))
    return path


def write_csv(path: Path, rows: list[dict[str, Any]], space: SweepSpace) -> None:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["trial", "state", space.metric, *space.parameters, "epochs", "seconds", "run_dir"])
    for row in rows:
        params = [row["params"].get(key) for key in space.parameters]
        writer.writerow(
            [row["number"], row["state"], row["value"], *params, row["epochs"], row["seconds"], row["run_dir"]]
        )
    _write_text(path, out.getvalue())


def write_tensorboard(directory: Path, rows: list[dict[str, Any]], space: SweepSpace) -> None:
    """One TensorBoard run per finished trial (``trial_<n>``) with its values as hparams and its metric.

    ``tensorboard --logdir <dir>`` then lists every trial side by side in the HPARAMS tab. The folder is
    rewritten whole at the end of every (resumed) sweep.
    """
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    partial = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    for row in rows:
        values = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in row["params"].items()}
        values["state"] = row["state"]
        metrics = {space.metric: row["value"], "epochs": float(row["epochs"])}
        writer = SummaryWriter(str(partial / f"trial_{row['number']:03d}"))
        try:
            file_writer = writer.file_writer
            assert file_writer is not None
            for summary in hparams(values, metrics):
                file_writer.add_summary(summary)
            for name, value in metrics.items():
                writer.add_scalar(name, value, 0)
        finally:
            writer.close()
    shutil.rmtree(directory, ignore_errors=True)
    if partial.exists():
        os.replace(partial, directory)


def _write_text(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)

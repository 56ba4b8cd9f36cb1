"""``ember runs [DIR]``: the runs under a runs directory as one table, what each was and how it went.

``ember runs runs`` prints (the table in full: docs/cli.md)::

    RUN            COMMAND  STATUS                   EPOCHS  STEPS  BEST            CKPTS  CHANGES
    net/version_0  fit      finished                 2       10     val/acc 0.5833  1
      eval         test     epoch=1-step=10          2       10     test/acc 0.5833
    net/version_1  fit      stopped (EarlyStopping)  1       5      val/acc 0.4583  1      trainer.max_epochs 2 -> 5

Every ``version_N`` folder under DIR is a run (sweep trials, ``sweeps/<space>/trial_N/version_0``, included).
What a row says comes from what the run left (nothing is run, nothing is written):

- command and status: ``status.json`` (`ember.checkpoint.run_status`), written by the run when it starts and
  ends; for runs without one, the command is told by the files (``lr_find.csv``: ``tune lr``; a ``sweep.json``
  two folders up: ``sweep trial``; checkpoints or ``config.yaml``: ``fit``) and the status is ``?``.
- epochs and steps: the status record, else the newest checkpoint.
- best: the monitored value of the best checkpoint, as the newest checkpoint's ``ModelCheckpoint`` state
  records it.
- checkpoints: how many complete-looking checkpoint folders ``checkpoints/`` holds.
- changes: the ``config.yaml`` keys whose values differ from the previous version of the same run name.
- evaluations of the run's checkpoints (``eval/*.json``) follow it, one row each: the stage, the checkpoint,
  its epochs and steps, and the metrics.

Rich draws the table when stdout is a terminal; plain text otherwise; ``--json`` gives the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember.checkpoint.locating import CHECKPOINT_SUBDIR, checkpoints_in, newest_valid, recorded_best, summarize
from ember.checkpoint.reading import differences
from ember.checkpoint.run_status import read_status
from ember.errors import UsageError

_VERSION = re.compile(r"version_(\d+)")
_MONITOR = re.compile(r"'monitor': '([^']*)'")
_COLUMNS = ("run", "command", "status", "started", "epochs", "steps", "best", "ckpts", "changes")
_CHANGES_SHOWN = 2


def add_parser(commands: Any) -> None:
    """Add ``ember runs`` to the ``ember`` command's subparsers."""
    sub: argparse.ArgumentParser = commands.add_parser(
        "runs",
        help="list the runs under a runs directory: command, status, progress, best metric, config changes",
        description="ember runs: one row per run under DIR (default runs): what made it (fit, validate, test, "
        "predict, tune lr, tune batch-size, sweep trial), how it ended (running, finished, stopped, failed, "
        "preempted), epochs, steps, the best monitored metric, checkpoints, and the config keys that differ from "
        "the previous run of the same name; evaluations of its checkpoints follow it. See docs/cli.md.",
        epilog="exit code 2: DIR does not exist or holds no runs.",
        allow_abbrev=False,
    )
    sub.add_argument("dir", nargs="?", default="runs", metavar="DIR", help="a runs directory (default: runs)")
    sub.add_argument("--json", action="store_true", help="print the runs as JSON")
    sub.set_defaults(debug=False, config=[])


def run(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
    """``ember runs``: print the table (or JSON) of the runs under ``args.dir``; returns the exit code."""
    if extra:
        raise UsageError(f"ember runs: unknown argument {extra[0]!r}; usage: ember runs [DIR] [--json]")
    root = Path(args.dir)
    runs = list_runs(root)
    if args.json:
        sys.stdout.write(json.dumps(runs, indent=2) + "\n")
    elif sys.stdout.isatty():
        print_rich(runs)
    else:
        sys.stdout.write(format_table(runs))
    return 0


def list_runs(root: Path) -> list[dict[str, Any]]:
    """Every run under `root`, described (`describe`), in path order (versions by number); a `UsageError`
    when `root` is not a directory or holds no run."""
    if not root.is_dir():
        raise UsageError(f"no runs directory {root}; give the folder runs are written to, e.g. `ember runs runs`")
    found = sorted(find_run_dirs(root), key=lambda p: _sort_key(p.relative_to(root)))
    if not found:
        raise UsageError(f"no runs under {root} (no version_N folders); `ember fit -c CONFIG` makes one")
    return [describe(path, root) for path in found]


def find_run_dirs(root: Path) -> list[Path]:
    """The ``version_N`` directories at any depth under `root` (not looked into: a run holds no runs)."""
    found: list[Path] = []
    for path in root.iterdir():
        if not path.is_dir() or path.is_symlink() or path.name.startswith("."):
            continue
        if _VERSION.fullmatch(path.name):
            found.append(path)
        else:
            found += find_run_dirs(path)
    return found


def _sort_key(relative: Path) -> list[tuple[int, Any]]:
    """Path parts in order, numbers as numbers (version_2 before version_10)."""
    key: list[tuple[int, Any]] = []
    for part in relative.parts:
        match = _VERSION.fullmatch(part)
        key.append((0, int(match.group(1))) if match else (1, part))
    return key


def describe(run_dir: Path, root: Path) -> dict[str, Any]:
    """One run as a dict: ``run``, ``command``, ``status``, ``reason``, ``error``, ``started``, ``epochs``,
    ``steps``, ``best`` (``{"monitor", "score"}`` or None), ``checkpoints``, ``changes`` (``[key, previous,
    this]`` triples) and ``evaluations``."""
    record = read_status(run_dir) or {}
    checkpoints = checkpoints_in(run_dir / CHECKPOINT_SUBDIR)
    newest = _newest_checkpoint(run_dir) if checkpoints else None
    summary = summarize(newest) if newest is not None else {}
    epochs, steps = record.get("epoch"), record.get("global_step")
    if not isinstance(epochs, int) or not isinstance(steps, int):
        epochs, steps = summary.get("epoch"), summary.get("global_step")
    return {
        "run": run_dir.relative_to(root).as_posix(),
        "command": record.get("command") or _guess_command(run_dir, bool(checkpoints)),
        "status": record.get("status", "?"),
        "reason": record.get("reason"),
        "error": record.get("error"),
        "started": record.get("started"),
        "epochs": epochs,
        "steps": steps,
        "best": _best(newest) if newest is not None else None,
        "checkpoints": len(checkpoints),
        "changes": config_changes(run_dir),
        "evaluations": evaluations(run_dir),
    }


def _newest_checkpoint(run_dir: Path) -> Path | None:
    import warnings

    with warnings.catch_warnings():  # a damaged checkpoint is passed over here; the run still gets its row
        warnings.simplefilter("ignore")
        return newest_valid(run_dir / CHECKPOINT_SUBDIR)


def _guess_command(run_dir: Path, has_checkpoints: bool) -> str:
    """The command of a run without a status record, from the files it left."""
    if (run_dir / "lr_find.csv").is_file():
        return "tune lr"
    if (run_dir.parent.parent / "sweep.json").is_file():
        return "sweep trial"
    if has_checkpoints or (run_dir / "config.yaml").is_file():
        return "fit"
    return "?"


def _best(checkpoint: Path) -> dict[str, Any] | None:
    """The first ModelCheckpoint's monitor and best score, as `checkpoint` recorded them."""
    found = recorded_best(checkpoint)
    if found is None:
        return None
    key, _, score = found
    monitor = _MONITOR.search(key)
    if monitor is None or not isinstance(score, (int, float)):
        return None
    return {"monitor": monitor.group(1), "score": float(score)}


def config_changes(run_dir: Path) -> list[list[Any]]:
    """``[key, previous value, this value]`` for each ``config.yaml`` key that differs from the previous
    version of the same run name (the next lower ``version_N`` with a config); [] when there is none."""
    number = int(run_dir.name.split("_")[1])
    earlier = [
        (int(m.group(1)), p)
        for p in run_dir.parent.iterdir()
        if (m := _VERSION.fullmatch(p.name)) and int(m.group(1)) < number and (p / "config.yaml").is_file()
    ]
    if not earlier or not (run_dir / "config.yaml").is_file():
        return []
    previous, current = _read_yaml(max(earlier)[1] / "config.yaml"), _read_yaml(run_dir / "config.yaml")
    if previous is None or current is None:
        return []
    found = differences(_indexed(previous), _indexed(current))
    return [[key.replace(".[", "["), old, new] for key, old, new in found]


def _indexed(value: Any) -> Any:
    """Lists as dicts keyed ``[0]``, ``[1]``, ... (at any depth), so a changed callback shows as
    ``trainer.callbacks[1].patience``, not as two whole lists."""
    if isinstance(value, dict):
        return {key: _indexed(item) for key, item in value.items()}
    if isinstance(value, list):
        return {f"[{i}]": _indexed(item) for i, item in enumerate(value)}
    return value


def _read_yaml(path: Path) -> dict[str, Any] | None:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def evaluations(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``eval/*.json`` records: ``stage``, ``checkpoint`` (its name), ``epoch``, ``global_step``,
    ``time`` and ``metrics`` (of the first dataloader), in file-name order."""
    found = []
    for path in sorted((run_dir / "eval").glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        metrics = record.get("metrics")
        metrics = metrics[0] if isinstance(metrics, list) and metrics else metrics
        found.append({
            "stage": record.get("stage"),
            "checkpoint": Path(str(record.get("checkpoint", ""))).name,
            "epoch": record.get("epoch"),
            "global_step": record.get("global_step"),
            "time": record.get("time"),
            "metrics": metrics if isinstance(metrics, dict) else {},
        })  # fmt: skip
    return found


def rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """The table's cells, one list per row: each run, then a row per evaluation of it."""
    table = []
    for item in runs:
        best = item["best"]
        changes = [f"{key} {_value(old)} -> {_value(new)}" for key, old, new in item["changes"]]
        if len(changes) > _CHANGES_SHOWN:
            changes = [*changes[:_CHANGES_SHOWN], f"+{len(changes) - _CHANGES_SHOWN} more"]
        table.append([
            item["run"],
            item["command"],
            _status(item),
            _when(item["started"]),
            _number(item["epochs"]),
            _number(item["steps"]),
            f"{best['monitor']} {best['score']:.4f}" if best else "",
            str(item["checkpoints"]),
            ", ".join(changes),
        ])  # fmt: skip
        for record in item["evaluations"]:
            metrics = "  ".join(
                f"{k} {v:.4f}" for k, v in sorted(record["metrics"].items()) if isinstance(v, (int, float))
            )
            table.append([
                "  eval", str(record["stage"]), record["checkpoint"], _when(record["time"]),
                _number(record["epoch"]), _number(record["global_step"]), metrics, "", "",
            ])  # fmt: skip
    return table


def format_table(runs: list[dict[str, Any]]) -> str:
    """The table as plain text: a header, columns padded to their widest cell, trailing spaces dropped."""
    table = [[c.upper() for c in _COLUMNS], *rows(runs)]
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    return "\n".join(lines) + "\n"


def print_rich(runs: list[dict[str, Any]]) -> None:
    """The table drawn by rich (for a terminal)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    colours = {"running": "cyan", "finished": "green", "stopped": "yellow", "failed": "red", "preempted": "magenta"}
    table = Table(*(c.upper() for c in _COLUMNS))
    for cells in rows(runs):
        is_eval = cells[0] == "  eval"
        colour = colours.get(cells[2].split(" ")[0], "")
        row = [escape(cell) for cell in cells]
        row[2] = row[2] if is_eval or not colour else f"[{colour}]{row[2]}[/{colour}]"
        table.add_row(*row, style="dim" if is_eval else None)
    Console().print(table)


def _status(item: dict[str, Any]) -> str:
    """``stopped (EarlyStopping)``, ``preempted (SIGTERM)``, ``failed (ValueError)``, ``finished``."""
    why = item["reason"] if item["status"] != "finished" else None
    if item["status"] == "failed" and isinstance(item["error"], str):
        why = item["error"].split(":", 1)[0]
    return item["status"] + (f" ({why})" if why else "")


def _when(stamp: Any) -> str:
    """``2026-12-04T09:12:33+0000`` as ``2026-12-04 09:12``."""
    return stamp[:16].replace("T", " ") if isinstance(stamp, str) else ""


def _number(value: Any) -> str:
    return str(value) if isinstance(value, int) else ""


def _value(value: Any, width: int = 24) -> str:
    """A config value as the table shows it: YAML-like, cut to `width` characters."""
    text = "(none)" if value is None else value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."

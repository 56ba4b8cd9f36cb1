"""A run's status record: ``<run dir>/status.json``, what ``ember runs`` reads to say how a run went.

A run that owns its directory (every fit; a validate / test / predict that started a new version) writes the
record twice, atomically (`atomic_write`): when it starts (``status: running``, the command, who runs it) and
when it ends (``finished``, ``stopped``, ``failed`` or ``preempted``, with the epochs and steps done, why it
stopped, and the error's first line). Nothing is written between the two, so the record costs the training
loop nothing. A run killed outright (``kill -9``, a lost node) keeps ``running``; `read_status` then asks
whether the process it names is still alive (`Holder`, as the run lock does).

The record is data: read with `json`, each field type-checked, never executed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ember.checkpoint.files import atomic_write, read_regular
from ember.checkpoint.format import CheckpointError
from ember.checkpoint.run_lock import Holder, is_held

STATUS_FILE = "status.json"

#: What a run's ``status`` may be: running, then one of the others.
STATUSES = ("running", "finished", "stopped", "failed", "preempted")

_READ_LIMIT = 1 << 16


def begin(run_dir: Path, command: str, url: str | None = None) -> None:
    """Record that `command` (``fit``, ``validate``, ``tune lr``, ``sweep trial``, ...) starts in `run_dir`; a run
    whose root is a URL records it as ``url`` (where the run is, shown without credentials) and `run_dir` as
    ``staging`` (the local folder it is staged in)."""
    record: dict[str, Any] = {
        "command": command,
        "status": "running",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "holder": asdict(Holder.of_this_process()),
    }
    if url is not None:
        record.update(url=url, staging=str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / STATUS_FILE, json.dumps(record, indent=2) + "\n")


def end(run_dir: Path, status: str, **details: Any) -> None:
    """Record how the run begun in `run_dir` ended: `status` (one of `STATUSES` but ``running``) and `details`
    (``epoch``, ``global_step``, ``reason``, ``error``). Nothing is written when the start was not recorded."""
    record = read_record(run_dir)
    if record is None:
        return
    record.update(status=status, ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"), **details)
    record.pop("holder", None)
    atomic_write(run_dir / STATUS_FILE, json.dumps(record, indent=2) + "\n")


def discard_if_alone(run_dir: Path) -> None:
    """Remove the record when it is all the run left in `run_dir` (a run that wrote nothing leaves nothing)."""
    path = run_dir / STATUS_FILE
    try:
        if [p.name for p in run_dir.iterdir()] == [STATUS_FILE]:
            path.unlink()
    except OSError:
        pass


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The record as written, or None when there is none or it is not a JSON object."""
    path = run_dir / STATUS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(read_regular(path, f"run {run_dir}", limit=_READ_LIMIT).decode("utf-8"))
    except (CheckpointError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """The record, its ``status`` checked: a ``running`` run whose process is gone is ``failed`` (reason
    ``killed``). None without a readable record."""
    record = read_record(run_dir)
    if record is None or record.get("status") not in STATUSES or not isinstance(record.get("command"), str):
        return None
    if record["status"] == "running" and not _is_alive(run_dir, record.get("holder")):
        record.update(status="failed", reason="killed")
    return record


def _is_alive(run_dir: Path, holder: Any) -> bool:
    """Whether the process that began the run still runs: asked of the process itself on this host, else of
    the run's writer lock (a fit's heartbeat); a run on another host without a lock is taken as alive."""
    named = Holder.parse(json.dumps(holder).encode()) if isinstance(holder, dict) else None
    if named is not None and named.is_on_this_host():
        return named.is_alive_here()
    held = is_held(run_dir)
    return True if held is None else held

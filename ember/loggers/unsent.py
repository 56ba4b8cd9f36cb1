"""What a logger could not send, kept in the run directory, and how to send it later.

A logger that fails or hangs during a run (`ember.loggers.guard`) has its values written to
``<run dir>/unsent/<n>-<LoggerClass>.jsonl``: one JSON object per line, the first a header naming the logger's
class and the keywords that rebuild it pointing at the same destination (`Logger.rebuild_kwargs`), then one line
per call it missed, in order::

    {"ember_unsent": 1, "logger": "ember.loggers.mlflow.MLflowLogger", "kwargs": {...}}
    {"seq": 7, "call": "log_metrics", "step": 40, "metrics": {"train/loss": 0.41, "epoch": 1}}
    {"seq": 8, "call": "log_hyperparams", "params": {"lr": 0.05}}
    {"seq": 9, "call": "after_save_checkpoint", "path": "runs/x/version_0/checkpoints/epoch=1-step=40"}
    {"seq": 10, "call": "finalize", "status": "success"}

`replay` sends such a file: ``python -m ember.loggers.replay FILE...`` from a shell. The file holds data only:
replaying imports the named class only when it is an ember `Logger` subclass and never runs code from the file.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ember.loggers.logger import Logger, public_params

FORMAT = 1
#: The calls a file can hold; everything else a logger receives (``save``, histograms) is not kept.
KEPT_CALLS = ("log_metrics", "log_hyperparams", "after_save_checkpoint", "finalize")
REPLAY_COMMAND = "python -m ember.loggers.replay"


def header(logger: Logger) -> dict[str, Any]:
    """The first line of a logger's file: its class and the keywords that rebuild it."""
    cls = type(logger)
    return {"ember_unsent": FORMAT, "logger": f"{cls.__module__}.{cls.__qualname__}", "kwargs": logger.rebuild_kwargs()}


def record(seq: int, name: str, args: Sequence[Any]) -> dict[str, Any]:
    """One missed call as a JSON-ready line (hyperparameters without entries named like credentials)."""
    if name == "log_metrics":
        metrics, step = args
        return {"seq": seq, "call": name, "step": int(step), "metrics": {str(k): float(v) for k, v in metrics.items()}}
    if name == "log_hyperparams":
        return {"seq": seq, "call": name, "params": _jsonable(public_params(args[0]))}
    if name == "after_save_checkpoint":
        return {"seq": seq, "call": name, "path": os.fspath(args[0])}
    if name == "finalize":
        return {"seq": seq, "call": name, "status": str(args[0])}
    raise ValueError(f"{name!r} is not a call an unsent-values file keeps; it keeps {', '.join(KEPT_CALLS)}")


def write(path: Path, first: Mapping[str, Any], lines: Sequence[Mapping[str, Any]]) -> None:
    """Write the whole file (header, then `lines`) atomically."""
    from ember.checkpoint.files import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "".join(json.dumps(obj) + "\n" for obj in [first, *lines]))


def append(path: Path, first: Mapping[str, Any], line: Mapping[str, Any]) -> None:
    """Add one line (the header first when the file is new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write(json.dumps(first) + "\n")
        f.write(json.dumps(line) + "\n")


def read(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header (the last one, which names the logger's run once it was known) and the calls, by ``seq``.

    A torn last line (the process died while appending) is left out; any other malformed line is an error
    naming the file and the line.
    """
    path = Path(path)
    heads: list[dict[str, Any]] = []
    calls: dict[int, dict[str, Any]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, text in enumerate(lines, 1):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line; the file is damaged") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object")
        if "ember_unsent" in obj:
            heads.append(obj)
        elif obj.get("call") in KEPT_CALLS and isinstance(obj.get("seq"), int):
            calls[obj["seq"]] = obj
        else:
            raise ValueError(f"{path}:{number}: unknown entry {text[:80]!r}")
    if not heads:
        raise ValueError(f"{path}: no header line; this is not an ember unsent-values file")
    if heads[-1]["ember_unsent"] != FORMAT:
        raise ValueError(f"{path}: format {heads[-1]['ember_unsent']!r}; this ember reads format {FORMAT}")
    return heads[-1], [calls[seq] for seq in sorted(calls)]


def apply(logger: Logger, line: Mapping[str, Any]) -> None:
    """Make the call `line` describes on `logger`."""
    name = line["call"]
    if name == "log_metrics":
        logger.log_metrics(dict(line["metrics"]), int(line["step"]))
    elif name == "log_hyperparams":
        logger.log_hyperparams(dict(line["params"]))
    elif name == "after_save_checkpoint":
        logger.after_save_checkpoint(Path(line["path"]))
    else:
        logger.finalize(str(line["status"]))


def rebuild(head: Mapping[str, Any], path: Path) -> Logger:
    """The logger a header names, built from its keywords; only ember `Logger` subclasses are built."""
    module_name, _, qualname = str(head.get("logger", "")).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError, ValueError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Logger)):
        raise ValueError(f"{path}: {head.get('logger')!r} is not an importable ember Logger; pass one to replay()")
    kwargs = head.get("kwargs")
    if not isinstance(kwargs, dict):
        raise ValueError(
            f"{path}: {cls.__name__} cannot be rebuilt from the file; call "
            f"ember.loggers.unsent.replay({str(path)!r}, logger={cls.__name__}(...))"
        )
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(
            f"{path}: {cls.__name__}(**{kwargs}) failed ({exc}); call "
            f"ember.loggers.unsent.replay({str(path)!r}, logger={cls.__name__}(...))"
        ) from None


def replay(path: str | os.PathLike[str], logger: Logger | None = None) -> int:
    """Send the calls kept in `path` to `logger` (default: the logger the file names, rebuilt), in their order,
    then ``save`` it (and ``finalize("interrupted")`` it when the file ends without the run's end: its process
    died); the file is renamed to ``*.jsonl.sent`` once everything went through. Returns the number of calls
    sent. A failure raises and leaves the file as it was, so it can be replayed again."""
    path = Path(path)
    head, lines = read(path)
    target = logger if logger is not None else rebuild(head, path)
    finalized = False
    for line in lines:
        apply(target, line)
        finalized = line["call"] == "finalize"
    if not finalized:
        target.save()
        target.finalize("interrupted")
    path.rename(path.with_name(path.name + ".sent"))
    return len(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return _jsonable(value.item())
    return repr(value)

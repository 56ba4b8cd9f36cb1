"""Finding checkpoints and run directories: one place for version folders, ``last``, ``best`` and what a
``ckpt_path`` names, used by the trainer, the ``ember`` command and ``ember export``.

Run directories are ``<default_root_dir>/<run name>/version_N``. Two runs started at the same moment
under the same root must never share one, so a new version is *claimed* with an exclusive ``mkdir``
(the first process to create ``version_N`` owns it; the other takes N+1).

Everything read here is data: a ``last`` file may only name a directory beside it; a best-checkpoint
path recorded in a checkpoint is looked up by name beside that checkpoint, never followed elsewhere.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from ember.checkpoint.files import is_plain_name, read_regular
from ember.checkpoint.format import LAST_FILE, META_FILE, CheckpointError
from ember.checkpoint.reading import check_complete, read_meta

#: The folder of a run directory that ``ModelCheckpoint`` writes to by default.
CHECKPOINT_SUBDIR = "checkpoints"

#: The largest ``last`` file read (it holds one directory name).
_POINTER_BYTES = 4096

def read_pointer(pointer: Path) -> Path:
    """The checkpoint a ``last`` file names: a sibling directory name, nothing else (no path, no ``..``)."""
    data = read_regular(pointer, f"checkpoint pointer {pointer}", limit=_POINTER_BYTES)
    try:
        name = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"checkpoint pointer {pointer} is not text; it is damaged or not ember's") from None
    if not is_plain_name(name):
        raise CheckpointError(
            f"checkpoint pointer {pointer} names {name[:80]!r}, not a checkpoint directory beside it; it is damaged"
        )
    return pointer.parent / name

def resolve_path(path: Path) -> Path:
    """A checkpoint given by the user: its directory, or a ``last`` file (the one it names); checked complete."""
    if path.name == LAST_FILE:
        if path.is_dir() and not (path / META_FILE).exists():
            raise CheckpointError(f"checkpoint pointer {path} is a directory, not a file naming a checkpoint")
        if not path.is_dir():
            path = read_pointer(path)
    check_complete(path)
    return path

def checkpoints_in(directory: Path) -> list[Path]:
    """Checkpoint directories in `directory` (temporary ones excluded), not yet checked."""
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / META_FILE).exists()]

def newest_valid(directory: Path, resumable: bool = False) -> Path | None:
    """The checkpoint ``last`` names, or, when that one is missing or unusable, the newest valid other one.

    With `resumable`, checkpoints that hold weights only are passed over (they cannot resume training).
    Every checkpoint passed over is named in a warning; none stops the search.
    """
    candidates: list[Path] = []
    named: Path | None = None
    pointer = directory / LAST_FILE
    if os.path.lexists(pointer):
        try:
            named = read_pointer(pointer)
            candidates.append(named)
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint: {exc}", RuntimeWarning, stacklevel=2)
    by_step: list[tuple[int, str, Path]] = []
    for path in checkpoints_in(directory):
        if path != named:
            try:
                progress = read_meta(path)["state"].get("progress", {})
                step = progress.get("global_step", -1) if isinstance(progress, dict) else -1
                by_step.append((step if isinstance(step, int) else -1, path.name, path))
            except CheckpointError as exc:
                warnings.warn(f"skipping checkpoint: {exc}", RuntimeWarning, stacklevel=2)
    candidates += [p for _, _, p in sorted(by_step, reverse=True)]
    for path in candidates:
        try:
            meta = check_complete(path)
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint: {exc}", RuntimeWarning, stacklevel=2)
            continue
        if resumable and meta.get("weights_only"):
            warnings.warn(
                f"skipping checkpoint {path}: it holds weights only and cannot resume training", RuntimeWarning,
                stacklevel=2,
            )  # fmt: skip
            continue
        return path
    return None


_VERSION = re.compile(r"version_(\d+)")


def versions_newest_first(run_root: Path) -> list[Path]:
    """The ``version_N`` directories of `run_root`, highest N first."""
    found = []
    if run_root.is_dir():
        for path in run_root.iterdir():
            match = _VERSION.fullmatch(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found, reverse=True)]


def claim_version(run_root: Path) -> tuple[Path, Path]:
    """Create a new ``version_N`` directory in `run_root`, N one past the highest there; returns it and the
    deepest folder above it that existed before (what `release_if_empty` keeps).

    The ``mkdir`` is exclusive: when another process created the same N first, the next N is tried.
    """
    existed = run_root
    while not existed.exists() and existed.parent != existed:
        existed = existed.parent
    run_root.mkdir(parents=True, exist_ok=True)
    existing = versions_newest_first(run_root)
    number = int(existing[0].name.split("_")[1]) + 1 if existing else 0
    while True:
        path = run_root / f"version_{number}"
        try:
            path.mkdir()
            return path, existed
        except FileExistsError:
            number += 1


def release_if_empty(run_dir: Path, keep: Path) -> None:
    """Remove a claimed run directory that nothing was written to (a rejected or write-free run), and the
    empty folders above it that the claim created, up to (not including) `keep`."""
    folder = run_dir
    while folder != keep and keep in folder.parents:
        try:
            os.rmdir(folder)
        except OSError:
            return  # not empty (or already gone): it holds a record of some run
        folder = folder.parent


def find_last(folders: list[Path], versions: list[Path], resumable: bool = False) -> tuple[Path, Path | None] | None:
    """(checkpoint, its run directory) for the newest complete checkpoint, or None.

    `folders` (explicit checkpoint folders) are searched first, then ``<version>/checkpoints`` of each of
    `versions` (newest first); the run directory is None for an explicit folder. With `resumable`,
    weights-only checkpoints are passed over.
    """
    for directory in folders:
        found = newest_valid(directory, resumable)
        if found is not None:
            return found, None
    for version in versions:
        found = newest_valid(version / CHECKPOINT_SUBDIR, resumable)
        if found is not None:
            return found, version
    return None


def find_best(folders: list[Path], run_root: Path, known: str | None = None) -> Path:
    """The best checkpoint of a `ModelCheckpoint(monitor=...)`: `known` (this process's own record), else the
    one the newest checkpoint of `run_root` (or of `folders`) records.

    A path recorded in a checkpoint is data: only its name is used, looked up beside the checkpoint that
    recorded it, so a crafted file cannot point anywhere else.
    """
    if known:
        return resolve_path(Path(known))
    last = find_last(folders, versions_newest_first(run_root))
    if last is not None:
        saved = read_meta(last[0])["state"].get("callbacks", {})
        for key, value in (saved.items() if isinstance(saved, dict) else ()):
            best = value.get("best_model_path") if isinstance(value, dict) else None
            if str(key).startswith("ModelCheckpoint") and isinstance(best, str) and best:
                return resolve_path(last[0].parent / Path(best).name)
    raise CheckpointError(
        f"ckpt_path='best': no ModelCheckpoint with a monitored best checkpoint in this trainer or under {run_root}"
    )


def resolve_ckpt_path(
    ckpt_path: str | os.PathLike[str], run_root: Path, stage: str, folders: list[Path], known_best: str | None = None
) -> tuple[Path | None, Path | None, str | None]:
    """(the checkpoint directory `ckpt_path` names, the run directory to continue or None, a line to print).

    ``"last"``: the newest complete checkpoint of `run_root`'s versions (or of the explicit checkpoint
    `folders`); for `stage` "fit", one that can resume training, and its run directory is continued
    (no checkpoint: None, and fit starts a new run, saying so). ``"best"``: `find_best`. Anything else is
    a checkpoint directory or a ``last`` file. Everything but fit's ``"last"`` starts a new version.
    """
    if ckpt_path == "last":
        found = find_last(folders, versions_newest_first(run_root), resumable=stage == "fit")
        if found is None:
            if stage != "fit":
                raise CheckpointError(f"ckpt_path='last': no complete checkpoint under {run_root}")
            return None, None, f"no checkpoint under {run_root}; starting a new run"
        path, run_dir = found
        if stage == "fit":
            return path, run_dir, f"resuming from {path}"
        return path, None, f"loading {path}"
    if ckpt_path == "best":
        return find_best(folders, run_root, known_best), None, None
    return resolve_path(Path(ckpt_path)), None, None

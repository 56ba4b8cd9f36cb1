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
from typing import Any

from ember.checkpoint.files import is_plain_name, read_regular
from ember.checkpoint.format import LAST_FILE, META_FILE, CheckpointError
from ember.checkpoint.manifest import fetch_checkpoint
from ember.checkpoint.reading import check_complete, read_meta
from ember.checkpoint.run_status import STATUS_FILE, read_status
from ember.checkpoint.store import is_url, redact

#: The folder of a run directory that ``ModelCheckpoint`` writes to by default.
CHECKPOINT_SUBDIR = "checkpoints"

#: The largest ``last`` file read (it holds one directory name).
_POINTER_BYTES = 4096


def read_pointer(pointer: Path) -> Path:
    """The checkpoint a ``last`` file names: a sibling directory name, nothing else (no path, no ``..``).

    ember writes ``last`` as a regular file; a symbolic link there is not followed (it may point anywhere,
    or nowhere): it is an error here, passed over by a search for ``last``, and replaced (the link, never
    what it points to) by the next save.
    """
    if pointer.is_symlink():
        raise CheckpointError(
            f"checkpoint pointer {pointer} is a symbolic link (to {os.readlink(pointer)!s:.200}), not the file "
            "ember writes; it is not followed, and the next save replaces the link"
        )
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


def check_last_replaceable(folder: Path) -> None:
    """Refuse, before a fit trains, a ``last`` in checkpoint folder `folder` that its saves could not replace.

    ``last`` is replaced by a rename, which works over a file or a symbolic link (the link is replaced, not
    followed) but not over a directory: that would fail at the first save, after an epoch of training.
    """
    pointer = folder / LAST_FILE
    if pointer.is_dir() and not pointer.is_symlink():
        raise CheckpointError(
            f"checkpoint pointer {pointer} is a directory, where ember writes the file naming the newest checkpoint; "
            f"move it away (mv '{pointer}' '{pointer}.moved'), then run again"
        )


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


def claim_version(run_root: Path, boundary: Path | None = None) -> tuple[Path, Path]:
    """Create a new ``version_N`` directory in `run_root`, N one past the highest there; returns it and the
    deepest folder above it that existed before (what `release_if_empty` keeps), never one above `boundary`
    (folders there may be another process's, e.g. the folder a user's script writes its own results into).

    The ``mkdir`` is exclusive: when another process created the same N first, the next N is tried; when
    another run released the folders above it meanwhile, they are made again.
    """
    existed = run_root
    while not existed.exists() and existed.parent != existed:
        existed = existed.parent
    if boundary is not None and existed != boundary and boundary not in existed.parents:
        existed = boundary  # made by this claim, above the boundary: left in place by release_if_empty
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
        except FileNotFoundError:
            run_root.mkdir(parents=True, exist_ok=True)


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


def find_best(
    folders: list[Path], run_root: Path, known: str | None = None, versions: list[Path] | None = None
) -> Path:
    """The best checkpoint of a `ModelCheckpoint(monitor=...)`: `known` (this process's own record), else the
    one the newest checkpoint of `versions` (default: every version of `run_root`, newest first; or of
    `folders`) records.

    A path recorded in a checkpoint is data: only its name is used, looked up beside the checkpoint that
    recorded it, so a crafted file cannot point anywhere else.
    """
    if known:
        return resolve_path(Path(known))
    last = find_last(folders, versions_newest_first(run_root) if versions is None else versions)
    if last is not None:
        saved = read_meta(last[0])["state"].get("callbacks", {})
        for key, value in saved.items() if isinstance(saved, dict) else ():
            best = value.get("best_model_path") if isinstance(value, dict) else None
            if str(key).startswith("ModelCheckpoint") and isinstance(best, str) and best:
                return resolve_path(last[0].parent / Path(best).name)
    where = versions[0] if versions and len(versions) == 1 else run_root
    raise CheckpointError(
        f"ckpt_path='best': no ModelCheckpoint with a monitored best checkpoint in this trainer or under {where}"
    )


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory `checkpoint` belongs to (``<run dir>/checkpoints/<name>``, the run dir a
    ``version_N`` folder or one holding ``config.yaml``), or None for a checkpoint kept elsewhere."""
    folder = checkpoint.parent
    if folder.name != CHECKPOINT_SUBDIR:
        return None
    run = folder.parent
    return run if _VERSION.fullmatch(run.name) or (run / "config.yaml").is_file() else None


_MONITOR = re.compile(r"'monitor': '([^']*)'")


def summarize(checkpoint: Path) -> dict[str, Any]:
    """What a checkpoint holds, from its metadata: ``epoch`` (epochs completed), ``global_step`` and
    ``monitored`` (the value every ``ModelCheckpoint`` monitor recorded for it, by metric name)."""
    try:
        state = read_meta(checkpoint)["state"]
    except CheckpointError:
        return {}
    progress = state.get("progress", {}) if isinstance(state, dict) else {}
    summary: dict[str, Any] = {}
    if isinstance(progress, dict):
        summary = {"epoch": progress.get("epoch"), "global_step": progress.get("global_step")}
    monitored: dict[str, float] = {}
    callbacks = state.get("callbacks", {}) if isinstance(state, dict) else {}
    for key, value in callbacks.items() if isinstance(callbacks, dict) else ():
        monitor = _MONITOR.search(str(key))
        kept = value.get("kept") if isinstance(value, dict) else None
        if not str(key).startswith("ModelCheckpoint") or monitor is None or not isinstance(kept, dict):
            continue
        score = next((v for k, v in kept.items() if Path(str(k)).name == checkpoint.name), None)
        if isinstance(score, (int, float)):
            monitored[monitor.group(1)] = float(score)
    return {**summary, "monitored": monitored}


def recorded_best(checkpoint: Path) -> tuple[str, str, Any] | None:
    """The best checkpoint the first ``ModelCheckpoint`` had recorded when `checkpoint` was written:
    (its state key, the best path, the best score); None when there is none or the metadata is unreadable."""
    try:
        state = read_meta(checkpoint)["state"]
    except CheckpointError:
        return None
    callbacks = state.get("callbacks", {}) if isinstance(state, dict) else {}
    for key, value in callbacks.items() if isinstance(callbacks, dict) else ():
        if str(key).startswith("ModelCheckpoint") and isinstance(value, dict):
            best = value.get("best_model_path")
            return (str(key), str(best), value.get("best_model_score")) if best else None
    return None


def epoch_label(checkpoint: Path) -> int | None:
    """The 0-based number of the epoch `checkpoint` was written in, the one its default name shows
    (``epoch=3-step=69``): a checkpoint written at an epoch's end records the epochs completed (4), one
    written inside an epoch the index of that epoch. None when the metadata does not say."""
    try:
        progress = read_meta(checkpoint)["state"].get("progress", {})
    except CheckpointError:
        return None
    epoch, batch = (progress.get("epoch"), progress.get("batch_idx")) if isinstance(progress, dict) else (None, None)
    if not isinstance(epoch, int) or not isinstance(batch, int):
        return None
    return epoch - 1 if batch == 0 and epoch > 0 else epoch


def describe(checkpoint: Path) -> str:
    """`summarize` as text, the epoch numbered from 0 as in checkpoint names (`epoch_label`):
    ``"epoch 3, step 69, val/acc 0.9583"`` for ``epoch=3-step=69``."""
    summary = summarize(checkpoint)
    if not summary:
        return "unreadable metadata"
    label = epoch_label(checkpoint)
    parts = [f"epoch {'?' if label is None else label}", f"step {summary.get('global_step', '?')}"]
    parts += [f"{name} {value:.4f}" for name, value in summary["monitored"].items()]
    return ", ".join(parts)


#: The commands whose runs ``last`` looks at (`ember.checkpoint.run_status`); a run without a record counts.
_FIT_COMMANDS = ("fit", "sweep trial")


def is_fit_run(run_dir: Path) -> bool:
    """Whether `run_dir` is a fit's (its ``status.json`` says so, or it has none): an lr finder's or an
    evaluation's run is not, and ``last`` passes it over."""
    record = read_status(run_dir)
    return record is None or record.get("command") in _FIT_COMMANDS


class NewestRunHasNoCheckpoint(CheckpointError):
    """``ckpt_path="last"`` for fit, when the newest fit of the run name has no checkpoint but an older one has:
    continuing the older run silently would extend the wrong run. Names both runs and the older checkpoint."""

    def __init__(self, newest: Path | str, how: str, older: Path | str, checkpoint: Path | str) -> None:
        self.newest, self.how, self.older, self.checkpoint = newest, how, older, checkpoint
        super().__init__(
            f"ckpt_path='last': the newest run, {newest} ({how}), has no checkpoint; to continue {older} from "
            f"{checkpoint}, pass ckpt_path='{older}' (its run directory); to start over, no ckpt_path"
        )


def _how_it_ended(run_dir: Path) -> str:
    """``"stopped: interrupted"``, ``"failed: RuntimeError"``, ``"finished"``: from the run's status record."""
    record = read_status(run_dir) or {}
    status, reason = record.get("status", "no status record"), record.get("reason")
    return f"{status}: {reason}" if isinstance(reason, str) and reason else str(status)


def _last_of_fit(folders: list[Path], versions: list[Path]) -> tuple[Path, Path | None] | None:
    """`find_last` for fit: the explicit `folders` first, then the newest of the fit runs `versions` alone.
    Raises `NewestRunHasNoCheckpoint` when that run has no checkpoint and an older one has."""
    found = find_last(folders, [], resumable=True)
    if found is not None or not versions:
        return found
    found = find_last([], versions[:1], resumable=True)
    if found is not None:
        return found
    older = find_last([], versions[1:], resumable=True)
    if older is None:
        return None
    checkpoint, run_dir = older
    assert run_dir is not None
    raise NewestRunHasNoCheckpoint(versions[0], _how_it_ended(versions[0]), run_dir, checkpoint)


def _continue_run(run_dir: Path, stage: str) -> tuple[Path, Path | None, str]:
    """A run directory given as the checkpoint: its newest complete checkpoint; fit continues that run."""
    found = newest_valid(run_dir / CHECKPOINT_SUBDIR, resumable=stage == "fit")
    if found is None:
        raise CheckpointError(f"{run_dir} is a run directory without a complete checkpoint; nothing to load from it")
    if stage == "fit":
        return found, run_dir, f"resuming run {run_dir} from {found} ({describe(found)})"
    return found, run_dir, f"{stage}: loading {found} ({describe(found)})"


def _is_run_dir(folder: Path) -> bool:
    """A run directory: it has a checkpoint folder, or (a run stopped before its first checkpoint) a status record."""
    return (folder / CHECKPOINT_SUBDIR).is_dir() or (folder / STATUS_FILE).is_file()


def _refuse_a_folder_of_many(given: Path) -> None:
    """A folder of runs (``runs/net``) or of checkpoints (``<run dir>/checkpoints``) is not one checkpoint: say
    what to give instead of reading it as an incomplete checkpoint."""
    if not given.is_dir() or (given / META_FILE).exists():
        return
    runs = versions_newest_first(given)
    if runs:
        names = ", ".join(v.name for v in reversed(runs))
        raise CheckpointError(
            f"{given} is a folder of runs ({names}), not a checkpoint: give a run directory ({runs[0]}), a "
            "checkpoint, or 'last'"
        )
    if (given / LAST_FILE).is_file():
        run = f" or the run directory ({given.parent})" if given.name == CHECKPOINT_SUBDIR else ""
        raise CheckpointError(
            f"{given} is a folder of checkpoints, not a checkpoint: give one of them, its 'last' "
            f"({given / LAST_FILE}){run}"
        )


def _across_runs(which: str, run_dir: Path | None, run_root: Path, stage: str) -> str:
    """For ``last``/``best``: which run was chosen when the run name has several, and how to choose another."""
    versions = versions_newest_first(run_root)
    if run_dir is None or len(versions) < 2:
        return ""
    choose = "give a checkpoint path" if stage == "fit" else "choose another run with --run version_N"
    return (
        f"; '{which}' is taken from {run_dir.name}, the newest of the {len(versions)} runs under {run_root} that "
        f"has a checkpoint ({choose})"
    )


def resolve_ckpt_path(
    ckpt_path: str | os.PathLike[str],
    run_root: Path,
    stage: str,
    folders: list[Path],
    known_best: str | None = None,
    run: str | None = None,
) -> tuple[Path | None, Path | None, str | None]:
    """(the checkpoint directory `ckpt_path` names, the run directory to continue or None, a line to print).

    ``"last"``: the newest complete checkpoint of `run_root`'s versions (only of version `run` when given;
    the explicit checkpoint `folders` first); for `stage` "fit", one that can resume training, and its run
    directory is continued (no checkpoint: None, and fit starts a new run, saying so). Only fit runs count
    (`is_fit_run`), and fit looks at the newest one alone: when it has no checkpoint while an older run has,
    `NewestRunHasNoCheckpoint`. ``"best"``: `find_best`. A run directory (``runs/net/version_0``): its
    newest checkpoint, and fit continues that run. A URL (``s3://...``) is a checkpoint on a store, its
    folder's ``last`` or the folder (`ember.checkpoint.manifest.fetch`), downloaded into a temporary folder.
    Anything else is a checkpoint directory or a ``last`` file.

    fit continues the run only for ``"last"``; any other checkpoint starts a new version. validate, test
    and predict of a checkpoint inside a run directory write into that run (`run_dir_of`). The line says
    which checkpoint was chosen and what it holds (`describe`), and for ``last``/``best`` which run.
    """
    if is_url(ckpt_path):  # on a store: downloaded and checked against its manifest, then read as usual
        path = fetch_checkpoint(str(ckpt_path))
        check_complete(path)
        shown = redact(str(ckpt_path))
        if stage == "fit":
            return path, None, f"resuming from {shown} ({describe(path)}) in a new run"
        return path, None, f"{stage}: loading {shown} ({describe(path)})"
    versions = versions_newest_first(run_root)
    if run is not None:
        chosen = run_root / run
        if not _VERSION.fullmatch(run) or not chosen.is_dir():
            names = ", ".join(v.name for v in versions) or "none"
            raise CheckpointError(f"--run {run}: no such run under {run_root} (runs there: {names})")
        versions, folders = [chosen], []
    if ckpt_path == "last":
        if run is None:
            versions = [v for v in versions if is_fit_run(v)]
        if stage == "fit" and run is None:
            found = _last_of_fit(folders, versions)
        else:
            found = find_last(folders, versions, resumable=stage == "fit")
        if found is None:
            if stage != "fit":
                where = versions[0] if run else run_root
                raise CheckpointError(f"ckpt_path='last': no complete checkpoint under {where}")
            return None, None, f"no checkpoint under {run_root}; starting a new run"
        path, run_dir = found
        across = "" if run is not None else _across_runs("last", run_dir, run_root, stage)
        if stage == "fit":
            return path, run_dir, f"resuming from {path} ({describe(path)}){across}"
        return path, run_dir or run_dir_of(path), f"{stage}: loading {path} ({describe(path)}){across}"
    if ckpt_path == "best":
        path = find_best(folders, run_root, None if run is not None else known_best, versions)
        if stage == "fit":
            return path, None, f"resuming from {path} ({describe(path)}) in a new run"
        run_dir = run_dir_of(path)
        across = "" if run is not None or known_best else _across_runs("best", run_dir, run_root, stage)
        return path, run_dir, f"{stage}: loading the best checkpoint {path} ({describe(path)}){across}"
    given = Path(ckpt_path)
    if given.is_dir() and not (given / META_FILE).exists() and _is_run_dir(given):
        return _continue_run(given, stage)
    _refuse_a_folder_of_many(given)
    path = resolve_path(given)
    if stage == "fit":
        return path, None, f"resuming from {path} ({describe(path)}) in a new run"
    return path, run_dir_of(path), f"{stage}: loading {path} ({describe(path)})"

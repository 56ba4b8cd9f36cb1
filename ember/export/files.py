"""Writing an artifact atomically: into a hidden folder beside the destination, checked, then renamed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ember.checkpoint.files import fsync_path
from ember.export.checks import ExportError


@contextlib.contextmanager
def staged(path: Path) -> Iterator[Path]:
    """Yield where to write `path` (same name, in a fresh hidden folder beside it).

    When the block finishes, every file written there (``model.onnx`` and any ``model.onnx.data``) is
    fsynced and renamed into ``path.parent``, the file named like `path` last, so a reader never sees it
    before its companions. When the block raises (a failed export or check), the folder is removed and
    nothing appears at `path`; an older file there is left as it was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield folder / path.name
        if not (folder / path.name).is_file():
            raise ExportError(f"exporting {path} wrote no file")
        mode = _default_file_mode(folder)
        for item in sorted(folder.iterdir(), key=lambda p: p.name == path.name):
            os.chmod(item, mode)  # some writers (safetensors) create files readable by their owner only
            fsync_path(item)
            os.replace(item, path.parent / item.name)
        fsync_path(path.parent)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _default_file_mode(folder: Path) -> int:
    """The permissions ``open(path, "w")`` gives a new file here (0o666 less the umask)."""
    probe = folder / ".mode-probe"
    probe.touch()
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    return mode


@contextlib.contextmanager
def staged_dir(path: Path) -> Iterator[Path]:
    """Yield a fresh hidden directory beside `path`; when the block finishes, it replaces `path`.

    Its files are fsynced, then an existing `path` is renamed aside, the new directory renamed to `path`
    and the old one removed. When the block raises, the new directory is removed and `path` is left as it
    was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    old: Path | None = None
    try:
        yield folder
        file_mode = _default_file_mode(folder)
        for item in folder.rglob("*"):
            if item.is_file():
                os.chmod(item, file_mode)  # safetensors creates files readable by their owner only
                fsync_path(item)
        os.chmod(folder, _default_dir_mode(folder))  # mkdtemp made it private
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
        os.replace(folder, path)
        fsync_path(path.parent)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _default_dir_mode(folder: Path) -> int:
    """The permissions ``mkdir`` gives a new directory here (0o777 less the umask)."""
    probe = folder / ".mode-probe-dir"
    probe.mkdir()
    mode = probe.stat().st_mode & 0o777
    probe.rmdir()
    return mode

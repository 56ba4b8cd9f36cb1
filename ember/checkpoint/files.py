"""Files on disk, safely: fsync, atomic replacement, writes that fail cleanly, reads that never block.

One home for the file-level rules every writer in ember follows (checkpoints, the ``last`` pointer,
loggers' ``metrics.csv`` and ``hparams.yaml``, ``config.yaml``, exported artifacts):

- `atomic_write`: write beside, fsync, rename over: a reader sees the old file or the new one, whole.
- `fsync_path`: fsync a file or a directory (a rename is durable once its directory is fsynced).
- `GuardedFile` / `guarded_open`: a failed write (a full disk) is raised once the writer is done, never
  inside torch's C++ serializer, where it would abort the process.
- `read_regular`: only regular files are read, without blocking on a FIFO.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

from ember.checkpoint.format import DAMAGED, CheckpointError


def fsync_path(path: Path) -> None:
    """fsync `path` (a file, or a directory after a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: str | bytes, sync_dir: bool = False) -> None:
    """Replace `path` by `data`: written beside (a hidden name of this process), fsynced, renamed over.

    With `sync_dir` the directory is fsynced too, so the new content survives a power loss. A failure
    leaves `path` as it was and no temporary file.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_path(path.parent)


def torch_save_to(obj: Any, path: Path, sync: bool) -> None:
    """``torch.save(obj)`` into `path` through a `GuardedFile` (flushed, fsynced with `sync`)."""
    with guarded_open(path, sync) as f:
        torch.save(obj, f)


class _NeverRaises(io.RawIOBase):
    """The raw file under a `GuardedFile`: records the first `OSError` of a write and pretends that write
    (and every later one) succeeded, counting the bytes it dropped so that ``tell`` stays consistent."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__()
        self.file = file
        self.error: OSError | None = None
        self.lost = 0  # bytes pretended written after the error

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self.error is None:
            try:
                written = self.file.write(data)
                return size if written is None else written  # a short write: the buffer above retries the rest
            except OSError as exc:
                self.error = exc
        self.lost += size
        return size

    def tell(self) -> int:
        return self.file.tell() + self.lost

    def fileno(self) -> int:
        return self.file.fileno()

    @property
    def name(self) -> Any:
        return self.file.name


class GuardedFile(io.BufferedWriter):
    """A binary file whose ``write`` never raises into torch's C++ serializer.

    ``torch.save`` and `save_tensor` write through a C++ stream writer; when a write fails (ENOSPC),
    the exception leaves that writer unfinished, and its destructor then throws again, which aborts
    the whole process (``terminate called after throwing an instance of 'c10::Error'``). Under this
    buffer, the first `OSError` is recorded, every later write pretends to succeed (so the writer
    finishes normally), and `check` raises the recorded error once the writer is done with the file.

    ``write`` is the C buffer's own method: torch's serializer makes a few dozen small writes per
    tensor, and none of them runs Python code until the buffer fills. ``fileno`` flushes first, so an
    ``os.fsync(f.fileno())`` (as torch.distributed.checkpoint does) covers everything written.
    """

    def __init__(self, file: IO[bytes], buffer_size: int = 1 << 16) -> None:
        self._guard = _NeverRaises(file)
        super().__init__(self._guard, buffer_size=buffer_size)

    @property
    def error(self) -> OSError | None:
        """The first write error, or None."""
        return self._guard.error

    def fileno(self) -> int:
        self.flush()
        return super().fileno()

    def close(self) -> None:
        """Flush only: the file underneath is closed by whoever opened it (`guarded_open`)."""
        self.flush()

    def check(self) -> None:
        """Flush, then raise the first write error, if any (call after the serializer is finished)."""
        self.flush()
        if self._guard.error is not None:
            raise self._guard.error


@contextmanager
def guarded_open(path: Path, sync: bool) -> Iterator[GuardedFile]:
    """``open(path, "wb")`` as a `GuardedFile`: flushed (and fsynced with `sync`) on success; its write
    error raised once the block is done."""
    with open(path, "wb", buffering=0) as raw:
        f = GuardedFile(raw)
        yield f
        f.check()
        if sync:
            os.fsync(raw.fileno())


def read_regular(
    file: Path, what: str, limit: int | None = None, check: Callable[[int, int], None] | None = None
) -> bytes:
    """The bytes of `file`, which must be a regular file; anything else is a `CheckpointError` naming it.

    Opened without blocking and checked before reading: a FIFO, device or directory planted under a
    checkpoint's name is refused instead of hanging or failing with a raw OS error; so is a file over
    `limit` bytes, and one that `check` (called with the open descriptor and the size) refuses. `what`
    names the checkpoint (or folder) in messages.
    """
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{what} is incomplete: {file.name} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{what}: cannot read {file.name} ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{what}: {file.name} is not a regular file")
        if limit is not None and info.st_size > limit:
            raise CheckpointError(
                f"{what}: {file.name} is {info.st_size} bytes, more than its checkpoint can justify ({limit}); "
                + DAMAGED
            )
        if check is not None:
            check(fd, info.st_size)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError as exc:
        raise CheckpointError(f"{what}: cannot read {file.name} ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def is_plain_name(name: str) -> bool:
    """A file or directory name inside one folder: no separators, not hidden, not ``.``/``..``."""
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".") and "\0" not in name

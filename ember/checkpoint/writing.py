"""Writing checkpoints: atomically (write beside, fsync, rename), cleanly on failure, in one or many processes.

The directory is written under a temporary name, every file is fsynced, then it is renamed into place:
a crash at any instant leaves either no directory or a complete one. A ``last`` file beside the
checkpoints names the newest complete one and is itself replaced atomically. A failed write (a full
disk) is a `CheckpointWriteError` on every process of the job, leaving the previous checkpoint intact.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor

from ember.checkpoint import dcp_writer
from ember.checkpoint.files import atomic_write, fsync_path, guarded_open, torch_save_to
from ember.checkpoint.format import FORMAT_VERSION, LAST_FILE, META_FILE, CheckpointWriteError
from ember.strategies.collectives import keep


def underlying(exc: BaseException) -> BaseException:
    """torch.distributed.checkpoint wraps errors per rank (a BaseException); return the first real one."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


#: From this many bytes of tensors per process, a checkpoint is written by several threads.
_PARALLEL_WRITE_BYTES = 64 * 2**20


def _bytes_of(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


#: Room a checkpoint needs besides its tensors (ember.pt, rank files, metadata), for the free-space check.
_SMALL_FILES_BYTES = 64 << 10


def _free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _no_space(path: Path, needed: int) -> str:
    try:
        free = f"{_free_bytes(path.parent) / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return (
        f"writing checkpoint {path} failed: No space left on device (it needs about {needed / 2**20:.1f} MiB; "
        f"{free} in {path.parent}). The previous checkpoint and `last` are intact: free some space, or save "
        "elsewhere (ModelCheckpoint(dirpath=...)), then resume with ckpt_path='last'"
    )


def _check_space(tmp: Path, path: Path, needed: int) -> None:
    """Refuse a write that cannot fit before writing a byte (one process; `needed` is a lower bound)."""
    try:
        free = _free_bytes(tmp)
    except OSError:
        return
    if free < needed:
        raise CheckpointWriteError(_no_space(path, needed))


def _raise_write_error(path: Path, exc: BaseException, needed: int = 0) -> NoReturn:
    """Re-raise a failed write as a `CheckpointWriteError` naming its first real cause (DCP wraps errors per
    rank); a full disk says how much space the checkpoint needs."""
    cause = underlying(exc)
    if isinstance(cause, CheckpointWriteError):
        raise cause
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        raise CheckpointWriteError(_no_space(path, needed + _SMALL_FILES_BYTES)) from None
    if isinstance(cause, Exception):
        raise CheckpointWriteError(f"writing checkpoint {path} failed: {type(cause).__name__}: {cause}") from cause
    raise exc


def _guarded_writer(tmp: Path, threads: int) -> Any:
    """DCP's file writer, with every stream a `GuardedFile` (see there: a failed write must not
    abort the process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    class GuardedFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with guarded_open(Path(path), sync=False) as stream:  # DCP fsyncs it (GuardedFile.fileno flushes)
                yield stream

    writer = dcp.FileSystemWriter(tmp, sync_files=True, single_file_per_rank=True, thread_count=threads)
    writer.fs = GuardedFileSystem()
    return writer


def _write_files(
    path: Path,
    tmp: Path,
    meta: dict[str, Any],
    tensors: dict[str, Tensor],
    rank_meta: dict[str, Any],
    rank: int,
    world_size: int,
    group: Any,
    sync: bool,
) -> list[Path]:
    """This process's files of checkpoint `path`, into `tmp`; returns those written without fsync (`sync` False)."""
    import torch.distributed.checkpoint as dcp

    unsynced: list[Path] = []
    # Large states go to several files per process, written (and fsynced) by parallel threads: the copy
    # into the page cache and the flush to disk overlap, which brings a save close to a plain torch.save
    # without fsync. Small ones are not worth starting threads for; in one process they skip DCP's planning.
    size = _bytes_of(tensors)
    if world_size == 1:
        _check_space(tmp, path, size + _SMALL_FILES_BYTES)
    if world_size == 1 and size < _PARALLEL_WRITE_BYTES and dcp_writer.can_write(tensors):
        dcp_writer.write_tensors(tmp, tensors, fsync=sync)
        unsynced += [tmp / dcp_writer.DATA_FILE, tmp / dcp_writer.METADATA_FILE]
    else:
        threads = max(1, min(4, os.cpu_count() or 1)) if size >= _PARALLEL_WRITE_BYTES else 1
        writer = _guarded_writer(tmp, threads)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
            if world_size > 1:
                dcp.save(tensors, storage_writer=writer, process_group=group)
            else:
                dcp.save(tensors, storage_writer=writer, no_dist=True)
    files = [(tmp / f"rank-{rank}.pt", rank_meta)]
    if rank == 0:
        files.insert(0, (tmp / META_FILE, {"format_version": FORMAT_VERSION, "world_size": world_size, **meta}))
    for file, content in files:
        torch_save_to(content, file, sync)
        unsynced.append(file)
    return [] if sync else unsynced


def fsync_together(paths: list[Path]) -> None:
    """fsync every path in `paths` at the same time (the calling thread and one thread per other path); once
    all are done, raise the first failure.

    A journaling file system commits fsyncs that wait at the same time in one journal transaction; one after
    another, each waits for a commit of its own (ext4 on a 2-core VM: the four files of a small checkpoint
    and its directory took 16-18 ms in a row, 1-4 ms together). Plain threads, not an executor: a background
    write finishing while the interpreter exits must still be able to start them (and, where it cannot,
    syncs one path after another).
    """
    errors: list[BaseException] = []

    def sync(path: Path) -> None:
        try:
            fsync_path(path)
        except BaseException as exc:  # raised by the caller once every path is done
            errors.append(exc)

    threads = []
    for path in paths[1:]:
        thread = threading.Thread(target=sync, args=(path,), name="ember-fsync", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no new threads (the interpreter is finalizing): this one does it
            sync(path)
        else:
            threads.append(thread)
    for path in paths[:1]:
        sync(path)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class StagedCheckpoint:
    """A one-process checkpoint whose files are written under a temporary name but not yet durable.

    `finish` fsyncs them, renames the directory into place and points ``last``
    at it. It is mostly waiting on the disk, with the GIL released, so the
    trainer runs it on a background thread while training goes on (see
    `ember.checkpoint.manager.CheckpointManager`); until it returns the
    checkpoint does not exist under its name, and a crash leaves only the
    temporary directory, which a later write removes.
    """

    def __init__(self, path: Path, tmp: Path, unsynced: list[Path], set_last: bool) -> None:
        self.path, self.tmp, self.unsynced, self.set_last = path, tmp, unsynced, set_last

    def finish(self) -> Path:
        """fsync the files, the directory and the new ``last`` (written beside it) together; rename the
        directory into place; then, once that rename is durable, the new ``last`` over the old one."""
        pointer = self.path.parent / f".{LAST_FILE}.tmp-{os.getpid()}"
        try:
            if self.set_last:
                pointer.write_text(self.path.name + "\n", encoding="utf-8")
            fsync_together([*self.unsynced, self.tmp, *([pointer] if self.set_last else [])])
            os.rename(self.tmp, self.path)
            fsync_path(self.path.parent)
            if self.set_last:  # `last` only ever names a complete checkpoint
                os.replace(pointer, self.path.parent / LAST_FILE)
                fsync_path(self.path.parent)
        except BaseException as exc:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if self.set_last:
                pointer.unlink(missing_ok=True)
            _raise_write_error(self.path, exc)
        return self.path

    def abandon(self) -> None:
        """Remove the files without making them a checkpoint (a checkpoint saved before this one failed)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def _temporary_name(path: Path, pid: int) -> Path:
    """Where checkpoint `path` is written before it is complete: hidden, and named after the writing process
    (`_remove_abandoned_temporaries` deletes it once that process is gone)."""
    return path.with_name(f".{path.name}.tmp-{pid}")


def _make_temporary(path: Path, tmp: Path) -> None:
    if path.exists():
        raise FileExistsError(f"checkpoint {path} already exists; ember never overwrites a checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temporaries(path.parent)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def stage_checkpoint(
    path: Path, meta: dict[str, Any], tensors: dict[str, Tensor], rank_meta: dict[str, Any], set_last: bool = False
) -> StagedCheckpoint:
    """One process: write every file of the checkpoint at `path` under a temporary name, without fsync.

    Call ``finish()`` on the result (on any thread) to make it durable and put it in place.
    """
    tmp = _temporary_name(path, os.getpid())
    _make_temporary(path, tmp)
    try:
        unsynced = _write_files(path, tmp, meta, tensors, rank_meta, 0, 1, None, sync=False)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_write_error(path, exc, _bytes_of(tensors))
    return StagedCheckpoint(path, tmp, unsynced, set_last)


def write_checkpoint(
    path: Path,
    meta: dict[str, Any],
    tensors: dict[str, Tensor],
    rank_meta: dict[str, Any],
    rank: int = 0,
    world_size: int = 1,
    group: Any = None,
    set_last: bool = False,
) -> Path:
    """Write a complete checkpoint directory at `path` (which must not exist); returns `path`.

    Every process writes its tensor shards (torch.distributed.checkpoint, a
    collective over `group` when ``world_size > 1``) and its ``rank-N.pt``;
    rank 0 writes ``ember.pt`` and, once all files are fsynced, renames the
    directory into place. A process that does not see rank 0's temporary folder
    (another machine without a shared file system) writes its files into a
    folder of its own at `path` (no ``ember.pt`` in it; `ember.checkpoint.shared_commit`
    uploads it). The processes agree on the outcome of each phase, so
    a failure on one (a full disk) is raised on all, never a hang.
    """
    if world_size == 1:
        return stage_checkpoint(path, meta, tensors, rank_meta, set_last).finish()
    if path.exists():
        raise FileExistsError(f"checkpoint {path} already exists; ember never overwrites a checkpoint")
    tmp = _temporary_name(path, _broadcast_int(os.getpid(), group))  # one name all processes agree on
    failure: BaseException | None = None
    own_folder = rank == 0
    if rank == 0:
        try:
            _make_temporary(path, tmp)
        except BaseException as exc:
            failure = exc
    if not _any_failed(failure, group):
        # A process that does not see rank 0's folder (another machine, no shared file system: a run whose
        # checkpoints go to a store) writes its own files into a folder of its own and puts it in place itself.
        own_folder = rank == 0 or not tmp.is_dir()
        try:
            if rank != 0 and own_folder:  # never removes anything under this name: it may be rank 0's after all
                path.parent.mkdir(parents=True, exist_ok=True)
                _remove_abandoned_temporaries(path.parent)
                tmp.mkdir()
            _write_files(path, tmp, meta, tensors, rank_meta, rank, world_size, group, sync=True)
        except BaseException as exc:
            failure = exc
        if not _any_failed(failure, group) and own_folder:
            try:
                StagedCheckpoint(path, tmp, [], set_last and rank == 0).finish()
            except BaseException as exc:
                failure = exc
        if not _any_failed(failure, group):  # every process returns once the checkpoint (and `last`) is in place
            return path
    if own_folder:
        shutil.rmtree(tmp, ignore_errors=True)
    if failure is None:
        raise CheckpointWriteError(f"writing checkpoint {path} failed on another process (its error says why)")
    _raise_write_error(path, failure, _bytes_of(tensors))


def _broadcast_int(value: int, group: Any) -> int:
    import torch.distributed as dist

    box = torch.tensor([value], dtype=torch.int64)
    keep(box)
    dist.broadcast(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(box)


def _any_failed(failure: BaseException | None, group: Any) -> bool:
    """Whether this or any other process of `group` failed (a collective: every process must call it)."""
    import torch.distributed as dist

    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
    keep(flag)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag)


def _remove_abandoned_temporaries(directory: Path) -> None:
    """Delete temporary checkpoint directories left by processes that died while writing."""
    for stale in directory.glob(".*.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its writer is gone: it can never be completed
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:
            continue


def delete_checkpoint(path: Path) -> None:
    """Delete checkpoint directory `path` all at once, as far as readers can tell: it is renamed to a hidden
    temporary name first, then deleted file by file. A kill in between leaves that hidden directory, never a
    half-deleted checkpoint under its own name; the next save in the folder deletes it
    (`_remove_abandoned_temporaries`)."""
    doomed = path.with_name(f".{path.name}.deleting.tmp-{os.getpid()}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def point_last_at(checkpoint: Path) -> None:
    """Atomically make ``<dir>/last`` name `checkpoint` (a sibling directory)."""
    atomic_write(checkpoint.parent / LAST_FILE, checkpoint.name + "\n", sync_dir=True)


def save_weights(path: Path, state_dict: dict[str, Tensor]) -> None:
    """One-file weights export (a ``torch.save``d state dict), written beside and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch_save_to({k: v.detach().cpu() for k, v in state_dict.items()}, tmp, sync=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind; an older file at `path` stays
        raise

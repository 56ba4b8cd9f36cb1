"""Checkpoint files: one format for every strategy, written atomically, read without running code.

A checkpoint is a directory::

    epoch=2-step=300/
      .metadata          torch.distributed.checkpoint metadata (read by a restricted unpickler)
      __0_0.distcp ...   tensors (module, optimizer state, ...) written by torch.distributed.checkpoint
      ember.pt           everything else, one copy for the run (loaded with weights_only=True)
      rank-0.pt ...      per-process state: RNG streams and data position (weights_only=True)

The directory is written under a temporary name, every file is fsynced, then it
is renamed into place: a crash at any instant leaves either no directory or a
complete one. A ``last`` file beside the checkpoints names the newest complete
one and is itself replaced atomically.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import io
import os
import shutil
import stat
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NoReturn, cast

import torch
from torch import Tensor

from ember import dcp_writer
from ember.dcp_metadata import safe_reader, unpickle_metadata

FORMAT_VERSION = 1
META_FILE = "ember.pt"
LAST_FILE = "last"
_TENSOR_MARK = "__ember_tensor__"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (e.g. the disk is full); the previous checkpoint and ``last`` are intact."""


# --- tensors out of the way: DCP holds tensors only, torch.save holds the rest ------------


def split_tensors(obj: Any, prefix: str = "") -> tuple[Any, dict[str, Tensor]]:
    """Replace every tensor in a nested dict/list/tuple by a marker; return (skeleton, {path: tensor})."""
    tensors: dict[str, Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, Tensor):
            tensors[path] = value
            return {_TENSOR_MARK: path}
        if isinstance(value, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    return walk(obj, prefix), tensors


def join_tensors(skeleton: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of `split_tensors`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR_MARK}:
            return tensors[skeleton[_TENSOR_MARK]]
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_tensors(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(join_tensors(v, tensors) for v in skeleton)
    return skeleton


# --- writing -------------------------------------------------------------------------------


def _underlying(exc: BaseException) -> BaseException:
    """torch.distributed.checkpoint wraps errors per rank (a BaseException); return the first real one."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


#: From this many bytes of tensors per process, a checkpoint is written by several threads.
_PARALLEL_WRITE_BYTES = 64 * 2**20


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save_to(obj: Any, path: Path, sync: bool) -> None:
    with dcp_writer.guarded_open(path, sync) as f:
        torch.save(obj, cast(IO[bytes], f))  # a file-like object with write, tell and flush


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
    cause = _underlying(exc)
    if isinstance(cause, CheckpointWriteError):
        raise cause
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        raise CheckpointWriteError(_no_space(path, needed + _SMALL_FILES_BYTES)) from None
    if isinstance(cause, Exception):
        raise CheckpointWriteError(f"writing checkpoint {path} failed: {type(cause).__name__}: {cause}") from cause
    raise exc


def _guarded_writer(tmp: Path, threads: int) -> Any:
    """DCP's file writer, with every stream a `dcp_writer.GuardedFile` (see there: a failed write must not
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
            with Path(path).open(mode) as raw:
                guarded = dcp_writer.GuardedFile(raw)
                yield guarded
                guarded.check()

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
        _torch_save_to(content, file, sync)
        unsynced.append(file)
    return [] if sync else unsynced


class StagedCheckpoint:
    """A one-process checkpoint whose files are written under a temporary name but not yet durable.

    `finish` fsyncs them, renames the directory into place and points ``last``
    at it. It is mostly waiting on the disk, with the GIL released, so the
    trainer runs it on a background thread while training goes on (see
    `ember.trainer.checkpointing.CheckpointWriter`); until it returns the
    checkpoint does not exist under its name, and a crash leaves only the
    temporary directory, which a later write removes.
    """

    def __init__(self, path: Path, tmp: Path, unsynced: list[Path], set_last: bool) -> None:
        self.path, self.tmp, self.unsynced, self.set_last = path, tmp, unsynced, set_last

    def finish(self) -> Path:
        try:
            for file in self.unsynced:
                _fsync_path(file)
            _fsync_path(self.tmp)
            os.rename(self.tmp, self.path)
            _fsync_path(self.path.parent)
            if self.set_last:  # `last` only ever names a complete checkpoint
                point_last_at(self.path)
        except BaseException as exc:
            shutil.rmtree(self.tmp, ignore_errors=True)
            _raise_write_error(self.path, exc)
        return self.path


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
    directory into place. The processes agree on the outcome of each phase, so
    a failure on one (a full disk) is raised on all, never a hang.
    """
    if world_size == 1:
        return stage_checkpoint(path, meta, tensors, rank_meta, set_last).finish()
    if path.exists():
        raise FileExistsError(f"checkpoint {path} already exists; ember never overwrites a checkpoint")
    tmp = _temporary_name(path, _broadcast_int(os.getpid(), group))  # one name all processes agree on
    failure: BaseException | None = None
    if rank == 0:
        try:
            _make_temporary(path, tmp)
        except BaseException as exc:
            failure = exc
    if not _any_failed(failure, group):
        try:
            _write_files(path, tmp, meta, tensors, rank_meta, rank, world_size, group, sync=True)
        except BaseException as exc:
            failure = exc
        if not _any_failed(failure, group) and rank == 0:
            try:
                StagedCheckpoint(path, tmp, [], set_last).finish()
            except BaseException as exc:
                failure = exc
        if not _any_failed(failure, group):  # every process returns once the checkpoint (and `last`) is in place
            return path
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if failure is None:
        raise CheckpointWriteError(f"writing checkpoint {path} failed on another process (its error says why)")
    _raise_write_error(path, failure, _bytes_of(tensors))


def _broadcast_int(value: int, group: Any) -> int:
    import torch.distributed as dist

    box = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(box)


def _any_failed(failure: BaseException | None, group: Any) -> bool:
    """Whether this or any other process of `group` failed (a collective: every process must call it)."""
    import torch.distributed as dist

    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
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


def point_last_at(checkpoint: Path) -> None:
    """Atomically make ``<dir>/last`` name `checkpoint` (a sibling directory)."""
    pointer = checkpoint.parent / LAST_FILE
    tmp = pointer.with_name(f".{LAST_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(checkpoint.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
    _fsync_path(pointer.parent)


# --- reading ---------------------------------------------------------------------------------

#: The largest ``last`` file read (it holds one directory name).
_POINTER_BYTES = 4096


def read_regular(file: Path, what: str, limit: int | None = None) -> bytes:
    """The bytes of `file`, which must be a regular file; anything else is a `CheckpointError` naming it.

    Opened without blocking and checked before reading: a FIFO, device or directory planted under a
    checkpoint's name is refused instead of hanging or failing with a raw OS error. `what` names the
    checkpoint (or folder) in messages.
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
            raise CheckpointError(f"{what}: {file.name} is {info.st_size} bytes, more than a checkpoint's {limit}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    except OSError as exc:
        raise CheckpointError(f"{what}: cannot read {file.name} ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def read_metadata(path: Path) -> Any:
    """The checkpoint's tensor metadata, through the restricted unpickler."""
    data = read_regular(path / ".metadata", f"checkpoint {path}")
    try:
        metadata = unpickle_metadata(data)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: .metadata is corrupt or not a checkpoint ({exc})") from None
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict) or not isinstance(
        getattr(metadata, "storage_data", None), dict
    ):
        raise CheckpointError(f"checkpoint {path}: .metadata is not torch.distributed.checkpoint metadata")
    return metadata


def _load_safe(file: Path) -> Any:
    data = read_regular(file, f"checkpoint {file.parent}")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {file.parent}: {file.name} is corrupt or holds something other than plain data ({first_line})"
        ) from None


#: Fields of ``ember.pt`` and the types they must have (None: the field may be absent).
_META_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "format_version": ((int,), True),
    "tensor_skeleton": ((dict,), True),
    "state": ((dict,), True),
    "weights_only": ((bool,), False),
    "world_size": ((int,), False),
    "hparams": ((dict,), False),
    "config": ((dict, type(None)), False),
    "module_class": ((str, type(None)), False),
}


def _check_meta(path: Path, meta: Any) -> dict[str, Any]:
    """``ember.pt``'s fields have the types ember wrote; anything else is a `CheckpointError` naming the field."""
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} is not an ember checkpoint")
    for field, (types, required) in _META_FIELDS.items():
        if field not in meta:
            if required:
                raise CheckpointError(f"checkpoint {path}: {META_FILE} lacks {field!r}; it is damaged or not ember's")
            continue
        value = meta[field]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            expected = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise CheckpointError(
                f"checkpoint {path}: {META_FILE} field {field!r} is {type(value).__name__} {value!r:.60}, "
                f"expected {expected}; the file is damaged or not ember's"
            )
    if meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {meta['format_version']}, newer than this ember "
            f"understands ({FORMAT_VERSION}); upgrade ember to load it"
        )
    if meta["format_version"] < 1 or meta.get("world_size", 1) < 1:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} holds impossible values; the file is damaged")
    if not isinstance(meta["tensor_skeleton"].get("module"), dict):
        raise CheckpointError(f"checkpoint {path}: {META_FILE} describes no module weights; the file is damaged")
    for name, kind in _STATE_ENTRIES.items():
        if name in meta["state"] and not isinstance(meta["state"][name], kind):
            raise CheckpointError(
                f"checkpoint {path}: {META_FILE} state {name!r} is {type(meta['state'][name]).__name__}, expected "
                f"{kind.__name__}; the file is damaged or not ember's"
            )
    return meta


#: Entries of ``ember.pt``'s state whose container type ember knows (the registry's built-in entries).
_STATE_ENTRIES: dict[str, type] = {
    "progress": dict,
    "callbacks": dict,
    "loggers": list,
    "lr_schedulers": list,
    "precision": dict,
    "metrics": dict,
}


def read_meta(path: Path) -> dict[str, Any]:
    """Read and check ``ember.pt`` (format version and field types included)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (expected a checkpoint directory)")
    return _check_meta(path, _load_safe(path / META_FILE))


def read_rank_meta(path: Path, rank: int = 0) -> dict[str, Any]:
    meta = _load_safe(path / f"rank-{rank}.pt")
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: rank-{rank}.pt is not an ember checkpoint file")
    return meta


def read_tensors(path: Path, keys: Callable[[str], bool] = lambda _k: True) -> dict[str, Tensor]:
    """Load the tensors whose key passes `keys`, into freshly allocated CPU tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(path)
    template: dict[str, Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if keys(key) and isinstance(item, TensorStorageMetadata):
            template[key] = torch.empty(item.size, dtype=item.properties.dtype)
    _check_shard_files(path, metadata)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(template, storage_reader=safe_reader(path, read_metadata), no_dist=True)
    except (Exception, CheckpointException) as exc:
        cause = _underlying(exc)
        first_line = (str(cause).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"checkpoint {path}: reading tensors failed ({type(cause).__name__}: {first_line})"
        ) from None
    return template


def _check_shard_files(path: Path, metadata: Any) -> None:
    """Every tensor's bytes must lie inside an existing regular shard file (catches truncation, deletion and
    planted FIFOs) in the checkpoint directory itself."""
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _is_plain_name(name):
            raise CheckpointError(f"checkpoint {path}: .metadata names a shard outside the checkpoint ({name!r})")
        try:
            mode = os.stat(path / name)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} is incomplete: shard {name} is missing") from None
        if not stat.S_ISREG(mode.st_mode):
            raise CheckpointError(f"checkpoint {path}: shard {name} is not a regular file")
        if mode.st_size < info.offset + info.length:
            raise CheckpointError(f"checkpoint {path}: shard {name} is truncated")


def _is_plain_name(name: str) -> bool:
    """A file or directory name inside one folder: no separators, not hidden, not ``.``/``..``."""
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".") and "\0" not in name


def join_checked(path: Path, skeleton: Any, tensors: dict[str, Tensor]) -> Any:
    """`join_tensors`, with a skeleton that names a tensor the files lack reported as a `CheckpointError`."""
    try:
        return join_tensors(skeleton, tensors)
    except KeyError as exc:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} names tensor {exc} that the shards lack") from None


def read_module_state(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(ember.pt content, the module's state dict) without reading optimizer state."""
    meta = read_meta(path)
    tensors = read_tensors(path, keys=lambda key: key.startswith("/module/"))
    return meta, join_checked(path, meta["tensor_skeleton"]["module"], tensors)


def load_weights_into(
    module: Any, state: dict[str, Tensor], path: Path, module_class: str | None, load: Any = None, hint: str = ""
) -> None:
    """``module.load_state_dict(state)`` (or ``load(module, state)``) with an error naming the first
    missing/unexpected keys or mismatched shapes, followed by `hint` (see `mismatch_hint`)."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} holds a different module ({module_class}) than {type(module).__qualname__}: "
            + _describe_keys(missing, unexpected, list(own))
            + hint
        )
    for key, value in state.items():
        if own[key].shape != value.shape:
            raise CheckpointError(
                f"checkpoint {path}: {key} has shape {tuple(value.shape)}, the module expects {tuple(own[key].shape)}"
                + hint
            )
    if load is not None:
        load(module, state)
    else:
        module.load_state_dict(state)


def mismatch_hint(meta: dict[str, Any], given_config: dict[str, Any] | None, hparams: dict[str, Any]) -> str:
    """What would make the module fit the checkpoint, as text to append to the error: for a run built from a
    config, the ``module.*`` overrides it was trained with; else the hyperparameters; "" when neither differs."""
    saved = meta.get("config")
    found: list[tuple[str, Any]] = []
    if isinstance(saved, dict) and isinstance(given_config, dict):
        found = [
            (key, old)
            for key, old, _ in differences(saved.get("module"), given_config.get("module"), "module")
            if old is not None and not key.endswith("._target_")
        ]
    trained = meta.get("hparams")
    if not found and isinstance(trained, dict) and hparams:
        prefix = "module" if given_config is not None else ""
        found = [(key, old) for key, old, _ in differences(trained, dict(hparams), prefix) if old is not None]
        if found and given_config is None:
            values = ", ".join(f"{key}={value!r}" for key, value in found)
            return f"; it was trained with {values}: build the module with those (or use load_from_checkpoint)"
    if not found:
        return ""
    overrides = " ".join(f"{key}={_as_override(value)}" for key, value in found)
    return f"; it was trained with other module settings: add the override(s) {overrides}"


def _as_override(value: Any) -> str:
    """A value as it is written on the ``ember`` command line (YAML)."""
    import json

    try:
        return json.dumps(value) if not isinstance(value, str) or not value.isidentifier() else value
    except (TypeError, ValueError):
        return repr(value)


_MISSING = object()


def differences(saved: Any, given: Any, key: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, given value)`` for every leaf where two nested dicts differ (a value
    missing on one side is None there). The values are data: compared and shown, never built."""
    if isinstance(saved, dict) and isinstance(given, dict):
        found: list[tuple[str, Any, Any]] = []
        for name in sorted(set(saved) | set(given), key=str):
            sub = f"{key}.{name}" if key else str(name)
            found += differences(saved.get(name, _MISSING), given.get(name, _MISSING), sub)
        return found
    if saved is given or (saved is not _MISSING and given is not _MISSING and _same(saved, given)):
        return []
    return [(key, None if saved is _MISSING else saved, None if given is _MISSING else given)]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors of different shapes
        return False


def _describe_keys(missing: list[str], unexpected: list[str], valid: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing keys {missing[:5]}" + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if unexpected:
        hint = difflib.get_close_matches(unexpected[0], valid, n=1)
        parts.append(
            f"unexpected keys {unexpected[:5]}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    return "; ".join(parts)


# --- finding checkpoints -----------------------------------------------------------------------


def read_pointer(pointer: Path) -> Path:
    """The checkpoint a ``last`` file names: a sibling directory name, nothing else (no path, no ``..``)."""
    data = read_regular(pointer, f"checkpoint pointer {pointer}", limit=_POINTER_BYTES)
    try:
        name = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"checkpoint pointer {pointer} is not text; it is damaged or not ember's") from None
    if not _is_plain_name(name):
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


def check_complete(path: Path) -> dict[str, Any]:
    """Cheap validation of a checkpoint directory (metadata, shards, ember.pt); returns its meta."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (expected a checkpoint directory)")
    metadata = read_metadata(path)
    _check_shard_files(path, metadata)
    meta = read_meta(path)
    missing = sorted(set(_tensor_names(meta["tensor_skeleton"])) - set(metadata.state_dict_metadata))
    if missing:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} names tensors the shards lack ({missing[:3]})")
    read_rank_meta(path, 0)
    return meta


def _tensor_names(skeleton: Any) -> list[str]:
    """The tensor keys a skeleton (from `split_tensors`) refers to."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR_MARK}:
            return [str(skeleton[_TENSOR_MARK])]
        return [name for value in skeleton.values() for name in _tensor_names(value)]
    if isinstance(skeleton, (list, tuple)):
        return [name for value in skeleton for name in _tensor_names(value)]
    return []


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


def save_weights(path: Path, state_dict: dict[str, Tensor]) -> None:
    """One-file weights export (a ``torch.save``d state dict), written beside and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _torch_save_to({k: v.detach().cpu() for k, v in state_dict.items()}, tmp, sync=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind; an older file at `path` stays
        raise

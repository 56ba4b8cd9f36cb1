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

import difflib
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

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
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def _raise_write_error(path: Path, exc: BaseException) -> NoReturn:
    """Re-raise a failed write's error, DCP's per-rank wrapper replaced by its first real cause."""
    cause = _underlying(exc)
    if cause is not exc and isinstance(cause, Exception):
        raise CheckpointError(f"writing checkpoint {path} failed: {type(cause).__name__}: {cause}") from cause
    raise exc


def _write_files(
    tmp: Path,
    meta: dict[str, Any],
    tensors: dict[str, Tensor],
    rank_meta: dict[str, Any],
    rank: int,
    world_size: int,
    group: Any,
    sync: bool,
) -> list[Path]:
    """This process's files of a checkpoint, into `tmp`; returns those written without fsync (`sync` False)."""
    import torch.distributed.checkpoint as dcp

    unsynced: list[Path] = []
    # Large states go to several files per process, written (and fsynced) by parallel threads: the copy
    # into the page cache and the flush to disk overlap, which brings a save close to a plain torch.save
    # without fsync. Small ones are not worth starting threads for; in one process they skip DCP's planning.
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if world_size == 1 and size < _PARALLEL_WRITE_BYTES and dcp_writer.can_write(tensors):
        dcp_writer.write_tensors(tmp, tensors, fsync=sync)
        unsynced += [tmp / dcp_writer.DATA_FILE, tmp / dcp_writer.METADATA_FILE]
    else:
        threads = max(1, min(4, os.cpu_count() or 1)) if size >= _PARALLEL_WRITE_BYTES else 1
        writer = dcp.FileSystemWriter(tmp, sync_files=True, single_file_per_rank=True, thread_count=threads)
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
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _make_temporary(path, tmp)
    try:
        unsynced = _write_files(tmp, meta, tensors, rank_meta, 0, 1, None, sync=False)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_write_error(path, exc)
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
    directory into place.
    """
    import torch.distributed as dist

    if world_size == 1:
        return stage_checkpoint(path, meta, tensors, rank_meta, set_last).finish()

    def barrier() -> None:
        dist.barrier(group=group)

    tmp = path.with_name(f".{path.name}.tmp")  # one temporary name all processes agree on
    if path.exists():
        raise FileExistsError(f"checkpoint {path} already exists; ember never overwrites a checkpoint")
    if rank == 0:
        _make_temporary(path, tmp)
    barrier()
    try:
        _write_files(tmp, meta, tensors, rank_meta, rank, world_size, group, sync=True)
        barrier()
        if rank == 0:
            StagedCheckpoint(path, tmp, [], set_last).finish()
        barrier()  # every process returns once the checkpoint (and `last`) is in place
    except BaseException as exc:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_write_error(path, exc)
    return path


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


def read_metadata(path: Path) -> Any:
    """The checkpoint's tensor metadata, through the restricted unpickler."""
    file = path / ".metadata"
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: {file.name} is missing") from None
    try:
        return unpickle_metadata(data)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: {file.name} is corrupt or not a checkpoint ({exc})") from None


def _load_safe(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {file.parent} is incomplete: {file.name} is missing") from None
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {file.parent}: {file.name} is corrupt or holds something other than plain data ({first_line})"
        ) from None


def read_meta(path: Path) -> dict[str, Any]:
    """Read and check ``ember.pt`` (format version included)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (expected a checkpoint directory)")
    meta = _load_safe(path / META_FILE)
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} is not an ember checkpoint")
    if meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {meta['format_version']}, newer than this ember "
            f"understands ({FORMAT_VERSION}); upgrade ember to load it"
        )
    return meta


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
    """Every tensor's bytes must lie inside an existing shard file (catches truncation and deletion)."""
    for info in metadata.storage_data.values():
        file = path / info.relative_path
        if not file.exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: shard {info.relative_path} is missing")
        if file.stat().st_size < info.offset + info.length:
            raise CheckpointError(f"checkpoint {path}: shard {info.relative_path} is truncated")


def read_module_state(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(ember.pt content, the module's state dict) without reading optimizer state."""
    meta = read_meta(path)
    tensors = read_tensors(path, keys=lambda key: key.startswith("/module/"))
    return meta, join_tensors(meta["tensor_skeleton"]["module"], tensors)


def load_weights_into(
    module: Any, state: dict[str, Tensor], path: Path, module_class: str | None, load: Any = None
) -> None:
    """``module.load_state_dict(state)`` (or ``load(module, state)``) with an error naming the first
    missing/unexpected keys or mismatched shapes."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} holds a different module ({module_class}) than {type(module).__qualname__}: "
            + _describe_keys(missing, unexpected, list(own))
        )
    for key, value in state.items():
        if own[key].shape != value.shape:
            raise CheckpointError(
                f"checkpoint {path}: {key} has shape {tuple(value.shape)}, the module expects {tuple(own[key].shape)}"
            )
    if load is not None:
        load(module, state)
    else:
        module.load_state_dict(state)


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


def check_complete(path: Path) -> dict[str, Any]:
    """Cheap validation of a checkpoint directory (metadata, shards, ember.pt); returns its meta."""
    _check_shard_files(path, read_metadata(path))
    meta = read_meta(path)
    read_rank_meta(path, 0)
    return meta


# --- finding checkpoints -----------------------------------------------------------------------


def checkpoints_in(directory: Path) -> list[Path]:
    """Complete-looking checkpoint directories in `directory` (temporary ones excluded)."""
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / META_FILE).exists()]


def newest_valid(directory: Path) -> Path | None:
    """The checkpoint ``last`` names, or, when that one is missing or corrupt, the newest valid other one."""
    candidates: list[Path] = []
    pointer = directory / LAST_FILE
    named: Path | None = None
    if pointer.exists():
        named = directory / pointer.read_text(encoding="utf-8").strip()
        candidates.append(named)
    by_step: list[tuple[int, Path]] = []
    for path in checkpoints_in(directory):
        if path != named:
            try:
                progress = read_meta(path).get("state", {}).get("progress", {})
                by_step.append((int(progress.get("global_step", -1)), path))
            except (CheckpointError, TypeError, ValueError):
                continue
    candidates += [p for _, p in sorted(by_step, key=lambda sp: sp[0], reverse=True)]
    for path in candidates:
        try:
            check_complete(path)
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint: {exc}", RuntimeWarning, stacklevel=2)
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

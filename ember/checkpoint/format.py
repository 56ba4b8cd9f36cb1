"""The checkpoint format: what a checkpoint directory holds, and the checks its ``ember.pt`` must pass.

A checkpoint is a directory::

    epoch=2-step=300/
      .metadata          torch.distributed.checkpoint metadata (read by a restricted unpickler)
      __0_0.distcp ...   tensors (module, optimizer state, ...) written by torch.distributed.checkpoint
      ember.pt           everything else, one copy for the run (loaded with weights_only=True)
      rank-0.pt ...      per-process state: RNG streams and data position (weights_only=True)

Tensors go to the DCP files, everything else to ``ember.pt``; `split_tensors` / `join_tensors` move
them apart and back. Writing is in `writing`, reading in `reading`, finding checkpoints in `locating`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a tensor is handled: the upload process reads this module without it
    from torch import Tensor

FORMAT_VERSION = 1

META_FILE = "ember.pt"

LAST_FILE = "last"

_TENSOR_MARK = "__ember_tensor__"


#: What a file that contradicts itself (a size it cannot hold, a record cut short) is answered with.
DAMAGED = "the file is damaged or not ember's: load another checkpoint (e.g. the one before it)"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (e.g. the disk is full); the previous checkpoint and ``last`` are intact."""


def split_tensors(obj: Any, prefix: str = "") -> tuple[Any, dict[str, Tensor]]:
    """Replace every tensor in a nested dict/list/tuple by a marker; return (skeleton, {path: tensor})."""
    from torch import Tensor

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


def join_checked(path: Path, skeleton: Any, tensors: dict[str, Tensor]) -> Any:
    """`join_tensors`, with a skeleton that names a tensor the files lack reported as a `CheckpointError`."""
    try:
        return join_tensors(skeleton, tensors)
    except KeyError as exc:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} names tensor {exc} that the shards lack") from None


def tensor_names(skeleton: Any) -> list[str]:
    """The tensor keys a skeleton (from `split_tensors`) refers to."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR_MARK}:
            return [str(skeleton[_TENSOR_MARK])]
        return [name for value in skeleton.values() for name in tensor_names(value)]
    if isinstance(skeleton, (list, tuple)):
        return [name for value in skeleton for name in tensor_names(value)]
    return []


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


def check_meta(path: Path, meta: Any) -> dict[str, Any]:
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

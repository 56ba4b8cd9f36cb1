"""Reading checkpoints without running code: checked files, restricted unpickling, clear errors.

``ember.pt``, ``rank-N.pt`` and the shards are read with ``torch.load(weights_only=True)``; DCP's
``.metadata`` (which torch reads with plain ``pickle``) goes through an unpickler that resolves only the
checkpoint metadata classes. Only regular files are opened. Anything unusable is a `CheckpointError`
naming the file.
"""

from __future__ import annotations

import difflib
import io
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ember.checkpoint import bounds
from ember.checkpoint.dcp_metadata import safe_reader, unpickle_metadata
from ember.checkpoint.files import read_regular
from ember.checkpoint.format import META_FILE, CheckpointError, check_meta, join_checked, tensor_names
from ember.checkpoint.writing import underlying

#: ``.metadata`` may be this many bytes plus `_METADATA_PER_SHARD_BYTE` times the shards' size: it describes
#: their chunks, each of which costs a shard far more bytes (a whole archive) than its entry here.
_METADATA_BASE_BYTES = 1 << 20
_METADATA_PER_SHARD_BYTE = 4


def _shard_bytes(path: Path) -> int:
    """The size of the shard files (``*.distcp``) in checkpoint directory `path`."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    return sum(e.stat().st_size for e in entries if e.name.endswith(".distcp") and e.is_file(follow_symlinks=False))


def read_metadata(path: Path) -> Any:
    """The checkpoint's tensor metadata, through the restricted unpickler; a ``.metadata`` larger than the
    shards it describes could justify is refused before it is read."""
    limit = _METADATA_BASE_BYTES + _METADATA_PER_SHARD_BYTE * _shard_bytes(path)
    data = read_regular(path / ".metadata", f"checkpoint {path}", limit=limit)
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
    """``torch.load(weights_only=True)`` of `file`, once it is checked to be the whole archive torch writes
    (`bounds.check_archive_file`: a file extended, cut or padded is refused before it is read)."""
    what = f"checkpoint {file.parent}"
    data = read_regular(file, what, check=lambda fd, size: bounds.check_archive_file(file, fd, size, what))
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {file.parent}: {file.name} is corrupt or holds something other than plain data ({first_line})"
        ) from None


def read_meta(path: Path) -> dict[str, Any]:
    """Read and check ``ember.pt`` (format version and field types included)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (expected a checkpoint directory)")
    return check_meta(path, _load_safe(path / META_FILE))


def read_rank_meta(path: Path, rank: int = 0) -> dict[str, Any]:
    meta = _load_safe(path / f"rank-{rank}.pt")
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: rank-{rank}.pt is not an ember checkpoint file")
    return meta


def read_tensors(path: Path, keys: Callable[[str], bool] = lambda _k: True) -> dict[str, Tensor]:
    """Load the tensors whose key passes `keys`, into freshly allocated CPU tensors."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(path)
    wanted = [
        k for k, item in metadata.state_dict_metadata.items() if keys(k) and isinstance(item, TensorStorageMetadata)
    ]
    bounds.check_tensor_claims(path, metadata, wanted)  # every byte allocated below is a byte on disk
    template: dict[str, Tensor] = {}
    for key in wanted:
        item = metadata.state_dict_metadata[key]
        try:
            template[key] = torch.empty(item.size, dtype=item.properties.dtype)
        except (RuntimeError, MemoryError) as exc:
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise CheckpointError(f"checkpoint {path}: no memory for {key} {tuple(item.size)} ({first_line})") from None
    _dcp_load(path, template, no_dist=True)
    return template


def read_shards(path: Path, targets: dict[str, Tensor], group: Any = None) -> dict[str, Tensor]:
    """Read the tensors named in `targets` into new tensors laid out like them; every process of `group`
    calls it. For a DTensor target this process reads and allocates only the chunks its shard covers.

    A name the checkpoint lacks, or holds with another shape or dtype, is left out of the result (read it
    with `read_tensors`; loading it then reports the difference).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(path)
    template: dict[str, Tensor] = {}
    for key, like in targets.items():
        item = metadata.state_dict_metadata.get(key)
        if isinstance(item, TensorStorageMetadata) and (tuple(item.size), item.properties.dtype) == (
            tuple(like.shape),
            like.dtype,
        ):
            template[key] = torch.empty_like(like)
    bounds.check_tensor_claims(path, metadata, list(template))
    _dcp_load(path, template, process_group=group)
    return template


def _dcp_load(path: Path, template: dict[str, Tensor], **options: Any) -> None:
    """``dcp.load`` into `template` through the safe metadata reader; a failure is a `CheckpointError`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(template, storage_reader=safe_reader(path, read_metadata), **options)
    except (Exception, CheckpointException) as exc:
        cause = underlying(exc)
        first_line = (str(cause).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"checkpoint {path}: reading tensors failed ({type(cause).__name__}: {first_line})"
        ) from None


def read_module_state(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(ember.pt content, the module's state dict) without reading optimizer state."""
    meta = read_meta(path)
    tensors = read_tensors(path, keys=lambda key: key.startswith("/module/"))
    return meta, join_checked(path, meta["tensor_skeleton"]["module"], tensors)


def check_complete(path: Path) -> dict[str, Any]:
    """Cheap validation of a checkpoint directory (metadata, shards, ember.pt); returns its meta."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (expected a checkpoint directory)")
    metadata = read_metadata(path)
    tensors = [k for k, item in metadata.state_dict_metadata.items() if hasattr(item, "chunks")]
    bounds.check_tensor_claims(path, metadata, tensors)  # shards present, whole, and as large as claimed
    meta = read_meta(path)
    missing = sorted(set(tensor_names(meta["tensor_skeleton"])) - set(metadata.state_dict_metadata))
    if missing:
        raise CheckpointError(f"checkpoint {path}: {META_FILE} names tensors the shards lack ({missing[:3]})")
    read_rank_meta(path, 0)
    return meta


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

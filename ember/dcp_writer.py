"""torch.distributed.checkpoint files for one process, written without DCP's planning machinery.

``dcp.save`` spends about half a millisecond of Python per tensor on planning,
write items, metadata and logging before any byte is written: a model with its
AdamW state (a few hundred tensors) pays a noticeable fraction of a second per
checkpoint, and a tiny model pays several milliseconds at every epoch end. For
one process holding plain tensors the plan is trivial (every tensor is one
whole chunk in one file), so this module writes the same two files directly:

- ``__0_0.distcp``: each tensor ``torch.save``\\ d one after the other, as
  DCP's ``FileSystemWriter`` does with ``single_file_per_rank=True``;
- ``.metadata``: DCP's own `Metadata` dataclasses, pickled, naming each
  tensor's offset and length in that file.

The result is read by ``dcp.load`` (and ember's restricted reader) exactly like
a ``dcp.save`` checkpoint; tests/unit/test_dcp_writer.py compares the two field
by field and loads each with the other's reader.
"""

from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path

import torch
from torch import Tensor

DATA_FILE = "__0_0.distcp"
METADATA_FILE = ".metadata"


def can_write(tensors: dict[str, Tensor]) -> bool:
    """Whether `write_tensors` handles this state: plain tensors only (no DTensor or other subclass)."""
    return all(type(t) in (Tensor, torch.nn.Parameter) for t in tensors.values())


def _whole(tensor: Tensor) -> Tensor:
    """A CPU tensor that owns exactly its bytes (``torch.save`` of a view would write its whole storage)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def write_tensors(directory: Path, tensors: dict[str, Tensor], fsync: bool = True) -> None:
    """Write `tensors` (flat, keyed by name) into `directory` as a one-process DCP checkpoint."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state_md: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    with open(directory / DATA_FILE, "wb") as f:
        for key, value in tensors.items():
            tensor = _whole(value)
            start = f.tell()
            torch.save(tensor, f)
            offsets = torch.Size([0] * tensor.dim())
            state_md[key] = TensorStorageMetadata(
                properties=TensorProperties.create_from_tensor(value),
                size=tensor.size(),
                chunks=[ChunkStorageMetadata(offsets=offsets, sizes=tensor.size())],
            )
            storage[MetadataIndex(key, offsets, 0)] = _StorageInfo(DATA_FILE, start, f.tell() - start)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    metadata = Metadata(
        state_dict_metadata=dict(state_md),
        planner_data={key: (key,) for key in tensors},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=directory, save_id=str(uuid.uuid4())),
        version=getattr(filesystem, "CURRENT_DCP_VERSION", "1.0.0"),
    )
    with open(directory / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        if fsync:
            os.fsync(f.fileno())

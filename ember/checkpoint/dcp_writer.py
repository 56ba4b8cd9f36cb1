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
by field and byte for byte, and loads each with the other's reader.

Most of a small tensor's ``torch.save`` is pickling its layout (dtype, shape,
strides), the same for every tensor of that layout. `save_tensor` pickles each
layout once, checks that it then writes exactly the bytes ``torch.save`` writes,
and from then on only copies the data: about 3x faster per tensor.
"""

from __future__ import annotations

import io
import pickle
import sys
import uuid
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch import Tensor

from ember.checkpoint.files import guarded_open

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


#: The ``data.pkl`` record ``torch.save`` writes for a tensor of each layout; None where
#: `save_tensor`'s records did not come out identical to ``torch.save``'s (it then uses torch.save).
_PICKLED: dict[tuple[Any, ...], bytes | None] = {}
_MAX_LAYOUTS = 4096  # beyond this many layouts in one process, new ones are not remembered


def _layout(tensor: Tensor) -> tuple[Any, ...] | None:
    """What ``torch.save`` pickles about `tensor` besides its bytes; None for tensors it pickles otherwise."""
    if (
        type(tensor) is not Tensor
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.__dict__
    ):
        return None
    metadata = tuple(sorted(torch._utils.get_tensor_metadata(tensor).items()))
    storage_bytes = tensor.untyped_storage().nbytes()
    options = (torch.serialization.get_crc32_options(), torch.serialization._get_storage_alignment())
    return (tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset(), storage_bytes, metadata, options)


def _records(f: IO[bytes], pickled: bytes, tensor: Tensor) -> None:
    """The records of ``torch.save(tensor, f)``, in its order, with the pickle given."""
    options = (torch.serialization.get_crc32_options(), torch.serialization._get_storage_alignment())
    writer = torch._C.PyTorchFileWriter(f, *options)
    alignment, byteorder = str(options[1]).encode(), sys.byteorder.encode()
    writer.write_record("data.pkl", pickled, len(pickled))
    writer.write_record(".format_version", b"1", 1)
    writer.write_record(".storage_alignment", alignment, len(alignment))
    writer.write_record("byteorder", byteorder, len(byteorder))
    storage = tensor.untyped_storage()
    writer.write_record("data/0", cast(Any, storage), storage.nbytes())  # as torch.save passes it
    writer.write_end_of_file()


def _learn(tensor: Tensor) -> bytes | None:
    """``torch.save``'s pickle for `tensor`'s layout, if `_records` with it reproduces torch.save's bytes."""
    reference = io.BytesIO()
    torch.save(tensor, reference)
    expected = reference.getvalue()
    pickled = torch._C.PyTorchFileReader(io.BytesIO(expected)).get_record("data.pkl")
    candidate = io.BytesIO()
    _records(candidate, pickled, tensor)
    return pickled if candidate.getvalue() == expected else None


def save_tensor(tensor: Tensor, f: IO[bytes]) -> None:
    """Write exactly what ``torch.save(tensor, f)`` writes (without its flush), faster for a repeated layout."""
    layout = _layout(tensor)
    if layout is not None and layout not in _PICKLED and len(_PICKLED) < _MAX_LAYOUTS:
        _PICKLED[layout] = _learn(tensor)
    pickled = None if layout is None else _PICKLED.get(layout)
    if pickled is None:
        torch.save(tensor, f)
    else:
        _records(f, pickled, tensor)


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
    with guarded_open(directory / DATA_FILE, fsync) as f:
        for key, value in tensors.items():
            tensor = _whole(value)
            start = f.tell()
            save_tensor(tensor, f)
            offsets = torch.Size([0] * tensor.dim())
            state_md[key] = TensorStorageMetadata(
                properties=TensorProperties.create_from_tensor(value),
                size=tensor.size(),
                chunks=[ChunkStorageMetadata(offsets=offsets, sizes=tensor.size())],
            )
            storage[MetadataIndex(key, offsets, 0)] = _StorageInfo(DATA_FILE, start, f.tell() - start)
    metadata = Metadata(
        state_dict_metadata=dict(state_md),
        planner_data={key: (key,) for key in tensors},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=directory, save_id=str(uuid.uuid4())),
        version=getattr(filesystem, "CURRENT_DCP_VERSION", "1.0.0"),
    )
    with guarded_open(directory / METADATA_FILE, fsync) as f:
        pickle.dump(metadata, f)

"""torch.distributed.checkpoint metadata, read without running code.

DCP's own ``FileSystemReader`` reads ``.metadata`` with plain ``pickle.load``,
so a crafted file runs its payload even when the load then fails. Here the
metadata is unpickled by an unpickler that resolves only DCP's metadata
classes (and dtypes); anything else is refused before it is constructed.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
        "MetadataIndex",
        "StorageMeta",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint metadata and nothing else: no other global resolves."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def unpickle_metadata(data: bytes) -> Any:
    """DCP metadata from the bytes of a ``.metadata`` file; `pickle.UnpicklingError` for any other global."""
    return _MetadataUnpickler(io.BytesIO(data)).load()


def safe_reader(path: Path, read_metadata: Callable[[Path], Any]) -> Any:
    """A DCP ``FileSystemReader`` for `path` whose metadata comes from `read_metadata` (a safe reader)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)

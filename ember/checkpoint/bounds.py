"""Sizes a checkpoint's files claim, checked against the files before anything is read or allocated.

Every size field that would drive a read or an allocation is a claim a damaged or crafted file can make
up: a tensor's shape and dtype in DCP's ``.metadata``, a chunk's offset and length in a shard, a record's
length inside a ``torch.save`` file (``ember.pt``, ``rank-N.pt``, each tensor in a shard), and a file's own
size (a sparse file can claim terabytes and hold nothing). Each is checked here against what is on disk:

- a ``torch.save`` file (or one slice of a shard) must be the zip archive torch writes, whole: its end
  record exactly at its end (a file extended by ``truncate`` or padding has zeros there), uncompressed
  records lying inside it one after the other, their central directory where the end record says;
- a tensor the metadata describes must be tiled by its chunks, each chunk stored in a slice of a regular
  shard file inside the checkpoint, the slices of a file disjoint, and each slice a whole archive whose
  data records hold at least the chunk's bytes. So every byte allocated for a tensor is a byte of a
  record on disk, and a read never goes past a file.

Nothing here reads more than a few hundred bytes per record. Failures are `CheckpointError` naming the
checkpoint, the file and what to do.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from ember.checkpoint.files import is_plain_name
from ember.checkpoint.format import DAMAGED, CheckpointError

#: The largest central directory read from one archive (torch writes a few hundred bytes per record).
_MAX_DIRECTORY_BYTES = 16 << 20

_END = struct.Struct("<4s4H2IH")  # end of central directory record (22 bytes, no comment)
_END64_LOCATOR = struct.Struct("<4sIQI")  # zip64 end of central directory locator (20 bytes)
_END64 = struct.Struct("<4sQ2H2I4Q")  # zip64 end of central directory record (56 bytes)
_LOCAL_HEADER = 30


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, read with ``pread`` (the file's offset is untouched)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self.length - self.pos)
        size = left if size is None or size < 0 else min(size, left)
        data = os.pread(self.fd, size, self.start + self.pos) if size else b""
        self.pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def archive_records(fd: int, start: int, length: int, where: str) -> dict[str, int]:
    """The records (name without the archive folder -> bytes) of the ``torch.save`` archive that fills
    ``[start, start + length)`` of `fd`, checked as the module docstring says; `where` names it in errors."""

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{where} {what}; {DAMAGED}")

    if length < _END.size:
        raise refuse(f"is {length} bytes, too short for the archive torch writes")
    data = _Slice(fd, start, length)
    data.seek(length - _END.size)
    signature, _, _, _, _, cd_size, cd_offset, comment = _END.unpack(data.read(_END.size))
    if signature != b"PK\x05\x06" or comment:
        raise refuse("does not end with an archive's end record (it was cut short, extended or overwritten)")
    end = length - _END.size
    if end >= _END64_LOCATOR.size + _END64.size:
        data.seek(end - _END64_LOCATOR.size)
        locator = _END64_LOCATOR.unpack(data.read(_END64_LOCATOR.size))
        if locator[0] == b"PK\x06\x07":
            end = end - _END64_LOCATOR.size - _END64.size
            if locator[2] != end:
                raise refuse("has a zip64 end record where none can be")
            data.seek(end)
            record = _END64.unpack(data.read(_END64.size))
            if record[0] != b"PK\x06\x06":
                raise refuse("has no zip64 end record where its locator says")
            cd_size, cd_offset = record[8], record[9]
    if cd_offset + cd_size != end or cd_size > _MAX_DIRECTORY_BYTES:
        raise refuse(f"claims a {cd_size}-byte record directory at byte {cd_offset}, which its size cannot hold")
    data.seek(0)
    try:
        infos = zipfile.ZipFile(data).infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise refuse(f"is not a readable archive ({exc})") from None
    records: dict[str, int] = {}
    bound = cd_offset
    for info in sorted(infos, key=lambda i: i.header_offset, reverse=True):
        stored = info.compress_type == zipfile.ZIP_STORED and info.compress_size == info.file_size
        if not stored or info.header_offset + _LOCAL_HEADER + len(info.orig_filename) + info.file_size > bound:
            raise refuse(f"claims a {info.file_size}-byte record {info.orig_filename!r} that its bytes cannot hold")
        bound = info.header_offset
        records[info.orig_filename.split("/", 1)[-1]] = info.file_size
    return records


def check_archive_file(file: Path, fd: int, size: int, what: str) -> None:
    """`file` (open as `fd`, `size` bytes) is a whole ``torch.save`` archive (`archive_records`)."""
    archive_records(fd, 0, size, f"{what}: {file.name} ({size} bytes)")


def check_tensor_claims(path: Path, metadata: Any, keys: list[str]) -> None:
    """Every tensor in `keys` that `metadata` (DCP's ``.metadata`` of checkpoint `path`) describes is held,
    byte for byte, by slices of regular shard files in `path`: checked before any tensor is allocated."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {what}; {DAMAGED}")

    slices = _check_slices(path, metadata.storage_data, refuse)
    for key in keys:
        item = metadata.state_dict_metadata[key]
        if not isinstance(item, TensorStorageMetadata):
            continue
        dtype, size = getattr(item.properties, "dtype", None), item.size
        if not isinstance(dtype, torch.dtype) or not _is_shape(size):
            raise refuse(f".metadata describes {key} with dtype {dtype!r} and shape {size!r}")
        itemsize, numel = dtype.itemsize, math.prod(size)
        covered = 0
        for chunk in item.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if not (_is_shape(offsets) and _is_shape(sizes) and len(offsets) == len(sizes) == len(size)) or any(
                o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)
            ):
                raise refuse(f".metadata gives {key} a chunk {sizes} at {offsets} outside its shape {tuple(size)}")
            where = slices.get(MetadataIndex(key, torch.Size(offsets)))
            if where is None:
                raise refuse(f".metadata stores no bytes for a chunk of {key}")
            chunk_bytes = math.prod(sizes) * itemsize
            if where[2] < chunk_bytes:
                raise refuse(
                    f".metadata says {key} is {dtype} {tuple(size)} ({numel * itemsize} bytes), but stores a "
                    f"{chunk_bytes}-byte chunk of it in {where[2]} bytes of {where[0]}"
                )
            covered += math.prod(sizes)
        if covered != numel:
            raise refuse(
                f".metadata says {key} is {dtype} {tuple(size)}, but its chunks hold {covered} of its {numel} values"
            )
        for chunk in item.chunks:
            name, offset, length = slices[MetadataIndex(key, torch.Size(tuple(chunk.offsets)))]
            held = _held_bytes(path / name, offset, length, f"checkpoint {path}: {name} (the bytes of {key})")
            if held < math.prod(tuple(chunk.sizes)) * itemsize:
                raise refuse(
                    f".metadata says {key} is {dtype} {tuple(size)}, but {name} holds {held} bytes of it "
                    f"where a chunk needs {math.prod(tuple(chunk.sizes)) * itemsize}"
                )


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list, torch.Size)) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    )


def _check_slices(path: Path, storage_data: Any, refuse: Any) -> dict[Any, tuple[str, int, int]]:
    """{chunk index: (shard name, offset, length)}: each inside a regular file of `path`, none overlapping."""
    import stat

    sizes: dict[str, int] = {}
    found: dict[Any, tuple[str, int, int]] = {}
    by_file: dict[str, list[tuple[int, int]]] = {}
    for index, info in storage_data.items():
        name, offset, length = (getattr(info, f, None) for f in ("relative_path", "offset", "length"))
        if not isinstance(name, str) or not is_plain_name(name):
            raise CheckpointError(f"checkpoint {path}: .metadata names a shard outside the checkpoint ({name!r})")
        if name not in sizes:
            try:
                mode = os.stat(path / name)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {path} is incomplete: shard {name} is missing") from None
            if not stat.S_ISREG(mode.st_mode):
                raise CheckpointError(f"checkpoint {path}: shard {name} is not a regular file")
            sizes[name] = mode.st_size
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
            raise refuse(f".metadata gives a chunk in {name} the offset {offset!r} and length {length!r}")
        if offset + length > sizes[name]:
            raise CheckpointError(
                f"checkpoint {path}: shard {name} is truncated ({sizes[name]} bytes; .metadata places a chunk at "
                f"bytes {offset}-{offset + length}); {DAMAGED}"
            )
        found[index] = (name, offset, length)
        by_file.setdefault(name, []).append((offset, length))
    for name, spans in by_file.items():
        spans.sort()
        for (a, n), (b, _) in itertools.pairwise(spans):
            if a + n > b:
                raise refuse(f".metadata places two chunks on the same bytes of {name} (at {a} and {b})")
    return found


def _held_bytes(file: Path, offset: int, length: int, where: str) -> int:
    """The bytes of tensor data (``data/*`` records) in the archive at ``[offset, offset + length)`` of `file`."""
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        records = archive_records(fd, offset, length, where)
    finally:
        os.close(fd)
    return sum(size for name, size in records.items() if name.startswith("data/"))

"""`ember.checkpoint.files.GuardedFile`: a write error never reaches torch's C++ serializer, is raised once
the writer is done, and the bytes written before it are on disk; torch's small writes never run Python."""

from __future__ import annotations

import errno
import io
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.checkpoint.files import GuardedFile, guarded_open


class FullAfter(io.RawIOBase):
    """An unbuffered file that takes `capacity` bytes (writing short at the edge), then fails with ENOSPC;
    it counts the calls to its ``write``."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.data, self.calls = capacity, bytearray(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[no-untyped-def]
        self.calls += 1
        room = self.capacity - len(self.data)
        if room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        chunk = bytes(memoryview(data)[:room])
        self.data += chunk
        return len(chunk)

    def tell(self) -> int:
        return len(self.data)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(17 + i, 5, generator=g) for i in range(12)}


def _saved(obj: object) -> bytes:
    reference = io.BytesIO()
    torch.save(obj, reference)
    return reference.getvalue()


@settings(max_examples=25, deadline=None)
@given(
    capacity=st.integers(min_value=0, max_value=len(_saved(_state())) - 1), buffer=st.sampled_from([64, 4096, 65536])
)
def test_a_full_disk_at_any_byte_is_raised_after_torch_save_and_keeps_what_fit(capacity: int, buffer: int) -> None:
    expected = _saved(_state())
    raw = FullAfter(capacity)
    f = GuardedFile(raw, buffer_size=buffer)
    torch.save(_state(), f)  # would abort the process if the error escaped into the serializer
    assert f.tell() == len(expected), "tell counts the bytes pretended written"
    with pytest.raises(OSError) as error:
        f.check()
    assert error.value.errno == errno.ENOSPC
    assert bytes(raw.data) == expected[:capacity]


def test_with_room_the_file_holds_exactly_what_torch_save_writes_in_few_python_writes() -> None:
    expected = _saved(_state())
    raw = FullAfter(1 << 30)
    f = GuardedFile(raw)
    torch.save(_state(), f)
    f.check()
    assert bytes(raw.data) == expected
    # torch.save makes hundreds of small writes for 12 tensors; only full buffers reach Python code
    assert raw.calls <= len(expected) // (1 << 16) + 2, raw.calls


def test_fileno_flushes_so_an_fsync_covers_every_byte(tmp_path: Path) -> None:
    path = tmp_path / "file"
    with guarded_open(path, sync=False) as f:
        f.write(b"abc" * 100)
        assert path.read_bytes() == b""  # still in the buffer
        f.fileno()
        assert path.read_bytes() == b"abc" * 100

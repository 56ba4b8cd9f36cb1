"""ember's one-process writer produces what ``dcp.save`` produces, and both readers read it.

`ember.checkpoint.dcp_writer.write_tensors` skips DCP's planning; these tests hold it to
DCP's layout: the same metadata (every field but the save's id and path), the
same bytes in the data file (each tensor's exactly what ``torch.save`` writes),
loadable by stock ``dcp.load`` and by ember's restricted reader, bitwise.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ember import checkpoint as ckpt
from ember.checkpoint import dcp_writer, writing


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 64, generator=g)
    return {
        "/module/weight": torch.randn(8, 4, generator=g),
        "/module/bias": torch.randn(8, generator=g),
        "/module/bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "/opt/step": torch.tensor(7.0),  # 0-d
        "/opt/count": torch.arange(5),
        "/opt/mask": torch.tensor([True, False, True]),
        "/opt/empty": torch.empty(0, 3),
        "/view/row": big[3],  # a view: only its own 64 values may be written
        "/view/transposed": big[:4, :6].t(),  # non-contiguous
    }


def dcp_save(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    directory.mkdir()
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=False, thread_count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, storage_writer=writer, no_dist=True)


def ember_save(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    directory.mkdir()
    dcp_writer.write_tensors(directory, tensors)


def metadata(directory: Path) -> dcp.Metadata:
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)  # files this test wrote itself


def stock_load(directory: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    template = {k: torch.zeros_like(v, memory_format=torch.contiguous_format) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    return template


def test_same_metadata_as_dcp_save(tmp_path: Path) -> None:
    tensors = state()
    dcp_save(tmp_path / "dcp", tensors)
    ember_save(tmp_path / "ember", tensors)
    theirs, mine = metadata(tmp_path / "dcp"), metadata(tmp_path / "ember")
    assert mine.state_dict_metadata == theirs.state_dict_metadata
    assert mine.planner_data == theirs.planner_data
    assert mine.version == theirs.version
    # Same index keys, file, offsets and lengths: the tensors are serialized alike, in the same order.
    assert sorted(mine.storage_data.items(), key=str) == sorted(theirs.storage_data.items(), key=str)
    assert mine.storage_meta is not None and mine.storage_meta.save_id != theirs.storage_meta.save_id
    assert sorted(p.name for p in (tmp_path / "ember").iterdir()) == [".metadata", dcp_writer.DATA_FILE]


def test_same_data_file_bytes_as_dcp_save(tmp_path: Path) -> None:
    tensors = state()
    dcp_save(tmp_path / "dcp", tensors)
    ember_save(tmp_path / "ember", tensors)
    ember_save(tmp_path / "again", tensors)  # every layout known by now: the reused pickles
    theirs = (tmp_path / "dcp" / dcp_writer.DATA_FILE).read_bytes()
    assert (tmp_path / "ember" / dcp_writer.DATA_FILE).read_bytes() == theirs
    assert (tmp_path / "again" / dcp_writer.DATA_FILE).read_bytes() == theirs


def torch_saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def ember_saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    dcp_writer.save_tensor(tensor, buffer)
    return buffer.getvalue()


def test_save_tensor_writes_torch_saves_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp_writer, "_PICKLED", {})
    g = torch.Generator().manual_seed(1)
    first, second = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g)  # one layout, new values
    transposed = torch.randn(3, 6, generator=g).t()  # owns its storage, strides (1, 6)
    for tensor in (first, second, transposed, torch.tensor(3), torch.zeros(0, 2), torch.ones(4, dtype=torch.int8)):
        assert ember_saved(tensor) == torch_saved(tensor)
        assert torch.equal(torch.load(io.BytesIO(ember_saved(tensor)), weights_only=True), tensor)
    assert len(dcp_writer._PICKLED) == 5  # `first` and `second` share theirs
    assert all(pickled is not None for pickled in dcp_writer._PICKLED.values())


def test_tensors_pickled_otherwise_go_through_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter, a tensor with grad or with attributes is pickled with more than its layout."""
    monkeypatch.setattr(dcp_writer, "_PICKLED", {})
    tagged = torch.zeros(2)
    tagged.note = "kept by torch.save"  # type: ignore[attr-defined]
    for tensor in (torch.nn.Parameter(torch.zeros(2)), torch.zeros(2, requires_grad=True), tagged):
        assert ember_saved(tensor) == torch_saved(tensor)
    assert dcp_writer._PICKLED == {}


def test_a_layout_whose_bytes_differ_is_left_to_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """If torch.save ever writes records `save_tensor` does not, its own check turns the shortcut off."""
    monkeypatch.setattr(dcp_writer, "_PICKLED", {})
    records = dcp_writer._records

    def one_record_more(f: Any, pickled: bytes, tensor: torch.Tensor) -> None:
        records(f, pickled + b".", tensor)  # e.g. a newer torch pickling its tensors differently

    monkeypatch.setattr(dcp_writer, "_records", one_record_more)
    tensor = torch.randn(3, 3)
    assert ember_saved(tensor) == torch_saved(tensor)
    assert list(dcp_writer._PICKLED.values()) == [None]
    assert ember_saved(tensor) == torch_saved(tensor)  # and stays torch.save's


def test_each_reader_reads_the_other_writers_files_bitwise(tmp_path: Path) -> None:
    tensors = state()
    dcp_save(tmp_path / "dcp", tensors)
    ember_save(tmp_path / "ember", tensors)
    for loaded in (stock_load(tmp_path / "ember", tensors), ckpt.read_tensors(tmp_path / "ember")):
        assert loaded.keys() == tensors.keys()
        for key, value in tensors.items():
            assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
            assert torch.equal(loaded[key], value), key
    from_dcp = ckpt.read_tensors(tmp_path / "dcp")
    assert all(torch.equal(from_dcp[k], v) for k, v in tensors.items())


def test_a_view_is_written_without_its_base(tmp_path: Path) -> None:
    base = torch.randn(1000, 100)
    ember_save(tmp_path / "c", {"/row": base[7]})
    assert (tmp_path / "c" / dcp_writer.DATA_FILE).stat().st_size < 4000  # 100 floats and zip records, not 400 kB
    assert torch.equal(ckpt.read_tensors(tmp_path / "c")["/row"], base[7])


def test_only_plain_tensors_take_this_path() -> None:
    assert dcp_writer.can_write({"a": torch.zeros(2), "b": torch.nn.Parameter(torch.zeros(2))})

    class Marked(torch.Tensor):
        pass

    assert not dcp_writer.can_write({"a": torch.zeros(2), "b": torch.zeros(2).as_subclass(Marked)})


@pytest.mark.parametrize("many", [False, True])
def test_checkpoints_take_the_matching_writer(tmp_path: Path, many: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process below the parallel-write size: ember's writer; at or above it: DCP's threads."""
    used: list[str] = []
    original_ember, original_dcp = dcp_writer.write_tensors, dcp.save
    monkeypatch.setattr(dcp_writer, "write_tensors", lambda *a, **k: (used.append("ember"), original_ember(*a, **k)))
    monkeypatch.setattr(dcp, "save", lambda *a, **k: (used.append("dcp"), original_dcp(*a, **k)))
    monkeypatch.setattr(writing, "_PARALLEL_WRITE_BYTES", 16 if many else 2**30)
    tensors = {"/module/w": torch.randn(4, 4)}
    ckpt.write_checkpoint(tmp_path / "c", {}, tensors, {})
    assert used == (["dcp"] if many else ["ember"])
    assert torch.equal(ckpt.read_tensors(tmp_path / "c")["/module/w"], tensors["/module/w"])

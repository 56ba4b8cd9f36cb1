"""Async checkpoint staging: host buffers, reused save after save, pinned for device tensors on a CUDA host.

The ``meta`` device stands in for a GPU: a meta tensor has a device other than the CPU and no data, so a
staging buffer made for it shows where the copy of a device tensor would live. DTensor shards staged in a
real 2-process FSDP2 run are tested in tests/distributed/test_fsdp_async_staging.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ember.checkpoint.staging import HostShard, copy_into, stage_shard, staging_buffer


def test_a_device_tensor_is_staged_in_host_memory_and_the_buffer_is_reused() -> None:
    staging: dict[str, torch.Tensor] = {}
    weight = torch.empty(4, 3, device="meta")
    first = staging_buffer(staging, "/module/w", weight)
    assert first.device.type == "cpu" and first.shape == (4, 3) and first.dtype == torch.float32
    again = staging_buffer(staging, "/module/w", torch.empty(4, 3, device="meta"))  # the next save
    assert again is first
    assert all(t.device.type == "cpu" for t in staging.values())  # no second copy held on the device


def test_a_new_shape_or_dtype_gets_a_new_buffer_kept_for_the_next_save() -> None:
    staging: dict[str, torch.Tensor] = {}
    first = staging_buffer(staging, "k", torch.empty(2, device="meta"))
    resized = staging_buffer(staging, "k", torch.empty(3, device="meta"))
    assert resized is not first and resized.shape == (3,) and staging["k"] is resized
    cast = staging_buffer(staging, "k", torch.empty(3, dtype=torch.bfloat16, device="meta"))
    assert cast is not resized and cast.dtype == torch.bfloat16 and staging["k"] is cast


@pytest.mark.parametrize(
    ("device", "cuda", "pinned"), [("meta", True, True), ("meta", False, False), ("cpu", True, False)]
)
def test_pinned_only_for_device_tensors_when_cuda_is_available(
    monkeypatch: pytest.MonkeyPatch, device: str, cuda: bool, pinned: bool
) -> None:
    asked: list[bool] = []
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        asked.append(pin_memory)
        return real_empty(*args, **kwargs)  # this build cannot pin; the request is what is checked

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch, "empty", empty)
    staging_buffer({}, "k", real_empty(5, device=device))
    assert asked == [pinned]


def test_copies_hold_the_values_and_reuse_the_buffers_across_saves() -> None:
    staging: dict[str, torch.Tensor] = {}
    live = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # not contiguous
    first = copy_into(staging, "w", live)
    assert torch.equal(first, live) and first.is_contiguous()
    live.add_(1)  # training goes on; the next save copies into the same buffer
    second = copy_into(staging, "w", live)
    assert second is first and torch.equal(second, live)


def _write_item(fqn: str) -> WriteItem:
    """A DCP write item as a DTensor of global shape (4, 3) gives for its rows 2-3."""
    chunk = ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 3]))
    data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size([4, 3]))
    return WriteItem(index=MetadataIndex(fqn, torch.Size([2, 0])), type=WriteItemType.SHARD, tensor_data=data)


def test_a_host_shard_answers_dcp_with_the_dtensor_write_items_and_hands_over_its_buffer() -> None:
    buffer = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    item = _write_item("/module/w")
    shard = HostShard.of(buffer, [item])
    assert isinstance(shard, torch.Tensor) and shard.device.type == "cpu" and torch.equal(shard, buffer)
    assert shard.__create_write_items__("/module/w", shard) == [item]
    renamed = shard.__create_write_items__("w", shard)[0]  # DCP names the entry otherwise: same chunk, its name
    assert renamed.index == MetadataIndex("w", torch.Size([2, 0])) and renamed.tensor_data == item.tensor_data
    assert shard.__create_chunk_list__() == [item.tensor_data.chunk]
    written = shard.__get_tensor_shard__(item.index)
    assert written is buffer and type(written) is torch.Tensor  # a plain tensor: its file names no ember class


def test_without_staging_or_for_other_tensor_subclasses_the_copy_is_a_clone() -> None:
    class Tagged(torch.Tensor):
        pass

    live = torch.ones(3)
    unstaged = copy_into(None, "k", live)
    assert unstaged is not live and torch.equal(unstaged, live) and unstaged.data_ptr() != live.data_ptr()
    staging: dict[str, torch.Tensor] = {}
    tagged = torch.ones(3).as_subclass(Tagged)
    copied = copy_into(staging, "k", tagged)
    assert type(copied) is Tagged and copied.data_ptr() != tagged.data_ptr() and staging == {}


class _StandInMesh:
    def get_coordinate(self) -> list[int]:
        return [1]  # this process is in the mesh


class _StandInDTensor:
    """What `stage_shard` reads of a DTensor: its global layout and DCP's write items (counted)."""

    def __init__(self, placements: tuple[str, ...]) -> None:
        self.shape, self.device_mesh, self.placements = torch.Size([4, 3]), _StandInMesh(), placements
        self.asked = 0

    def stride(self) -> tuple[int, ...]:
        return (3, 1)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        self.asked += 1
        return [_write_item(fqn)]


def test_a_shard_is_staged_in_the_same_host_shard_every_save_until_its_sharding_changes() -> None:
    staging: dict[str, torch.Tensor] = {}
    live = _StandInDTensor(("Shard(0)",))
    local = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    first = stage_shard(staging, "/module/w", live, local)
    assert isinstance(first, HostShard) and staging["/module/w"] is first and torch.equal(first.buffer, local)
    assert first.buffer.data_ptr() != local.data_ptr()
    local.add_(1)  # the next step; the next save
    again = stage_shard(staging, "/module/w", live, local)
    assert again is first and torch.equal(again.buffer, local) and live.asked == 1  # items taken once
    resharded = _StandInDTensor(("Shard(1)",))  # e.g. another mesh layout in a later fit
    other = stage_shard(staging, "/module/w", resharded, local)
    assert other is not first and staging["/module/w"] is other and resharded.asked == 1
    bigger = stage_shard(staging, "/module/w", resharded, torch.zeros(3, 3))
    assert bigger is not other and bigger.shape == (3, 3) and resharded.asked == 2


def test_a_key_staged_as_a_shard_and_then_as_a_plain_tensor_gets_a_plain_buffer() -> None:
    staging: dict[str, torch.Tensor] = {}
    stage_shard(staging, "k", _StandInDTensor(("Shard(0)",)), torch.zeros(2, 3))
    copied = copy_into(staging, "k", torch.ones(2, 3))
    assert type(copied) is torch.Tensor and staging["k"] is copied and torch.equal(copied, torch.ones(2, 3))

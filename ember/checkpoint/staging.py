"""Async checkpoint staging: the host copies a background write reads while training goes on.

An async save copies every tensor of the checkpoint once, at the step boundary, into host (CPU) memory kept
by the `CheckpointManager` and reused save after save (`staging_buffer`): the loop pays one copy, no
allocation, and a GPU run holds no second copy of its state in device memory between saves. A device
tensor's buffer is pinned when CUDA is available, so the device-to-host copy needs no pageable bounce.

Sharded state (FSDP2 and tensor-parallel DTensors) is staged the same way, one buffer per local shard. A
DTensor cannot carry the host copy itself: ``DTensor.from_local`` moves a local tensor to its mesh's device
type, which would put the copy back on the GPU. The copy is handed to torch.distributed.checkpoint as a
`HostShard` instead, a host tensor that answers DCP's checkpointing protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, the methods DTensor itself implements) with the live
DTensor's own write items, taken when it was staged: DCP plans, deduplicates replicas and writes it exactly
as the DTensor, so the checkpoint's files and metadata are those of a save of the live state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from ember.strategies.strategy import holds_dtensors


def staging_buffer(staging: dict[str, Tensor], key: str, value: Tensor) -> Tensor:
    """The host buffer an async snapshot copies `value` into: ``staging[key]`` when its shape and dtype match
    (the same tensor save after save), else a new one kept there. A device tensor's buffer is pinned when
    CUDA is available, so the device-to-host copy runs at full speed without a pageable bounce."""
    buffer = staging.get(key)
    if type(buffer) is not Tensor or buffer.shape != value.shape or buffer.dtype != value.dtype:  # or a HostShard
        buffer = staging[key] = _host_buffer(value)
    return buffer


def _host_buffer(value: Tensor) -> Tensor:
    pin = value.device.type != "cpu" and torch.cuda.is_available()
    return torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)


def copy_into(staging: dict[str, Tensor] | None, key: str, value: Tensor, on_cpu: bool = False) -> Tensor:
    """The copy of `value` (checkpoint key `key`) an async write reads: in ``staging[key]`` (see
    `staging_buffer`) for a plain tensor, in a `HostShard` kept there for a DTensor (`stage_shard`), a
    fresh clone for any other tensor subclass or without `staging` (in host memory with `on_cpu`, for a plain
    tensor).

    On CUDA the copies are asynchronous: synchronize before a writer reads them."""
    if staging is not None and type(value) is Tensor:
        buffer = staging_buffer(staging, key, value)
        return buffer.copy_(value, non_blocking=buffer.is_pinned())
    if staging is not None and holds_dtensors(value):
        # A DTensor (holds_dtensors imported its class): this process's shard.
        local = value.to_local()  # type: ignore[attr-defined]
        if type(local) is Tensor:  # not a wrapper of several shards, which DCP asks for shard by shard
            return stage_shard(staging, key, value, local)
    return value.to("cpu", copy=True) if on_cpu and type(value) is Tensor else value.clone()


def stage_shard(staging: dict[str, Tensor], key: str, value: Any, local: Tensor) -> HostShard:
    """Copy DTensor `value`'s local shard `local` into ``staging[key]``, a `HostShard`: the one an earlier
    save made when the DTensor is sharded the same way (global shape and stride, mesh, placements) and its
    shard has the same shape and dtype, else a new one kept there. Its DCP write items are taken once, when
    it is made, not at every save."""
    sharding = (value.shape, value.stride(), value.device_mesh, tuple(value.placements))
    shard = staging.get(key)
    if not (
        isinstance(shard, HostShard)
        and shard.sharding == sharding
        and shard.buffer.shape == local.shape  # the plain tensor: no __torch_function__ of the subclass
        and shard.buffer.dtype == local.dtype
    ):
        shard = HostShard.of(_host_buffer(local), _write_items(key, value), sharding)
        staging[key] = shard
    shard.buffer.copy_(local, non_blocking=shard.buffer.is_pinned())
    return shard


def _write_items(key: str, value: Any) -> list[Any]:
    """What DCP would write of DTensor `value` from this process (none where it is outside its mesh, as DCP
    skips it then; a Partial placement raises here as in any save)."""
    if value.device_mesh.get_coordinate() is None:
        return []
    return list(value.__create_write_items__(key, value))


class HostShard(Tensor):
    """This process's shard of a DTensor, copied into a host buffer, as torch.distributed.checkpoint saves it.

    The tensor is the host copy (its local shape, not the DTensor's global one). ``buffer`` is the same
    memory as a plain tensor (what DCP writes, so the file names no ember class); ``write_items`` are the
    DTensor's own DCP write items (global size, this shard's offsets, the tensor properties), so DCP writes
    the copy exactly where it writes the DTensor's shard; ``sharding`` is what they were made for (global
    shape and stride, mesh, placements). Made with `HostShard.of`, reused save after save (`stage_shard`).
    """

    buffer: Tensor
    write_items: list[Any]
    sharding: tuple[Any, ...]

    @classmethod
    def of(cls, buffer: Tensor, write_items: list[Any], sharding: tuple[Any, ...] = ()) -> HostShard:
        shard = buffer.as_subclass(cls)
        shard.buffer, shard.write_items, shard.sharding = buffer, write_items, sharding
        return shard

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        """DCP's planning: the DTensor's write items, under the name DCP saves this entry by."""
        return [
            item if item.index.fqn == fqn else dataclasses.replace(item, index=dataclasses.replace(item.index, fqn=fqn))
            for item in self.write_items
        ]

    def __create_chunk_list__(self) -> list[Any]:
        """The chunk of the global tensor this shard holds (offsets and sizes)."""
        return [item.tensor_data.chunk for item in self.write_items]

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        """What DCP writes for the chunk `index` names: the host copy, a plain tensor (one chunk per shard)."""
        return self.buffer

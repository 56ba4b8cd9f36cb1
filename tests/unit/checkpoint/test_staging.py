"""Async checkpoint staging: host buffers, reused save after save, pinned for device tensors on a CUDA host.

The ``meta`` device stands in for a GPU: a meta tensor has a device other than the CPU and no data, so a
staging buffer made for it shows where the copy of a device tensor would live.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ember.checkpoint.staging import copy_into, staging_buffer


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

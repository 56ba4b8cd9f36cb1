"""GPU-only paths that the CPU suite checks with stand-ins (the ``meta`` device, a monkeypatched
``torch.cuda``): here on a real device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ember.checkpoint import registry
from ember.checkpoint.resume import capture_rng, restore_rng

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason=f"needs CUDA: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device",
    ),
]


def test_async_staging_copies_device_tensors_into_reused_pinned_host_buffers() -> None:
    staging: dict[str, torch.Tensor] = {}
    live = torch.randn(256, 64, device="cuda")
    first = registry._copy_into(staging, "w", live)
    torch.cuda.synchronize()
    assert first.device.type == "cpu" and first.is_pinned()
    assert torch.equal(first, live.cpu())
    live.mul_(2)
    second = registry._copy_into(staging, "w", live)
    torch.cuda.synchronize()
    assert second is first and torch.equal(second, live.cpu())


def test_the_cuda_stream_of_this_device_is_saved_and_restored() -> None:
    torch.cuda.manual_seed(3)
    torch.cuda.init()
    state = capture_rng()
    expected = torch.rand(4, device="cuda")
    restore_rng(state)
    assert torch.equal(torch.rand(4, device="cuda"), expected)

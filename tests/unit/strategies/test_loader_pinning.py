"""Loaders ember rebuilds: pinned for a GPU run, and every pinning setting of the user's loader kept."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ember.strategies import DDPStrategy
from ember.strategies.environment import ClusterEnvironment
from ember.strategies.parallel import rebuilt_loader

DATA = TensorDataset(torch.arange(8.0))


def test_a_rebuilt_loader_keeps_pin_memory_and_its_device() -> None:
    loader = DataLoader(DATA, batch_size=2, pin_memory=True, pin_memory_device="cuda:1")
    rebuilt = rebuilt_loader(loader, shuffle=False)
    assert (rebuilt.pin_memory, rebuilt.pin_memory_device) == (True, "cuda:1")


@pytest.mark.parametrize(("device", "pinned"), [("cuda", True), ("cpu", False)])
def test_a_distributed_loader_is_pinned_on_a_gpu(device: str, pinned: bool) -> None:
    strategy = DDPStrategy()
    # Rank 1 of 2, its device chosen as setup_environment would (no process group is needed to rebuild).
    strategy.cluster = ClusterEnvironment("torchelastic", world_size=2, global_rank=1, local_rank=1)
    strategy.root_device = torch.device(device, 1 if device == "cuda" else None)
    rebuilt = strategy.distribute_loader(DataLoader(DATA, batch_size=2), training=True)
    assert isinstance(rebuilt.sampler, DistributedSampler)
    assert rebuilt.pin_memory is pinned


def test_a_loader_the_user_pinned_stays_pinned_on_the_cpu() -> None:
    strategy = DDPStrategy()
    strategy.cluster = ClusterEnvironment("torchelastic", world_size=2, global_rank=0)
    rebuilt = strategy.distribute_loader(DataLoader(DATA, batch_size=2, pin_memory=True), training=False)
    assert rebuilt.pin_memory is True

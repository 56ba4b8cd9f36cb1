"""`ember.strategies.collectives`: tensors handed to collectives are kept until nothing else holds them,
and the exit waits (bounded) for that."""

from __future__ import annotations

import collections
import time

import pytest
import torch

from ember.strategies import collectives


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_RECENT", collections.deque(maxlen=64))


def test_a_kept_tensor_is_held_while_another_reference_to_its_cpp_object_lives() -> None:
    tensor = collectives.keep(torch.zeros(3))
    assert collectives.held_by_workers() == 0
    view = tensor.view(3)  # a second reference to the tensor's C++ object, as a worker's would be
    assert collectives.held_by_workers() == 1
    start = time.monotonic()
    assert collectives.let_workers_finish(timeout_s=0.05) is False
    assert time.monotonic() - start >= 0.05
    del view
    assert collectives.held_by_workers() == 0 and collectives.let_workers_finish() is True


def test_only_the_most_recent_tensors_are_kept() -> None:
    for i in range(100):
        collectives.keep(torch.full((1,), float(i)))
    assert [float(t) for t in collectives._RECENT] == [float(i) for i in range(36, 100)]


def test_a_released_tensor_of_a_finished_collective_lets_the_exit_go_at_once() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1)
    tensor = collectives.keep(torch.ones(4))
    group.allreduce([tensor]).wait()
    assert collectives.let_workers_finish(timeout_s=5.0) is True
    assert torch.equal(tensor, torch.ones(4))

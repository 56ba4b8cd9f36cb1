"""`ember.strategies.collectives`: tensors handed to collectives are kept until nothing else holds them,
and the exit waits (bounded) for that."""

from __future__ import annotations

import time

import pytest
import torch

from ember.strategies import collectives


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_KEPT", [])


def test_a_kept_tensor_is_held_while_another_reference_to_its_cpp_object_lives() -> None:
    tensor = torch.zeros(3)
    view = tensor.view(3)  # a second reference to the tensor's C++ object, as an in-flight worker's would be
    collectives.keep(tensor)
    assert collectives.held_by_workers() == 1
    start = time.monotonic()
    assert collectives.let_workers_finish(timeout_s=0.05) is False
    assert time.monotonic() - start >= 0.05
    del view
    assert collectives.held_by_workers() == 0 and collectives.let_workers_finish() is True


def test_only_tensors_something_else_still_holds_are_kept_whatever_their_number_or_size() -> None:
    in_flight = []
    for i in range(100):
        tensor = torch.full((1,), float(i))
        if i % 10 == 0:
            in_flight.append(tensor.view(1))  # a worker's reference, taken when the collective was issued
        collectives.keep(tensor)
    # kept: the ten still held elsewhere and the latest one; the 89 released ones were forgotten
    assert [float(t) for t in collectives._KEPT] == [float(i) for i in range(0, 100, 10)] + [99.0]
    in_flight.clear()
    big = torch.zeros(1 << 20)
    collectives.keep(big)
    assert len(collectives._KEPT) == 1 and collectives._KEPT[0] is big  # the released ones went at this call
    del big
    collectives.keep(torch.zeros(1))
    assert [t.numel() for t in collectives._KEPT] == [1]  # no memory outlives its collective


def test_a_released_tensor_of_a_finished_collective_lets_the_exit_go_at_once() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1)
    tensor = torch.ones(4)
    group.allreduce([tensor]).wait()
    collectives.keep(tensor)
    assert collectives.let_workers_finish(timeout_s=5.0) is True
    assert torch.equal(tensor, torch.ones(4))

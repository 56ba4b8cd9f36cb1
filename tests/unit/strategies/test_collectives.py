"""`ember.strategies.collectives`: a tensor handed to a collective has a holder of ember's until the
collective's worker lets go of it, so the worker's drop never leaves the tensor's Python object as its only
holder (the drop that takes the GIL); the exit waits (bounded) for the workers."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from ember.strategies import collectives


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_KEPT", [])


def test_a_kept_tensor_is_held_while_a_worker_holds_it_and_released_after() -> None:
    tensor = torch.zeros(3)
    collectives.keep(tensor)
    assert tensor._use_count() == 2  # its Python object's reference and ember's holder
    worker = tensor.view(3)  # a second C++ reference, as an in-flight worker's would be
    assert collectives.held_by_workers() == 1
    del worker
    assert tensor._use_count() == 2  # the worker's drop did not leave the Python object alone
    assert collectives.held_by_workers() == 0 and collectives.let_workers_finish() is True
    assert tensor._use_count() == 1 and collectives._KEPT == []


def test_only_tensors_of_collectives_in_flight_are_held_whatever_their_number_or_size() -> None:
    in_flight = []
    for i in range(100):
        tensor = torch.full((1,), float(i))
        collectives.keep(tensor)
        if i % 10 == 0:
            in_flight.append(tensor.view(1))  # a worker's reference, taken when the collective is issued
    # held: the ten still in flight and the latest one; the 89 finished ones were released
    assert [float(k.tensor) for k in collectives._KEPT] == [float(i) for i in range(0, 100, 10)] + [99.0]
    in_flight.clear()
    big = torch.zeros(1 << 20)
    collectives.keep(big)
    assert len(collectives._KEPT) == 1 and collectives._KEPT[0].tensor is big  # the finished ones went here
    collectives.keep(torch.zeros(1))
    assert [k.tensor.numel() for k in collectives._KEPT] == [1]  # no memory outlives its collective
    assert big._use_count() == 1


def test_other_holders_before_the_collective_are_not_taken_for_a_worker() -> None:
    tensor = torch.zeros(2)
    earlier = tensor.view(2)  # e.g. the caller keeps a view: present before the collective and after it
    collectives.keep(tensor)
    assert collectives.held_by_workers() == 0
    assert earlier._base is tensor


def test_a_real_gloo_collective_never_leaves_the_python_object_as_the_only_holder() -> None:
    import torch.distributed as dist

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    tensor = torch.ones(4)
    collectives.keep(tensor)
    group.allreduce([tensor]).wait()
    assert collectives.let_workers_finish(timeout_s=5.0) is True  # the worker let go: the count came back to
    assert tensor._use_count() == 1 and torch.equal(tensor, torch.ones(4))  # 2 (ours), then ours dropped here


def test_an_exit_that_times_out_keeps_the_holders_for_the_rest_of_the_process() -> None:
    tensor = torch.zeros(1)
    collectives.keep(tensor)
    worker = tensor.view(1)
    start = time.monotonic()
    assert collectives.let_workers_finish(timeout_s=0.05) is False
    assert time.monotonic() - start >= 0.05
    del worker  # the worker finishes during interpreter shutdown: ember's holder is still there
    assert tensor._use_count() == 2


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_keep_loses_no_tensor_when_two_threads_call_it_at_once() -> None:
    """An async checkpoint write keeps its tensors from the writer thread while the loop keeps its own."""
    workers: list[torch.Tensor] = []
    per_thread = 2000

    def keep_many() -> None:
        for _ in range(per_thread):
            tensor = torch.zeros(1)
            collectives.keep(tensor)
            workers.append(tensor.view(1))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: interleavings become likely
    try:
        threads = [threading.Thread(target=keep_many) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(collectives._KEPT) == 2 * per_thread == collectives.held_by_workers()


def test_a_tensor_another_thread_kept_is_not_released_before_that_thread_issues_its_collective() -> None:
    kept, issue = threading.Event(), threading.Event()
    tensor = torch.zeros(1)

    def writer() -> None:  # e.g. the checkpoint writer thread, between keep() and the collective
        collectives.keep(tensor)
        kept.set()
        issue.wait(5)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert kept.wait(5)
        collectives.keep(torch.zeros(1))  # no worker holds `tensor` yet: it must stay held all the same
        assert collectives._KEPT[0].tensor is tensor and tensor._use_count() == 2
    finally:
        issue.set()
        thread.join()
    collectives.keep(torch.zeros(1))  # its thread ended (its collective was issued and finished): released
    assert all(k.tensor is not tensor for k in collectives._KEPT) and tensor._use_count() == 1


def _spin_as_a_gloo_worker(seconds: float, named: threading.Event, done: threading.Event, spun: list[float]) -> None:
    """A thread that takes gloo's worker name, runs for `seconds` (a worker still freeing a finished work),
    then sleeps until `done` (an idle worker waiting for the next one). `spun` gets the instant it stops running."""
    import ctypes

    ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME
    end = time.monotonic() + seconds
    named.set()
    while time.monotonic() < end:
        pass
    spun.append(time.monotonic())
    done.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread states are read from /proc (Linux)")
@pytest.mark.parametrize("timeout_s", [5.0, 0.05])
def test_the_exit_waits_until_every_gloo_worker_thread_is_asleep(timeout_s: float) -> None:
    named, done, spun = threading.Event(), threading.Event(), []
    spin_s = 0.3 if timeout_s > 0.3 else 1.0  # to give up on, a worker that runs well past the timeout
    thread = threading.Thread(target=_spin_as_a_gloo_worker, args=(spin_s, named, done, spun))
    thread.start()
    try:
        assert named.wait(5)
        assert collectives.gloo_workers_awake() == 1
        start = time.monotonic()
        finished = collectives.let_workers_finish(timeout_s=timeout_s)
        returned = time.monotonic()
        # (times are taken against the worker's own end, not a fixed length: on a loaded machine this thread may
        # get the CPU back long after the worker started spinning)
        if timeout_s > 0.3:  # waited for the worker to go to sleep, then returned
            assert finished is True and spun and spun[0] <= returned < start + timeout_s
            assert collectives.gloo_workers_awake() == 0
        else:  # gave up at the timeout, the worker still running
            assert finished is False and returned - start >= timeout_s and not spun
    finally:
        done.set()
        thread.join()

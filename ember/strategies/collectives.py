"""Tensors that ember hands to gloo collectives, held so that gloo's worker threads never need the GIL.

A gloo collective runs on one of the process group's worker threads, which holds a reference to its
tensors until just after the work completes: a ``wait()`` can return before that reference is dropped.
A tensor that Python created has a Python object, and while anything besides that object holds the
tensor, the tensor holds its Python object in turn; the drop that leaves the Python object as the only
holder releases that hold, which takes the GIL. When a worker thread makes that drop while the
interpreter shuts down, it cannot take the GIL and the process aborts: ``terminate called without an
active exception``, SIGABRT. The drop and the GIL are two steps, so a count of the tensor's holders can
already say "released" while the worker still waits for the GIL (a two-process full-disk run aborted
this way, about once in 60 runs on 2 busy cores).

So every tensor ember passes to a collective goes through `keep` before the collective is issued: it
adds a holder of its own (a C++ one, not a Python reference), and drops it only once the worker has let
go. The worker's drop is then never the one that leaves the Python object alone, and never takes the
GIL, whenever it happens. At exit, `let_workers_finish` still waits (releasing the GIL, at most a second)
until the workers have let go, so the holders can be dropped normally; a collective that has not finished
by then keeps its holders for good (the process is ending).

A worker's drop of a finished collective takes the GIL for another reason too: a collective issued during a
backward pass (DDP's gradient all-reduce, FSDP's reduce-scatter) captures the thread-local state, which then
holds a Python object (the context torch stashes for the backward), and freeing the work frees that hold. DDP
and FSDP wait for those collectives before the backward returns, but the worker frees the work only when it
next runs, which on a busy machine can be after the script ended (a two-process DDP run aborted this way in
about 1 of 8 runs on 2 cores kept busy). So the exit also waits, at most as long, until every gloo worker
thread (``pt_gloo_runloop``) is asleep, twice in a row; where threads cannot be read (no ``/proc``), it does not.

Collectives that torch issues itself (the object collectives inside torch.distributed.checkpoint, and
``broadcast_object_list`` under `ParallelStrategy.broadcast`) create their own tensors, which this cannot
reach.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
from typing import Any

import torch
from torch import Tensor


class _Kept:
    """A tensor, a C++ holder of it, how many holders it had before, and the thread issuing its collective."""

    __slots__ = ("holder", "others", "tensor", "thread")

    def __init__(self, tensor: Tensor, thread: threading.Thread) -> None:
        self.tensor = tensor
        self.others = _use_count(tensor)
        self.holder: Any = torch._C.ScriptList([tensor])  # a list of C++ tensor references (not Python ones)
        self.thread = thread

    def held_by_workers(self) -> bool:
        return _use_count(self.tensor) > self.others + 1

    def releasable(self, current: threading.Thread) -> bool:
        """Whether its collective was issued (its thread has moved on to another `keep`, or ended) and no
        worker holds the tensor any more."""
        return (self.thread is current or not self.thread.is_alive()) and not self.held_by_workers()


#: Tensors handed to collectives, until no worker holds them.
_KEPT: list[_Kept] = []
_LOCK = threading.Lock()  # the writer thread's collectives keep their tensors too


def keep(*tensors: Tensor) -> None:
    """Hold `tensors`, about to be handed to a collective, until the collective's work lets go of them.
    Call it before the collective is issued, on the thread that issues it. The tensors of this thread's
    earlier collectives (and of ended threads') that no worker holds any more are released here: what is
    held is only what collectives in flight use."""
    current = threading.current_thread()
    fresh = [_Kept(tensor, current) for tensor in tensors]
    with _LOCK:
        _KEPT[:] = [kept for kept in _KEPT if not kept.releasable(current)] + fresh


def held_by_workers() -> int:
    """How many of the kept tensors something besides their holders at `keep` (a worker) still holds."""
    with _LOCK:
        return sum(1 for kept in _KEPT if kept.held_by_workers())


def _use_count(tensor: Tensor) -> int:
    """References to the tensor's C++ object (a Python object holding it counts once, however many names it has)."""
    count: int = getattr(tensor, "_use_count")()  # noqa: B009  (not in torch's type stubs)
    return count


def let_workers_finish(timeout_s: float = 1.0) -> bool:
    """Wait, with the GIL released, until no worker thread holds a kept tensor and every gloo worker thread is
    asleep (at most `timeout_s`); whether they all let go. Then the holders are dropped; on a timeout they
    are kept for the rest of the process, so that a worker finishing during interpreter shutdown still never
    takes the GIL."""
    deadline = time.monotonic() + timeout_s
    asleep_in_a_row = 0
    while True:
        awake = gloo_workers_awake()
        asleep_in_a_row = asleep_in_a_row + 1 if awake == 0 else 0
        # Asleep twice in a row: a worker just woken to free its work is "ready to run" the second time.
        if not held_by_workers() and (awake is None or asleep_in_a_row >= 2):
            break
        if time.monotonic() >= deadline:
            with _LOCK:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(list(_KEPT)))  # never freed: the process is ending
            return False
        time.sleep(0.002)
    with _LOCK:
        _KEPT.clear()
    return True


#: The name gloo gives its worker threads (the process group's run loop), as /proc shows it.
_GLOO_WORKER = b"pt_gloo_runloop"


def gloo_workers_awake() -> int | None:
    """How many of this process's gloo worker threads are not asleep (running, or ready to run); None where
    there are none, or the threads cannot be read (no ``/proc``)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    seen = awake = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                head, _, rest = stat.read().rpartition(b") ")  # "tid (name) state ...": the name may hold ") "
        except OSError:
            continue  # the thread ended
        if head.endswith(b"(" + _GLOO_WORKER):
            seen += 1
            awake += rest[:1] not in (b"S", b"D")  # S, D: blocked (idle, or in a collective that waits)
    return awake if seen else None


atexit.register(let_workers_finish)

"""Tensors that ember hands to gloo collectives, kept until gloo's worker threads have let go of them.

A gloo collective runs on one of the process group's worker threads, which holds a reference to its
tensors until just after the work completes: a ``wait()`` can return before that reference is dropped.
When the Python code that created a tensor has already dropped its own reference, the worker's drop is
the last one, and freeing a tensor that Python created needs the GIL. If the interpreter is shutting
down by then (the collective was one of the last things a process did), the worker thread cannot take
the GIL, and the process aborts: ``terminate called without an active exception``, SIGABRT, seen about
once in 40-80 two-process runs on 2 busy cores.

Every tensor ember passes to a collective goes through `keep` once the collective is issued (from then on
the collective's work holds it until a worker lets go); at exit, `let_workers_finish` waits
(releasing the GIL) until no worker holds any of them, so the last reference is Python's own and the
tensor is freed by the main thread. `keep` forgets the tensors that nothing else holds any more each time
it is called, so what it holds is only what collectives still in flight use: no memory (host or device)
is kept alive past its collective, however large the tensor.
"""

from __future__ import annotations

import atexit
import time

from torch import Tensor

#: Tensors handed to collectives that something besides their Python object may still hold.
_KEPT: list[Tensor] = []


def keep(*tensors: Tensor) -> None:
    """Remember `tensors`, handed to a collective already issued, until nothing but their Python objects
    hold them. Call it after the collective call returns: a tensor that nothing else holds by then was
    released for good, and `keep` forgets it at its next call (a worker never takes a reference again)."""
    _KEPT[:] = [kept for kept in _KEPT if _use_count(kept) > 1]
    _KEPT.extend(tensors)


def held_by_workers() -> int:
    """How many of the remembered tensors something besides their Python object still holds."""
    return sum(1 for tensor in _KEPT if _use_count(tensor) > 1)


def _use_count(tensor: Tensor) -> int:
    """References to the tensor's C++ object (a Python object holding it counts once, however many names it has)."""
    count: int = getattr(tensor, "_use_count")()  # noqa: B009  (not in torch's type stubs)
    return count


def let_workers_finish(timeout_s: float = 1.0) -> bool:
    """Wait, with the GIL released, until no worker thread holds a remembered tensor (at most `timeout_s`);
    whether they all let go. A tensor the caller still holds counts as held until the timeout."""
    deadline = time.monotonic() + timeout_s
    while held_by_workers():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


atexit.register(let_workers_finish)

"""Tensors that ember hands to gloo collectives, kept until gloo's worker threads have let go of them.

A gloo collective runs on one of the process group's worker threads, which holds a reference to its
tensors until just after the work completes: a ``wait()`` can return before that reference is dropped.
When the Python code that created a tensor has already dropped its own reference, the worker's drop is
the last one, and freeing a tensor that Python created needs the GIL. If the interpreter is shutting
down by then (the collective was one of the last things a process did), the worker thread cannot take
the GIL, and the process aborts: ``terminate called without an active exception``, SIGABRT, seen about
once in 40-80 two-process runs on 2 busy cores.

Every tensor ember passes to a collective goes through `keep`; at exit, `let_workers_finish` waits
(releasing the GIL) until no worker holds any of them, so the last reference is Python's own and the
tensor is freed by the main thread.
"""

from __future__ import annotations

import atexit
import collections
import time

from torch import Tensor

#: The tensors of this process's most recent collectives (older ones were long released by the workers).
_RECENT: collections.deque[Tensor] = collections.deque(maxlen=64)


def keep(tensor: Tensor) -> Tensor:
    """`tensor`, remembered until exit as one a collective uses."""
    _RECENT.append(tensor)
    return tensor


def held_by_workers() -> int:
    """How many of the remembered tensors something besides this module's reference still holds."""
    return sum(1 for tensor in _RECENT if _use_count(tensor) > 1)


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

"""CPU allocator tuning: keep the memory of freed tensors in the process instead of unmapping it every step.

glibc's ``malloc`` serves a large request (above a threshold that adapts upwards, up to 32 MiB) with a
fresh ``mmap`` and unmaps it on ``free``; memory freed at the top of its heap above a trim threshold goes
back to the kernel too. A training or evaluation step frees its large tensors (logits, activations,
their gradients) when it ends, so the next step maps new pages, and the kernel zero-fills each page on
its first touch: a page fault per 4 KiB of every large tensor, every step. Raising both thresholds lets
freed memory be reused instead. The price is memory: up to `TRIM_THRESHOLD_BYTES` of freed heap may stay
in the process (docs/trainer.md, "CPU allocator", has the measured effect and peak RSS).

`tune_cpu_allocator` applies the setting once per process (``mallopt`` through ctypes) when
fit/validate/test/predict starts, unless:

- the platform is not Linux with glibc;
- another allocator (jemalloc, tcmalloc, mimalloc, ...) provides ``malloc``, preloaded or linked;
- the user set glibc's malloc options themselves (``MALLOC_*_`` variables or ``GLIBC_TUNABLES``);
- it is switched off: ``Trainer(tune_cpu_allocator=False)`` or ``EMBER_TUNE_CPU_ALLOCATOR=0``.

`allocator_status` says what happened and why.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

#: ``mallopt`` parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Requests below this size come from the heap, where freed memory is reused (glibc's default adapts up to 32 MiB).
MMAP_THRESHOLD_BYTES = 256 * 1024**2
#: Free memory at the top of the heap is returned to the kernel only above this size (glibc's default: 128 KiB,
#: adapting to twice the mmap threshold).
TRIM_THRESHOLD_BYTES = 1024**3
#: Set to 0 (or false/no/off) to leave the allocator alone in every run of the process.
ENV_VAR = "EMBER_TUNE_CPU_ALLOCATOR"

_GLIBC_MALLOC_VARS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_ARENA_MAX",
)
_FALSE, _TRUE = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


@dataclass(frozen=True)
class AllocatorStatus:
    """What `tune_cpu_allocator` did: ``applied`` and, in words, what was set or why nothing was."""

    applied: bool
    reason: str


_status: AllocatorStatus | None = None  # a final outcome: applied, or impossible in this process
_last_skip: AllocatorStatus | None = None  # the latest opt-out (not final: a later run may apply it)


def allocator_status() -> AllocatorStatus | None:
    """The outcome of the last `tune_cpu_allocator` call in this process (None before the first)."""
    return _status if _status is not None else _last_skip


def tune_cpu_allocator(enabled: bool = True, device_type: str = "cpu") -> AllocatorStatus:
    """Raise glibc's mmap and trim thresholds once per process, unless something says not to (module docstring).

    `device_type` is where the run trains: only a CPU run gains (its tensors are the large allocations); a GPU
    run's host allocations are loader batches, and the thresholds would keep up to 1 GiB per process (times
    processes and loader workers) for nothing, so it is left alone.

    Safe to call before every run: once applied (or found impossible here), later calls return that
    outcome without doing anything. An opt-out is not remembered, so a later run that allows it applies it.
    """
    global _status, _last_skip
    if not isinstance(enabled, bool):
        raise TypeError(f"tune_cpu_allocator must be True or False; got {enabled!r}")
    if _status is not None:
        return _status
    if not enabled:
        _last_skip = AllocatorStatus(False, "switched off: Trainer(tune_cpu_allocator=False)")
        return _last_skip
    if device_type != "cpu":
        _last_skip = AllocatorStatus(False, f"not needed: the run trains on {device_type}, not on the CPU")
        return _last_skip
    if not _env_allows():
        _last_skip = AllocatorStatus(False, f"switched off: {ENV_VAR}={os.environ[ENV_VAR]}")
        return _last_skip
    user_set = [name for name in _GLIBC_MALLOC_VARS if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        user_set.append("GLIBC_TUNABLES")
    if user_set:
        _last_skip = AllocatorStatus(False, f"left as configured: {', '.join(user_set)} set in the environment")
        return _last_skip
    _status = _apply()
    return _status


def _env_allows() -> bool:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", *_TRUE):
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: use 0 to leave the CPU allocator alone, 1 to tune it")


def _apply() -> AllocatorStatus:
    if not sys.platform.startswith("linux"):
        return AllocatorStatus(False, f"not Linux ({sys.platform})")
    try:
        glibc_version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        glibc_version = None
    if not glibc_version:
        return AllocatorStatus(False, "the C library is not glibc")
    other = other_allocator()
    if other is not None:
        return AllocatorStatus(False, f"another allocator provides malloc: {other}")
    libc = ctypes.CDLL("libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The trim threshold first: with it set, glibc stops adapting both thresholds.
    if not (mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)):
        return AllocatorStatus(False, f"mallopt refused the thresholds ({glibc_version})")
    thresholds = f"mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold {TRIM_THRESHOLD_BYTES >> 20} MiB"
    return AllocatorStatus(True, f"{glibc_version}: {thresholds}")


def other_allocator() -> str | None:
    """The library that provides ``malloc`` when it is not glibc's (e.g. a preloaded jemalloc), else None."""
    try:
        process_malloc = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
        glibc_malloc = ctypes.cast(ctypes.CDLL("libc.so.6").malloc, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return "unknown (malloc could not be looked up)"
    if process_malloc == glibc_malloc:
        return None
    return _library_at(process_malloc) or "an unnamed library"


def _library_at(address: int | None) -> str | None:
    """The file mapped at `address` in this process (/proc/self/maps), or None."""
    if address is None:
        return None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end and len(fields) >= 6:
                    return fields[5]
    except OSError:
        pass
    return None

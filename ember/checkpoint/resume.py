"""Exact data position and random streams across a resume.

Iterating a DataLoader draws from random generators: the worker base seed (from
the loader's ``generator``, else the global torch RNG) and, for a shuffling
sampler, the permutation (from the sampler's generator, else the global torch
RNG). ember records those generators' states just before each training epoch
opens its iterator. On resume in the middle of an epoch it puts them back,
opens the iterator again (same draws, same order) with the sampler skipping
the batches already consumed, so no skipped sample is loaded, and then puts
back the random streams as they were at the checkpointed step.

Iterable data cannot be skipped at the sampler: a ``StatefulDataLoader``
(torchdata) or an ``IterableDataset`` with ``state_dict``/``load_state_dict``
is resumed through those instead.
"""

from __future__ import annotations

import _random
import array
import contextlib
import ctypes
import itertools
import random
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch


def capture_rng() -> dict[str, Any]:
    """The global random streams of this process: Python, NumPy (when imported), torch CPU and, when CUDA is
    in use, the stream of this process's device (`torch.cuda.current_device`).

    Python's Mersenne Twister state (625 ints) is kept as one int64 tensor: a checkpoint then pickles
    one object for it, not 625, which makes the per-process file several times cheaper to write.
    """
    state: dict[str, Any] = {"python": _python_state(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = _numpy_state(np)
    if torch.cuda.is_initialized() and torch.cuda.is_available():  # the first alone is cheap: most hosts stop there
        # This process's device only: each rank records its own stream (in its own part of the checkpoint),
        # so the checkpoint does not depend on how many devices the host shows.
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


#: The Python stream's words `capture_rng` last converted, and their tensor. A fit whose code draws nothing from
#: `random` captures the same words snapshot after snapshot: comparing them with the last ones costs about a tenth
#: of converting them again (625 ints). The tensor is shared, as captured states are: nobody changes one in place.
_last_python_words: list[Any] = [None, None]


#: The bytes of CPython's Mersenne Twister state in a `random.Random` (the C part of the object, right after its header:
#: the position as a C int, then 624 32-bit key words).
_MT_BYTES = ctypes.sizeof(ctypes.c_int) + 624 * ctypes.sizeof(ctypes.c_uint32)

#: The Python stream as `_python_state` last recorded it: the raw bytes and cached Gaussian it was read with (None:
#: do not reuse it), and the record.
_last_python_state: list[Any] = [None, None, None]

#: The generator classes whose raw state was checked against ``getstate()``, and whether it matched.
_raw_layout: dict[type, bool] = {}


def _python_state() -> Any:
    """The global `random` stream as ``random.getstate()`` gives it, with the words as a tensor (`_python_words`).

    ``getstate()`` builds 625 ints (about 9 us). When the generator's raw state (read as bytes where CPython keeps
    it, `_raw_python_state`) and its cached Gaussian are those of the last record, nothing was drawn since: the last
    record is returned (shared, as captured states are; nobody changes one in place)."""
    generator: Any = getattr(random.getstate, "__self__", None)  # the module's functions are one instance's methods
    raw, gauss = _raw_python_state(generator), getattr(generator, "gauss_next", None)
    last_raw, last_gauss, last = _last_python_state
    if raw is not None and raw == last_raw and (gauss is last_gauss or gauss == last_gauss):
        return last
    version, internal, gauss = random.getstate()
    state = (version, _python_words(internal), gauss)
    _last_python_state[:] = [raw, gauss, state]
    return state


def _raw_python_state(generator: Any) -> bytes | None:
    """`generator`'s Mersenne Twister state as bytes (about 0.3 us), or None where that layout is not CPython's: the
    first read for a generator class is compared with ``getstate()``, and a class whose bytes differ is never read."""
    kind = type(generator)
    known = _raw_layout.get(kind)
    if known is False:
        return None
    header = object.__basicsize__
    if kind.__basicsize__ < header + _MT_BYTES or not isinstance(generator, _random.Random):
        _raw_layout[kind] = False
        return None
    raw = ctypes.string_at(id(generator) + header, _MT_BYTES)
    if known is None:
        index = int.from_bytes(raw[:4], sys.byteorder, signed=True)
        words = array.array("I", raw[4:])
        _raw_layout[kind] = words.itemsize == 4 and (*words, index) == _random.Random.getstate(generator)
        return raw if _raw_layout[kind] else None
    return raw


def _python_words(internal: tuple[int, ...]) -> torch.Tensor:
    last, words = _last_python_words
    if internal != last:
        words = torch.frombuffer(array.array("q", internal), dtype=torch.int64)
        _last_python_words[:] = [internal, words]
    return words


#: The bytes of NumPy's Mersenne Twister state (``mt19937_state``: 624 32-bit key words, then the position as a C
#: int), read through the generator's documented ``ctypes`` interface.
_MT19937_STATE_BYTES = 624 * ctypes.sizeof(ctypes.c_uint32) + ctypes.sizeof(ctypes.c_int)

#: NumPy's legacy stream as `capture_rng` last recorded it, and the raw generator state it was read from (None: do
#: not reuse it). ``np.random.get_state()`` copies the 624 key words one at a time (about 30 us, a fifth of a rewind
#: snapshot of a small model); reading the raw state and comparing it with the last one costs about 0.5 us.
_last_numpy_state: list[Any] = [None, None]


def _numpy_state(np: Any) -> tuple[Any, ...]:
    """NumPy's legacy global stream as ``np.random.get_state()`` gives it, with the key as an int64 tensor.

    When the generator's raw state (key words and position) is byte for byte the one last read, and that state had
    no cached Gaussian, nothing was drawn since: the last result is returned (shared, as captured states are; nobody
    changes one in place). A cached Gaussian can be used up without the key words changing, so a state that had one
    is never reused; `restore_rng` forgets the last state, since ``set_state`` may bring one back with the same key.
    """
    get_generator = getattr(np.random, "get_bit_generator", None)  # NumPy >= 1.25
    generator: Any = get_generator() if get_generator is not None else None
    raw = None
    if type(generator) is np.random.MT19937:
        raw = ctypes.string_at(generator.ctypes.state_address, _MT19937_STATE_BYTES)
        last_raw, last = _last_numpy_state
        if raw == last_raw:
            return last
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    _last_numpy_state[:] = [None if has_gauss else raw, state]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the streams `capture_rng` recorded."""
    random.setstate(_as_python_random_state(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        _last_numpy_state[:] = [None, None]
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if torch.cuda.is_available():
        _restore_cuda_rng(state)


def _restore_cuda_rng(state: dict[str, Any]) -> None:
    """Put this process's device stream back; the streams of devices this process does not use keep theirs.

    An older checkpoint holds one state per device its host showed (``"cuda"``): the entry of this process's
    device is taken, and none is set when that host had fewer devices (the device keeps its seeded stream).
    """
    device = torch.cuda.current_device()
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)
    elif "cuda" in state and device < len(state["cuda"]):
        torch.cuda.set_rng_state(state["cuda"][device], device)


def _as_python_random_state(value: Any) -> tuple[Any, ...]:
    """`capture_rng`'s Python entry as `random.setstate` takes it (older checkpoints hold a tuple or list)."""
    version, internal, gauss = value  # tuples may come back as lists
    words = internal.tolist() if isinstance(internal, torch.Tensor) else internal
    return (version, tuple(words), gauss)


def _loader_generators(loader: Any) -> list[torch.Generator]:
    found: list[torch.Generator] = []
    for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    gen = getattr(sampler, "generator", None)
    if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
        found.append(gen)
    return found


def capture_epoch_start(loader: Any) -> dict[str, Any]:
    """State of every generator `iter(loader)` may draw from, taken just before it is called."""
    return {"global": capture_rng(), "loader": [g.get_state() for g in _loader_generators(loader)]}


def capture_loader_generators(loader: Any) -> list[Any]:
    """Current states of the loader's own generators (for a resume at an epoch boundary)."""
    return [g.get_state() for g in _loader_generators(loader)]


def restore_loader_generators(loader: Any, states: list[Any], strict: bool = True) -> None:
    """Put back the states `capture_loader_generators` recorded. Not `strict`: when the loader has other
    generators (it was distributed differently), leave them alone."""
    generators = _loader_generators(loader)
    if len(generators) != len(states) and not strict:
        return
    if len(generators) != len(states):
        raise RuntimeError(
            "the training DataLoader's random generators differ from the checkpointed run's; "
            "build the DataLoader the same way to resume exactly"
        )
    for gen, state in zip(generators, states, strict=True):
        gen.set_state(state)


def restore_epoch_start(loader: Any, state: dict[str, Any], generators: list[torch.Generator] | None = None) -> None:
    """Put back what `capture_epoch_start` recorded: the global streams and the loader's generators."""
    restore_rng(state["global"])
    generators = _loader_generators(loader) if generators is None else generators
    if len(generators) != len(state["loader"]):
        raise RuntimeError(
            "the training DataLoader's random generators differ from the checkpointed run's; "
            "build the DataLoader the same way to resume exactly"
        )
    for gen, gen_state in zip(generators, state["loader"], strict=True):
        gen.set_state(gen_state)


class _SkipFirst:
    """Iterates an index iterator after skipping `skip` items; `prime()` does the skip now."""

    def __init__(self, inner: Iterator[Any], skip: int) -> None:
        self._inner, self._skip = inner, skip

    def prime(self) -> None:
        while self._skip:
            next(self._inner)
            self._skip -= 1

    def __iter__(self) -> _SkipFirst:
        return self

    def __next__(self) -> Any:
        self.prime()
        return next(self._inner)


class _Dropping:
    """Stands in for a DataLoader's batch sampler (its sampler, when it does not batch) while an epoch's iterator is
    created: the loader's own entries, without those at the epoch positions `drop`. Every entry is still drawn from
    the loader's own sampler, so the epoch's random draws are those of the whole epoch, and a dropped batch is never
    loaded. Other attributes (``sampler``, ``generator``) are the loader's own, so its generators are found."""

    def __init__(self, inner: Any, drop: frozenset[int]) -> None:
        self.inner, self.drop = inner, drop

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __iter__(self) -> Iterator[Any]:
        drop = self.drop
        return (entry for position, entry in enumerate(self.inner) if position not in drop)


def drops_at_sampler(loader: Any) -> bool:
    """Whether batches of `loader` can be left out at its sampler (`dropping`): a map-style DataLoader."""
    return isinstance(loader, torch.utils.data.DataLoader) and not isinstance(
        loader.dataset, torch.utils.data.IterableDataset
    )


@contextlib.contextmanager
def dropping(loader: Any, drop: frozenset[int]) -> Iterator[None]:
    """While inside, iterators made over `loader` leave out the batches at epoch positions `drop` (see `_Dropping`);
    `loader` must `drops_at_sampler`. With nothing to drop, the loader is left alone."""
    if not drop:
        yield
        return
    attr = "batch_sampler" if getattr(loader, "batch_sampler", None) is not None else "sampler"
    original = getattr(loader, attr)
    object.__setattr__(loader, attr, _Dropping(original, drop))  # one epoch's iterator only, as `open_positioned`
    try:
        yield
    finally:
        object.__setattr__(loader, attr, original)


class _SkippingSampler:
    """Stands in for a DataLoader's (batch) sampler while the resumed epoch's iterator is created.

    Every iteration started while `active` skips `skip` entries: a multi-process
    DataLoader iterator calls ``iter()`` on its sampler twice while it is created
    (in ``_BaseDataLoaderIter.__init__`` and again in ``_reset``) and consumes
    the second one. Later iterations (the next epochs of a persistent-worker
    iterator) do not skip.

    `rewind`, when given, runs at that second call: between the two calls the new
    iterator drew its worker base seed, a draw that a persistent-worker iterator
    does not repeat after its first epoch (later epochs only ``_reset`` it). Putting
    the generators back there lets the permutation come from the state the
    uninterrupted run drew it from.
    """

    def __init__(self, inner: Any, skip: int, rewind: Callable[[], None] | None = None) -> None:
        self.inner, self.skip, self.rewind = inner, skip, rewind
        self.active = True
        self.calls = 0
        self.first: _SkipFirst | None = None

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        if not self.active:
            return iter(self.inner)
        self.calls += 1
        if self.calls == 2 and self.rewind is not None:
            self.rewind()
        self.first = _SkipFirst(iter(self.inner), self.skip)
        return self.first


class _Batched:
    """Stands in for a DataLoader's batch sampler while a resumed epoch's iterator is created at a sample: the
    entries of `sampler` (a `_SkippingSampler` over the loader's sampler) in batches of `batch_size`, as
    ``BatchSampler`` makes them (the same requests to the sampler, so the same draws). Once `sampler` is no
    longer active (later epochs of a persistent-worker iterator), the loader's own batch sampler."""

    def __init__(self, sampler: _SkippingSampler, batch_size: int, drop_last: bool, original: Any) -> None:
        self.sampler, self.batch_size, self.drop_last, self.original = sampler, batch_size, drop_last, original

    def __len__(self) -> int:
        return len(self.original)

    def __iter__(self) -> Iterator[list[Any]]:
        if not self.sampler.active:
            return iter(self.original)
        return self._batches(iter(self.sampler))  # the sampler's iterator now: `open_positioned` primes it

    def _batches(self, indices: Iterator[Any]) -> Iterator[list[Any]]:
        while batch := list(itertools.islice(indices, self.batch_size)):
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch


def reuses_workers(loader: Any, epoch: int) -> bool:
    """Whether an uninterrupted run would reuse `loader`'s persistent workers in `epoch` (so its iterator,
    created in epoch 0, is only reset: no new worker base seed is drawn)."""
    return (
        epoch > 0
        and isinstance(loader, torch.utils.data.DataLoader)
        and bool(getattr(loader, "persistent_workers", False))
        and loader.num_workers > 0
        and not callable(getattr(loader, "state_dict", None))  # a StatefulDataLoader keeps its own account
    )


def open_positioned(
    loader: Any, skip: int, epoch_start: dict[str, Any], epoch: int, in_samples: bool = False
) -> Iterator[Any]:
    """``iter(loader)`` from the generator states `epoch_start`, its sampler past the first `skip` entries: batches,
    or with `in_samples` entries of the loader's sampler, the rest batched at the loader's batch size (a resume
    at another batch size or dataset length, `data_position.check_rest_of_epoch`).

    The states are put back first, so the iterator draws what the uninterrupted run's drew. For a loader
    whose persistent workers the uninterrupted run would have reused, the new iterator's worker base-seed
    draw is undone before the sampler draws (see `_SkippingSampler`), and the workers start with the
    dataset as the uninterrupted run's workers had it: they were made in epoch 0, after
    ``dataset.set_epoch(0)``, and never saw a later ``set_epoch`` (each worker holds its own copy).
    """
    attr = "batch_sampler" if getattr(loader, "batch_sampler", None) is not None else "sampler"
    original = getattr(loader, attr)
    reused = reuses_workers(loader, epoch)
    generators = _loader_generators(loader)  # found now: the stand-in hides the sampler's
    rewind = (lambda: restore_epoch_start(loader, epoch_start, generators)) if reused else None
    skipping = _SkippingSampler(loader.sampler if in_samples else original, skip, rewind)
    stand_in = _Batched(skipping, loader.batch_size, loader.drop_last, original) if in_samples else skipping
    dataset_set_epoch = getattr(getattr(loader, "dataset", None), "set_epoch", None)
    restore_epoch_start(loader, epoch_start, generators)
    object.__setattr__(loader, attr, stand_in)  # DataLoader forbids setting it after __init__; one epoch only
    try:
        if reused and callable(dataset_set_epoch):
            dataset_set_epoch(0)  # the copy the workers get
        iterator = iter(loader)
        assert skipping.first is not None
        skipping.first.prime()  # the permutation is drawn now, where the uninterrupted run drew it
    finally:
        skipping.active = False
        object.__setattr__(loader, attr, original)
        if reused and callable(dataset_set_epoch):
            dataset_set_epoch(epoch)
    return iterator


def open_at_sample(
    loader: Any, skip: int, epoch_start: dict[str, Any] | None, step_rng: dict[str, Any], epoch: int
) -> tuple[Iterator[Any], int]:
    """An iterator over `loader` from entry `skip` of its sampler on, batched at its batch size, with the step's
    random streams restored; and how many batches it yields."""
    if epoch_start is None:
        raise RuntimeError("the checkpoint lacks the epoch's data position (epoch_start); it cannot resume mid-epoch")
    iterator = open_positioned(loader, skip, epoch_start, epoch, in_samples=True)
    restore_rng(step_rng)
    rest = max(len(loader.sampler) - skip, 0)
    batch_size = loader.batch_size
    return iterator, rest // batch_size if loader.drop_last else -(-rest // batch_size)


class _FixedBatches:
    """Stands in for a DataLoader's batch sampler while an iterator over given batches is created."""

    def __init__(self, inner: Any, batches: list[list[int]]) -> None:
        self.inner, self.batches = inner, batches
        self.active = True

    def __len__(self) -> int:
        return len(self.batches) if self.active else len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self.batches)) if self.active else iter(self.inner)


def open_batches(loader: Any, batches: list[list[int]], step_rng: dict[str, Any]) -> Iterator[Any]:
    """An iterator over `loader` that yields exactly `batches` (lists of dataset indices) this epoch, then
    the step's random streams put back. Later epochs use the loader's own batch sampler again."""
    original = loader.batch_sampler
    stand_in = _FixedBatches(original, batches)
    object.__setattr__(loader, "batch_sampler", stand_in)  # one epoch only, as in `open_positioned`
    try:
        iterator = iter(loader)
    finally:
        stand_in.active = False
        object.__setattr__(loader, "batch_sampler", original)
    restore_rng(step_rng)
    return iterator


def warn_if_workers_miss_set_epoch(loader: Any) -> None:
    """Warn when the training dataset has ``set_epoch`` but its DataLoader keeps persistent workers.

    Each worker holds the copy of the dataset made when the workers started (the first epoch), so
    ``dataset.set_epoch(epoch)``, called in the main process, never reaches them: per-epoch augmentation
    keyed on it repeats the first epoch's. The same happens in a plain loop over the loader.
    """
    dataset = getattr(loader, "dataset", None)
    if callable(getattr(dataset, "set_epoch", None)) and reuses_workers(loader, 1):
        warnings.warn(
            f"the training dataset {type(dataset).__name__} has set_epoch(), but its DataLoader uses "
            "persistent_workers=True: each worker keeps the copy of the dataset made in the first epoch, so "
            "set_epoch(epoch) does not reach it and per-epoch randomness keyed on it repeats epoch 0's. Use "
            "persistent_workers=False, or carry the epoch through the sampler.",
            RuntimeWarning,
            stacklevel=3,
        )


def open_resumed_epoch(
    loader: Any, skip: int, epoch_start: dict[str, Any] | None, saved: dict[str, Any], epoch: int = 0
) -> Any:
    """An iterator over `loader` positioned after `skip` batches, with the step's random streams restored.

    `saved` is the process's checkpointed state (``rng``, and ``loader`` or
    ``dataset`` positions when those keep their own). The caller limits how
    many batches it takes. Falls back to restarting the epoch (with a warning)
    for an iterable dataset without ``load_state_dict``.
    """
    step_rng = saved["rng"]
    if "loader" in saved or "dataset" in saved:  # iterable data that knows its own position
        if "loader" in saved:  # a StatefulDataLoader
            loader.load_state_dict(saved["loader"])
        else:
            loader.dataset.load_state_dict(saved["dataset"])
        iterator = iter(loader)  # draws (e.g. the worker base seed) must not leak into the step's streams
        restore_rng(step_rng)
        return iterator
    if epoch_start is None:
        raise RuntimeError("the checkpoint lacks the epoch's data position (epoch_start); it cannot resume mid-epoch")
    if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        warnings.warn(
            "resuming in the middle of an epoch over an IterableDataset without state_dict/load_state_dict: "
            "the epoch restarts from its first batch. Give the dataset state_dict()/load_state_dict() "
            "(or use torchdata's StatefulDataLoader) to resume exactly.",
            RuntimeWarning,
            stacklevel=2,
        )
        iterator = iter(loader)
        restore_rng(step_rng)
        return iterator
    iterator = open_positioned(loader, skip, epoch_start, epoch)
    restore_rng(step_rng)
    return iterator


def islice_from(iterator: Any, start: int, count: float) -> Iterator[tuple[int, Any]]:
    """``enumerate`` from `start`, stopping at index `count` (inf: until the iterator ends)."""
    indexed = enumerate(iterator, start)
    if count == float("inf"):
        return indexed
    return itertools.islice(indexed, max(int(count) - start, 0))

"""The batch-size finder: the largest training batch that fits, by power-of-two growth then binary search.

Each trial trains ``steps_per_trial`` optimizer steps at one batch size, in a
scratch run that leaves the module as it found it (`ember.tuning.scratch`). A
size *fits* when the trial finishes without running out of memory and, when a
``memory_budget`` is set, its peak stays within the budget:

- On CUDA, out of memory is the real ``torch.cuda.OutOfMemoryError``; the peak
  is ``torch.cuda.max_memory_allocated()`` during the trial, above what was
  allocated when it started.
- On the CPU nothing runs out of memory in a useful way, so the budget stands
  in for it: the peak is measured from the CPU allocator's own records
  (``torch.profiler`` with ``profile_memory=True``): the most bytes the trial
  held at any instant on top of what was allocated when it started. That
  covers the batches the loader builds, activations, gradients, optimizer state
  created by the first step, and temporaries inside operators.

The search doubles the size from ``init_size`` until a size does not fit or
``max_size`` (or the data set's size) is reached, then bisects between the
last size that fitted and the first that did not. The answer is the largest
size found to fit. Under DDP every process runs each trial on its own batch of
that size; the processes agree after each trial that it fitted only if it fitted
on all of them (an all-reduce), so they take the same path and give the same
answer.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.modules.datamodule import DataModule
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str) -> int:
    """``4096``, ``"512MB"``, ``"1.5 GiB"`` -> bytes (decimal kB/MB/GB, binary KiB/MiB/GiB)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"memory budget {value!r}: use a positive number of bytes, e.g. 4096, '512MB' or '2GiB'")
    return int(float(match.group(1)) * _UNITS[unit])


class BatchSizeError(RuntimeError):
    """No batch size fits: the smallest one tried already ran out of memory or over the budget."""


@dataclass
class Trial:
    """One batch size tried: whether it fitted (on every process), its peak bytes (the largest over the processes;
    None when it ran out of memory first) and this process's own peak."""

    batch_size: int
    fits: bool
    peak_bytes: int | None
    reason: str = ""
    local_peak_bytes: int | None = None


@dataclass
class BatchSizeResult:
    """The largest batch size found to fit, and every trial on the way (in the order they ran)."""

    batch_size: int
    trials: list[Trial] = field(default_factory=list)
    limited_by: str = ""
    key: str = "data.batch_size"

    @property
    def override(self) -> str:
        """The command-line override that uses it, e.g. ``data.batch_size=384``."""
        return f"{self.key}={self.batch_size}"


def search(fits: Callable[[int], bool], init_size: int, max_size: int, mode: str = "binsearch") -> tuple[int, str]:
    """Power-of-two growth from `init_size`, then (``mode="binsearch"``) bisection; returns (size, why it stopped).

    `fits(n)` runs one trial. The growth stops at the first size that does not
    fit or at `max_size`; a size that fits is never tried twice.
    """
    size, last_good, first_bad = init_size, 0, 0
    while True:
        size = min(size, max_size)
        if not fits(size):
            first_bad = size
            break
        last_good = size
        if size >= max_size:
            return size, "max_size"
        size *= 2
    if last_good == 0:
        raise BatchSizeError(
            f"batch size {init_size} does not fit already; lower init_size, raise the memory budget or "
            "make the model smaller"
        )
    if mode == "power":
        return last_good, "limit"
    low, high = last_good, first_bad
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, "limit"


class _PeakMemory(Callback):
    """Measures the trial's peak memory above the level at its start (CUDA statistics or CPU allocator records)."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._profiler: Any = None
        self._cuda_start = 0

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._cuda_start = torch.cuda.memory_allocated(device)
            return
        self._profiler = cpu_memory_recorder()
        self._profiler.__enter__()

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.peak_bytes = torch.cuda.max_memory_allocated(device) - self._cuda_start
            return
        self.peak_bytes = self._finish()

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._finish()  # after an error the profiler still runs

    def _finish(self) -> int | None:
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        return peak_allocated(profiler)


def cpu_memory_recorder() -> Any:
    """A ``torch.profiler.profile`` that records the CPU allocator's allocations and frees (enter it to start).

    The profiler's library (kineto) prints a ``USDT: ... profiler_start`` / ``profiler_stop`` line to stderr at
    every start and stop, two per trial, unless its log level says otherwise: that level is raised here, for
    this process, when the user has not set it (``KINETO_LOG_LEVEL``)."""
    import os

    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above every level kineto logs at: quiet

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def peak_allocated(profiler: Any) -> int:
    """The most bytes held at once, above the starting level, from a finished recorder's allocation records."""
    results = getattr(getattr(profiler, "profiler", None), "kineto_results", None)
    if results is None:
        raise RuntimeError("this torch build's profiler keeps no memory records; set no memory budget on the CPU")
    records = sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in records:
        held += nbytes
        peak = max(peak, held)
    return peak


def scale_batch_size(
    trainer: Trainer,
    module: TrainingModule,
    train_dataloaders: Any = None,
    datamodule: DataModule | None = None,
    *,
    init_size: int = 2,
    max_size: int | None = None,
    mode: str = "binsearch",
    steps_per_trial: int = 3,
    memory_budget: int | str | None = None,
    batch_arg_name: str = "batch_size",
    key: str | None = None,
    verbose: bool = True,
) -> BatchSizeResult:
    """Find the largest batch size that trains within memory (see the module docstring for the search).

    The batch size is the datamodule's ``batch_arg_name`` attribute (set for each
    trial and put back afterwards), or, without a datamodule, the ``batch_size``
    of the one training DataLoader passed (rebuilt per trial with the same
    dataset, sampler type, collate function and workers). ``max_size`` caps the
    search (default: the data set's length, else 2**20); ``memory_budget`` (bytes
    or a string like ``"512MB"``) is required on the CPU, where nothing else
    stops the growth. Process 0 prints the result and the override (``key``,
    default ``data.<batch_arg_name>``) unless ``verbose=False``.
    """
    from ember.tuning.scratch import Snapshot, check_supported

    check_supported(trainer, "scale_batch_size")
    if mode not in ("power", "binsearch"):
        raise ValueError(f"scale_batch_size: mode={mode!r}; choose 'power' or 'binsearch'")
    for name, value in (("init_size", init_size), ("steps_per_trial", steps_per_trial)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"scale_batch_size: {name} must be a positive int; got {value!r}")
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    on_cuda = trainer.strategy.root_device.type == "cuda" or _cuda_strategy_pending(trainer)
    if budget is None and not on_cuda and max_size is None:
        raise ValueError(
            "scale_batch_size on the CPU needs memory_budget (e.g. '2GB') or max_size: nothing runs out of "
            "memory there in a way ember can catch"
        )
    batches = _BatchSetter(datamodule, train_dataloaders, batch_arg_name)
    limit = min(max_size or 2**20, batches.data_limit(trainer.world_size))
    if init_size > limit:
        cap = "max_size" if max_size is not None and limit == max_size else "the training samples per process"
        raise ValueError(f"scale_batch_size: init_size={init_size} is above {limit} ({cap}); lower init_size")
    snapshot = Snapshot.take(module, datamodule, train_dataloaders)
    trials: list[Trial] = []

    def fits(size: int) -> bool:
        trial = _run_trial(trainer, module, batches, size, steps_per_trial, budget, snapshot)
        trials.append(trial)
        return trial.fits

    try:
        size, why = search(fits, init_size, limit, mode)
    finally:
        batches.restore()
        snapshot.restore()
    if why == "max_size":
        why = "max_size" if max_size is not None and limit == max_size else "data set size"
    else:
        why = "memory budget" if budget is not None else "out of memory"
    result = BatchSizeResult(size, trials, why, key or f"data.{batch_arg_name}")
    if verbose and trainer.is_global_zero:
        print(describe(result, budget), flush=True)
    return result


def _cuda_strategy_pending(trainer: Trainer) -> bool:
    """A parallel strategy picks its CUDA device only at setup; judge by what it will pick."""
    accelerator = getattr(trainer.strategy, "accelerator", None)
    return accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())


def _run_trial(
    trainer: Trainer,
    module: TrainingModule,
    batches: _BatchSetter,
    size: int,
    steps: int,
    budget: int | None,
    snapshot: Any,
) -> Trial:
    from ember.trainer.run import label_command
    from ember.tuning.scratch import CaptureInitialised, release, scratch_trainer

    batches.set(size)
    meter = _PeakMemory()
    callbacks: list[Any] = [meter]
    if snapshot.lazy:  # only then: the hook sends steps down the general path
        callbacks.insert(0, CaptureInitialised(snapshot))
    scratch = scratch_trainer(trainer, max_steps=steps, callbacks=callbacks, logger=False, enable_progress_bar=False)
    label_command(scratch, "tune batch-size")  # its run directory's status.json says what made it
    out_of_memory = False
    try:
        scratch.fit(module, batches.loaders(), datamodule=batches.datamodule)
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True
    finally:
        release(scratch)
        snapshot.restore()
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()
    local = meter.peak_bytes
    local_fit = not out_of_memory and (budget is None or (local is not None and local <= budget))
    strategy = scratch.strategy
    device = strategy.root_device
    # One exchange: whether it fitted everywhere (min) and the largest peak (max; -1: ran out of memory).
    fitted = strategy.reduce(torch.tensor(1.0 if local_fit else 0.0, device=device), "min")
    peak = strategy.reduce(torch.tensor(-1.0 if local is None else float(local), device=device), "max")
    fits, peak_bytes = bool(fitted.item() > 0.5), int(peak.item())
    any_oom = strategy.reduce(torch.tensor(1.0 if out_of_memory else 0.0, device=device), "max").item() > 0.5
    reason = "" if fits else ("out of memory" if any_oom else "over the memory budget")
    return Trial(size, fits, None if any_oom or peak_bytes < 0 else peak_bytes, reason, local)


class _BatchSetter:
    """Where the batch size lives: a datamodule attribute, or the batch size of a plain DataLoader."""

    def __init__(self, datamodule: DataModule | None, loaders: Any, name: str) -> None:
        self.datamodule, self.name = datamodule, name
        self._loader: Any = None
        self._current: Any = None
        if datamodule is not None:
            if not hasattr(datamodule, name):
                raise ValueError(
                    f"scale_batch_size: {type(datamodule).__qualname__} has no attribute {name!r}; give its "
                    "batch size attribute as batch_arg_name"
                )
            self._original = getattr(datamodule, name)
            return
        from torch.utils.data import DataLoader

        loader = loaders[0] if isinstance(loaders, (list, tuple)) and len(loaders) == 1 else loaders
        if not isinstance(loader, DataLoader) or loader.batch_size is None:
            raise ValueError(
                "scale_batch_size needs a datamodule with a batch size attribute, or one torch DataLoader built "
                "with batch_size=..."
            )
        self._loader, self._original = loader, loader.batch_size

    def data_limit(self, world_size: int) -> int:
        """The most samples one process sees in an epoch (a batch cannot hold more); 2**20 when unknown.
        `EmptyDataError` when the training data set has no samples."""
        from ember.trainer.data import EmptyDataError

        empty = EmptyDataError(
            "scale_batch_size: the training data set is empty (0 samples), so no batch size can be tried; check the "
            "data's path, split and filters, then run the finder again"
        )
        dataset = None
        if self._loader is not None:
            dataset = self._loader.dataset
        else:
            assert self.datamodule is not None
            self.datamodule.setup("fit")
            try:
                dataset = getattr(self.datamodule.train_dataloader(), "dataset", None)
            except ValueError as exc:
                if "num_samples=0" in str(exc):  # torch's RandomSampler refuses to shuffle no samples
                    raise empty from exc
                raise
        try:
            samples = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            return 2**20
        if samples == 0:
            raise empty
        return max(1, math.ceil(samples / world_size))

    def set(self, size: int) -> None:
        if self.datamodule is not None:
            setattr(self.datamodule, self.name, size)
        else:
            self._current = _with_batch_size(self._loader, size)

    def loaders(self) -> Any:
        return self._current

    def restore(self) -> None:
        if self.datamodule is not None:
            setattr(self.datamodule, self.name, self._original)


def _with_batch_size(loader: Any, size: int) -> Any:
    from torch.utils.data import RandomSampler

    from ember.strategies.parallel import rebuilt_loader

    shuffle = isinstance(loader.sampler, RandomSampler)
    return rebuilt_loader(loader, batch_size=size, shuffle=shuffle, timeout=0, multiprocessing_context=None,
                          prefetch_factor=None, persistent_workers=False)  # fmt: skip


def describe(result: BatchSizeResult, budget: int | None) -> str:
    """The lines `scale_batch_size` prints: every trial, the answer and the override."""
    lines = []
    for trial in result.trials:
        peak = f"peak {_human(trial.peak_bytes)}" if trial.peak_bytes is not None else "no peak"
        verdict = "fits" if trial.fits else f"does not fit ({trial.reason})"
        lines.append(f"scale_batch_size: batch size {trial.batch_size}: {peak}, {verdict}")
    limit = f" of {_human(budget)}" if budget is not None and result.limited_by == "memory budget" else ""
    lines.append(
        f"scale_batch_size: largest batch size {result.batch_size} (limited by the {result.limited_by}{limit})"
    )
    lines.append(f"scale_batch_size: use it with {result.override}")
    return "\n".join(lines)


def _human(nbytes: int | None) -> str:
    if nbytes is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


@contextlib.contextmanager
def measure_peak_bytes() -> Iterator[list[int]]:
    """``with measure_peak_bytes() as peak:`` ... then ``peak[0]``: the CPU bytes held at most inside the block
    above the level at its start (the same measure the finder uses on the CPU)."""
    out: list[int] = []
    recorder = cpu_memory_recorder()
    with recorder:
        yield out
    out.append(peak_allocated(recorder))

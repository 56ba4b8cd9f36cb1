"""Dataloaders: where they come from, how many batches each stage uses, and the epoch plan."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ember.modules.datamodule import DataModule

#: Trainer stage -> the DataModule method prefix that feeds it.
_LOADER_PREFIX = {"train": "train", "validation": "val", "test": "test", "predict": "predict"}


def check_limit(name: str, value: float | int) -> None:
    """``limit_*_batches``: a fraction in [0, 1] or a non-negative batch count."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a fraction (float) or a batch count (int); got {value!r}")
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value}: a float is a fraction of the epoch and must lie in [0, 1]")
    if value < 0:
        raise ValueError(f"{name}={value} must not be negative")


def num_batches(loader: Iterable[Any], limit: float | int, name: str = "limit_*_batches") -> float:
    """Batches to use from `loader`: ``inf`` for a loader without a length.

    `name` is the option the limit came from, for the error messages.
    """
    try:
        length: float = len(loader)  # type: ignore[arg-type]
    except TypeError:
        length = math.inf
    if isinstance(limit, int):
        return min(length, limit)
    if limit == 1.0:
        return length
    if math.isinf(length):
        raise ValueError(f"a fractional {name} needs a dataloader with a length; pass a batch count")
    count = int(length * limit)
    if count == 0 and limit > 0 and length > 0:
        raise ValueError(
            f"{name}={limit} of {int(length)} batches is less than one batch; "
            f"use at least {1 / length:.4g}, a batch count, or 0 to skip"
        )
    return count


def limited(loader: Iterable[Any], count: float) -> Iterator[Any]:
    """Iterate `loader` once, stopping after `count` batches (the iterator is made exactly once).

    When `count` is the loader's whole length the loader is iterated to its end, as a ``for`` loop
    does: the sampler's last draw (e.g. ``RandomSampler``'s final ``randperm``) then happens.
    """
    if math.isinf(count) or count == _length(loader):
        return iter(loader)
    return itertools.islice(loader, int(count))


def _length(loader: Iterable[Any]) -> float:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return math.inf


def as_list(loaders: Any) -> list[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    return [loaders]


def resolve_loaders(stage: str, given: Any, datamodule: DataModule | None) -> list[Any]:
    """Dataloaders for `stage`: passed directly, else from the datamodule, else none."""
    if given is not None:
        return as_list(given)
    if datamodule is not None and datamodule.has_dataloader(_LOADER_PREFIX[stage]):
        return as_list(getattr(datamodule, f"{_LOADER_PREFIX[stage]}_dataloader")())
    return []


@dataclass(frozen=True)
class EpochPlan:
    """Which batches of a training epoch end an accumulation window or run validation."""

    num_batches: float  # inf when the loader has no length
    accumulate: int
    val_every: float  # validate after every `val_every` batches (inf: only at epoch end)

    @classmethod
    def build(cls, num_batches: float, accumulate: int, val_check_interval: float | int) -> EpochPlan:
        if isinstance(val_check_interval, int) and not isinstance(val_check_interval, bool):
            if val_check_interval > num_batches:
                raise ValueError(
                    f"val_check_interval={val_check_interval} is larger than the training epoch "
                    f"({int(num_batches)} batches); use at most {int(num_batches)}, or a fraction like 0.5"
                )
            every: float = val_check_interval
        elif math.isinf(num_batches):
            every = math.inf
        else:
            every = max(1, int(num_batches * val_check_interval))
        return cls(num_batches, accumulate, every)

    @property
    def _full_windows_end(self) -> float:
        """Index of the first batch of the short last window (inf for a loader without a length)."""
        if math.isinf(self.num_batches):
            return math.inf
        return int(self.num_batches) // self.accumulate * self.accumulate

    def window_size(self, batch_idx: int) -> int:
        """Micro-batches in the accumulation window holding `batch_idx` (the last one may be shorter)."""
        if self.accumulate == 1 or batch_idx < self._full_windows_end:
            return self.accumulate
        return int(self.num_batches - self._full_windows_end)

    def ends_window(self, batch_idx: int) -> bool:
        return (batch_idx + 1) % self.accumulate == 0 or self.is_last(batch_idx)

    def is_last(self, batch_idx: int) -> bool:
        return batch_idx + 1 == self.num_batches

    def validates_after(self, batch_idx: int) -> bool:
        return self.is_last(batch_idx) or (batch_idx + 1) % self.val_every == 0


def check_not_empty(stage: str, loaders: Sequence[Any]) -> None:
    for i, loader in enumerate(loaders):
        try:
            empty = len(loader) == 0
        except TypeError:
            continue
        if empty:
            which = f"{stage} dataloader" + (f" #{i}" if len(loaders) > 1 else "")
            raise ValueError(f"the {which} is empty (0 batches); check the dataset size, batch_size and drop_last")

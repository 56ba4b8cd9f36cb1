"""Dataloaders: where they come from, how many batches each stage uses, and the epoch plan."""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ember import stages
from ember.modules.datamodule import DataModule
from ember.seed import with_seeded_workers


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
    length = loader_length(loader)
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
    if math.isinf(count) or count == loader_length(loader):
        return iter(loader)
    return itertools.islice(loader, int(count))


def loader_length(loader: Any) -> float:
    """``len(loader)``, or inf for a loader without a length."""
    try:
        return len(loader)
    except TypeError:
        return math.inf


def finish_epoch(iterator: Iterator[Any], loader: Any) -> None:
    """Ask the epoch's iterator once more after its last batch, as a ``for`` loop over the loader does.

    That call ends the sampler's iteration, which may still draw: when the dataset size is a multiple
    of the batch size, the last batch is complete before ``RandomSampler.__iter__`` has run to its end,
    and its final ``torch.randperm(n, generator=...)`` advances the loader's generator. Without it every
    later epoch is shuffled differently from a plain loop's. Runs only for an epoch that reached its
    last batch and was not cut short by ``limit_train_batches`` (one call per epoch, outside the step loop).
    """
    extra = next(iterator, _END)
    if extra is not _END:
        warnings.warn(
            f"the training DataLoader yielded more batches than its len() ({loader_length(loader)}); ember used "
            "the first len() of them in this epoch. Make the dataset's __len__ match what it yields.",
            RuntimeWarning,
            stacklevel=2,
        )


_END = object()


def release_workers(loaders: Iterable[Any]) -> None:
    """Stop the worker processes that loaders with ``persistent_workers=True`` keep between epochs; a loader's next
    iteration starts new ones.

    PyTorch stops them when the loader is freed. A fit's loaders are freed by the garbage collector (the trainer,
    its loop and the loaders refer to one another), and there the queues that tell the workers to stop are
    finalized before the loader: PyTorch then waits 5 s for each worker and kills it, at whatever later moment the
    collector runs. The end of a fit stops them at once instead (as Lightning does when its loops end).
    """
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and callable(getattr(iterator, "_shutdown_workers", None)):
            iterator._shutdown_workers()
            loader._iterator = None  # DataLoader.__iter__ makes a new iterator (and workers) the next time


def set_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the dataset and samplers that have it (seeded augmentation, distributed)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    targets = {id(obj): obj for obj in (getattr(loader, "dataset", None), *owners[1:]) if obj is not None}
    for obj in targets.values():
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)


def as_list(loaders: Any) -> list[Any]:
    """`loaders` as a list of dataloaders. A list of batches (``[(x, y), ...]``) is one dataloader."""
    if loaders is None:
        return []
    if isinstance(loaders, (list, tuple)):
        if loaders and all(_is_batch(item) for item in loaders):
            return [loaders]
        for item in loaders:
            if not isinstance(item, Iterable) or isinstance(item, (str, bytes)):
                raise TypeError(
                    f"expected a DataLoader (or any iterable of batches), a list of them, or a list of batches; "
                    f"got a {type(loaders).__name__} holding a {type(item).__qualname__}"
                )
        return list(loaders)
    if not isinstance(loaders, Iterable) or isinstance(loaders, (str, bytes)):
        raise TypeError(
            f"expected a DataLoader (or any iterable of batches) or a list of them; got {type(loaders).__qualname__}"
        )
    return [loaders]


def _is_batch(item: Any) -> bool:
    """Whether `item` of a list passed as data is a batch (a tensor, a dict, a tuple) rather than a dataloader."""
    if isinstance(item, (Tensor, Mapping, tuple)):
        return True
    return isinstance(item, list) and bool(item) and all(isinstance(x, Tensor) for x in item)


def resolve_loaders(stage: str, given: Any, datamodule: DataModule | None, module: Any = None) -> list[Any]:
    """Dataloaders for the loop `stage` ("train", "validation", ...): passed directly, else from the
    datamodule, else from the module's own ``<stage>_dataloader()`` method (as in Lightning), else none."""
    if given is None:
        prefix = stages.by_loop(stage).loader
        method = getattr(module, f"{prefix}_dataloader", None)
        if datamodule is not None and datamodule.has_dataloader(prefix):
            given = getattr(datamodule, f"{prefix}_dataloader")()
        elif callable(method):
            given = method()
    return [with_seeded_workers(loader) for loader in as_list(given)]


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


class EmptyDataError(ValueError):
    """A dataloader the run needs yields no batches: a mistake in the data's settings, found before any step."""


def check_not_empty(stage: str, loaders: Sequence[Any]) -> None:
    """Raise `EmptyDataError` for the first of `loaders` whose length is 0 (loaders without a length pass)."""
    for i, loader in enumerate(loaders):
        try:
            empty = len(loader) == 0
        except TypeError:
            continue
        if empty:
            which = f"{stage} dataloader" + (f" #{i}" if len(loaders) > 1 else "")
            raise EmptyDataError(f"the {which} is empty (0 batches); check the dataset size, batch_size and drop_last")


def unshuffled(loader: Any) -> Any:
    """``overfit_batches``: `loader` rebuilt to read in order when it shuffles (the same few batches every epoch)."""
    from torch.utils.data import DataLoader, RandomSampler

    if not isinstance(loader, DataLoader) or not isinstance(loader.sampler, RandomSampler):
        return loader
    from ember.strategies.parallel import rebuilt_loader

    warnings.warn(
        "overfit_batches: the training DataLoader shuffles; ember reads it in order, so every epoch trains on the "
        "same batches",
        UserWarning,
        stacklevel=3,
    )
    return rebuilt_loader(loader, shuffle=False)


_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def batch_transfer(trainer: Any, module: Any, dataloader_idx: int = 0) -> Callable[[Any], Any] | None:
    """The function that brings a batch of dataloader `dataloader_idx` to the device, or None when the batch
    stays as it is (one CPU process, no cast, no transfer hook): decided once per loop, not per batch.

    The batch-transfer hooks are Lightning's: ``on_before_batch_transfer``, ``transfer_batch_to_device``,
    ``on_after_batch_transfer``, each taken from the datamodule when it overrides it, else from the module
    when it does. Without a ``transfer_batch_to_device`` override the strategy moves (and casts) the batch.
    """
    from ember.modules.module import TrainingModule

    strategy = trainer.strategy
    found = [_override(trainer.datamodule, DataModule, name) or _override(module, TrainingModule, name)
             for name in _TRANSFER_HOOKS]  # fmt: skip
    before, transfer, after = found
    if before is None and transfer is None and after is None:
        return None if strategy.batches_stay_put else strategy.batch_to_device
    device, convert = strategy.root_device, strategy.precision.convert_batch

    def to_device(batch: Any) -> Any:
        if before is not None:
            batch = before(batch, dataloader_idx)
        batch = (
            strategy.batch_to_device(batch) if transfer is None else convert(transfer(batch, device, dataloader_idx))
        )
        return batch if after is None else after(batch, dataloader_idx)

    return to_device


def _override(obj: Any, base: type, name: str) -> Callable[..., Any] | None:
    """``obj.name`` when `obj`'s class overrides `base`'s method, else None."""
    if obj is None or getattr(type(obj), name, None) is getattr(base, name):
        return None
    method: Callable[..., Any] = getattr(obj, name)
    return method

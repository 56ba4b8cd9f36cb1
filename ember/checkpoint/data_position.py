"""The data position of a checkpoint in samples, and the rest of an interrupted epoch on a different number
of processes, or at another batch size or dataset length.

On the same number of processes, `resume` re-creates each process's iterator exactly (bitwise). On a
different number, the per-process position means nothing to the new processes, so every checkpoint also
records the epoch's position globally: how many samples of the epoch's global order the processes have
consumed, and what the order is made of (a `DistributedSampler`'s seed and epoch, or one process's own
sampler, replayed from the generator states recorded at the epoch's start). On resume the order is
rebuilt, the consumed samples are dropped, and the rest is split across the new processes the way
`DistributedSampler` splits an epoch (process r takes every W-th sample from the r-th). Within that epoch
no sample is seen twice and none is skipped, except that when the rest does not give every process the
same number of batches, each process short of one batch repeats one sample from the start of the rest
(at most W - 1 samples, as `DistributedSampler` pads every epoch), or, with ``drop_last=True``, the
samples past the last full batch of the process with the fewest are dropped (as ``drop_last`` drops).
The batch indices of the rest are numbered so the epoch ends at its usual last index.

What cannot be rebuilt is refused with `ember.checkpoint.CheckpointError` saying what to do: a custom
sampler or batch sampler, an iterable dataset, ``use_distributed_sampler=False`` with several processes,
or an epoch cut short by ``limit_train_batches``.

On as many processes whose batch size or training dataset length changed since the checkpoint, each process
also records the samples of its own order it consumed (`check_rest_of_epoch`): the epoch continues from that
sample of the same order, batched at the new size (no sample skipped or repeated), and what cannot (a dataset
shorter than that, an order that depends on the dataset's length, a sampler switched) is refused before any
step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ember.checkpoint import CheckpointError
from ember.checkpoint.resume import open_at_sample, open_batches, restore_epoch_start

if TYPE_CHECKING:
    from ember.trainer.loop import FitLoop
    from ember.trainer.trainer import Trainer

#: Samplers whose order ember can replay from the generator states of the epoch's start.
_REPLAYABLE = (RandomSampler, SequentialSampler)


def record(trainer: Trainer) -> dict[str, Any] | None:
    """The epoch's position in samples consumed globally, and how to rebuild the epoch's order.

    The same on every process; taken at a checkpoint (never per step).
    """
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader):
        return None
    world_size, progress = data_world(trainer.strategy)[0], trainer.progress
    position: dict[str, Any] = {
        "epoch": progress.epoch,
        "batches": progress.batch_idx,  # per process
        "world_size": world_size,  # data-parallel shards (tensor-parallel peers share one)
        "order": None,  # how the epoch's global order is rebuilt; None: it cannot be
    }
    dataset, sampler, batch_size = loader.dataset, loader.sampler, loader.batch_size
    if isinstance(dataset, IterableDataset) or batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return position
    length = _length(dataset)
    position["dataset_size"] = length
    position["whole_epoch"] = trainer.epoch_plan.num_batches == len(loader)
    # this process's own account, for a resume on as many processes with other data settings
    position.update(batch_size=batch_size, sampler=type(sampler).__qualname__)
    position["process_samples"] = _consumed(progress.batch_idx * batch_size, sampler)
    if isinstance(sampler, DistributedSampler) and sampler.num_replicas == world_size:
        per_process = min(progress.batch_idx * batch_size, sampler.num_samples)
        position.update(
            order="distributed",
            samples=per_process * world_size,
            seed=sampler.seed,
            shuffle=sampler.shuffle,
            sampler_drop_last=sampler.drop_last,
        )
    elif world_size == 1 and type(sampler) in _REPLAYABLE:
        position.update(order="replay", samples=min(progress.batch_idx * batch_size, _length(sampler)))
    return position


def distributed_order(
    dataset_size: int, world_size: int, seed: int, shuffle: bool, drop_last: bool, epoch: int
) -> list[int]:
    """The epoch's global order under `DistributedSampler`: position p is what process p % W took as its
    (p // W)-th sample (padded or cut as the sampler does)."""
    samplers: list[list[int]] = []
    for rank in range(world_size):
        sampler: DistributedSampler[int] = DistributedSampler(
            _Indices(dataset_size), world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        samplers.append(list(sampler))
    return [index for group in zip(*samplers, strict=True) for index in group]


def split_rest(rest: list[int], world_size: int, rank: int, batch_size: int, drop_last: bool) -> list[list[int]]:
    """Process `rank`'s batches of the samples `rest`, split as `DistributedSampler` splits an epoch.

    Every process gets the same number of batches: with ``drop_last`` the batches past the fewest full
    ones are dropped; otherwise a process one batch short repeats one sample from the start of `rest`.
    """
    shares = [rest[r::world_size] for r in range(world_size)]
    if drop_last:
        count = min(len(share) // batch_size for share in shares)
    else:
        count = max(math.ceil(len(share) / batch_size) for share in shares)
        short = [r for r in range(world_size) if math.ceil(len(shares[r]) / batch_size) < count]
        for j, r in enumerate(short):
            shares[r] = shares[r] + [rest[j % len(rest)]]
    mine = shares[rank]
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(count)]


def open_rest_of_epoch(loop: FitLoop, saved: dict[str, Any], start: int) -> tuple[Iterator[Any], int, int]:
    """The iterator over this process's part of the rest of the interrupted epoch, with the batch index it
    starts at and the index validation counts as done after (-1: none).

    On as many processes with another batch size or dataset length (`check_rest_of_epoch` marked `saved`), the
    rest is the epoch's own order from the sample the process had reached, batched at the new size; on another
    number of processes, `rest_of_epoch`. The epoch's batch index continues so that the epoch ends at its usual
    last index; a validation that ran right at the checkpoint still counts as done.
    """
    trainer, loader = loop.trainer, loop.train_loader
    if _FROM_SAMPLE in saved:
        epoch_start, epoch = loop.epoch_start_state, loop.state.epoch
        iterator, count = open_at_sample(loader, saved[_FROM_SAMPLE], epoch_start, saved["rng"], epoch)
    else:
        rest = rest_of_epoch(trainer, loader, saved, loop.epoch_start_state)
        iterator, count = open_batches(loader, rest, saved["rng"]), len(rest)
    first = int(loop.plan.num_batches) - count
    validated = first - 1 if loop.state.validated_after == start - 1 else -1
    return iterator, first, validated


#: The key `check_rest_of_epoch` adds to a process's checkpointed state: the sampler entry its epoch continues at.
_FROM_SAMPLE = "rest_from_sample"


def check_rest_of_epoch(trainer: Trainer, path: Any, saved: dict[str, Any]) -> None:
    """Before any step: whether a checkpoint saved in the middle of an epoch continues exactly on as many
    processes whose batch size or training dataset length changed since. Where it can (the epoch's order is
    the same, and reaches past the samples already consumed), `saved` is marked to continue that order at the
    sample; where it cannot, `CheckpointError` says why and what to do. Same settings: nothing changes (the
    resume skips whole batches, bitwise). Checkpoints from before ember recorded the batch size are not checked.
    """
    position = saved.get("position") or {}
    if trainer.progress.batch_idx == 0 or "batch_size" not in position or not same_layout(saved, trainer.strategy):
        return  # an epoch boundary, an older checkpoint, or another number of processes (`rest_of_epoch`)
    loader = trainer.train_dataloader
    if not isinstance(loader, DataLoader) or type(loader.batch_sampler) is not BatchSampler:
        return  # a custom batch sampler: ember skips its batches (it cannot tell what changed in it)
    if isinstance(loader.dataset, IterableDataset):
        return  # iterable data continues through its own state_dict
    sampler, batch_size, length = loader.sampler, loader.batch_size, _length(loader.dataset)
    kind, consumed = type(sampler).__qualname__, position["process_samples"]

    def refuse(reason: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path} was saved in the middle of epoch {position['epoch']} (after {position['batches']} "
            f"batches, {consumed} samples) and {reason}. Resume with the data settings it was saved with, or from a "
            "checkpoint saved at an epoch end (e.g. ModelCheckpoint(every_n_epochs=1))"
        )

    if kind != position["sampler"]:
        raise refuse(f"its samples came from a {position['sampler']}, this run's come from a {kind}")
    if batch_size == position["batch_size"] and length == position["dataset_size"]:
        return
    if not position["whole_epoch"] or trainer.epoch_plan.num_batches != len(loader):
        raise refuse("limit_train_batches cuts the epoch short, so its rest at another batch size is not defined")
    if length != position["dataset_size"]:
        if type(sampler) is not SequentialSampler:
            order = "shuffled order" if isinstance(sampler, RandomSampler) else f"order (from a {kind})"
            raise refuse(
                f"the epoch's {order} of {position['dataset_size']} samples cannot continue over this run's "
                f"training dataset of {length}: it orders another length differently"
            )
        if length < consumed:
            raise refuse(
                f"this run's training dataset has {length} samples, fewer than the {consumed} already trained on "
                "in this epoch"
            )
    saved[_FROM_SAMPLE] = consumed


def rest_of_epoch(
    trainer: Trainer, loader: Any, saved: dict[str, Any], epoch_start: dict[str, Any] | None
) -> list[list[int]]:
    """This process's batches for the rest of the interrupted epoch, on this run's number of processes.

    `saved` is the checkpoint's per-process state (its ``position``); raises `CheckpointError` when the
    rest cannot be rebuilt, naming the reason and what to do.
    """
    world_size, rank = data_world(trainer.strategy)
    position = saved.get("position")
    saved_world = int(saved.get("saved_world_size", 1))

    def refuse(reason: str) -> CheckpointError:
        batches = position["batches"] if position else trainer.progress.batch_idx
        return CheckpointError(
            f"checkpoint {trainer.ckpt_path} was saved in the middle of epoch {trainer.progress.epoch} (after "
            f"{batches} batches on each of {saved_world} process(es)); this run has {world_size}, and {reason}. "
            f"Resume it on {saved_world} process(es), or resume from a checkpoint saved at an epoch end "
            "(e.g. ModelCheckpoint(every_n_epochs=1))"
        )

    if position is None:
        raise refuse("the checkpoint holds no global data position (it was written by an older ember)")
    if position.get("order") is None:
        raise refuse(
            "ember cannot rebuild the order of that epoch: its training DataLoader has a custom sampler or batch "
            "sampler, an iterable dataset, or several processes each iterating the whole sampler "
            "(use_distributed_sampler=False)"
        )
    if not position.get("whole_epoch", False) or trainer.epoch_plan.num_batches != len(loader):
        raise refuse("limit_train_batches cuts the epoch short, so its rest is not defined on another world size")
    target = _splittable(loader, world_size)
    if target is not None:
        raise refuse(target)
    dataset_size = _length(loader.dataset)
    if dataset_size != position["dataset_size"]:
        raise refuse(f"the training dataset has {dataset_size} samples, the checkpointed run's had "
                     f"{position['dataset_size']}")  # fmt: skip
    if position["order"] == "distributed":
        order = distributed_order(
            dataset_size,
            position["world_size"],
            position["seed"],
            position["shuffle"],
            position["sampler_drop_last"],
            position["epoch"],
        )
        order = order[: min(dataset_size, len(order))]  # without the padding (seen twice already)
    else:
        order = _replay(loader, epoch_start)
    rest = order[position["samples"] :]
    if not rest:
        return []
    return split_rest(rest, world_size, rank, loader.batch_size, loader.drop_last)


def _splittable(loader: Any, world_size: int) -> str | None:
    """Why this run's loader cannot take the rest of an epoch (None: it can)."""
    if not isinstance(loader, DataLoader) or type(loader.batch_sampler) is not BatchSampler:
        return "this run's training DataLoader has a custom batch sampler"
    if isinstance(loader.dataset, IterableDataset):
        return "this run's training dataset is iterable"
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler) and sampler.num_replicas == world_size:
        return None
    if world_size > 1:
        return "this run's training DataLoader is not split across processes (a custom sampler, or " \
            "use_distributed_sampler=False)"  # fmt: skip
    if type(sampler) not in _REPLAYABLE:
        return "this run's training DataLoader has a custom sampler"
    return None


def data_world(strategy: Any) -> tuple[int, int]:
    """(data-parallel shards, this process's shard): the processes of a tensor-parallel group share one."""
    shard = strategy.distributed_sampler_kwargs
    return int(shard["num_replicas"]), int(shard["rank"])


def same_layout(saved: dict[str, Any] | None, strategy: Any) -> bool:
    """Whether a checkpoint's per-process data state fits this run: the same number of processes and of
    data-parallel shards, and (`check_rest_of_epoch`) the same batch size and dataset length in the middle of an
    epoch. Else the rest of an interrupted epoch is rebuilt (`open_rest_of_epoch`)."""
    if saved is None:
        return True
    if _FROM_SAMPLE in saved:  # as many processes, but another batch size or dataset length
        return False
    position = saved.get("position") or {}
    shards = data_world(strategy)[0]
    return saved.get("saved_world_size", 1) == strategy.world_size and position.get("world_size", shards) == shards


class _Indices(Dataset[int]):
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


def _replay(loader: Any, epoch_start: dict[str, Any] | None) -> list[int]:
    """The order one process's sampler gave the interrupted epoch, drawn again from the recorded states."""
    source = getattr(loader, "ember_source_sampler", None)
    if source is None or epoch_start is None:
        raise CheckpointError(
            "the checkpoint's epoch order came from one process's sampler, which this run's DataLoader does not "
            "hold; resume on one process, or from a checkpoint saved at an epoch end"
        )
    # The same draws as the checkpointed run's iterator: its worker base seed, then the sampler's.
    probe = DataLoader(_Indices(_length(loader.dataset)), batch_size=None, sampler=source, generator=loader.generator)
    restore_epoch_start(probe, epoch_start)
    return [int(index) for index in probe]


def _length(dataset: Any) -> int:
    return len(dataset)


def _consumed(samples: int, sampler: Any) -> int:
    """`samples`, capped at what `sampler` yields in an epoch (when it has a length)."""
    try:
        return min(samples, len(sampler))
    except TypeError:
        return samples


def batch_samples(loader: Any, epoch_start: dict[str, Any] | None, batches: list[int]) -> list[list[int]] | None:
    """The dataset indices of this process's batches at epoch positions `batches`, drawn again from the generator
    states of the epoch's start (`epoch_start`); None when the order cannot be rebuilt (an iterable dataset, a custom
    batch sampler, a sampler ember cannot replay). Redraws from the global and the loader's generators: call it only
    where they are put back afterwards (a rewind reopens the epoch from recorded states)."""
    if not isinstance(loader, DataLoader) or type(loader.batch_sampler) is not BatchSampler or epoch_start is None:
        return None
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        order = [int(index) for index in sampler]  # a function of its seed and epoch alone
    elif isinstance(getattr(loader, "ember_source_sampler", sampler), _REPLAYABLE):
        source = getattr(loader, "ember_source_sampler", sampler)
        indices = _Indices(_length(loader.dataset))
        probe = DataLoader(indices, batch_size=None, sampler=source, generator=loader.generator)
        restore_epoch_start(probe, epoch_start)
        order = [int(index) for index in probe]
    else:
        return None
    size = int(loader.batch_size or 1)
    return [order[b * size : (b + 1) * size] for b in batches]

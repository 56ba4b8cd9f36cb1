"""The data position of a checkpoint as samples consumed by all processes, and the rest of an interrupted
epoch on a different number of processes.

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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ember.checkpoint import CheckpointError
from ember.checkpoint.resume import open_batches, restore_epoch_start

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
    """The iterator over this process's part of the rest of the interrupted epoch (`rest_of_epoch`), with the
    batch index it starts at and the index validation counts as done after (-1: none).

    The epoch's batch index continues so that the epoch ends at its usual last index; a validation that
    ran right at the checkpoint still counts as done.
    """
    trainer, loader = loop.trainer, loop.train_loader
    rest = rest_of_epoch(trainer, loader, saved, loop.epoch_start_state)
    first = int(loop.plan.num_batches) - len(rest)
    validated = first - 1 if loop.state.validated_after == start - 1 else -1
    return open_batches(loader, rest, saved["rng"]), first, validated


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
    data-parallel shards (else the rest of an interrupted epoch is rebuilt from the global position)."""
    if saved is None:
        return True
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

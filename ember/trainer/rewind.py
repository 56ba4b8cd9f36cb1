"""Rewinding a fit: back to an in-memory snapshot of its training state, with batches left out from there on.

A rewind is a resume from an earlier state with some batches removed from the data. `Rewind` is what a
callback asks for (``trainer.rewind``, e.g. from `ember.callbacks.SpikeGuard`): the snapshot to go back to
(``trainer.snapshot()``: the checkpoint registry gathered into host memory) and how many optimizer steps' worth
of batches, counted from the snapshot's position, to leave out. The loop applies it at the next step boundary
(`FitLoop.apply_rewind`): the training entries of the snapshot are put back (`registry.restore_snapshot`), the
left-out batch positions join the fit's skip list (`FitState`, checkpointed, so a resumed run leaves them out
too), and the epoch is reopened from the snapshot's data position and random streams exactly as a resume
reopens it. Left-out batches are whole accumulation windows, dropped at the loader's sampler: they are never
loaded, and every random draw of the epoch is the one the uninterrupted run made.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.checkpoint.data_position import batch_samples

if TYPE_CHECKING:
    from ember.checkpoint.registry import Snapshot


class TooManyRewinds(RuntimeError):
    """A fit asked for more rewinds than its limit allows; the run stopped at its last good state."""


@dataclass
class Rewind:
    """A rewind a callback asked for: back to `snapshot`, leaving out the batches of `steps` optimizer steps from
    the snapshot's position on. With `stop` set, the fit then saves a resumable ``last`` and raises
    `TooManyRewinds` with that message (no batch is left out)."""

    snapshot: Snapshot
    steps: int
    stop: str | None = None
    #: Filled in when the loop applies it: the left-out (epoch, batch) positions and their dataset indices
    #: (None for a batch whose indices cannot be rebuilt, e.g. one in a later epoch).
    skipped: list[tuple[int, int]] = field(default_factory=list)
    samples: list[list[int] | None] = field(default_factory=list)
    #: Called once the rewind is applied (the callback's record of it).
    on_applied: Callable[[Rewind], None] | None = None


def snapshot_position(snapshot: Snapshot) -> tuple[int, int, int]:
    """(epoch, batch index, global step) of a snapshot."""
    progress = snapshot.meta["state"]["progress"]
    return int(progress["epoch"]), int(progress["batch_idx"]), int(progress["global_step"])


def epoch_start_of(snapshot: Snapshot) -> dict[str, Any] | None:
    """The generator states the snapshot's epoch draws its order from: recorded when the epoch opened, or, for a
    snapshot taken at the epoch's first batch before its iterator opened (the fit's start), the streams the snapshot
    holds, from which the reopened epoch draws it."""
    rank_state, (_, batch_idx, _) = snapshot.rank_state, snapshot_position(snapshot)
    if batch_idx == 0 and "loader_generators" in rank_state:
        return {"global": rank_state["rng"], "loader": rank_state["loader_generators"]}
    epoch_start: dict[str, Any] | None = rank_state.get("epoch_start")
    return epoch_start


def positions_to_skip(
    accumulate: int,
    length: Callable[[int], float],
    epoch: int,
    batch_idx: int,
    steps: int,
    skipped: Callable[[int], frozenset[int]],
) -> list[tuple[int, int]]:
    """The (epoch, batch) positions of the next `steps` accumulation windows (of `accumulate` batches; an epoch's
    last ends one) from `batch_idx` of `epoch` on, past the positions already `skipped` (a function of the epoch).
    `length(epoch)`: the epoch's number of batches; inf for data of unknown length whose epoch has not ended, which
    counts as one long epoch."""
    found: list[tuple[int, int]] = []
    windows = 0
    while windows < steps:
        size = length(epoch)
        if batch_idx >= size:
            epoch, batch_idx = epoch + 1, 0
            continue
        if batch_idx not in skipped(epoch):
            found.append((epoch, batch_idx))
            windows += (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == size
        batch_idx += 1
    return found


def samples_of(
    loader: Any, epoch_start: dict[str, Any] | None, epoch: int, positions: list[tuple[int, int]]
) -> list[list[int] | None]:
    """The dataset indices of the left-out `positions` that lie in `epoch` (whose start `epoch_start` recorded);
    None for the others, and for all when the order cannot be rebuilt."""
    here = [b for e, b in positions if e == epoch]
    found = batch_samples(loader, epoch_start, here) if here else None
    by_position = dict(zip(here, found, strict=True)) if found is not None else {}
    return [by_position.get(b) if e == epoch else None for e, b in positions]


def kept_batches(
    iterator: Iterator[Any], start: int, count: float, drop: frozenset[int], dropped: bool
) -> Iterator[tuple[int, Any]]:
    """``(batch_idx, batch)`` from `start` up to `count`, without the positions in `drop`: `iterator` already leaves
    them out (`dropped`, at the sampler) or yields them and they are discarded here (iterable data)."""
    end = math.inf if math.isinf(count) else int(count)
    indices = (i for i in (itertools.count(start) if end == math.inf else range(start, int(end))) if i not in drop)
    if dropped:
        return zip(indices, iterator)  # noqa: B905 (the indices end first: no batch is fetched past them)
    indexed: Iterator[tuple[int, Any]] = enumerate(iterator, start)
    if end != math.inf:
        indexed = itertools.islice(indexed, max(int(end) - start, 0))
    return ((i, batch) for i, batch in indexed if i not in drop)

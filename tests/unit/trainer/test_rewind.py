"""The pieces of a rewind (ember/trainer/rewind.py): which positions a rewind leaves out, how an epoch's batches
go without them, and the skip list in the fit's checkpointed state."""

from __future__ import annotations

import math

from ember.trainer.loop import FitState
from ember.trainer.rewind import kept_batches, positions_to_skip


def test_positions_to_skip_are_whole_windows_past_those_already_skipped_and_cross_epochs() -> None:
    ten = lambda epoch: 10  # noqa: E731  (windows of 3: [0-2] [3-5] [6-8] [9])
    nothing = lambda epoch: frozenset()  # noqa: E731
    assert positions_to_skip(3, ten, 0, 3, 2, nothing) == [(0, b) for b in range(3, 9)]
    assert positions_to_skip(3, ten, 0, 6, 3, nothing) == [(0, 6), (0, 7), (0, 8), (0, 9), (1, 0), (1, 1), (1, 2)]
    already = lambda epoch: frozenset({3, 4, 5}) if epoch == 0 else frozenset()  # noqa: E731
    assert positions_to_skip(3, ten, 0, 0, 2, already) == [(0, 0), (0, 1), (0, 2), (0, 6), (0, 7), (0, 8)]


def test_positions_to_skip_cross_the_end_of_an_epoch_of_unknown_length_where_it_ended() -> None:
    """Data of unknown length: an epoch that ended has the length it ended at (here 7: windows of 3 [0-2] [3-5]
    [6]); the epoch still running counts as one long epoch."""
    ended = lambda epoch: 7 if epoch == 0 else math.inf  # noqa: E731
    nothing = lambda epoch: frozenset()  # noqa: E731
    assert positions_to_skip(3, ended, 0, 3, 3, nothing) == [(0, 3), (0, 4), (0, 5), (0, 6), (1, 0), (1, 1), (1, 2)]
    assert positions_to_skip(1, ended, 0, 5, 4, nothing) == [(0, 5), (0, 6), (1, 0), (1, 1)]
    assert positions_to_skip(1, ended, 1, 5, 4, nothing) == [(1, 5), (1, 6), (1, 7), (1, 8)]


def test_kept_batches_numbers_batches_by_their_epoch_position() -> None:
    drop = frozenset({1, 2, 5})
    # dropped at the sampler: the iterator yields only the kept batches
    assert list(kept_batches(iter("acdfg"), 0, 7, drop, dropped=True)) == [(0, "a"), (3, "c"), (4, "d"), (6, "f")]
    # iterable data: every batch is read, the left-out ones are discarded
    assert list(kept_batches(iter("abcdefg"), 0, 7, drop, dropped=False)) == [(0, "a"), (3, "d"), (4, "e"), (6, "g")]
    assert list(kept_batches(iter("defg"), 3, math.inf, drop, dropped=False)) == [(3, "d"), (4, "e"), (6, "g")]


def test_the_skip_list_is_checkpointed_and_older_checkpoints_have_none() -> None:
    state = FitState(epoch=1, global_step=7, batch_idx=3)
    state.skip_batches([(1, 4), (0, 2), (1, 5)])
    saved = state.state_dict()
    assert saved["skipped_batches"] == [[0, 2], [1, 4], [1, 5]]
    restored = FitState()
    restored.load_state_dict(saved)
    assert restored.skipped_in(1) == frozenset({4, 5}) and restored.skipped_in(0) == frozenset({2})
    older = {k: v for k, v in saved.items() if k != "skipped_batches"}
    restored.load_state_dict(older)
    assert restored.skipped == {} and restored.global_step == 7

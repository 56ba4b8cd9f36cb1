"""The pieces of a rewind (ember/trainer/rewind.py): which positions a rewind leaves out, how an epoch's batches
go without them, and the skip list in the fit's checkpointed state."""

from __future__ import annotations

import math

from ember.trainer.data import EpochPlan
from ember.trainer.loop import FitState
from ember.trainer.rewind import kept_batches, positions_to_skip


def test_positions_to_skip_are_whole_windows_past_those_already_skipped_and_cross_epochs() -> None:
    plan = EpochPlan.build(10, 3, 1.0)  # windows [0-2] [3-5] [6-8] [9]
    nothing = lambda epoch: frozenset()  # noqa: E731
    assert positions_to_skip(plan, 0, 3, 2, nothing) == [(0, b) for b in range(3, 9)]
    assert positions_to_skip(plan, 0, 6, 3, nothing) == [(0, 6), (0, 7), (0, 8), (0, 9), (1, 0), (1, 1), (1, 2)]
    already = lambda epoch: frozenset({3, 4, 5}) if epoch == 0 else frozenset()  # noqa: E731
    assert positions_to_skip(plan, 0, 0, 2, already) == [(0, 0), (0, 1), (0, 2), (0, 6), (0, 7), (0, 8)]


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

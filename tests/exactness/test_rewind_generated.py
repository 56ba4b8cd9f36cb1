"""The rewind oracle: a fit that rewinds ends bitwise equal to a resume from the same snapshot with exactly the
left-out batches' samples removed from the data (docs/rewind.md).

Generated over the snapshot's step (``snapshot_every_n_steps``, ``check_every_n_steps``), the poisoned batch (so
the spike's step), ``skip_after`` and gradient accumulation; the model has dropout (random streams) and momentum
(optimizer state), the data is shuffled. The reference trains the same loader with the left-out batches removed
(`rewind_workload.Without`) up to the snapshot's step, saves a checkpoint, and resumes from it in a new trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from exact_strategies import examples, record
from hypothesis import example, given, settings
from hypothesis import strategies as st
from rewind_workload import PoisonData, Regressor, batch_ids, loader, params

import ember
from ember.callbacks import SpikeGuard

N_BATCHES, BATCH = 24, 4
QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, max_epochs=1
)


def module() -> Regressor:
    return Regressor(lr=0.02, momentum=0.9, dropout=0.1)


@settings(max_examples=examples(2), deadline=None)
# the rewind leaves out the whole epoch: the only snapshot is the fit's start (the first check is in the warm-up)
@example(check_every=3, snapshots_per_check=1, poisoned_late=0, skip_after=2, accumulate=3)
@given(
    check_every=st.integers(1, 3),
    snapshots_per_check=st.integers(1, 2),
    poisoned_late=st.integers(0, 6),
    skip_after=st.integers(0, 2),
    accumulate=st.integers(1, 3),
)
def test_rewind_equals_resume_without_the_skipped_samples(
    tmp_path_factory: Any,
    check_every: int,
    snapshots_per_check: int,
    poisoned_late: int,
    skip_after: int,
    accumulate: int,
) -> None:
    # after the warm-up (2 steps) and its first check: a spike by `factor` needs a median to compare with
    poisoned = min((2 + check_every) * accumulate + poisoned_late, N_BATCHES - 1)
    record("rewind", check_every, snapshots_per_check, poisoned, skip_after, accumulate)
    root: Path = tmp_path_factory.mktemp("rewind")
    n = N_BATCHES * BATCH
    data = PoisonData(n, frozenset(batch_ids(n, BATCH)[poisoned]))
    guard = SpikeGuard(
        factor=50.0,
        window=4,
        warmup_steps=2,
        check_every_n_steps=check_every,
        snapshot_every_n_steps=check_every * snapshots_per_check,
        skip_after=skip_after,
    )
    options = dict(QUIET, accumulate_grad_batches=accumulate, default_root_dir=str(root))
    rewound = module()
    ember.seed_everything(3)
    ember.Trainer(callbacks=[guard], **options).fit(rewound, loader(data, BATCH))

    assert len(guard.rewinds) == 1, guard.rewinds
    rewind = guard.rewinds[0]
    skipped = {b for epoch, b in rewind["skipped_batches"] if epoch == 0}  # the fit has one epoch
    assert poisoned in skipped
    assert len(skipped) % accumulate == 0 or max(skipped) == N_BATCHES - 1  # whole accumulation windows

    drop = {0: skipped}
    reference = module()
    ember.seed_everything(3)
    snapshot_step = rewind["restored_step"]
    # the optimizer steps of the data left: none when the rewind left out every batch (a spike whose only snapshot
    # is the fit's start, with the windows after it, can cover the whole epoch; the fit then ends as it began)
    remains = snapshot_step < -(-(N_BATCHES - len(skipped)) // accumulate)
    resume_from = None
    if snapshot_step > 0:  # the snapshot's state, written to disk by a run stopped there (`last`)
        head = ember.Trainer(max_steps=snapshot_step, **{**options, "enable_checkpointing": True})
        head.fit(reference, loader(data, BATCH, drop))
        resume_from = "last"
    if remains:
        reference = module()
        ember.seed_everything(3)
        tail = ember.Trainer(**{**options, "enable_checkpointing": resume_from is not None})
        tail.fit(reference, loader(data, BATCH, drop), ckpt_path=resume_from)

    for ours, theirs in zip(params(rewound), params(reference), strict=True):
        assert torch.isfinite(ours).all()
        assert torch.equal(ours, theirs)

"""Every failure the generated tests found, kept as an explicit case: the minimal configuration hypothesis
printed, less the options that turned out not to matter (``manual=True`` in the first two: it fails without).

The list, with the cause and the fix of each, is in docs/trainer.md ("Exactness").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from exact_checks import check_ddp, check_parity, check_resume
from exact_workload import Config

PARITY = {
    # 640 / 32 in the issue; the last batch ends before RandomSampler's final randperm (loop.finish_epoch).
    # As printed by the suite with that fix taken out: a shuffled loader with its own generator, 2 epochs.
    "multiple_of_batch_size_shuffled": Config(n=3, batch_size=1),
}

RESUME = {
    # persistent workers: after its first epoch the iterator is only reset (no new base seed); a resumed
    # epoch >= 1 used to draw one from the global RNG (resume.open_positioned rewinds it)
    "persistent_workers_epoch_boundary": (
        Config(
            n=1,
            batch_size=1,
            sampler="sequential",
            generator=False,
            num_workers=2,
            persistent_workers=True,
            manual=True,
        ),
        1,
    ),
    # ... and the dataset's set_epoch never reaches persistent workers (each holds epoch 0's copy); a resumed
    # epoch >= 1 made its workers after set_epoch(1) (open_positioned makes them from set_epoch(0)'s state)
    "persistent_workers_per_sample_augmentation": (
        Config(
            n=1,
            batch_size=1,
            sampler="sequential",
            generator=False,
            num_workers=2,
            persistent_workers=True,
            augment="per_sample",
            manual=True,
        ),
        1,
    ),
    # ... with a batch sampler that has its own generator: undoing that draw looked for the generators while
    # the batch sampler was replaced by its stand-in, found none and refused to resume
    "persistent_workers_batch_sampler_generator": (
        Config(
            n=10,
            batch_size=5,
            sampler="batch_sampler",
            num_workers=2,
            persistent_workers=True,
            limit_train_batches=1,  # printed without it: the suite's repr took the count 1 for the default 1.0
        ),
        1,
    ),
    # an iterable dataset keeps its own position, and an epoch cut by limit_train_batches leaves it inside its
    # stream; a resume at the next epoch boundary started it from the beginning (printed without the limit,
    # whose count 1 the suite's repr took for the default fraction 1.0)
    "iterable_limited_epoch_boundary": (
        Config(n=2, batch_size=1, sampler="iterable", generator=False, limit_train_batches=1, manual=True),
        1,
    ),
    # an iterable dataset whose stream ended inside the epoch's last, partial batch: its state_dict read 0, as
    # before its first item, so the resume re-read the stream (fixed in the dataset: it starts over in
    # set_epoch, not when it ends; docs/trainer.md, "Data")
    "iterable_ended_inside_last_batch": (Config(n=2, batch_size=3, sampler="iterable", generator=False), 1),
    # (not ember: the suite's stop callback) a loader without a length steps its last, partial window after
    # its last batch, so a stop at that boundary must be asked for at the epoch end, not after a batch
    "iterable_partial_window_epoch_end": (
        Config(n=2, batch_size=2, sampler="iterable", generator=False, accumulate=2),
        1,
    ),
}


DDP = {
    # the loss grew to 8.84, where 1e-6 is about one fp32 ulp: the tolerance is relative above 1
    "tolerance_relative_above_one": Config(n=18, batch_size=1, sampler="sequential", generator=False),
}


@pytest.mark.parametrize("name", list(PARITY))
def test_parity_regression(name: str, tmp_path: Path) -> None:
    check_parity(PARITY[name], tmp_path)


@pytest.mark.parametrize("name", list(RESUME))
def test_resume_regression(name: str, tmp_path: Path) -> None:
    cfg, stop_at = RESUME[name]
    check_resume(cfg, stop_at, tmp_path)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(DDP))
def test_ddp_regression(name: str, tmp_path: Path) -> None:
    check_ddp(DDP[name], tmp_path)

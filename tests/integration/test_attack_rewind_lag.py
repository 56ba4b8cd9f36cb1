"""Attacks on docs/rewind.md's promise about SpikeGuard's check interval (its lag): what a check finds does not
depend on how many steps it holds, so the rewind goes back to the same snapshot and leaves out the same batches
whatever the lag; the lag only adds the steps between the spike and its check to those trained again (and moves
where a fit stopped between the two ends).

Fits that differ only in ``check_every_n_steps`` (``snapshot_every_n_steps`` a common multiple) are compared: their
rewind records and final parameters, with accumulation, several epochs, an epoch length that is not a multiple of
the interval, ``max_steps``, ``skip_after``, two spikes, data of unknown length, spikes in the warm-up. The cases
written out below are what broke an earlier version of the detector: each is a test of the fix.
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exactness"))
from rewind_workload import PoisonData, Regressor, ResumableStream, batch_ids, loader, params

import ember
from ember.callbacks import SpikeGuard
from ember.callbacks.callback import Callback
from ember.trainer.rewind import TooManyRewinds

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, max_epochs=1
)
KEYS = ("spike_step", "restored_step", "skipped_batches", "skipped_samples")
BATCH = 4


class Precondition(Exception):
    """The setup of a case did not come out as planned (the fit does not make the situation the test is about)."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise Precondition(message)


def nan_data(n: int, samples: list[int]) -> PoisonData:
    """`PoisonData` whose `samples` have NaN inputs: a batch holding one has a NaN loss, a spike under any median."""
    data = PoisonData(n)
    data.x[sorted(samples)] = math.nan
    return data


def guard(every: int, **options: Any) -> SpikeGuard:
    return SpikeGuard(**{"factor": 50, "window": 4, "warmup_steps": 2, "check_every_n_steps": every, **options})


def fit(
    root: Path, data: Any, spike_guard: SpikeGuard, *callbacks: Any, module: Regressor | None = None, **options: Any
) -> tuple[ember.Trainer, Regressor]:
    module = Regressor(lr=0.02) if module is None else module
    trainer = ember.Trainer(default_root_dir=str(root), callbacks=[spike_guard, *callbacks], **{**QUIET, **options})
    trainer.fit(module, data)
    return trainer, module


def records(spike_guard: SpikeGuard) -> list[dict[str, Any]]:
    return [{k: r[k] for k in KEYS} for r in spike_guard.rewinds]


def same_params(a: Regressor, b: Regressor) -> bool:
    return all(torch.equal(x, y) for x, y in zip(params(a), params(b), strict=True))


class LearningRates(Callback):
    """The learning rate each step trained with (a step trained again after a rewind: its last value)."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.lrs[trainer.global_step + 1] = trainer.optimizers[0].param_groups[0]["lr"]


# --- generated -----------------------------------------------------------------------------------------------
def restored_step(spike: int, warmup: int, snapshot_every: int, accumulate: int) -> int:
    """The snapshot a first spike at step `spike` goes back to: the fit's start, or the last multiple of
    `snapshot_every` before it whose loss was judged (losses before it, ``warmup_steps`` steps before its own)."""
    judged = [m for m in range(snapshot_every, spike, snapshot_every) if m - 1 >= warmup and (m >= 2 or accumulate > 1)]
    return judged[-1] if judged else 0


@st.composite
def configurations(draw: st.DrawFn) -> dict[str, Any]:
    every = draw(st.sampled_from([2, 4, 8]))
    snapshot_every = every * draw(st.sampled_from([1, 2]))
    warmup = draw(st.integers(0, 8))
    accumulate = draw(st.sampled_from([1, 2, 3]))
    n_batches = draw(st.integers(4, 40))
    stream, skip_after = draw(st.booleans()), draw(st.integers(0, 2))
    # Data of unknown length: a rewind before the epoch's end cannot know where the epoch ends, so the batches it
    # leaves out must lie in it (docs/rewind.md, "Limits").
    last = n_batches - 1 - ((skip_after + 1) * accumulate if stream else 0)
    assume(last >= 0)
    poisoned = sorted(draw(st.sets(st.integers(0, last), min_size=1, max_size=2)))
    epochs = draw(st.integers(1, 3))
    steps_per_epoch = math.ceil(n_batches / accumulate)
    return dict(
        every=every,
        snapshot_every=snapshot_every,
        warmup=warmup,
        accumulate=accumulate,
        n_batches=n_batches,
        poisoned=poisoned,
        epochs=epochs,
        stream=stream,
        skip_after=skip_after,
        max_steps=draw(st.none() | st.integers(poisoned[0] // accumulate, steps_per_epoch * epochs)),
    )


def lagged_fit(root: Path, config: dict[str, Any], every: int) -> tuple[list[dict[str, Any]], Regressor, int, bool]:
    n = config["n_batches"] * BATCH
    if config["stream"]:  # unknown length, not shuffled: the poisoned position is the same in every epoch
        data: Any = DataLoader(ResumableStream(nan_data(n, [BATCH * p for p in config["poisoned"]])), batch_size=BATCH)
    else:  # shuffled: the poisoned samples move between epochs
        ids = batch_ids(n, BATCH)
        data = loader(nan_data(n, [ids[p][0] for p in config["poisoned"]]), BATCH)
    spike_guard = guard(
        every,
        warmup_steps=config["warmup"],
        snapshot_every_n_steps=config["snapshot_every"],
        skip_after=config["skip_after"],
        max_rewinds=50,
    )
    options: dict[str, Any] = dict(max_epochs=config["epochs"], accumulate_grad_batches=config["accumulate"])
    if config["max_steps"] is not None:
        options["max_steps"] = config["max_steps"]
    module = Regressor(lr=0.02)
    stopped = False
    try:
        trainer, _ = fit(root, data, spike_guard, module=module, **options)
        step = trainer.global_step
    except TooManyRewinds:
        stopped, step = True, -1
    return records(spike_guard), module, step, stopped


@given(config=configurations())
@settings(max_examples=8, deadline=None, database=None)  # a fit takes 0.1-1 s
def test_a_non_finite_spike_is_rewound_alike_whatever_the_lag(
    config: dict[str, Any],
) -> None:
    """Generated: interval (2-8) and its half against checks at every step, snapshots at 1 or 2 intervals, warm-up
    0-8, accumulation 1-3, 1-3 epochs of a length that need not be a multiple of anything, map-style (shuffled) or
    unknown-length data, skip_after 0-2, an optional max_steps, one or two NaN-poisoned batches anywhere (in the
    warm-up too). Same records, same end, bitwise the same parameters."""
    every = config["every"]
    spike = config["poisoned"][0] // config["accumulate"] + 1
    with tempfile.TemporaryDirectory() as root:
        runs = {e: lagged_fit(Path(root) / str(e), config, e) for e in sorted({1, every // 2, every})}
    rewinds, module, step, stopped = runs[1]
    if config["max_steps"] is not None and config["max_steps"] < spike:
        assert rewinds == []
    else:
        assert rewinds[0]["spike_step"] == spike
        expected = restored_step(spike, config["warmup"], config["snapshot_every"], config["accumulate"])
        assert rewinds[0]["restored_step"] == expected
    for e, (lagged, lagged_module, lagged_step, lagged_stopped) in runs.items():
        assert lagged == rewinds, e
        assert (lagged_step, lagged_stopped) == (step, stopped), e
        assert same_params(lagged_module, module), e


# Two generated cases, written out: the config, then each rewind's (spike step, restored step, first and last
# left-out position) and the step the fit ends at.
PINNED = [
    pytest.param(  # 3 batches a step, 50 batches (17 steps, the last of 2 batches) an epoch: checks every 4 (2, 1)
        dict(every=4, accumulate=3, n_batches=50, epochs=2, poisoned=[27, 40]),  # and at 17 and 34, epochs' ends
        [(10, 8, [0, 24], [0, 32]), (11, 8, [0, 33], [0, 44]), (13, 12, [1, 6], [1, 11]), (20, 16, [1, 24], [1, 38])],
        20,
        id="accumulate 3, 2 epochs of 50 batches",
    ),
    pytest.param(  # 25 batches an epoch, checks every 8 (4, 1) and at each epoch's end; 6 rewinds over 3 epochs
        dict(every=8, accumulate=1, n_batches=25, epochs=3, poisoned=[17, 21]),
        [
            (18, 16, [0, 16], [0, 18]),
            (19, 16, [0, 19], [0, 22]),
            (29, 24, [1, 6], [1, 11]),
            (25, 24, [1, 12], [1, 13]),
            (42, 40, [2, 5], [2, 7]),
            (51, 48, [2, 16], [2, 19]),
        ],
        53,
        id="3 epochs of 25 batches",
    ),
]


@pytest.mark.parametrize(("case", "expected", "end"), PINNED)
def test_pinned_fits_rewind_alike_whatever_the_lag(
    tmp_path: Path, case: dict[str, Any], expected: list[tuple[int, int, list[int], list[int]]], end: int
) -> None:
    """Every lag gives these records, ends at the same step, with bitwise the same parameters (warm-up 2, a
    snapshot at every check of the longest interval, skip_after 1, NaN poison)."""
    every = case["every"]
    config = {**case, "snapshot_every": every, "warmup": 2, "stream": False, "skip_after": 1, "max_steps": None}
    runs = {e: lagged_fit(tmp_path / str(e), config, e) for e in (1, every // 2, every)}
    rewinds, module, step, stopped = runs[1]
    got = [(r["spike_step"], r["restored_step"], r["skipped_batches"][0], r["skipped_batches"][-1]) for r in rewinds]
    assert got == expected
    assert (step, stopped) == (end, False)
    for e, (lagged, lagged_module, lagged_step, _) in runs.items():
        assert lagged == rewinds, e
        assert lagged_step == step, e
        assert same_params(lagged_module, module), e


# --- what broke an earlier detector, each a test of its fix ----------------------------------------------------
@pytest.mark.parametrize(
    ("warmup", "snapshot_every", "lags", "poisoned"),
    [(6, 8, (1, 4), 13), (0, 2, (1, 2), 2)],
    ids=["warmup 6, spike at step 14", "warmup 0, spike at step 3"],
)
def test_in_the_warm_up_the_lag_does_not_move_the_rewind(
    tmp_path: Path, warmup: int, snapshot_every: int, lags: tuple[int, int], poisoned: int
) -> None:
    """A snapshot is taken once its step's loss was judged, not once a check was: with checks judged as a whole,
    the longer interval's first judged check came later (warmup_steps=6, snapshot every 8, intervals 1 and 4: no
    snapshot at 8 under 4, a spike at step 14 went back to 0; warmup_steps=0, snapshot every 2, intervals 1 and 2:
    a spike at step 3 went back to 0 instead of 2)."""
    n = 40 * BATCH
    data = nan_data(n, [batch_ids(n, BATCH)[poisoned][0]])
    runs = {}
    for every in lags:
        spike_guard = guard(every, warmup_steps=warmup, snapshot_every_n_steps=snapshot_every)
        runs[every] = (spike_guard, fit(tmp_path / str(every), loader(data, BATCH), spike_guard)[1])
    spike = poisoned + 1
    require(spike > warmup + max(lags), "the spike comes after warmup_steps + check_every_n_steps")
    (short, short_module), (long, long_module) = runs[lags[0]], runs[lags[1]]
    require([r["spike_step"] for r in short.rewinds] == [spike], f"one rewind, of step {spike}")
    assert records(long) == records(short)
    assert short.rewinds[0]["restored_step"] == snapshot_every * ((spike - 1) // snapshot_every)
    assert same_params(long_module, short_module)


class Bumped(Regressor):
    """Reports the loss of the batch at `position` of epoch 0 `bump` times higher (its gradient unchanged): a loss
    placed between two medians, no damage done."""

    def __init__(self, position: int, bump: float) -> None:
        super().__init__(lr=0.02)
        self.position, self.bump = position, bump

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.current_epoch == 0 and batch_idx == self.position:
            return loss + (self.bump - 1) * loss.detach()
        return loss


def test_a_loss_between_the_two_medians_is_judged_alike_whatever_the_lag(tmp_path: Path) -> None:
    """A loss compared with the median of the losses checked before its check (not before it) was a spike under one
    interval and not the other: intervals 1 and 8 differed in whether they rewound at all. Each loss is now judged
    against the `window` losses before it, whatever the check holds."""
    n, window, factor, snapshot_every = 40 * BATCH, 4, 50.0, 8
    clean = Regressor(lr=0.02)
    clean.record_losses = True
    ember.Trainer(default_root_dir=str(tmp_path / "clean"), **QUIET).fit(clean, loader(PoisonData(n), BATCH))
    losses = clean.losses  # batch k's loss is step k+1's

    def medians(k: int) -> tuple[float, float]:  # the median batch k is judged against, at intervals 1 and 8
        last_check = 8 * (k // 8)  # the 8-run's last check before step k+1 (its history: steps up to it)
        return statistics.median(losses[k - window : k]), statistics.median(losses[last_check - window : last_check])

    candidates = [k for k in range(24, 39) if k % 8]  # past both runs' snapshot at 16; not a check group's first
    position = max(candidates, key=lambda k: abs(math.log(medians(k)[1] / medians(k)[0])))
    rolling, at_check = medians(position)
    require(max(rolling, at_check) > 1.5 * min(rolling, at_check), f"medians apart: {rolling}, {at_check}")
    bump = factor * math.sqrt(rolling * at_check) / losses[position]  # the loss lands between the two limits
    runs = {}
    for every in (1, 8):
        spike_guard = guard(every, factor=factor, window=window, snapshot_every_n_steps=snapshot_every)
        module = Bumped(position, bump)
        fit(tmp_path / str(every), loader(PoisonData(n), BATCH), spike_guard, module=module)
        runs[every] = (spike_guard, module)
    flagged = {every: [r["spike_step"] for r in g.rewinds] for every, (g, _) in runs.items()}
    bumped = losses[position] * bump
    require(min(rolling, at_check) * factor < bumped < max(rolling, at_check) * factor, "between the two limits")
    assert flagged[1] == flagged[8] == ([position + 1] if bumped > factor * rolling else [])
    assert records(runs[8][0]) == records(runs[1][0])
    assert same_params(runs[8][1], runs[1][1])


@pytest.mark.parametrize(
    ("poisoned", "scale_steps"),
    [([19, 22], 6), ([19, 29], 12), ([19, 27], 12)],
    ids=["interval 1 wrong", "interval 8 wrong", "both wrong alike"],
)
def test_after_a_second_rewind_the_scale_lasts_its_steps_whatever_the_lag(
    tmp_path: Path, poisoned: list[int], scale_steps: int
) -> None:
    """Poison in batches 19 (step 20: back to 16, batches 16-19 left out) and one more, met after the first
    rewind while its scale (0.5 x 0.02) is in force. After the last rewind the rate is 0.01 for `scale_steps`
    steps, then 0.02, in both runs. Whether the restored rates carried a scale was read at the rewind, not from the
    snapshot: the scale was undone and later ended again (0.04 for good), or applied twice (0.005)."""
    n = 40 * BATCH
    ids = batch_ids(n, BATCH)
    data = PoisonData(n, frozenset(i for p in poisoned for i in ids[p]))
    runs = {}
    for every in (1, 8):
        spike_guard = guard(every, snapshot_every_n_steps=8, lr_scale=0.5, lr_scale_steps=scale_steps)
        lrs = LearningRates()
        _, module = fit(tmp_path / str(every), loader(data, BATCH), spike_guard, lrs)
        runs[every] = (spike_guard, lrs.lrs, module)
    for every, (spike_guard, lrs, _) in runs.items():
        require(len(spike_guard.rewinds) == 2, f"two rewinds at interval {every}")
        restored = spike_guard.rewinds[-1]["restored_step"]
        after = [lrs[s] for s in sorted(lrs) if s > restored]
        scaled = min(scale_steps, len(after))
        assert after == [0.01] * scaled + [0.02] * (len(after) - scaled), every
    assert same_params(runs[8][2], runs[1][2])


class PoisonedAt(Regressor):
    """NaN inputs at the given (epoch, batch index) positions: a spike that is not in every epoch's same batch."""

    def __init__(self, positions: set[tuple[int, int]]) -> None:
        super().__init__(lr=0.02)
        self.positions = positions

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if (self.trainer.current_epoch, batch_idx) in self.positions:
            x = x * math.nan
        return super().training_step((x, y), batch_idx)


@pytest.mark.parametrize("every", [1, 4])
def test_unknown_length_a_spike_early_in_an_epoch_is_left_out_when_the_snapshot_is_in_the_one_before(
    tmp_path: Path, every: int
) -> None:
    """10 batches an epoch, snapshots every 4 steps (8: epoch 0's batch 8), a NaN in epoch 1's batch 1 (step 12).
    Data of unknown length counted as one long epoch: the rewind left out (0, 10) and (0, 11), past epoch 0's end,
    and the spike was trained again at every rewind until TooManyRewinds."""
    spike_guard = guard(every, snapshot_every_n_steps=4)
    data = DataLoader(ResumableStream(PoisonData(10 * BATCH)), batch_size=BATCH)
    trainer, _ = fit(tmp_path, data, spike_guard, module=PoisonedAt({(1, 1)}), max_epochs=2)
    first = spike_guard.rewinds[0]
    assert (first["spike_step"], first["restored_step"]) == (12, 8)
    assert first["skipped_batches"] == [[0, 8], [0, 9], [1, 0], [1, 1]]
    assert len(spike_guard.rewinds) == 1
    assert trainer.global_step == 16  # 8, then epoch 1's 8 batches after the 2 left out (epoch 0's last 2 too)


class StopOnceAt(Callback):
    """Asks the fit to stop the first time it reaches `step` (as an early-stopping callback would, once)."""

    def __init__(self, step: int) -> None:
        self.step, self.asked = step, False

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.asked and trainer.global_step == self.step:
            trainer.should_stop, self.asked = True, True


def test_a_stop_between_the_spike_and_its_check_comes_after_the_rewind(tmp_path: Path) -> None:
    """docs/rewind.md: a stop asked for between a spike (step 20) and its check (24 at interval 8) is where the
    lag shows beyond the steps trained again. The rewind is the same; interval 1 rewinds at 20 and trains on to
    the stop at 22; interval 8 meets the stop at 22, checks there (``on_train_stop``), goes back to 16 and stops at
    the next step boundary, 17."""
    n = 40 * BATCH
    data = PoisonData(n, frozenset(batch_ids(n, BATCH)[19]))
    runs = {}
    for every in (1, 8):
        spike_guard = guard(every, snapshot_every_n_steps=8)
        runs[every] = (spike_guard, *fit(tmp_path / str(every), loader(data, BATCH), spike_guard, StopOnceAt(22)))
    (short, short_trainer, _), (long, long_trainer, _) = runs[1], runs[8]
    assert records(long) == records(short)
    assert [(r["spike_step"], r["restored_step"]) for r in short.rewinds] == [(20, 16)]
    assert (short_trainer.global_step, long_trainer.global_step) == (22, 17)

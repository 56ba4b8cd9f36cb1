"""SpikeGuard on real fits: planted poison batches, the record of each rewind, the skip list across a resume, the
rewind limit, the learning-rate scale, mixed precision, and no host sync outside its checks (docs/rewind.md)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exactness"))
from rewind_workload import PoisonData, Regressor, batch_ids, loader, params, val_loss

import ember
from ember.callbacks import SpikeGuard
from ember.loggers import CSVLogger
from ember.trainer.rewind import TooManyRewinds

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, max_epochs=1
)


def fit(root: Path, data: PoisonData, batch: int, *callbacks: Any, lr: float = 0.1, **options: Any) -> Regressor:
    module = Regressor(lr=lr)
    trainer = ember.Trainer(default_root_dir=str(root), callbacks=list(callbacks), **{**QUIET, **options})
    trainer.fit(module, loader(data, batch))
    return module


# --- must show 2: planted poison ------------------------------------------------------------------------------
N, BATCH, PLANTED = 4096, 16, (60, 150)  # one pass over 256 batches; poison (inputs x 1e4) in two of them


def test_planted_poison_spikes_without_the_guard_and_trains_like_the_clean_run_with_it(tmp_path: Path) -> None:
    ids = batch_ids(N, BATCH)
    planted = frozenset(i for p in PLANTED for i in ids[p])
    held_out = PoisonData(1024, seed=1)
    clean = val_loss(fit(tmp_path / "clean", PoisonData(N), BATCH), held_out)
    unguarded = val_loss(fit(tmp_path / "unguarded", PoisonData(N, planted), BATCH), held_out)
    guard = SpikeGuard(factor=10, window=16, check_every_n_steps=4, snapshot_every_n_steps=4, skip_after=1)
    logger = CSVLogger(tmp_path / "guarded")
    guarded_module = fit(tmp_path / "guarded", PoisonData(N, planted), BATCH, guard, logger=logger)
    guarded = val_loss(guarded_module, held_out)

    assert unguarded > 1000 * clean  # inf: the poison blows the run up
    assert abs(guarded - clean) <= 0.01 * clean, (guarded, clean)
    assert len(guard.rewinds) == len(PLANTED)
    for rewind, poisoned in zip(guard.rewinds, PLANTED, strict=True):
        positions = [b for _, b in rewind["skipped_batches"]]
        # the documented margin: the batches since the snapshot (at most check_every - 1) and skip_after more
        assert positions == list(range(positions[0], poisoned + 2))
        assert poisoned - 3 <= positions[0] <= poisoned
        assert rewind["skipped_samples"] == [i for p in positions for i in ids[p]]
    skipped = {i for rewind in guard.rewinds for i in rewind["skipped_samples"]}
    assert planted <= skipped
    assert len(skipped - planted) == BATCH * (sum(len(r["skipped_batches"]) for r in guard.rewinds) - len(PLANTED))

    run_dir = guarded_module.trainer.run_dir
    on_disk = [json.loads(line) for line in (run_dir / "rewinds.jsonl").read_text().splitlines()]
    assert on_disk == guard.rewinds
    rows = list(csv.DictReader((Path(logger.log_dir) / "metrics.csv").open()))
    counts = [float(r["rewind/count"]) for r in rows if r.get("rewind/count")]
    assert counts == [1.0, 2.0]


def test_each_rewind_is_one_line_on_screen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = batch_ids(24 * 4, 4)
    guard = SpikeGuard(factor=50, window=4, warmup_steps=2, check_every_n_steps=2, snapshot_every_n_steps=2)
    fit(tmp_path, PoisonData(96, frozenset(ids[9])), 4, guard, lr=0.02)
    lines = [line for line in capsys.readouterr().err.splitlines() if "loss spike" in line]
    assert lines == [
        f"ember: loss spike at step 10 (above 50 x median, {guard.rewinds[0]['value']}): rewound to step 8, "
        "left out 2 batches (rewind 1)"
    ]


# --- the skip list survives a resume ----------------------------------------------------------------------------
def test_a_resumed_run_keeps_leaving_out_the_skipped_batches(tmp_path: Path) -> None:
    """A rewinding fit stopped after its rewind and resumed from ``last`` in a new trainer ends bitwise equal to
    the same fit uninterrupted: the resumed epoch leaves out the same batches (they are in the checkpoint)."""
    n, batch = 32 * 4, 4
    data = PoisonData(n, frozenset(batch_ids(n, batch)[20]))

    def guard() -> SpikeGuard:
        return SpikeGuard(factor=50, window=4, warmup_steps=2, check_every_n_steps=2, snapshot_every_n_steps=2)

    whole = fit(tmp_path / "whole", data, batch, guard(), lr=0.02)
    first, stopped_guard = Regressor(lr=0.02), guard()
    options = {**QUIET, "enable_checkpointing": True}
    stopped = ember.Trainer(default_root_dir=str(tmp_path / "cut"), callbacks=[stopped_guard], max_steps=26, **options)
    stopped.fit(first, loader(data, batch))  # `last`: step 26, after the rewind at step 22
    assert len(stopped_guard.rewinds) == 1
    resumed_guard = guard()
    second = Regressor(lr=0.02)
    resumed = ember.Trainer(default_root_dir=str(tmp_path / "cut"), callbacks=[resumed_guard], **options)
    resumed.fit(second, loader(data, batch), ckpt_path="last")

    assert resumed.progress.skipped_positions() == [[0, 20]]  # the poisoned batch (its step is a snapshot's next)
    assert resumed_guard.rewinds == stopped_guard.rewinds  # the guard's record is checkpointed too
    for a, b in zip(params(whole), params(second), strict=True):
        assert torch.equal(a, b)


# --- the limit --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("poisoned", [5, 11, 15, 18, 23, 31, 36], ids=lambda p: f"batch {p}")
def test_the_checks_lag_does_not_move_the_rewind(tmp_path: Path, poisoned: int) -> None:
    """docs/rewind.md: whatever the check interval (the detector's lag), a spike is rewound to the same snapshot with
    the same batches left out, and the fit ends bitwise equal; only the step it was found at differs. Batches 15, 23
    and 31 are the last of a snapshot interval (their steps would have taken one); batch 5 comes before the first
    snapshot after the start (step 8), batch 11 just after it, in the warm-up of the longer intervals' checks."""
    n, batch = 40 * 4, 4
    data = PoisonData(n, frozenset(batch_ids(n, batch)[poisoned]))
    runs = {}
    for every in (1, 2, 4, 8):
        guard = SpikeGuard(
            factor=50, window=4, warmup_steps=2, check_every_n_steps=every, snapshot_every_n_steps=8, skip_after=1
        )
        runs[every] = (guard, fit(tmp_path / str(every), data, batch, guard, lr=0.02))
    (rewind,) = runs[1][0].rewinds
    assert rewind["step"] == rewind["spike_step"] == poisoned + 1  # checked at every step: found at once
    assert rewind["restored_step"] == 8 * (poisoned // 8)  # the snapshot before it
    for every, (guard, module) in runs.items():
        (lagged,) = guard.rewinds
        assert lagged["step"] == -(-(poisoned + 1) // every) * every  # found at the next check
        same = ("spike_step", "restored_step", "skipped_batches", "skipped_samples", "value", "median")
        assert {k: lagged[k] for k in same} == {k: rewind[k] for k in same}, every
        for a, b in zip(params(runs[1][1]), params(module), strict=True):
            assert torch.equal(a, b), every


def test_too_many_rewinds_stop_with_a_clear_error_and_a_resumable_last(tmp_path: Path) -> None:
    n, batch = 40 * 4, 4
    ids = batch_ids(n, batch)
    data = PoisonData(n, frozenset(ids[12]) | frozenset(ids[24]))
    guard = SpikeGuard(
        factor=50, window=4, warmup_steps=2, check_every_n_steps=2, snapshot_every_n_steps=2, max_rewinds=1
    )
    module = Regressor(lr=0.02)
    trainer = ember.Trainer(
        default_root_dir=str(tmp_path), callbacks=[guard], **{**QUIET, "enable_checkpointing": True}
    )
    with pytest.raises(TooManyRewinds, match=r"spiked 2 times within 1000 steps \(steps 13, 24\).*ckpt_path='last'"):
        trainer.fit(module, loader(data, batch))
    assert guard.rewinds[-1]["stopped"] is True
    assert trainer.global_step == guard.rewinds[-1]["restored_step"] == 22
    assert all(torch.isfinite(p).all() for p in module.parameters())
    again = ember.Trainer(default_root_dir=str(tmp_path), **{**QUIET, "max_steps": 23})
    again.fit(Regressor(lr=0.02), loader(data, batch), ckpt_path="last")
    assert again.global_step == 23  # resumed at the good state (step 22) and trained on


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"factor": 1.0}, "factor=1.0: use a finite number above 1"),
        ({"check_every_n_steps": 0}, "check_every_n_steps=0: use a whole number >= 1"),
        ({"check_every_n_steps": 4, "snapshot_every_n_steps": 6}, "snapshot_every_n_steps=6: use a multiple of"),
        ({"skip_after": -1}, "skip_after=-1: use a whole number >= 0"),
        ({"lr_scale": 0.0}, "lr_scale=0.0: use a positive number"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^SpikeGuard: {message}") as raised:
        SpikeGuard(**kwargs)
    assert "\n" not in str(raised.value)


# --- learning-rate scale ----------------------------------------------------------------------------------------
class LearningRates(ember.Callback):
    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.lrs[trainer.global_step + 1] = trainer.optimizers[0].param_groups[0]["lr"]


@pytest.mark.parametrize("scaled_steps", [4, 3], ids=["ends on a checking step", "ends between checks"])
def test_lr_scale_applies_for_its_steps_after_a_rewind(tmp_path: Path, scaled_steps: int) -> None:
    """The scale ends after exactly `lr_scale_steps` steps, also where that is not a step the guard checks at (it
    used to end only on a checking step: with 3 steps and checks every 2, never)."""
    ids = batch_ids(24 * 4, 4)
    guard = SpikeGuard(
        factor=50,
        window=4,
        warmup_steps=2,
        check_every_n_steps=2,
        snapshot_every_n_steps=2,
        lr_scale=0.5,
        lr_scale_steps=scaled_steps,
    )
    lrs = LearningRates()
    fit(tmp_path, PoisonData(96, frozenset(ids[9])), 4, guard, lrs, lr=0.02)
    assert guard.rewinds[0]["restored_step"] == 8
    assert [lrs.lrs[s] for s in range(9, 16)] == [0.01] * scaled_steps + [0.02] * (7 - scaled_steps)
    assert lrs.lrs[8] == 0.02


# --- mixed precision --------------------------------------------------------------------------------------------
class Overflowing(Regressor):
    """Its loss is large enough that the first steps' scaled fp16 gradients overflow: the scaler skips them."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 1000.0


def test_a_scaler_skipping_inf_gradients_is_not_a_spike(tmp_path: Path) -> None:
    guard = SpikeGuard(factor=10, window=4, warmup_steps=2, check_every_n_steps=2, snapshot_every_n_steps=2)
    module = Overflowing(lr=1e-5)
    trainer = ember.Trainer(default_root_dir=str(tmp_path), precision="16-mixed", callbacks=[guard], **QUIET)
    trainer.fit(module, loader(PoisonData(96), 4))
    scaler = trainer.strategy.precision.scaler  # type: ignore[attr-defined]
    assert scaler.get_scale() < 65536.0  # it skipped steps for inf gradients
    assert guard.rewinds == []


# --- must show 4: no host sync per step --------------------------------------------------------------------------
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


def count_syncs(monkeypatch: pytest.MonkeyPatch, run: Any) -> list[int]:
    """The global step at each call that reads a tensor on the host while `run()` runs."""
    seen: list[int] = []
    trainer_of: list[Any] = []

    def counting(name: str) -> Any:
        original = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if trainer_of:
                seen.append(trainer_of[0].global_step)
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    run(trainer_of)
    monkeypatch.undo()
    return seen


def test_the_guard_reads_the_device_only_at_its_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = PoisonData(64 * 4)

    class Watch(ember.Callback):
        def __init__(self, into: list[Any]) -> None:
            self.into = into

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.into.append(trainer)

    def run(guard: SpikeGuard | None) -> Any:
        def go(into: list[Any]) -> None:
            extra = [guard] if guard is not None else []
            fit(tmp_path / str(guard is None), data, 4, Watch(into), *extra, log_every_n_steps=1000)

        return go

    without = count_syncs(monkeypatch, run(None))
    with_guard = count_syncs(monkeypatch, run(SpikeGuard(check_every_n_steps=8, snapshot_every_n_steps=16)))
    extra = list(with_guard)
    for step in without:
        extra.remove(step)
    assert sorted(extra) == list(range(8, 65, 8))  # one read per check (every 8 steps), none in between


def test_a_guard_used_for_a_second_fit_starts_afresh(tmp_path: Path) -> None:
    """Its snapshot belongs to the first fit: going back to it in the second would restore another run."""
    ids = batch_ids(24 * 4, 4)
    guard = SpikeGuard(factor=50, window=4, warmup_steps=2, check_every_n_steps=2, snapshot_every_n_steps=2)
    fit(tmp_path / "first", PoisonData(96, frozenset(ids[9])), 4, guard, lr=0.02)
    assert len(guard.rewinds) == 1
    fit(tmp_path / "second", PoisonData(96, frozenset(ids[15])), 4, guard, lr=0.02)
    assert [r["restored_step"] for r in guard.rewinds] == [14]

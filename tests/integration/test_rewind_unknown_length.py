"""SpikeGuard on data of unknown length (docs/rewind.md).

An iterable without ``__len__`` does not say which batch ends an epoch, so the guard cannot check at an epoch's
last batch; in the fit's last epoch the loop calls ``on_train_stop`` when the data runs out, and the guard checks
there what it has not.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exactness"))
from rewind_workload import PoisonData, Regressor, ResumableStream

import ember
from ember.callbacks import SpikeGuard


def fit(root: Path, data: Any, guard: SpikeGuard) -> ember.Trainer:
    trainer = ember.Trainer(
        default_root_dir=str(root), callbacks=[guard], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, max_epochs=1,
    )  # fmt: skip
    trainer.fit(Regressor(lr=0.02), data)
    return trainer


def test_a_spike_at_a_checking_step_of_an_iterable_of_unknown_length_is_rewound(tmp_path: Path) -> None:
    """The control: the same stream, the poison in batch 7 (step 8, a checking step), is rewound."""
    guard = SpikeGuard(factor=50, window=4, warmup_steps=2, check_every_n_steps=4, snapshot_every_n_steps=4)
    trainer = fit(tmp_path, DataLoader(ResumableStream(PoisonData(40, frozenset({30}))), batch_size=4), guard)
    # the snapshot at step 4 (its loss judged: 3 steps before it, warmup_steps=2)
    assert [(r["spike_step"], r["restored_step"]) for r in guard.rewinds] == [(8, 4)]
    assert [b for _, b in guard.rewinds[0]["skipped_batches"]] == [4, 5, 6, 7]
    assert trainer.global_step == 6  # 4, then the 2 batches after the 4 left out


def test_a_spike_in_the_last_steps_of_an_iterable_of_unknown_length_is_rewound(tmp_path: Path) -> None:
    """Batch 9 of 10 (step 10, after the last check at 8) is poisoned: the data's end in the fit's last epoch is its
    last step boundary, where the guard checks what it has not (`on_train_stop`) and rewinds."""
    guard = SpikeGuard(factor=50, window=4, warmup_steps=2, check_every_n_steps=4, snapshot_every_n_steps=4)
    trainer = fit(tmp_path, DataLoader(ResumableStream(PoisonData(40, frozenset({38}))), batch_size=4), guard)
    assert [(r["spike_step"], r["restored_step"]) for r in guard.rewinds] == [(10, 8)]
    assert [b for _, b in guard.rewinds[0]["skipped_batches"]] == [8, 9]
    assert trainer.global_step == 8 and guard._losses == []  # nothing left after the skipped batches


def test_a_spike_in_the_last_steps_of_an_earlier_epoch_is_rewound_at_the_next_epochs_first_check(
    tmp_path: Path,
) -> None:
    """The same poison in both epochs: epoch 0's (step 10) is checked at epoch 1's first check and rewound across
    the epoch's end; epoch 1's (step 18, after that rewind) when the data runs out."""
    guard = SpikeGuard(factor=50, window=4, warmup_steps=2, check_every_n_steps=4, snapshot_every_n_steps=4)
    data = DataLoader(ResumableStream(PoisonData(40, frozenset({38}))), batch_size=4)
    trainer = ember.Trainer(
        default_root_dir=str(tmp_path), callbacks=[guard], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, max_epochs=2,
    )  # fmt: skip
    module = Regressor(lr=0.02)
    trainer.fit(module, data)
    assert [(r["spike_step"], r["restored_step"], r["skipped_batches"]) for r in guard.rewinds] == [
        (10, 8, [[0, 8], [0, 9]]),
        (18, 16, [[1, 8], [1, 9]]),
    ]
    assert trainer.global_step == 16
    assert all(bool(p.isfinite().all()) for p in module.parameters())

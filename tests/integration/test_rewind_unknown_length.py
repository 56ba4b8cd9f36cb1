"""SpikeGuard on data of unknown length: a known limit (docs/rewind.md, "Limits").

An iterable without ``__len__`` does not say which batch ends an epoch, so the guard has no check at an epoch's last
step: a spike in the fit's last ``check_every_n_steps - 1`` steps is never checked. Kept as a strict expected
failure, so the day it is rewound this test says so.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exactness"))
from rewind_workload import PoisonData, Regressor

import ember
from ember.callbacks import SpikeGuard


class Stream(IterableDataset):
    """An iterable of unknown length that can go back to a position (state_dict/load_state_dict)."""

    def __init__(self, data: PoisonData) -> None:
        self.data, self.pos = data, 0

    def __iter__(self) -> Iterator[Any]:
        while self.pos < len(self.data):
            self.pos += 1
            yield self.data[self.pos - 1]
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


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
    trainer = fit(tmp_path, DataLoader(Stream(PoisonData(40, frozenset({30}))), batch_size=4), guard)
    assert [(r["spike_step"], r["restored_step"]) for r in guard.rewinds] == [(8, 0)]  # the first snapshot: step 0
    assert [b for _, b in guard.rewinds[0]["skipped_batches"]] == list(range(8))
    assert trainer.global_step == 2  # the 2 batches after the 8 left out


@pytest.mark.xfail(
    strict=True,
    reason="a known limit (docs/rewind.md, 'Limits'): on data of unknown length the guard does not know the "
    "epoch's last batch, so the losses after the fit's last check are never checked",
)
def test_a_spike_in_the_last_steps_of_an_iterable_of_unknown_length_is_rewound(tmp_path: Path) -> None:
    guard = SpikeGuard(factor=50, window=4, warmup_steps=2, check_every_n_steps=4, snapshot_every_n_steps=4)
    trainer = fit(tmp_path, DataLoader(Stream(PoisonData(40, frozenset({38}))), batch_size=4), guard)
    assert trainer.global_step == 10  # batch 9 of 10 (step 10) is poisoned
    assert [r["spike_step"] for r in guard.rewinds] == [10]

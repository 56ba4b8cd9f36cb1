"""Kill -9 fault injection (issue 3, "must show" 2; DESIGN.md section 5, atomic writes).

`test_sigkill_at_random_moments_then_resume_is_bitwise_exact` runs the harness of ``benchmarks/kill9.py``
with 5 kills: a training process with ``ModelCheckpoint(every_n_train_steps=1)`` and
``fit(ckpt_path="last")`` is SIGKILLed at seeded random moments (most of a step is checkpoint I/O, so
most kills land in a write), relaunched after each kill, and finally runs to completion. After every
kill the checkpoint that ``last`` names must load; the final parameters must be bitwise equal to those
of an uninterrupted run. ``python benchmarks/kill9.py`` is the 50-kill version.

The other tests pin what a kill can leave behind but a random kill rarely hits: no ``last`` yet beside
a complete checkpoint (a kill between the first checkpoint's rename and the pointer write), and a
``last`` that names a checkpoint that is gone or broken.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import checkpoint as ckpt
from ember.callbacks.model_checkpoint import ModelCheckpoint

REPO = Path(__file__).resolve().parents[2]


def _load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ember_benchmark_kill9", REPO / "benchmarks" / "kill9.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bitwise_exact(tmp_path: Path) -> None:
    harness = _load_harness()
    report = harness.run(tmp_path, kills=5, seed=1234, max_delay_s=0.3, timeout_s=90.0)
    print(report)
    assert report.kills >= 5
    assert report.relaunches >= 5
    assert report.last_always_readable, report.unreadable
    assert report.kills_in_checkpoint_io >= 1  # the model is big enough that writes take most of a step
    assert report.bitwise_equal


# --- what a crash can leave behind, built deliberately ------------------------------------------------------


class Tiny(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(root: Path, max_steps: int, ckpt_path: str | None = None) -> ember.Trainer:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g))
    trainer = ember.Trainer(
        max_steps=max_steps,
        callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)],
        default_root_dir=root,
        run_name="crash",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def _step_of(path: Path) -> int:
    return int(ckpt.read_meta(path)["state"]["progress"]["global_step"])


@pytest.fixture
def four_checkpoints(tmp_path: Path) -> Path:
    _fit(tmp_path, max_steps=4)
    directory = tmp_path / "crash" / "version_0" / "checkpoints"
    assert sorted(_step_of(p) for p in ckpt.checkpoints_in(directory)) == [1, 2, 3, 4]
    assert _step_of(ckpt.newest_valid(directory)) == 4
    return directory


def test_without_a_last_file_the_newest_complete_checkpoint_is_used(four_checkpoints: Path) -> None:
    (four_checkpoints / ckpt.LAST_FILE).unlink()
    found = ckpt.newest_valid(four_checkpoints)
    assert found is not None, "complete checkpoints exist, but newest_valid found none"
    assert _step_of(found) == 4


def test_a_last_naming_a_broken_checkpoint_falls_back_to_the_previous_one(four_checkpoints: Path) -> None:
    named = four_checkpoints / (four_checkpoints / ckpt.LAST_FILE).read_text().strip()
    (named / ".metadata").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = ckpt.newest_valid(four_checkpoints)
    assert any("skipping checkpoint" in str(w.message) and named.name in str(w.message) for w in caught)
    assert found is not None and _step_of(found) == 3


def test_fit_last_resumes_from_the_newest_complete_checkpoint_when_last_names_a_missing_one(
    four_checkpoints: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    named = four_checkpoints / (four_checkpoints / ckpt.LAST_FILE).read_text().strip()
    shutil.rmtree(named)
    root = four_checkpoints.parents[2]
    with pytest.warns(RuntimeWarning, match="skipping checkpoint"):
        trainer = _fit(root, max_steps=6, ckpt_path="last")
    assert trainer.run_dir == four_checkpoints.parent  # continued version_0 instead of starting version_1
    assert not (root / "crash" / "version_1").exists()
    assert trainer.global_step == 6
    assert "resuming from" in capsys.readouterr().err

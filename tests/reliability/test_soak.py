"""``benchmarks/soak.py --short`` (issue 16, "must show" 3): 16 random interruptions across the eight
configurations, every promise counted. The full run (104 interruptions) is recorded in docs/benchmarks.md."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ember

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_soak_short_mode_interrupts_every_configuration_and_every_promise_holds(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--short", "--seed", "7"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]

    def count(label: str) -> int:
        match = re.search(rf"^{re.escape(label)}:\s+(\d+)", out, re.MULTILINE)
        assert match, f"no {label!r} line:\n{out}"
        return int(match.group(1))

    assert count("interruptions") == 16
    assert count("configurations completed") == 8
    for label in ("unreadable `last`", "runs that lost completed work", "deleted checkpoints still kept",
                  "deleted outside the run", "executed payloads", "unexpected exits"):  # fmt: skip
        assert count(label) == 0, out
    assert re.search(r"^final parameters bitwise equal:\s+True$", out, re.MULTILINE), out
    assert out.strip().endswith("verdict: every promise held")


def _soak() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = soak  # its dataclasses look their module up
    try:
        spec.loader.exec_module(soak)
    finally:
        del sys.modules["soak"]
    return soak


def test_the_soak_reads_the_step_of_a_re_saved_checkpoint() -> None:
    """A kill between a checkpoint's completion and `last` naming it leaves that checkpoint complete; the resumed
    launch re-saves the same step as ``step=N-v1``, which the soak's bookkeeping must read as step N."""
    soak = _soak()
    assert [soak.saved_step(name) for name in ("step=38", "step=38-v1", "step=7-v12")] == [38, 38, 7]


class _Line(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("newest_complete", [True, False])
def test_the_kept_check_counts_a_save_completed_before_its_report_and_still_catches_a_deleted_kept_one(
    tmp_path: Path, newest_complete: bool
) -> None:
    """Rank 0's loggers hear of a finished save on a thread of their own, while the save's eviction of an older
    checkpoint starts at once: a SIGKILL between the two leaves the older one half deleted and the newer one
    unreported. With saves at steps 2, 4, 6 and 8 reported up to 6 and top 2 kept, step 4 was rightly evicted when
    step 8 completed; when step 8 is not complete, step 4 is still one of the two newest and must be there."""
    from torch.utils.data import DataLoader, TensorDataset

    from ember.callbacks import ModelCheckpoint

    soak = _soak()
    run = soak.Run(tmp_path, soak.Config(async_save=False, top_k=2, world_size=1), soak.Report(), epochs=1)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    saver = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = ember.Trainer(max_steps=8, callbacks=[saver], default_root_dir=run.root, run_name=soak.RUN_NAME,
                            logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(_Line(), DataLoader(data, batch_size=4))
    folder = run.folder()
    assert sorted(p.name for p in folder.glob("step=*")) == ["step=2", "step=4", "step=6", "step=8"]
    run.progress.write_text("".join(f"saved step={n}\n" for n in (2, 4, 6)))  # step 8's line never written
    shard = next(p for p in (folder / "step=4").iterdir() if p.name != "ember.pt")
    shard.unlink()  # the eviction of step 4, cut short
    if not newest_complete:
        (folder / "last").write_text("step=6")
        shutil.rmtree(folder / "step=8")

    run.check("SIGKILL")

    kept_problems = [p for p in run.report.problems if "kept checkpoint" in p]
    assert run.report.deleted_kept == (0 if newest_complete else 1), run.report.problems
    assert len(kept_problems) == run.report.deleted_kept
    assert run.report.unreadable_last == run.report.lost_work == 0, run.report.problems

"""A write-free run of several processes keeps its run directory: another process may still write into it
(``ember predict`` saves each rank's outputs there after the run; rank 1 once found it removed by rank 0)."""

from __future__ import annotations

import dist_harness as harness
import pytest

pytestmark = pytest.mark.distributed

SCRIPT = """\
import sys
import time
from pathlib import Path

from torch.utils.data import DataLoader

import dist_workload as w
import ember

out = Path(sys.argv[1])
trainer = ember.Trainer(strategy=w.ddp(), devices=2, accelerator="cpu", default_root_dir=out / "runs", max_steps=4,
                        enable_checkpointing=False, **w.QUIET)
trainer.fit(w.Net(), DataLoader(w.train_set(w.N_SEQ), batch_size=4))
if trainer.global_rank == 1:  # once rank 0 is past its run (which, before, removed the empty directory)
    deadline = time.monotonic() + 60
    while not (trainer.run_dir / "after-rank0.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
(trainer.run_dir / f"after-rank{trainer.global_rank}.txt").write_text("written after the run")
"""


def test_a_write_free_job_keeps_its_run_dir_for_every_process(tmp_path) -> None:
    script = harness.write_script(tmp_path, SCRIPT)
    job = harness.run(harness.spawn(script, str(tmp_path / "out")), tmp_path, timeout=120)
    assert job.returncode == 0, harness.describe(job)
    written = sorted(p.name for p in (tmp_path / "out" / "runs").glob("*/version_0/after-rank*.txt"))
    assert written == ["after-rank0.txt", "after-rank1.txt"], harness.describe(job)

"""A full disk is a clean error (issue 16, item 7; "must show" 2): tested on a real, small tmpfs.

Training saves every epoch with ``save_top_k=-1`` until the disk is full. Whatever the path (sync or
async, one process or two), the run must end with one clear error naming the directory and the space
needed, a normal exit status (no abort, no core dump, no hang), the previous checkpoint intact, ``last``
naming a complete checkpoint, and no temporary directory left behind; after space is freed, ``last``
resumes.

Mounting a tmpfs needs root on Linux (CI runs as root). Elsewhere these tests are skipped, and the
injected ENOSPC tests of tests/unit/test_checkpoint_format.py cover the same paths.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rel_helpers import make_project
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import checkpoint as ckpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

import dist_harness as harness

DISK_SIZE = "2m"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted at `tmp_path`/disk, unmounted afterwards."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux; tests/unit/test_checkpoint_format.py injects ENOSPC")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(disk)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the injected ENOSPC tests cover this")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def assert_intact(folder: Path) -> Path:
    """`last` names a complete checkpoint, every visible checkpoint is complete, no temporary is left."""
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert leftovers == [], f"temporary files left: {leftovers}"
    last = ckpt.read_pointer(folder / "last")
    ckpt.check_complete(last)
    for path in ckpt.checkpoints_in(folder):
        ckpt.check_complete(path)
    return last


def free_space(folder: Path, keep: Path) -> None:
    for path in ckpt.checkpoints_in(folder):
        if path != keep:
            shutil.rmtree(path)


class Wide(ember.TrainingModule):
    """About 50 KB of weights and AdamW state: a 2 MiB disk holds a few dozen checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 2))
        self.loss_fn = nn.CrossEntropyLoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g)), 16)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.slow  # 3 s of CPU on a 2-core machine, with the processes it starts
def test_one_process_fills_the_disk_and_ends_with_a_clean_error(small_disk: Path, async_save: bool) -> None:
    folder = small_disk / "ckpts"
    saver = ember.callbacks.ModelCheckpoint(folder, save_top_k=-1, async_save=async_save)
    trainer = ember.Trainer(max_epochs=500, callbacks=[saver], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=small_disk / "runs")  # fmt: skip
    with pytest.raises(ckpt.CheckpointWriteError) as info:
        trainer.fit(Wide(), data())
    message = str(info.value)
    assert "No space left on device" in message and str(folder) in message and "needs about" in message
    assert 5 < trainer.current_epoch < 499  # several saves fitted, then the disk was full
    last = assert_intact(folder)
    free_space(folder, keep=last)
    resumed = ember.Trainer(max_epochs=trainer.current_epoch + 2, callbacks=[ember.callbacks.ModelCheckpoint(folder)],
                            logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    resumed.fit(Wide(), data(), ckpt_path=last)
    assert resumed.current_epoch == trainer.current_epoch + 2


BIG = """\
seed: 1
trainer:
  max_epochs: 500
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  default_root_dir: {root}
  logger:
    - _target_: ember.loggers.CSVLogger
  callbacks:
    - _target_: ember.callbacks.ModelCheckpoint
      save_top_k: -1
      async_save: {async_save}
module:
  _target_: my_project.models.Net
  hidden: 512
data:
  _target_: my_project.models.Blobs
  n: 64
optimizer:
  _target_: torch.optim.AdamW
  lr: 0.01
"""


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["false", "true"], ids=["sync", "async"])
def test_the_command_exits_1_with_one_line_when_the_disk_fills(
    small_disk: Path, tmp_path: Path, async_save: str
) -> None:
    config = make_project(tmp_path / "project", BIG.format(root=small_disk / "runs", async_save=async_save))
    env = dict(os.environ, PYTHONPATH=str(Path(ember.__file__).parents[1]), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "ember", "fit", "-c", str(config)], cwd=tmp_path / "project",
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "terminate called" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ember: error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], result.stderr
    assert_intact(small_disk / "runs" / "net" / "version_0" / "checkpoints")


TWO_PROCESSES = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import ember
    from ember.checkpoint import CheckpointWriteError

    folder, async_save = sys.argv[1], sys.argv[2] == "async"

    class Wide(ember.TrainingModule):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 2))
            self.loss_fn = nn.CrossEntropyLoss()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g)), 8)
    saver = ember.callbacks.ModelCheckpoint(folder, save_top_k=-1, async_save=async_save)
    trainer = ember.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=500, callbacks=[saver],
                            logger=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Wide(), data)
    except CheckpointWriteError as exc:
        print(f"rank {trainer.global_rank}: CheckpointWriteError: {exc}", flush=True)
        sys.exit(3)
    print(f"rank {trainer.global_rank}: finished without filling the disk", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_processes_fill_the_disk_and_both_end_with_a_clean_error(
    small_disk: Path, tmp_path: Path, mode: str
) -> None:
    folder = small_disk / "ckpts"
    script = harness.write_script(tmp_path / "job", TWO_PROCESSES)
    job = harness.run(harness.spawn(script, str(folder), mode), cwd=tmp_path / "job", timeout=240)
    assert not job.timed_out, harness.describe(job)
    for rank in (0, 1):
        assert f"rank {rank}: CheckpointWriteError: " in job.output, harness.describe(job)
    assert "No space left on device" in job.output
    assert "terminate called" not in job.output and "Aborted" not in job.output, harness.describe(job)
    assert job.returncode == 1, harness.describe(job)  # torchrun's status when workers exit non-zero
    assert_intact(folder)

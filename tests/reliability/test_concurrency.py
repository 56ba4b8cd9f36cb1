"""Runs started together, and processes that disagree (issue 16, items 6 and 15).

- Two runs started at the same moment under the same root get two version directories, each with its own
  ``config.yaml`` and ``last``.
- Ranks holding different numbers of training batches are an error on every rank that names the counts,
  not a gloo abort.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from rel_helpers import make_project

import ember

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

import dist_harness as harness


def _claim_at(root: str, start: Any, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    from ember.checkpoint import claim_version

    start.wait()  # every process leaves the barrier at the same instant
    out.put(str(claim_version(Path(root))[0]))


def test_processes_claiming_at_the_same_instant_get_distinct_versions(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
    start = context.Barrier(6, timeout=60)
    procs = [context.Process(target=_claim_at, args=(str(tmp_path), start, out)) for _ in range(6)]
    for proc in procs:
        proc.start()
    claimed = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert len(set(claimed)) == 6
    assert sorted(Path(p).name for p in claimed) == [f"version_{i}" for i in range(6)]


def test_threads_claiming_together_get_distinct_versions(tmp_path: Path) -> None:
    from ember.checkpoint import claim_version

    claimed: list[Path] = []
    barrier = threading.Barrier(8)

    def claim() -> None:
        barrier.wait()
        claimed.append(claim_version(tmp_path)[0])

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({p.name for p in claimed}) == 8


def test_a_claim_survives_another_run_releasing_the_folders_above_it(tmp_path: Path, monkeypatch) -> None:
    """Run A's release removes the empty ``<root>/<name>`` between run B's ``mkdir`` of it and B's claim."""
    from ember.checkpoint import locating

    run_root = tmp_path / "runs" / "net"
    listed = locating.versions_newest_first

    def listed_then_released(folder: Path) -> list[Path]:
        found = listed(folder)
        locating.release_if_empty(run_root, tmp_path)  # the other run's release, at the worst moment
        return found

    monkeypatch.setattr(locating, "versions_newest_first", listed_then_released)
    claimed, kept = locating.claim_version(run_root)
    assert claimed == run_root / "version_0" and claimed.is_dir() and kept == tmp_path


def test_a_write_free_run_never_removes_folders_above_its_root_dir(tmp_path: Path) -> None:
    """Another process may be about to write into the folder above ``default_root_dir`` (a script's own
    results, beside the runs); a write-free run's release stops at its root dir, even when it made more."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    root = tmp_path / "made" / "by" / "this" / "run" / "runs"
    trainer = ember.Trainer(max_steps=2, default_root_dir=root, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Tiny(), data)
    assert not root.exists(), "the write-free run left its root dir"
    assert root.parent.is_dir(), "the folder above the root dir was removed"
    # and with the folder above it already there, the root dir is still removed: nothing else changes
    trainer = ember.Trainer(max_steps=2, default_root_dir=root, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Tiny(), data)
    assert not root.exists() and root.parent.is_dir()


@pytest.mark.slow
def test_two_ember_fit_commands_started_together_keep_apart(tmp_path: Path) -> None:
    config = make_project(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(Path(ember.__file__).parents[1]), OMP_NUM_THREADS="1")
    commands = [
        [sys.executable, "-m", "ember", "fit", "-c", str(config), f"module.hidden={hidden}"] for hidden in (5, 9)
    ]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]  # fmt: skip
    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    versions = sorted((tmp_path / "runs" / "net").iterdir())
    assert [v.name for v in versions] == ["version_0", "version_1"]
    hidden = sorted(yaml.safe_load((v / "config.yaml").read_text())["module"]["hidden"] for v in versions)
    assert hidden == [5, 9]  # each directory holds its own run's config
    for version in versions:
        own = yaml.safe_load((version / "config.yaml").read_text())["module"]["hidden"]
        last = version / "checkpoints" / (version / "checkpoints" / "last").read_text().strip()
        saved = ember.checkpoint.read_meta(last)["config"]["module"]["hidden"]
        assert saved == own, "`last` names the other run's checkpoint"


UNEVEN = """\
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import ember

class Net(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        self.model, self.loss_fn = nn.Linear(4, 1), nn.MSELoss()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = ember.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=1, use_distributed_sampler=False,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
rank = int(__import__("os").environ["RANK"])  # torchrun sets it; the trainer joins the group in fit
n = 24 if rank == 0 else 16  # each rank holds its own share, of different sizes
data = DataLoader(TensorDataset(torch.randn(n, 4), torch.randn(n, 1)), batch_size=4)
try:
    trainer.fit(Net(), data)
except RuntimeError as exc:
    print(f"rank {rank}: {exc}", flush=True)
    sys.exit(3)
print(f"rank {rank}: finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_uneven_batches_across_ranks_are_an_error_on_every_rank(tmp_path: Path) -> None:
    script = harness.write_script(tmp_path, UNEVEN)
    job = harness.run(harness.spawn(script), cwd=tmp_path, timeout=180)
    assert not job.timed_out, harness.describe(job)
    for rank in (0, 1):
        assert f"rank {rank}: the processes have different numbers of training batches per epoch " in job.output
        assert "(rank 0: 6, rank 1: 4)" in job.output
    assert "collective mismatch" not in job.output and "EnforceNotMet" not in job.output
    assert job.returncode == 1, harness.describe(job)  # torchrun: the workers exited with status 3

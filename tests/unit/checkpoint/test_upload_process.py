"""The upload worker process (ember/checkpoint/upload_process.py) behind `StoreMirror`: it commits in the order
asked, imports no torch, leaves signals to the training process, ends with it, and a crash of it is an upload
failure that keeps the local checkpoints."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ember import Callback, Trainer, TrainingModule
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import CheckpointWriteError, manifest
from ember.checkpoint.mirror import StoreMirror
from ember.checkpoint.store import open_store
from ember.checkpoint.upload_process import UploadProcess

REPO = Path(__file__).resolve().parents[3]
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")


def _checkpoint(tmp: Path, name: str) -> Path:
    local = tmp / "local" / name
    (local / "sub").mkdir(parents=True)
    (local / "ember.pt").write_bytes(b"meta-" + name.encode())
    (local / "sub" / "__0_0.distcp").write_bytes(name.encode() * 1000)
    return local


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[StoreMirror]:
    """A mirror of a file:// folder of this test's own: uploaded by a worker process; closed afterwards."""
    mirror = StoreMirror(f"file://{tmp_path}/store")
    yield mirror
    with contextlib.suppress(CheckpointWriteError):  # a test that made an upload fail has asserted on it
        mirror.close()


def test_a_store_outside_this_process_is_uploaded_in_order_by_a_worker_process_with_its_evictions(
    tmp_path: Path, mirror: StoreMirror
) -> None:
    pid = mirror.upload_pid
    assert pid is not None and pid != os.getpid()
    mirror.wait_ready()  # the worker answered: started, its store opened
    assert _alive(pid)
    events: list[str] = []
    for step in (1, 2, 3):
        keep = {f"s{step - 1}", f"s{step}"}  # top-2: s1 is evicted once s3 is committed
        mirror.submit(_checkpoint(tmp_path, f"s{step}"), step, True, keep, after=lambda s=step: events.append(f"s{s}"))
    mirror.close()
    assert events == ["s1", "s2", "s3"]  # each cleanup after its own upload, in save order
    fs, root = open_store(f"file://{tmp_path}/store")
    assert sorted(Path(p).name for p in fs.ls(root, detail=False)) == ["last", "s2", "s3"]
    assert manifest.read_last(fs, root, "store") == "s3"
    committed = manifest.committed(fs, f"{root}/s3", "store/s3")
    assert committed is not None and committed["global_step"] == 3
    assert {e["name"] for e in committed["files"]} == {"ember.pt", "sub/__0_0.distcp"}
    assert mirror.uploaded == ["s2", "s3"]
    assert not _alive(pid)  # close ended the worker


def test_memory_stores_exist_in_this_process_only_so_the_thread_uploads_them() -> None:
    mirror = StoreMirror("memory://ember-test-upload-thread")
    try:
        assert mirror.upload_pid is None
    finally:
        mirror.close()


def test_the_worker_imports_ember_store_modules_but_never_torch(tmp_path: Path) -> None:
    process = UploadProcess(f"file://{tmp_path}/store")
    try:
        imported = process.imported()
    finally:
        process.close()
    assert "torch" not in imported and "numpy" not in imported
    assert {"ember", "fsspec"} <= set(imported)


def test_a_failed_upload_in_the_worker_is_raised_with_its_error_and_keeps_later_checkpoints_local(
    tmp_path: Path, mirror: StoreMirror
) -> None:
    ran: list[str] = []
    mirror.submit(tmp_path / "gone", 1, True, {"gone"}, after=lambda: ran.append("gone"))
    mirror.submit(_checkpoint(tmp_path, "s2"), 2, True, {"s2"}, after=lambda: ran.append("s2"))
    with pytest.raises(CheckpointWriteError, match=r"failed: FileNotFoundError: checkpoint .*gone has no files"):
        mirror.wait()
    assert ran == []
    assert not Path(f"{tmp_path}/store/s2").exists()  # not attempted after the failure


def test_a_killed_worker_is_an_upload_failure_that_says_so(tmp_path: Path, mirror: StoreMirror) -> None:
    pid = mirror.upload_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    ran: list[str] = []
    mirror.submit(_checkpoint(tmp_path, "s1"), 1, True, {"s1"}, after=lambda: ran.append("s1"))
    ended = r"the upload process ended unexpectedly \(exit status -9\); the local checkpoints"
    with pytest.raises(CheckpointWriteError, match=ended):
        mirror.wait()
    assert ran == [] and (tmp_path / "local" / "s1" / "ember.pt").is_file()


@needs_proc
def test_the_worker_ignores_interrupts_meant_for_the_training_process(tmp_path: Path, mirror: StoreMirror) -> None:
    pid = mirror.upload_pid
    assert pid is not None
    mirror.submit(_checkpoint(tmp_path, "s1"), 1, True, {"s1"})
    mirror.wait()  # the worker is up, its handlers set
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # Ctrl-C, preemption, requeue: the group's
        os.kill(pid, signum)
    mirror.submit(_checkpoint(tmp_path, "s2"), 2, True, {"s1", "s2"})
    mirror.wait()
    assert _alive(pid)
    assert manifest.read_last(*open_store(f"file://{tmp_path}/store"), "store") == "s2"


TRAINER = """
import os, signal, sys, time
from ember.checkpoint.mirror import StoreMirror
mirror = StoreMirror(sys.argv[1])
holder = os.fork()  # as a DataLoader worker would: it holds the pipe to the upload worker open
if holder == 0:
    time.sleep(60)
    os._exit(0)
print(mirror.upload_pid, holder, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


@needs_proc
def test_the_worker_ends_when_the_training_process_is_killed(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, f"file://{tmp_path}/store"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip
    assert trainer.stdin is not None and trainer.stdout is not None
    worker, holder = map(int, trainer.stdout.readline().split())
    try:
        assert _alive(worker)
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        assert trainer.wait(timeout=30) == -signal.SIGKILL
        assert _wait_gone(worker, timeout_s=5), "the upload worker outlived the training process"
        assert _alive(holder)  # its input stayed open: the worker saw its parent die, not an end of input
    finally:
        os.kill(holder, signal.SIGKILL)


class _Tiny(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _EndAtStep3(Callback):
    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 3 and self.how == "error":
            raise RuntimeError("boom at step 3")
        if trainer.global_step == 3 and self.how == "preempted":
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize(("how", "raised", "last"), [
    ("finished", None, "epoch=0-step=5"),
    ("error", RuntimeError, "epoch=0-step=2"),  # step 3's save is asked for after the hook that raised
    ("preempted", SystemExit, "epoch=0-step=3"),
])  # fmt: skip
def test_the_worker_is_ended_and_joined_when_fit_ends_however_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, raised: type[BaseException] | None, last: str
) -> None:
    started: list[UploadProcess] = []
    init = UploadProcess.__init__

    def recording(self: UploadProcess, url: str) -> None:
        init(self, url)
        started.append(self)

    monkeypatch.setattr(UploadProcess, "__init__", recording)
    url = f"file://{tmp_path}/store"
    saver = ModelCheckpoint(dirpath=url, every_n_train_steps=1, async_save=True)
    trainer = Trainer(max_steps=5, default_root_dir=tmp_path / "runs", callbacks=[saver, _EndAtStep3(how)],
                      logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(20, 3, generator=g), torch.randn(20, 1, generator=g)), batch_size=4)
    with pytest.raises(raised) if raised is not None else contextlib.nullcontext():
        trainer.fit(_Tiny(), loader)
    assert len(started) == 1
    assert started[0]._proc.poll() is not None  # ended, and reaped: nothing left running
    assert manifest.read_last(*open_store(url), url) == last  # what was queued was uploaded before the end

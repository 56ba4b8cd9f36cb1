"""Checkpoints on a real S3 API server (moto's standalone server on 127.0.0.1, started by a fixture): a fit
whose process is SIGKILLed at generated instants while it saves, uploads and evicts, relaunched each time on
an empty local directory (a new machine: nothing shared but the store), resumed from the store's ``last``,
ends with parameters bitwise equal to an uninterrupted run. After every kill the store's ``last`` (or its
newest committed checkpoint) downloads and matches its manifest. Credentials come from the environment only
and appear in no checkpoint, object or message."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ember.checkpoint import manifest, run_store
from ember.checkpoint.store import open_store

pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install -e '.[dev]')")
REPO = Path(__file__).resolve().parents[2]

ZYGOTE = """
# Imports everything once, then forks one fit per "run" line on stdin (a launch costs milliseconds, not the
# seconds of importing torch); "wait PID" reaps a child and prints its exit status.
import os, sys, traceback
import torch
from pathlib import Path
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import manifest, run_store
from ember.checkpoint.store import open_store
import s3fs
import torch._dynamo, torch.distributed.checkpoint  # what a fit imports on first use, imported before forking

class Net(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 256), nn.Dropout(0.1), nn.Linear(256, 256), nn.Linear(256, 1))
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)
    def on_train_start(self):
        self.trainer.checkpoint_callbacks[0]._mirror.wait_ready()  # kills then land among uploads, not its start
        Path(self.hparams_marker).write_text("training")
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

def fit(url, local, out, marker):
    torch.set_num_threads(1)
    fs, root = open_store(url)
    resume = url + "/last" if manifest.newest(fs, root, url) is not None else None
    ember.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    saver = ModelCheckpoint(dirpath=url, every_n_train_steps=1, save_top_k=2, async_save=True)
    trainer = ember.Trainer(max_steps=24, default_root_dir=local, callbacks=[saver], logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
    module = Net()
    module.hparams_marker = marker
    trainer.fit(module, loader, ckpt_path=resume)
    torch.save([p.detach() for p in module.parameters()], out)

for line in sys.stdin:
    command, *args = line.rstrip("\\n").split("\\t")
    if command == "run":
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)
            code = 1
            try:
                fit(*args)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        print(pid, flush=True)
    elif command == "wait":
        print(os.waitstatus_to_exitcode(os.waitpid(int(args[0]), 0)[1]), flush=True)
"""


class Zygote:
    """The process that forks the fits (see ZYGOTE); its and their stderr go to `log`."""

    def __init__(self, script: Path, log: Path, env: dict[str, str]) -> None:
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        environ = dict(os.environ, **env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(log.parent))
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True,
        )  # fmt: skip

    def _ask(self, *words: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\t".join(words) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def run(self, url: str, local: Path, out: Path, marker: Path) -> int:
        return self._ask("run", url, str(local), str(out), str(marker))

    def wait(self, pid: int) -> int:
        return self._ask("wait", str(pid))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.log.close()


def _bucket(env: dict[str, str]) -> str:
    import s3fs

    name = f"ember-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    return name


def _partial(fs: object, root: str) -> int:
    """Checkpoint folders on the store without a manifest (an upload a kill interrupted)."""
    found = 0
    if not fs.exists(root):  # type: ignore[attr-defined]
        return 0
    for info in fs.ls(root, detail=True, refresh=True):  # type: ignore[attr-defined]
        if info["type"] == "directory" and not fs.exists(f"{info['name']}/{manifest.MANIFEST_FILE}"):  # type: ignore[attr-defined]
            found += 1
    return found


@pytest.mark.slow  # about 55 s on 2 cores: 31 forked fits, each about 1 s to its first step
@pytest.mark.waits  # for the S3 server and the kills
def test_sigkill_during_saves_uploads_and_evictions_then_resume_from_the_store_is_bitwise_exact(
    tmp_path: Path, s3_env: dict[str, str]
) -> None:
    script = tmp_path / "zygote.py"
    script.write_text(ZYGOTE)
    (tmp_path / "tmp").mkdir()
    zygote = Zygote(script, tmp_path / "tmp" / "fits.log", s3_env)
    try:
        _kill_and_resume(tmp_path, zygote, _bucket(s3_env), s3_env)
    finally:
        zygote.close()
    log = (tmp_path / "tmp" / "fits.log").read_text()
    key_id, secret = s3_env["AWS_ACCESS_KEY_ID"], s3_env["AWS_SECRET_ACCESS_KEY"]
    assert secret not in log and key_id not in log


def _kill_and_resume(tmp_path: Path, zygote: Zygote, bucket: str, s3_env: dict[str, str]) -> None:
    reference = tmp_path / "reference.pt"
    pid = zygote.run(f"s3://{bucket}/reference", tmp_path / "ref", reference, tmp_path / "m-ref")
    assert zygote.wait(pid) == 0, (tmp_path / "tmp" / "fits.log").read_text()[-3000:]

    url, out, rng = f"s3://{bucket}/ckpts", tmp_path / "final.pt", random.Random(35)
    fs, root = open_store(url)
    kills = partial_seen = restarts = 0
    while kills < 30:
        marker = tmp_path / f"m{kills}-{restarts}"
        pid = zygote.run(url, tmp_path / f"machine-{kills}-{restarts}", out, marker)
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.5))  # into training: steps, async saves, uploads, evictions
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        code = zygote.wait(pid)
        if code == 0:  # finished before the kill: start over so that every launch can be killed
            restarts += 1
            out.unlink()
            fs.rm(root, recursive=True)
            continue
        assert code == -signal.SIGKILL, (tmp_path / "tmp" / "fits.log").read_text()[-3000:]
        kills += 1
        fs.invalidate_cache()  # the fit that was killed wrote from another process
        partial_seen += _partial(fs, root) > 0
        if manifest.newest(fs, root, url) is not None:  # what a reader trusts after this kill loads
            local = manifest.fetch(url + "/last", fs, root + "/last", tmp_path / f"check-{kills}")
            assert (local / "ember.pt").is_file()
    pid = zygote.run(url, tmp_path / "machine-final", out, tmp_path / "m-final")
    assert zygote.wait(pid) == 0, (tmp_path / "tmp" / "fits.log").read_text()[-3000:]
    expected, got = torch.load(reference), torch.load(out)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert kills >= 30
    assert partial_seen >= 1  # some kills landed inside an upload (files written, manifest not yet)
    fs.invalidate_cache()  # the final fit wrote from another process: list the store as it is now
    for key in fs.find(bucket):  # nothing secret in any object on the store
        data = fs.cat_file(key)
        assert all(s3_env[k].encode() not in data for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")), key


RUN_ON_STORE = """
import sys, time, torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint

class Net(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.Linear(32, 1))
    def training_step(self, batch, batch_idx):
        time.sleep(float(sys.argv[3]))  # slow enough for the test to kill it mid-run
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
trainer = ember.Trainer(max_steps=int(sys.argv[2]), default_root_dir=sys.argv[1], log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(every_n_train_steps=int(sys.argv[4]), async_save=True)])
trainer.fit(Net(), DataLoader(data, batch_size=4), ckpt_path="last")
print(trainer.run_url, trainer.global_step)
"""


def test_run_versions_are_claimed_with_a_conditional_write_the_server_enforces(
    tmp_path: Path, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{_bucket(s3_env)}/runs/net"
    monkeypatch.setattr(run_store, "store_versions", lambda fs, root: [])  # as if the listing lagged the claims
    runs = [run_store.claim_version(url, tmp_path / f"machine-{i}") for i in range(3)]
    assert [r[1] for r in runs] == [f"{url}/version_{i}" for i in range(3)]
    fs, root = open_store(url)
    with pytest.raises(FileExistsError):  # If-None-Match: * refused by the server, not checked by the client
        fs.pipe_file(f"{root}/version_0/{run_store.CLAIM_FILE}", b"{}", mode="create")


@pytest.mark.slow  # 10-30 s on 2 cores: two fresh processes that import torch and s3fs, one killed mid-run
def test_a_run_on_s3_killed_mid_run_leaves_a_loadable_last_and_logs_then_resumes_on_an_empty_machine(
    tmp_path: Path, s3_env: dict[str, str]
) -> None:
    url = f"s3://{_bucket(s3_env)}/runs"
    script = tmp_path / "fit.py"
    script.write_text(RUN_ON_STORE)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", EMBER_SYNC_EVERY_S="0.2")
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        [sys.executable, str(script), url, "400", "0.05", "1"], stdout=log, stderr=subprocess.STDOUT,
        env=dict(env, EMBER_CACHE=str(tmp_path / "machine-a")),
    )  # fmt: skip
    fs, root = open_store(url)
    run = f"{root}/net/version_0"
    try:
        deadline = time.monotonic() + 60
        while not (fs.exists(f"{run}/checkpoints/last") and fs.exists(f"{run}/metrics.csv")):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-2000:]
            time.sleep(0.1)
            fs.invalidate_cache()
    finally:
        first.kill()  # SIGKILL: no end of run, no last sync
        first.wait(timeout=30)
        log.close()
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(f"{run}/status.json"))["status"] == "running"
    assert fs.cat_file(f"{run}/metrics.csv").startswith(b"step,")
    found = run_store.find_last(f"{url}/net", tmp_path / "machine-b", "fit")
    assert found is not None and found[1] == tmp_path / "machine-b" / "version_0"
    resumed_from = found[0].name
    assert resumed_from.startswith("epoch=") and 0 < int(resumed_from.rsplit("=", 1)[1]) < 60
    second = subprocess.run(
        [sys.executable, str(script), url, "60", "0", "30"], capture_output=True, text=True, timeout=120,
        env=dict(env, EMBER_CACHE=str(tmp_path / "machine-c")),
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.split()[-2:] == [f"{url}/net/version_0", "60"]
    assert "resuming from" in second.stderr
    assert s3_env["AWS_ACCESS_KEY_ID"] not in second.stderr and s3_env["AWS_SECRET_ACCESS_KEY"] not in second.stderr
    fs.invalidate_cache()
    status = json.loads(fs.cat_file(f"{run}/status.json"))
    assert status["status"] == "finished" and status["global_step"] == 60
    assert not fs.exists(f"{root}/net/version_1")  # the resume continued version_0


def _fork(work: Callable[[], object], exit_code: int) -> int:
    """A child process (forked: importing torch and s3fs again would cost seconds) that does `work`, then
    exits with `exit_code` at once, running no cleanup: as if it were killed. Returns its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work()
            code = exit_code
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _exit_status(pid: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked process {pid} did not exit within {timeout_s} s")


def test_the_run_lock_on_s3_refuses_a_second_writer_and_is_taken_over_from_a_killed_one(
    tmp_path: Path, s3_env: dict[str, str]
) -> None:
    from ember.checkpoint.run_lock import RunLockedError
    from ember.checkpoint.store_lock import StoreRunLock

    url = f"s3://{_bucket(s3_env)}/runs/net/version_0"
    lock = StoreRunLock.acquire(url)
    fs, root = open_store(url)
    try:
        with pytest.raises(RunLockedError, match=f"is being written by another process: pid {os.getpid()} on host"):
            StoreRunLock.acquire(url)
        with pytest.raises(FileExistsError):  # a claim is a conditional create the server enforces
            fs.pipe_file(lock.path, b"{}", mode="create")
    finally:
        lock.release()
    fs.invalidate_cache()
    assert not fs.exists(root)  # the claim was the run's only object
    assert _exit_status(_fork(lambda: StoreRunLock.acquire(url), exit_code=9)) == 9  # exited without releasing
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False, refresh=True)] == [".writer-0.lock"]
    lock = StoreRunLock.acquire(url)  # its process is gone (same host): taken over at once
    try:
        assert lock.path.endswith("/.writer-1.lock")
        fs.invalidate_cache()
        assert [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False, refresh=True)] == [".writer-1.lock"]
    finally:
        lock.release()

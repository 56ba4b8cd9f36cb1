"""A run has one writer (docs/checkpoints.md, "One writer per run").

Two ``ember fit --resume last`` of the same run at once: exactly one trains, the other exits 2 at once with one
line naming the holder (pid, host, since when) and what to do. A holder killed with SIGKILL does not lock the
run: the next resume takes it over. A new run (no resume) is never blocked: it claims a fresh version. Each
holder here is a real ``ember fit`` process held at ``on_train_start`` by a `Gate` callback until the test lets
it go, so the second process always meets a run that is being written. In one process: a refused resume changes
nothing in the run, and the lock is let go on an error and on a preemption exit. Under DDP only process 0 holds
the lock, and a refusal reaches every process. The lock itself (staleness, takeover races, heartbeat) is
tests/unit/checkpoint/test_run_lock.py.
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from rel_helpers import CONFIG, assert_one_line_error, make_project, run_cli

import ember

pytestmark = pytest.mark.usefixtures("clean_imports")

CSV = "  logger:\n    - _target_: ember.loggers.CSVLogger\n  log_every_n_steps: 1\n"
LOGGED = CONFIG.replace("  logger: false\n", CSV)

GATE = """\
import os
import time
from pathlib import Path
from typing import Any

import ember


class Gate(ember.Callback):
    \"\"\"Holds the run at on_train_start: writes `folder`/started (its pid), then waits for `folder`/go.\"\"\"

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_start(self, trainer, module) -> None:
        (self.folder / "started").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not (self.folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
"""


def _project(root: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A project trained for 2 epochs (8 steps, a checkpoint per epoch, metrics.csv) with a gate overlay."""
    make_project(root, LOGGED)
    (root / "gate.py").write_text(GATE)
    (root / "gate.yaml").write_text(f"trainer:\n  callbacks:\n    - _target_: gate.Gate\n      folder: {root}\n")
    code, _, err = run_cli(["fit", "-c", "net.yaml"], capsys)
    assert code == 0, err
    return root / "runs" / "net" / "version_0"


def _ember(root: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "ember", "fit", "-c", str(root / "net.yaml"), *args]


def _start_holder(root: Path) -> subprocess.Popen[str]:
    """``ember fit --resume last`` held at on_train_start (it has claimed the run by then)."""
    env = dict(os.environ, PYTHONPATH=str(Path(ember.__file__).parents[1]), OMP_NUM_THREADS="1")
    command = _ember(root, "-c", str(root / "gate.yaml"), "--resume", "last", "trainer.max_epochs=4")
    holder = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (root / "started").exists():
        if holder.poll() is not None or time.monotonic() > deadline:
            holder.kill()
            pytest.fail(f"the holder never reached on_train_start:\n{holder.communicate()[0]}", pytrace=False)
        time.sleep(0.05)
    return holder


def _steps(run_dir: Path) -> list[int]:
    with (run_dir / "metrics.csv").open() as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]


def _checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())


@pytest.mark.slow
def test_a_second_resume_of_a_run_being_written_exits_2_at_once_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = _project(tmp_path, capsys)
    holder = _start_holder(tmp_path)
    try:
        env = dict(os.environ, PYTHONPATH=str(Path(ember.__file__).parents[1]), OMP_NUM_THREADS="1")
        second = subprocess.run(_ember(tmp_path, "--resume", "last", "trainer.max_epochs=4"), cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=90)  # fmt: skip
        assert holder.poll() is None, "the holder did not hold the run while the second process ran"
        assert second.returncode == 2, second.stdout + second.stderr
        line = assert_one_line_error(second.stderr, f"pid {holder.pid}", socket.gethostname(), "since ")
        assert "wait for it to finish" in line and "EMBER_RUN_LOCK_TIMEOUT_S" in line
        # a new run is never blocked by another run's writer: it claims the next version
        code, _, err = run_cli(["fit", "-c", "net.yaml", "trainer.max_epochs=1"], capsys)
        assert code == 0, err
        assert (tmp_path / "runs" / "net" / "version_1" / "checkpoints" / "last").is_file()
    finally:
        (tmp_path / "go").touch()
        output = holder.communicate(timeout=180)[0]
    assert holder.returncode == 0, output
    # one writer: epochs 2 and 3 once each, no checkpoint renamed around another's (``-v1``)
    assert _checkpoint_names(run_dir) == ["epoch=3-step=12"]
    steps = _steps(run_dir)
    assert steps == list(range(12)), f"metrics.csv rows: {steps}"  # steps 1-12 at rows 0-11
    assert not list(run_dir.glob(".writer-*")), "the lock outlived the run"


@pytest.mark.slow
def test_a_holder_killed_with_sigkill_does_not_lock_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _project(tmp_path, capsys)
    holder = _start_holder(tmp_path)
    (lock,) = run_dir.glob(".writer-*.lock")
    assert f'"pid": {holder.pid}' in lock.read_text()
    holder.send_signal(signal.SIGKILL)
    holder.communicate(timeout=60)
    assert lock.exists(), "a killed process cannot remove its lock: the test would prove nothing"
    # same host, pid gone: stale at once; the resume takes the run over and continues it
    code, _, err = run_cli(["fit", "-c", "net.yaml", "--resume", "last", "trainer.max_epochs=4"], capsys)
    assert code == 0, err
    assert _checkpoint_names(run_dir) == ["epoch=3-step=12"]
    steps = _steps(run_dir)
    assert sorted(Counter(steps).values()) == [1] * 12 and sorted(steps) == list(range(12)), steps
    assert not list(run_dir.glob(".writer-*")), "the lock outlived the run"


# --- in one process: what a refused run leaves, and the lock let go on every way out ---------------------------


def test_a_refused_resume_writes_nothing_into_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ember.checkpoint.run_lock import RunLock

    run_dir = _project(tmp_path, capsys)
    before = {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    held = RunLock.acquire(run_dir)  # held by this very process: its pid is alive
    try:
        code, _, err = run_cli(["fit", "-c", "net.yaml", "--resume", "last", "trainer.max_epochs=4"], capsys)
        assert code == 2
        assert_one_line_error(err, f"is being written by another process: pid {os.getpid()} on host")
        after = {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
        del after[held.path.relative_to(run_dir)]
        assert after == before, "the refused run changed the run directory"
    finally:
        held.release()


class _Tiny(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        import torch

        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        import torch

        return torch.optim.SGD(self.parameters(), lr=0.1)


class _AtStep(ember.Callback):
    """Calls `act` after step `step`, recording whether the run held its lock file then."""

    def __init__(self, step: int, act: Any) -> None:
        self.step, self.act = step, act
        self.held: list[str] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            self.held = [p.name for p in trainer.run_dir.glob(".writer-*.lock")]
            self.act()


def _tiny_fit(root: Path, callback: ember.Callback, ckpt_path: str | None = None) -> ember.Trainer:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=4)
    trainer = ember.Trainer(max_epochs=2, default_root_dir=root, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[callback])  # fmt: skip
    trainer.fit(_Tiny(), data, ckpt_path=ckpt_path)
    return trainer


def _fail() -> None:
    raise RuntimeError("boom")


@pytest.mark.parametrize("how", ["error", "preemption"])
def test_the_run_is_let_go_on_an_error_and_on_a_preemption_exit(tmp_path: Path, how: str) -> None:
    callback = _AtStep(2, _fail if how == "error" else lambda: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(RuntimeError if how == "error" else SystemExit) as stopped:
        _tiny_fit(tmp_path, callback)
    if how == "preemption":
        assert stopped.value.code == 75
    run_dir = tmp_path / "_tiny" / "version_0"
    assert callback.held == [".writer-0.lock"], "the fit did not hold its run"
    assert not list(run_dir.glob(".writer-*")), "the lock outlived the run"
    resumed = _tiny_fit(tmp_path, _AtStep(-1, lambda: None), ckpt_path="last")  # the run is free again
    assert resumed.run_dir == run_dir and resumed.global_step == 8


# --- several processes: only process 0 holds the run, and a refusal stops every process ------------------------

DDP_JOB = """\
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import dist_workload as workload
import ember
from ember.checkpoint.run_lock import RunLock, RunLockedError
from ember.strategies import DDPStrategy

out, root = Path(sys.argv[1]), Path(sys.argv[2])


class Net(ember.TrainingModule):
    def __init__(self):
        super().__init__()
        self.model, self.loss_fn = torch.nn.Linear(2, 1), torch.nn.MSELoss()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Looks(ember.Callback):
    # the pids the run's lock files name, seen from this process at its first step

    def __init__(self):
        self.pids = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.pids is None:
            self.pids = [json.loads(p.read_text())["pid"] for p in trainer.run_dir.glob(".writer-*.lock")]


def fit(ckpt_path, callbacks):
    data = DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=4)
    trainer = ember.Trainer(strategy=DDPStrategy(timeout_s=workload.PG_TIMEOUT_S), devices=2, accelerator="cpu",
                            max_epochs=1, default_root_dir=root, run_name="net", logger=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(Net(), data, ckpt_path=ckpt_path)
    return trainer


def held():
    looks = Looks()
    trainer = fit(None, [looks])
    return {"pid": os.getpid(), "rank": trainer.global_rank, "lock_pids": looks.pids, "run_dir": str(trainer.run_dir)}


def refused():
    run_dir = root / "net" / "version_0"
    own = RunLock.acquire(run_dir) if os.environ["RANK"] == "0" else None  # process 0 of this job holds it
    try:
        fit("last", [])
    except RunLockedError as exc:
        return {"error": str(exc)}
    finally:
        if own is not None:
            own.release()
    return {"error": None}


for name, run in {"held": held, "refused": refused}.items():
    workload.section(out, name, run)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_under_ddp_only_process_0_holds_the_run_and_a_refusal_stops_every_process(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    import dist_harness as harness

    script = harness.write_script(tmp_path, DDP_JOB)
    job = harness.run(harness.spawn(script, str(tmp_path / "out"), str(tmp_path / "runs")), tmp_path, timeout=240)
    assert not job.timed_out, harness.describe(job)
    held = harness.results(tmp_path / "out", "held", 2, job)
    rank0_pid = held[0]["pid"]
    assert [r["lock_pids"] for r in held] == [[rank0_pid], [rank0_pid]], "not exactly process 0's lock"
    assert not list((tmp_path / "runs").rglob(".writer-*")), "the lock outlived the run"
    for result in harness.results(tmp_path / "out", "refused", 2, job):
        assert result["error"] is not None, "a process trained on a run another process holds"
        assert f"is being written by another process: pid {rank0_pid} on host" in result["error"]
    assert job.returncode == 0, harness.describe(job)


def test_a_writer_whose_run_was_taken_over_writes_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder stalled past the timeout and another host took the run over: its next save raises instead."""
    import json

    from ember.checkpoint.run_lock import RunLockedError

    monkeypatch.setenv("EMBER_RUN_LOCK_TIMEOUT_S", "0.4")  # a heartbeat every 0.1 s
    run_dir = tmp_path / "_tiny" / "version_0"
    taker = run_dir / ".writer-1.lock"

    def take_over() -> None:
        holder = {"host": "other-node", "machine": "m", "pid": 4242, "process_start": "", "since": time.time()}
        taker.write_text(json.dumps({**holder, "token": "t" * 32}))
        (run_dir / ".writer-0.lock").unlink()
        deadline = time.monotonic() + 1.0  # a few heartbeats of the holder, while the taker's keeps beating
        while time.monotonic() < deadline:
            os.utime(taker)
            time.sleep(0.02)

    with pytest.raises(RunLockedError) as lost:
        _tiny_fit(tmp_path, _AtStep(2, take_over))  # the epoch-end checkpoint comes at step 4
    assert f"this process no longer holds run {run_dir}" in str(lost.value)
    assert "pid 4242 on host other-node" in str(lost.value)
    assert not list((run_dir / "checkpoints").glob("epoch=*")), "the displaced writer wrote a checkpoint"
    assert taker.exists(), "the displaced writer removed the new holder's lock"

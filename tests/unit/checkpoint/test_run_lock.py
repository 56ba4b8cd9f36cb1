"""`ember.checkpoint.run_lock`: one writer per run, a dead holder never locks a run forever, and a takeover is
race-free between contenders.

Holders on "another host" are lock files written the way another node's ember writes them (its host name and
machine identity); holders on this host are real processes (this one, a finished child, a zombie).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ember.checkpoint import CheckpointError
from ember.checkpoint.run_lock import TIMEOUT_ENV, Holder, RunLock, RunLockedError, timeout_s

#: Above Linux's largest pid_max (2**22): no process has it.
NO_SUCH_PID = 2**22 + 12345


def _write_claim(run_dir: Path, number: int, age_s: float = 0.0, **fields: Any) -> Path:
    """A lock file as another process would have left it (by default: a live-looking one on another host)."""
    holder = {"host": "other-node", "machine": "m", "pid": 4242, "process_start": "7", "since": time.time() - 60}
    holder |= {"token": "t" * 32, **fields}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f".writer-{number}.lock"
    path.write_text(json.dumps(holder))
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def _this_host(pid: int, process_start: str = "") -> dict[str, Any]:
    me = Holder.of_this_process()
    return {"host": me.host, "machine": me.machine, "pid": pid, "process_start": process_start}


def _files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir())


def test_a_claim_names_its_holder_refuses_a_second_and_is_removed_on_release(tmp_path: Path) -> None:
    lock = RunLock.acquire(tmp_path)
    try:
        assert _files(tmp_path) == [".writer-0.lock"]
        saved = json.loads(lock.path.read_text())
        assert saved["pid"] == os.getpid() and saved["host"] == socket.gethostname()
        assert saved["token"] == lock.holder.token and abs(saved["since"] - time.time()) < 60
        with pytest.raises(RunLockedError) as refused:
            RunLock.acquire(tmp_path)  # this very process still holds it: the pid is alive
        message = str(refused.value)
        assert f"run {tmp_path} is being written by another process: pid {os.getpid()} on host " in message
        assert "(lock .writer-0.lock). A run has one writer: wait for it to finish, or stop it" in message
        assert "\n" not in message
        assert _files(tmp_path) == [".writer-0.lock"], "a refused claim left a file behind"
    finally:
        lock.release()
    assert _files(tmp_path) == []
    RunLock.acquire(tmp_path).release()  # free again


def test_a_holder_on_this_host_whose_process_is_gone_is_taken_over_at_once(tmp_path: Path) -> None:
    # a fresh heartbeat: only the pid (above any this machine hands out) says it is dead
    _write_claim(tmp_path, 3, age_s=0.0, **_this_host(NO_SUCH_PID))
    lock = RunLock.acquire(tmp_path)
    try:
        assert lock.path.name == ".writer-4.lock" and _files(tmp_path) == [".writer-4.lock"]
    finally:
        lock.release()


def test_a_pid_now_running_another_process_is_not_the_holder(tmp_path: Path) -> None:
    _write_claim(tmp_path, 0, **_this_host(os.getpid(), process_start="1"))  # this pid, started at another time
    RunLock.acquire(tmp_path).release()


def test_a_killed_holder_not_yet_reaped_is_dead(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        _write_claim(tmp_path, 0, **_this_host(child.pid, start))
        with pytest.raises(RunLockedError, match=f"pid {child.pid} on host"):
            RunLock.acquire(tmp_path)  # alive
        child.kill()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not become a zombie"
            time.sleep(0.01)
        RunLock.acquire(tmp_path).release()  # a zombie writes nothing more
    finally:
        child.kill()
        child.wait()


def test_a_holder_on_another_host_holds_until_its_heartbeat_is_older_than_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "30")
    claim = _write_claim(tmp_path, 5, age_s=20)
    with pytest.raises(RunLockedError) as refused:
        RunLock.acquire(tmp_path)
    message = str(refused.value)
    assert "pid 4242 on host other-node since " in message and ", last heartbeat 20 s ago" in message
    assert "elsewhere 30 s after its last heartbeat (EMBER_RUN_LOCK_TIMEOUT_S)" in message
    stamp = time.time() - 31
    os.utime(claim, (stamp, stamp))
    lock = RunLock.acquire(tmp_path)
    try:
        assert _files(tmp_path) == [".writer-6.lock"]
    finally:
        lock.release()


def test_an_unreadable_lock_holds_while_fresh_and_is_taken_over_once_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "30")
    garbage = tmp_path / ".writer-0.lock"
    garbage.write_bytes(b"\x00not json")
    with pytest.raises(RunLockedError, match=re.escape("a process whose lock .writer-0.lock is unreadable")):
        RunLock.acquire(tmp_path)
    stamp = time.time() - 60
    os.utime(garbage, (stamp, stamp))
    RunLock.acquire(tmp_path).release()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan"])
def test_a_bad_timeout_setting_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, value)
    expected = f"EMBER_RUN_LOCK_TIMEOUT_S='{value}': expected a number of seconds > 0 (default 120)"
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        timeout_s()


def test_the_heartbeat_keeps_the_lock_fresh(tmp_path: Path) -> None:
    lock = RunLock.acquire(tmp_path, timeout=0.4)  # a beat every 0.1 s
    try:
        stamp = time.time() - 100
        os.utime(lock.path, (stamp, stamp))
        deadline = time.monotonic() + 10
        while time.time() - lock.path.stat().st_mtime > 50:
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.02)
    finally:
        lock.release()


def test_a_holder_taken_over_while_its_heartbeat_stalled_stops_writing(tmp_path: Path) -> None:
    lock = RunLock.acquire(tmp_path, timeout=0.4)
    try:
        other = _write_claim(tmp_path, 1)  # a taker on another host, once this holder's heartbeat was past the timeout,
        lock.path.unlink()  # claims the run, then removes the claim it found dead
        deadline = time.monotonic() + 10
        while True:
            os.utime(other)
            try:
                lock.check()
            except RunLockedError as exc:
                message = str(exc)
                break
            assert time.monotonic() < deadline, "the holder never noticed"
            time.sleep(0.02)
        assert f"this process no longer holds run {tmp_path} (run {tmp_path} is being written by another " in message
        assert "pid 4242 on host other-node" in message and "it writes no checkpoint there" in message
    finally:
        lock.release()
    assert _files(tmp_path) == [".writer-1.lock"], "the holder that lost the run removed the taker's lock"


def test_a_lock_removed_by_hand_is_claimed_again_when_nobody_holds_the_run(tmp_path: Path) -> None:
    lock = RunLock.acquire(tmp_path, timeout=0.4)
    try:
        lock.path.unlink()
        deadline = time.monotonic() + 10
        while not list(tmp_path.glob(".writer-*.lock")):
            assert time.monotonic() < deadline, "the claim was not made again"
            time.sleep(0.02)
        lock.check()  # still the writer
        assert json.loads(lock.path.read_text())["token"] == lock.holder.token
    finally:
        lock.release()
    assert _files(tmp_path) == []


def _release_in_child(lock: RunLock) -> None:
    lock.release()


def test_a_forked_child_never_releases_its_parents_lock(tmp_path: Path) -> None:
    lock = RunLock.acquire(tmp_path)
    try:
        child = multiprocessing.get_context("fork").Process(target=_release_in_child, args=(lock,))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert lock.path.exists()
    finally:
        lock.release()


# --- contenders at the same instant ------------------------------------------------------------------------


def _contend(run_dir: str, start: Any, done: Any, out: Any) -> None:
    start.wait()  # every contender leaves the barrier at the same instant
    try:
        lock = RunLock.acquire(Path(run_dir), timeout=30)
    except RunLockedError as exc:
        out.put(("refused", str(exc)))
        return
    out.put(("holds", os.getpid()))
    done.wait(60)  # hold the run until every other contender has tried
    lock.release()


@pytest.mark.parametrize("before", ["nothing", "a stale lock of another host", "a lock of a dead process here"])
def test_of_contenders_claiming_at_the_same_instant_exactly_one_holds_the_run(tmp_path: Path, before: str) -> None:
    context = multiprocessing.get_context("fork")
    for round_ in range(3):
        run_dir = tmp_path / f"round-{round_}"
        if before == "a stale lock of another host":
            _write_claim(run_dir, 2, age_s=120)
        elif before == "a lock of a dead process here":
            _write_claim(run_dir, 2, **_this_host(NO_SUCH_PID))
        out, start, done = context.Queue(), context.Barrier(6, timeout=60), context.Event()
        procs = [context.Process(target=_contend, args=(str(run_dir), start, done, out)) for _ in range(6)]
        for proc in procs:
            proc.start()
        results = [out.get(timeout=60) for _ in procs]
        done.set()
        for proc in procs:
            proc.join(timeout=60)
        holders = [value for kind, value in results if kind == "holds"]
        assert len(holders) == 1, results
        for kind, value in results:
            if kind == "refused":
                assert f"pid {holders[0]} on host" in value, value
        assert _files(run_dir) == [], "the holder's release left a file, or a contender's claim was left behind"

"""`ember.checkpoint.store_lock`: one writer per run on a store (``memory://`` here; S3 in
tests/integration/test_store_s3.py): the second claim is refused naming the holder, a dead holder is taken
over (at once on this host, after the heartbeat timeout elsewhere), and a holder overtaken stops writing.

Holders on "another host" are lock objects written the way another machine's ember writes them."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ember.checkpoint.run_lock import TIMEOUT_ENV, Holder, RunLockedError
from ember.checkpoint.store import open_store
from ember.checkpoint.store_lock import StoreRunLock

NO_SUCH_PID = 2**22 + 12345  # above Linux's largest pid_max: no process has it


@pytest.fixture
def url() -> Iterator[str]:
    """A run's URL on a ``memory://`` store of this test's own, removed afterwards."""
    bucket = f"memory://ember-lock-{uuid.uuid4().hex}"
    yield f"{bucket}/runs/net/version_0"
    fs, path = open_store(bucket)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def _objects(url: str) -> list[str]:
    fs, root = open_store(url)
    return sorted(str(p).rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) if fs.exists(root) else []


def _write_claim(url: str, number: int, **fields: Any) -> None:
    """A claim as another process left it (by default: a live-looking one on another host)."""
    holder = {"host": "other-node", "machine": "m", "pid": 4242, "process_start": "7", "since": time.time() - 60}
    holder |= {"token": "t" * 32, **fields}
    fs, root = open_store(url)
    fs.pipe_file(f"{root}/.writer-{number}.lock", json.dumps(holder).encode())


def _this_host(pid: int) -> dict[str, Any]:
    me = Holder.of_this_process()
    return {"host": me.host, "machine": me.machine, "pid": pid, "process_start": ""}


def test_a_claim_names_its_holder_refuses_a_second_and_is_removed_on_release(url: str) -> None:
    lock = StoreRunLock.acquire(url)
    try:
        assert _objects(url) == [".writer-0.lock"]
        fs, root = open_store(url)
        saved = json.loads(fs.cat_file(f"{root}/.writer-0.lock"))
        assert saved["pid"] == os.getpid() and saved["token"] == lock.holder.token
        with pytest.raises(RunLockedError) as refused:
            StoreRunLock.acquire(url)  # this very process still holds it: its pid is alive
        message = str(refused.value)
        assert message.startswith(f"run {url} is being written by another process: pid {os.getpid()} on host ")
        assert "(lock .writer-0.lock on the store). A run has one writer: wait for it to finish" in message
        assert "\n" not in message
        assert _objects(url) == [".writer-0.lock"], "a refused claim left an object behind"
    finally:
        lock.release()
    assert _objects(url) == []
    StoreRunLock.acquire(url).release()  # free again


def test_a_killed_writer_on_this_host_is_taken_over_at_once(url: str) -> None:
    _write_claim(url, 3, **_this_host(NO_SUCH_PID))  # written a moment ago: only the pid says it is dead
    lock = StoreRunLock.acquire(url)
    try:
        assert lock.path.endswith("/.writer-4.lock") and _objects(url) == [".writer-4.lock"]
    finally:
        lock.release()


def test_a_writer_on_another_host_holds_until_its_heartbeat_is_older_than_the_timeout(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    _write_claim(url, 0)
    with pytest.raises(RunLockedError) as refused:
        StoreRunLock.acquire(url)
    assert "pid 4242 on host other-node since " in str(refused.value)
    assert "elsewhere 0.5 s after its last heartbeat (EMBER_RUN_LOCK_TIMEOUT_S)" in str(refused.value)
    time.sleep(0.6)  # no heartbeat since: by the store's clock the claim is now stale
    lock = StoreRunLock.acquire(url)
    try:
        assert _objects(url) == [".writer-1.lock"]
    finally:
        lock.release()


def test_the_heartbeat_rewrites_the_claim_and_a_holder_overtaken_stops_writing(url: str) -> None:
    lock = StoreRunLock.acquire(url, timeout=3600)  # no background beat during the test: beats by hand
    try:
        fs, _ = open_store(url)
        before = fs.modified(lock.path)
        time.sleep(0.01)
        lock.beat()
        assert fs.modified(lock.path) > before
        lock.check()  # still the holder
        _write_claim(url, 1)  # another process took the run over
        lock.beat()
        with pytest.raises(RunLockedError, match=r"no longer holds run .* overtaken by a newer claim"):
            lock.check()
    finally:
        lock.release()
    assert _objects(url) == [".writer-1.lock"]  # its own claim removed, the new holder's left alone

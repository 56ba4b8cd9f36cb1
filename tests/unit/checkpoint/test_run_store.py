"""`ember.checkpoint.run_store`: the staging folder a URL root maps to, the log sync (what it uploads, when again,
what a failing store costs), bringing a run's logs back, and the sync period's check."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ember.checkpoint import run_store
from ember.checkpoint.store import open_store


@pytest.fixture
def url() -> Iterator[str]:
    """A ``memory://`` run folder of this test's own, removed afterwards."""
    folder = f"memory://ember-sync-{uuid.uuid4().hex}/runs/net/version_0"
    yield folder
    fs, root = open_store(folder)
    bucket = root.split("/", 2)[1]
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)


def _objects(url: str) -> dict[str, bytes]:
    fs, root = open_store(url)
    return {name[len(root) + 1 :]: fs.cat_file(name) for name in fs.find(root)}


def test_staging_dir_is_under_ember_cache_and_one_per_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(run_store.CACHE_ENV, str(tmp_path))
    a = run_store.staging_dir("s3://bucket/runs")
    assert a.parent == tmp_path / "runs" and len(a.name) == 16
    assert run_store.staging_dir("s3://bucket/runs/") == a
    assert run_store.staging_dir("s3://bucket/other") != a
    monkeypatch.delenv(run_store.CACHE_ENV)
    assert run_store.staging_dir("s3://bucket/runs") == Path.home() / ".cache" / "ember" / "runs" / a.name


def test_sync_uploads_the_logs_once_each_change_never_checkpoints_or_hidden_files(tmp_path: Path, url: str) -> None:
    run = tmp_path / "version_0"
    (run / "tensorboard").mkdir(parents=True)
    (run / "checkpoints" / "step=1").mkdir(parents=True)
    (run / "metrics.csv").write_text("step,loss\n0,1.0\n")
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"\x00event")
    (run / "checkpoints" / "step=1" / "ember.pt").write_bytes(b"weights")
    (run / ".writer-0.lock").write_text("held")
    sync = run_store.LogSync(run, url, every_s=3600)  # the thread stays asleep: only the calls below sync
    try:
        assert sync.sync() == ["metrics.csv", "tensorboard/events.out.tfevents.1"]
        assert _objects(url) == {
            "metrics.csv": b"step,loss\n0,1.0\n",
            "tensorboard/events.out.tfevents.1": b"\x00event",
        }
        assert sync.sync() == []  # nothing changed: nothing uploaded again
        with (run / "metrics.csv").open("a") as f:
            f.write("1,0.5\n")
        assert sync.sync() == ["metrics.csv"]
        (run / "status.json").write_text('{"status": "finished"}')
    finally:
        sync.close()  # the last sync
    assert _objects(url)["metrics.csv"] == b"step,loss\n0,1.0\n1,0.5\n"
    assert _objects(url)["status.json"] == b'{"status": "finished"}'


def test_the_thread_syncs_every_period(tmp_path: Path, url: str) -> None:
    (tmp_path / "status.json").write_text("running")
    sync = run_store.LogSync(tmp_path, url, every_s=0.02)
    try:
        deadline = time.monotonic() + 5
        # fsspec's memory store shows an object while its bytes are still being written: wait for what a sync leaves
        while _objects(url) != {"status.json": b"running"} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _objects(url) == {"status.json": b"running"}
    finally:
        sync.close()


class _Down:
    """A store that refuses every upload."""

    def put_file(self, *args: Any) -> None:
        raise ConnectionError("store unreachable\nsecond line")


def test_a_failing_store_costs_one_warning_line_and_never_raises(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "metrics.csv").write_text("step\n")
    sync = run_store.LogSync(tmp_path, url, every_s=0.01)
    sync.fs = _Down()
    time.sleep(0.2)  # about 20 periods, each failing
    sync.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "second line" not in "".join(err)
    assert err[0].startswith(f"ember: warning: syncing logs to {url} failed (ConnectionError: store unreachable)")
    assert "last sync" in err[1] and f"complete in {tmp_path}" in err[1]


def test_restore_logs_brings_back_what_the_run_dir_lacks_but_no_checkpoint_or_claim(tmp_path: Path, url: str) -> None:
    fs, root = open_store(url)
    for name, data in {
        "metrics.csv": b"rows", "config.yaml": b"cfg", "checkpoints/last": b"step=1", "claim.json": b"{}",
        "eval/test-step=1.json": b"{}",
    }.items():  # fmt: skip
        fs.pipe_file(f"{root}/{name}", data)
    run = tmp_path / "version_0"
    run.mkdir()
    (run / "config.yaml").write_text("mine")
    assert run_store.restore_logs(fs, root, run) == ["eval/test-step=1.json", "metrics.csv"]
    assert (run / "metrics.csv").read_bytes() == b"rows" and (run / "config.yaml").read_text() == "mine"
    assert not (run / "checkpoints").exists() and not (run / "claim.json").exists()


@pytest.mark.parametrize(("raw", "expected"), [(None, 30.0), ("0.5", 0.5), ("120", 120.0)])
def test_sync_period_comes_from_the_environment(
    raw: str | None, expected: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    if raw is None:
        monkeypatch.delenv(run_store.SYNC_ENV, raising=False)
    else:
        monkeypatch.setenv(run_store.SYNC_ENV, raw)
    assert run_store.sync_every_s() == expected


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "nan"])
def test_a_bad_sync_period_says_what_to_give(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(run_store.SYNC_ENV, raw)
    with pytest.raises(ValueError, match=r"EMBER_SYNC_EVERY_S=.* must be a number of seconds > 0 \(default 30\)"):
        run_store.sync_every_s()
    assert os.environ[run_store.SYNC_ENV] == raw

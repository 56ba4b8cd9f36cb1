"""ember/checkpoint/writing.py: a staged checkpoint's fsyncs run together, and all of them before the rename."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from ember.checkpoint import writing


def test_fsync_together_syncs_every_path_at_the_same_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [tmp_path / f"f{i}" for i in range(4)]
    together = threading.Barrier(len(paths), timeout=5)  # one after another, the first would wait in vain
    synced: list[Path] = []

    def fsync_path(path: Path) -> None:
        together.wait()
        synced.append(path)

    monkeypatch.setattr(writing, "fsync_path", fsync_path)
    writing.fsync_together(paths)
    assert sorted(synced) == paths


def test_fsync_together_raises_a_failure_once_the_others_are_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [tmp_path / f"f{i}" for i in range(3)]
    finished: list[Path] = []
    started = threading.Barrier(len(paths), timeout=10)

    def fsync_path(path: Path) -> None:
        started.wait()
        if path == paths[0]:
            raise OSError(5, "Input/output error")
        finished.append(path)

    monkeypatch.setattr(writing, "fsync_path", fsync_path)
    with pytest.raises(OSError, match="Input/output error"):
        writing.fsync_together(paths)
    assert sorted(finished) == paths[1:]


def test_one_path_is_synced_on_the_calling_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    monkeypatch.setattr(writing, "fsync_path", lambda path: threads.append(threading.current_thread().name))
    writing.fsync_together([tmp_path])
    assert threads == [threading.current_thread().name]


@pytest.mark.parametrize("set_last", [False, True])
def test_finish_makes_every_file_durable_before_the_rename_and_the_rename_before_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, set_last: bool
) -> None:
    events: list[str] = []
    lock = threading.Lock()
    real_fsync, real_rename, real_replace = writing.fsync_path, os.rename, os.replace

    def fsync_path(path: Path) -> None:
        with lock:
            events.append(f"fsync {path.relative_to(tmp_path)}")
        real_fsync(path)

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(f"rename {Path(src).relative_to(tmp_path)}")
        real_rename(src, dst)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(f"replace {Path(src).relative_to(tmp_path)} -> {Path(dst).relative_to(tmp_path)}")
        real_replace(src, dst)

    monkeypatch.setattr(writing, "fsync_path", fsync_path)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    (tmp_path / "last").write_text("step=0\n")
    staged = writing.stage_checkpoint(tmp_path / "step=1", {"a": 1}, {"w": torch.ones(3)}, {"b": 2}, set_last)
    tmp = staged.tmp.name
    written = sorted(p.name for p in staged.tmp.iterdir())
    assert staged.finish() == tmp_path / "step=1"
    pointer = f".last.tmp-{os.getpid()}"
    rename_at = events.index(f"rename {tmp}")
    synced_first = [f"fsync {tmp}/{name}" for name in written] + [f"fsync {tmp}"] + [f"fsync {pointer}"] * set_last
    assert sorted(events[:rename_at]) == sorted(synced_first)
    # The rename made durable; only then `last` replaced, and that made durable too.
    assert events[rename_at + 1 :] == ["fsync ."] + [f"replace {pointer} -> last", "fsync ."] * set_last
    assert sorted(p.name for p in (tmp_path / "step=1").iterdir()) == written
    assert (tmp_path / "last").read_text() == ("step=1\n" if set_last else "step=0\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step=1"]  # no temporary left


def test_a_failed_finish_leaves_last_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "last").write_text("step=0\n")
    staged = writing.stage_checkpoint(tmp_path / "step=1", {"a": 1}, {"w": torch.ones(3)}, {"b": 2}, set_last=True)

    def fsync_path(path: Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writing, "fsync_path", fsync_path)
    with pytest.raises(writing.CheckpointWriteError, match="Input/output error"):
        staged.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    assert (tmp_path / "last").read_text() == "step=0\n"


def test_where_no_thread_can_start_the_caller_syncs_every_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background write finishing while the interpreter exits cannot start threads: it still syncs all."""
    paths = [tmp_path / f"f{i}" for i in range(3)]
    synced: list[tuple[Path, str]] = []

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(writing, "fsync_path", lambda path: synced.append((path, threading.current_thread().name)))
    monkeypatch.setattr(threading.Thread, "start", refuse)
    writing.fsync_together(paths)
    assert sorted(synced) == [(p, threading.current_thread().name) for p in paths]

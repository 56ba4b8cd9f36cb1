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


def _checkpoint_dir(path: Path, files: int) -> None:
    path.mkdir()
    for i in range(files):
        (path / f"__{i}_0.distcp").write_bytes(b"x" * 64)
    (path / "ember.pt").write_bytes(b"meta")


def test_a_deleted_checkpoint_leaves_its_name_at_once_and_a_leftover_is_swept_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`delete_checkpoint` renames before deleting: a deletion cut short leaves a hidden temporary, never a
    half-deleted checkpoint under its name; once its process is gone, the next save in the folder removes it."""
    doomed = tmp_path / "step=4"
    _checkpoint_dir(doomed, 3)
    monkeypatch.setattr(writing.shutil, "rmtree", lambda *a, **k: None)  # the process dies right after the rename
    writing.delete_checkpoint(doomed)
    monkeypatch.undo()
    assert not doomed.exists()
    (hidden,) = tmp_path.iterdir()
    assert hidden.name == f".step=4.deleting.tmp-{os.getpid()}"
    assert sorted(p.name for p in hidden.iterdir()) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "ember.pt"]
    writing.delete_checkpoint(doomed)  # already gone: nothing to do, no error

    dead = subprocess_pid_that_exited()
    hidden.rename(tmp_path / f".step=4.deleting.tmp-{dead}")
    writing.stage_checkpoint(tmp_path / "step=6", {"state": {}}, {"w": torch.zeros(2)}, {}).finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=6"]


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_kill_during_a_deletion_leaves_the_checkpoint_whole_or_gone(tmp_path: Path) -> None:
    """SIGKILL a process while it deletes a checkpoint of 3000 files (tens of milliseconds of unlinks): the
    checkpoint's name holds every file or does not exist."""
    import signal
    import subprocess
    import sys
    import time

    doomed = tmp_path / "step=4"
    _checkpoint_dir(doomed, 3000)
    code = (
        "import sys\nfrom pathlib import Path\nfrom ember.checkpoint.writing import delete_checkpoint\n"
        "print('go', flush=True)\ndelete_checkpoint(Path(sys.argv[1]))\nimport time\ntime.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(doomed)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "go\n"
        time.sleep(0.003)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert not doomed.exists() or len(list(doomed.iterdir())) == 3001
    assert [p for p in tmp_path.iterdir() if p.name != "step=4" and ".deleting.tmp-" not in p.name] == []

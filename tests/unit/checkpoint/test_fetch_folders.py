"""The temporary folders a checkpoint on a store is downloaded into (`ember.checkpoint.manifest.fetch_checkpoint`):
removed at the process's exit, and, when the process was killed before it could remove its own (SIGKILL, an OOM
kill), by the next fetch on the machine, but never while the process that fetched into it lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import ember
from ember.checkpoint import manifest
from ember.checkpoint.store import open_store


def env() -> dict[str, str]:
    """This process's environment (TMPDIR included), importing this ember (the one under test) wherever it starts."""
    return {**os.environ, "PYTHONPATH": str(Path(ember.__file__).parents[1])}


HOLDER = """
import sys, time
from ember.checkpoint import fetch_checkpoint
print(fetch_checkpoint(sys.argv[1]), flush=True)
time.sleep(120)
"""


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's own temporary directory, for this process and the processes it starts."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    yield root
    manifest._remove_fetched()
    tempfile.tempdir = None


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A committed checkpoint on a ``file://`` store."""
    local = tmp_path / "local" / "step=3"
    local.mkdir(parents=True)
    (local / "ember.pt").write_bytes(b"meta")
    (local / "__0_0.distcp").write_bytes(b"tensors" * 1000)
    fs, root = open_store(f"file://{tmp_path / 'store'}")
    manifest.upload(fs, local, f"{root}/step=3", global_step=3)
    return f"file://{tmp_path / 'store'}/step=3"


def holder(url: str) -> tuple[subprocess.Popen[str], Path]:
    """A process that fetched `url` and lives on; the folder it downloaded into."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, url], stdout=subprocess.PIPE, text=True, env=env())
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, proc.communicate(timeout=30)
    return proc, Path(line).parent


def test_a_killed_processs_folder_goes_with_the_next_fetch_and_a_living_ones_stays(temp_root: Path, url: str) -> None:
    killed, abandoned = holder(url)
    alive, held = holder(url)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        setting_up = Path(tempfile.mkdtemp(prefix=manifest._PREFIX))  # no lock file yet: not judged
        assert abandoned.is_dir() and (abandoned / "step=3" / "__0_0.distcp").stat().st_size == 7000

        fetched = manifest.fetch_checkpoint(url)

        assert (fetched / "__0_0.distcp").read_bytes() == b"tensors" * 1000
        assert not abandoned.exists()
        assert (held / "step=3" / "__0_0.distcp").stat().st_size == 7000  # its process still reads it
        assert setting_up.is_dir()
        assert sorted(p.name for p in temp_root.iterdir()) == sorted([fetched.parent.name, held.name, setting_up.name])
    finally:
        alive.kill()
        alive.wait(timeout=30)


def test_a_process_removes_its_folders_at_exit(temp_root: Path, url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from ember.checkpoint import fetch_checkpoint as f; f(sys.argv[1]); "
         "print(f(sys.argv[1]))", url],
        capture_output=True, text=True, timeout=60, env=env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent.parent == temp_root
    assert list(temp_root.iterdir()) == []


def test_a_folder_another_user_owns_is_left_alone(temp_root: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder whose lock file cannot be opened (another user's, mode 0700) is not this process's to judge."""
    other = Path(tempfile.mkdtemp(prefix=manifest._PREFIX))
    (other / manifest._HELD).write_text("")
    real_open = os.open

    def refuse(path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
        if Path(path).parent == other:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(manifest.os, "open", refuse)
    manifest.fetch_checkpoint(url)
    assert other.is_dir()

"""A ``last`` that is not the file ember writes is refused before any step or handled safely; a fit never
fails after it started training because of it.

- a directory: refused before training (one line, exit 2, saying what to move); nothing is written.
- a dangling symbolic link, a file of garbage, a link to a file outside the run: passed over with a
  warning; the fit resumes from the newest complete checkpoint, and its first save replaces ``last``
  with a regular file (a link is replaced, never what it points to).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from rel_helpers import assert_one_line_error, edit_meta, last_checkpoint, run_cli

from ember import checkpoint as ckpt

pytestmark = pytest.mark.usefixtures("clean_imports")


def _directory(last: Path) -> None:
    last.unlink()
    last.mkdir()
    (last / "notes.txt").write_text("mine")


def _dangling_link(last: Path) -> None:
    last.unlink()
    last.symlink_to(last.parent / "gone")


def _garbage(last: Path) -> None:
    last.write_bytes(b"\x00\xffPK\x03\x04 not a name\n" * 50)


def _link_outside(last: Path) -> None:
    """A link to another run's ``last``, which names this run's *older* checkpoint."""
    outside = last.parents[4] / "elsewhere" / "last"
    outside.parent.mkdir()
    outside.write_text("epoch=0-step=3\n")
    last.unlink()
    last.symlink_to(outside)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "a directory": _directory,
    "a dangling link": _dangling_link,
    "a file of garbage": _garbage,
    "a link outside the run": _link_outside,
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_last_that_is_not_a_pointer_file_is_refused_before_training_or_replaced_safely(
    project: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    newest = last_checkpoint(project)  # epoch=1-step=6
    older = newest.with_name("epoch=0-step=3")
    shutil.copytree(newest, older)
    edit_meta(older, lambda meta: meta["state"]["progress"].update(global_step=3))
    folder, pointer = newest.parent, newest.parent / "last"
    DAMAGE[damage](pointer)
    before = sorted(p.name for p in folder.iterdir())
    shown = pointer.relative_to(project)  # as the command names it: the run's paths are relative to cwd
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run_cli(["fit", "-c", "net.yaml", "trainer.max_epochs=3", "--resume", "last"], capsys)
    if damage == "a directory":
        assert code == 2, err
        assert_one_line_error(err, f"checkpoint pointer {shown} is a directory", f"move it away (mv '{shown}'")
        assert sorted(p.name for p in folder.iterdir()) == before  # nothing trained, nothing saved
        assert (pointer / "notes.txt").read_text() == "mine"
        return
    assert code == 0, err
    assert newest.name == "epoch=1-step=6"  # the epoch in messages is the one in the name, numbered from 0
    assert f"resuming from {newest.relative_to(project)} (epoch 1, step 6)" in err, err
    skipped = [str(w.message) for w in caught if "skipping checkpoint" in str(w.message)]
    assert skipped and f"checkpoint pointer {shown} " in skipped[0], skipped
    if "link" in damage:
        assert "is a symbolic link" in skipped[0] and "not followed" in skipped[0], skipped
    assert not pointer.is_symlink() and pointer.read_text() == "epoch=2-step=9\n"
    assert ckpt.newest_valid(folder) == folder / "epoch=2-step=9"
    if damage == "a link outside the run":
        assert (project / "elsewhere" / "last").read_text() == "epoch=0-step=3\n"  # the link's target untouched
    assert os.listdir(project / "runs" / "net") == ["version_0"]  # the run continued in place

"""Only regular files are read, every malformed checkpoint is a `CheckpointError`, and the command line
answers each with one line and exit 2 (issue 16, items 9 and 11).

Each corruption is applied to the newest checkpoint of a trained run (or beside it), then the checkpoint
is loaded every way there is. A search for ``last`` skips what it cannot use, with a warning, and never
hangs on a FIFO planted where a file is expected.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_helpers import assert_one_line_error, edit_meta, fit_project, last_checkpoint, run_cli

from ember import checkpoint as ckpt
from ember.checkpoint import CheckpointError

pytestmark = pytest.mark.usefixtures("clean_imports")


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _set(field: str, value: Any) -> Callable[[Path], None]:
    return lambda checkpoint: edit_meta(checkpoint, lambda meta: meta.__setitem__(field, value))


def _drop(field: str) -> Callable[[Path], None]:
    return lambda checkpoint: edit_meta(checkpoint, lambda meta: meta.pop(field))


def _pointer_to(text: bytes) -> Callable[[Path], None]:
    def write(checkpoint: Path) -> None:
        (checkpoint.parent / "last").write_bytes(text)

    return write


def _last_is_a_directory(checkpoint: Path) -> None:
    (checkpoint.parent / "last").unlink()
    (checkpoint.parent / "last").mkdir()


#: name -> how to damage the newest checkpoint (or its `last` file)
DAMAGE: dict[str, Callable[[Path], None]] = {
    "ember.pt is a FIFO": lambda c: _fifo(c / "ember.pt"),
    "rank-0.pt is a FIFO": lambda c: _fifo(c / "rank-0.pt"),
    ".metadata is a FIFO": lambda c: _fifo(c / ".metadata"),
    "shard is a FIFO": lambda c: _fifo(c / "__0_0.distcp"),
    "ember.pt is a directory": lambda c: ((c / "ember.pt").unlink(), (c / "ember.pt").mkdir()),
    "format_version is a string": _set("format_version", "2"),
    "format_version is newer": _set("format_version", 99),
    "format_version is a bool": _set("format_version", True),
    "tensor_skeleton missing": _drop("tensor_skeleton"),
    "tensor_skeleton names no tensor": _set("tensor_skeleton", {"module": {"w": {"__ember_tensor__": "/nope"}}}),
    "state is a list": _set("state", [1, 2]),
    "state entries of wrong types": _set("state", {"progress": "x", "callbacks": 3}),
    "hparams is a string": _set("hparams", "lr=1"),
    "ember.pt is not a dict": lambda c: torch.save([1, 2, 3], c / "ember.pt"),
    "ember.pt is empty": lambda c: (c / "ember.pt").write_bytes(b""),
    "last is a directory": _last_is_a_directory,
    "last is binary": _pointer_to(b"\xff\xfe\x00garbage\x80"),
    "last names a path outside": _pointer_to(b"../../../../etc"),
    "last names nothing": _pointer_to(b"\n"),
    "last is huge": _pointer_to(b"x" * 100_000),
}
#: Damage that leaves the checkpoint itself usable (only `last` is broken): the search still finds it.
POINTER_ONLY = {"last is a directory", "last is binary", "last names a path outside", "last names nothing",
                "last is huge"}  # fmt: skip


def _with_timeout(fn: Callable[[], Any], seconds: float = 60.0) -> Any:
    """Run `fn` in a thread; a hang (e.g. opening a FIFO) fails the test instead of blocking the suite."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"hung for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.mark.parametrize("damage", DAMAGE)
def test_reading_a_damaged_checkpoint_is_a_checkpoint_error(project: Path, damage: str) -> None:
    checkpoint = last_checkpoint(project)
    DAMAGE[damage](checkpoint)
    if damage in POINTER_ONLY:
        with pytest.raises(CheckpointError, match="checkpoint pointer"):
            _with_timeout(lambda: ckpt.resolve_path(checkpoint.parent / "last"))
        return
    with pytest.raises(CheckpointError, match=str(checkpoint).replace("[", r"\[")):
        _with_timeout(lambda: ckpt.resolve_path(checkpoint) and ckpt.read_tensors(checkpoint))


@pytest.mark.parametrize("damage", DAMAGE)
def test_searching_for_last_skips_damage_with_a_warning(project: Path, damage: str) -> None:
    """A good older checkpoint beside the damaged one: `last` resolves to it (or to the intact checkpoint
    when only the pointer is damaged), with a warning, and never hangs."""
    checkpoint = last_checkpoint(project)
    older = checkpoint.with_name("epoch=0-step=3")
    shutil.copytree(checkpoint, older)
    edit_meta(older, lambda meta: meta["state"]["progress"].update(global_step=3))
    DAMAGE[damage](checkpoint)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = _with_timeout(lambda: ckpt.newest_valid(checkpoint.parent))
    assert found == (checkpoint if damage in POINTER_ONLY else older)
    assert any("skipping checkpoint" in str(w.message) for w in caught)


def test_a_fifo_in_a_sibling_never_hangs_fit_resuming_from_last(project: Path) -> None:
    """The reproduction of the report: `last` is valid, a sibling directory holds a FIFO named ember.pt."""
    sibling = last_checkpoint(project).with_name("epoch=0-step=3")
    sibling.mkdir()
    os.mkfifo(sibling / "ember.pt")
    trainer = _with_timeout(lambda: fit_project(project, max_epochs=3, ckpt_path="last"))
    assert trainer.global_step == 9


COMMANDS = {
    "fit --resume": ["fit", "-c", "net.yaml", "trainer.max_epochs=3", "--resume"],
    "validate --ckpt-path": ["validate", "-c", "net.yaml", "--ckpt-path"],
    "test --ckpt-path": ["test", "-c", "net.yaml", "--ckpt-path"],
    "predict --ckpt-path": ["predict", "-c", "net.yaml", "--ckpt-path"],
    "export --ckpt": ["export", "-c", "net.yaml", "--format", "safetensors", "--out", "x", "--ckpt"],
}


@pytest.mark.parametrize("damage", [d for d in DAMAGE if d not in POINTER_ONLY])
def test_the_command_line_answers_a_damaged_checkpoint_with_one_line_and_exit_2(
    project: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = last_checkpoint(project)
    DAMAGE[damage](checkpoint)
    for name, argv in COMMANDS.items():
        code, _, err = _with_timeout(lambda argv=argv: run_cli([*argv, str(checkpoint)], capsys))
        assert code == 2, f"{name}: exit {code}\n{err}"
        assert_one_line_error(err, "checkpoint")
    assert not (project / "x").exists()


@pytest.mark.parametrize("damage", sorted(POINTER_ONLY))
def test_the_command_line_answers_a_damaged_last_file_with_one_line_and_exit_2(
    project: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = last_checkpoint(project)
    DAMAGE[damage](checkpoint)
    pointer = checkpoint.parent / "last"
    for name, argv in COMMANDS.items():
        code, _, err = _with_timeout(lambda argv=argv: run_cli([*argv, str(pointer)], capsys))
        assert code == 2, f"{name}: exit {code}\n{err}"
        assert_one_line_error(err, "checkpoint")


# --- item 11: evaluating a structurally different module ------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "test", "predict", "export"])
def test_evaluating_another_module_shape_names_the_override_that_fits(
    project: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trained with module.hidden=8; evaluated with hidden=16: one line naming the keys and the fix."""
    option = ["--ckpt"] if command == "export" else ["--ckpt-path"]
    extra = ["--format", "safetensors", "--out", "x"] if command == "export" else []
    argv = [command, "-c", "net.yaml", "module.hidden=16", *extra, *option, "last"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2, err
    line = assert_one_line_error(err, "model.0.weight", "(8, 4)", "(16, 4)", "module.hidden=8")
    assert line.endswith("add the override(s) module.hidden=8")


def test_loading_another_module_shape_from_python_names_the_hyperparameters(project: Path) -> None:
    import sys

    import ember

    sys.path.insert(0, str(project))
    from my_project.models import Blobs, Net

    trainer = ember.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(CheckpointError, match=r"it was trained with hidden=8: build the module with those"):
        trainer.validate(Net(hidden=16), datamodule=Blobs(n=64), ckpt_path=last_checkpoint(project))

"""The documentation runs (issue 21, item 5): every Python block of README.md, configs/README.md,
examples/README.md and docs/**/*.md is executed, and every ``ember ...`` command line in their other blocks
is run through the ``ember`` entry point, shortened by overrides (one epoch of two batches; sweeps of one
trial on one worker, each sweep once). A failure names the page and line.

Python blocks of one page run in order in one namespace, as a reader would paste them, in a folder with
``configs/`` and ``examples/`` and a short digits run (``runs/classifier/version_0``). The namespace starts
with what the guides take as given: ``module`` (the digits `Classifier`), ``data``/``dm`` (its
`DigitsData`), ``train_loader``, ``val_loader``, ``test_loader``, ``predict_loader``, ``loader``,
``trainer``, and the public callbacks and loggers by name. ``ember.Trainer`` is shortened the same way as
the commands (``max_epochs`` at most 1, two batches per loop).

A block that cannot run (a sketch with ``...``, a signature, a page's hypothetical file) starts with
``# not run: <reason>``, which readers see; `test_few_blocks_are_marked_not_run` keeps that list short.
"""

from __future__ import annotations

import shutil
import socket
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_blocks import ROOT, Block, Command, commands, pages, python_blocks

from ember.cli import main

FIT_SHORT = [
    "trainer.max_epochs=1",
    "trainer.max_steps=-1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=2",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
]
EVAL_SHORT = ["trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.limit_predict_batches=2"]
#: Smaller data and models for the examples' configs (as their own tests use), put before the command's own
#: overrides, so that what the command sets (``data.seq_len=39``) still applies.
CONFIG_SHORT = {
    "char_transformer.yaml": ["data.max_bytes=50000", "module.n_layers=1", "module.max_new_tokens=8"],
    "hf_lm.yaml": ["data.vocab_size=384", "data.max_bytes=40000", "data.seq_len=32", "module.n_embd=32",
                   "module.n_head=2", "module.n_layer=1"],
    "hf_classify.yaml": ["data.train_per_class=8", "data.val_per_class=16", "data.max_tokens=16"],
    "segmentation.yaml": ["data.train_size=32", "data.val_size=16", "module.width=4", "module.depth=2"],
}  # fmt: skip
#: At most this many blocks and command lines carry the ``not run`` marker.
MAX_NOT_RUN = 10

PY_PAGES = [p for p in pages() if any(not b.is_marked_not_run for b in python_blocks(p))]
CMD_PAGES = [p for p in pages() if any(not c.marked_not_run for c in commands(p))]


def shorten(argv: list[str]) -> list[str]:
    """The command with overrides that make it quick; what it does is unchanged."""
    configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-c", "--config")]
    smaller = [o for c in configs for o in CONFIG_SHORT.get(Path(c).name, [])]
    if smaller:
        first = next((i for i, a in enumerate(argv) if i > 0 and "=" in a and not a.startswith("-")), len(argv))
        argv = [*argv[:first], *smaller, *argv[first:]]
    sub = argv[0]
    if "--print-config" in argv:
        return argv
    if sub == "fit":
        return [*argv, *FIT_SHORT]
    if sub in ("validate", "test", "predict"):
        return [*argv, *EVAL_SHORT]
    if sub == "tune":
        return [*argv, "--num-steps", "20", *FIT_SHORT] if argv[1] == "lr" else [*argv, "--max-size", "16"]
    if sub == "sweep":
        out = list(argv)
        for option, value in (("--trials", "1"), ("--workers", "1")):
            if option in out:
                out[out.index(option) + 1] = value
        return [*out, *FIT_SHORT]
    return argv


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short digits run (``runs/classifier/version_0``) that pages copy before they start."""
    root = tmp_path_factory.mktemp("docs_digits")
    _link_project(root)
    saved, cwd = list(sys.path), Path.cwd()
    import os

    os.chdir(root)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert main(["fit", "-c", "configs/digits.yaml", *FIT_SHORT]) == 0
    finally:
        os.chdir(cwd)
        sys.path[:] = saved
    return root / "runs"


def _link_project(folder: Path) -> None:
    for name in ("configs", "examples"):
        (folder / name).symlink_to(ROOT / name, target_is_directory=True)


@pytest.fixture
def page_dir(tmp_path: Path, digits_run: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test's working directory as a reader's checkout: configs/, examples/, a short digits run."""
    _link_project(tmp_path)
    shutil.copytree(digits_run, tmp_path / "runs")
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    yield tmp_path


def _short_trainer() -> type:
    import ember
    from ember.trainer.trainer import Trainer

    class ShortTrainer(Trainer):
        """``ember.Trainer`` as the docs call it, at most one epoch of two batches per loop."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("max_epochs") is not None:
                kwargs["max_epochs"] = 1
            if kwargs.get("max_steps", -1) > 2:
                kwargs["max_steps"] = 2
            for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
                kwargs.setdefault(key, 2)
            kwargs.setdefault("num_sanity_val_steps", 0)
            super().__init__(*args, **kwargs)

    ShortTrainer.__name__ = ShortTrainer.__qualname__ = "Trainer"
    assert ember.Trainer is Trainer
    return ShortTrainer


def namespace() -> dict[str, Any]:
    """What the guides' snippets take as given (see the module docstring)."""
    import numpy as np
    import torch
    import torchmetrics
    from torch import nn

    import ember
    import ember.callbacks as callbacks
    import ember.loggers as loggers
    from examples.digits import Classifier, DigitsData

    data = DigitsData(batch_size=32)
    data.setup("fit")
    names: dict[str, Any] = {name: getattr(callbacks, name) for name in callbacks.__all__}
    names |= {name: getattr(loggers, name) for name in loggers.__all__ if name != "WandbLogger"}
    return {
        **names,
        "np": np, "torch": torch, "nn": nn, "torchmetrics": torchmetrics, "ember": ember,
        "Classifier": Classifier, "DigitsData": DigitsData, "module": Classifier(epochs=1),
        "data": data, "dm": data, "train_loader": data.train_dataloader(), "val_loader": data.val_dataloader(),
        "test_loader": data.test_dataloader(), "predict_loader": data.predict_dataloader(),
        "loader": data.predict_dataloader(), "trainer": ember.Trainer(max_epochs=1),
        "__name__": "__docs__",
    }  # fmt: skip


@pytest.mark.slow  # about a minute for every page together; CI runs it
@pytest.mark.parametrize("page", PY_PAGES)
def test_python_blocks_run(page: str, page_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ember

    monkeypatch.setattr(ember, "Trainer", _short_trainer())
    names = namespace()
    ran = 0
    for block in python_blocks(page):
        if block.is_marked_not_run:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                exec(compile(block.text, block.where, "exec"), names)
            except Exception as exc:
                pytest.fail(f"{block.where}: the documented Python block fails: {type(exc).__name__}: {exc}")
        ran += 1
    assert ran > 0


#: Sweeps already run in this session: the same sweep command on another page proves nothing new.
_SWEEPS_RUN: set[tuple[str, ...]] = set()


@pytest.mark.slow  # one to two minutes for every page together; CI runs it
@pytest.mark.parametrize("page", CMD_PAGES)
def test_command_lines_run(page: str, page_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ran = 0
    for command in commands(page):
        if command.marked_not_run:
            continue
        argv = shorten(command.argv)
        if argv[0] == "sweep":
            key = tuple(a for a in argv if a != "trainer.enable_progress_bar=false")
            if key in _SWEEPS_RUN:
                ran += 1
                continue
            _SWEEPS_RUN.add(key)
        code = run_command(argv)
        err = capsys.readouterr().err
        assert code == 0, f"{command.where}: `{command.text}` (run as ember {' '.join(argv)}) exits {code}:\n{err}"
        ran += 1
    assert ran > 0


def run_command(argv: list[str]) -> int:
    """``ember ARGV`` in this process. ``trainer.devices=N`` becomes 1: the command line, the strategy and the
    config still run; several processes (which re-launch the program they run in, here pytest) are what
    tests/distributed runs."""
    import os

    import torch.distributed as dist

    argv = [("trainer.devices=1" if a.startswith("trainer.devices=") else a) for a in argv]
    environ = dict(os.environ)
    # A ddp/fsdp strategy of one process listens on MASTER_PORT (29500 unless set): another pytest worker may be
    # running a command of another page at the same time
    os.environ["MASTER_PORT"] = str(free_port())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return main(argv)
        except SystemExit as exc:  # argparse rejected the documented command line
            return int(exc.code or 0)
        finally:  # a ddp/fsdp strategy joined a process group and exported RANK, MASTER_PORT, ...: undo both
            if dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(environ)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _marked() -> list[str]:
    found = [b.where for p in pages() for b in python_blocks(p) if b.is_marked_not_run]
    return found + [c.where for p in pages() for c in commands(p) if c.marked_not_run]


def test_few_blocks_are_marked_not_run() -> None:
    marked = _marked()
    assert len(marked) <= MAX_NOT_RUN, f"{len(marked)} blocks/commands marked not run (at most {MAX_NOT_RUN}): {marked}"


def test_every_page_with_code_is_exercised() -> None:
    """A page whose Python or commands were all marked not run would drift unnoticed: none is."""
    for page in pages():
        has_python = bool(python_blocks(page))
        has_commands = bool(commands(page))
        assert not has_python or page in PY_PAGES, f"{page}: every Python block is marked not run"
        assert not has_commands or page in CMD_PAGES, f"{page}: every command line is marked not run"


def test_readme_quickstart_is_the_example_file() -> None:
    (quickstart,) = [b for b in python_blocks("README.md") if "examples/quickstart.py" in b.text.splitlines()[0]]
    assert quickstart.text == (ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8")


def test_blocks_are_found_with_their_lines() -> None:
    """The extraction itself: a page's blocks, languages and line numbers as written."""
    block: Block = python_blocks("README.md")[0]
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[block.line - 2].startswith("```python") and lines[block.line - 1] == block.text.splitlines()[0]
    command: Command = commands("docs/cli.md")[0]
    assert command.argv[:3] == ["fit", "-c", "configs/digits.yaml"]

"""Fixtures of the reliability tests (issue 16): each test tries to break one promise of docs/checkpoints.md
("Trust and failure model") the way a user or an attacker would: hostile checkpoint contents, kills, full
disks, concurrent runs. Helpers live in `rel_helpers`."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rel_helpers import make_project

from ember.cli import main


def _forget_project_imports() -> None:
    for name in [m for m in sys.modules if m.startswith("my_project") or m == "evil_mod"]:
        del sys.modules[name]


@pytest.fixture
def clean_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`ember.cli.main` puts the config's folder on sys.path and imports my_project: undo both afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    _forget_project_imports()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project trained once with ``ember fit`` (2 epochs); tests copy it before changing anything."""
    root = tmp_path_factory.mktemp("trained")
    config = make_project(root)
    saved_path, cwd = list(sys.path), Path.cwd()
    os.chdir(root)
    try:
        assert main(["fit", "-c", str(config)]) == 0
    finally:
        os.chdir(cwd)
        sys.path[:] = saved_path
        _forget_project_imports()
    return root


@pytest.fixture
def project(trained_run: Path, tmp_path: Path) -> Path:
    """A private copy of `trained_run` in the test's working directory (which is `tmp_path`)."""
    shutil.copytree(trained_run, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path

"""Shared test setup: every test runs in its own empty working directory, offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs write `runs/` into the working directory: keep each test's apart from the repo."""
    monkeypatch.chdir(tmp_path)

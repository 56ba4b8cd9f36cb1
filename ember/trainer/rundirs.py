"""Run directories: ``<default_root_dir>/<run name>/version_N``, found and claimed in one place.

Two runs started at the same moment under the same root must never share a directory, so a new
version is *claimed* with an exclusive ``mkdir`` (the first process to create ``version_N`` owns it;
the other takes N+1), never computed as "highest + 1" and used later.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_VERSION = re.compile(r"version_(\d+)")


def versions_newest_first(run_root: Path) -> list[Path]:
    """The ``version_N`` directories of `run_root`, highest N first."""
    found = []
    if run_root.is_dir():
        for path in run_root.iterdir():
            match = _VERSION.fullmatch(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
    return [p for _, p in sorted(found, reverse=True)]


def claim_version(run_root: Path) -> tuple[Path, Path]:
    """Create a new ``version_N`` directory in `run_root`, N one past the highest there; returns it and the
    deepest folder above it that existed before (what `release_if_empty` keeps).

    The ``mkdir`` is exclusive: when another process created the same N first, the next N is tried.
    """
    existed = run_root
    while not existed.exists() and existed.parent != existed:
        existed = existed.parent
    run_root.mkdir(parents=True, exist_ok=True)
    existing = versions_newest_first(run_root)
    number = int(existing[0].name.split("_")[1]) + 1 if existing else 0
    while True:
        path = run_root / f"version_{number}"
        try:
            path.mkdir()
            return path, existed
        except FileExistsError:
            number += 1


def release_if_empty(run_dir: Path, keep: Path) -> None:
    """Remove a claimed run directory that nothing was written to (a rejected or write-free run), and the
    empty folders above it that the claim created, up to (not including) `keep`."""
    folder = run_dir
    while folder != keep and keep in folder.parents:
        try:
            os.rmdir(folder)
        except OSError:
            return  # not empty (or already gone): it holds a record of some run
        folder = folder.parent

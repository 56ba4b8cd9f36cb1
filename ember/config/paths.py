"""Relative paths in a config's ``module`` and ``data`` sections, found from any working directory.

A value such as ``path: data/blobs.csv`` names a file relative to where the user keeps the config, not to
wherever the command happens to run. `resolve_paths` keeps a relative path that exists from the working
directory; otherwise it looks for it in each config file's folder, then that file's project root (the
folders ``_target_`` classes import from, `loading.import_roots`), and uses the first match, as an
absolute path. A path found nowhere is left as written: the code that opens it says it is missing.

Only strings that look like paths are looked up: they hold a ``/`` (or the platform's separator) or end in
a file suffix (``blobs.csv``), are not URLs, and are not the ``_target_`` of a section.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember.config.loading import import_roots

#: The sections whose values are the user's own arguments (file names among them).
SECTIONS = ("module", "data")

_SUFFIX = re.compile(r"\.[A-Za-z0-9]{1,8}$")


def looks_like_path(value: str) -> bool:
    """Whether `value` is worth looking up as a relative path (``data/x.csv``, ``blobs.csv``; not ``images``,
    ``1e-3``, ``https://...`` or an absolute path)."""
    if not value or "://" in value or os.path.isabs(value) or value.startswith("~"):
        return False
    has_separator = "/" in value or os.sep in value
    return has_separator or (_SUFFIX.search(value) is not None and not _is_number(value))


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def resolve_paths(resolved: dict[str, Any], files: Sequence[str | Path]) -> dict[str, Any]:
    """`resolved` with the relative paths of its module and data sections that exist only beside a config
    file (or in its project) made absolute; everything else unchanged."""
    roots = [Path(root) for root in import_roots(files)[:-1]]  # the last root is the working directory
    if not roots:
        return resolved
    out = dict(resolved)
    for section in SECTIONS:
        if section in out:
            out[section] = _walk(out[section], roots)
    return out


def _walk(node: Any, roots: list[Path]) -> Any:
    if isinstance(node, dict):
        return {k: v if k == "_target_" else _walk(v, roots) for k, v in node.items()}
    if isinstance(node, list):
        return [_walk(v, roots) for v in node]
    if isinstance(node, str) and looks_like_path(node) and not Path(node).exists():
        found = next((root / node for root in roots if (root / node).exists()), None)
        return str(found) if found is not None else node
    return node

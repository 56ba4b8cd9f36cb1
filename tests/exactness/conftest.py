"""The count of the configurations the exactness suite exercised.

``EMBER_HYPOTHESIS_PROFILE`` picks the hypothesis profile (tests/conftest.py): ``ci`` (default; fixed
examples, so CI is repeatable, and under 3 minutes on 2 cores) or ``thorough`` (20 times as many examples,
freshly drawn each run). Each property asks for a multiple of the profile's ``max_examples``
(`exact_strategies.examples`). At the end of the session the number of distinct configurations each property
ran is printed (and written as JSON to ``EMBER_EXACTNESS_COUNTS`` when that is set), the counts of every
pytest-xdist worker together (when these tests are named on the command line, as in
``python -m pytest tests/exactness``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import exact_strategies


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: hand the configurations it ran to the controller (`pytest_testnodedown`)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["exactness_seen"] = {prop: sorted(keys) for prop, keys in exact_strategies.SEEN.items()}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: only called when it runs the session
def pytest_testnodedown(node: Any, error: Any) -> None:
    for prop, keys in getattr(node, "workeroutput", {}).get("exactness_seen", {}).items():
        exact_strategies.SEEN.setdefault(prop, set()).update(keys)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    seen = exact_strategies.SEEN
    if not seen:
        return
    profile = os.environ.get("EMBER_HYPOTHESIS_PROFILE", "ci")
    counts = {prop: len(keys) for prop, keys in sorted(seen.items())}
    parts = ", ".join(f"{prop} {count}" for prop, count in counts.items())
    terminalreporter.write_line(
        f"exactness ({profile} profile): distinct configurations exercised: {parts}; total {sum(counts.values())}"
    )
    target = os.environ.get("EMBER_EXACTNESS_COUNTS")
    if target:
        Path(target).write_text(json.dumps({"profile": profile, "counts": counts}, indent=1) + "\n")

"""``benchmarks/soak.py --short`` (issue 16, "must show" 3): 16 random interruptions across the eight
configurations, every promise counted. The full run (104 interruptions) is recorded in docs/benchmarks.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_soak_short_mode_interrupts_every_configuration_and_every_promise_holds(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--short", "--seed", "7"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]

    def count(label: str) -> int:
        match = re.search(rf"^{re.escape(label)}:\s+(\d+)", out, re.MULTILINE)
        assert match, f"no {label!r} line:\n{out}"
        return int(match.group(1))

    assert count("interruptions") == 16
    assert count("configurations completed") == 8
    for label in ("unreadable `last`", "runs that lost completed work", "deleted checkpoints still kept",
                  "deleted outside the run", "executed payloads", "unexpected exits"):  # fmt: skip
        assert count(label) == 0, out
    assert re.search(r"^final parameters bitwise equal:\s+True$", out, re.MULTILINE), out
    assert out.strip().endswith("verdict: every promise held")


def test_the_soak_reads_the_step_of_a_re_saved_checkpoint() -> None:
    """A kill between a checkpoint's completion and `last` naming it leaves that checkpoint complete; the resumed
    launch re-saves the same step as ``step=N-v1``, which the soak's bookkeeping must read as step N."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = soak  # its dataclasses look their module up
    try:
        spec.loader.exec_module(soak)
    finally:
        del sys.modules["soak"]
    assert [soak.saved_step(name) for name in ("step=38", "step=38-v1", "step=7-v12")] == [38, 38, 7]

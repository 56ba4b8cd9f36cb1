"""benchmarks/real_workloads.py in its short mode: the figures it reports, and that both loops agree.

Times and ratios are not asserted (a shared machine makes them noise); what is asserted is that every
workload reports a ratio for each phase with the allocator tuned and not, that ember and the
hand-written loop end with bitwise equal weights and the same validation value, that the tuning was
applied in the tuned processes (on glibc Linux) and not in the others, and that a verdict is stated.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("word_lm", "char_transformer", "cnn", "gan")


def _glibc_linux() -> bool:
    return sys.platform.startswith("linux") and bool(os.confstr("CS_GNU_LIBC_VERSION"))


@pytest.mark.slow
def test_short_mode_reports_every_phase_and_both_loops_agree(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    env = {k: v for k, v in os.environ.items() if k != "EMBER_TUNE_CPU_ALLOCATOR" and not k.startswith("MALLOC_")}
    env.pop("LD_PRELOAD", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_workloads.py"), "--short", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["workloads"]) == set(WORKLOADS)
    for name, work in figures["workloads"].items():
        assert work["equal"], f"{name}: ember's final weights differ from the hand loop's by {work['max_diff']}"
        assert work["val_agrees"], f"{name}: last validation value [ember, hand] {work['val']}"
        for setting in ("tuned", "not_tuned"):
            ratios = work[setting]["ratio"]
            assert set(ratios) == {"train", "eval", "fit"}
            assert all(math.isfinite(r) and r > 0 for r in ratios.values()), (name, setting, ratios)
            assert all(t > 0 for t in (*work[setting]["ember_s"].values(), *work[setting]["hand_s"].values()))
            assert work[setting]["peak_rss_mib"] > 0
    if _glibc_linux():
        assert figures["allocator"]["applied"], figures["allocator"]
    else:
        assert not figures["allocator"]["applied"], figures["allocator"]
    # The printed report: both settings' tables, the agreement lines, and one verdict with a figure per goal.
    text = result.stdout
    assert "allocator tuned (the default):" in text and "allocator not tuned (EMBER_TUNE_CPU_ALLOCATOR=0):" in text
    assert "final weights, ember vs hand-written loop: " + ", ".join(f"{n} bitwise equal" for n in WORKLOADS) in text
    verdicts = re.findall(r"^verdict: (meets|misses) the goals \(wall clock, tuned: (.+)\)$", text, re.MULTILINE)
    assert len(verdicts) == 1 and verdicts[0][0] == figures["verdict"], text
    goals = re.findall(r"(\w+) (train|eval) x(\d+\.\d+) <= 1\.00", verdicts[0][1])
    assert {(n, p) for n, p, _ in goals} == {(n, p) for n in WORKLOADS for p in ("train", "eval")}

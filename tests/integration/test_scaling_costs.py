"""benchmarks/scaling_costs.py runs in its short mode (2 gloo processes) and prints every figure docs/scaling.md
uses, with a verdict. Timings are not asserted (docs/benchmarks.md: noise on a shared machine); sizes are."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_scaling_costs_short_run(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scaling_costs.py"), "--short", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("2 processes (gloo, CPU)")
    for figure in ("join (process group", "blocking all-reduce", "only counts down", "between idle steps"):
        assert figure in out, out
    # 4 x Linear(512, 512) with AdamW: (512 * 512 + 512) * 4 parameters, 3 fp32 tensors each (weights, 2 moments).
    megabytes = float(re.search(r"([\d.]+) MB of tensors", out).group(1))  # type: ignore[union-attr]
    assert megabytes == pytest.approx((512 * 512 + 512) * 4 * 3 * 4 / 2**20, abs=0.1)
    per_process = float(re.search(r"([\d.]+) MB per process", out).group(1))  # type: ignore[union-attr]
    assert per_process == pytest.approx(megabytes / 2, abs=0.1)  # FSDP: half on each of 2 processes
    assert re.search(r"^verdict: (meets|misses) the goal \(flag checks \d+\.\d+% <= 1% of the loop\)$", out, re.M)
    assert not any(p.name.startswith("scaling-costs") for p in tmp_path.iterdir())  # cleaned up

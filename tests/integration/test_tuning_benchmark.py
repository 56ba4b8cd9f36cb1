"""benchmarks/tuning.py in its short mode: it runs both parts and states a verdict with its figures.

The short mode trains 2 epochs and sweeps 3 trials, so its verdict says nothing about the goals (the
full run's figures are in docs/tuning.md); what is asserted is that the script measures what it says.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_tuning_benchmark_runs_and_states_a_verdict(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tuning.py"), "--short"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verdicts = re.findall(r"^verdict: (meets|misses) the goals \((.+)\)$", done.stdout, re.MULTILINE)
    assert len(verdicts) == 1 and len(re.findall(r"(\d+\.\d+)\s*\S*\s*<=", verdicts[0][1])) == 3, done.stdout
    result = json.loads(next(line[8:] for line in done.stdout.splitlines() if line.startswith("result: ")))
    (row,) = result["lr"]["rows"]
    assert len(row["grid"]) == 6 and 1e-8 <= row["suggestion"] <= 1.0
    assert row["gap_points"] == pytest.approx(100 * (max(row["grid"].values()) - row["val_acc"]))
    sweep = result["sweep"]
    assert sweep["trials"] == 3 and sweep["epochs_unpruned"] == 3 * 2
    assert 0.0 <= sweep["pruned_share"] < 1.0 and 0.0 < sweep["default"] <= 1.0
    assert 0.0 < sweep["best"] <= 1.0
    assert set(sweep["best_params"]) == {"module.lr", "module.hidden", "module.weight_decay"}

"""benchmarks/tuning.py in its short mode: it runs both parts and states a verdict with its figures.

The short mode trains 2 epochs and sweeps 3 trials, so its verdict says nothing about the goals (the
full run's figures are in docs/tuning.md); what is asserted is that the script measures what it says.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_tuning_benchmark_runs_and_states_a_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # ``python benchmarks/tuning.py --short`` in this process, where torch and ember are imported already (the
    # sweep's own processes stay processes); sys.path, which the script and the config loader extend, is restored.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["tuning.py", "--short"])
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("tuning_benchmark_under_test", ROOT / "benchmarks" / "tuning.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main()
    stdout = capsys.readouterr().out
    verdicts = re.findall(r"^verdict: (meets|misses) the goals \((.+)\)$", stdout, re.MULTILINE)
    assert len(verdicts) == 1 and len(re.findall(r"(\d+\.\d+)\s*\S*\s*<=", verdicts[0][1])) == 3, stdout
    result = json.loads(next(line[8:] for line in stdout.splitlines() if line.startswith("result: ")))
    (row,) = result["lr"]["rows"]
    assert len(row["grid"]) == 6 and 1e-8 <= row["suggestion"] <= 1.0
    assert row["gap_points"] == pytest.approx(100 * (max(row["grid"].values()) - row["val_acc"]))
    sweep = result["sweep"]
    assert sweep["trials"] == 3 and sweep["epochs_unpruned"] == 3 * 2
    assert 0.0 <= sweep["pruned_share"] < 1.0 and 0.0 < sweep["default"] <= 1.0
    assert 0.0 < sweep["best"] <= 1.0
    assert set(sweep["best_params"]) == {"module.lr", "module.hidden", "module.weight_decay"}

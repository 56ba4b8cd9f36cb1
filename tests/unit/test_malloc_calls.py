"""benchmarks/malloc_calls.py: its arithmetic, and the step's allocations it measures.

The loop itself allocates nothing per step beyond what a raw PyTorch loop allocates (the hot path's rule:
no per-step allocation the user did not ask for); a ``self.log`` call and the default callbacks add a few
blocks. Calls to malloc do not depend on timing or on the machine's load, so the bounds are tight.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("malloc_calls", BENCHMARKS / "malloc_calls.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_per_step_is_the_difference_of_every_kind_over_the_steps_between_the_runs(script: ModuleType) -> None:
    short = script.parse("4 100 0 0 3\n7 10 1 0 0\n")
    long = script.parse("4 1124 0 0 515\n7 10 1 0 0\n12 0 0 512 0\n")
    assert short == {4: (100, 0, 0, 3), 7: (10, 1, 0, 0)}
    assert script.SHORT == 1 and script.LONG == 3 and script.STEPS_PER_EPOCH == 256
    assert script.per_step(short, long) == {4: 3.0, 7: 0.0, 12: 1.0}


def test_the_report_shows_each_variant_against_raw(script: ModuleType) -> None:
    table = script.report({"raw": {4: 10.0, 5: 2.0}, "ember minimal": {4: 11.0, 5: 2.0, 9: 0.5}})
    assert "raw                    12.0    +0.0" in table
    assert "ember minimal          13.5    +1.5" in table


def test_without_a_compiler_it_says_so(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(script.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["malloc_calls.py"])
    assert script.main() == 2
    assert "no C compiler" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc) to build the counting library")
def test_the_loop_allocates_nothing_per_step_beyond_a_raw_loop(script: ModuleType) -> None:
    calls = {
        variant: sum(per_class.values())
        for variant, per_class in script.measure(
            ["raw", "minimal, no log", "ember minimal", "defaults, no ckpt"], fork=True
        ).items()
    }
    assert calls["raw"] > 500  # the counter sees torch's own allocations (about 800 per step here)
    # ember's loop, without the step's self.log: what raw allocates (epoch-level work spread over the steps)
    assert abs(calls["minimal, no log"] - calls["raw"]) < 0.5, calls
    # one self.log(..., prog_bar=True) per step: the detached value and its record (measured +3.1)
    assert calls["ember minimal"] - calls["raw"] < 3.5, calls
    # the defaults' progress line and logger on top (measured +7.0)
    assert calls["defaults, no ckpt"] - calls["raw"] < 8.0, calls

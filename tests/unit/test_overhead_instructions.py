"""benchmarks/overhead_instructions.py: its reading of valgrind's output and its per-step arithmetic.

A full run takes 10-25 minutes under valgrind, so CI does not run it (docs/benchmarks.md records one);
what it computes from valgrind's numbers is checked here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

SUMMARY = """==25863== Cachegrind, a cache and branch-prediction profiler
==25863== Command: python3 overhead.py --run raw --epochs 3
==25863==
==25863== I   refs:      11,008,298,331
"""


@pytest.fixture(scope="module")
def script() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("overhead_instructions", BENCHMARKS / "overhead_instructions.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_reads_the_instruction_total(script: ModuleType) -> None:
    assert script.instructions(SUMMARY) == 11_008_298_331


def test_output_without_a_summary_is_an_error_that_shows_it(script: ModuleType) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)no instruction count.*Killed"):
        script.instructions("==1== Command: python3\nKilled\n")


def test_per_step_is_the_difference_over_the_steps_between_the_runs(script: ModuleType) -> None:
    # 1 and 9 epochs of 256 steps: 2048 steps apart; start-up and the first epoch cancel out.
    assert script.SHORT == 1 and script.LONG == 9 and script.STEPS_PER_EPOCH == 256
    assert script.per_step(10_095_694_059, 13_746_112_571) == pytest.approx(1_782_430.5)


def test_without_valgrind_it_says_so(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(script.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["overhead_instructions.py"])
    assert script.main() == 2
    assert "valgrind is not installed" in capsys.readouterr().err


def test_repeats_take_the_median_of_the_per_step_figures(script: ModuleType) -> None:
    base = 10_000_000_000
    steps = (script.LONG - script.SHORT) * script.STEPS_PER_EPOCH
    pairs = [
        (base, base + steps * 1_800_000),
        (base, base + steps * 1_900_000),
        (base + 7, base + 7 + steps * 1_750_000),
    ]
    assert script.median_per_step(pairs) == pytest.approx(1_800_000)
    assert script.median_per_step(pairs[:1]) == pytest.approx(1_800_000)


def test_every_run_has_fixed_hashing_and_one_thread_per_pool(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle pool threads spin, and cachegrind counts the spinning: each run gets one thread per library pool."""
    seen: dict[str, str] = {}

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.update(kwargs["env"])  # type: ignore[arg-type]
        return subprocess.CompletedProcess(command, 0, "", SUMMARY)

    monkeypatch.setattr(script.subprocess, "run", fake_run)
    assert script.count("raw", 1) == 11_008_298_331
    assert seen["PYTHONHASHSEED"] == "0"
    assert all(seen[name] == "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"))


def test_jemalloc_runs_get_it_preloaded_without_time_based_purging(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    library = tmp_path / "libjemalloc.so.2"
    library.write_bytes(b"")
    monkeypatch.setattr(script, "JEMALLOC_PATHS", (str(tmp_path / "absent.so"), str(library)))
    assert script.allocator_env("glibc") == {}
    env = script.allocator_env("jemalloc")
    assert env == {"LD_PRELOAD": str(library), "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}
    seen: dict[str, str] = {}

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.update(kwargs["env"])  # type: ignore[arg-type]
        return subprocess.CompletedProcess(command, 0, "", SUMMARY)

    monkeypatch.setattr(script.subprocess, "run", fake_run)
    script.count("raw", 1, env)
    assert seen["LD_PRELOAD"] == str(library) and seen["PYTHONHASHSEED"] == "0"


def test_a_missing_jemalloc_is_one_line_saying_how_to_install_it(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(script, "JEMALLOC_PATHS", (str(tmp_path / "absent.so"),))
    with pytest.raises(FileNotFoundError, match="apt-get install libjemalloc2"):
        script.allocator_env("jemalloc")
    monkeypatch.setattr(sys, "argv", ["overhead_instructions.py", "--allocator", "jemalloc"])
    assert script.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "jemalloc is not installed" in err

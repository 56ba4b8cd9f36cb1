"""The suite's isolation (tests/conftest.py, `_restore_global_state`): what one test changes for the whole process
never reaches the next one.

The case that showed it: `ember.seed_everything(42, workers=True)` (docs/migrating-from-lightning.md runs it)
sets ``EMBER_SEED_WORKERS=1`` for the process, and a parity case of tests/exactness run after it in the same
process then differed from the raw loop (its DataLoader workers were reseeded). The check below runs a small
pytest session (in this process, in a fixed order) with the suite's conftest.py, and once more with its
restoring fixture switched off, where the same tests must fail: the check itself is shown to see the leak.
A second case: a package a test imports from its own temporary folder (a CLI test's ``my_project``) must not
shadow the next test's package of the same name.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (imported once here: importing it again in the same process fails)

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "exactness"))

import exact_checks  # noqa: E402, F401  (the sessions below import it; pytester forgets what they imported)

CONFTEST = (TESTS / "conftest.py").read_text(encoding="utf-8")
AUTOUSE = "@pytest.fixture(autouse=True)\ndef _restore_global_state("
assert AUTOUSE in CONFTEST

WORKERS_SEEDED_THEN_PARITY = """
import os

from exact_checks import check_parity
from exact_workload import Config

import ember


def test_1_seed_everything_seeds_dataloader_workers_for_the_process():
    assert ember.seed_everything(42, workers=True) == 42
    assert os.environ["EMBER_SEED_WORKERS"] == "1" and os.environ["EMBER_SEED"] == "42"


def test_2_the_next_test_finds_the_environment_as_before():
    assert "EMBER_SEED_WORKERS" not in os.environ and "EMBER_SEED" not in os.environ


def test_3_the_parity_case_that_failed_after_it(tmp_path):
    # tests/exactness/test_parity_generated.py; with workers seeded, ember's loss of batch 0 was 0.8172
    # against the raw loop's 0.7060
    check_parity(Config(n=1, batch_size=1, num_workers=2, augment="global"), tmp_path)
"""

SETTINGS_CHANGED = """
import random

import torch

THREADS = torch.get_num_threads()  # this process's own count, read before test_1 changes it


def test_1_changes_the_random_streams_and_the_settings():
    torch.manual_seed(123)
    random.seed(123)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(THREADS + 1)
    torch.use_deterministic_algorithms(True)


def test_2_the_torch_stream_is_as_before():
    assert torch.rand(()).item() != torch.rand((), generator=torch.Generator().manual_seed(123)).item()


def test_3_the_python_stream_is_as_before():
    assert random.random() != random.Random(123).random()


def test_4_the_default_dtype_is_as_before():
    assert torch.get_default_dtype() == torch.float32


def test_5_the_thread_count_is_as_before():
    assert torch.get_num_threads() == THREADS


def test_6_deterministic_algorithms_are_as_before():
    assert not torch.are_deterministic_algorithms_enabled()
"""


PROJECTS_OF_THE_SAME_NAME = """
import importlib
import sys


def _import_project(folder, value):
    (folder / "leaky_project").mkdir()
    (folder / "leaky_project" / "__init__.py").write_text(f"VALUE = {value}")
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module("leaky_project")
    finally:
        sys.path.remove(str(folder))  # as the CLI tests' project fixtures do; sys.modules keeps the package


def test_1_imports_its_project(tmp_path):
    assert _import_project(tmp_path, 1).VALUE == 1


def test_2_imports_its_own_project_of_the_same_name(tmp_path):
    assert _import_project(tmp_path, 2).VALUE == 2
"""


@pytest.mark.parametrize("restoring", [True, False], ids=["restored", "not-restored"])
def test_what_a_test_changes_for_the_process_does_not_reach_the_next_test(
    pytester: pytest.Pytester, restoring: bool
) -> None:
    os.environ.pop("EMBER_SEED", None)  # as in a fresh shell (this test's own changes are restored after it)
    os.environ.pop("EMBER_SEED_WORKERS", None)
    conftest = CONFTEST if restoring else CONFTEST.replace(AUTOUSE, AUTOUSE.replace("(autouse=True)", ""))
    pytester.makeconftest(conftest)
    pytester.makepyfile(
        test_1_workers=WORKERS_SEEDED_THEN_PARITY,
        test_2_settings=SETTINGS_CHANGED,
        test_3_projects=PROJECTS_OF_THE_SAME_NAME,
    )
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider", "-q")
    if restoring:
        result.assert_outcomes(passed=11)
        return
    result.assert_outcomes(passed=3, failed=8)
    result.stdout.fnmatch_lines(["E * ember differs from the raw loop: loss of batch 0: *"])
    failed = [line.split(" ")[1] for line in result.outlines if line.startswith("FAILED ")]
    assert failed == [
        "test_1_workers.py::test_2_the_next_test_finds_the_environment_as_before",
        "test_1_workers.py::test_3_the_parity_case_that_failed_after_it",
        "test_2_settings.py::test_2_the_torch_stream_is_as_before",
        "test_2_settings.py::test_3_the_python_stream_is_as_before",
        "test_2_settings.py::test_4_the_default_dtype_is_as_before",
        "test_2_settings.py::test_5_the_thread_count_is_as_before",
        "test_2_settings.py::test_6_deterministic_algorithms_are_as_before",
        "test_3_projects.py::test_2_imports_its_own_project_of_the_same_name",
    ]


CTRL_C_REACHES_EVERY_PROCESS = """
import signal
import subprocess
import sys


def test_ctrl_c_reaches_this_process_and_the_processes_it_starts():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    child = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    assert subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip() == "True"
"""
SIGINT_LINES = "if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:\n    signal.signal("


@pytest.mark.parametrize("restored", [True, False], ids=["suite's conftest", "without its SIGINT lines"])
def test_a_suite_started_with_ctrl_c_ignored_still_delivers_it(tmp_path: Path, restored: bool) -> None:
    """A suite started in the background (bash ignores SIGINT in ``cmd &`` jobs) inherits SIGINT ignored; the
    conftest puts Python's handler back, so the Ctrl-C tests' ``ember`` processes receive what they are sent.
    Without those lines the same session fails: the check sees the inherited state."""
    import signal
    import subprocess

    assert SIGINT_LINES in CONFTEST
    conftest = CONFTEST if restored else CONFTEST.replace(SIGINT_LINES, "if False:\n    signal.signal(")
    (tmp_path / "conftest.py").write_text(conftest, encoding="utf-8")
    (tmp_path / "test_ctrl_c.py").write_text(CTRL_C_REACHES_EVERY_PROCESS, encoding="utf-8")
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "test_ctrl_c.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as bash starts a background job
    )
    assert (done.returncode == 0) == restored, done.stdout[-2000:] + done.stderr[-2000:]

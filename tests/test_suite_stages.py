"""The README's test command (one ``python -m pytest``: the whole suite but the timed tests), what the fast subset
``-m "not slow and not distributed"`` selects, and the order in which the suite hands its tests to the xdist
workers (tests/conftest.py, `pytest_collection_modifyitems`)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFTEST = (ROOT / "tests" / "conftest.py").read_text(encoding="utf-8")
KINDS = ("slow", "distributed", "perf")
#: The fast subset the README's "Tests" section offers for a quick check while working.
FAST = ["-m", "not slow and not distributed"]


def readme_test_command() -> str:
    """The command under "install and pass the tests" in the README's "Two commands"."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# install and pass the tests"))
    return lines[start + 1]


def pytest_stages(command: str) -> list[list[str]]:
    """The arguments of each ``python -m pytest`` in a ``&&`` chain, in order."""
    parts = [shlex.split(part) for part in command.split("&&")]
    return [part[3:] for part in parts if part[:3] == ["python", "-m", "pytest"]]


def test_the_readme_test_command_runs_the_whole_suite_once() -> None:
    """One run: the fast tests fill the time the long ones leave idle on the workers (the multi-process tests and
    the other slow ones start first), and the suite is collected once per worker, not once per stage."""
    command = readme_test_command()
    assert pytest_stages(command) == [[]], command
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f'`python -m pytest {FAST[0]} "{FAST[1]}"`' in readme  # the fast subset, for a quick check
    # CI runs this command (tests/unit/test_docs_site.py) with no hypothesis profile of its own, so the
    # README's command draws the same examples as CI: the profile `ci` (tests/conftest.py)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "EMBER_HYPOTHESIS_PROFILE" not in command and "EMBER_HYPOTHESIS_PROFILE" not in ci
    assert 'settings.load_profile(os.environ.get("EMBER_HYPOTHESIS_PROFILE", "ci"))' in CONFTEST


def test_the_fast_subset_is_most_of_the_suite_and_every_kind_is_in_use(request: pytest.FixtureRequest) -> None:
    """What ``-m "not slow and not distributed"`` selects from this suite, from the items this session collected
    (every worker collects the whole suite; the timed tests are already left out, `pytest_collection_modifyitems`),
    so it runs only in a plain ``python -m pytest``.
    How ``-m`` and the `perf` mark select is checked on a small suite of known tests below
    (`test_timed_tests_run_only_when_the_mark_expression_names_them`)."""
    config = request.config
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or config.option.markexpr or config.option.keyword:
        pytest.skip("counts the whole suite's collection: it runs in a plain `python -m pytest` (the README's)")
    items = request.session.items
    kinds = [{mark.name for mark in item.iter_markers()} & set(KINDS) for item in items]
    assert all("perf" not in found for found in kinds)  # a plain run leaves the timed tests out
    fast = [item.nodeid for item, found in zip(items, kinds, strict=True) if not found]
    marked = {kind for found in kinds for kind in found}
    assert marked == {"slow", "distributed"}, marked
    # most of the suite is fast (1,401 of 1,628 tests when first counted)
    assert len(fast) > 3 * (len(items) - len(fast)), (len(fast), len(items))


FILES = {
    "test_a_fast.py": "def test_a1():\n    pass\n\n\ndef test_a2():\n    pass\n",
    "test_b_mixed.py": (
        "import pytest\n\n\ndef test_b1():\n    pass\n\n\n@pytest.mark.slow\ndef test_b2():\n    pass\n\n\n"
        "def test_b3():\n    pass\n"
    ),
    "test_c_fast.py": "def test_c1():\n    pass\n",
    "test_d_dist.py": "import pytest\n\npytestmark = pytest.mark.distributed\n\n\ndef test_d1():\n    pass\n",
    "test_e_perf.py": "import pytest\n\n\n@pytest.mark.perf\ndef test_e1():\n    pass\n",
    "test_f_waits.py": "import pytest\n\n\n@pytest.mark.waits\ndef test_f1():\n    pass\n",
}


def collected(pytester: pytest.Pytester, *args: str) -> list[str]:
    pytester.makeconftest(CONFTEST)
    for name, body in FILES.items():
        pytester.makepyfile(**{name[:-3]: body})
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", *args)
    return [line for line in result.outlines if "::" in line]


@pytest.mark.parametrize("order", [["-p", "no:randomly"], ["--randomly-seed=1"], ["--randomly-seed=2"]])
def test_multi_process_files_come_first_then_waiting_then_slow_ones_each_file_whole(
    pytester: pytest.Pytester, order: list[str]
) -> None:
    ids = collected(pytester, *order)
    files = [nodeid.split("::")[0] for nodeid in ids]
    assert files[:2] == ["test_d_dist.py", "test_f_waits.py"] and files[2:5] == ["test_b_mixed.py"] * 3, ids
    assert sorted(files[5:]) == ["test_a_fast.py", "test_a_fast.py", "test_c_fast.py"], ids
    if order == ["-p", "no:randomly"]:  # otherwise in the order collected
        assert ids == [
            "test_d_dist.py::test_d1",
            "test_f_waits.py::test_f1",
            "test_b_mixed.py::test_b1",
            "test_b_mixed.py::test_b2",
            "test_b_mixed.py::test_b3",
            "test_a_fast.py::test_a1",
            "test_a_fast.py::test_a2",
            "test_c_fast.py::test_c1",
        ]


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        (None, 8),  # the plain run: everything but the timed test
        ("not slow and not distributed", 6),  # the README's fast subset: no timed test either
        ("slow or distributed", 2),
        ("perf", 1),  # named: the timed test alone
    ],
)
def test_timed_tests_run_only_when_the_mark_expression_names_them(
    pytester: pytest.Pytester, expression: str | None, expected: int
) -> None:
    ids = collected(pytester, "-p", "no:randomly", *([] if expression is None else ["-m", expression]))
    assert len(ids) == expected, ids
    assert ("test_e_perf.py::test_e1" in ids) == (expression == "perf"), ids

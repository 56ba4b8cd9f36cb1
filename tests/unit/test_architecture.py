"""docs/architecture.md is true: every module it names exists, and the layout rules it states hold."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ember"
DOC = (ROOT / "docs" / "architecture.md").read_text()
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _table_rows() -> list[list[str]]:
    """The backticked names of each row of the folder table, the folder first."""
    rows = []
    for line in DOC.splitlines():
        if line.startswith("| `ember/"):
            rows.append(re.findall(r"`([^`]+)`", line))
    return rows


def test_the_folder_table_names_every_folder_of_the_package() -> None:
    named = {row[0].rstrip("/") for row in _table_rows()}
    folders = {f"ember/{p.name}" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= named, f"folders missing from docs/architecture.md: {sorted(folders - named)}"


@pytest.mark.parametrize("row", _table_rows(), ids=lambda row: row[0])
def test_every_module_the_table_names_exists(row: list[str]) -> None:
    folder = ROOT / row[0]
    assert folder.exists(), row[0]
    for name in row[1:]:
        if name.endswith(".py"):
            base = folder if folder.is_dir() else folder.parent
            assert (base / name).is_file() or (PACKAGE / name).is_file(), f"{row[0]}: {name} does not exist"


def test_every_module_path_in_the_text_exists() -> None:
    paths = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)", DOC))
    assert len(paths) >= 10, paths  # the page names the modules it talks about
    for path in paths:
        assert (PACKAGE / path).is_file() or (ROOT / path).is_file(), f"docs/architecture.md names {path}"


def test_functions_the_walkthrough_names_exist() -> None:
    """`module.function` / `Class.method` names in the walkthrough resolve in the code they point at."""
    from ember.trainer import checkpointing, evaluation, loop, optimization, run

    modules = {"run": run, "optimization": optimization, "evaluation": evaluation, "checkpointing": checkpointing}
    named = re.findall(r"`(run|optimization|evaluation|checkpointing)\.(?!py`)([a-z_]+)`", DOC)
    assert len(named) >= 6, named
    for module, attr in named:
        assert hasattr(modules[module], attr), f"{module}.{attr}"
    for method in re.findall(r"`FitLoop\.([a-z_]+)`", DOC):
        assert hasattr(loop.FitLoop, method), f"FitLoop.{method}"


def test_nothing_outside_trainer_py_touches_the_trainers_private_state() -> None:
    pattern = re.compile(r"\btrainer\._[A-Za-z]")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in SOURCES
        if path != PACKAGE / "trainer" / "trainer.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders


def test_no_module_is_over_400_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in SOURCES}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def _runtime_imports(path: Path) -> set[str]:
    """Modules `path` imports outside ``if TYPE_CHECKING:`` blocks (at module level or inside functions)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", ["modules", "loggers", "strategies", "checkpoint"])
def test_imports_point_one_way(folder: str) -> None:
    offenders = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (PACKAGE / folder).rglob("*.py")
        for name in _runtime_imports(path)
        if name.startswith(("ember.trainer", "ember.callbacks"))
    }
    assert not offenders, sorted(offenders)

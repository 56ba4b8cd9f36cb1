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
    from ember.checkpoint import manager, registry
    from ember.trainer import boundary, evaluation, loop, optimization, run

    modules = {
        "run": run,
        "optimization": optimization,
        "evaluation": evaluation,
        "boundary": boundary,
        "registry": registry,
    }
    named = re.findall(r"`(run|optimization|evaluation|boundary|registry)\.(?!py`)([a-z_]+)`", DOC)
    assert len(named) >= 6, named
    for module, attr in named:
        assert hasattr(modules[module], attr), f"{module}.{attr}"
    classes = {"FitLoop": loop.FitLoop, "CheckpointManager": manager.CheckpointManager}
    methods = re.findall(r"`(FitLoop|CheckpointManager)\.([a-z_]+)`", DOC)
    assert len(methods) >= 3, methods
    for cls, method in methods:
        assert hasattr(classes[cls], method), f"{cls}.{method}"


def _ownership_rows() -> list[tuple[str, str, str]]:
    """(state, owner file, class) of each row of "Where state lives"."""
    section = DOC[DOC.index("## Where state lives") : DOC.index("## How to add")]
    rows = re.findall(r"^\| ([^|]+) \| `([^`]+\.py)` \| `([A-Za-z_]+)` \|$", section, flags=re.M)
    return [(state.strip(), path, name) for state, path, name in rows]


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return names


def test_the_ownership_table_names_the_file_that_defines_each_owner() -> None:
    rows = _ownership_rows()
    assert len(rows) >= 8, rows
    for state, path, name in rows:
        assert (ROOT / path).is_file(), f"{state}: {path} does not exist"
        assert name in _top_level_names(ROOT / path), f"{state}: {path} does not define {name}"


def test_the_ownership_table_agrees_with_the_ownership_test() -> None:
    """Each owner class the table names is a component of tests/unit/test_ownership.py, owned by that file."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("_ownership", Path(__file__).with_name("test_ownership.py"))
    assert spec is not None and spec.loader is not None
    ownership = importlib.util.module_from_spec(spec)
    sys.modules["_ownership"] = ownership  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(ownership)
    finally:
        del sys.modules["_ownership"]
    checked = 0
    for state, path, name in _ownership_rows():
        component = ownership.CLASSES.get(name)
        if component is None:
            continue
        owners = ownership.OWNERS[component]
        assert any(path == o or (o.endswith("/") and path.startswith(o)) for o in owners), (state, path, owners)
        checked += 1
    assert checked >= 6, checked


def test_every_checkpoint_concept_lives_in_the_checkpoint_package() -> None:
    """How a checkpoint is gathered, written, located or restored is decided in ember/checkpoint/: no other
    module calls the writers and readers of checkpoint files or torch.distributed.checkpoint directly."""
    entry_points = re.compile(
        r"\b(?:ckpt|checkpoint)\.(?:write_checkpoint|stage_checkpoint|read_tensors|read_meta|read_rank_meta|"
        r"join_checked|split_tensors)\b|\bdcp\.(?:save|load|async_save)\b|\bregistry\.(?:gather|load|restore|write)\b"
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in SOURCES
        if "checkpoint" not in path.relative_to(PACKAGE).parts[:1]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if entry_points.search(line)
    ]
    assert not offenders, offenders


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

"""No import loop in ``ember`` at run time, and docs/architecture.md's import picture is the real one.

The graph is built from the AST of every file of the package. A node is a module (a package is its
``__init__.py``); an edge ``a -> b`` means that running ``a`` can execute ``b``:

- Every ``import`` counts, at module level or inside a function, except those under
  ``if TYPE_CHECKING:`` (they never run). ``import a.b.c``, ``from a.b import c`` (``c`` a name or a
  submodule), ``from a import b as c`` and relative imports are resolved to the modules they load.
- Importing ``ember.x.y`` executes ``ember/x/__init__.py`` first, so it is an edge to ``ember.x`` too,
  and through it to whatever that ``__init__`` imports: a module that imports
  ``ember.checkpoint.files`` runs everything ``ember/checkpoint/__init__.py`` re-exports.
- A module's own enclosing packages are not edges of it. Python starts a package's ``__init__`` before
  any of its submodules, so when ``ember.checkpoint.writing`` imports its sibling
  ``ember.checkpoint.files``, ``ember/checkpoint/__init__.py`` is already running (it is the reason
  ``writing`` runs): nothing is executed again and no loop is taken. An ``__init__`` that re-exports its
  submodules is therefore not in a loop with them. Taking a *name* from an enclosing package
  (``from ember.checkpoint import save`` inside ``ember/checkpoint/``, or ``import ember`` then
  ``ember.Trainer``) does count: it needs that ``__init__`` to have run up to the name, and that is a loop.
- A module-level ``__getattr__`` (PEP 562) runs when a name is looked up, not when the module runs, so
  its imports are edges of whoever takes that name: ``from ember.strategies import DDPStrategy`` is an
  edge to ``ember.strategies.ddp``; ``from ember import config`` then ``config.load(...)`` (looked up in
  the package's ``_WHERE`` table) an edge to ``ember.config.loading``. Lookups are matched by the name an
  import binds anywhere in the file, and annotations are skipped where ``from __future__ import
  annotations`` keeps them from running. Imports by a computed name (``importlib.import_module(name)``
  of a config's ``_target_``) are not in the graph.

A loop is a cycle of that graph. For every edge inside a loop the shortest loop through it is printed, as
``a -> b -> a`` with the file and line of every edge, so each import that takes part in a loop is shown.
`PENDING` names the edges of a loop still to be cut, in files whose owners cut them; each entry must
still close a loop, so it is removed once its edge is.

The package-level picture groups the modules by the top-level unit they belong to (``ember.trainer``
for ``ember.trainer.loop``; ``ember.cli`` for ``ember/cli.py``; ``ember`` for ``ember/__init__.py``):
the table in docs/architecture.md lists, for each unit, the units it imports, and must list exactly the
edges the code has.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Edge:
    """One import that makes `importer` execute `imported`: where it is written."""

    importer: str
    imported: str
    path: Path
    line: int

    def where(self, root: Path) -> str:
        """``file:line`` of the import, relative to `root`."""
        return f"{self.path.relative_to(root)}:{self.line}"


@dataclass(frozen=True)
class _Import:
    """One import statement's effect: the module it loads, and the names it takes from that module."""

    module: str
    names: tuple[str, ...]
    line: int


@dataclass(frozen=True)
class _Lookup:
    """``name.a.b`` in the code, with ``name`` bound by an import to module `bound`: the attributes looked up."""

    bound: str
    attributes: tuple[str, ...]
    line: int


@dataclass
class _Module:
    """What one file does at run time: its imports, its lookups on imported modules, its lazy names."""

    imports: list[_Import]
    lookups: list[_Lookup]
    lazy: dict[str, str]


Graph = dict[str, dict[str, Edge]]


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module in `path` (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _never_run(tree: ast.Module) -> set[int]:
    """The ids of the nodes that never run: ``if TYPE_CHECKING:`` bodies (their ``else:`` runs), and
    annotations when the file has ``from __future__ import annotations``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    postponed = any(
        isinstance(stmt, ast.ImportFrom)
        and stmt.module == "__future__"
        and any(a.name == "annotations" for a in stmt.names)
        for stmt in tree.body
    )
    if postponed:
        for node in ast.walk(tree):
            annotations: list[ast.expr | None] = []
            if isinstance(node, ast.arg):
                annotations.append(node.annotation)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                annotations.append(node.returns)
            elif isinstance(node, ast.AnnAssign):
                annotations.append(node.annotation)
            skipped.update(id(child) for annotation in annotations if annotation for child in ast.walk(annotation))
    return skipped


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` names, relative imports resolved against module `name`."""
    if node.level == 0:
        return node.module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(nodes: list[ast.stmt], name: str, is_package: bool, skipped: set[int]) -> list[_Import]:
    """The imports in `nodes` (walked to any depth) that run, as `_Import`s."""
    found: list[_Import] = []
    for stmt in nodes:
        for node in ast.walk(stmt):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                found.extend(_Import(alias.name, (), node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                names = tuple(alias.name for alias in node.names)
                found.append(_Import(_absolute(node, name, is_package), names, node.lineno))
    return found


def _lookups(tree: ast.Module, name: str, is_package: bool, skipped: set[int]) -> list[_Lookup]:
    """Attribute lookups (``config.load``) on names an import binds, anywhere in the file."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, name, is_package)
            bound.update({alias.asname or alias.name: f"{module}.{alias.name}" for alias in node.names})
    found: list[_Lookup] = []
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.Attribute):
            continue
        attributes: list[str] = []
        inner: ast.expr = node
        while isinstance(inner, ast.Attribute):
            attributes.insert(0, inner.attr)
            inner = inner.value
        if isinstance(inner, ast.Name) and inner.id in bound:
            found.append(_Lookup(bound[inner.id], tuple(attributes), node.lineno))
    return found


def _lazy_names(tree: ast.Module, name: str, is_package: bool, skipped: set[int]) -> tuple[dict[str, str], set[int]]:
    """What a module-level ``__getattr__`` imports for each name, and the ids of its nodes.

    Two spellings are read: ``from ember.x.y import Name`` inside ``__getattr__``, and
    ``importlib.import_module(f"ember.x.{TABLE[name]}")`` with ``TABLE`` a module-level dict of strings.
    """
    tables: dict[str, dict[str, str]] = {}
    for stmt in tree.body:
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Dict)
        ):
            pairs = zip(stmt.value.keys, stmt.value.values, strict=True)
            tables[stmt.targets[0].id] = {
                key.value: value.value
                for key, value in pairs
                if isinstance(key, ast.Constant)
                and isinstance(key.value, str)
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
            }
    lazy: dict[str, str] = {}
    owned: set[int] = set()
    for stmt in tree.body:
        if not (isinstance(stmt, ast.FunctionDef) and stmt.name == "__getattr__"):
            continue
        owned.update(id(node) for node in ast.walk(stmt))
        for found in _imports([stmt], name, is_package, skipped):
            lazy.update(dict.fromkeys(found.names, found.module))
        for node in ast.walk(stmt):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "importlib.import_module"):
                continue
            pattern = node.args[0] if node.args else None
            if not (isinstance(pattern, ast.JoinedStr) and len(pattern.values) == 2):
                continue
            prefix, hole = pattern.values
            if (
                isinstance(prefix, ast.Constant)
                and isinstance(hole, ast.FormattedValue)
                and isinstance(hole.value, ast.Subscript)
                and isinstance(hole.value.value, ast.Name)
            ):
                for key, value in tables.get(hole.value.value.id, {}).items():
                    lazy[key] = f"{prefix.value}{value}"
    return lazy, owned


def _parse(path: Path, name: str) -> _Module:
    """Read one file's run-time imports, lookups and lazy names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    skipped = _never_run(tree)
    lazy, owned = _lazy_names(tree, name, is_package, skipped)
    return _Module(
        _imports(tree.body, name, is_package, skipped | owned), _lookups(tree, name, is_package, skipped | owned), lazy
    )


def _edges(name: str, path: Path, parsed: dict[str, _Module]) -> dict[str, Edge]:
    """The edges of module `name` (file `path`), by the rules in this module's docstring."""
    parts = name.split(".")
    enclosing = {".".join(parts[:i]) for i in range(1, len(parts))}
    if path.name == "__init__.py":
        enclosing.add(name)
    edges: dict[str, Edge] = {}

    def add(target: str, line: int, *, explicit: bool) -> None:
        if target in parsed and target != name and (explicit or target not in enclosing):
            edges.setdefault(target, Edge(name, target, path, line))

    def take(target: str, attribute: str, line: int) -> None:
        """A name looked up in module `target`: it needs that module, and whatever its ``__getattr__`` loads."""
        add(target, line, explicit=True)
        if attribute in parsed[target].lazy:
            add(parsed[target].lazy[attribute], line, explicit=True)

    module = parsed[name]
    for found in module.imports:
        chain = found.module.split(".")
        for i in range(1, len(chain) + 1):
            add(".".join(chain[:i]), found.line, explicit=False)
        for imported in found.names:
            if f"{found.module}.{imported}" in parsed:
                add(f"{found.module}.{imported}", found.line, explicit=True)
            elif found.module in parsed:
                take(found.module, imported, found.line)
    for lookup in module.lookups:
        current = lookup.bound
        if current not in parsed:
            continue
        for attribute in lookup.attributes:
            if f"{current}.{attribute}" not in parsed:
                take(current, attribute, lookup.line)
                break
            current = f"{current}.{attribute}"
    return edges


def build_graph(root: Path, package: str = "ember") -> Graph:
    """The run-time import graph of `package` under `root`: for each module, the modules it imports."""
    paths = {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}
    parsed = {name: _parse(path, name) for name, path in paths.items()}
    return {name: _edges(name, path, parsed) for name, path in paths.items()}


def _shortest_path(graph: Graph, start: str, goal: str, allowed: set[str]) -> list[str] | None:
    """The shortest path from `start` to `goal` through `allowed` nodes (breadth first), or None."""
    before: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = [node]
            while (previous := before[path[-1]]) is not None:
                path.append(previous)
            return path[::-1]
        for nxt in sorted(graph[node]):
            if nxt in allowed and nxt not in before:
                before[nxt] = node
                queue.append(nxt)
    return None


def _strongly_connected(graph: Graph) -> list[set[str]]:
    """The strongly connected components of `graph` with a cycle in them (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def find_cycles(graph: Graph) -> list[list[str]]:
    """Import loops: for every edge inside a loop, the shortest loop through it, each loop once.

    Every edge that takes part in some loop appears in one of the loops returned, so cutting the
    edges they show is what removes all loops. A loop is returned starting at its smallest name.
    """
    cycles: set[tuple[str, ...]] = set()
    for component in _strongly_connected(graph):
        for node in sorted(component):
            for nxt in sorted(graph[node]):
                back = _shortest_path(graph, nxt, node, component) if nxt in component else None
                if back is not None:
                    cycle = [node, *back[:-1]]
                    first = cycle.index(min(cycle))
                    cycles.add(tuple(cycle[first:] + cycle[:first]))
    return [list(cycle) for cycle in sorted(cycles, key=lambda cycle: (len(cycle), cycle))]


def format_cycle(cycle: list[str], graph: Graph, root: Path) -> str:
    """``a -> b -> a`` and, below it, the file:line of each edge."""
    closed = [*cycle, cycle[0]]
    lines = [" -> ".join(closed)]
    lines += [f"    {a} -> {b}: {graph[a][b].where(root)}" for a, b in itertools.pairwise(closed)]
    return "\n".join(lines)


def unit(module: str) -> str:
    """The top-level unit a module belongs to: ``ember.trainer`` for ``ember.trainer.loop``."""
    return ".".join(module.split(".")[:2])


def unit_edges(graph: Graph) -> dict[tuple[str, str], Edge]:
    """The edges between top-level units, each with one import that makes it (the first by name)."""
    edges: dict[tuple[str, str], Edge] = {}
    for importer in sorted(graph):
        for imported, edge in sorted(graph[importer].items()):
            if unit(importer) != unit(imported):
                edges.setdefault((unit(importer), unit(imported)), edge)
    return edges


def documented_imports(text: str) -> dict[str, tuple[int, set[str]]]:
    """The import table of docs/architecture.md: for each unit, its line in the page and the units it imports.

    The table is the one under the heading "## Who imports whom"; a row is ``| `ember.x` | `ember.y`, ... |``.
    """
    heading = "## Who imports whom"
    assert heading in text, f"docs/architecture.md has no section {heading!r}"
    offset = text[: text.index(heading)].count("\n") + 1
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[int, set[str]]] = {}
    for n, line in enumerate(section.splitlines()):
        cells = line.split("|")
        if len(cells) == 4 and re.fullmatch(r"\s*`ember[a-z_.]*`\s*", cells[1]):
            importer = cells[1].strip().strip("`")
            rows[importer] = (offset + n, set(re.findall(r"`(ember[a-z_.]*)`", cells[2])))
    return rows


GRAPH = build_graph(ROOT)

#: Edges that still close a loop, each to be cut in the file it starts from; an entry goes when its edge does.
PENDING: set[tuple[str, str]] = set()


def test_there_is_no_import_loop_at_run_time() -> None:
    graph = {
        importer: {k: v for k, v in edges.items() if (importer, k) not in PENDING} for importer, edges in GRAPH.items()
    }
    cycles = find_cycles(graph)
    report = "\n".join(format_cycle(cycle, graph, ROOT) for cycle in cycles)
    assert not cycles, f"{len(cycles)} import loops at run time:\n{report}"


def test_every_pending_edge_still_closes_a_loop() -> None:
    looping = {pair for cycle in find_cycles(GRAPH) for pair in itertools.pairwise([*cycle, cycle[0]])}
    assert not PENDING - looping, f"no longer in a loop, remove from PENDING: {sorted(PENDING - looping)}"


def test_the_graph_has_the_edges_the_code_has() -> None:
    edge = GRAPH["ember.trainer.trainer"]["ember.modules.module"]
    assert (edge.path.name, edge.path.parent.name) == ("trainer.py", "trainer")
    assert "ember.modules.module" in edge.path.read_text().splitlines()[edge.line - 1]
    assert "ember.modules" in GRAPH["ember.trainer.trainer"]  # the package's __init__ runs first
    assert "ember.strategies.ddp" not in GRAPH["ember.strategies"]  # a PEP 562 __getattr__ is not run on import
    assert "ember.checkpoint" not in GRAPH["ember.checkpoint.writing"]  # its own package is already running
    assert len(GRAPH) > 100 and sum(map(len, GRAPH.values())) > 300


def test_the_builder_finds_a_loop_and_every_kind_of_import(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from pkg.sub import b as bee\nA = 1\n",
        "pkg/sub/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n",
        "pkg/sub/b.py": "def f():\n    from .. import c\n",
        "pkg/c.py": "import pkg.d.e\n",
        "pkg/d/__init__.py": "",
        "pkg/d/e.py": "from ..a import A\n",
        "pkg/lazy/__init__.py": (
            "import importlib\n_WHERE = {'Far': 'far'}\n"
            "def __getattr__(name):\n"
            "    from pkg.lazy.near import Near\n"
            "    return getattr(importlib.import_module(f'pkg.lazy.{_WHERE[name]}'), name)\n"
        ),
        "pkg/lazy/near.py": "",
        "pkg/lazy/far.py": "",
        "pkg/user.py": "from pkg.lazy import Near\n",
        "pkg/looker.py": (
            "from __future__ import annotations\nfrom pkg import lazy\n"
            "def f(x: lazy.Near) -> lazy.Near:\n    return lazy.Far\n"
        ),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = build_graph(tmp_path, "pkg")
    assert set(graph["pkg.a"]) == {"pkg.sub", "pkg.sub.b"}
    assert set(graph["pkg.sub"]) == set()  # TYPE_CHECKING only
    assert set(graph["pkg.sub.b"]) == {"pkg.c"}  # function level, relative
    assert set(graph["pkg.c"]) == {"pkg.d", "pkg.d.e"}
    assert set(graph["pkg.d.e"]) == {"pkg.a"}
    assert set(graph["pkg.lazy"]) == set()
    assert set(graph["pkg.user"]) == {"pkg.lazy", "pkg.lazy.near"}
    assert set(graph["pkg.looker"]) == {"pkg.lazy", "pkg.lazy.far"}  # the annotations never run
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.d.e"]]
    text = format_cycle(find_cycles(graph)[0], graph, tmp_path)
    assert text.splitlines()[0] == "pkg.a -> pkg.sub.b -> pkg.c -> pkg.d.e -> pkg.a"
    assert "pkg.c -> pkg.d.e: pkg/c.py:1" in text and "pkg.a -> pkg.sub.b: pkg/a.py:1" in text


def test_a_name_taken_from_the_enclosing_package_is_an_edge(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from pkg.a import A\nfrom pkg.b import B\n")
    (tmp_path / "pkg" / "a.py").write_text("import pkg.b\nA = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("from pkg import A\nB = 2\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg\nimport pkg.a\ndef f():\n    return pkg.A, pkg.a.A\n")
    graph = build_graph(tmp_path, "pkg")
    assert set(graph["pkg.a"]) == {"pkg.b"}
    assert set(graph["pkg.b"]) == {"pkg"}
    assert set(graph["pkg.c"]) == {"pkg", "pkg.a"}  # pkg.A: a name the package binds
    assert find_cycles(graph) == [["pkg", "pkg.b"], ["pkg", "pkg.a", "pkg.b"]]


def test_the_docs_import_table_is_the_real_one() -> None:
    real = unit_edges(GRAPH)
    rows = documented_imports(DOC.read_text())
    units = {unit(module) for module in GRAPH}
    assert set(rows) == units, f"rows to add: {sorted(units - set(rows))}; rows to remove: {sorted(set(rows) - units)}"
    documented = {(importer, imported): n for importer, (n, imports) in rows.items() for imported in imports}
    missing = [f"{a} -> {b} ({edge.where(ROOT)})" for (a, b), edge in sorted(real.items()) if (a, b) not in documented]
    stale = [f"{a} -> {b} (docs/architecture.md:{n})" for (a, b), n in sorted(documented.items()) if (a, b) not in real]
    assert not missing, "imports docs/architecture.md's table does not list:\n" + "\n".join(missing)
    assert not stale, "edges docs/architecture.md's table lists that no import makes:\n" + "\n".join(stale)

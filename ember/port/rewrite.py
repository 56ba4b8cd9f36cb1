"""One file's port: the Lightning imports and the references to the names they bind, found in the syntax tree
and rewritten at their byte positions (`port_source`); what cannot be mapped is kept and noted."""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field

from ember.port.names import (
    ACCELERATORS,
    CALLBACK_BASES,
    MODULE_BASES,
    REMOVED_METHODS,
    TRAINER_KEYWORDS,
    UTILITIES_ADVICE,
    Target,
    is_module,
    qualified,
    resolve,
    split_lightning,
)
from ember.port.syntax import alias_text, comments_within, line_starts, names_in, scopes


class PortError(Exception):
    """A file that cannot be ported: missing, not Python, or not valid Python (the message is one line)."""


@dataclass(frozen=True)
class Note:
    """Something the port left for a hand edit: where, the Lightning name as written, and what to do."""

    line: int
    col: int
    name: str
    advice: str

    def format(self, path: str) -> str:
        """``path:line:col: name: advice``, the form compilers use."""
        return f"{path}:{self.line}:{self.col + 1}: {self.name}: {self.advice}"


@dataclass
class PortResult:
    """The ported text, what was rewritten (`mapped`: names as ``old -> new``) and what was not (`notes`)."""

    source: str
    original: str
    mapped: list[str] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """Whether the port changed the text."""
        return self.source != self.original

    def diff(self, path: str) -> str:
        """A unified diff from the original to the ported text, both named `path`."""
        lines = difflib.unified_diff(
            self.original.splitlines(keepends=True),
            self.source.splitlines(keepends=True),
            fromfile=f"{path} (Lightning)",
            tofile=f"{path} (ember)",
        )
        return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


@dataclass
class _Binding:
    """A local name an import binds to a Lightning module or object (`parts` as `split_lightning` gives)."""

    local: str
    parts: list[str]
    statement: ast.Import | ast.ImportFrom
    kept: bool = False  # some reference stays unmapped: the Lightning import stays too
    needs: set[str] = field(default_factory=set)  # ember modules its rewritten references need imported


@dataclass
class _Edit:
    start: int  # byte offsets into the UTF-8 text
    end: int
    text: str


class _Porter:
    """One file's port: find the Lightning bindings and references, then rewrite them (see `port_source`)."""

    def __init__(self, source: str, tree: ast.Module) -> None:
        self.source = source
        self.data = source.encode("utf-8")
        self.tree = tree
        self.line_starts = line_starts(self.data)
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.scope_of, self.local_names = scopes(tree)
        self.bindings: dict[tuple[ast.AST, str], _Binding] = {}
        self.edits: list[_Edit] = []
        self.notes: list[Note] = []
        self.mapped: list[str] = []
        self.used_names = names_in(tree)
        self.resolved_refs: dict[ast.AST, Target] = {}  # reference node -> what it became

    # positions ------------------------------------------------------------------------------------------------
    def offset(self, line: int, col: int) -> int:
        return self.line_starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),  # type: ignore[attr-defined]
            self.offset(node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )

    def note(self, node: ast.AST, name: str, advice: str) -> None:
        self.notes.append(Note(node.lineno, node.col_offset, name, advice))  # type: ignore[attr-defined]

    # the passes -----------------------------------------------------------------------------------------------
    def run(self) -> None:
        imports = [n for n in ast.walk(self.tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for statement in imports:
            self.collect_bindings(statement)
        renames = self.plan_symbol_names()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name):
                binding = self.binding_of(node)
                if binding is not None:
                    self.rewrite_reference(node, binding, renames)
        for statement in imports:
            self.rewrite_import(statement, renames)
        self.check_trainer_calls()
        self.check_classes()
        self.notes.sort(key=lambda n: (n.line, n.col))

    def collect_bindings(self, statement: ast.Import | ast.ImportFrom) -> None:
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                parts = split_lightning(alias.name)
                if parts is not None:
                    local = alias.asname or alias.name.split(".")[0]
                    bound = parts if alias.asname else split_lightning(alias.name.split(".")[0]) or []
                    self.bindings[self.scope_of[statement], local] = _Binding(local, list(bound), statement)
                elif alias.name.split(".")[0] == "lightning_utilities":
                    self.note(statement, alias.name, UTILITIES_ADVICE)
            return
        if statement.level or statement.module is None:
            return
        parts = split_lightning(statement.module)
        if parts is None:
            if statement.module.split(".")[0] == "lightning_utilities":
                for alias in statement.names:
                    self.note(statement, f"{statement.module}.{alias.name}", UTILITIES_ADVICE)
            return
        for alias in statement.names:
            if alias.name == "*":
                self.note(statement, f"{statement.module}.*", "a star import: import the names you use by name")
                continue
            self.bindings[self.scope_of[statement], alias.asname or alias.name] = _Binding(
                alias.asname or alias.name, [*parts, alias.name], statement
            )

    def binding_of(self, name: ast.Name) -> _Binding | None:
        """The Lightning import a name refers to, following Python's scopes (a parameter or local variable of
        the same name hides a module-level import)."""
        scope: ast.AST | None = self.scope_of.get(name)
        first = True
        while scope is not None:
            if (first or not isinstance(scope, ast.ClassDef)) and name.id in self.local_names.get(scope, ()):
                return self.bindings.get((scope, name.id))
            first = False
            scope = self.scope_of.get(scope)
        return None

    def plan_symbol_names(self) -> dict[tuple[ast.AST, str], str]:
        """For objects imported by name whose ember name differs, the new local name (when it is free)."""
        renames: dict[tuple[ast.AST, str], str] = {}
        for (scope, local), binding in self.bindings.items():
            if not isinstance(binding.statement, ast.ImportFrom):
                continue
            target = resolve(binding.parts)
            if not isinstance(target, Target) or target.name is None:
                continue
            aliased = any(a.asname == local for a in binding.statement.names)
            if not aliased and target.name != local and target.name not in self.used_names:
                renames[scope, local] = target.name
        return renames

    def rewrite_reference(self, name: ast.Name, binding: _Binding, renames: dict[tuple[ast.AST, str], str]) -> None:
        """One use of a Lightning binding: ``pl.callbacks.EarlyStopping`` (the attribute chain up to the first
        object), a module (``pl.callbacks`` passed on), or a name imported by name."""
        link: ast.AST = name
        parts = list(binding.parts)
        while is_module(parts):
            parent = self.parents.get(link)
            if not isinstance(parent, ast.Attribute) or parent.value is not link:
                break  # the chain ends on a module
            link, parts = parent, [*parts, parent.attr]
        target = resolve(parts)
        if not isinstance(target, Target):
            binding.kept = True
            if link is not name or isinstance(binding.statement, ast.Import):
                self.note(link, ".".join(qualified(parts)), target)
            return  # a name imported by name is listed once, at its import
        self.resolved_refs[link] = target
        start, end = self.span(link)
        if link is name and isinstance(binding.statement, ast.ImportFrom) and target.name is not None:
            aliased = any(a.asname == name.id for a in binding.statement.names)
            if aliased or target.name == name.id:
                return  # the import keeps the local name: nothing to change here
            key = (self.scope_of[binding.statement], name.id)
            if key in renames:
                self.edits.append(_Edit(start, end, renames[key]))
                return
        binding.needs.add(target.module)
        self.edits.append(_Edit(start, end, target.dotted))

    def rewrite_import(self, statement: ast.Import | ast.ImportFrom, renames: dict[tuple[ast.AST, str], str]) -> None:
        """Replace a Lightning import by the ember imports its references need; unmapped names stay imported."""
        kept: list[str] = []
        new: list[str] = []
        from_groups: dict[str, list[str]] = {}
        needs: set[str] = set()
        lightning = False
        scope = self.scope_of[statement]
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                local = alias.asname or alias.name.split(".")[0]
                binding = self.bindings.get((scope, local))
                if split_lightning(alias.name) is None or binding is None or binding.statement is not statement:
                    kept.append(alias_text(alias))
                    continue
                lightning = True
                if binding.kept:
                    kept.append(alias_text(alias))
                needs |= binding.needs
            if kept:
                new.append("import " + ", ".join(kept))
        else:
            if statement.level or statement.module is None or split_lightning(statement.module) is None:
                return
            lightning = True
            for alias in statement.names:
                local = alias.asname or alias.name
                binding = self.bindings.get((scope, local))
                if alias.name == "*" or binding is None or binding.statement is not statement:
                    kept.append(alias_text(alias))
                    continue
                target = resolve(binding.parts)
                if not isinstance(target, Target):
                    self.note(statement, f"{statement.module}.{alias.name}", target)
                    kept.append(alias_text(alias))
                    continue
                if binding.kept:
                    kept.append(alias_text(alias))
                needs |= binding.needs
                old = f"{statement.module}.{alias.name}"
                if target.name is None:  # a module imported by name: its references were qualified
                    self.mapped.append(f"{old} -> {target.dotted}")
                    continue
                self.mapped.append(f"{old} -> {target.dotted}")
                if alias.asname:
                    text = target.name if target.name == alias.asname else f"{target.name} as {alias.asname}"
                elif (scope, local) in renames or target.name == local:
                    text = target.name
                else:  # the ember name is taken in this file: references were qualified instead
                    continue
                from_groups.setdefault(target.module, []).append(text)
            if kept:
                new.append(f"from {statement.module} import {', '.join(kept)}")
            new += [f"from {module} import {', '.join(names)}" for module, names in from_groups.items()]
        if not lightning:
            return
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                local = alias.asname or alias.name.split(".")[0]
                binding = self.bindings.get((scope, local))
                if binding is not None and binding.statement is statement and split_lightning(alias.name) is not None:
                    self.mapped.append(f"{alias.name} -> ember")
        new += [f"import {module}" for module in sorted(needs, key=lambda m: (m != "ember", m))]
        if not new:  # nothing of it is used: keep the dependency visible
            new = ["import ember"]
        start, end = self.span(statement)
        comments = comments_within(self.source, statement)
        self.edits.append(_Edit(start, end, self.join_statements(statement, [*comments, *new])))

    def join_statements(self, statement: ast.stmt, lines: list[str]) -> str:
        """Several statements where one stood: one per line at its indentation, or ``;`` after other code."""
        line_start = self.line_starts[statement.lineno - 1]
        before = self.data[line_start : self.offset(statement.lineno, statement.col_offset)].decode("utf-8")
        if before.strip():
            return "; ".join(line for line in lines if not line.startswith("#"))
        return ("\n" + before).join(lines)

    def check_trainer_calls(self) -> None:
        """Trainer keywords and accelerators ember does not take (listed, not changed)."""
        import inspect

        from ember.trainer.trainer import Trainer

        accepted = set(inspect.signature(Trainer).parameters)
        for ref, target in self.resolved_refs.items():
            call = self.parents.get(ref)
            if target != Target("ember", "Trainer") or not isinstance(call, ast.Call) or call.func is not ref:
                continue
            if call.args:
                self.note(call, "Trainer(...)", "ember's Trainer options are keyword-only: name each argument")
            for keyword in call.keywords:
                if keyword.arg is None:
                    continue
                if keyword.arg in TRAINER_KEYWORDS:
                    self.note(keyword, f"Trainer({keyword.arg}=...)", TRAINER_KEYWORDS[keyword.arg])
                elif keyword.arg not in accepted:
                    self.note(keyword, f"Trainer({keyword.arg}=...)", "ember's Trainer has no such option")
                value = keyword.value
                if keyword.arg == "accelerator" and isinstance(value, ast.Constant) and value.value in ACCELERATORS:
                    self.note(keyword, f"Trainer(accelerator={value.value!r})", ACCELERATORS[str(value.value)])

    def check_classes(self) -> None:
        """Methods a ported module or callback defines that ember does not call (listed, not changed)."""
        from ember.callbacks.lightning_hooks import AUTOMATIC_ONLY, LIGHTNING_ONLY, MODULE_METHODS

        kinds: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.ClassDef):
                continue
            kind = None
            for base in node.bases:
                target = self.resolved_refs.get(base)
                base_kind = kinds.get(base.id) if isinstance(base, ast.Name) else None
                if target is not None and target.name in MODULE_BASES:
                    base_kind = "module"
                elif target is not None and target.name in CALLBACK_BASES:
                    base_kind = "callback"
                kind = kind or base_kind
            if kind is None:
                continue
            kinds[node.name] = kind
            manual = _sets_manual_optimization(node)
            for item in node.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                meaning: tuple[str, str] | None = LIGHTNING_ONLY.get(item.name)
                if kind == "module" and meaning is None:
                    meaning = MODULE_METHODS.get(item.name)
                if meaning is not None and manual and item.name in AUTOMATIC_ONLY:
                    continue  # under manual optimization neither framework calls it, and ember accepts it
                if meaning is not None:
                    self.note(item, f"{node.name}.{item.name}", f"ember does not call it ({meaning[0]}); {meaning[1]}")
                elif kind == "module" and item.name in REMOVED_METHODS:
                    self.note(item, f"{node.name}.{item.name}", REMOVED_METHODS[item.name])

    def result(self) -> str:
        data = self.data
        for edit in sorted(self.edits, key=lambda e: e.start, reverse=True):
            data = data[: edit.start] + edit.text.encode("utf-8") + data[edit.end :]
        return data.decode("utf-8")


def _sets_manual_optimization(cls: ast.ClassDef) -> bool:
    """Whether a class body assigns ``self.automatic_optimization = False`` (or defines it so)."""
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else []
        value = node.value if isinstance(node, ast.Assign) else None
        for target in targets:
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
            if name == "automatic_optimization" and isinstance(value, ast.Constant) and value.value is False:
                return True
    return False


def port_source(source: str, filename: str = "<string>") -> PortResult:
    """Port one file's text; raises `PortError` (with the line) when it is not valid Python."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise PortError(f"{filename}:{exc.lineno}: syntax error: {exc.msg}") from None
    except ValueError as exc:  # null bytes
        raise PortError(f"{filename}: not a Python file ({exc})") from None
    porter = _Porter(source, tree)
    porter.run()
    return PortResult(source=porter.result(), original=source, mapped=porter.mapped, notes=porter.notes)

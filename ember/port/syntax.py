"""The syntax-tree helpers `ember port`'s rewrite needs: byte offsets of lines, Python's scopes and the names
each binds, and the comments inside a statement."""

from __future__ import annotations

import ast
import io
import tokenize


def alias_text(alias: ast.alias) -> str:
    return f"{alias.name} as {alias.asname}" if alias.asname else alias.name


def line_starts(data: bytes) -> list[int]:
    """Byte offset of each line's start, lines ending as Python's tokenizer ends them (\\n, \\r\\n, \\r)."""
    starts = [0]
    i, n = 0, len(data)
    while i < n:
        c = data[i]
        if c == 0x0A or (c == 0x0D and (i + 1 >= n or data[i + 1] != 0x0A)):
            starts.append(i + 1)
        i += 1
    return starts


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def scopes(tree: ast.Module) -> tuple[dict[ast.AST, ast.AST], dict[ast.AST, set[str]]]:
    """Each node's scope (the module, a function, lambda, comprehension or class body; a scope's own entry is
    the scope around it) and the names each scope binds, as Python resolves names."""
    scope_of: dict[ast.AST, ast.AST] = {}
    local_names: dict[ast.AST, set[str]] = {tree: set()}
    declared: dict[ast.AST, set[str]] = {}  # global / nonlocal names: not local

    def visit(node: ast.AST, scope: ast.AST) -> None:
        scope_of[node] = scope
        names = local_names[scope]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            outer: list[ast.AST] = [*node.decorator_list]
            if isinstance(node, ast.ClassDef):
                outer += [*node.bases, *(k.value for k in node.keywords)]
            else:
                outer += [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
                outer += [a.annotation for a in _arguments(node.args) if a.annotation is not None]
                outer += [node.returns] if node.returns is not None else []
            for child in outer:
                visit(child, scope)
            local_names[node] = {a.arg for a in _arguments(node.args)} if not isinstance(node, ast.ClassDef) else set()
            for child in node.body:
                visit(child, node)
            return
        if isinstance(node, ast.Lambda):
            local_names[node] = {a.arg for a in _arguments(node.args)}
            for child in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
                visit(child, scope)
            visit(node.body, node)
            return
        if isinstance(node, _COMPREHENSIONS):
            local_names[node] = set()
            for child in ast.iter_child_nodes(node):
                visit(child, node)
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            declared.setdefault(scope, set()).update(node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    for child in tree.body:
        visit(child, tree)
    for scope, names in declared.items():
        local_names[scope] -= names
    return scope_of, local_names


def _arguments(args: ast.arguments) -> list[ast.arg]:
    extra = [a for a in (args.vararg, args.kwarg) if a is not None]
    return [*args.posonlyargs, *args.args, *extra, *args.kwonlyargs]


def names_in(tree: ast.AST) -> set[str]:
    """Every identifier the file binds or reads (to tell whether a new local name would collide)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
    return names


def comments_within(source: str, statement: ast.stmt) -> list[str]:
    """Comments inside a (parenthesised, multi-line) statement, which a rewrite of it would drop."""
    if statement.end_lineno == statement.lineno:
        return []
    lines = source.splitlines(keepends=True)[statement.lineno - 1 : statement.end_lineno]
    comments = []
    try:
        for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
            if token.type == tokenize.COMMENT and token.start[0] < len(lines):
                comments.append(token.string)
    except (tokenize.TokenError, SyntaxError):
        return []
    return comments

"""State has one owner: no module assigns attributes of the trainer, the module, the strategy, the fit's state or
another component's object outside the file (or package) that owns it.

The check reads every function of ``ember/`` from its AST. A write is ``x.attr = ...`` (also augmented and
annotated assignments and tuple targets), ``setattr(x, ...)``, ``object.__setattr__(x, ...)`` and
``x.__dict__[...] = ...``, for any receiver ``x`` but a bare ``self`` / ``cls``. The receiver's kind is found
from its names: the last name of the receiver's chain that is a known component (``trainer.run_state`` is
the run state), where a name may be a parameter annotated with a component's class (``t: Trainer`` is a
trainer) or a local bound to such a chain (``state = trainer.run_state``). A write to a known component is
allowed only in its owner's files. A write through any other receiver is allowed unless it sets a private
attribute (``x._name``), goes through ``__dict__``, or uses ``setattr``: those reach into an object's
internals. The exceptions are `ALLOWED`: a short list, each with its reason.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ember"

#: A component's name (as the code names it) -> the files or folders that own its attributes.
OWNERS: dict[str, tuple[str, ...]] = {
    "trainer": ("ember/trainer/trainer.py",),
    "scratch": ("ember/trainer/trainer.py",),  # the finders' scratch Trainer
    "module": ("ember/modules/",),
    "datamodule": ("ember/modules/",),
    "strategy": ("ember/strategies/",),
    "precision": ("ember/strategies/",),
    "loop": ("ember/trainer/loop.py",),
    "fit_loop": ("ember/trainer/loop.py",),
    "progress": ("ember/trainer/loop.py",),  # the FitState
    "fit_state": ("ember/trainer/loop.py",),
    "run_state": ("ember/trainer/run.py",),
    "eval_progress": ("ember/trainer/evaluation.py",),
    "reporter": ("ember/trainer/reporting.py",),
    "collector": ("ember/modules/logging.py",),
    "train_collector": ("ember/modules/logging.py",),
    "eval_collector": ("ember/modules/logging.py",),
    "checkpoints": ("ember/checkpoint/manager.py",),
    "hooks": ("ember/callbacks/callback_list.py",),
    "finite_guard": ("ember/trainer/numerics.py",),
}

#: A parameter annotated with one of these classes is that component, whatever its name.
CLASSES: dict[str, str] = {
    "Trainer": "trainer",
    "TrainingModule": "module",
    "DataModule": "datamodule",
    "Strategy": "strategy",
    "ParallelStrategy": "strategy",
    "DDPStrategy": "strategy",
    "FSDPStrategy": "strategy",
    "ModelParallelStrategy": "strategy",
    "Precision": "precision",
    "FitLoop": "loop",
    "FitState": "progress",
    "RunState": "run_state",
    "EvalProgress": "eval_progress",
    "Reporter": "reporter",
    "MetricCollector": "collector",
    "CheckpointManager": "checkpoints",
    "CallbackList": "hooks",
    "FiniteGuard": "finite_guard",
}

#: (file, the write as written) -> why it is allowed. Keep it short; each entry is reviewed.
ALLOWED: dict[tuple[str, str], str] = {
    ("*", "trainer.should_stop"): "Lightning's public way for a callback to stop a run",
    ("ember/commands.py", "trainer.run_config"): "the command hands the resolved config to the trainer it built",
    ("ember/commands.py", "module.optimizer_config"): "the command hands the config's optimizer to the module it built",
    ("ember/tuning/lr_finder.py", "scratch.run_config"): "the scratch run is recorded with the user's config",
    ("ember/trainer/run.py", "module.trainer"): "a run attaches its trainer (Lightning's public setter)",
    ("ember/tuning/scratch.py", "self.module.trainer"): "a finder re-attaches the module's own trainer after it",
    ("ember/strategies/strategy.py", "module._compiled_call_impl"): (
        "the slot nn.Module.compile fills; torch 2.13 skips a compiled _call_impl (compile_in_place)"
    ),
    ("ember/checkpoint/resume.py", "object.__setattr__(loader)"): (
        "a resumed epoch's stand-in sampler, for one epoch; DataLoader forbids setting it after __init__"
    ),
    ("ember/trainer/data.py", "loader._iterator"): (
        "a DataLoader whose persistent workers a fit stopped makes a new iterator next time (Lightning does so too)"
    ),
    ("ember/tuning/profiler.py", "setattr(obj)"): "the profiler times methods by wrapping them, and unwraps them",
    ("ember/tuning/batch_size.py", "setattr(self.datamodule)"): (
        "the batch-size finder sets the attribute the user named (Lightning's batch_arg_name), and puts it back"
    ),
}


@dataclass(frozen=True)
class Write:
    path: str
    line: int
    text: str
    component: str | None  # the receiver's component, if known
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text} ({self.why})"


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None for anything that is not a plain chain of names."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    names.append(node.id)
    return names[::-1]


def _component(chain: list[str], aliases: dict[str, str]) -> str | None:
    """The last known component along `chain` (its first name resolved through `aliases`)."""
    found = aliases.get(chain[0]) or (chain[0] if chain[0] in OWNERS else None)
    for name in chain[1:]:
        if name in OWNERS:
            found = name
    return found


def _annotated(annotation: ast.expr | None) -> str | None:
    if annotation is None:
        return None
    names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
    names |= {n.value for n in ast.walk(annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return next((CLASSES[name] for name in sorted(names) if name in CLASSES), None)


def _aliases(function: ast.AST) -> dict[str, str]:
    """Names that stand for a component in `function`: annotated parameters and locals bound to a chain."""
    aliases: dict[str, str] = {}
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        args = function.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            kind = _annotated(arg.annotation)
            if kind is not None:
                aliases[arg.arg] = kind
    for node in _own_nodes(function):
        if isinstance(node, ast.Assign):
            pairs = []
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts, strict=False))
                else:
                    pairs.append((target, node.value))
            for target, value in pairs:
                chain = _chain(value) if isinstance(target, ast.Name) else None
                kind = _component(chain, aliases) if chain else None
                if isinstance(target, ast.Name) and kind is not None and target.id not in ("self", "cls"):
                    aliases[target.id] = kind
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            kind = _annotated(node.annotation)
            if kind is not None:
                aliases[node.target.id] = kind
    return aliases


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of `scope` outside the functions and classes nested in it."""
    found: list[ast.AST] = []
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def _writes_in(path: str, scope: ast.AST, inherited: dict[str, str]) -> list[Write]:
    aliases = {**inherited, **_aliases(scope)}
    writes: list[Write] = []

    def receiver_write(receiver: ast.expr, attr: str, text: str, line: int, forced: str | None = None) -> None:
        chain = _chain(receiver)
        if chain == ["self"] or chain == ["cls"]:
            return
        kind = _component(chain, aliases) if chain else None
        if kind is not None:
            writes.append(Write(path, line, text, kind, f"writes a {kind}'s attribute"))
        elif forced is not None:
            writes.append(Write(path, line, text, None, forced))
        elif attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
            writes.append(Write(path, line, text, None, "writes another object's private attribute"))

    for node in _own_nodes(scope):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        flat: list[ast.expr] = []
        for target in targets:
            flat += list(target.elts) if isinstance(target, ast.Tuple) else [target]
        for target in flat:
            if isinstance(target, ast.Attribute):
                receiver_write(target.value, target.attr, ast.unparse(target), node.lineno)  # type: ignore[attr-defined]
            elif (
                isinstance(target, ast.Subscript)
                and isinstance(target.value, ast.Attribute)
                and target.value.attr == "__dict__"
            ):
                text = ast.unparse(target)
                receiver_write(target.value.value, "__dict__", text, node.lineno, "writes through __dict__")  # type: ignore[attr-defined]
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            if func in ("setattr", "object.__setattr__"):
                text = f"{func}({ast.unparse(node.args[0])})"
                receiver_write(node.args[0], "", text, node.lineno, f"sets an attribute with {func}")
    for nested in _nested_direct(scope):
        writes += _writes_in(path, nested, {} if isinstance(nested, ast.ClassDef) else aliases)
    return writes


def _nested_direct(scope: ast.AST) -> list[ast.AST]:
    """Functions and classes defined in `scope` (not inside another function or class of it)."""
    found: list[ast.AST] = []
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            found.append(node)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def writes_from_outside(source: str, path: str) -> list[Write]:
    """Every write in `source` (the file at `path`, relative to the repository) that its owner does not make."""
    found = []
    for write in _writes_in(path, ast.parse(source), {}):
        owners = OWNERS.get(write.component or "", ())
        if any(path == owner or (owner.endswith("/") and path.startswith(owner)) for owner in owners):
            continue
        if (path, write.text) in ALLOWED or ("*", write.text) in ALLOWED:
            continue
        found.append(write)
    return found


def _package_writes() -> list[Write]:
    found: list[Write] = []
    for file in sorted(PACKAGE.rglob("*.py")):
        found += writes_from_outside(file.read_text(), str(file.relative_to(ROOT)))
    return found


def test_no_module_writes_state_it_does_not_own() -> None:
    found = _package_writes()
    assert not found, "writes outside their owner (add a method to the owner instead):\n" + "\n".join(map(str, found))


def test_every_allowed_exception_is_still_needed() -> None:
    """An entry of `ALLOWED` that matches no write any more is stale: drop it."""
    seen = set()
    for file in sorted(PACKAGE.rglob("*.py")):
        path = str(file.relative_to(ROOT))
        for write in _writes_in(path, ast.parse(file.read_text()), {}):
            seen.add((path, write.text))
            seen.add(("*", write.text))
    assert set(ALLOWED) <= seen, sorted(set(ALLOWED) - seen)


@pytest.mark.parametrize(
    ("source", "path", "expected"),
    [
        ("def f(trainer):\n    trainer.stage = 'fit'\n", "ember/trainer/run.py", ["trainer.stage"]),
        ("def f(t: 'Trainer'):\n    t.loggers = []\n", "ember/trainer/run.py", ["t.loggers"]),
        (
            "def f(trainer):\n    state = trainer.run_state\n    state.ckpt = None\n",
            "ember/tuning/x.py",
            ["state.ckpt"],
        ),
        ("def f(trainer):\n    state = trainer.run_state\n    state.ckpt = None\n", "ember/trainer/run.py", []),
        (
            "def f(loop):\n    loop.progress.global_step += 1\n",
            "ember/trainer/optimization.py",
            ["loop.progress.global_step"],
        ),
        ("def f(m):\n    m._x = 1\n", "ember/export/a.py", ["m._x"]),
        ("def f(m):\n    m.__dict__['a'] = 1\n", "ember/export/a.py", ["m.__dict__['a']"]),
        ("def f(m):\n    setattr(m, 'a', 1)\n", "ember/export/a.py", ["setattr(m)"]),
        ("def f(m):\n    m.training = False\n", "ember/export/a.py", []),
        (
            "class A:\n    def f(self):\n        self.x = 1\n        self.trainer.y = 2\n",
            "ember/a.py",
            ["self.trainer.y"],
        ),
        ("def f(trainer):\n    def g():\n        trainer.x = 1\n    return g\n", "ember/a.py", ["trainer.x"]),
        ("def f(strategy):\n    strategy.precision = None\n", "ember/strategies/ddp.py", []),
        ("def f(trainer):\n    trainer.should_stop = True\n", "ember/callbacks/a.py", []),
    ],
)
def test_the_check_finds_what_it_should(source: str, path: str, expected: list[str]) -> None:
    """The checker itself, on small sources: each kind of write it must catch, and what it must let pass."""
    assert [w.text for w in writes_from_outside(source, path)] == expected

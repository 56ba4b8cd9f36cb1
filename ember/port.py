"""``ember port FILE...``: the migration guide's recipe, applied to Python files.

It rewrites what ties a file to Lightning and nothing else: import statements of ``lightning``,
``lightning.pytorch`` and ``pytorch_lightning``, and every reference to a name they bind
(``pl.LightningModule`` -> ``ember.TrainingModule``, ``LightningDataModule`` -> ``DataModule``,
``pl.callbacks.TQDMProgressBar`` -> ``ember.callbacks.ProgressLine``, ...). The file is read with `ast` and
edited at the positions of those nodes only, so strings, comments, docstrings and layout stay as they were.

A name is mapped only when ember exports its counterpart in this installation (``ember.__all__``,
``ember.callbacks``, ``ember.loggers``, ``ember.strategies``, ``ember.utilities``). Everything else is
listed with its line and what to do instead (`UNSUPPORTED`); its import is kept, so the file still runs
where Lightning is installed. The port also lists, without changing them, Trainer keywords ember does not
take and module methods ember does not call.

::

    ember port model.py              # in place; the original is kept as model.py.orig
    ember port src/*.py --out ported # writes ported/<name>.py
    ember port model.py --diff       # prints a unified diff, writes nothing

Exit code 0: every Lightning name was mapped; 1: the files were written but some names are listed for
a hand edit; 2: a mistake (a missing file, a file that is not Python, a syntax error), nothing written.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import io
import sys
import tokenize
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Import roots that are Lightning, longest first (``lightning`` alone is the umbrella package).
ROOTS = ("lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning")

#: Lower-case names of Lightning's subpackages and modules: in ``pl.callbacks.early_stopping.EarlyStopping``
#: every part up to the first name not in this set is a module, that name is the object.
# fmt: off
SUBMODULES = frozenset(
    [
        "accelerator", "accelerator_connector", "accelerators", "advanced", "amp", "argparse", "async_plugin",
        "automatic", "base", "batch_size_finder", "batch_size_scaling", "bitsandbytes", "boring_classes", "call",
        "callback", "callback_connector", "callbacks", "checkpoint", "checkpoint_connector", "checkpoint_plugin", "cli",
        "closure", "combined_loader", "comet", "compile", "configuration_validator", "connectors",
        "consolidate_checkpoint", "core", "cpu", "csv_logs", "cuda", "data", "data_connector", "datamodule", "ddp",
        "deepspeed", "demos", "device_stats_monitor", "distributed", "double", "early_stopping", "enums",
        "environments", "evaluation_loop", "exceptions", "fetchers", "finetuning", "fit_loop", "fsdp", "fx_validator",
        "gradient_accumulation_scheduler", "grads", "half", "hooks", "hparams_mixin", "hpu", "imports", "io",
        "lambda_function", "launcher", "launchers", "layer_sync", "litlogger", "logger", "logger_connector", "loggers",
        "loop", "loops", "lr_finder", "lr_monitor", "lstm", "manual", "memory", "migration", "mixins", "mlflow",
        "mnist_datamodule", "model_checkpoint", "model_helpers", "model_parallel", "model_registry", "model_summary",
        "model_summary_deepspeed", "module", "mps", "multiprocessing", "neptune", "on_exception_checkpoint",
        "optimization", "optimizer", "overrides", "parallel", "parameter_tying", "parsing", "plugins", "precision",
        "prediction_loop", "prediction_writer", "profiler", "profilers", "progress", "progress_bar", "pruning",
        "pytorch", "rank_zero", "result", "rich_model_summary", "rich_progress", "saving", "seed", "servable_module",
        "servable_module_validator", "serve", "setup", "signal_connector", "signature_utils", "simple", "single_device",
        "single_xla", "spike", "states", "stochastic_weight_avg", "strategies", "strategy", "subprocess_script",
        "tensorboard", "testing", "throughput_monitor", "timer", "torch_plugin", "tpu", "tqdm_progress", "trainer",
        "training_epoch_loop", "transformer", "transformer_engine", "tuner", "tuning", "types", "upgrade_checkpoint",
        "utilities", "utils", "wandb", "warnings", "weight_averaging", "wrapper", "xla", "xla_plugin", "fabric", "app",
        "store",
    ]
)
# fmt: on

#: Lightning subpackages whose ember counterpart has the same name.
PACKAGES = {"callbacks": "ember.callbacks", "loggers": "ember.loggers", "strategies": "ember.strategies"}

#: Lightning names ember has under another name: (Lightning package, name) -> ember name.
RENAMED = {
    ("", "LightningModule"): "TrainingModule",
    ("", "LightningDataModule"): "DataModule",
    ("callbacks", "TQDMProgressBar"): "ProgressLine",
    ("callbacks", "EMAWeightAveraging"): "EMA",
    ("loggers", "MLFlowLogger"): "MLflowLogger",
}

#: Names ember is growing: where they will live, tried in order at run time (mapped only once one exists).
PENDING = {
    "BaseFinetuning": ("ember.callbacks", "ember.utilities"),
    "rank_zero_only": ("ember.utilities",),
    "rank_zero_info": ("ember.utilities",),
    "rank_zero_warn": ("ember.utilities",),
    "rank_zero_debug": ("ember.utilities",),
    "cli_lightning_logo": ("ember.utilities",),
}

#: Lightning objects ember exports from a module other than the one `resolve` derives: name -> ember module.
ELSEWHERE = {"LightningOptimizer": "ember.modules"}

#: What to do about Lightning names ember has no counterpart for: "package.Name" (or "package." for a whole
#: package, or "Name" for a top-level name) -> advice.
UNSUPPORTED = {
    "strategies.DeepSpeedStrategy": "not supported; use strategy='fsdp'",
    "strategies.XLAStrategy": "not supported: ember runs on CPUs and CUDA GPUs",
    "strategies.SingleDeviceXLAStrategy": "not supported: ember runs on CPUs and CUDA GPUs",
    "strategies.SingleDeviceStrategy": "use Trainer(strategy='single_device') (the default on one device)",
    "strategies.ParallelStrategy": "ember's multi-process strategies are DDPStrategy, FSDPStrategy and "
    "ModelParallelStrategy (ember.strategies); to ask whether a run is distributed, read trainer.world_size > 1",
    "strategies.FSDPStrategy": "use ember.strategies.FSDPStrategy (FSDP2) or strategy='fsdp'",
    "strategies.": "pick a strategy by name: Trainer(strategy='ddp'|'fsdp'|'model_parallel') (docs/distributed.md)",
    "callbacks.StochasticWeightAveraging": "not supported: write a Callback",
    "callbacks.WeightAveraging": "not supported: ember.callbacks.EMA for an exponential average, else a Callback",
    "callbacks.GradientAccumulationScheduler": "not supported: write a Callback",
    "callbacks.ModelPruning": "not supported: write a Callback (torch.nn.utils.prune)",
    "callbacks.SpikeDetection": "not supported: write a Callback",
    "callbacks.OnExceptionCheckpoint": "not needed: preemption checkpoints are built in (Trainer(requeue_signal=))",
    "callbacks.BasePredictionWriter": "not supported: save the outputs of trainer.predict(...), or write a Callback",
    "callbacks.LambdaCallback": "not supported: subclass ember.Callback",
    "callbacks.RichModelSummary": "use ember.callbacks.ModelSummary (rich when it is installed)",
    "callbacks.DeviceStatsMonitor": "not the same: ember.callbacks.GradientMonitor and ThroughputMonitor",
    "callbacks.LearningRateFinder": "use the function ember.tuning.lr_find(trainer, module, ...)",
    "callbacks.BatchSizeFinder": "use the function ember.tuning.scale_batch_size(trainer, module, ...)",
    "callbacks.ProgressBar": "subclass ember.Callback; ProgressLine and RichProgressBar are ember's bars",
    "callbacks.Checkpoint": "subclass ember.callbacks.ModelCheckpoint or ember.Callback",
    "loggers.CometLogger": "not supported: subclass ember.loggers.Logger",
    "loggers.NeptuneLogger": "not supported: subclass ember.loggers.Logger",
    "loggers.LitLogger": "not supported: subclass ember.loggers.Logger",
    "utilities.types.": "Lightning's type aliases: annotate with typing.Any, torch.Tensor or a dict",
    "utilities.imports.": "Lightning's private availability flags: try the import yourself",
    "utilities.model_helpers.get_torchvision_model": "call torchvision.models.get_model(name, weights=...)",
    "utilities.": "not in ember: keep a copy of what you use",
    "Fabric": "ember has no Fabric: use TrainingModule and Trainer, or plain PyTorch",
    "fabric.": "ember has no Fabric: use TrainingModule and Trainer, or plain PyTorch",
    "cli.LightningCLI": "use the ember command: `ember fit -c config.yaml` (docs/cli.md)",
    "cli.": "use the ember command: `ember fit -c config.yaml` (docs/cli.md)",
    "tuner.Tuner": "use ember.tuning.lr_find(trainer, module, ...) and ember.tuning.scale_batch_size",
    "tuner.": "use ember.tuning.lr_find(trainer, module, ...) and ember.tuning.scale_batch_size",
    "plugins.": "precision is Trainer(precision=...); cluster environments are detected (torchrun, SLURM)",
    "profilers.": "use Trainer(profiler='simple'|'pytorch') (docs/tuning.md)",
    "accelerators.": "use Trainer(accelerator='cpu'|'cuda')",
    "loops.": "ember's loops are not pluggable: use hooks or manual optimization",
    "demos.": "Lightning's demo code, not an API: copy what you use into your project (and port it)",
    "serve.": "not supported: see docs/export.md for inference artifacts",
    "app.": "not supported",
}

#: Lightning 1.x hooks (Lightning 2 refuses them too) a ported module should rename, with what to use.
REMOVED_METHODS = {
    "training_epoch_end": "Lightning 2 removed it: use on_train_epoch_end and keep the outputs yourself",
    "validation_epoch_end": "Lightning 2 removed it: use on_validation_epoch_end and keep the outputs yourself",
    "test_epoch_end": "Lightning 2 removed it: use on_test_epoch_end and keep the outputs yourself",
    "training_step_end": "Lightning 2 removed it: do the work in training_step",
    "validation_step_end": "Lightning 2 removed it: do the work in validation_step",
    "test_step_end": "Lightning 2 removed it: do the work in test_step",
}

#: Trainer keywords of Lightning that ember does not take, with what to do instead.
TRAINER_KEYWORDS = {
    "gpus": "use accelerator='cuda', devices=N",
    "tpu_cores": "not supported: ember runs on CPUs and CUDA GPUs",
    "auto_select_gpus": "use devices=N (or CUDA_VISIBLE_DEVICES)",
    "plugins": "precision is Trainer(precision=...); cluster environments are detected",
    "barebones": "not needed: ember skips hooks nobody implements (docs/trainer.md)",
    "enable_autolog_hparams": "hyperparameters always go to the loggers",
    "model_registry": "not supported",
}

#: Trainer accelerators of Lightning that ember names otherwise or lacks.
ACCELERATORS = {
    "mps": "not supported: use 'cpu'",
    "tpu": "not supported",
    "hpu": "not supported",
}

#: Base classes whose subclasses get their method names checked.
_MODULE_BASES = {"TrainingModule", "DataModule"}
_CALLBACK_BASES = {"Callback"}


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


# --- what ember has -------------------------------------------------------------------------------------------


def _exports(module: str) -> frozenset[str]:
    """The public names of an ember module in this installation (empty when it does not exist)."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return frozenset()
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    return frozenset(names)


@dataclass(frozen=True)
class Target:
    """An ember object (``module`` and ``name``) or, with ``name`` None, an ember module."""

    module: str
    name: str | None = None

    @property
    def dotted(self) -> str:
        """``ember.callbacks.EarlyStopping``, or the module's name."""
        return self.module if self.name is None else f"{self.module}.{self.name}"


def split_lightning(qualname: str) -> list[str] | None:
    """The parts of a Lightning dotted name below ``lightning.pytorch`` (``["callbacks", "EarlyStopping"]``),
    with ``["fabric", ...]`` for ``lightning.fabric``; None when the name is not Lightning's."""
    for root in ROOTS:
        if qualname == root or qualname.startswith(root + "."):
            rest = qualname[len(root) + 1 :].split(".") if qualname != root else []
            if root == "lightning.fabric":
                return ["fabric", *rest]
            if root == "lightning" and rest[:1] == ["pytorch"]:
                return rest[1:]
            return rest
    return None


def _advice(parts: Sequence[str]) -> str:
    """The `UNSUPPORTED` entry for a Lightning name: the name itself, then a pending name, then its package."""
    for key in (".".join(parts), f"{parts[0]}.{parts[-1]}", parts[-1]):
        if key in UNSUPPORTED:
            return UNSUPPORTED[key]
    if parts and parts[-1] in PENDING:
        return f"not in ember yet (planned for {' or '.join(PENDING[parts[-1]])}); the Lightning import stays"
    for i in range(len(parts) - 1, 0, -1):
        key = ".".join(parts[:i]) + "."
        if key in UNSUPPORTED:
            return UNSUPPORTED[key]
    return "ember has no counterpart; the Lightning import stays: rewrite this part"


def resolve(parts: Sequence[str]) -> Target | str:
    """The ember target of a Lightning name given as `split_lightning` parts, or the advice when there is none.

    ``[]`` is the package itself (``ember``); a subpackage maps to ember's same-named one; an object maps when
    ember exports it here, under its own or its `RENAMED` name.
    """
    if parts[:1] == ["pytorch"]:  # ``import lightning as L; L.pytorch.X``
        parts = parts[1:]
    if not parts:
        return Target("ember")
    if _is_module(parts):  # a module: only the packages ember has
        if len(parts) == 1 and parts[0] in PACKAGES:
            return Target(PACKAGES[parts[0]])
        if parts == ["utilities"] and _exports("ember.utilities"):
            return Target("ember.utilities")
        return _advice(parts)
    name = parts[-1]
    if name.startswith("__"):  # pl.__version__, pl.__file__: about Lightning's package itself
        return "an attribute of Lightning's own package: nothing of ember's corresponds"
    if name in ELSEWHERE and name in _exports(ELSEWHERE[name]):
        return Target(ELSEWHERE[name], name)
    if name in PENDING:
        for module in PENDING[name]:
            if name in _exports(module):
                return Target(module, name)
        return _advice(parts)
    package = parts[0] if parts[0] in (*PACKAGES, "utilities") else ""
    if package == "" and parts[0] not in ("core", "trainer") and len(parts) > 1:
        return _advice(parts)  # plugins, cli, demos, fabric, ...: no object of theirs maps
    ember_name = RENAMED.get((package, name), name)
    module = "ember.utilities" if package == "utilities" else PACKAGES.get(package, "ember")
    if ember_name in _exports(module):
        return Target(module, ember_name)
    return _advice(parts)


# --- reading the file -------------------------------------------------------------------------------------------


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
        self.line_starts = _line_starts(self.data)
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.scope_of, self.local_names = _scopes(tree)
        self.bindings: dict[tuple[ast.AST, str], _Binding] = {}
        self.edits: list[_Edit] = []
        self.notes: list[Note] = []
        self.mapped: list[str] = []
        self.used_names = _names_in(tree)
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
                    self.note(statement, alias.name, _UTILITIES_ADVICE)
            return
        if statement.level or statement.module is None:
            return
        parts = split_lightning(statement.module)
        if parts is None:
            if statement.module.split(".")[0] == "lightning_utilities":
                for alias in statement.names:
                    self.note(statement, f"{statement.module}.{alias.name}", _UTILITIES_ADVICE)
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
        while _is_module(parts):
            parent = self.parents.get(link)
            if not isinstance(parent, ast.Attribute) or parent.value is not link:
                break  # the chain ends on a module
            link, parts = parent, [*parts, parent.attr]
        target = resolve(parts)
        if not isinstance(target, Target):
            binding.kept = True
            if link is not name or isinstance(binding.statement, ast.Import):
                self.note(link, ".".join(_qualified(parts)), target)
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
                    kept.append(_alias_text(alias))
                    continue
                lightning = True
                if binding.kept:
                    kept.append(_alias_text(alias))
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
                    kept.append(_alias_text(alias))
                    continue
                target = resolve(binding.parts)
                if not isinstance(target, Target):
                    self.note(statement, f"{statement.module}.{alias.name}", target)
                    kept.append(_alias_text(alias))
                    continue
                if binding.kept:
                    kept.append(_alias_text(alias))
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
        comments = _comments_within(self.source, statement)
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
                if target is not None and target.name in _MODULE_BASES:
                    base_kind = "module"
                elif target is not None and target.name in _CALLBACK_BASES:
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


_UTILITIES_ADVICE = "lightning_utilities is installed with Lightning: keep it as a dependency or replace the helper"


def _qualified(parts: Sequence[str]) -> list[str]:
    """``["callbacks", "X"]`` -> ``["lightning", "pytorch", "callbacks", "X"]`` (the name as users write it)."""
    if parts[:1] == ["fabric"]:
        return ["lightning", *parts]
    return ["lightning", "pytorch", *parts]


def _is_module(parts: Sequence[str]) -> bool:
    """Whether Lightning parts name a module (``[]``, ``["callbacks"]``, ``["callbacks", "early_stopping"]``)."""
    return all(p in SUBMODULES for p in parts)


def _alias_text(alias: ast.alias) -> str:
    return f"{alias.name} as {alias.asname}" if alias.asname else alias.name


def _line_starts(data: bytes) -> list[int]:
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


def _scopes(tree: ast.Module) -> tuple[dict[ast.AST, ast.AST], dict[ast.AST, set[str]]]:
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


def _names_in(tree: ast.AST) -> set[str]:
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


def _comments_within(source: str, statement: ast.stmt) -> list[str]:
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


# --- the API ----------------------------------------------------------------------------------------------------


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


def read_source(path: Path) -> tuple[str, str]:
    """A Python file's text and encoding (PEP 263); `PortError` when it is missing or not Python text."""
    if not path.exists():
        raise PortError(f"{path}: no such file")
    if path.is_dir():
        raise PortError(f"{path}: is a directory; give the Python files")
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        raise PortError(f"{path}: not a Python file (not text in a Python source encoding)") from None
    if "\x00" in text:
        raise PortError(f"{path}: not a Python file (binary)")
    if encoding == "utf-8-sig":
        text = text.removeprefix("\ufeff")
    return text, encoding


def port_files(
    paths: Iterable[Path], *, out: Path | None = None, diff: bool = False, stdout: Any = None, stderr: Any = None
) -> int:
    """Port files as ``ember port`` does; returns the exit code (0 all mapped, 1 notes left, 2 a mistake).

    Every file is read and parsed before anything is written, so a mistake leaves every file as it was.
    """
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    paths = list(paths)
    try:
        if out is None and not diff:
            for path in paths:
                backup = path.with_name(path.name + ".orig")
                if backup.exists():
                    raise PortError(f"{backup}: a backup exists already; remove it, or use --out DIR or --diff")
        if out is not None:
            seen: dict[str, Path] = {}
            for path in paths:
                if path.name in seen and seen[path.name] != path:
                    raise PortError(f"--out: {seen[path.name]} and {path} would both be written to {out / path.name}")
                seen[path.name] = path
            if out.exists() and not out.is_dir():
                raise PortError(f"--out: {out} is not a directory")
        ported: list[tuple[Path, str, PortResult]] = []
        for path in paths:
            text, encoding = read_source(path)
            ported.append((path, encoding, port_source(text, str(path))))
    except PortError as exc:
        print(f"ember port: error: {exc}", file=stderr)
        return 2
    left = 0
    for path, encoding, result in ported:
        for note in result.notes:
            print(note.format(str(path)), file=stderr)
        left += len(result.notes)
        if diff:
            stdout.write(result.diff(str(path)))
            where = "diff printed"
        elif out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / path.name).write_bytes(result.source.encode(encoding))
            where = f"written to {out / path.name}"
        elif result.changed:
            path.with_name(path.name + ".orig").write_bytes(path.read_bytes())
            path.write_bytes(result.source.encode(encoding))
            where = f"rewritten (the original is {path.name}.orig)"
        else:
            where = "unchanged"
        todo = f"; {len(result.notes)} left to edit by hand (listed above)" if result.notes else ""
        mapped = f"{len(result.mapped)} Lightning name{'s' * (len(result.mapped) != 1)} mapped"
        print(f"ember port: {path}: {mapped}, {where}{todo}", file=stderr)
    return 1 if left else 0


def add_parser(commands: Any) -> None:
    """Add ``ember port`` to the ``ember`` command's subparsers."""
    sub: argparse.ArgumentParser = commands.add_parser(
        "port",
        help="rewrite a LightningModule's Lightning imports and names for ember",
        description="ember port: rewrite Lightning imports and base-class names in Python files for ember; "
        "list what it cannot map, with what to do. Strings and comments are left as they are.",
        epilog="exit code 0: everything mapped; 1: files written, some names listed for a hand edit; "
        "2: a mistake, nothing written. See docs/migrating-from-lightning.md.",
        allow_abbrev=False,
    )
    sub.add_argument("files", nargs="+", metavar="FILE", help="Python files to port")
    where = sub.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="DIR", help="write the ported files into DIR (default: in place, FILE.orig)")
    where.add_argument("--diff", action="store_true", help="print a unified diff; write nothing")
    sub.set_defaults(debug=False)


def run(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
    """``ember port``: port the files the parsed arguments name; returns the exit code."""
    if extra:
        print(f"ember port: error: unknown argument {extra[0]!r}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    return port_files([Path(f) for f in args.files], out=out, diff=args.diff)

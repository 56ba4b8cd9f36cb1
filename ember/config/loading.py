"""Loading a config: YAML files and command-line overrides merged over the schema, then resolved.

Layers merge in order, the later one winning: schema defaults < each ``-c`` file < overrides. A mistake
is a `ConfigError` whose one-line message says where the value was set (``file:line`` or ``command
line``), the full key path and, where one exists, the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from ember.config.errors import ConfigError
from ember.config.schema import RunConfig, lookup, schema_type, split_key
from ember.config.targets import SCHEDULER_OPTIONS, accepted_names


@dataclass
class Layer:
    """One source of values: a YAML file or the command line."""

    label: str
    values: dict[str, Any]
    path: Path | None = None

    def line_of(self, key: str) -> int | None:
        """1-based line of `key` (or of its deepest present parent) in this layer's file."""
        if self.path is None:
            return None
        node: Any = yaml.compose(self.path.read_text(encoding="utf-8"))
        line = None
        for part in split_key(key):
            if isinstance(node, yaml.MappingNode):
                match = [(k, v) for k, v in node.value if k.value == part]
                if not match:
                    break
                line, node = match[0][0].start_mark.line + 1, match[0][1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                node = node.value[part]
                line = node.start_mark.line + 1
            else:
                break
        return line


@dataclass
class LoadedConfig:
    """The merged (unresolved) config and the layers it came from, to say where a bad value was set."""

    config: DictConfig
    layers: list[Layer]

    def where(self, key: str) -> str:
        """``file:line`` or ``command line`` of the last layer that set `key` or a parent of it; "" if none."""
        parts = split_key(key)
        for depth in range(len(parts), 0, -1):
            for layer in reversed(self.layers):
                if lookup(layer.values, parts[:depth])[0]:
                    line = layer.line_of(key)
                    return f"{layer.label}:{line}" if line else layer.label
        return ""

    def error(self, key: str, problem: str) -> ConfigError:
        """A `ConfigError` for `key`, prefixed with where it was set."""
        where = self.where(key)
        return ConfigError(f"{where}: {key}: {problem}" if where else f"{key}: {problem}")


def read_yaml(path: str | Path) -> Layer:
    """One config file as a layer; a missing file or a YAML syntax error is a `ConfigError` (file:line:col)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from exc
    try:
        values = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        pos = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{pos}: YAML syntax error: {exc.problem or exc.context}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: YAML syntax error: {exc}") from exc
    if not isinstance(values, DictConfig):
        raise ConfigError(f"{path}: expected a mapping of sections (seed, trainer, module, data, ...), got a list")
    return Layer(str(path), OmegaConf.to_container(values), Path(path))  # type: ignore[arg-type]


def parse_overrides(items: Iterable[str]) -> Layer:
    """``key=value`` and ``--key=value`` items (values parsed as YAML) as one command-line layer."""
    dotlist = []
    for item in items:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text or text.startswith("="):
            form = f"{item}=VALUE" if item.startswith("--") else "key=value or --key=value"
            raise ConfigError(f"command line: {item!r} is not an option or an override; write {form}")
        dotlist.append(text)
    try:
        values = OmegaConf.from_dotlist(dotlist)
    except (yaml.YAMLError, oc_errors.OmegaConfBaseException) as exc:
        raise ConfigError(f"command line: cannot parse override: {str(exc).splitlines()[0]}") from exc
    return Layer("command line", OmegaConf.to_container(values))  # type: ignore[arg-type]


def load(files: Sequence[str | Path], overrides: Sequence[str] = ()) -> LoadedConfig:
    """Merge schema defaults < `files` in order < `overrides`; checks keys and types as it goes."""
    layers = [read_yaml(f) for f in files]
    if overrides:
        layers.append(parse_overrides(overrides))
    config = OmegaConf.structured(RunConfig)
    loaded = LoadedConfig(config, [])
    for layer in layers:
        loaded.layers.append(layer)
        current = OmegaConf.to_container(loaded.config, resolve=False)
        if prepare_merge(loaded, current, layer.values):  # type: ignore[arg-type]
            loaded.config = OmegaConf.merge(OmegaConf.structured(RunConfig), current)  # type: ignore[assignment]
        try:
            loaded.config = OmegaConf.merge(loaded.config, OmegaConf.create(layer.values))  # type: ignore[assignment]
        except oc_errors.ConfigKeyError as exc:
            raise loaded.error(str(exc.full_key), unknown_key_problem(loaded.config, str(exc.full_key))) from exc
        except (oc_errors.ValidationError, oc_errors.ConfigTypeError) as exc:
            key = str(exc.full_key)
            raise loaded.error(key, type_problem(key, lookup(layer.values, split_key(key))[1], exc)) from exc
    return loaded


def prepare_merge(loaded: LoadedConfig, current: dict[str, Any], values: dict[str, Any], prefix: str = "") -> bool:
    """Get `current` ready for `values` to merge in; True when it changed. Two things a plain merge gets wrong:

    - A value whose shape the schema does not allow (a mapping for ``trainer.callbacks``, a number for
      ``trainer``) is an error naming the key. Where the schema does not say (``trainer.logger``, module
      arguments), a list replaces a mapping and the reverse.
    - A new ``_target_`` keeps only the keywords it accepts: ``lr_scheduler._target_=...CosineAnnealingLR``
      over ``StepLR`` forgets ``step_size`` and ``gamma``; ``optimizer._target_=torch.optim.SGD`` over
      ``AdamW`` keeps ``lr`` and ``weight_decay`` (as jsonargparse does for a new ``class_path``).
    """
    changed = False
    for key, value in values.items():
        path, node = f"{prefix}{key}", current.get(key)
        if _is_placeholder(value):
            continue
        kind, expected = _kind(value), schema_type(path)
        if expected is not None and not _fits(kind, expected):
            raise loaded.error(path, f"expected {expected}, got {value!r}")
        if _is_placeholder(node):
            continue
        if {kind, _kind(node)} == {"mapping", "list"}:  # the schema allows either: replace, do not merge
            del current[key]
            changed = True
        elif isinstance(node, dict) and isinstance(value, dict):
            changed = _drop_unaccepted_kwargs(node, value, with_options=key == "lr_scheduler") or changed
            changed = prepare_merge(loaded, node, value, f"{path}.") or changed
    return changed


def _is_placeholder(value: Any) -> bool:
    return value is None or (isinstance(value, str) and ("${" in value or value == "???"))


def _kind(value: Any) -> str:
    return "mapping" if isinstance(value, dict) else "list" if isinstance(value, list) else "scalar"


def _fits(kind: str, expected: str) -> bool:
    return (kind == "mapping") == ("mapping" in expected) and (kind == "list") == ("list" in expected)


def _drop_unaccepted_kwargs(node: dict[str, Any], value: dict[str, Any], with_options: bool) -> bool:
    target = value.get("_target_")
    if not isinstance(target, str) or node.get("_target_") in (None, target):
        return False
    accepted = accepted_names(target)
    if accepted is None:  # takes **kwargs, or cannot be imported (reported later): keep everything
        return False
    keep = {"_target_", *value, *accepted, *(SCHEDULER_OPTIONS if with_options else ())}
    dropped = [k for k in node if k not in keep]
    for name in dropped:
        del node[name]
    return bool(dropped)


def unknown_key_problem(config: DictConfig, key: str) -> str:
    """ "no such key; did you mean trainer.max_epochs?": the first unknown part of `key`, swapped for the nearest."""
    parts = key.split(".")
    node: Any = OmegaConf.to_container(config, resolve=False)
    for i, part in enumerate(parts):
        siblings = [str(k) for k in node] if isinstance(node, dict) else []
        if part in siblings:
            node = node[part]
            continue
        close = difflib.get_close_matches(part, siblings, n=1)
        if close:
            return f"no such key; did you mean {'.'.join([*parts[:i], close[0], *parts[i + 1 :]])}?"
        where = f" of {'.'.join(parts[:i])}" if i else ""
        if len(siblings) > 10:
            return f"no such key{where}; --print-config lists every key"
        return f"no such key; valid keys{where}: {', '.join(siblings)}"
    return "no such key"


def type_problem(key: str, value: Any, exc: Exception) -> str:
    """ "expected int or null, got 'ten'" from the schema's annotation for `key`."""
    expected = schema_type(key)
    if expected is None:
        return str(exc).splitlines()[0]
    return f"expected {expected}, got {value!r}"


def resolve(loaded: LoadedConfig) -> dict[str, Any]:
    """Resolve interpolations (``${module.lr}``, ``${oc.env:VAR,default}``) into a plain dict.

    A missing required value (``???`` or an absent ``module``/``data``) or an interpolation that
    cannot be resolved is a `ConfigError`.
    """
    try:
        missing = OmegaConf.missing_keys(loaded.config)
        if missing:
            first = min(missing, key=lambda k: (_SECTIONS.index(str(split_key(k)[0])), k))
            raise loaded.error(first, "missing required value" + _MISSING_HINTS.get(first, ""))
        return OmegaConf.to_container(loaded.config, resolve=True)  # type: ignore[return-value]
    except (oc_errors.ValidationError, oc_errors.InterpolationResolutionError) as exc:
        key = str(exc.full_key)
        given = lookup(OmegaConf.to_container(loaded.config, resolve=False), split_key(key))[1]
        raise loaded.error(key, _resolution_problem(loaded.config, given, exc)) from exc


def _resolution_problem(config: DictConfig, given: Any, exc: Exception) -> str:
    message = str(exc).splitlines()[0]
    if isinstance(exc, oc_errors.InterpolationValidationError):  # resolved to a value of the wrong type
        value = re.search(r"Value (.*?) of type", message)
        expected = schema_type(str(getattr(exc, "full_key", "")))
        if value and expected:
            return f"expected {expected}, got {value.group(1)} (from {given})"
    missing = re.fullmatch(r"Interpolation key '(.+)' not found", message)
    if missing:
        return f"cannot resolve {given!r}: {missing.group(1)}: {unknown_key_problem(config, missing.group(1))}"
    return f"cannot resolve {given!r}: {message}"


_SECTIONS = [f.name for f in dataclasses.fields(RunConfig)]


_MISSING_HINTS = {
    "module": "; add a module section: _target_ (your TrainingModule class) and its arguments",
    "data": "; add a data section: _target_ (your DataModule class) and its arguments",
}


#: Files that mark a project's root folder (see `import_roots`).
PROJECT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


def import_roots(files: Sequence[str | Path]) -> list[str]:
    """Where ``_target_`` paths import from, in order: for each config file its folder, then its project's
    root (the nearest folder above it holding ``pyproject.toml``, ``setup.py``, ``setup.cfg`` or ``.git``);
    then the working directory. So ``configs/digits.yaml`` naming ``examples.digits.Classifier`` works from
    any directory, as does ``my_project/configs/train.yaml`` naming ``my_project.models.Net``."""
    roots: list[str] = []
    for file in files:
        folder = Path(file).resolve().parent
        project = next((d for d in (folder, *folder.parents) if any((d / m).exists() for m in PROJECT_MARKERS)), None)
        for root in (folder, project):
            if root is not None and str(root) not in roots:
                roots.append(str(root))
    return [*roots, *([str(Path.cwd())] if str(Path.cwd()) not in roots else [])]


def add_import_roots(files: Sequence[str | Path]) -> None:
    """Put `import_roots` at the front of `sys.path`, in their order (as ``python script.py`` does its folder)."""
    for root in import_roots(files)[::-1]:
        if root in sys.path:
            sys.path.remove(root)
        sys.path.insert(0, root)


def to_yaml(config: dict[str, Any]) -> str:
    """A resolved config as YAML that `load` reads back to the same values."""
    return OmegaConf.to_yaml(OmegaConf.create(config))

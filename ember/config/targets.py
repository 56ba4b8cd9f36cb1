"""``_target_`` sections: import the dotted path, check what it names is of the right kind, build it.

What building needs and nothing more: `TrainingModule.configure_optimizers` builds a config's optimizer
sections with `build_optimizers`, so this module imports no other part of ember than `ConfigError`.
Checking a whole config before anything is built is `ember.config.checking`.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from collections.abc import Iterable
from typing import Any

import torch

from ember.config.errors import ConfigError

#: What an ``optimizer`` section must build.
OPTIMIZER_BASE = torch.optim.Optimizer


def scheduler_bases() -> tuple[type, ...]:
    """What an ``lr_scheduler`` section must build: a torch LR scheduler (ReduceLROnPlateau included)."""
    from torch.optim import lr_scheduler

    return (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)


#: Keys of an ``lr_scheduler`` section that say when it steps; they are not scheduler arguments.
SCHEDULER_OPTIONS = ("interval", "frequency", "monitor", "strict", "name")


def import_target(path: str) -> Any:
    """The object named by a dotted path (``my_project.models.Net``); `ImportError` says what failed."""
    parts = path.split(".")
    if not path or not all(p.isidentifier() for p in parts):
        raise ImportError(f"{path!r} is not a dotted path like my_project.models.Net")
    module, i = None, 0
    for depth in range(1, len(parts) + 1):  # the longest importable prefix; the rest are attributes
        name = ".".join(parts[:depth])
        try:
            module, i = importlib.import_module(name), depth
        except ModuleNotFoundError as exc:
            if exc.name == name:
                break
            raise ImportError(f"importing {name} failed: {exc}") from exc  # it imports a missing module
        except Exception as exc:  # a bug in the user's module: report it, do not hide it
            raise ImportError(f"importing {name} failed: {type(exc).__name__}: {exc}") from exc
    if module is None:
        raise ImportError(f"no module named {parts[0]!r} (searched the config's folder, the cwd and sys.path)")
    obj: Any = module
    for j, attr in enumerate(parts[i:], start=i):
        if not hasattr(obj, attr):
            names = [n for n in dir(obj) if not n.startswith("_")]
            names += [m.name for m in pkgutil.iter_modules(getattr(obj, "__path__", []))]
            close = difflib.get_close_matches(attr, names, n=1)
            hint = f"; did you mean {'.'.join(parts[:j] + close)}?" if close else ""
            raise ImportError(f"{'.'.join(parts[:j])} has no attribute {attr!r}{hint}")
        obj = getattr(obj, attr)
    return obj


def public_name(cls: type) -> str:
    """``ember.TrainingModule`` rather than ``ember.modules.module.TrainingModule``, where ember exports it."""
    import sys

    for package in ("ember", "ember.callbacks", "ember.loggers", "ember.strategies"):
        if getattr(sys.modules.get(package), cls.__name__, None) is cls:
            return f"{package}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def wrong_kind(obj: Any, target: str, base: type | tuple[type, ...] | None) -> str | None:
    """Why `obj` (imported from `target`) cannot be built where a `base` subclass is expected; None if it can.

    Checked before anything is called: a ``_target_`` naming a function (``os.system``) for a module,
    data, strategy, logger or callback section is refused without running it.
    """
    if base is None:
        return None
    bases = base if isinstance(base, tuple) else (base,)
    names = " or ".join(public_name(b) for b in bases)
    if not inspect.isclass(obj):
        kind = "a function" if inspect.isroutine(obj) else f"a {type(obj).__qualname__} object"
        return f"{target} is {kind}, not a class deriving from {names}"
    if not issubclass(obj, bases):
        return f"{target} is not a subclass of {names}"
    return None


def accepted_names(target: str) -> set[str] | None:
    """The keyword names `target` accepts; None when it takes ``**kwargs``, has no signature or cannot be imported."""
    try:
        params = inspect.signature(import_target(target)).parameters.values()
    except (ImportError, TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is not p.VAR_POSITIONAL}


def instantiate(spec: Any, key: str, base: type | tuple[type, ...] | None = None) -> Any:
    """Build ``_target_(**kwargs)`` (nested ``_target_`` sections first); other values pass through.

    With `base`, the target must be a class deriving from it (for a list, every entry), checked before
    anything is called. A constructor that raises becomes a `ConfigError` naming `key` (the original is its
    cause).
    """
    if isinstance(spec, list):
        return [instantiate(v, f"{key}[{i}]", base) for i, v in enumerate(spec)]
    if not isinstance(spec, dict) or "_target_" not in spec:
        return spec
    target = spec["_target_"]
    try:
        factory = import_target(str(target))
    except ImportError as exc:
        raise ConfigError(f"{key}._target_: cannot import {target}: {exc}") from exc
    problem = wrong_kind(factory, str(target), base)
    if problem is not None:
        raise ConfigError(f"{key}._target_: {problem}")
    kwargs = {k: instantiate(v, f"{key}.{k}") for k, v in spec.items() if k != "_target_"}
    try:
        return factory(**kwargs)
    except Exception as exc:
        raise ConfigError(f"{key}: {target}(...) raised {type(exc).__name__}: {exc}") from exc


def nested_target(spec: Any, key: str) -> str | None:
    """The key of the first ``_target_`` nested anywhere inside `spec`'s arguments, or None (plain data)."""
    items: list[tuple[str, Any]]
    if isinstance(spec, dict):
        items = [(f"{key}.{k}", v) for k, v in spec.items() if k != "_target_"]
    elif isinstance(spec, list):
        items = [(f"{key}[{i}]", v) for i, v in enumerate(spec)]
    else:
        return None
    for sub_key, value in items:
        if isinstance(value, dict) and "_target_" in value:
            return sub_key
        found = nested_target(value, sub_key)
        if found is not None:
            return found
    return None


def build_optimizers(params: Iterable[Any], sections: dict[str, Any]) -> Any:
    """What the default `TrainingModule.configure_optimizers` returns for a config's optimizer sections.

    ``sections`` is ``{"optimizer": {_target_, kwargs}, "lr_scheduler": {_target_, kwargs,
    interval/frequency/monitor/...} or None}``.
    """
    spec = dict(sections["optimizer"])
    target = spec.pop("_target_")
    factory = import_target(target)
    problem = wrong_kind(factory, target, OPTIMIZER_BASE)
    if problem is not None:
        raise ConfigError(f"optimizer._target_: {problem}")
    optimizer = factory(params, **spec)
    sched_spec = sections.get("lr_scheduler")
    if not sched_spec:
        return optimizer
    kwargs = {k: v for k, v in sched_spec.items() if k != "_target_" and k not in SCHEDULER_OPTIONS}
    factory = import_target(sched_spec["_target_"])
    problem = wrong_kind(factory, sched_spec["_target_"], scheduler_bases())
    if problem is not None:
        raise ConfigError(f"lr_scheduler._target_: {problem}")
    scheduler = factory(optimizer, **kwargs)
    options = {k: v for k, v in sched_spec.items() if k in SCHEDULER_OPTIONS}
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, **options}}

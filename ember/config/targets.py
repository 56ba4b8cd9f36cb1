"""``_target_`` sections: import the dotted path, check the keywords against its signature, build it."""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import types
import typing
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from ember import stages
from ember.config.schema import ConfigError, describe_type, lookup, split_key

if TYPE_CHECKING:
    from ember.config.loading import LoadedConfig

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


def check_target(
    loaded: LoadedConfig,
    spec: Any,
    key: str,
    *,
    skip: int = 0,
    base: type | tuple[type, ...] | None = None,
    reserved: Sequence[str] = (),
) -> None:
    """Check a ``_target_`` section: importable, callable, its kwargs accepted by the signature.

    `skip` leading positional parameters are supplied by ember (an optimizer's ``params``);
    `base` is the class the target must subclass; `reserved` keys are not arguments.
    Nested ``_target_`` sections in the kwargs are checked too.
    """
    if not isinstance(spec, dict):
        raise loaded.error(key, f"expected a section with _target_ and arguments, got {spec!r}")
    target = spec.get("_target_")
    if target is None:
        raise loaded.error(f"{key}._target_", "missing required value: the dotted path of the class to build")
    if not isinstance(target, str):
        raise loaded.error(f"{key}._target_", f"expected a dotted path (str), got {target!r}")
    try:
        obj = import_target(target)
    except ImportError as exc:
        raise loaded.error(f"{key}._target_", f"cannot import {target}: {exc}") from exc
    if not callable(obj):
        raise loaded.error(f"{key}._target_", f"{target} is not a class or function")
    problem = wrong_kind(obj, target, base)
    if problem is not None:
        raise loaded.error(f"{key}._target_", problem)
    kwargs = {k: v for k, v in spec.items() if k != "_target_" and k not in reserved}
    _check_signature(loaded, obj, target, kwargs, key, skip)
    for name, value in kwargs.items():
        for sub_key, sub in _nested_targets(f"{key}.{name}", value):
            check_target(loaded, sub, sub_key)


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


def _nested_targets(key: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and "_target_" in value:
        return [(key, value)]
    if isinstance(value, list):
        return [(f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, dict) and "_target_" in v]
    return []


def accepted_names(target: str) -> set[str] | None:
    """The keyword names `target` accepts; None when it takes ``**kwargs``, has no signature or cannot be imported."""
    try:
        params = inspect.signature(import_target(target)).parameters.values()
    except (ImportError, TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is not p.VAR_POSITIONAL}


def _check_signature(loaded: LoadedConfig, obj: Any, target: str, kwargs: dict[str, Any], key: str, skip: int) -> None:
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return  # some builtins have no signature: let the call decide
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    while skip and params and params[0].kind in positional:
        params, skip = params[1:], skip - 1
    named = {p.name: p for p in params if p.kind not in (inspect.Parameter.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    for name in kwargs:
        if name not in named and not takes_any:
            close = difflib.get_close_matches(name, list(named), n=1)
            advice = f"; did you mean {key}.{close[0]}?" if close else f"; it takes: {', '.join(named) or 'nothing'}"
            raise loaded.error(f"{key}.{name}", f"{target} takes no argument {name!r}{advice}")
        if name in named and named[name].kind is inspect.Parameter.POSITIONAL_ONLY:
            raise loaded.error(f"{key}.{name}", f"{target} takes {name!r} only by position")
    for name, p in named.items():
        if p.default is p.empty and p.kind is not inspect.Parameter.POSITIONAL_ONLY and name not in kwargs:
            raise loaded.error(f"{key}.{name}", f"missing required value: {target} needs the argument {name!r}")
    hints = _type_hints(obj)
    for name, value in kwargs.items():
        hint = hints.get(name)
        if hint is not None and _accepts(hint, value) is False:
            raw = lookup(OmegaConf.to_container(loaded.config, resolve=False), split_key(f"{key}.{name}"))[1]
            decode = " (oc.env gives a string: wrap it as ${oc.decode:${oc.env:...}})" if "oc.env" in str(raw) else ""
            raise loaded.error(f"{key}.{name}", f"expected {describe_type(hint)}, got {value!r}{decode}")


def _type_hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj.__init__ if inspect.isclass(obj) else obj)
    except Exception:  # unresolvable annotations (TYPE_CHECKING names, ...): skip the type check
        return {}


_SIMPLE_TYPES = (bool, int, float, str, type(None))


def _accepts(hint: Any, value: Any) -> bool | None:
    """Whether `value` fits a hint made of bool/int/float/str/None; None when the hint is anything else."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if not all(a in _SIMPLE_TYPES for a in args):
        return None
    for a in args:
        if a is bool or a is type(None) or a is str:
            if isinstance(value, a):
                return True
        elif isinstance(value, int if a is int else (int, float)) and not isinstance(value, bool):
            return True
    return False


def check(loaded: LoadedConfig, config: dict[str, Any], command: str | None = None) -> None:
    """Check every ``_target_`` section of a resolved config before anything is built.

    With `command` ("fit", "test", ...), the data class must also define that stage's dataloader.
    """
    from ember.callbacks.callback import Callback
    from ember.loggers.logger import Logger
    from ember.modules.datamodule import DataModule
    from ember.modules.module import TrainingModule

    check_target(loaded, config["module"], "module", base=TrainingModule)
    check_target(loaded, config["data"], "data", base=DataModule)
    data_cls = import_target(config["data"]["_target_"])
    loader = f"{stages.by_name(command).loader}_dataloader" if command else None
    if loader and inspect.isclass(data_cls) and getattr(data_cls, loader) is getattr(DataModule, loader):
        raise loaded.error("data._target_", f"{config['data']['_target_']} has no {loader}(), which `{command}` needs")
    trainer = config["trainer"]
    for i, spec in enumerate(trainer["callbacks"] or []):
        check_target(loaded, spec, f"trainer.callbacks[{i}]", base=Callback)
    logger = trainer["logger"]
    if isinstance(logger, (dict, list)):
        for i, spec in enumerate(logger if isinstance(logger, list) else [logger]):
            check_target(
                loaded, spec, f"trainer.logger[{i}]" if isinstance(logger, list) else "trainer.logger", base=Logger
            )
    elif not isinstance(logger, bool) and logger is not None:
        raise loaded.error("trainer.logger", f"expected true, false or a list of _target_ sections, got {logger!r}")
    if isinstance(trainer["strategy"], dict):
        from ember.strategies.strategy import Strategy

        check_target(loaded, trainer["strategy"], "trainer.strategy", base=Strategy)
    elif not isinstance(trainer["strategy"], str):
        raise loaded.error("trainer.strategy", f"expected a name or a _target_ section, got {trainer['strategy']!r}")
    _check_optimizer_sections(loaded, config, TrainingModule)


def _check_optimizer_sections(loaded: LoadedConfig, config: dict[str, Any], base: type) -> None:
    if config["optimizer"] is None:
        if config["lr_scheduler"] is not None:
            raise loaded.error("lr_scheduler", "a scheduler needs an optimizer section too")
        return
    check_target(loaded, config["optimizer"], "optimizer", skip=1, base=OPTIMIZER_BASE)
    if config["lr_scheduler"] is not None:
        check_target(
            loaded, config["lr_scheduler"], "lr_scheduler", skip=1, reserved=SCHEDULER_OPTIONS, base=scheduler_bases()
        )
    module_cls = import_target(config["module"]["_target_"])
    if inspect.isclass(module_cls) and module_cls.configure_optimizers is not base.configure_optimizers:  # type: ignore[attr-defined]
        raise loaded.error(
            "optimizer",
            f"{config['module']['_target_']} defines its own configure_optimizers(), which would ignore this "
            "section; remove the section or the override",
        )


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

"""Checking a resolved run config before anything is built: every ``_target_`` importable, of the right kind,
its keywords accepted by its signature and of the types it declares.

`check` is the entry point; it imports the base classes a section must derive from (`TrainingModule`,
`DataModule`, `Callback`, `Logger`, `Strategy`) when it runs.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from ember import stages
from ember.config.schema import describe_type, lookup, split_key
from ember.config.targets import OPTIMIZER_BASE, SCHEDULER_OPTIONS, import_target, scheduler_bases, wrong_kind

if TYPE_CHECKING:
    from ember.config.loading import LoadedConfig


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


def _nested_targets(key: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and "_target_" in value:
        return [(key, value)]
    if isinstance(value, list):
        return [(f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, dict) and "_target_" in v]
    return []


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
    _check_store_urls(loaded, trainer)


def _check_store_urls(loaded: LoadedConfig, trainer: dict[str, Any]) -> None:
    """Refuse a store URL that carries credentials or a query before anything prints or builds it."""
    from ember.checkpoint.format import CheckpointError
    from ember.checkpoint.store import check_url, is_url

    urls = [("trainer.default_root_dir", trainer.get("default_root_dir"))]
    for i, spec in enumerate(trainer["callbacks"] or []):
        if isinstance(spec, dict):
            urls.append((f"trainer.callbacks[{i}].dirpath", spec.get("dirpath")))
    for key, value in urls:
        if isinstance(value, str) and is_url(value):
            try:
                check_url(value, key.rsplit(".", 1)[-1])
            except CheckpointError as exc:
                raise loaded.error(key, str(exc)) from None


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

"""The config schema: what a run config may contain, typed, and key paths into it.

`RunConfig` is the whole file; `TrainerConfig` is derived from the Trainer's own options
(`ember.trainer.options.TrainerOptions`), field for field. ``module``, ``data``, ``optimizer`` and
``lr_scheduler`` are ``_target_`` sections: a dotted path plus constructor keywords.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


def _trainer_config() -> type:
    """The ``trainer`` section's schema, derived field for field from `ember.trainer.options.TrainerOptions`
    (the Trainer's keywords), so the YAML schema and the Python API cannot drift."""
    from ember.trainer.options import TrainerOptions

    hints = typing.get_type_hints(TrainerOptions)
    yaml_types: dict[str, Any] = {"callbacks": list[Any] | None}  # _target_ sections
    fields = [
        (f.name, yaml_types.get(f.name, hints[f.name]), field(default=f.default))
        for f in dataclasses.fields(TrainerOptions)
    ]
    config = dataclasses.make_dataclass("TrainerConfig", fields)
    config.__module__ = __name__
    return config


#: The ``trainer`` section of a run config: every `ember.Trainer` keyword with its default.
TrainerConfig = _trainer_config()


@dataclass
class RunConfig:
    """A whole run: what `ember fit -c FILE` reads. ``module`` and ``data`` are ``_target_`` plus kwargs."""

    seed: int | None = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # type: ignore[valid-type]
    module: dict[str, Any] = MISSING
    data: dict[str, Any] = MISSING
    optimizer: dict[str, Any] | None = None
    lr_scheduler: dict[str, Any] | None = None


def split_key(key: str) -> list[str | int]:
    """``"trainer.callbacks[0].monitor"`` -> ``["trainer", "callbacks", 0, "monitor"]``."""
    return [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", key)]


def lookup(container: Any, parts: Sequence[str | int]) -> tuple[bool, Any]:
    """(found, value) of the key `parts` in nested dicts and lists."""
    for part in parts:
        if isinstance(container, dict):
            found = part in container
        else:
            found = isinstance(container, list) and isinstance(part, int) and part < len(container)
        if not found:
            return False, None
        container = container[part]
    return True, container


def schema_type(key: str) -> str | None:
    """The schema's type for `key` in words ("int or null"), or None where the schema does not say."""
    cls: Any = RunConfig
    hint: Any = None
    for part in split_key(key):
        if not (isinstance(part, str) and dataclasses.is_dataclass(cls)):
            return None
        hint = typing.get_type_hints(cls).get(part)
        cls = hint
    return describe_type(hint)


def describe_type(hint: Any) -> str | None:
    """``int | None`` -> "int or null"; None for `Any` and types it cannot name."""
    if hint is None or hint is Any:
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        names = [describe_type(a) for a in typing.get_args(hint)]
        return None if None in names else " or ".join(n for n in names if n)
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return "a mapping of options"
    origin = typing.get_origin(hint) or hint
    return {dict: "a mapping", list: "a list"}.get(origin, getattr(hint, "__name__", None))

"""Run configs for the ``ember`` command: schema, loading, checking and building ``_target_`` sections.

A config is loaded (`load`: schema defaults < each file < command-line overrides), resolved
(`resolve`: interpolations such as ``${module.lr}`` and ``${oc.env:VAR,default}``) and checked
(`check`: every ``_target_`` importable, its keywords accepted) before `instantiate` builds anything.
Every mistake is a `ConfigError` with a one-line message.

Each name is imported from its module on first use (`ConfigError` at once): the schema is derived from
the Trainer's options and imports them, so importing ``ember.config.targets`` (which
`TrainingModule.configure_optimizers` does) must not import the schema. OmegaConf is imported with the
schema, so ``import ember`` does not import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ember.config.errors import ConfigError

if TYPE_CHECKING:
    from ember.config.checking import check
    from ember.config.loading import LoadedConfig, add_import_roots, load, resolve, to_yaml
    from ember.config.paths import resolve_paths
    from ember.config.schema import RunConfig, TrainerConfig, schema_type
    from ember.config.targets import SCHEDULER_OPTIONS, build_optimizers, import_target, instantiate

_WHERE = {
    "LoadedConfig": "loading",
    "RunConfig": "schema",
    "SCHEDULER_OPTIONS": "targets",
    "TrainerConfig": "schema",
    "add_import_roots": "loading",
    "build_optimizers": "targets",
    "check": "checking",
    "import_target": "targets",
    "instantiate": "targets",
    "load": "loading",
    "resolve": "loading",
    "resolve_paths": "paths",
    "schema_type": "schema",
    "to_yaml": "loading",
}

__all__ = [
    "SCHEDULER_OPTIONS",
    "ConfigError",
    "LoadedConfig",
    "RunConfig",
    "TrainerConfig",
    "add_import_roots",
    "build_optimizers",
    "check",
    "import_target",
    "instantiate",
    "load",
    "resolve",
    "resolve_paths",
    "schema_type",
    "to_yaml",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"ember.config.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ember.config' has no attribute {name!r}")

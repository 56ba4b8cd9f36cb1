"""Run configs for the ``ember`` command: schema, loading, checking and building ``_target_`` sections.

A config is loaded (`load`: schema defaults < each file < command-line overrides), resolved
(`resolve`: interpolations such as ``${module.lr}`` and ``${oc.env:VAR,default}``) and checked
(`check`: every ``_target_`` importable, its keywords accepted) before `instantiate` builds anything.
Every mistake is a `ConfigError` with a one-line message. Importing this package imports OmegaConf,
so ``import ember`` does not import it.
"""

from ember.config.loading import LoadedConfig, add_import_roots, load, resolve, to_yaml
from ember.config.schema import ConfigError, RunConfig, TrainerConfig, schema_type
from ember.config.targets import SCHEDULER_OPTIONS, build_optimizers, check, import_target, instantiate

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
    "schema_type",
    "to_yaml",
]

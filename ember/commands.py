"""What the ``ember`` subcommands share: the options every subcommand takes, and building a run from a config.

`ember.cli` adds the subcommands; ``ember export`` (`ember.export.command`), ``ember tune`` and
``ember sweep`` (`ember.tuning.cli`, and each sweep trial in `ember.tuning.sweep_worker`) add and run their
own with these pieces, so none of them imports the command line back.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.modules.datamodule import DataModule
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def add_command(
    commands: Any,
    name: str,
    text: str,
    description: str,
    epilog: str,
    config_help: str = "a YAML config; repeat to layer",
) -> argparse.ArgumentParser:
    """A subcommand of ``ember``, with the options they all have: ``-c/--config`` (repeatable) and ``--debug``."""
    sub: argparse.ArgumentParser = commands.add_parser(
        name,
        help=text,
        description=description,
        epilog=epilog,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub.add_argument("-c", "--config", action="append", default=[], metavar="FILE", help=config_help)
    sub.add_argument("--debug", action="store_true", help="show full tracebacks")
    return sub


def add_seed(sub: argparse.ArgumentParser) -> None:
    """``--seed N``, for the subcommands that train or evaluate."""
    sub.add_argument("--seed", type=int, metavar="N", help="seed everything with N (same as seed=N)")


def build(config: dict[str, Any]) -> tuple[Trainer, TrainingModule, DataModule]:
    """Seed, then build the trainer (callbacks, loggers), the module and the data from a checked config.

    The module gets the config's ``optimizer``/``lr_scheduler`` sections as ``optimizer_config``; the
    trainer gets the whole config as ``run_config`` (saved as config.yaml, in checkpoints, as hparams).
    """
    import ember
    from ember.config import ConfigError, instantiate

    if config["seed"] is not None:
        ember.seed_everything(config["seed"])
    from ember.loggers.logger import Logger
    from ember.strategies.strategy import Strategy

    options = dict(config["trainer"])
    bases = {"callbacks": ember.Callback, "logger": Logger, "strategy": Strategy}
    for key, base in bases.items():
        options[key] = instantiate(options[key], f"trainer.{key}", base=base)
    try:
        trainer = ember.Trainer(**options)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"trainer: {exc}") from exc
    module = instantiate(config["module"], "module", base=ember.TrainingModule)
    data = instantiate(config["data"], "data", base=ember.DataModule)
    if config["optimizer"] is not None:
        module.optimizer_config = {"optimizer": config["optimizer"], "lr_scheduler": config["lr_scheduler"]}
    trainer.run_config = config
    return trainer, module, data

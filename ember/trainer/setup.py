"""What a run gets by default: loggers and the built-in callbacks."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ember.callbacks.callback import Callback
from ember.loggers.csv import CSVLogger
from ember.loggers.logger import Logger
from ember.modules.module import TrainingModule

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def run_name(module: TrainingModule | type) -> str:
    """Default run name: the module's class name in snake_case (``Classifier`` -> ``classifier``,
    ``CNNClassifier`` -> ``cnn_classifier``); a class may be given instead of a module."""
    name = (module if isinstance(module, type) else type(module)).__name__
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def resolve_loggers(option: bool | Logger | Sequence[Logger] | None) -> list[Logger]:
    """``True``: TensorBoard and CSV in the run directory; ``False``/``None``: none; else the given ones."""
    if option is True:
        from ember.loggers.tensorboard import TensorBoardLogger

        return [TensorBoardLogger(), CSVLogger()]
    if option is False or option is None:
        return []
    loggers = [option] if isinstance(option, Logger) else list(option)
    for logger in loggers:
        if not isinstance(logger, Logger):
            raise TypeError(f"logger must be True, False, an ember Logger or a list of them; got {logger!r}")
    return loggers


def stdout_is_terminal() -> bool:
    """Whether stdout is an interactive terminal (not a file, pipe, CI or SLURM log)."""
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


def default_callbacks(trainer: Trainer) -> list[Callback]:
    """Built-in callbacks the options ask for, unless the user passed one of the same kind.

    The progress display is `RichProgressBar` when stdout is a terminal and
    `ProgressLine` otherwise; `ParameterHistograms` joins when a logger asks
    for histograms.
    """
    from ember.callbacks.gradient_monitor import ParameterHistograms
    from ember.callbacks.model_checkpoint import ModelCheckpoint
    from ember.callbacks.model_summary import ModelSummary
    from ember.callbacks.progress import ProgressLine
    from ember.callbacks.rich_progress import RichProgressBar

    def present(*kinds: type) -> bool:
        return any(isinstance(cb, kinds) for cb in trainer.user_callbacks)

    wanted: list[Callback] = []
    if trainer.enable_model_summary and not present(ModelSummary):
        wanted.append(ModelSummary())
    if trainer.enable_progress_bar and not present(ProgressLine, RichProgressBar):
        wanted.append(RichProgressBar() if stdout_is_terminal() else ProgressLine())
    if trainer.enable_checkpointing and not present(ModelCheckpoint):
        wanted.append(ModelCheckpoint())
    if any(logger.log_histograms_every_n_steps for logger in given_loggers(trainer)) and not present(
        ParameterHistograms
    ):
        wanted.append(ParameterHistograms())
    if trainer.profiler is not None:
        wanted.append(trainer.profiler.callback)
    return wanted


def given_loggers(trainer: Trainer) -> list[Logger]:
    """The loggers the user passed (resolved or not yet), without building the defaults."""
    if trainer.loggers:
        return trainer.loggers
    option = trainer.options.logger
    if isinstance(option, Logger):
        return [option]
    if isinstance(option, Sequence):
        return [logger for logger in option if isinstance(logger, Logger)]
    return []


def record_hyperparameters(trainer: Trainer, module: TrainingModule, resumed: bool = False) -> None:
    """Write the resolved config to ``config.yaml`` and give the loggers the run's hyperparameters.

    A run that resumes in its own directory keeps ``config.yaml`` (the config its first segment trained
    with) and writes this segment's as ``config-resume-N.yaml``; ``fast_dev_run`` writes no config.
    """
    if not trainer.is_global_zero:
        return
    if trainer.run_config is not None and not trainer.fast_dev_run:
        from omegaconf import OmegaConf

        from ember.checkpoint.files import atomic_write

        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        target = trainer.run_dir / "config.yaml"
        if resumed and target.exists():
            n = 1
            while (trainer.run_dir / f"config-resume-{n}.yaml").exists():
                n += 1
            target = trainer.run_dir / f"config-resume-{n}.yaml"
        atomic_write(target, OmegaConf.to_yaml(OmegaConf.create(trainer.run_config)))
    hparams = dict(module.hparams) if module.hparams_to_loggers else {}
    params = trainer.run_config if trainer.run_config is not None else hparams
    if params:
        trainer.run_state.logger_guard.log_hyperparams(params)

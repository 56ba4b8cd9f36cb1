"""What a run gets by default: loggers and the built-in callbacks."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ember.callbacks.callback import Callback
from ember.loggers.csv import CSVLogger
from ember.loggers.logger import Logger
from ember.modules.module import TrainingModule

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def run_name(module: TrainingModule) -> str:
    """Default run name: the module's class name in snake_case (``Classifier`` -> ``classifier``)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(module).__name__).lower()


def next_version(root: Path) -> str:
    """``version_N`` with N one past the highest existing ``version_*`` folder in `root`."""
    numbers = [int(m.group(1)) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
    return f"version_{max(numbers, default=-1) + 1}"


def resolve_loggers(option: bool | Logger | Sequence[Logger] | None) -> list[Logger]:
    """``True``: a CSV logger in the run directory; ``False``/``None``: none; else the given ones."""
    if option is True:
        return [CSVLogger()]
    if option is False or option is None:
        return []
    loggers = [option] if isinstance(option, Logger) else list(option)
    for logger in loggers:
        if not isinstance(logger, Logger):
            raise TypeError(f"logger must be True, False, an ember Logger or a list of them; got {logger!r}")
    return loggers


def default_callbacks(trainer: Trainer) -> list[Callback]:
    """Built-in callbacks the options ask for, unless the user passed one of the same kind."""
    from ember.callbacks.model_checkpoint import ModelCheckpoint
    from ember.callbacks.model_summary import ModelSummary
    from ember.callbacks.progress import ProgressLine

    present = {type(cb) for cb in trainer.user_callbacks}
    wanted: list[Callback] = []
    if trainer.enable_model_summary and ModelSummary not in present:
        wanted.append(ModelSummary())
    if trainer.enable_progress_bar and ProgressLine not in present:
        wanted.append(ProgressLine())
    if trainer.enable_checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in trainer.user_callbacks):
        wanted.append(ModelCheckpoint())
    return wanted

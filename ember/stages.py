"""The stage vocabulary: every name a stage goes by, in one table.

A stage is called ``"validate"`` by `Trainer.stage` and `DataModule.setup`, ``"validation"`` by its loop
and hooks (``on_validation_start``), ``"val"`` by its dataloader method and limit option
(``val_dataloader``, ``limit_val_batches``), and ``validation_step`` is its step. Code that needs one
name from another looks it up here instead of keeping its own mapping.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """The names of one stage."""

    name: str  # Trainer.stage, DataModule.setup(stage), the `ember` subcommand
    loop: str  # the loop and its hooks: on_<loop>_start, ...
    loader: str  # <loader>_dataloader(), limit_<loader>_batches
    step: str  # the TrainingModule method called per batch

    @property
    def limit_option(self) -> str:
        return f"limit_{self.loader}_batches"


FIT = Stage("fit", "train", "train", "training_step")
VALIDATE = Stage("validate", "validation", "val", "validation_step")
TEST = Stage("test", "test", "test", "test_step")
PREDICT = Stage("predict", "predict", "predict", "predict_step")
STAGES = (FIT, VALIDATE, TEST, PREDICT)


def by_name(name: str) -> Stage:
    """The stage called `name` (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``)."""
    return _BY_NAME[name]


def by_loop(loop: str) -> Stage:
    """The stage whose loop is `loop` (``"train"``, ``"validation"``, ``"test"``, ``"predict"``)."""
    return _BY_LOOP[loop]


_BY_NAME = {stage.name: stage for stage in STAGES}
_BY_LOOP = {stage.loop: stage for stage in STAGES}

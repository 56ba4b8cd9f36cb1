"""Every public property of a `Trainer` reads right after ``__init__``: a value, or a RuntimeError that says when
it exists; never an AttributeError from a state that was not set yet. The trainer's state is read-only, except
``should_stop``."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import ember
from ember.trainer.trainer import Trainer

PROPERTIES = sorted(
    name for name, value in inspect.getmembers(Trainer) if isinstance(value, property) and not name.startswith("_")
)
#: The properties that only exist inside (or after) a run, and say so.
RUN_ONLY = {"hooks", "model", "module", "run_dir", "log_dir"}


class Tiny(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_there_are_properties_to_check() -> None:
    assert {"callbacks", "checkpoint_callback", "optimizers", "stage", "should_stop", "loggers"} <= set(PROPERTIES)


@pytest.mark.parametrize("name", PROPERTIES)
def test_every_public_property_reads_right_after_init(name: str) -> None:
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    if name in RUN_ONLY:
        with pytest.raises(RuntimeError, match="fit/validate/test/predict"):
            getattr(trainer, name)
    elif name == "estimated_stepping_batches":
        with pytest.raises(RuntimeError, match="once fit has its data"):
            getattr(trainer, name)
    else:
        getattr(trainer, name)  # no AttributeError, no other error


def test_values_before_the_first_run() -> None:
    saver = ember.callbacks.ModelCheckpoint()
    trainer = Trainer(callbacks=[saver], logger=False)
    assert trainer.callbacks == [saver]
    assert trainer.checkpoint_callback is saver
    assert trainer.checkpoint_callbacks == [saver]
    assert trainer.optimizers == [] and trainer.lr_scheduler_configs == []
    assert trainer.stage is None and trainer.should_stop is False and trainer.sanity_checking is False
    assert trainer.global_step == 0 and trainer.current_epoch == 0 and trainer.stop_reason is None
    assert Trainer(logger=False).checkpoint_callback is None


@pytest.mark.parametrize(
    "name",
    ["global_step", "current_epoch", "stage", "optimizers", "loggers", "callbacks", "progress", "sanity_checking"],
)
def test_the_run_state_is_read_only(name: str) -> None:
    trainer = Trainer(logger=False)
    with pytest.raises(AttributeError):
        setattr(trainer, name, getattr(trainer, name))


def test_should_stop_is_the_one_a_hook_sets_and_a_run_resets() -> None:
    trainer = Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    trainer.should_stop = True
    assert trainer.should_stop is True and trainer.progress.should_stop is True
    data = [(torch.ones(4, 2), torch.ones(4, 1))] * 3
    trainer.fit(Tiny(), data)
    assert trainer.current_epoch == 3, "a stop asked for before the run does not carry into it"
    assert trainer.stop_reason == "max_epochs"


def test_stop_reason_names_the_condition_that_ended_the_fit() -> None:
    data = [(torch.ones(4, 2), torch.ones(4, 1))] * 4

    class StopAtStep2(ember.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            if trainer.global_step == 2:
                trainer.should_stop = True

    common = {"logger": False, "enable_progress_bar": False, "enable_checkpointing": False}
    by_steps = Trainer(max_steps=3, **common)
    by_steps.fit(Tiny(), data)
    by_hook = Trainer(max_epochs=5, callbacks=[StopAtStep2()], **common)
    by_hook.fit(Tiny(), data)
    assert (by_steps.stop_reason, by_steps.global_step) == ("max_steps", 3)
    assert (by_hook.stop_reason, by_hook.global_step) == ("should_stop", 2)

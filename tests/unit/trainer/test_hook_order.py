"""The order of every hook, recorded from real runs and pinned literally.

A `TrainingModule` and a `Callback` that override every name in `HOOK_NAMES`
append ``(owner, hook_name)`` to one shared list. The expected lists below are
the source of truth; docs/hooks.md describes the same order in prose.

The recording hooks are generated from the signatures declared on `Callback`:
the callback versions keep ``(trainer, module, ...)``, the module versions drop
those two arguments, and every call is bound against that signature, so a hook
dispatched with the wrong arguments fails the test.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Callback, Trainer, TrainingModule
from ember.callbacks.callback import HOOK_NAMES

Calls = list[tuple[str, str]]


# --- recorders ------------------------------------------------------------------------------

#: One training batch's hooks: one that ends an accumulation window (an optimizer step), one inside a window.
STEPPED_BATCH = (
    "on_train_batch_start", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end",
)  # fmt: skip
MICRO_BATCH = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_train_batch_end")


def _module_signature(name: str) -> inspect.Signature:
    sig = inspect.signature(getattr(Callback, name))
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in ("trainer", "module")])


def _recording_hook(owner: str, name: str, sig: inspect.Signature) -> Callable[..., None]:
    def hook(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = sig.bind(self, *args, **kwargs)  # TypeError if dispatched with the wrong arguments
        if owner == "callback":
            trainer, module = bound.arguments["trainer"], bound.arguments["module"]
            assert isinstance(trainer, Trainer)
            assert module.trainer is trainer
        if name in ("setup", "teardown"):
            self.stages.append(bound.arguments["stage"])
        self.calls.append((owner, name))

    hook.__name__ = hook.__qualname__ = name
    hook.__signature__ = sig  # type: ignore[attr-defined]
    return hook


class RecordingModule(TrainingModule):
    """Overrides every hook (module signature: no trainer/module arguments)."""

    def __init__(self, calls: Calls) -> None:
        super().__init__()
        self.calls = calls
        self.stages: list[str] = []
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.layer(batch[0]).sum()

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.layer(batch[0]).sum()

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self.layer(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordingCallback(Callback):
    """Overrides every hook (callback signature: trainer and module first)."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.stages: list[str] = []


for _name in HOOK_NAMES:
    setattr(RecordingModule, _name, _recording_hook("module", _name, _module_signature(_name)))
    _callback_sig = inspect.signature(getattr(Callback, _name))
    setattr(RecordingCallback, _name, _recording_hook("callback", _name, _callback_sig))
del _name, _callback_sig


# --- helpers --------------------------------------------------------------------------------
def _loader(num_batches: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(2 * num_batches, 2)), batch_size=2)


def _trainer(calls: Calls, *extra_callbacks: Callback, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = {"max_epochs": 1, "num_sanity_val_steps": 0}
    options.update(kwargs)
    return Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[RecordingCallback(calls), *extra_callbacks],
        **options,
    )


def both(*names: str) -> Calls:
    """Each hook on the module, then on the callback (for the shorter tests)."""
    return [(owner, name) for name in names for owner in ("module", "callback")]


def test_recorders_override_every_hook() -> None:
    for name in HOOK_NAMES:
        assert name in vars(RecordingModule), name
        assert name in vars(RecordingCallback), name
        assert "trainer" not in inspect.signature(getattr(RecordingModule, name)).parameters
        assert "trainer" in inspect.signature(getattr(RecordingCallback, name)).parameters


# --- (a) fit ----------------------------------------------------------------------------------
FIT_EXPECTED: Calls = [
    ("module", "setup"), ("callback", "setup"),
    ("module", "on_fit_start"), ("callback", "on_fit_start"),
    # sanity check: num_sanity_val_steps=1 validation batch
    ("module", "on_sanity_check_start"), ("callback", "on_sanity_check_start"),
    ("module", "on_validation_start"), ("callback", "on_validation_start"),
    ("module", "on_validation_epoch_start"), ("callback", "on_validation_epoch_start"),
    ("module", "on_validation_batch_start"), ("callback", "on_validation_batch_start"),
    ("module", "on_validation_batch_end"), ("callback", "on_validation_batch_end"),
    ("module", "on_validation_epoch_end"), ("callback", "on_validation_epoch_end"),
    ("module", "on_validation_end"), ("callback", "on_validation_end"),
    ("module", "on_sanity_check_end"), ("callback", "on_sanity_check_end"),
    ("module", "on_train_start"), ("callback", "on_train_start"),
    ("module", "on_train_epoch_start"), ("callback", "on_train_epoch_start"),
    # train batch 0
    ("module", "on_train_batch_start"), ("callback", "on_train_batch_start"),
    ("module", "on_before_backward"), ("callback", "on_before_backward"),
    ("module", "on_after_backward"), ("callback", "on_after_backward"),
    ("module", "on_before_optimizer_step"), ("callback", "on_before_optimizer_step"),
    ("module", "on_before_zero_grad"), ("callback", "on_before_zero_grad"),
    ("module", "on_train_batch_end"), ("callback", "on_train_batch_end"),
    # train batch 1
    ("module", "on_train_batch_start"), ("callback", "on_train_batch_start"),
    ("module", "on_before_backward"), ("callback", "on_before_backward"),
    ("module", "on_after_backward"), ("callback", "on_after_backward"),
    ("module", "on_before_optimizer_step"), ("callback", "on_before_optimizer_step"),
    ("module", "on_before_zero_grad"), ("callback", "on_before_zero_grad"),
    ("module", "on_train_batch_end"), ("callback", "on_train_batch_end"),
    # mid-epoch validation (val_check_interval=0.5 of 4 batches), 2 validation batches
    ("module", "on_validation_start"), ("callback", "on_validation_start"),
    ("module", "on_validation_epoch_start"), ("callback", "on_validation_epoch_start"),
    ("module", "on_validation_batch_start"), ("callback", "on_validation_batch_start"),
    ("module", "on_validation_batch_end"), ("callback", "on_validation_batch_end"),
    ("module", "on_validation_batch_start"), ("callback", "on_validation_batch_start"),
    ("module", "on_validation_batch_end"), ("callback", "on_validation_batch_end"),
    ("module", "on_validation_epoch_end"), ("callback", "on_validation_epoch_end"),
    ("module", "on_validation_end"), ("callback", "on_validation_end"),
    # train batch 2
    ("module", "on_train_batch_start"), ("callback", "on_train_batch_start"),
    ("module", "on_before_backward"), ("callback", "on_before_backward"),
    ("module", "on_after_backward"), ("callback", "on_after_backward"),
    ("module", "on_before_optimizer_step"), ("callback", "on_before_optimizer_step"),
    ("module", "on_before_zero_grad"), ("callback", "on_before_zero_grad"),
    ("module", "on_train_batch_end"), ("callback", "on_train_batch_end"),
    # train batch 3 (last)
    ("module", "on_train_batch_start"), ("callback", "on_train_batch_start"),
    ("module", "on_before_backward"), ("callback", "on_before_backward"),
    ("module", "on_after_backward"), ("callback", "on_after_backward"),
    ("module", "on_before_optimizer_step"), ("callback", "on_before_optimizer_step"),
    ("module", "on_before_zero_grad"), ("callback", "on_before_zero_grad"),
    ("module", "on_train_batch_end"), ("callback", "on_train_batch_end"),
    # end-of-epoch validation, before on_train_epoch_end
    ("module", "on_validation_start"), ("callback", "on_validation_start"),
    ("module", "on_validation_epoch_start"), ("callback", "on_validation_epoch_start"),
    ("module", "on_validation_batch_start"), ("callback", "on_validation_batch_start"),
    ("module", "on_validation_batch_end"), ("callback", "on_validation_batch_end"),
    ("module", "on_validation_batch_start"), ("callback", "on_validation_batch_start"),
    ("module", "on_validation_batch_end"), ("callback", "on_validation_batch_end"),
    ("module", "on_validation_epoch_end"), ("callback", "on_validation_epoch_end"),
    ("module", "on_validation_end"), ("callback", "on_validation_end"),
    ("module", "on_train_epoch_end"), ("callback", "on_train_epoch_end"),
    ("module", "on_train_end"), ("callback", "on_train_end"),
    ("module", "on_fit_end"), ("callback", "on_fit_end"),
    ("module", "teardown"), ("callback", "teardown"),
]  # fmt: skip


def test_fit_hook_order() -> None:
    calls: Calls = []
    module = RecordingModule(calls)
    trainer = _trainer(calls, num_sanity_val_steps=1, val_check_interval=0.5, accumulate_grad_batches=1)
    trainer.fit(module, _loader(4), _loader(2))
    assert calls == FIT_EXPECTED
    assert trainer.global_step == 4
    assert module.stages == ["fit", "fit"]
    assert trainer.callbacks[0].stages == ["fit", "fit"]


# --- (b) validate, (c) test, (d) predict --------------------------------------------------------
VALIDATE_EXPECTED: Calls = [
    ("module", "setup"), ("callback", "setup"),
    ("module", "on_validation_start"), ("callback", "on_validation_start"),
    ("module", "on_validation_epoch_start"), ("callback", "on_validation_epoch_start"),
    ("module", "on_validation_batch_start"), ("callback", "on_validation_batch_start"),
    ("module", "on_validation_batch_end"), ("callback", "on_validation_batch_end"),
    ("module", "on_validation_batch_start"), ("callback", "on_validation_batch_start"),
    ("module", "on_validation_batch_end"), ("callback", "on_validation_batch_end"),
    ("module", "on_validation_epoch_end"), ("callback", "on_validation_epoch_end"),
    ("module", "on_validation_end"), ("callback", "on_validation_end"),
    ("module", "teardown"), ("callback", "teardown"),
]  # fmt: skip

TEST_EXPECTED: Calls = [
    ("module", "setup"), ("callback", "setup"),
    ("module", "on_test_start"), ("callback", "on_test_start"),
    ("module", "on_test_epoch_start"), ("callback", "on_test_epoch_start"),
    ("module", "on_test_batch_start"), ("callback", "on_test_batch_start"),
    ("module", "on_test_batch_end"), ("callback", "on_test_batch_end"),
    ("module", "on_test_batch_start"), ("callback", "on_test_batch_start"),
    ("module", "on_test_batch_end"), ("callback", "on_test_batch_end"),
    ("module", "on_test_epoch_end"), ("callback", "on_test_epoch_end"),
    ("module", "on_test_end"), ("callback", "on_test_end"),
    ("module", "teardown"), ("callback", "teardown"),
]  # fmt: skip

PREDICT_EXPECTED: Calls = [
    ("module", "setup"), ("callback", "setup"),
    ("module", "on_predict_start"), ("callback", "on_predict_start"),
    ("module", "on_predict_epoch_start"), ("callback", "on_predict_epoch_start"),
    ("module", "on_predict_batch_start"), ("callback", "on_predict_batch_start"),
    ("module", "on_predict_batch_end"), ("callback", "on_predict_batch_end"),
    ("module", "on_predict_batch_start"), ("callback", "on_predict_batch_start"),
    ("module", "on_predict_batch_end"), ("callback", "on_predict_batch_end"),
    ("module", "on_predict_epoch_end"), ("callback", "on_predict_epoch_end"),
    ("module", "on_predict_end"), ("callback", "on_predict_end"),
    ("module", "teardown"), ("callback", "teardown"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "stage", "expected"),
    [
        ("validate", "validate", VALIDATE_EXPECTED),
        ("test", "test", TEST_EXPECTED),
        ("predict", "predict", PREDICT_EXPECTED),
    ],
)
def test_evaluation_hook_order(method: str, stage: str, expected: Calls) -> None:
    calls: Calls = []
    module = RecordingModule(calls)
    trainer = _trainer(calls)
    getattr(trainer, method)(module, _loader(2))
    assert calls == expected
    assert module.stages == [stage, stage]
    assert trainer.callbacks[0].stages == [stage, stage]


# --- gradient accumulation --------------------------------------------------------------------
def test_accumulation_steps_only_at_window_ends() -> None:
    calls: Calls = []
    trainer = _trainer(calls, accumulate_grad_batches=2)
    trainer.fit(RecordingModule(calls), _loader(4))
    micro_batch, window_end = MICRO_BATCH, STEPPED_BATCH
    assert calls == both(
        "setup", "on_fit_start", "on_train_start", "on_train_epoch_start",
        *micro_batch, *window_end,  # batches 0, 1
        *micro_batch, *window_end,  # batches 2, 3
        "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown",
    )  # fmt: skip
    assert trainer.global_step == 2


def test_a_stop_inside_the_epoch_calls_on_train_stop_after_its_batch_end() -> None:
    calls: Calls = []
    trainer = _trainer(calls, max_steps=2)
    trainer.fit(RecordingModule(calls), _loader(4))
    batch = STEPPED_BATCH
    assert calls == both(
        "setup", "on_fit_start", "on_train_start", "on_train_epoch_start",
        *batch, *batch,  # batches 0, 1: max_steps=2 holds at the second step's boundary
        "on_train_stop", "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown",
    )  # fmt: skip
    assert trainer.global_step == 2


class _Unsized(torch.utils.data.IterableDataset):
    """Two batches of two samples, of unknown length."""

    def __iter__(self) -> Any:
        return iter([(torch.randn(2),) for _ in range(4)])


def test_data_of_unknown_length_running_out_in_the_last_epoch_calls_on_train_stop_there() -> None:
    """The fit's last step boundary is known only when the data runs out: `on_train_stop` runs there, after the
    last batch end and before the epoch's end; not in earlier epochs, whose ends are no stop."""
    calls: Calls = []
    trainer = _trainer(calls, max_epochs=2)
    trainer.fit(RecordingModule(calls), DataLoader(_Unsized(), batch_size=2))
    batch = STEPPED_BATCH
    assert calls == both(
        "setup", "on_fit_start", "on_train_start",
        "on_train_epoch_start", *batch, *batch, "on_train_epoch_end",
        "on_train_epoch_start", *batch, *batch, "on_train_stop", "on_train_epoch_end",
        "on_train_end", "on_fit_end", "teardown",
    )  # fmt: skip
    assert trainer.global_step == 4


def test_max_steps_reached_by_the_step_of_a_last_partial_window_calls_on_train_stop_there() -> None:
    """4 batches of unknown length, accumulating 3: the second step is the last, partial window's, taken once the
    data ran out. With ``max_steps=2`` the fit stops there: `on_train_stop` runs after that step, once."""
    calls: Calls = []
    trainer = _trainer(calls, max_epochs=5, max_steps=2, accumulate_grad_batches=3)
    trainer.fit(RecordingModule(calls), DataLoader(_Unsized(), batch_size=1))
    inside, ends = MICRO_BATCH, STEPPED_BATCH
    assert calls == both(
        "setup", "on_fit_start", "on_train_start",
        "on_train_epoch_start", *inside, *inside, *ends, *inside,
        "on_before_optimizer_step", "on_before_zero_grad", "on_train_stop", "on_train_epoch_end",
        "on_train_end", "on_fit_end", "teardown",
    )  # fmt: skip
    assert trainer.global_step == 2


# --- learning-rate schedulers -----------------------------------------------------------------
class _RecordingLR(torch.optim.lr_scheduler.LambdaLR):
    def __init__(self, optimizer: torch.optim.Optimizer, calls: Calls, interval: str) -> None:
        self.calls, self.interval, self.recording = calls, interval, False
        super().__init__(optimizer, lambda _: 1.0)  # steps once here; not recorded
        self.recording = True

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.recording:
            self.calls.append(("scheduler", self.interval))
        super().step(*args, **kwargs)


class _ScheduledModule(RecordingModule):
    def __init__(self, calls: Calls, interval: str) -> None:
        super().__init__(calls)
        self.interval = interval

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = _RecordingLR(opt, self.calls, self.interval)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


def test_epoch_scheduler_steps_after_the_last_batch_before_its_batch_end_hook() -> None:
    """Where Lightning steps it: after the epoch's last optimizer step, before that batch's ``on_train_batch_end``."""
    calls: Calls = []
    _trainer(calls).fit(_ScheduledModule(calls, "epoch"), _loader(1), _loader(1))
    assert calls == [
        *both("setup", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start"),
        *both("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad"),
        ("scheduler", "epoch"),
        *both("on_train_batch_end"),
        *both("on_validation_start", "on_validation_epoch_start", "on_validation_batch_start"),
        *both("on_validation_batch_end", "on_validation_epoch_end", "on_validation_end"),
        *both("on_train_epoch_end"),
        *both("on_train_end", "on_fit_end", "teardown"),
    ]


def test_step_scheduler_steps_after_zero_grad_before_batch_end() -> None:
    calls: Calls = []
    _trainer(calls).fit(_ScheduledModule(calls, "step"), _loader(1))
    assert calls == [
        *both("setup", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start"),
        *both("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad"),
        ("scheduler", "step"),
        *both("on_train_batch_end", "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown"),
    ]


# --- closure optimizers and the module's data hooks ----------------------------------------------
class _LBFGSModule(RecordingModule):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls.append(("step", "training_step"))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=2)


def test_closure_optimizer_runs_step_backward_and_pre_step_hooks_inside_each_evaluation() -> None:
    calls: Calls = []
    _trainer(calls).fit(_LBFGSModule(calls), _loader(1))
    evaluation = [
        ("step", "training_step"),
        *both("on_before_backward", "on_after_backward", "on_before_optimizer_step"),
    ]
    assert calls == [
        *both("setup", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start"),
        *evaluation,  # LBFGS with max_iter=2 evaluates the closure twice
        *evaluation,
        *both("on_before_zero_grad", "on_train_batch_end", "on_train_epoch_end", "on_train_end", "on_fit_end"),
        *both("teardown"),
    ]


class _DataHooksModule(RecordingModule):
    def prepare_data(self) -> None:
        self.calls.append(("module", "prepare_data"))

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.calls.append(("module", "on_before_batch_transfer"))
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self.calls.append(("module", "transfer_batch_to_device"))
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.calls.append(("module", "on_after_batch_transfer"))
        return batch

    def on_validation_model_eval(self) -> None:
        self.calls.append(("module", "on_validation_model_eval"))
        super().on_validation_model_eval()

    def on_validation_model_train(self) -> None:
        self.calls.append(("module", "on_validation_model_train"))
        super().on_validation_model_train()


def test_prepare_data_batch_transfer_and_eval_mode_hooks() -> None:
    calls: Calls = []
    _trainer(calls).fit(_DataHooksModule(calls), _loader(1), _loader(1))
    transfer = [("module", "on_before_batch_transfer"), ("module", "transfer_batch_to_device")]
    transfer.append(("module", "on_after_batch_transfer"))
    assert calls == [
        ("module", "prepare_data"),
        *both("setup", "on_fit_start", "on_train_start", "on_train_epoch_start"),
        *transfer,
        *both("on_train_batch_start"),
        *both("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad"),
        *both("on_train_batch_end"),
        ("module", "on_validation_model_eval"),
        *both("on_validation_start", "on_validation_epoch_start"),
        *transfer,
        *both("on_validation_batch_start", "on_validation_batch_end", "on_validation_epoch_end"),
        *both("on_validation_end"),
        ("module", "on_validation_model_train"),
        *both("on_train_epoch_end", "on_train_end", "on_fit_end", "teardown"),
    ]


# --- exceptions -------------------------------------------------------------------------------
class _FailingModule(RecordingModule):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 1:
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)


def test_exception_calls_on_exception_then_teardown_and_propagates() -> None:
    calls: Calls = []
    seen: list[BaseException] = []

    class Keep(Callback):
        def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
            seen.append(exception)

    module = _FailingModule(calls)
    trainer = _trainer(calls, Keep())
    with pytest.raises(RuntimeError, match="boom in training_step") as excinfo:
        trainer.fit(module, _loader(4))
    assert calls == both(
        "setup", "on_fit_start", "on_train_start", "on_train_epoch_start",
        # batch 0 completes
        "on_train_batch_start", "on_before_backward", "on_after_backward",
        "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end",
        # batch 1 raises inside training_step
        "on_train_batch_start",
        "on_exception", "teardown",
    )  # fmt: skip
    assert seen == [excinfo.value]  # the very exception that propagated
    assert module.stages == ["fit", "fit"]
    assert trainer.stage is None


def test_exception_in_validate_calls_on_exception_then_teardown() -> None:
    class FailingVal(RecordingModule):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            raise ValueError("boom in validation_step")

    calls: Calls = []
    with pytest.raises(ValueError, match="boom in validation_step"):
        _trainer(calls).validate(FailingVal(calls), _loader(2))
    assert calls == both(
        "setup", "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
        "on_exception", "teardown",
    )  # fmt: skip


# --- misspelt hooks ---------------------------------------------------------------------------
class _PlainModule(TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.steps += 1
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_misspelt_callback_hook_is_rejected_before_training() -> None:
    class Typo(Callback):
        def on_train_epoch_ends(self, trainer: Trainer, module: TrainingModule) -> None:
            raise AssertionError("never called")

    calls: Calls = []
    module = _PlainModule()
    trainer = _trainer(calls, Typo())
    with pytest.raises(AttributeError, match=r"on_train_epoch_ends.*did you mean 'on_train_epoch_end'\?"):
        trainer.fit(module, _loader(2))
    assert module.steps == 0
    assert calls == []  # not even setup ran


def test_misspelt_module_hook_is_rejected_before_training() -> None:
    class Typo(_PlainModule):
        def on_validation_epoch_end_(self) -> None:
            raise AssertionError("never called")

    calls: Calls = []
    module = Typo()
    match = r"on_validation_epoch_end_.*did you mean 'on_validation_epoch_end'\?"
    with pytest.raises(AttributeError, match=match):
        _trainer(calls).fit(module, _loader(2), _loader(1))
    assert module.steps == 0
    assert calls == []

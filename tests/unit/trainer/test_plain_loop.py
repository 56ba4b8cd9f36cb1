"""The plain step: when the one batch loop takes it, and that it trains exactly like the general step.

`optimization.plain_step` replaces `run_training_batch` when every part of a step other than
``training_step``, ``backward()`` and ``optimizer.step()`` would be a no-op. Each
scenario below runs twice, once as it comes and once with the plain path turned
off, and compares weights bitwise, the logged values and the progress counters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Callback, Trainer, TrainingModule
from ember.loggers.logger import Logger
from ember.trainer import loop


def _loader(n: int = 48, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x.sum(dim=1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=g)


class Net(TrainingModule):
    """Logs a step value, an epoch value and a validation value; options vary the output form."""

    def __init__(self, output: str = "tensor", skip_every: int = 0, scheduler: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.ReLU(), nn.Linear(8, 2))
        self.output, self.skip_every, self.scheduler = output, skip_every, scheduler

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train/loss", loss)
        self.log("train/mean_loss", loss, on_step=False, on_epoch=True)
        if self.skip_every and batch_idx % self.skip_every == self.skip_every - 1:  # right after an even step
            return None
        return {"loss": loss, "extra": loss * 2} if self.output == "dict" else loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.cross_entropy(self.model(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.scheduler is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler}}


class Recorder(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))


class StopAtValidation(Callback):
    """Sets ``should_stop`` after the second in-epoch validation (as early stopping would)."""

    def __init__(self) -> None:
        self.validations = 0

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self.validations += 1
        if self.validations == 2 and not trainer.sanity_checking:
            trainer.should_stop = True


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records which batch loop each epoch ran ("plain" or "general")."""
    taken: list[str] = []
    original = loop.plain_step

    def spy(fit_loop: Any) -> Any:  # the epoch's step: the plain one, or None for the general one
        step = original(fit_loop)
        taken.append("general" if step is None else "plain")
        return step

    monkeypatch.setattr(loop, "plain_step", spy)
    return taken


def _minimal(**options: Any) -> dict[str, Any]:
    return {
        "max_epochs": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        **options,
    }


class BatchEndHook(Callback):
    """Records what the per-batch hooks see."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        self.seen.append(("start", batch_idx, trainer.global_step, batch[0].sum().item()))

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, idx: int) -> None:
        loss = outputs["loss"] if outputs is not None else None
        assert loss is None or not loss.requires_grad  # detached for the hook
        self.seen.append(("end", idx, trainer.global_step, None if loss is None else loss.item()))


class BeforeStepModule(Net):
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass


class BatchStartModule(Net):
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass


class ManualNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


@pytest.mark.parametrize(
    ("module_cls", "options", "expected"),
    [
        (Net, {}, "plain"),
        (Net, {"precision": "64-true"}, "plain"),
        (Net, {"precision": "bf16-true"}, "plain"),
        (Net, {"callbacks": [BatchEndHook()]}, "plain"),
        (Net, {"enable_progress_bar": True, "enable_checkpointing": True}, "plain"),
        (BatchStartModule, {}, "plain"),
        (BeforeStepModule, {}, "general"),
        (Net, {"gradient_clip_val": 1.0}, "general"),
        (Net, {"accumulate_grad_batches": 2}, "general"),
        (Net, {"precision": "bf16-mixed"}, "general"),
        (Net, {"precision": "16-mixed"}, "general"),
        (Net, {"nonfinite_loss": "error"}, "general"),
        (ManualNet, {}, "general"),
    ],
)
def test_the_plain_loop_runs_only_when_every_other_part_of_a_step_is_a_no_op(
    paths: list[str], module_cls: type[Net], options: dict[str, Any], expected: str
) -> None:
    Trainer(**_minimal(**options)).fit(module_cls(), _loader())
    assert paths == [expected]


def _fit(module: Net, plain: bool, monkeypatch: pytest.MonkeyPatch, **options: Any) -> tuple[Trainer, Recorder]:
    with monkeypatch.context() as patch:
        if not plain:
            patch.setattr(loop, "plain_step", lambda fit_loop: None)
        recorder = Recorder()
        trainer = Trainer(
            **_minimal(**{"logger": recorder, "log_every_n_steps": 2, "num_sanity_val_steps": 0, **options})
        )
        torch.manual_seed(1234)  # dropout draws from the global generator
        trainer.fit(module, _loader(), _loader(n=16, seed=1))
    return trainer, recorder


SCENARIOS = {
    "epochs with validation": ({}, {"max_epochs": 2}),
    "validation inside the epoch": ({}, {"max_epochs": 2, "val_check_interval": 0.5}),
    "max_steps inside an epoch": ({}, {"max_epochs": 3, "max_steps": 9}),
    "stop from a validation hook": ({}, {"max_epochs": 3, "val_check_interval": 2}),
    "dict output": ({"output": "dict"}, {"max_epochs": 2}),
    "skipped batches": ({"skip_every": 3}, {"max_epochs": 2}),
    "step scheduler": ({"scheduler": "step"}, {"max_epochs": 2}),
    "epoch scheduler": ({"scheduler": "epoch"}, {"max_epochs": 2}),
    "64-true": ({}, {"max_epochs": 2, "precision": "64-true"}),
    "per-batch hooks": ({"skip_every": 3}, {"max_epochs": 2}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_plain_loop_trains_bitwise_like_the_general_loop(
    scenario: str, paths: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module_options, trainer_options = SCENARIOS[scenario]
    runs = []
    for plain in (True, False):
        if scenario == "stop from a validation hook":
            trainer_options = {**trainer_options, "callbacks": [StopAtValidation()]}
        if scenario == "per-batch hooks":
            trainer_options = {**trainer_options, "callbacks": [BatchEndHook()]}
        trainer, recorder = _fit(Net(**module_options), plain, monkeypatch, **trainer_options)
        runs.append((trainer, recorder))
    assert paths and set(paths) == {"plain"}  # the first run took the plain step (the second had it turned off)
    (plain_trainer, plain_log), (general_trainer, general_log) = runs
    assert plain_trainer.global_step == general_trainer.global_step > 0
    assert plain_trainer.current_epoch == general_trainer.current_epoch
    assert plain_trainer.progress.batch_idx == general_trainer.progress.batch_idx
    plain_state = plain_trainer.model.state_dict()
    for name, value in general_trainer.model.state_dict().items():
        assert torch.equal(plain_state[name], value), name
    assert plain_log.rows == general_log.rows
    assert plain_log.rows  # something was logged at all
    assert plain_trainer.callback_metrics == general_trainer.callback_metrics
    if scenario == "max_steps inside an epoch":
        assert plain_trainer.global_step == 9
    if scenario == "stop from a validation hook":
        assert plain_trainer.global_step == 4  # two validations, every 2 batches
    if scenario == "per-batch hooks":
        seen = [cb.seen for trainer, _ in runs for cb in trainer.callbacks if isinstance(cb, BatchEndHook)]
        assert seen[0] == seen[1] and len(seen[0]) == 2 * 12
        assert [event[0] for event in seen[0][:4]] == ["start", "end", "start", "end"]
        assert seen[0][5][3] is None  # batch 2 returned None: no loss for the hook
    if scenario == "skipped batches":
        assert plain_trainer.global_step == 8  # 2 of every 3 batches step, 6 batches x 2 epochs


class BadLoss(Net):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        per_sample = nn.functional.cross_entropy(self.model(x), y, reduction="none")
        if self.kind == "not a scalar":
            return per_sample
        if self.kind == "one element":  # backward accepts it (one element), the loop must not
            return per_sample.mean().reshape(1)
        if self.kind == "one element, late":
            return per_sample.mean().reshape(1, 1) if batch_idx == 3 else per_sample.mean()
        if self.kind == "detached":
            return per_sample.mean().detach()
        return {"logits": per_sample}


@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        ("not a scalar", ValueError, "must be a scalar"),
        ("one element", ValueError, r"a loss of shape \(1,\); it must be a scalar"),
        ("one element, late", ValueError, r"a loss of shape \(1, 1\); it must be a scalar"),
        ("detached", RuntimeError, "does not require grad"),
        ("no loss in the dict", TypeError, "without a 'loss' tensor"),
    ],
)
@pytest.mark.parametrize("path", ["plain", "general"])
def test_a_bad_loss_gets_the_same_clear_error_on_both_loops(
    paths: list[str], kind: str, error: type[Exception], message: str, path: str
) -> None:
    module = BadLoss(kind)
    options = {} if path == "plain" else {"gradient_clip_val": 1.0}
    with pytest.raises(error, match=message):
        Trainer(**_minimal(**options)).fit(module, _loader())
    assert paths == [path]
    assert module.trainer.global_step == (3 if kind == "one element, late" else 0)  # nothing trained on it

"""Lightning idioms a ported module uses: each works as in Lightning 2.6, or fails at the call with the ember way.

One test (or a few) per idiom that once did something else silently or failed far from its cause.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import ember
from ember.callbacks import ModelCheckpoint
from ember.loggers.logger import Logger
from ember.strategies.strategy import Strategy

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)


def data(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)


def loader(n: int = 12, batch_size: int = 4, seed: int = 0, shuffle: bool = False) -> DataLoader:
    x, y = data(n, seed)
    g = torch.Generator().manual_seed(1) if shuffle else None
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=g)


class Reg(ember.TrainingModule):
    """A linear regression whose steps call `self.train_log` / `self.val_log` to log things."""

    def __init__(self, train_log: Any = None, val_log: Any = None, optimizers: Any = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)
        self.train_log, self.val_log, self.make_optimizers = train_log, val_log, optimizers
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.steps += 1
        if self.train_log is not None:
            self.train_log(self, loss, batch_idx)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        if self.val_log is not None:
            self.val_log(self, F.mse_loss(self.layer(x), y), batch_idx)

    def configure_optimizers(self) -> Any:
        if self.make_optimizers is not None:
            return self.make_optimizers(self)
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recording(Logger):
    """Keeps every `log_metrics` call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append(dict(metrics))


class HookRecorder(ember.Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def setup(self, trainer: ember.Trainer, module: ember.TrainingModule, stage: str) -> None:
        self.calls.append("setup")

    def on_fit_start(self, trainer: ember.Trainer, module: ember.TrainingModule) -> None:
        self.calls.append("on_fit_start")


# --- self.log ------------------------------------------------------------------------------------------


def test_log_third_positional_argument_is_prog_bar_as_in_lightning() -> None:
    def log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        m.log("shown", loss, True)  # Lightning: prog_bar=True (on_step stays its train default, True)
        m.log("hidden", loss)

    trainer = ember.Trainer(max_epochs=1, **QUIET)
    trainer.fit(Reg(train_log=log), loader())
    assert "shown" in trainer.progress_bar_metrics and "hidden" not in trainer.progress_bar_metrics
    assert {"shown", "hidden"} <= set(trainer.callback_metrics)  # step values, not *_step/*_epoch forks


def test_log_parameters_are_lightnings_in_lightnings_order() -> None:
    import inspect

    names = list(inspect.signature(ember.TrainingModule.log).parameters)[1:]
    assert names == [
        "name", "value", "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph", "sync_dist",
        "sync_dist_group", "add_dataloader_idx", "batch_size", "metric_attribute", "rank_zero_only",
    ]  # fmt: skip


def test_logger_false_keeps_a_value_out_of_the_loggers_only() -> None:
    def log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        m.log("private", loss * 0 + 7.0, logger=False, prog_bar=True)
        m.log("public", loss * 0 + 3.0)

    recording = Recording()
    trainer = ember.Trainer(max_epochs=1, log_every_n_steps=1, **{**QUIET, "logger": recording})
    trainer.fit(Reg(train_log=log), loader())
    assert recording.rows and all("private" not in row for row in recording.rows)
    assert all(row["public"] == 3.0 for row in recording.rows if "public" in row)
    assert trainer.callback_metrics["private"] == 7.0 and trainer.progress_bar_metrics["private"] == 7.0


class RankOne(Strategy):
    """One CPU process that calls itself rank 1 (what `rank_zero_only` and `prepare_data` look at)."""

    @property
    def global_rank(self) -> int:
        return 1

    @property
    def local_rank(self) -> int:
        return 1


def test_rank_zero_only_logs_on_process_zero_and_refuses_sync_dist() -> None:
    def log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        m.log("r0", loss, rank_zero_only=True)

    zero = ember.Trainer(max_epochs=1, **QUIET)
    zero.fit(Reg(train_log=log), loader())
    assert "r0" in zero.callback_metrics
    other = ember.Trainer(max_epochs=1, strategy=RankOne(), **QUIET)
    other.fit(Reg(train_log=log), loader())
    assert "r0" not in other.callback_metrics  # a value logged on process 0 only does not exist elsewhere

    def both(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        m.log("r0", loss, rank_zero_only=True, sync_dist=True)

    with pytest.raises(ValueError, match="cannot be synced"):
        ember.Trainer(max_epochs=1, **QUIET).fit(Reg(train_log=both), loader())


@pytest.mark.parametrize(
    ("reduce_fx", "expected"), [(torch.max, max), (torch.min, min), (torch.sum, sum), ("avg", None)]
)
def test_reduce_fx_takes_lightnings_callables(reduce_fx: Any, expected: Any) -> None:
    seen: list[float] = []

    def log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        value = torch.tensor(float(batch_idx * 2 + 1))
        seen.append(float(value))
        m.log("v", value, on_step=False, on_epoch=True, reduce_fx=reduce_fx)

    trainer = ember.Trainer(max_epochs=1, **QUIET)
    trainer.fit(Reg(train_log=log), loader())
    want = expected(seen) if expected is not None else sum(seen) / len(seen)  # equal batch sizes: plain mean
    assert trainer.callback_metrics["v"] == want


def test_reduce_fx_other_callables_are_refused_with_the_torchmetrics_way() -> None:
    def log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        m.log("v", loss, on_epoch=True, reduce_fx=torch.median)

    with pytest.raises(ValueError, match=r"torchmetrics\.Metric"):
        ember.Trainer(max_epochs=1, **QUIET).fit(Reg(train_log=log), loader())


def test_log_with_neither_on_step_nor_on_epoch_is_refused() -> None:
    def log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        m.log("v", loss, on_step=False, on_epoch=False)

    with pytest.raises(ValueError, match="records nothing"):
        ember.Trainer(max_epochs=1, **QUIET).fit(Reg(train_log=log), loader())


def test_add_dataloader_idx_false_drops_the_suffix() -> None:
    class TwoLoaders(Reg):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            x, y = batch
            if dataloader_idx == 0:
                self.log("val/a", F.mse_loss(self.layer(x), y), add_dataloader_idx=False)
            self.log("val/b", F.mse_loss(self.layer(x), y))

    trainer = ember.Trainer(**QUIET)
    trainer.validate(TwoLoaders(), [loader(), loader(seed=1)])
    names = set(trainer.callback_metrics)
    assert {"val/a", "val/b/dataloader_idx_0", "val/b/dataloader_idx_1"} <= names


def test_sync_dist_group_is_refused_with_what_to_do() -> None:
    def log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        m.log("v", loss, sync_dist_group=object())

    with pytest.raises(ValueError, match="process_group"):
        ember.Trainer(max_epochs=1, **QUIET).fit(Reg(train_log=log), loader())


# --- configure_optimizers ------------------------------------------------------------------------------


def test_two_lists_of_optimizers_and_schedulers() -> None:
    def make(m: Reg) -> Any:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    trainer = ember.Trainer(max_epochs=3, **QUIET)
    trainer.fit(Reg(optimizers=make), loader())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_top_level_monitor_drives_reduce_lr_on_plateau() -> None:
    def make(m: Reg) -> Any:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {"optimizer": opt, "lr_scheduler": plateau, "monitor": "flat"}

    def log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        m.log("flat", 1.0, on_step=False, on_epoch=True)  # never improves after the first epoch

    trainer = ember.Trainer(max_epochs=3, **QUIET)
    trainer.fit(Reg(train_log=log, optimizers=make), loader())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_configure_optimizers_returning_none_trains_without_updates() -> None:
    class Watch(Reg):
        def on_after_backward(self) -> None:
            self.grads = self.layer.weight.grad.clone()

    module = Watch(optimizers=lambda m: None)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = ember.Trainer(max_epochs=2, **QUIET)
    with pytest.warns(UserWarning, match="without an optimizer"):
        trainer.fit(module, loader())
    assert module.steps == 6 and trainer.global_step == 6  # every batch ran forward and backward
    assert module.grads.abs().sum() > 0
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # nothing updated


# --- fit / validate arguments ------------------------------------------------------------------------------


class DM(ember.DataModule):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.train_calls = 0

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self) -> DataLoader:
        self.train_calls += 1
        return loader()

    def val_dataloader(self) -> DataLoader:
        return loader(seed=1)


def test_fit_takes_a_datamodule_in_second_place() -> None:
    dm = DM()
    module = Reg()
    ember.Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(module, dm)
    assert module.steps == 3 and dm.calls == ["prepare_data", "setup:fit"]


def test_validate_third_argument_is_ckpt_path(tmp_path: Path) -> None:
    saver = ModelCheckpoint(monitor="val/loss", mode="min")

    def val_log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        m.log("val/loss", loss)

    module = Reg(val_log=val_log)
    kw = {**QUIET, "enable_checkpointing": True}
    trainer = ember.Trainer(max_epochs=2, callbacks=[saver], default_root_dir=tmp_path, **kw)
    trainer.fit(module, loader(), loader(seed=1))
    fresh = Reg(val_log=val_log)
    (result,) = trainer.validate(fresh, loader(seed=1), "best")
    assert trainer.ckpt_path == Path(saver.best_model_path)
    assert result["val/loss"] == pytest.approx(saver.best_model_score)


def test_wrong_arguments_fail_at_the_call_before_any_hook() -> None:
    recorder = HookRecorder()
    trainer = ember.Trainer(max_epochs=1, callbacks=[recorder], **QUIET)
    with pytest.raises(TypeError, match="ckpt_path must be a path"):
        trainer.validate(Reg(), loader(), DM())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pass it as datamodule="):
        trainer.fit(Reg(), loader(), DM())
    with pytest.raises(TypeError, match="DataLoader"):
        trainer.fit(Reg(), 5)
    with pytest.raises(ValueError, match="not both"):
        trainer.fit(Reg(), DM(), loader())  # as in Lightning: the datamodule brings its own loaders
    with pytest.raises(ValueError, match="not both"):
        trainer.validate(Reg(), loader(), datamodule=DM())
    assert recorder.calls == []


def test_module_defined_dataloaders_are_used() -> None:
    class Own(Reg):
        def train_dataloader(self) -> DataLoader:
            return loader()

        def val_dataloader(self) -> DataLoader:
            return loader(n=8, seed=1)

    validated: list[int] = []
    module = Own(val_log=lambda m, loss, i: validated.append(i))
    ember.Trainer(max_epochs=2, num_sanity_val_steps=0, **QUIET).fit(module)
    assert module.steps == 6 and validated == [0, 1, 0, 1]
    assert len(ember.Trainer(**QUIET).validate(Own())) == 1


def test_a_plain_list_of_batches_trains_like_a_dataloader() -> None:
    batches = list(loader())
    from_list, from_loader = Reg(), Reg()
    ember.Trainer(max_epochs=2, **QUIET).fit(from_list, batches)
    ember.Trainer(max_epochs=2, **QUIET).fit(from_loader, loader())
    assert from_list.steps == 6
    assert all(torch.equal(a, b) for a, b in zip(from_list.parameters(), from_loader.parameters(), strict=True))


# --- closure optimizers and manual optimization ---------------------------------------------------------------


def lbfgs(params: Any) -> torch.optim.LBFGS:
    return torch.optim.LBFGS(params, lr=0.5, max_iter=4, history_size=5)


def test_lbfgs_under_automatic_optimization_equals_a_raw_closure_loop() -> None:
    class WithHooks(Reg):
        def on_before_backward(self, loss: torch.Tensor) -> None:
            self.backwards = getattr(self, "backwards", 0) + 1

    module = WithHooks(optimizers=lambda m: lbfgs(m.parameters()))
    ember.Trainer(max_epochs=2, **QUIET).fit(module, loader())

    torch.manual_seed(0)
    raw = nn.Linear(3, 1)
    opt = lbfgs(raw.parameters())
    evaluations = 0
    for _ in range(2):
        for x, y in loader():

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                nonlocal evaluations
                evaluations += 1
                opt.zero_grad()
                loss = F.mse_loss(raw(x), y)
                loss.backward()
                return loss

            opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(module.layer.parameters(), raw.parameters(), strict=True))
    assert module.steps == evaluations == module.backwards > 6  # the closure ran training_step each time


def test_lbfgs_with_gradient_accumulation_is_refused() -> None:
    module = Reg(optimizers=lambda m: lbfgs(m.parameters()))
    with pytest.raises(ValueError, match="cannot accumulate"):
        ember.Trainer(max_epochs=1, accumulate_grad_batches=2, **QUIET).fit(module, loader())


class Manual(Reg):
    def __init__(self) -> None:
        super().__init__(optimizers=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        self.automatic_optimization = False
        self.returned: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch

        def closure() -> torch.Tensor:
            loss = F.mse_loss(self.layer(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        self.returned.append(opt.step(closure))


def test_manual_step_returns_the_closures_loss() -> None:
    module = Manual()
    ember.Trainer(max_epochs=1, **QUIET).fit(module, loader())
    assert len(module.returned) == 3 and all(isinstance(v, torch.Tensor) and v.ndim == 0 for v in module.returned)


def test_gradient_clip_val_with_manual_optimization_fails_at_the_call() -> None:
    recorder = HookRecorder()
    trainer = ember.Trainer(max_epochs=1, gradient_clip_val=1.0, callbacks=[recorder], **QUIET)
    with pytest.raises(ValueError, match="clip in training_step"):
        trainer.fit(Manual(), loader())
    assert recorder.calls == []


def test_clip_gradients_in_a_manual_step() -> None:
    class Clipped(Manual):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            x, y = batch
            self.manual_backward(F.mse_loss(self.layer(x), y) * 1000)
            self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="value")
            self.max_grad = max(p.grad.abs().max() for p in self.parameters())
            opt.step()
            opt.zero_grad()

    module = Clipped()
    ember.Trainer(max_epochs=1, **QUIET).fit(module, loader())
    assert module.max_grad <= 0.01


# --- Trainer options ------------------------------------------------------------------------------------------


class StopAtOnce(ember.Callback):
    def on_train_batch_end(self, trainer: ember.Trainer, module: ember.TrainingModule, *args: Any) -> None:
        trainer.should_stop = True


def test_min_epochs_and_min_steps_hold_off_should_stop() -> None:
    plain = ember.Trainer(max_epochs=5, callbacks=[StopAtOnce()], **QUIET)
    plain.fit(Reg(), loader())
    assert plain.global_step == 1
    epochs = ember.Trainer(max_epochs=5, min_epochs=2, callbacks=[StopAtOnce()], **QUIET)
    epochs.fit(Reg(), loader())
    assert (epochs.current_epoch, epochs.global_step) == (2, 6)
    steps = ember.Trainer(max_epochs=5, min_steps=4, callbacks=[StopAtOnce()], **QUIET)
    steps.fit(Reg(), loader())
    assert steps.global_step == 4


def test_overfit_batches_trains_on_the_same_first_batches_in_order() -> None:
    seen: list[torch.Tensor] = []
    validated: list[int] = []

    def log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        seen.append(loss.detach())

    module = Reg(train_log=log, val_log=lambda m, loss, i: validated.append(i))
    trainer = ember.Trainer(max_epochs=2, overfit_batches=2, num_sanity_val_steps=0, **QUIET)
    with pytest.warns(UserWarning, match="overfit_batches"):
        trainer.fit(module, loader(shuffle=True), loader(seed=1))
    assert trainer.global_step == 4 and validated == [0, 1, 0, 1]
    first = next(iter(loader()))  # unshuffled order: the first batch of the dataset
    assert torch.equal(seen[0], F.mse_loss(Reg().layer(first[0]), first[1]).detach())


def test_inference_mode_option() -> None:
    modes: list[bool] = []

    def val_log(m: Reg, loss: torch.Tensor, batch_idx: int) -> None:
        modes.append(torch.is_inference_mode_enabled())

    ember.Trainer(inference_mode=True, **QUIET).validate(Reg(val_log=val_log), loader())
    ember.Trainer(**QUIET).validate(Reg(val_log=val_log), loader())
    assert modes == [True] * 3 + [False] * 3


def test_reload_dataloaders_every_n_epochs_asks_the_datamodule_again() -> None:
    dm = DM()
    ember.Trainer(max_epochs=4, reload_dataloaders_every_n_epochs=2, num_sanity_val_steps=0, **QUIET).fit(Reg(), dm)
    assert dm.train_calls == 2  # epochs 0 and 2
    once = DM()
    ember.Trainer(max_epochs=4, num_sanity_val_steps=0, **QUIET).fit(Reg(), datamodule=once)
    assert once.train_calls == 1


def test_benchmark_sets_cudnn_benchmark_and_conflicts_with_deterministic() -> None:
    was = torch.backends.cudnn.benchmark
    try:
        ember.Trainer(max_epochs=1, benchmark=True, **QUIET).fit(Reg(), loader())
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = was
    with pytest.raises(ValueError, match="deterministic"):
        ember.Trainer(benchmark=True, deterministic=True)


class TwoProcesses(Strategy):
    @property
    def world_size(self) -> int:
        return 2


def test_sync_batchnorm_on_cpu_processes_fails_before_training() -> None:
    class WithBN(Reg):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

    with pytest.raises(ValueError, match="GPUs only"):
        ember.Trainer(max_epochs=1, sync_batchnorm=True, strategy=TwoProcesses(), **QUIET).fit(WithBN(), loader())
    module = WithBN()
    ember.Trainer(max_epochs=1, sync_batchnorm=True, **QUIET).fit(module, loader())  # one process: nothing to sync
    assert type(module.bn) is nn.BatchNorm1d


def test_new_options_are_in_the_yaml_schema() -> None:
    from ember import config

    fields = {f for f in config.TrainerConfig.__dataclass_fields__}
    assert {"min_epochs", "min_steps", "overfit_batches", "inference_mode", "sync_batchnorm",
            "reload_dataloaders_every_n_epochs", "benchmark", "profiler"} <= fields  # fmt: skip


# --- DataModule: prepare_data and batch transfer ------------------------------------------------------------------


def test_prepare_data_runs_before_setup_on_local_rank_zero_only() -> None:
    dm = DM()
    ember.Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(Reg(), datamodule=dm)
    assert dm.calls == ["prepare_data", "setup:fit"]
    elsewhere = DM()
    ember.Trainer(max_epochs=1, num_sanity_val_steps=0, strategy=RankOne(), **QUIET).fit(Reg(), datamodule=elsewhere)
    assert elsewhere.calls == ["setup:fit"]


class Transfers(Reg):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, int]] = []

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return x * 0 + 1.0, y

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        x, y = batch
        return x + 1.0, y

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        self.seen.append((float(x.mean()), dataloader_idx))
        return x * 10, y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert torch.all(batch[0] == 20.0)  # (0 + 1 + 1) * 10
        return super().training_step(batch, batch_idx)


def test_batch_transfer_hooks_on_the_module() -> None:
    module = Transfers()
    ember.Trainer(max_epochs=1, **QUIET).fit(module, loader())
    assert module.seen == [(2.0, 0)] * 3
    module.seen.clear()
    ember.Trainer(**QUIET).validate(module, [loader(), loader()])
    assert module.seen == [(2.0, 0)] * 3 + [(2.0, 1)] * 3


def test_a_datamodules_transfer_hook_wins_over_the_modules() -> None:
    class Doubling(DM):
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            x, y = batch
            return x * 0 + 20.0, y  # what the module's step checks for

    module = Transfers()
    ember.Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(module, Doubling())
    assert module.seen == []  # the module's on_after_batch_transfer was not called


# --- seed_everything ----------------------------------------------------------------------------------------


class Draws(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([random.random(), float(torch.rand(()))])


class Predictor(ember.TrainingModule):
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return batch


def draws(workers: bool, rank: str = "0") -> torch.Tensor:
    os.environ["RANK"] = rank
    try:
        assert ember.seed_everything(42, workers=workers) == 42
        out = ember.Trainer(**QUIET).predict(Predictor(), DataLoader(Draws(), batch_size=1, num_workers=2))
    finally:
        del os.environ["RANK"]
    return torch.cat(out)


def test_seed_everything_workers_seeds_dataloader_workers_by_rank() -> None:
    try:
        seeded = draws(True)
        assert torch.equal(seeded, draws(True))  # repeats
        assert not torch.equal(seeded, draws(True, rank="1"))  # differs between processes
        assert torch.equal(draws(False), draws(False, rank="1"))  # torch alone: the same on every rank
    finally:
        ember.seed_everything(0)


# --- hooks ----------------------------------------------------------------------------------------------------


def test_lightning_module_hooks_with_an_ember_meaning_are_called() -> None:
    class Hooks(Reg):
        def __init__(self) -> None:
            super().__init__(val_log=lambda m, loss, i: m.modes.append(m.drop.training))
            self.drop = nn.Dropout(0.5)
            self.modes: list[bool] = []
            self.calls: list[str] = []

        def on_validation_model_eval(self) -> None:
            self.calls.append("model_eval")  # keeps dropout in train mode (MC dropout)

        def on_validation_model_train(self) -> None:
            self.calls.append("model_train")
            self.train()

        def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
            self.calls.append("zero_grad")

        def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.calls.append("val_batch_end")  # Lightning 2's signature with one dataloader

    module = Hooks()
    ember.Trainer(max_epochs=1, limit_train_batches=1, num_sanity_val_steps=0, **QUIET).fit(
        module, loader(), loader(n=4)
    )
    assert module.modes == [True]
    assert module.calls == ["zero_grad", "model_eval", "val_batch_end", "model_train"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("on_epoch_end", "Lightning hook that ember does not call .*on_train_epoch_end"),
        ("on_validation_model_zero_grad", "Lightning hook .*on_validation_start"),
        ("on_keyboard_interrupt", "on_exception"),
    ],
)
def test_lightning_only_hooks_are_refused_with_their_meaning_and_the_ember_way(name: str, message: str) -> None:
    module_class = type("Old", (Reg,), {name: lambda self, *args: None})
    with pytest.raises(AttributeError, match=message):
        ember.Trainer(max_epochs=1, **QUIET).fit(module_class(), loader())
    callback_class = type("OldCallback", (ember.Callback,), {name: lambda self, *args: None})
    with pytest.raises(AttributeError, match=message):
        ember.Trainer(max_epochs=1, callbacks=[callback_class()], **QUIET).fit(Reg(), loader())


def test_module_only_hooks_on_a_callback_are_refused() -> None:
    class Misplaced(ember.Callback):
        def on_validation_model_eval(self, trainer: Any, module: Any) -> None: ...

    with pytest.raises(AttributeError, match="define it on the module"):
        ember.Trainer(max_epochs=1, callbacks=[Misplaced()], **QUIET).fit(Reg(), loader())


def test_hooks_that_cannot_take_embers_arguments_fail_at_the_start() -> None:
    class OldBatchEnd(Reg):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int) -> None: ...

    with pytest.raises(TypeError, match="dropped dataloader_idx"):
        ember.Trainer(max_epochs=1, **QUIET).fit(OldBatchEnd(), loader())

    class NeedsIdx(Reg):
        def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int) -> None: ...

    with pytest.raises(TypeError, match="give it a default"):
        ember.Trainer(**QUIET).validate(NeedsIdx(), loader())


def test_clip_gradients_in_a_manual_step_under_16_mixed() -> None:
    class Clipped(Manual):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            x, y = batch
            self.manual_backward(F.mse_loss(self.layer(x), y))
            self.clip_gradients(opt, gradient_clip_val=10.0, gradient_clip_algorithm="value")  # unscales first
            self.max_grad = max(p.grad.abs().max() for p in self.parameters())
            opt.step()  # does not unscale a second time (GradScaler would raise)
            opt.zero_grad()

    module = Clipped()
    ember.Trainer(max_epochs=1, precision="16-mixed", **QUIET).fit(module, loader())
    assert 1e-2 < module.max_grad <= 10.0  # clipped in the unscaled space: scaled gradients are ~65536x larger


def test_toggle_optimizer_trains_only_that_optimizers_parameters() -> None:
    module = Reg()
    module.other = nn.Linear(3, 1)
    opt = torch.optim.SGD(module.layer.parameters(), lr=0.1)
    module.other.bias.requires_grad = False  # a frozen parameter stays frozen after untoggle
    with module.toggled_optimizer(opt):
        assert [p.requires_grad for p in module.parameters()] == [True, True, False, False]
    assert [p.requires_grad for p in module.parameters()] == [True, True, True, False]


def test_module_logger_print_and_trainer_checkpoint_callback(capsys: pytest.CaptureFixture[str]) -> None:
    recording = Recording()
    seen: list[Any] = []

    class Talks(Reg):
        def on_fit_start(self) -> None:
            seen.extend([self.logger, self.loggers])
            self.print("hello from process 0")

    trainer = ember.Trainer(max_epochs=1, **{**QUIET, "logger": recording, "enable_checkpointing": True})
    trainer.fit(Talks(), loader())
    assert seen == [recording, [recording]]
    assert "hello from process 0" in capsys.readouterr().out
    assert isinstance(trainer.checkpoint_callback, ModelCheckpoint)
    with pytest.raises(AttributeError, match=r"trainer\.module"):
        trainer.lightning_module  # noqa: B018


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("optimizer_step", "on_before_optimizer_step"),
        ("backward", "manual_backward"),
        ("configure_gradient_clipping", "gradient_clip_val"),
        ("configure_callbacks", r"Trainer\(callbacks="),
        ("lr_scheduler_step", "torch.optim.lr_scheduler"),
    ],
)
def test_lightning_module_methods_ember_does_not_call_are_refused(name: str, message: str) -> None:
    module_class = type("Old", (Reg,), {name: lambda self, *args: None})
    with pytest.raises(AttributeError, match=message):
        ember.Trainer(max_epochs=1, **QUIET).fit(module_class(), loader())


def test_configure_model_builds_layers_once_before_the_optimizers() -> None:
    class Late(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.built = 0
            self.layer: nn.Module | None = None

        def configure_model(self) -> None:
            self.built += 1
            if self.layer is None:
                self.layer = nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            assert self.layer is not None
            return F.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Late()
    trainer = ember.Trainer(max_epochs=1, **QUIET)
    trainer.fit(module, loader())
    trainer.fit(module, loader())
    assert module.built == 1 and trainer.global_step == 3

"""Every `configure_optimizers` form, scheduler stepping, its errors, and manual optimization."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau, StepLR
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.modules.optimizers import ManualOptimizer

TRAINER_KW = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)

LR = 0.1
BATCHES_PER_EPOCH = 3  # 10 samples in batches of 4, 4, 2


def loader(n: int = 10, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, generator=g)), batch_size=batch_size)


class Regressor(ember.TrainingModule):
    """Trains with the optimizers that `make_optimizers(self)` returns."""

    def __init__(self, make_optimizers: Callable[[Regressor], Any], log_fn: Callable | None = None) -> None:
        super().__init__()
        self.model = nn.Linear(3, 1)
        self.make_optimizers = make_optimizers
        self.log_fn = log_fn
        self.configured: Any = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x).squeeze(-1), y)
        if self.log_fn is not None:
            self.log_fn(self, batch_idx)
        return loss

    def validation_step(self, batch, batch_idx):
        if self.log_fn is not None:
            self.log_fn(self, batch_idx)

    def configure_optimizers(self):
        self.configured = self.make_optimizers(self)
        return self.configured


def count_steps(opt: torch.optim.Optimizer) -> list[int]:
    calls: list[int] = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    return calls


def fit(module: ember.TrainingModule, epochs: int, val: bool = False, **kw: Any) -> ember.Trainer:
    trainer = ember.Trainer(max_epochs=epochs, **{**TRAINER_KW, **kw})
    trainer.fit(module, loader(), loader() if val else None)
    return trainer


def sgd(m: nn.Module, lr: float = LR) -> torch.optim.SGD:
    return torch.optim.SGD(m.parameters(), lr=lr)


# --- optimizer forms ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "form",
    [
        lambda opt: opt,
        lambda opt: [opt],
        lambda opt: (opt,),
        lambda opt: {"optimizer": opt},
        lambda opt: {"optimizer": opt, "lr_scheduler": None},
        lambda opt: [{"optimizer": opt}],
    ],
    ids=["optimizer", "list", "tuple", "dict", "dict-none-scheduler", "list-of-dict"],
)
def test_optimizer_forms_without_scheduler(form):
    counts: dict[str, list[int]] = {}
    opts: list[torch.optim.Optimizer] = []

    def make(m):
        opt = sgd(m)
        opts.append(opt)
        counts["steps"] = count_steps(opt)
        return form(opt)

    module = Regressor(make)
    before = module.model.weight.detach().clone()
    trainer = fit(module, epochs=2)
    assert trainer.optimizers == opts
    assert trainer.lr_scheduler_configs == []
    assert len(counts["steps"]) == 2 * BATCHES_PER_EPOCH
    assert trainer.global_step == 2 * BATCHES_PER_EPOCH
    assert not torch.equal(before, module.model.weight)
    assert opts[0].param_groups[0]["lr"] == LR


def test_dict_with_scheduler_object_steps_once_per_epoch():
    def make(m):
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": StepLR(opt, step_size=1, gamma=0.5)}

    module = Regressor(make)
    trainer = fit(module, epochs=3)
    sched = module.configured["lr_scheduler"]
    assert sched.last_epoch == 3
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5**3)
    (config,) = trainer.lr_scheduler_configs
    assert config.scheduler is sched and config.interval == "epoch" and config.frequency == 1


@pytest.mark.parametrize(
    ("interval", "frequency", "epochs", "accumulate", "expected"),
    [
        ("step", 1, 2, 1, 6),
        ("step", 2, 2, 1, 3),
        ("step", 4, 2, 1, 1),  # after global steps 4 only
        ("step", 1, 2, 2, 4),  # 2 optimizer steps per epoch (windows of 2 and 1 batch)
        ("epoch", 1, 3, 1, 3),
        ("epoch", 2, 5, 1, 2),  # after epochs 2 and 4
        ("epoch", 3, 5, 1, 1),
    ],
)
def test_scheduler_dict_interval_and_frequency(interval, frequency, epochs, accumulate, expected):
    lambda_calls: list[int] = []

    def make(m):
        opt = sgd(m)
        sched = LambdaLR(opt, lambda n: lambda_calls.append(n) or 0.5**n)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": sched, "interval": interval, "frequency": frequency, "name": "lr"},
        }

    module = Regressor(make)
    trainer = fit(module, epochs=epochs, accumulate_grad_batches=accumulate)
    sched = module.configured["lr_scheduler"]["scheduler"]
    assert sched.last_epoch == expected
    assert len(lambda_calls) == expected + 1  # construction calls the lambda once
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5**expected)
    (config,) = trainer.lr_scheduler_configs
    assert (config.interval, config.frequency, config.name) == (interval, frequency, "lr")


def test_step_scheduler_stops_with_max_steps():
    def make(m):
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": StepLR(opt, 1, 0.5), "interval": "step"}}

    module = Regressor(make)
    trainer = ember.Trainer(max_steps=4, **TRAINER_KW)
    trainer.fit(module, loader())
    assert trainer.global_step == 4
    assert module.configured["lr_scheduler"]["scheduler"].last_epoch == 4  # step-interval: not stepped at epoch end


# --- ReduceLROnPlateau ------------------------------------------------------------------------------


def plateau_lrs(values: list[float], patience: int, factor: float) -> float:
    """The lr ReduceLROnPlateau(mode="min") reaches after stepping on `values` (hand simulation)."""
    lr, best, bad = LR, float("inf"), 0
    for v in values:
        if v < best * (1 - 1e-4):
            best, bad = v, 0
        else:
            bad += 1
        if bad > patience:
            lr *= factor
            bad = 0
    return lr


def test_plateau_hand_simulation():
    assert plateau_lrs([1.0] * 3, patience=1, factor=0.5) == pytest.approx(0.05)
    assert plateau_lrs([1.0] * 5, patience=1, factor=0.5) == pytest.approx(0.025)
    assert plateau_lrs([3.0, 2.0, 1.0], patience=0, factor=0.5) == pytest.approx(LR)


@pytest.mark.parametrize(("epochs", "expected_lr"), [(1, LR), (2, LR), (3, LR * 0.5), (4, LR * 0.5), (5, LR * 0.25)])
def test_plateau_on_val_metric_reduces_lr_after_patience(epochs, expected_lr):
    def log_fn(m, batch_idx):
        if not m.training:
            m.log("val/metric", 1.0)  # never improves

    def make(m):
        opt = sgd(m)
        sched = ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val/metric"}}

    module = Regressor(make, log_fn)
    trainer = fit(module, epochs=epochs, val=True)
    assert expected_lr == pytest.approx(plateau_lrs([1.0] * epochs, patience=1, factor=0.5))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected_lr)
    sched = module.configured["lr_scheduler"]["scheduler"]
    assert sched.last_epoch == epochs
    assert sched.best == 1.0


def test_plateau_uses_the_monitored_value():
    # val/metric improves every epoch (3, 2, 1): no reduction with patience=0 if the value is read
    def log_fn(m, batch_idx):
        if not m.training:
            m.log("val/metric", 3.0 - m.current_epoch)
            m.log("val/other", 1.0)

    def make(m):
        opt = sgd(m)
        sched = ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val/metric"}}

    module = Regressor(make, log_fn)
    trainer = fit(module, epochs=3, val=True)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR)
    assert module.configured["lr_scheduler"]["scheduler"].best == 1.0


def test_plateau_on_train_epoch_metric():
    """Monitoring a metric logged with on_epoch=True in training_step: the current epoch's value is used."""

    def log_fn(m, batch_idx):
        if m.training:
            m.log("train/metric", 5.0 - m.current_epoch, on_step=False, on_epoch=True)

    def make(m):
        opt = sgd(m)
        sched = ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "train/metric"}}

    module = Regressor(make, log_fn)
    trainer = fit(module, epochs=3)
    sched = module.configured["lr_scheduler"]["scheduler"]
    assert sched.best == 3.0  # the value of the last epoch
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR)


def test_plateau_with_step_interval_on_train_step_metric():
    def log_fn(m, batch_idx):
        if m.training:
            m.log("train/metric", 1.0)  # on_step by default; constant

    def make(m):
        opt = sgd(m)
        sched = ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=1)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": sched, "monitor": "train/metric", "interval": "step"},
        }

    module = Regressor(make, log_fn)
    trainer = fit(module, epochs=2)  # 6 steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(plateau_lrs([1.0] * 6, 1, 0.5))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.25)


def test_plateau_missing_monitor_is_value_error():
    def make(m):
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": ReduceLROnPlateau(opt)}

    with pytest.raises(ValueError, match="monitor"):
        fit(Regressor(make), epochs=1)

    def make_dict(m):
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": ReduceLROnPlateau(opt), "interval": "epoch"}}

    with pytest.raises(ValueError, match="monitor"):
        fit(Regressor(make_dict), epochs=1)


def test_plateau_monitor_not_logged():
    def make(strict):
        def inner(m):
            opt = sgd(m)
            sched = ReduceLROnPlateau(opt, patience=0)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": sched, "monitor": "val/nope", "strict": strict},
            }

        return inner

    with pytest.raises(KeyError, match="val/nope"):
        fit(Regressor(make(True)), epochs=1)
    module = Regressor(make(False))
    trainer = fit(module, epochs=3)  # skipped silently
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR
    assert module.configured["lr_scheduler"]["scheduler"].last_epoch == 0


# --- errors -----------------------------------------------------------------------------------------


def with_scheduler_dict(**extra: Any) -> Callable[[nn.Module], dict[str, Any]]:
    def make(m: nn.Module) -> dict[str, Any]:
        opt = sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": StepLR(opt, 1), **extra}}

    return make


@pytest.mark.parametrize(
    ("make", "hint"),
    [
        (lambda m: {"optimizer": sgd(m), "lr_schedular": None}, "did you mean 'lr_scheduler'?"),
        (lambda m: {"optimiser": sgd(m)}, "did you mean 'optimizer'?"),
        (with_scheduler_dict(intervall="step"), "did you mean 'interval'?"),
        (with_scheduler_dict(frequncy=2), "did you mean 'frequency'?"),
        (with_scheduler_dict(monitr="x"), "did you mean 'monitor'?"),
        (lambda m: [{"optimizer": sgd(m), "zzz": 1}], "valid keys: optimizer, lr_scheduler"),
    ],
    ids=["lr_schedular", "optimiser", "intervall", "frequncy", "monitr", "unrelated"],
)
def test_unknown_key_suggests_nearest(make, hint):
    with pytest.raises(ValueError, match="unknown key") as info:
        fit(Regressor(make), epochs=1)
    assert hint in str(info.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda m: [sgd(m), sgd(m)],
        lambda m: [{"optimizer": sgd(m)}, {"optimizer": sgd(m)}],
    ],
    ids=["list", "list-of-dicts"],
)
def test_two_optimizers_need_manual_optimization(make):
    module = Regressor(make)
    before = module.model.weight.detach().clone()
    with pytest.raises(ValueError, match="manual optimization") as info:
        fit(module, epochs=1)
    assert "automatic_optimization = False" in str(info.value)
    assert torch.equal(before, module.model.weight)


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        ([], ValueError, "empty"),
        ("sgd", TypeError, "must return an optimizer"),
        ({"lr_scheduler": None}, TypeError, "'optimizer' entry"),
    ],
)
def test_bad_configure_optimizers_values(value, exc, match):
    with pytest.raises(exc, match=match):
        fit(Regressor(lambda m: value), epochs=1)


@pytest.mark.parametrize(
    ("sched_dict", "match"),
    [
        ({"interval": "batch"}, "interval must be 'step' or 'epoch'"),
        ({"frequency": 0}, "frequency must be a positive int"),
        ({}, None),
    ],
)
def test_bad_scheduler_dict_values(sched_dict, match):
    make = with_scheduler_dict(**sched_dict)
    if match is None:
        fit(Regressor(make), epochs=1)
        return
    with pytest.raises(ValueError, match=match):
        fit(Regressor(make), epochs=1)


def test_scheduler_dict_without_scheduler():
    with pytest.raises(ValueError, match="'scheduler' entry"):
        fit(Regressor(lambda m: {"optimizer": sgd(m), "lr_scheduler": {"interval": "step"}}), epochs=1)


def test_missing_configure_optimizers():
    class NoOpt(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(3, 1)
            self.loss_fn = nn.MSELoss()

    with pytest.raises(NotImplementedError, match="configure_optimizers"):
        ember.Trainer(max_epochs=1, **TRAINER_KW).fit(NoOpt(), loader())


# --- manual optimization ----------------------------------------------------------------------------


class TwoNets(ember.TrainingModule):
    automatic_optimization = False

    def __init__(self, with_schedulers: bool = False, step_scheduler_a: bool = False) -> None:
        super().__init__()
        self.net_a = nn.Linear(3, 1)
        self.net_b = nn.Linear(3, 1)
        self.with_schedulers = with_schedulers
        self.step_scheduler_a = step_scheduler_a
        self.steps_seen: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        assert isinstance(opt_a, ManualOptimizer) and isinstance(opt_b, ManualOptimizer)
        start = self.global_step

        loss_a = F.mse_loss(self.net_a(x).squeeze(-1), y)
        opt_a.zero_grad()
        self.manual_backward(loss_a)
        assert self.net_a.weight.grad is not None
        opt_a.step()
        after_a = self.global_step

        loss_b = F.mse_loss(self.net_b(x).squeeze(-1), -y)
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        opt_b.step()
        self.steps_seen.append((start, after_a, self.global_step))
        self.log_dict({"train/loss_a": loss_a, "train/loss_b": loss_b})

    def on_train_epoch_end(self) -> None:
        if self.step_scheduler_a:
            sched_a, _ = self.lr_schedulers()
            sched_a.step()

    def configure_optimizers(self):
        opt_a = torch.optim.SGD(self.net_a.parameters(), lr=LR)
        opt_b = torch.optim.SGD(self.net_b.parameters(), lr=LR)
        self.raw = (opt_a, opt_b)
        if not self.with_schedulers:
            return [opt_a, opt_b]
        self.scheds = (StepLR(opt_a, 1, 0.5), StepLR(opt_b, 1, 0.5))
        return [
            {"optimizer": opt_a, "lr_scheduler": self.scheds[0]},
            {"optimizer": opt_b, "lr_scheduler": {"scheduler": self.scheds[1], "interval": "step"}},
        ]


def test_manual_optimization_two_optimizers():
    module = TwoNets()
    a0, b0 = module.net_a.weight.detach().clone(), module.net_b.weight.detach().clone()
    trainer = fit(module, epochs=2)
    assert not torch.equal(a0, module.net_a.weight)
    assert not torch.equal(b0, module.net_b.weight)
    batches = 2 * BATCHES_PER_EPOCH
    # every opt.step() counts as a global step
    assert trainer.global_step == 2 * batches
    assert module.steps_seen == [(2 * i, 2 * i + 1, 2 * i + 2) for i in range(batches)]
    assert trainer.callback_metrics.keys() >= {"train/loss_a", "train/loss_b"}


def test_manual_optimization_counts_real_optimizer_steps():
    module = TwoNets()
    counters: dict[str, list[int]] = {}
    original = module.configure_optimizers

    def configure():
        opts = original()
        counters["a"], counters["b"] = count_steps(opts[0]), count_steps(opts[1])
        return opts

    module.configure_optimizers = configure
    trainer = fit(module, epochs=1)
    assert len(counters["a"]) == len(counters["b"]) == BATCHES_PER_EPOCH
    assert trainer.global_step == 2 * BATCHES_PER_EPOCH
    wrappers = module.optimizers()
    assert [w.optimizer for w in wrappers] == list(module.raw)


def test_manual_optimization_max_steps_counts_every_optimizer_step():
    module = TwoNets()
    trainer = ember.Trainer(max_steps=4, **TRAINER_KW)
    trainer.fit(module, loader())
    assert trainer.global_step == 4
    assert len(module.steps_seen) == 2


def test_manual_optimization_list_of_dicts_schedulers_are_not_stepped_automatically():
    module = TwoNets(with_schedulers=True)
    trainer = fit(module, epochs=3)
    sched_a, sched_b = module.scheds
    assert module.lr_schedulers() == [sched_a, sched_b]
    assert sched_a.last_epoch == 0 and sched_b.last_epoch == 0
    assert [o.param_groups[0]["lr"] for o in module.raw] == [LR, LR]
    assert trainer.global_step == 2 * 3 * BATCHES_PER_EPOCH


def test_manual_optimization_user_steps_scheduler():
    module = TwoNets(with_schedulers=True, step_scheduler_a=True)
    fit(module, epochs=3)
    sched_a, sched_b = module.scheds
    assert sched_a.last_epoch == 3
    assert sched_b.last_epoch == 0
    assert module.raw[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5**3)
    assert module.raw[1].param_groups[0]["lr"] == LR


def test_manual_optimization_single_optimizer():
    class One(ember.TrainingModule):
        automatic_optimization = False

        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            assert isinstance(opt, ManualOptimizer)
            assert self.lr_schedulers() is None
            x, y = batch
            opt.zero_grad()
            self.manual_backward(F.mse_loss(self.model(x).squeeze(-1), y))
            opt.step()

        def configure_optimizers(self):
            return sgd(self)

    module = One()
    before = module.model.weight.detach().clone()
    trainer = fit(module, epochs=1)
    assert trainer.global_step == BATCHES_PER_EPOCH
    assert not torch.equal(before, module.model.weight)


def test_optimizers_and_manual_backward_outside_fit():
    module = TwoNets()
    with pytest.raises(RuntimeError, match="inside fit"):
        module.optimizers()
    with pytest.raises(RuntimeError, match="inside fit"):
        module.manual_backward(torch.zeros((), requires_grad=True))
    assert module.lr_schedulers() is None

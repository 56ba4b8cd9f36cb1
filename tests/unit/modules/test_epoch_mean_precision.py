"""Epoch means are exact to float32 rounding: they equal a float64 ``sum(loss * n) / N`` written by hand.

Accumulated in float32, a mean over a few hundred batches is off by several float32 units (up to 3e-6
on a loss near 5), enough to flip a plateau scheduler's or early stopping's decision on a near tie.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.modules.logging import MetricCollector

#: `TrainingModule.log`'s defaults, which the collector (it takes every argument) gets from the module.
LOG_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(ember.TrainingModule.log).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}


def log(collector: MetricCollector, name: str, value: object, **options: object) -> None:
    """``self.log(name, value, **options)`` as the module hands it to the collector."""
    arguments = {**LOG_DEFAULTS, **options}
    collector.log(
        name, value, *(arguments[key] for key in (
            "prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph", "sync_dist",
            "add_dataloader_idx", "batch_size",
        ))
    )  # fmt: skip


QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def float32_half_ulp(value: float) -> float:
    """Half the spacing of float32 numbers at `value`: what rounding the exact mean to float32 may cost."""
    return float(np.spacing(np.float32(abs(value)))) / 2


class Regression(ember.TrainingModule):
    """Records every logged loss and its batch size, as the float64 hand computation sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(8, 1)
        self.seen: dict[str, list[tuple[float, int]]] = {"train": [], "val": []}

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x).squeeze(-1), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        self.seen["train"].append((float(loss.detach()), len(batch[0])))
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        loss = self._loss(batch)
        self.log("val/loss", loss)
        if not self.trainer.sanity_checking:
            self.seen["val"].append((float(loss), len(batch[0])))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def hand_mean(pairs: list[tuple[float, int]]) -> float:
    """The script's epoch mean: float64 ``sum(loss * n) / N``."""
    return sum(loss * n for loss, n in pairs) / sum(n for _, n in pairs)


def data(n: int, seed: int, scale: float) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, scale * (x.sum(1) + torch.randn(n, generator=g)))


def test_fit_epoch_means_match_a_float64_hand_computation() -> None:
    # 3,001 samples in batches of 7 (the last holds 5): 429 batches; losses near 10 sum to ~3e4, where
    # float32 numbers are 0.002 apart.
    torch.manual_seed(0)
    module = Regression()
    train = DataLoader(data(3001, 0, 1.0), batch_size=7)
    val = DataLoader(data(3001, 1, 1.0), batch_size=7)
    trainer = ember.Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET)
    trainer.fit(module, train, val)
    for stage, key in (("train", "train/loss"), ("val", "val/loss")):
        expected = hand_mean(module.seen[stage])
        assert len(module.seen[stage]) == 429
        logged = trainer.callback_metrics[key]
        assert abs(logged - expected) <= float32_half_ulp(expected), (stage, logged, expected)


def test_validate_mean_matches_hand_computation_where_float32_accumulation_does_not() -> None:
    torch.manual_seed(1)
    module = Regression()
    val = DataLoader(data(4099, 2, 3.0), batch_size=13)
    (result,) = ember.Trainer(**QUIET).validate(module, val)
    expected = hand_mean(module.seen["val"])
    assert abs(result["val/loss"] - expected) <= float32_half_ulp(expected)
    # The same sums in float32 miss by more than that: the check above can fail.
    total = torch.zeros((), dtype=torch.float32)
    for loss, n in module.seen["val"]:
        total.add_(torch.tensor(loss, dtype=torch.float32), alpha=n)
    float32_mean = float(total / 4099)
    assert abs(float32_mean - expected) > float32_half_ulp(expected)


@pytest.mark.parametrize("reduce_fx", ["mean", "sum"])
def test_collector_accumulates_in_float64(reduce_fx: str) -> None:
    # 20,000 values around 1e3 with a small spread: a float32 running total loses the spread entirely.
    g = torch.Generator().manual_seed(3)
    values = (1000 + torch.rand(20_000, generator=g)).float()
    sizes = torch.randint(1, 64, (20_000,), generator=g).tolist()
    collector = MetricCollector()
    collector.start_epoch("validation")
    for value, size in zip(values, sizes, strict=True):
        log(collector, "val/x", value, on_step=None, on_epoch=None, reduce_fx=reduce_fx, batch_size=size)
    (result,) = collector.epoch_values().values()
    pairs = [(float(v), n) for v, n in zip(values, sizes, strict=True)]
    expected = hand_mean(pairs) if reduce_fx == "mean" else math.fsum(v for v, _ in pairs)
    assert abs(float(result) - expected) <= float32_half_ulp(expected)


def test_a_float32_total_from_an_older_checkpoint_keeps_accumulating_in_float64() -> None:
    collector = MetricCollector()
    collector.start_epoch("train")
    log(collector, "train/loss", torch.tensor(2.0), on_step=False, on_epoch=True, batch_size=3)
    state = collector.state_dict()
    state["entries"]["train/loss"]["total"] = state["entries"]["train/loss"]["total"].float()  # as saved before
    restored = MetricCollector()
    restored.load_state_dict(state)
    log(restored, "train/loss", torch.tensor(1.0), on_step=False, on_epoch=True, batch_size=1)
    (value,) = restored.epoch_values().values()
    assert value.dtype == torch.float64
    assert float(value) == (2.0 * 3 + 1.0) / 4


def test_accumulating_allocates_nothing_per_step() -> None:
    from torch.profiler import ProfilerActivity, profile

    collector = MetricCollector()
    collector.start_epoch("validation")
    loss = torch.tensor(0.25)
    log(collector, "val/loss", loss, batch_size=4)  # the first log creates the totals
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            log(collector, "val/loss", loss, batch_size=4)
    names = {event.name for event in prof.events()}
    assert "aten::add_" in names
    assert not {name for name in names if name.startswith(("aten::empty", "aten::to", "aten::_to_copy"))}, names
    assert float(collector.epoch_values()["val/loss"]) == 0.25


def _device_only_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """A stand-in for an NCCL all-reduce: it rejects host tensors (here the `meta` device plays the GPU)."""
    if tensor.device.type == "cpu":
        raise RuntimeError(f"all_reduce({op}): a CPU tensor on a device process group")
    return tensor


@pytest.mark.parametrize("reduce_fx", ["mean", "sum", "max", "min"])
def test_restored_totals_go_back_to_the_module_device(reduce_fx: str) -> None:
    saved = MetricCollector()
    saved.start_epoch("train")
    options = dict(on_step=False, on_epoch=True, reduce_fx=reduce_fx, sync_dist=True)
    log(saved, "train/loss", torch.tensor(2.0), batch_size=3, **options)
    state = saved.state_dict()  # a checkpoint is read onto the CPU: its totals are CPU tensors
    meta = torch.device("meta")
    restored = MetricCollector(reduce=_device_only_reduce, device=lambda: meta)
    restored.load_state_dict(state)
    entry = restored._entries["train/loss"]
    assert entry.total is not None and entry.total.device == meta
    assert entry.scratch is None  # no host buffer to copy each step's device value through
    assert entry.total.dtype == (torch.float64 if reduce_fx in ("mean", "sum") else torch.float32)
    log(restored, "train/loss", torch.ones((), device=meta), batch_size=1, **options)
    # The epoch value is all-reduced (sync_dist): every tensor reaching the reduce is on the device.
    (value,) = restored.epoch_values().values()
    assert value.device == meta


def test_restored_totals_on_the_cpu_keep_their_values_and_scratch() -> None:
    saved = MetricCollector()
    saved.start_epoch("train")
    log(saved, "train/loss", torch.tensor(2.0), on_step=False, on_epoch=True, batch_size=3)
    restored = MetricCollector(device=lambda: torch.device("cpu"))
    restored.load_state_dict(saved.state_dict())
    assert restored._entries["train/loss"].scratch is not None
    log(restored, "train/loss", torch.tensor(1.0), on_step=False, on_epoch=True, batch_size=1)
    (value,) = restored.epoch_values().values()
    assert float(value) == (2.0 * 3 + 1.0) / 4


def test_the_trainer_collectors_follow_the_strategy_device() -> None:
    from ember.strategies.strategy import Strategy

    trainer = ember.Trainer(strategy=Strategy(device="meta"), logger=False, enable_checkpointing=False)
    saved = MetricCollector()
    saved.start_epoch("train")
    log(saved, "train/loss", torch.tensor(2.0), on_step=False, on_epoch=True, batch_size=3)
    trainer.reporter.train_collector.load_state_dict(saved.state_dict())
    total = trainer.reporter.train_collector._entries["train/loss"].total
    assert total is not None and total.device.type == "meta"

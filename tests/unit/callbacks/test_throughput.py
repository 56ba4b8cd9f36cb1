"""ThroughputMonitor: rates agree with an independent count of batches and time, tokens, measured FLOPs and MFU,
training undisturbed.

The rate tests run twice: on a simulated clock (the monitor's `time` and the steps' sleeps), where the rates are
known exactly, and, marked `perf`, on the wall clock with 10% tolerance (a loaded machine can exceed it).
"""

from __future__ import annotations

import time
import types
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ThroughputMonitor
from ember.callbacks.throughput import count_tokens, measure_flops, peak_flops_per_s
from ember.loggers import Logger

QUIET: dict[str, Any] = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
BATCH, STEP_S = 4, 0.004


class Spy(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(step, m[name]) for step, m in self.calls if name in m]


class SimulatedClock:
    """Time that passes only in `sleep`: read by the monitor (in place of its `time` module) and by `Clock`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(params=["simulated", pytest.param("wall", marks=pytest.mark.perf)])
def clock(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The clock of a rate test, and the tolerance of its comparisons."""
    if request.param == "wall":
        return types.SimpleNamespace(perf_counter=time.perf_counter, sleep=time.sleep, rel=0.10)
    simulated = SimulatedClock()
    monkeypatch.setattr("ember.callbacks.throughput.time", simulated)
    return types.SimpleNamespace(perf_counter=simulated.perf_counter, sleep=simulated.sleep, rel=1e-9)


class Slow(ember.TrainingModule):
    """An MLP whose training steps take at least STEP_S and whose validation batches take `val_s` (of `clock`)."""

    def __init__(self, val_s: float = 0.0, dropout: float = 0.0, clock: Any = time) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 2))
        self.val_s = val_s
        self.sleep_s = STEP_S
        self.clock = clock

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.clock.sleep(self.sleep_s)
        x = batch["x"] if isinstance(batch, dict) else batch[0]
        return self.model(x).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.clock.sleep(self.val_s)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Clock(ember.Callback):
    """Independent count at the same points: batches started and the time (of `clock`) at each logged step."""

    def __init__(self, every: int, clock: Any) -> None:
        self.every = every
        self.clock = clock
        self.marks: list[tuple[float, int]] = []
        self.batches = 0
        self.validation_s = 0.0  # validation time in each window
        self.validation_in_window: list[float] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.marks.append((self.clock.perf_counter(), 0))

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        self.validation_s -= self.clock.perf_counter()

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self.validation_s += self.clock.perf_counter()

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if (trainer.global_step + 1) % self.every == 0:
            self.marks.append((self.clock.perf_counter(), self.batches))
            self.validation_in_window.append(self.validation_s)
            self.validation_s = 0.0

    def rates(self, with_validation: bool = False) -> list[float]:
        windows = zip(self.marks[:-1], self.marks[1:], self.validation_in_window, strict=True)
        return [(b1 - b0) / (t1 - t0 - (0 if with_validation else v)) for (t0, b0), (t1, b1), v in windows]


def loader(n_batches: int = 30) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n_batches * BATCH, 32, generator=g)), batch_size=BATCH)


def test_rates_agree_with_an_independent_count(clock: Any) -> None:
    spy, counted = Spy(), Clock(every=5, clock=clock)
    monitor = ThroughputMonitor()
    trainer = ember.Trainer(max_epochs=1, log_every_n_steps=5, logger=spy, callbacks=[monitor, counted], **QUIET)
    trainer.fit(Slow(clock=clock), loader(30))
    batches = spy.series("throughput/batches_per_s")
    samples = spy.series("throughput/samples_per_s")
    assert [step for step, _ in batches] == [4, 9, 14, 19, 24, 29]  # optimizer steps 5, 10, ...: rows N - 1
    for (_, logged), expected in zip(batches, counted.rates(), strict=True):
        assert logged == pytest.approx(expected, rel=clock.rel)
    if clock.rel < 0.01:  # simulated: every step takes STEP_S and nothing else takes time
        assert [rate for _, rate in batches] == pytest.approx([1 / STEP_S] * 6, rel=clock.rel)
    for (_, per_batch), (_, per_sample) in zip(batches, samples, strict=True):
        assert per_sample == pytest.approx(BATCH * per_batch, rel=1e-12)
    # the whole run: 30 batches over the span from train start to the last logged step
    (t0, _), (t1, n) = counted.marks[0], counted.marks[-1]
    mean_rate = n / sum(5 / rate for _, rate in batches)
    assert mean_rate == pytest.approx(n / (t1 - t0), rel=clock.rel)
    assert monitor.last["throughput/batches_per_s"] == batches[-1][1]
    assert "throughput/tokens_per_s" not in spy.calls[-1][1] and "throughput/mfu" not in spy.calls[-1][1]


def test_validation_time_is_left_out(clock: Any) -> None:
    spy, counted = Spy(), Clock(every=4, clock=clock)
    trainer = ember.Trainer(
        max_epochs=2,
        log_every_n_steps=4,
        num_sanity_val_steps=0,
        logger=spy,
        callbacks=[ThroughputMonitor(), counted],
        **QUIET,
    )
    trainer.fit(Slow(val_s=0.05, clock=clock), loader(10), loader(2))  # 100 ms of validation after steps 10 and 20
    rates = spy.series("throughput/batches_per_s")
    assert [step for step, _ in rates] == [3, 7, 11, 15, 19]  # optimizer steps 4, 8, ...
    assert [v > 0.09 for v in counted.validation_in_window] == [False, False, True, False, False]
    for (_, logged), expected in zip(rates, counted.rates(), strict=True):
        assert logged == pytest.approx(expected, rel=clock.rel)
    if clock.rel < 0.01:  # simulated: the window with validation in it has the others' rate
        assert [rate for _, rate in rates] == pytest.approx([1 / STEP_S] * 5, rel=clock.rel)
    assert rates[2][1] > 2 * counted.rates(with_validation=True)[2]  # counting validation would halve it at least


def test_tokens_from_dict_batches() -> None:
    rows = [{"x": torch.randn(32), "input_ids": torch.zeros(16, dtype=torch.long)} for _ in range(5 * BATCH)]
    spy = Spy()
    trainer = ember.Trainer(max_epochs=1, log_every_n_steps=5, logger=spy, callbacks=[ThroughputMonitor()], **QUIET)
    trainer.fit(Slow(), DataLoader(rows, batch_size=BATCH))
    ((_, last),) = spy.calls[-1:]
    assert last["throughput/tokens_per_s"] == pytest.approx(16 * last["throughput/samples_per_s"], rel=1e-12)
    assert count_tokens({"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}).item() == 3  # type: ignore[union-attr]
    assert count_tokens({"num_tokens": 7, "input_ids": torch.zeros(2, 5)}) == 7
    assert count_tokens({"input_ids": torch.zeros(2, 5)}) == 10
    assert count_tokens((torch.zeros(2, 5),)) is None


def test_flops_measured_on_the_example_input_and_mfu() -> None:
    module = Slow()
    module.example_input_array = torch.zeros(8, 32)
    spy = Spy()
    monitor = ThroughputMonitor(peak_flops_per_s=1e9)
    trainer = ember.Trainer(max_epochs=1, log_every_n_steps=5, logger=spy, callbacks=[monitor], **QUIET)
    trainer.fit(module, loader(10))
    # per sample: forward 2 * (32*64 + 64*2); backward: weight grads as much again, input grad of layer 2 only
    per_sample = 2 * (32 * 64 + 64 * 2) * 2 + 2 * 64 * 2
    ((_, last),) = spy.calls[-1:]
    assert last["throughput/flops_per_s"] == pytest.approx(per_sample * last["throughput/samples_per_s"], rel=1e-12)
    assert last["throughput/mfu"] == pytest.approx(last["throughput/flops_per_s"] / 1e9, rel=1e-12)


def test_known_flops_per_batch() -> None:
    spy = Spy()
    monitor = ThroughputMonitor(flops_per_batch=1e6, peak_flops_per_s=4e8)
    trainer = ember.Trainer(max_epochs=1, log_every_n_steps=5, logger=spy, callbacks=[monitor], **QUIET)
    trainer.fit(Slow(), loader(10))
    assert [step for step, _ in spy.series("throughput/mfu")] == [4, 9]
    ((_, last),) = [c for c in spy.calls if "throughput/mfu" in c[1]][-1:]
    assert last["throughput/flops_per_s"] == pytest.approx(1e6 * last["throughput/batches_per_s"], rel=1e-12)
    assert last["throughput/mfu"] == pytest.approx(1e6 * last["throughput/batches_per_s"] / 4e8, rel=1e-12)


def test_measuring_flops_leaves_training_unchanged() -> None:
    def train(monitor: bool) -> torch.Tensor:
        module = Slow(dropout=0.5)
        module.sleep_s = 0.0
        module.example_input_array = torch.randn(3, 32)
        callbacks = [ThroughputMonitor()] if monitor else []
        torch.manual_seed(123)
        ember.Trainer(max_epochs=1, logger=False, callbacks=callbacks, **QUIET).fit(module, loader(5))
        return module.model[0].weight.detach().clone()

    assert torch.equal(train(True), train(False))


def test_measure_flops_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = nn.Linear(16, 8)
        x = torch.randn(4, 16)
    assert measure_flops(lambda: model(x)) == 2 * 4 * 16 * 8
    assert measure_flops(lambda: model(x), lambda y: y.sum()) == 2 * (2 * 4 * 16 * 8)  # no input grad for x
    assert peak_flops_per_s(torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("device_name", "peak"),
    [
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 80GB HBM3", 989e12),  # the SXM card's name
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", 165.2e12),
        ("NVIDIA B9000 (unknown)", None),
    ],
)
def test_peak_flops_match_whole_model_names(
    monkeypatch: pytest.MonkeyPatch, device_name: str, peak: float | None
) -> None:
    from ember.callbacks.throughput import peak_flops_per_s

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: device_name)
    assert peak_flops_per_s(torch.device("cuda", 0), "bf16-mixed") == peak

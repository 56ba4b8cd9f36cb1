"""`ember.tuning.lr_find`: the schedule, smoothing and suggestion rule, early stopping, outputs, and that the
module, trainer and random streams come back bitwise."""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ember
from ember.tuning.lr_finder import LRFinderResult, lr_find, lr_schedule, smooth, suggest


def test_the_schedule_runs_from_min_to_max_like_numpy() -> None:
    np.testing.assert_allclose(lr_schedule(1e-6, 1.0, 7, "exponential"), np.logspace(-6, 0, 7), rtol=1e-12)
    np.testing.assert_allclose(lr_schedule(0.1, 0.5, 5, "linear"), np.linspace(0.1, 0.5, 5), rtol=1e-12)


@given(st.lists(st.floats(0.01, 100), min_size=1, max_size=40), st.floats(0.0, 0.99))
def test_smoothing_is_the_bias_corrected_moving_average(losses: list[float], beta: float) -> None:
    smoothed = smooth(losses, beta)
    for k in range(1, len(losses) + 1):  # the closed form: a weighted mean of the first k losses
        weights = [(1 - beta) * beta ** (k - i) for i in range(1, k + 1)]
        expected = sum(w * x for w, x in zip(weights, losses[:k], strict=True)) / sum(weights)
        assert math.isclose(smoothed[k - 1], expected, rel_tol=1e-9)
    if beta == 0.0:
        assert smoothed == pytest.approx(losses)


def test_the_suggestion_is_the_steepest_descent_in_log_lr() -> None:
    lrs = lr_schedule(1e-6, 1.0, 61, "exponential")
    x = np.log10(lrs)
    curve = 2.0 - np.tanh(2 * (x + 2.5))  # falls fastest at lr = 10**-2.5
    index = suggest(lrs, list(curve))
    assert index is not None and lrs[index] == pytest.approx(10**-2.5, rel=0.05)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.1, 10), min_size=8, max_size=60))
def test_the_suggestion_follows_the_documented_rule(smoothed: list[float]) -> None:
    lrs = lr_schedule(1e-5, 1.0, len(smoothed), "exponential")
    begin, end = max(1, len(smoothed) // 10), len(smoothed) - 1
    index = suggest(lrs, smoothed)
    if end - begin < 5:
        assert index is None
        return
    slope = np.gradient(np.asarray(smoothed[begin:end]), np.log10(lrs[begin:end]))
    assert index == begin + int(np.argmin(slope))


def test_too_short_a_curve_gives_no_suggestion() -> None:
    assert suggest([1e-3, 1e-2, 1e-1, 1.0], [1.0, 0.9, 0.8, 5.0]) is None


def test_each_step_uses_its_learning_rate_and_the_losses_are_the_steps(tiny: Any, tmp_path: Path) -> None:
    Net, Blobs, trainer = tiny

    class Recording(Net):
        seen: list[float] = []
        losses: list[float] = []

        def on_before_zero_grad(self, optimizer: Any) -> None:
            Recording.seen.append(optimizer.param_groups[0]["lr"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            Recording.losses.append(float(loss.detach()))
            return loss

    result = lr_find(
        trainer(default_root_dir=tmp_path), Recording(), datamodule=Blobs(), num_steps=20, max_lr=0.1, verbose=False
    )
    assert not result.stopped_early and len(result.lrs) == 20
    assert Recording.seen == pytest.approx(lr_schedule(1e-8, 0.1, 20, "exponential"), rel=1e-12)
    assert result.losses == pytest.approx(Recording.losses, rel=1e-6)
    assert result.smoothed == pytest.approx(smooth(result.losses, 0.98))
    assert result.suggestion_index == suggest(result.lrs, result.smoothed)
    assert result.override == f"module.lr={result.suggestion:.3g}"


def test_parameter_groups_keep_their_ratio(tiny: Any, tmp_path: Path) -> None:
    Net, Blobs, trainer = tiny

    class TwoGroups(Net):
        seen: list[tuple[float, float]] = []

        def configure_optimizers(self) -> Any:
            first, second = self.model[0].parameters(), self.model[4].parameters()
            return torch.optim.SGD([{"params": first, "lr": 0.1}, {"params": second, "lr": 0.01}], lr=0.1)

        def on_before_zero_grad(self, optimizer: Any) -> None:
            TwoGroups.seen.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"]))

    lr_find(trainer(default_root_dir=tmp_path), TwoGroups(), datamodule=Blobs(), num_steps=6, verbose=False)
    assert len(TwoGroups.seen) == 6
    for first, second in TwoGroups.seen:
        assert second == pytest.approx(first / 10, rel=1e-12)


def test_accumulation_records_one_loss_per_optimizer_step(tiny: Any, tmp_path: Path) -> None:
    Net, Blobs, trainer = tiny
    batch_losses: list[float] = []

    class Recording(Net):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            batch_losses.append(float(loss.detach()))
            return loss

    result = lr_find(
        trainer(default_root_dir=tmp_path, accumulate_grad_batches=2),
        Recording(),
        datamodule=Blobs(),
        num_steps=5,
        max_lr=1e-2,
        verbose=False,
    )
    assert len(result.losses) == 5 and len(batch_losses) == 10
    expected = [(batch_losses[2 * i] + batch_losses[2 * i + 1]) / 2 for i in range(5)]
    assert result.losses == pytest.approx(expected, rel=1e-6)


def test_a_diverging_loss_stops_the_test_early(tiny: Any, tmp_path: Path) -> None:
    Net, Blobs, trainer = tiny

    class Exploding(Net):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    result = lr_find(
        trainer(default_root_dir=tmp_path), Exploding(dropout=0.0), datamodule=Blobs(), num_steps=80,
        min_lr=1e-4, max_lr=1e4, verbose=False,
    )  # fmt: skip
    assert result.stopped_early and len(result.losses) < 80
    best = [min(result.smoothed[: k + 1]) for k in range(len(result.smoothed))]
    last = result.smoothed[-1]
    assert not math.isfinite(last) or last > 4 * best[-1]  # the rule that stopped it held at the last step
    for k in range(1, len(result.smoothed) - 1):  # and at no step before
        assert math.isfinite(result.smoothed[k]) and result.smoothed[k] <= 4 * best[k]


def _state(trainer: ember.Trainer, module: ember.TrainingModule) -> dict[str, Any]:
    return {
        "module": {k: v.clone() for k, v in module.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in module.parameters()],
        "optimizers": [_clone(o.state_dict()) for o in trainer.optimizers],
        "schedulers": [_clone(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs],
        "progress": trainer.progress.state_dict(),
        "modes": [m.training for m in module.modules()],
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
    }


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_everything_is_bitwise_as_before_after_a_fit(tiny: Any, tmp_path: Path) -> None:
    """After a fit (so the trainer holds optimizer, scheduler and counters), with the module half in eval mode."""
    Net, Blobs, make = tiny
    trainer, module, data = make(default_root_dir=tmp_path, max_epochs=2), Net(), Blobs()
    trainer.fit(module, datamodule=data)
    module.model[1].eval()  # a frozen BatchNorm must stay frozen
    module.model[0].weight.grad = torch.ones_like(module.model[0].weight)
    before, generator = _state(trainer, module), data.generator.get_state()
    # The trained model's loss is near zero and jumps between batches: no early stop, so 15 steps run.
    result = lr_find(trainer, module, datamodule=data, num_steps=15, divergence_factor=1e9, verbose=False)
    assert len(result.losses) == 15
    _assert_same(before, _state(trainer, module), "state")
    assert torch.equal(generator, data.generator.get_state())
    assert module._trainer is trainer


@pytest.mark.slow  # 3 s of CPU on a 2-core machine, with the processes it starts
def test_a_fit_after_the_finder_is_the_fit_without_it(tiny: Any, tmp_path: Path) -> None:
    """The differential check of "nothing changed": the same fit, bitwise, with and without lr_find first."""
    Net, Blobs, make = tiny

    def run(find: bool) -> dict[str, torch.Tensor]:
        ember.seed_everything(3)
        trainer, module, data = make(default_root_dir=tmp_path, max_epochs=2), Net(), Blobs()
        if find:
            lr_find(trainer, module, datamodule=data, num_steps=12, verbose=False)
        trainer.fit(module, datamodule=data)
        return module.state_dict()

    plain, after = run(False), run(True)
    for key in plain:
        assert torch.equal(plain[key], after[key]), key


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_dataloaders_passed_directly_get_their_generators_back(tiny: Any, tmp_path: Path) -> None:
    Net, Blobs, make = tiny
    loader = Blobs().train_dataloader()
    before = loader.generator.get_state()
    lr_find(make(default_root_dir=tmp_path), Net(), loader, num_steps=30, verbose=False)  # > one epoch
    assert torch.equal(before, loader.generator.get_state())


@pytest.mark.slow  # 2 s of CPU on a 2-core machine, with the processes it starts
def test_outputs_csv_png_and_tensorboard(tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Net, Blobs, make = tiny
    trainer = make(default_root_dir=tmp_path, logger=True)
    result = lr_find(trainer, Net(), datamodule=Blobs(), num_steps=25)
    assert result.run_dir == tmp_path / "net" / "version_0"
    with open(result.run_dir / "lr_find.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["lr"]) for r in rows] == result.lrs
    assert [float(r["loss_smoothed"]) for r in rows] == result.smoothed
    assert result.plot_path == result.run_dir / "lr_find.png"
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = EventAccumulator(str(result.run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    smoothed = [e.value for e in events.Scalars("lr_find/loss_smoothed")]
    assert smoothed == pytest.approx(result.smoothed, rel=1e-6)
    assert [e.step for e in events.Scalars("lr_find/lr")] == list(range(25))
    assert "lr_find/plot" in events.Tags()["images"]
    assert events.Scalars("lr_find/suggestion")[0].value == pytest.approx(result.suggestion, rel=1e-6)
    printed = capsys.readouterr().out
    assert f"use it with module.lr={result.suggestion:.3g}" in printed and str(result.plot_path) in printed
    for logger in trainer.loggers:  # the trainer's own loggers were neither attached to a run nor written
        with pytest.raises(RuntimeError, match="no save_dir yet"):
            _ = logger.log_dir


def test_the_plot_marks_the_suggestion(tiny: Any) -> None:
    lrs = lr_schedule(1e-5, 1.0, 30, "exponential")
    losses = [2.0 - math.tanh(math.log10(lr) + 2.5) for lr in lrs]
    result = LRFinderResult(lrs, losses, losses, suggest(lrs, losses), False, "exponential")
    figure = result.plot()
    (ax,) = figure.axes
    marker = [line for line in ax.get_lines() if line.get_label() == "suggestion"]
    assert len(marker) == 1 and marker[0].get_xdata()[0] == result.suggestion
    assert ax.get_xscale() == "log"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "cosine"}, "mode='cosine'"),
        ({"min_lr": 1.0, "max_lr": 0.1}, "0 < min_lr < max_lr"),
        ({"num_steps": 1}, "num_steps must be an int >= 2"),
        ({"beta": 1.0}, "beta=1.0"),
        ({"divergence_factor": 1.0}, "divergence_factor"),
    ],
)
def test_bad_options_say_what_to_change(tiny: Any, options: dict[str, Any], message: str) -> None:
    Net, Blobs, make = tiny
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lr_find(make(), Net(), datamodule=Blobs(), **options)

"""GradientMonitor logs the pre-clipping gradient norm; ParameterHistograms reach TensorBoard."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import GradientMonitor, ParameterHistograms
from ember.loggers import Logger, TensorBoardLogger

QUIET: dict[str, Any] = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
CLIP = 0.05


class Spy(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []
        self.histograms: list[tuple[int, dict[str, torch.Tensor]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))

    def log_histograms(self, values: dict[str, torch.Tensor], step: int) -> None:
        self.histograms.append((step, {k: v.clone() for k, v in values.items()}))

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(step, m[name]) for step, m in self.calls if name in m]


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = make_model()
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def raw_norms(steps: int) -> list[float]:
    """The same training in plain PyTorch; clip_grad_norm_ returns the norm before clipping."""
    model, loss_fn = make_model(), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for x, y in list(DataLoader(data(), batch_size=4))[:steps]:
        loss_fn(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return norms


def test_grad_norm_equals_the_norm_clip_grad_norm_sees_before_clipping() -> None:
    spy = Spy()
    monitor = GradientMonitor()
    trainer = ember.Trainer(
        max_epochs=1, gradient_clip_val=CLIP, log_every_n_steps=1, logger=spy, callbacks=[monitor], **QUIET
    )
    trainer.fit(Net(), DataLoader(data(), batch_size=4))
    expected = raw_norms(6)
    assert all(norm > CLIP for norm in expected)  # clipping really changed the gradients
    assert spy.series("train/grad_norm") == [(step - 1, expected[step - 1]) for step in range(1, 7)]  # row N - 1


def test_logging_steps_per_parameter_and_inf_norm() -> None:
    spy = Spy()
    monitor = GradientMonitor(norm_type=float("inf"), per_parameter=True)
    trainer = ember.Trainer(max_epochs=1, log_every_n_steps=3, logger=spy, callbacks=[monitor], **QUIET)

    grads: list[dict[str, torch.Tensor]] = []

    class Grab(ember.Callback):
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            grads.append({n: p.grad.clone() for n, p in module.named_parameters()})

    trainer.user_callbacks.append(Grab())
    trainer.fit(Net(), DataLoader(data(), batch_size=4))
    assert [step for step, _ in spy.series("train/grad_norm")] == [2, 5]  # optimizer steps 3 and 6
    for step, value in spy.series("train/grad_norm"):
        assert value == float(max(g.abs().max() for g in grads[step].values()))  # row N - 1: grads[N - 1]
    assert spy.series("grad_norm/model.0.weight") == [
        (step - 1, float(grads[step - 1]["model.0.weight"].abs().max())) for step in (3, 6)
    ]


def test_histograms_at_each_loggers_cadence() -> None:
    spy = Spy()
    spy.log_histograms_every_n_steps = 2
    trainer = ember.Trainer(max_epochs=1, logger=spy, **QUIET)
    trainer.fit(Net(), DataLoader(data(), batch_size=4))
    assert any(isinstance(cb, ParameterHistograms) for cb in trainer.callbacks)  # added by itself
    assert [step for step, _ in spy.histograms] == [1, 3, 5]  # optimizer steps 2, 4, 6: the scalars' rows
    names = set(spy.histograms[0][1])
    assert names == {
        f"{kind}/model.{i}.{p}" for kind in ("weights", "grads") for i in (0, 2) for p in ("weight", "bias")
    }


def test_tensorboard_histograms_read_back(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(tmp_path / "tb", log_histograms_every_n_steps=3)
    grads: dict[int, torch.Tensor] = {}

    class Grab(ember.Callback):
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            grads[trainer.global_step + 1] = module.model[0].weight.grad.clone()

    trainer = ember.Trainer(max_epochs=1, logger=tb, callbacks=[Grab()], **QUIET)
    trainer.fit(Net(), DataLoader(data(), batch_size=4))
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    events = acc.Histograms("grads/model.0.weight")
    assert [e.step for e in events] == [2, 5]  # optimizer steps 3 and 6
    for event in events:
        grad = grads[event.step + 1]  # optimizer step N's row is N - 1
        assert event.histogram_value.num == grad.numel() == 12
        assert event.histogram_value.sum == pytest.approx(float(grad.sum()), rel=1e-5, abs=1e-7)
        assert event.histogram_value.max == pytest.approx(float(grad.max()), rel=1e-6)
    assert "weights/model.2.bias" in acc.Tags()["histograms"]

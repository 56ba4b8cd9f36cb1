"""EMA: the average equals one computed by hand; evaluation sees it; training weights come back; state survives."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import EMA

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)


def loader(n: int = 12) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)), batch_size=3)


class Net(ember.TrainingModule):
    """Linear + BatchNorm, so parameters and floating buffers are both averaged."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)
        self.head = nn.Linear(2, 1)
        self.seen_in_validation: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layer(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == 0:
            self.seen_in_validation.append({k: v.clone() for k, v in self.state_dict().items()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class AfterStep(ember.Callback):
    """Records the float state (weights and running stats) after every optimizer step."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.states.append(
            {k: v.detach().clone().double() for k, v in module.state_dict().items() if v.is_floating_point()}
        )


def hand_ema(states: list[dict[str, torch.Tensor]], decays: list[float]) -> dict[str, torch.Tensor]:
    ema = dict(states[0])
    for state, decay in zip(states[1:], decays[1:], strict=True):
        ema = {k: decay * ema[k] + (1 - decay) * state[k] for k in ema}
    return ema


def test_average_equals_the_hand_computed_ema_and_validation_uses_it() -> None:
    record, ema = AfterStep(), EMA(decay=0.9)
    module = Net()
    trainer = ember.Trainer(max_epochs=2, num_sanity_val_steps=1, callbacks=[record, ema], **QUIET)
    trainer.fit(module, loader(), loader(3))
    assert ema.num_updates == 8 == len(record.states)
    expected = hand_ema(record.states, [0.9] * 8)
    averaged = ema.averaged
    assert set(averaged) == set(expected) and "norm.running_mean" in averaged
    for name, value in averaged.items():
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-6, atol=1e-7)
    # sanity check (before any update): training weights; each epoch-end validation: the average so far
    first_epoch = hand_ema(record.states[:4], [0.9] * 4)
    torch.testing.assert_close(module.seen_in_validation[1]["layer.weight"].double(), first_epoch["layer.weight"])
    torch.testing.assert_close(module.seen_in_validation[2]["head.bias"].double(), expected["head.bias"])
    # the training weights are back after validation, bit for bit
    for name, value in record.states[-1].items():
        assert torch.equal(module.state_dict()[name].double(), value), name


def test_every_n_steps_start_step_and_warmup() -> None:
    record, ema = AfterStep(), EMA(decay=0.99, every_n_steps=2, start_step=4, warmup=True)
    ember.Trainer(max_epochs=2, callbacks=[record, ema], **QUIET).fit(Net(), loader())
    # updates after steps 4, 6, 8; warm-up decays min(0.99, (1 + n) / (10 + n)) for n = 0, 1, 2
    states = [record.states[3], record.states[5], record.states[7]]
    expected = hand_ema(states, [0.0, 2 / 11, 3 / 12])
    assert ema.num_updates == 3
    torch.testing.assert_close(ema.averaged["layer.weight"].double(), expected["layer.weight"], rtol=1e-6, atol=1e-7)


def test_export_context_and_state_dict_leave_the_module_alone() -> None:
    record, ema = AfterStep(), EMA(decay=0.5, include_buffers=False)
    module = Net()
    ember.Trainer(max_epochs=1, callbacks=[record, ema], **QUIET).fit(module, loader())
    live = {k: v.clone() for k, v in module.state_dict().items()}
    exported = ema.averaged_state_dict(module)
    assert set(exported) == set(live)
    assert torch.equal(exported["layer.weight"], ema.averaged["layer.weight"])
    assert torch.equal(exported["norm.running_mean"], live["norm.running_mean"])  # buffers not averaged here
    assert "norm.running_mean" not in ema.averaged
    with ema.averaged_weights(module) as swapped:
        assert swapped is module and torch.equal(module.layer.weight, ema.averaged["layer.weight"])
    assert all(torch.equal(module.state_dict()[k], v) for k, v in live.items())


def test_state_round_trips_through_torch_save_and_the_average_continues() -> None:
    first, module = EMA(decay=0.8), Net()
    ember.Trainer(max_epochs=1, callbacks=[first], **QUIET).fit(module, loader())
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["num_updates"] == 4 and set(state["averaged"]) == set(first.averaged)

    resumed, record = EMA(decay=0.8), AfterStep()
    resumed.load_state_dict(state)
    assert resumed.state_dict()["averaged"].keys() == state["averaged"].keys()  # a save before fit keeps it
    ember.Trainer(max_epochs=1, callbacks=[record, resumed], **QUIET).fit(module, loader())
    assert resumed.num_updates == 8
    expected = hand_ema([{k: v.double() for k, v in state["averaged"].items()}, *record.states], [0.8] * 5)
    for name, value in resumed.averaged.items():
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-6, atol=1e-7)


def test_weights_come_back_after_a_failing_validation() -> None:
    class Failing(Net):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            raise RuntimeError("boom")

    record, ema, module = AfterStep(), EMA(decay=0.5), Failing()
    trainer = ember.Trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[record, ema], **QUIET)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(module, loader(), loader(3))
    assert torch.equal(module.layer.weight.double(), record.states[-1]["layer.weight"])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="decay"):
        EMA(decay=1.5)
    with pytest.raises(ValueError, match="every_n_steps"):
        EMA(every_n_steps=0)


def test_half_precision_weights_are_averaged_in_float32() -> None:
    layer = nn.Linear(3, 2).bfloat16()
    ema = EMA(decay=0.75)
    seen = []
    for _ in range(3):
        with torch.no_grad():
            layer.weight.add_(0.1)
        seen.append(layer.weight.detach().float().double())
        with ema.averaged_weights(layer):  # binds on first use
            pass
        ema.update()
    expected = hand_ema([{"w": s} for s in seen], [0.75] * 3)["w"]
    assert ema.averaged["weight"].dtype == torch.float32
    torch.testing.assert_close(ema.averaged["weight"].double(), expected, rtol=1e-6, atol=1e-7)

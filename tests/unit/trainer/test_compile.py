"""compile=True: in place (clean checkpoint keys), no recompiles after warm-up, loadable without compile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks.model_checkpoint import ModelCheckpoint


class Net(ember.TrainingModule):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(nn.Linear(4, hidden), nn.Dropout(0.1), nn.ReLU(), nn.Linear(hidden, 1))
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class GraphCount(ember.Callback):
    """Distinct graphs dynamo has compiled, read at each epoch end."""

    def __init__(self) -> None:
        self.per_epoch: list[int] = []

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        from torch._dynamo.utils import counters

        self.per_epoch.append(counters["stats"]["unique_graphs"])


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=8)


@pytest.mark.slow
def test_compile_in_place_without_recompiles_and_loadable_uncompiled(tmp_path: Path) -> None:
    torch._dynamo.reset()
    counter = GraphCount()
    trainer = ember.Trainer(
        max_epochs=3,
        compile=True,
        callbacks=[counter, ModelCheckpoint(dirpath=tmp_path / "ckpt")],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = Net()
    trainer.fit(module, loader(), loader())
    assert module.model._compiled_call_impl is not None  # default forward: the model is compiled, in place
    # Epoch 1 compiles the train and the eval graphs; later epochs reuse them.
    assert counter.per_epoch[0] >= 2
    assert counter.per_epoch == [counter.per_epoch[0]] * 3

    last = tmp_path / "ckpt" / (tmp_path / "ckpt" / "last").read_text().strip()
    plain = Net.load_from_checkpoint(last)
    assert plain.model._compiled_call_impl is None
    assert list(plain.state_dict()) == list(Net().state_dict())
    for a, b in zip(plain.parameters(), module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_compile_options_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown option 'fulgraph'; did you mean 'fullgraph'"):
        ember.Trainer(compile={"fulgraph": True})
    with pytest.raises(ValueError, match="mode='fast'"):
        ember.Trainer(compile={"mode": "fast"})
    with pytest.raises(TypeError, match="compile must be"):
        ember.Trainer(compile="yes")  # type: ignore[arg-type]


class DirectCall(Net):
    """Calls ``self.model`` in its step instead of ``self(x)``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.model(x), y)


class CustomForward(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) * 2


@pytest.mark.slow
@pytest.mark.parametrize(("cls", "compiled"), [(DirectCall, "model"), (CustomForward, "module")])
def test_compile_reaches_steps_that_call_the_model_and_custom_forwards(cls: type[Net], compiled: str) -> None:
    """A torch.nn container as ``self.model`` is compiled too (its own ``.compile()`` compiles nothing)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    module, eager = cls(), cls()
    eager.load_state_dict(module.state_dict())
    for m in (module, eager):
        m.model[1].p = 0.0  # compiled dropout draws other masks: compare without it
    options = {"max_epochs": 1, "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    ember.Trainer(compile=True, enable_checkpointing=False, **options).fit(module, loader())
    assert counters["stats"]["unique_graphs"] >= 1  # the step ran compiled code
    assert (module.model._compiled_call_impl is not None) == (compiled == "model")
    assert (module._compiled_call_impl is not None) == (compiled == "module")
    ember.Trainer(enable_checkpointing=False, **options).fit(eager, loader())
    for a, b in zip(module.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # compiled training matches eager training

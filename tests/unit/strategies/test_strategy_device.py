"""A `Strategy` instance passed to the Trainer goes where ``accelerator=`` says, or refuses a device that disagrees.

"CUDA available" is a stand-in here (``torch.cuda.is_available`` patched): these tests check which device the
strategy settles on when the Trainer is built, which needs no CUDA call; training on it is tests/gpu's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ember
from ember.strategies.strategy import Strategy


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def cuda_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.usefixtures("cuda_absent")
def test_a_strategy_instance_with_accelerator_cuda_and_no_cuda_fails_like_the_name_does(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as by_name:
        ember.Trainer(accelerator="cuda", default_root_dir=tmp_path)
    with pytest.raises(RuntimeError) as by_instance:
        ember.Trainer(strategy=Strategy(), accelerator="cuda", default_root_dir=tmp_path)
    assert str(by_instance.value) == str(by_name.value)
    assert "accelerator='cuda' but CUDA is not available here" in str(by_instance.value)


@pytest.mark.usefixtures("cuda_present")
@pytest.mark.parametrize("accelerator", ["cuda", "gpu", "auto"])
def test_a_default_strategy_instance_follows_the_accelerator_to_cuda(tmp_path: Path, accelerator: str) -> None:
    strategy = Strategy()
    trainer = ember.Trainer(strategy=strategy, accelerator=accelerator, default_root_dir=tmp_path)
    assert trainer.strategy is strategy
    assert strategy.root_device == torch.device("cuda", 0)
    assert strategy.batches_stay_put is False  # batches will be moved to it


@pytest.mark.usefixtures("cuda_present")
def test_accelerator_cpu_keeps_a_default_instance_on_the_cpu_even_with_cuda(tmp_path: Path) -> None:
    strategy = Strategy()
    ember.Trainer(strategy=strategy, accelerator="cpu", default_root_dir=tmp_path)
    assert strategy.root_device == torch.device("cpu") and strategy.batches_stay_put is True
    ember.Trainer(strategy=strategy, default_root_dir=tmp_path)  # a later "auto" (a tuner's run) keeps the choice
    assert strategy.root_device == torch.device("cpu")


@pytest.mark.usefixtures("cuda_present")
@pytest.mark.parametrize(("device", "accelerator"), [("cpu", "cuda"), ("cuda:1", "cpu"), ("cpu", "gpu")])
def test_an_instance_built_for_another_device_is_an_error_naming_both(
    tmp_path: Path, device: str, accelerator: str
) -> None:
    with pytest.raises(ValueError) as error:
        ember.Trainer(strategy=Strategy(device), accelerator=accelerator, default_root_dir=tmp_path)
    message = str(error.value)
    wanted = "cuda" if accelerator == "gpu" else accelerator
    assert f"strategy=Strategy(device='{device}') conflicts with accelerator='{wanted}'" in message
    assert "without a device" in message


@pytest.mark.usefixtures("cuda_present")
def test_an_instance_built_with_a_device_keeps_it_under_auto(tmp_path: Path) -> None:
    strategy = Strategy("cuda:1")
    ember.Trainer(strategy=strategy, default_root_dir=tmp_path)
    assert strategy.root_device == torch.device("cuda", 1)


@pytest.mark.usefixtures("cuda_absent")
def test_an_instance_built_for_cuda_without_cuda_says_so(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"Strategy\(device='cuda:0'\) but CUDA is not available here; build"):
        ember.Trainer(strategy=Strategy("cuda:0"), default_root_dir=tmp_path)


class Tiny(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(4, 1)
        self.loss_fn = nn.MSELoss()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_accelerator_cpu_with_a_default_instance_trains_on_the_cpu(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    module = Tiny()
    before = module.model.weight.detach().clone()
    trainer = ember.Trainer(
        strategy=Strategy(), accelerator="cpu", max_steps=2, default_root_dir=tmp_path, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == 2
    assert trainer.strategy.root_device == torch.device("cpu")
    assert module.model.weight.device.type == "cpu" and not torch.equal(module.model.weight.detach(), before)

"""`TrainingModule.freeze` / `unfreeze`: requires_grad and train/eval mode."""

from __future__ import annotations

from torch import nn

import ember


class Net(ember.TrainingModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))


def test_freeze_sets_requires_grad_false_and_eval_mode() -> None:
    net = Net()
    assert net.freeze() is net
    assert [p.requires_grad for p in net.parameters()] == [False] * 4
    assert not net.training and not any(m.training for m in net.modules())


def test_unfreeze_restores_training() -> None:
    net = Net().freeze()
    assert net.unfreeze() is net
    assert [p.requires_grad for p in net.parameters()] == [True] * 4
    assert net.training and all(m.training for m in net.modules())

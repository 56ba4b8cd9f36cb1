"""`optimizer_state_by_name` gives ``get_optimizer_state_dict``'s layout, and knows when to leave it to DCP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from ember.strategies.strategy import Strategy, optimizer_state_by_name


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


OPTIMIZERS: dict[str, Callable[[Net], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adamw groups": lambda m: torch.optim.AdamW(
        [{"params": m.a.parameters(), "lr": 1e-3}, {"params": m.b.parameters(), "lr": 1e-2, "weight_decay": 0.0}]
    ),
    "adam trainable only": lambda m: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_get_optimizer_state_dict(name: str) -> None:
    torch.manual_seed(0)
    module = Net()
    optimizer = OPTIMIZERS[name](module)
    for _ in range(3):
        module(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    mine = optimizer_state_by_name(module, optimizer)
    assert mine is not None
    assert same(mine, get_optimizer_state_dict(module, optimizer))
    assert mine["param_groups"][0]["params"][:2] == ["a.weight", "a.bias"]


def test_the_strategy_uses_it_for_plain_parameters() -> None:
    module = Net()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    assert same(Strategy().optimizer_state(module, optimizer), optimizer_state_by_name(module, optimizer))


def test_an_optimizer_without_state_is_saved_as_such_and_left_alone() -> None:
    """DCP's warm-up would step the live Adam once (step=1, zero moments); here it stays untouched."""
    module = Net()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    state = optimizer_state_by_name(module, optimizer)
    assert state is not None and state["state"] == {}
    assert len(optimizer.state) == 0 and all(p.grad is None for p in module.parameters())


def test_tied_weights_are_named_once() -> None:
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    optimizer = torch.optim.SGD(tied.parameters(), lr=0.1, momentum=0.9)
    tied(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    mine = optimizer_state_by_name(tied, optimizer)
    assert mine is not None and same(mine, get_optimizer_state_dict(tied, optimizer))
    assert "1.weight" not in mine["state"]


def test_leaves_it_to_dcp_when_it_cannot_name_a_parameter() -> None:
    module = Net()
    stranger = nn.Parameter(torch.zeros(3))
    assert optimizer_state_by_name(module, torch.optim.SGD([*module.parameters(), stranger], lr=0.1)) is None
    compiled_name = nn.Module()
    compiled_name._orig_mod = Net()  # the prefix torch.compile's wrapper inserts
    assert optimizer_state_by_name(compiled_name, torch.optim.SGD(compiled_name.parameters(), lr=0.1)) is None

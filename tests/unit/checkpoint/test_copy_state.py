"""`registry.copy_state`: the copy of state a snapshot keeps, safe from the live objects' later changes."""

from __future__ import annotations

import copy
from fractions import Fraction

import torch

from ember.checkpoint.registry import copy_state


def test_containers_are_rebuilt_tensors_cloned_and_immutable_values_shared() -> None:
    tensor = torch.tensor([1.0, 2.0])
    name = "step"
    state = {"lrs": [0.1, 0.2], "pair": (1, [2]), "total": tensor, "name": name, "none": None}
    copied = copy_state(state)
    assert copied == {"lrs": [0.1, 0.2], "pair": (1, [2]), "total": copied["total"], "name": "step", "none": None}
    assert torch.equal(copied["total"], tensor)
    state["lrs"].append(0.3)  # the live objects change in place after the snapshot
    state["pair"][1].append(3)
    tensor.add_(1)
    assert copied["lrs"] == [0.1, 0.2]
    assert copied["pair"] == (1, [2])
    assert copied["total"].tolist() == [1.0, 2.0]
    assert copied["name"] is name


def test_anything_else_is_deep_copied() -> None:
    class Counter:
        def __init__(self) -> None:
            self.seen = [Fraction(1, 3)]

    weight = torch.ones(2, requires_grad=True)  # a leaf that requires grad: deepcopy keeps it a leaf
    counter = Counter()
    copied = copy_state({"counter": counter, "weight": weight})
    counter.seen.append(Fraction(2, 3))
    assert copied["counter"].seen == [Fraction(1, 3)]
    assert copied["weight"].is_leaf and copied["weight"].requires_grad
    assert copied["weight"] is not weight
    assert copy_state([1, (2.0, "x")]) == copy.deepcopy([1, (2.0, "x")])

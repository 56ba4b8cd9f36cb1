"""`SnapshotPlan`: a snapshot taken through the plan is the one gathered afresh, the plan is rebuilt when the
model's structure changes, and its buffers hold the state of their moment (ember/checkpoint/snapshot_plan.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.checkpoint.registry import Snapshot, restore_snapshot
from ember.checkpoint.snapshot_plan import SnapshotPlan

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, max_epochs=1
)


class Net(ember.TrainingModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class ExtraState(nn.Linear):
    def get_extra_state(self) -> Any:
        return {"calls": 1}

    def set_extra_state(self, state: Any) -> None:
        pass


class AtBatches(ember.Callback):
    """Calls `action(trainer, module, batch_idx)` at the end of each batch in `at`."""

    def __init__(self, at: tuple[int, ...], action: Callable[[Any, Any, int], None]) -> None:
        self.at, self.action = at, action

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx in self.at:
            self.action(trainer, module, batch_idx)


def run(tmp_path: Path, at: tuple[int, ...], action: Callable[[Any, Any, int], None], module: Any = None) -> Any:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    module = module or Net()
    trainer = ember.Trainer(default_root_dir=str(tmp_path), callbacks=[AtBatches(at, action)], **QUIET)
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)))
    return module


def assert_same(planned: Snapshot, general: Snapshot) -> None:
    """Key for key, in the same order, byte for byte; the metadata and per-process state equal."""
    assert list(planned.tensors) == list(general.tensors)
    for key, tensor in general.tensors.items():
        assert planned.tensors[key].dtype == tensor.dtype, key
        assert torch.equal(planned.tensors[key], tensor), key
    assert planned.meta == general.meta
    assert _plain(planned.rank_state) == _plain(general.rank_state)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def test_a_planned_snapshot_equals_one_gathered_afresh_before_and_after_optimizer_state_appears(
    tmp_path: Path,
) -> None:
    plan, seen = SnapshotPlan(), []

    def compare(trainer: Any, module: Any, batch_idx: int) -> None:
        planned = trainer.snapshot(plan)
        assert_same(planned, trainer.snapshot({}))
        seen.append(sorted(k for k in planned.tensors if k.startswith("/optimizers")))

    for optimizer in ("sgd", "adamw"):
        seen.clear()
        run(tmp_path / optimizer, (0, 3, 5), compare, Net(optimizer))
        assert seen[0], optimizer  # the optimizer state the first step created is in the snapshot
        assert seen[0] == seen[-1]
    assert plan.builds == 2  # once per fit's module; the optimizer state appearing needs no rebuild


def test_the_plan_is_rebuilt_when_a_buffer_or_parameter_is_replaced_or_a_group_added(tmp_path: Path) -> None:
    plan, builds = SnapshotPlan(), []

    def change(trainer: Any, module: Any, batch_idx: int) -> None:
        if batch_idx == 2:  # a buffer replaced by a new tensor
            module.model[1].running_mean = torch.full((8,), 3.0)
        if batch_idx == 4:  # a new parameter and a param group for it
            module.extra = nn.Parameter(torch.full((2,), 7.0))
            trainer.optimizers[0].add_param_group({"params": [module.extra], "lr": 0.5})
        if batch_idx == 6:  # a parameter resized in place: same object, new buffer (the fit stops: it no longer fits)
            with torch.no_grad():
                module.model[3].bias.data = torch.full((3,), 5.0)
            trainer.should_stop = True
        planned = trainer.snapshot(plan)
        assert_same(planned, trainer.snapshot({}))
        builds.append(plan.builds)
        if batch_idx == 2:
            assert planned.tensors["/module/model.1.running_mean"].tolist() == [3.0] * 8
        if batch_idx == 4:
            assert planned.tensors["/module/extra"].tolist() == [7.0, 7.0]
            assert planned.meta["tensor_skeleton"]["optimizers"][0]["param_groups"][1]["params"] == ["extra"]
        if batch_idx == 6:
            assert planned.tensors["/module/model.3.bias"].tolist() == [5.0, 5.0, 5.0]

    run(tmp_path, (0, 1, 2, 3, 4, 6), change)
    assert builds == [1, 1, 2, 2, 3, 3]


def test_a_snapshot_is_not_changed_by_training_after_it_and_restores_bitwise(tmp_path: Path) -> None:
    plan, kept = SnapshotPlan(), {}

    def act(trainer: Any, module: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            kept["snapshot"] = trainer.snapshot(plan)
            kept["copy"] = {k: v.clone() for k, v in kept["snapshot"].tensors.items()}
            kept["state"] = {k: v.clone() for k, v in module.state_dict().items()}
            kept["momentum"] = [s["momentum_buffer"].clone() for s in trainer.optimizers[0].state.values()]
            return
        snapshot = kept["snapshot"]
        for key, tensor in kept["copy"].items():  # training went on: the snapshot's buffers did not follow it
            assert torch.equal(snapshot.tensors[key], tensor), key
        assert not torch.equal(module.model[0].weight, kept["state"]["model.0.weight"])
        restore_snapshot(trainer, module, snapshot)
        for key, tensor in module.state_dict().items():
            assert torch.equal(tensor, kept["state"][key]), key
        momentum = [s["momentum_buffer"] for s in trainer.optimizers[0].state.values()]
        assert all(torch.equal(a, b) for a, b in zip(momentum, kept["momentum"], strict=True))
        trainer.should_stop = True

    run(tmp_path, (1, 4), act)


def test_a_model_the_plan_cannot_describe_is_gathered_the_general_way(tmp_path: Path) -> None:
    plan = SnapshotPlan()
    module = Net()
    module.model[3] = ExtraState(8, 1)

    def compare(trainer: Any, module: Any, batch_idx: int) -> None:
        planned = trainer.snapshot(plan)
        assert_same(planned, trainer.snapshot({}))
        assert planned.meta["tensor_skeleton"]["module"]["model.3._extra_state"] == {"calls": 1}

    run(tmp_path, (0, 2), compare, module)
    assert plan.builds == 1 and plan.staging  # checked once; its buffers still reused


def test_the_one_walk_splits_and_copies_as_split_tensors_then_copy_state() -> None:
    from collections import OrderedDict, namedtuple

    from ember.checkpoint.format import split_tensors
    from ember.checkpoint.registry import copy_state
    from ember.checkpoint.snapshot_plan import _split_copy

    pair = namedtuple("pair", "a b")
    group = {"lr": 0.1, "betas": (0.9, 0.99), "tags": {"x"}, "params": ["w"], "scale": torch.tensor(2.0)}
    value = [{"state": OrderedDict(w={"m": torch.ones(2)}), "param_groups": [group]}, pair(torch.zeros(1), None)]
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split_copy(value, "/optimizers", {}, tensors)
    expected_skeleton, expected = split_tensors({"optimizers": value})
    assert skeleton == copy_state(expected_skeleton)["optimizers"]
    assert [type(x) for x in (skeleton[0]["state"], skeleton[1])] == [dict, tuple]  # as split_tensors rebuilds them
    assert (
        list(tensors)
        == list(expected)
        == ["/optimizers/0/state/w/m", "/optimizers/0/param_groups/0/scale", "/optimizers/1/0"]
    )
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert skeleton[0]["param_groups"][0]["tags"] is not group["tags"]  # a mutable leaf is deep-copied
    value[0]["state"]["w"]["m"].add_(1)
    assert tensors["/optimizers/0/state/w/m"].tolist() == [1.0, 1.0]  # copies, not the live tensors


def test_a_guard_lets_go_of_the_model_when_its_fit_ends_and_keeps_its_buffers(tmp_path: Path) -> None:
    from ember.callbacks import SpikeGuard

    guard = SpikeGuard(window=2, check_every_n_steps=2, snapshot_every_n_steps=2)
    module = Net()
    trainer = ember.Trainer(default_root_dir=str(tmp_path), callbacks=[guard], **QUIET)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer.fit(module, DataLoader(data, batch_size=8))
    plan = guard._plan
    assert plan.builds == 1 and {f"/module/{k}" for k in module.state_dict()} <= set(plan.staging)
    held = [value for value in vars(plan).values() if value is not plan.staging]
    live = [module, *module.parameters(), *module.buffers(), *trainer.optimizers]
    assert not any(obj is x for obj in live for x in _reachable(held))  # the plan let go of them
    again = ember.Trainer(default_root_dir=str(tmp_path), callbacks=[guard], **QUIET)
    again.fit(module, DataLoader(data, batch_size=8))  # a second fit walks the model again
    assert plan.builds == 2


def _reachable(values: list[Any]) -> list[Any]:
    """The objects in `values` and the lists, tuples and dicts they hold."""
    found, todo = [], list(values)
    while todo:
        value = todo.pop()
        found.append(value)
        if isinstance(value, list | tuple):
            todo += value
        elif isinstance(value, dict):
            todo += [*value.keys(), *value.values()]
    return found

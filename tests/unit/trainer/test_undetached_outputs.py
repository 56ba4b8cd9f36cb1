"""Outputs passed undetached to a lone ``on_train_batch_end`` marked `reads_outputs_undetached` (SpikeGuard's).

The loop saves the per-batch ``detach()`` only when the marked hook is the batch end's one implementation and the
step is the plain step (ember's own ``loss.backward()``, which frees the graph's saved tensors); every other hook,
and every other loop, gets the detached outputs Lightning's contract promises. The guard decides and trains
bitwise alike through both.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import SpikeGuard
from ember.callbacks.callback import reads_outputs_undetached

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "exactness"))
from rewind_workload import PoisonData, Regressor, batch_ids, loader, params

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, max_epochs=1
)


class Net(ember.TrainingModule):
    """Returns its loss as a tensor or in a dict; remembers what it returned and its saved activations."""

    def __init__(self, output: str = "tensor") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(4, 64), nn.Linear(64, 1)
        self.output = output
        self.returned: list[Any] = []
        self.activations: list[weakref.ref[Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        hidden = torch.relu(self.first(x))  # saved by relu's and the second layer's backward
        self.activations.append(weakref.ref(hidden))
        loss = nn.functional.mse_loss(self.second(hidden), y)
        out = {"loss": loss, "extra": 7} if self.output == "dict" else loss
        self.returned.append(out)
        return out

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Keeps(ember.Callback):
    """Keeps every `outputs` its batch end receives."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(outputs)


class KeepsUndetached(Keeps):
    @reads_outputs_undetached
    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(outputs)


class Unmarked(KeepsUndetached):
    """A subclass overriding the marked hook: its own hook is not marked."""

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)


def data(n: int = 32) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=8)


def fit(module: ember.TrainingModule, *callbacks: ember.Callback, root: Path, **options: Any) -> None:
    ember.Trainer(default_root_dir=str(root), callbacks=list(callbacks), **{**QUIET, **options}).fit(module, data())


@pytest.mark.parametrize("output", ["tensor", "dict"])
def test_a_lone_marked_hook_of_the_plain_loop_gets_the_outputs_as_returned(tmp_path: Path, output: str) -> None:
    module, hook = Net(output), KeepsUndetached()
    fit(module, hook, root=tmp_path)
    assert len(hook.seen) == len(module.returned) == 4
    for seen, returned in zip(hook.seen, module.returned, strict=True):
        assert seen is returned
        loss = seen if output == "tensor" else seen["loss"]
        assert loss.requires_grad and loss.grad_fn is not None


@pytest.mark.parametrize(
    ("callbacks", "options"),
    [
        pytest.param(lambda: [KeepsUndetached(), Keeps()], {}, id="two implementations"),
        pytest.param(lambda: [Unmarked()], {}, id="an unmarked override"),
        pytest.param(lambda: [Keeps()], {}, id="an unmarked hook"),
        pytest.param(lambda: [KeepsUndetached()], {"gradient_clip_val": 1.0}, id="clipping: not the plain step"),
        pytest.param(lambda: [KeepsUndetached()], {"accumulate_grad_batches": 2}, id="accumulation"),
    ],
)
@pytest.mark.parametrize("output", ["tensor", "dict"])
def test_every_other_hook_and_loop_gets_detached_outputs(
    tmp_path: Path, callbacks: Any, options: dict[str, Any], output: str
) -> None:
    module, hooks = Net(output), callbacks()
    fit(module, *hooks, root=tmp_path, **options)
    for hook in hooks:
        assert len(hook.seen) == 4
        for seen, returned in zip(hook.seen, module.returned, strict=True):
            assert type(seen) is dict and seen is not returned
            loss = returned if output == "tensor" else returned["loss"]
            assert not seen["loss"].requires_grad and seen["loss"].grad_fn is None
            assert torch.equal(seen["loss"], loss.detach())
            assert seen.get("extra") == (7 if output == "dict" else None)


def test_losses_kept_undetached_keep_no_saved_activation_alive(tmp_path: Path) -> None:
    """The plain step's backward frees what the graph saved: holding the loss holds no activation."""
    module, hook = Net(), KeepsUndetached()
    fit(module, hook, root=tmp_path)
    assert all(loss.grad_fn is not None for loss in hook.seen)  # every graph's nodes are still held
    module.returned.clear()
    assert [ref() for ref in module.activations] == [None] * 4


def test_the_guard_trains_and_decides_alike_with_detached_and_undetached_losses(tmp_path: Path) -> None:
    """The guard alone reads the losses undetached; beside another batch-end hook, detached. Both rewind at the
    same steps, leave out the same batches and end with the same weights, bitwise."""
    ids = batch_ids(24 * 4, 4)
    poison = frozenset(ids[9]) | frozenset(ids[17])

    class Spy(Regressor):
        kept_undetached: list[bool]

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            guard = next(cb for cb in self.trainer.callbacks if isinstance(cb, SpikeGuard))
            self.kept_undetached = getattr(self, "kept_undetached", [])
            self.kept_undetached += [loss.requires_grad for loss in guard._losses]
            return super().training_step(batch, batch_idx)

    runs = {}
    for name, extra in (("undetached", []), ("detached", [Keeps()])):
        guard = SpikeGuard(factor=50, window=4, warmup_steps=2, check_every_n_steps=2, snapshot_every_n_steps=2)
        module = Spy(lr=0.02)
        trainer = ember.Trainer(default_root_dir=str(tmp_path / name), callbacks=[guard, *extra], **QUIET)
        trainer.fit(module, loader(PoisonData(96, poison), 4))
        runs[name] = (module, guard)
    (plain, plain_guard), (general, general_guard) = runs["undetached"], runs["detached"]
    assert plain.kept_undetached and all(plain.kept_undetached)
    assert general.kept_undetached and not any(general.kept_undetached)
    assert [r["spike_step"] for r in plain_guard.rewinds] == [10, 16]  # 17 + 1, less the 2 left out before
    assert plain_guard.rewinds == general_guard.rewinds
    for a, b in zip(params(plain), params(general), strict=True):
        assert torch.equal(a, b)

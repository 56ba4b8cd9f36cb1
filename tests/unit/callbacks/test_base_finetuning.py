"""BaseFinetuning: a subclass written in Lightning's idiom trains as under Lightning, and resumes exactly.

The bodies below are mixins written once, as for Lightning; each test combines them with
``lightning.LightningModule`` / ``lightning.pytorch.callbacks.BaseFinetuning`` or with
``ember.TrainingModule`` / ``ember.callbacks.BaseFinetuning``. The backbone holds a BatchNorm layer;
the callback freezes the backbone with ``train_bn=False`` before training and unfreezes it at epoch 1.
32 samples in unshuffled batches of 8: 4 optimizer steps per epoch.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import checkpoint as ckpt
from ember.callbacks import BaseFinetuning
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.modules.freezing import freeze as ember_freeze

QUIET: dict[str, Any] = dict(
    logger=False,
    enable_progress_bar=False,
    enable_checkpointing=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)
STEPS_PER_EPOCH = 4


@pytest.fixture(autouse=True)
def _isolate_global_rng():
    py_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py_state)


def lightning() -> Any:
    return pytest.importorskip("lightning", reason="compares ember with Lightning; install it (the dev extra)")


# --- the bodies, in Lightning's idiom --------------------------------------------------------------------


class TransferBody:
    """A backbone with BatchNorm and a head; the optimizer takes the parameters that require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.step_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.step_losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


class FreezeUnfreezeBody:
    """Lightning's documented example: freeze the backbone, unfreeze it at `unfreeze_at_epoch`."""

    def __init__(self, unfreeze_at_epoch: int = 1) -> None:
        super().__init__()
        self._unfreeze_at_epoch = unfreeze_at_epoch

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.backbone, train_bn=False)  # type: ignore[attr-defined]

    def finetune_function(self, pl_module: Any, current_epoch: int, optimizer: Any) -> None:
        if current_epoch == self._unfreeze_at_epoch:
            self.unfreeze_and_add_param_group(  # type: ignore[attr-defined]
                modules=pl_module.backbone, optimizer=optimizer, train_bn=True
            )


def build(body: type, base: type, *args: Any) -> Any:
    """An instance of ``class <body>On<base>(body, base)``, its parameters drawn after ``torch.manual_seed(0)``."""
    cls = type(f"{body.__name__}On{base.__name__}", (body, base), {})
    torch.manual_seed(0)
    return cls(*args)


def train_loader(n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def outcome(module: Any, trainer: Any) -> dict[str, Any]:
    optimizer = trainer.optimizers[0]
    names = {p: n for n, p in module.named_parameters()}
    return {
        "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "groups": [[names[p] for p in g["params"]] for g in optimizer.param_groups],
        "lrs": [g["lr"] for g in optimizer.param_groups],
        "requires_grad": {n: p.requires_grad for n, p in module.named_parameters()},
        "bn": (module.backbone[1].training, module.backbone[1].track_running_stats),
        "global_step": trainer.global_step,
    }


def assert_same(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert mine["params"].keys() == theirs["params"].keys()
    for name, value in theirs["params"].items():
        assert torch.equal(mine["params"][name], value), f"{name} differs"
    for key in ("groups", "lrs", "requires_grad", "bn", "global_step"):
        assert mine[key] == theirs[key], key


# --- against Lightning -----------------------------------------------------------------------------------


def test_a_lightning_subclass_trains_bitwise_as_under_lightning() -> None:
    pl = lightning()
    from lightning.pytorch.callbacks import BaseFinetuning as LightningBaseFinetuning

    runs = {}
    for name, module_base, callback_base, trainer_cls in [
        ("lightning", pl.LightningModule, LightningBaseFinetuning, pl.Trainer),
        ("ember", ember.TrainingModule, BaseFinetuning, ember.Trainer),
    ]:
        module = build(TransferBody, module_base)
        callback = build(FreezeUnfreezeBody, callback_base)
        extra = {"devices": 1} if name == "lightning" else {}
        trainer = trainer_cls(accelerator="cpu", max_epochs=3, callbacks=[callback], **extra, **QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on num_workers and the missing validation
            trainer.fit(module, train_loader())
        runs[name] = (module.step_losses, outcome(module, trainer), callback.state_dict())

    (losses, ember_run, ember_state), (lightning_losses, lightning_run, lightning_state) = (
        runs["ember"],
        runs["lightning"],
    )
    assert len(losses) == len(lightning_losses) == 3 * STEPS_PER_EPOCH
    for i, (a, b) in enumerate(zip(losses, lightning_losses, strict=True)):
        assert torch.equal(a, b), f"step {i}: ember {a.item()!r} != Lightning {b.item()!r}"
    assert_same(ember_run, lightning_run)
    # The backbone joined at epoch 1 as a second group at a tenth of the head's rate then, and halved with it.
    assert ember_run["groups"] == [
        ["head.weight", "head.bias"],
        [f"backbone.{i}.{kind}" for i in (0, 1, 3) for kind in ("weight", "bias")],
    ]
    assert ember_run["lrs"] == [0.01 * 0.5**3, 0.01 * 0.5 / 10 * 0.5**2]
    assert ember_run["bn"] == (True, True)  # unfrozen: tracks statistics again; never put in eval mode
    # The state names the same groups, by parameter name.
    for state in (ember_state, lightning_state):
        groups = state["internal_optimizer_metadata"][0]
        assert [g["params"] for g in groups] == ember_run["groups"]


def test_the_hooks_run_where_lightning_runs_them_with_two_optimizers() -> None:
    """freeze_before_training before configure_optimizers; finetune_function per epoch, per optimizer."""
    pl = lightning()
    from lightning.pytorch.callbacks import BaseFinetuning as LightningBaseFinetuning

    class TwoOptimizers:
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.backbone = nn.Linear(6, 4)
            self.head = nn.Linear(4, 1)
            self.seen_at_configure: list[bool] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = F.mse_loss(self.head(self.backbone(x)), y)
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self) -> Any:
            self.seen_at_configure = [p.requires_grad for p in self.parameters()]
            return [torch.optim.SGD(self.head.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.2)]

    class Recording:
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int, float]] = []

        def freeze_before_training(self, pl_module: Any) -> None:
            self.calls.append(("freeze", -1, 0.0))
            self.freeze(pl_module.backbone)  # type: ignore[attr-defined]

        def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
            self.calls.append(("finetune", epoch, optimizer.param_groups[0]["lr"]))

    calls = {}
    for name, module_base, callback_base, trainer_cls in [
        ("lightning", pl.LightningModule, LightningBaseFinetuning, pl.Trainer),
        ("ember", ember.TrainingModule, BaseFinetuning, ember.Trainer),
    ]:
        module = build(TwoOptimizers, module_base)
        callback = build(Recording, callback_base)
        trainer = trainer_cls(accelerator="cpu", max_epochs=2, limit_train_batches=2, callbacks=[callback], **QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, train_loader())
        calls[name] = (callback.calls, module.seen_at_configure)
    assert calls["ember"] == calls["lightning"]
    assert calls["ember"] == (
        [("freeze", -1, 0.0), ("finetune", 0, 0.1), ("finetune", 0, 0.2), ("finetune", 1, 0.1), ("finetune", 1, 0.2)],
        [False, False, True, True],  # the backbone was frozen when configure_optimizers ran
    )


def nets() -> tuple[nn.Module, nn.Module]:
    """Two equal nets: BatchNorm layers in train and eval mode, nested in a ModuleDict and a ModuleList."""
    torch.manual_seed(0)
    net = nn.ModuleDict(
        {
            "stem": nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)),
            "blocks": nn.ModuleList([nn.BatchNorm2d(2).eval(), nn.Conv2d(2, 2, 1)]),
        }
    )
    other = nn.ModuleDict(
        {
            "stem": nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)),
            "blocks": nn.ModuleList([nn.BatchNorm2d(2).eval(), nn.Conv2d(2, 2, 1)]),
        }
    )
    other.load_state_dict(net.state_dict())
    return net, other


def flags(net: nn.Module) -> list[tuple[str, bool, bool | None, list[bool]]]:
    """Per submodule: name, training, track_running_stats (BatchNorm), requires_grad of its own parameters."""
    return [
        (name, m.training, getattr(m, "track_running_stats", None), [p.requires_grad for p in m.parameters(False)])
        for name, m in net.named_modules()
    ]


@pytest.mark.parametrize("train_bn", [False, True])
def test_freeze_leaves_modes_and_sets_batch_norm_flags_as_lightning_does(train_bn: bool) -> None:
    lightning()
    from lightning.pytorch.callbacks import BaseFinetuning as LightningBaseFinetuning

    net, lightning_net = nets()
    before = flags(net)
    BaseFinetuning.freeze(net, train_bn=train_bn)
    LightningBaseFinetuning.freeze(lightning_net, train_bn=train_bn)
    assert flags(net) == flags(lightning_net)
    bn1d, bn2d = net["stem"][1], net["blocks"][0]
    assert [m.training for m in net.modules()] == [t for _, t, _, _ in before]  # no mode changes
    assert (bn1d.training, bn2d.training) == (True, False)
    assert (bn1d.track_running_stats, bn2d.track_running_stats) == (train_bn, train_bn)
    assert [p.requires_grad for p in bn1d.parameters()] == [train_bn, train_bn]
    assert not any(p.requires_grad for p in net["stem"][0].parameters())
    # Unlike ember.modules.freezing.freeze, which puts the frozen module in eval mode:
    assert not any(m.training for m in ember_freeze(nets()[0]).modules())

    BaseFinetuning.make_trainable(net)
    LightningBaseFinetuning.make_trainable(lightning_net)
    assert flags(net) == flags(lightning_net)
    assert all(p.requires_grad for p in net.parameters()) and bn1d.track_running_stats and bn2d.track_running_stats


def test_the_static_helpers_agree_with_lightnings() -> None:
    lightning()
    from lightning.pytorch.callbacks import BaseFinetuning as LightningBaseFinetuning

    net, _ = nets()
    names = {p: n for n, p in net.named_parameters()}
    modules = {m: n for n, m in net.named_modules()}
    mine, theirs = BaseFinetuning.flatten_modules(net), LightningBaseFinetuning.flatten_modules(net)
    assert (
        [modules[m] for m in mine]
        == [modules[m] for m in theirs]
        == [
            "stem.0",
            "stem.1",
            "blocks.0",
            "blocks.1",
        ]
    )
    BaseFinetuning.freeze(net["stem"])
    for kwargs in ({}, {"train_bn": False}, {"requires_grad": False}, {"train_bn": False, "requires_grad": False}):
        ours = [names[p] for p in BaseFinetuning.filter_params([net["stem"], net["blocks"]], **kwargs)]
        assert ours == [names[p] for p in LightningBaseFinetuning.filter_params([net["stem"], net["blocks"]], **kwargs)]

    optimizer = torch.optim.SGD(net["blocks"].parameters(), lr=0.5)
    with pytest.warns(UserWarning, match="2 of the parameters to add are in a param group"):
        BaseFinetuning.unfreeze_and_add_param_group([net["stem"], net["blocks"][0]], optimizer)
    assert [[names[p] for p in g["params"]] for g in optimizer.param_groups] == [
        ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"],
        ["stem.0.weight", "stem.0.bias", "stem.1.weight", "stem.1.bias"],
    ]
    assert optimizer.param_groups[1]["lr"] == 0.05  # the first group's rate / initial_denom_lr
    BaseFinetuning.unfreeze_and_add_param_group(nn.Linear(2, 2), optimizer, lr=0.3, train_bn=False)
    assert optimizer.param_groups[2]["lr"] == 0.3


# --- exact resume ----------------------------------------------------------------------------------------


class Transfer(TransferBody, ember.TrainingModule):
    pass


class FreezeUnfreeze(FreezeUnfreezeBody, BaseFinetuning):
    pass


class StopAfter(ember.Callback):
    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen += 1
        if self.seen >= self.n:
            trainer.should_stop = True


def resume_fit(root: Path, stop_after: int | None = None, ckpt_path: Path | None = None) -> tuple[Any, ember.Trainer]:
    torch.manual_seed(0)
    module = Transfer()
    if ckpt_path is not None:  # nothing of the first half's process state may matter
        torch.manual_seed(999)
    callbacks: list[ember.Callback] = [FreezeUnfreeze(), ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)]
    if stop_after is not None:
        callbacks.append(StopAfter(stop_after))
    trainer = ember.Trainer(
        max_epochs=3,
        callbacks=callbacks,
        default_root_dir=root,
        run_name="finetune",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_loader(), ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.parametrize(
    "stop_after",
    [
        6,  # epoch 1, batch 1: two steps after the unfreeze
        8,  # the end of epoch 1: its scheduler stepped after the last batch, as in Lightning
        10,  # epoch 2, batch 1: the scheduler has halved the backbone group's rate since the unfreeze
    ],
    ids=["mid_epoch_after_unfreeze", "epoch_boundary_after_unfreeze", "an_epoch_later"],
)
def test_a_resume_after_the_unfreeze_is_bitwise_exact(tmp_path: Path, stop_after: int) -> None:
    full, full_trainer = resume_fit(tmp_path / "full")
    resume_fit(tmp_path / "split", stop_after=stop_after)
    last = ckpt.newest_valid(tmp_path / "split" / "finetune" / "version_0" / "checkpoints")
    assert last is not None and ckpt.read_meta(last)["state"]["progress"]["global_step"] == stop_after
    saved = ckpt.read_meta(last)["state"]["callbacks"]["FreezeUnfreeze"]
    assert saved["finetuned_epoch"] == (1 if stop_after <= 8 else 2)
    groups = saved["internal_optimizer_metadata"][0]
    assert [len(g["params"]) for g in groups] == [2, 6]
    assert groups[1]["lr"] == (0.0005 if stop_after < 8 else 0.00025)  # the rate when saved
    assert saved["trainability"] == {"frozen_parameters": [], "untracked_batch_norms": []}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, trainer = resume_fit(tmp_path / "split", ckpt_path=last)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "changed settings" in m or "BaseFinetuning" in m], messages

    assert trainer.global_step == full_trainer.global_step == 3 * STEPS_PER_EPOCH
    assert len(resumed.step_losses) == 3 * STEPS_PER_EPOCH - stop_after
    for i, (a, b) in enumerate(zip(resumed.step_losses, full.step_losses[stop_after:], strict=True)):
        assert torch.equal(a, b), f"step {stop_after + i}"
    assert_same(outcome(resumed, trainer), outcome(full, full_trainer))
    full_state = full_trainer.strategy.optimizer_state(full, full_trainer.optimizers[0])
    state = trainer.strategy.optimizer_state(resumed, trainer.optimizers[0])
    assert state["param_groups"] == full_state["param_groups"]
    for name, entry in full_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(state["state"][name][key], value), (name, key)

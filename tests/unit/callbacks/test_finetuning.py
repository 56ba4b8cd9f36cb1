"""BackboneFinetuning: freeze and unfreeze points, learning rates, schedulers, state, and exact resume.

The module under test has a plain ``nn.Module`` backbone (Linear, BatchNorm, Dropout) and a linear
head; its ``configure_optimizers`` takes the parameters that require grad, so the optimizer starts
with the head only. 32 samples in batches of 8: 4 optimizer steps per epoch.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import checkpoint as ckpt
from ember.callbacks import BackboneFinetuning
from ember.callbacks.finetuning import freeze, set_frozen_mode, unfreeze
from ember.callbacks.model_checkpoint import ModelCheckpoint

QUIET: dict[str, Any] = dict(
    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
)
LR, STEPS_PER_EPOCH = 0.01, 4


@pytest.fixture(autouse=True)
def _isolate_global_rng():
    py_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py_state)


def backbone_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2))


class Net(ember.TrainingModule):
    """A backbone (plain nn.Module) and a head; the optimizer gets the parameters that require grad."""

    def __init__(self, scheduler: str | None = None, all_params: bool = False) -> None:
        super().__init__()
        self.backbone = backbone_net()
        self.head = nn.Linear(8, 2)
        self.scheduler = scheduler
        self.all_params = all_params

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        params = list(self.parameters()) if self.all_params else [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=LR)
        if self.scheduler is None:
            return opt
        if self.scheduler == "step":
            sched: Any = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        else:  # closed form: base_lr * lambda(epoch), so base_lrs must gain an entry for the backbone group
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
        return {"optimizer": opt, "lr_scheduler": sched}


def loaders(n: int = 32) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    return train, DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8)


class Recorder(ember.Callback):
    """At the first batch of each epoch (after BackboneFinetuning acted): what trains, modes and learning rates."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, Any]] = []
        self.backbone_at_epoch_start: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx != 0:
            return
        opt = trainer.optimizers[0]
        self.epochs.append(
            {
                "epoch": trainer.current_epoch,
                "requires_grad": [p.requires_grad for p in module.backbone.parameters()],
                "backbone_training": module.backbone.training,
                "bn_training": module.backbone[1].training,
                "dropout_training": module.backbone[3].training,
                "head_training": module.head.training,
                "groups": [len(g["params"]) for g in opt.param_groups],
                "lrs": [g["lr"] for g in opt.param_groups],
            }
        )
        self.backbone_at_epoch_start.append({k: v.clone() for k, v in module.backbone.state_dict().items()})


def fit(callback: BackboneFinetuning, epochs: int = 4, **module_kw: Any) -> tuple[Net, Recorder, ember.Trainer]:
    torch.manual_seed(0)
    module, recorder = Net(**module_kw), Recorder()
    trainer = ember.Trainer(max_epochs=epochs, callbacks=[callback, recorder], num_sanity_val_steps=0, **QUIET)
    trainer.fit(module, *loaders())
    return module, recorder, trainer


# --- freeze / unfreeze on plain modules --------------------------------------------------------------


def test_freeze_stops_every_parameter_and_sets_eval_mode() -> None:
    net = backbone_net().train()
    assert freeze(net) is net
    assert not any(p.requires_grad for p in net.parameters())
    assert not any(m.training for m in net.modules())
    assert unfreeze(net) is net
    assert all(p.requires_grad for p in net.parameters())
    assert all(m.training for m in net.modules())


def test_freeze_with_train_bn_keeps_batch_norm_learning() -> None:
    net = freeze(backbone_net(), train_bn=True)
    assert [p.requires_grad for p in net.parameters()] == [False, False, True, True]  # Linear w, b; BN w, b
    assert [m.training for m in net] == [False, True, False, False]
    net.train()
    set_frozen_mode(net, train_bn=False)
    assert not any(m.training for m in net.modules())


# --- the schedule --------------------------------------------------------------------------------------


def test_frozen_until_the_unfreeze_epoch_then_trained_at_a_tenth_of_the_rate() -> None:
    callback = BackboneFinetuning(unfreeze_at_epoch=2)
    module, rec, trainer = fit(callback)
    frozen = {
        "requires_grad": [False] * 4,
        "backbone_training": False,
        "bn_training": False,
        "dropout_training": False,
        "head_training": True,
        "groups": [2],
        "lrs": [LR],
    }
    assert rec.epochs[0] == {"epoch": 0, **frozen}
    assert rec.epochs[1] == {"epoch": 1, **frozen}
    unfrozen = {"requires_grad": [True] * 4, "backbone_training": True, "bn_training": True, "dropout_training": True}
    assert rec.epochs[2] == {"epoch": 2, **unfrozen, "head_training": True, "groups": [2, 4], "lrs": [LR, LR / 10]}
    assert rec.epochs[3]["groups"] == [2, 4] and rec.epochs[3]["lrs"] == [LR, LR / 10]
    assert callback.unfrozen_at_epoch == 2
    assert callback.backbone_lr == pytest.approx(LR / 10)
    # While frozen nothing in the backbone moved, BatchNorm running statistics included (eval mode) ...
    for name, value in rec.backbone_at_epoch_start[0].items():
        assert torch.equal(value, rec.backbone_at_epoch_start[2][name]), name
    # ... and once unfrozen, it trains.
    final = module.backbone.state_dict()
    assert not torch.equal(final["0.weight"], rec.backbone_at_epoch_start[2]["0.weight"])
    assert not torch.equal(final["1.running_mean"], rec.backbone_at_epoch_start[2]["1.running_mean"])
    assert trainer.optimizers[0].state[module.backbone[0].weight]["step"] == 2 * STEPS_PER_EPOCH


@pytest.mark.parametrize("scheduler", ["step", "lambda"])
def test_the_backbone_group_follows_the_scheduler_at_its_ratio(scheduler: str) -> None:
    """Head lr halves every epoch; the backbone joins at epoch 2 at 0.1x and halves with it."""
    callback = BackboneFinetuning(unfreeze_at_epoch=2, lr_ratio=0.1)
    _, rec, _ = fit(callback, epochs=5, scheduler=scheduler)
    lrs = [e["lrs"] for e in rec.epochs]
    expected = [[LR], [LR / 2], [LR / 4, LR / 40], [LR / 8, LR / 80], [LR / 16, LR / 160]]
    assert [len(row) for row in lrs] == [len(row) for row in expected]
    for got, want in zip(lrs, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert callback.backbone_lr == pytest.approx(LR / 40)


def test_an_absolute_backbone_lr_and_unfreezing_at_epoch_zero() -> None:
    callback = BackboneFinetuning(unfreeze_at_epoch=0, backbone_lr=1e-4)
    _, rec, _ = fit(callback, epochs=2)
    assert [e["lrs"] for e in rec.epochs] == [[LR, 1e-4], [LR, 1e-4]]
    assert rec.epochs[0]["requires_grad"] == [True] * 4 and rec.epochs[0]["bn_training"]
    assert callback.unfrozen_at_epoch == 0


def test_train_bn_trains_batch_norm_while_the_rest_is_frozen() -> None:
    callback = BackboneFinetuning(unfreeze_at_epoch=2, train_bn=True)
    _, rec, _ = fit(callback, epochs=3)
    first = rec.epochs[0]
    assert first["requires_grad"] == [False, False, True, True]
    assert (first["backbone_training"], first["bn_training"], first["dropout_training"]) == (False, True, False)
    assert first["groups"] == [4]  # head weight and bias + BatchNorm weight and bias
    assert rec.epochs[2]["groups"] == [4, 2]  # only the Linear layer was left to add
    before, after = rec.backbone_at_epoch_start[0], rec.backbone_at_epoch_start[2]
    assert torch.equal(before["0.weight"], after["0.weight"])
    assert not torch.equal(before["1.weight"], after["1.weight"])
    assert not torch.equal(before["1.running_mean"], after["1.running_mean"])


def test_a_dotted_backbone_path_and_a_training_module_backbone() -> None:
    class Inner(ember.TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = backbone_net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    class Outer(Net):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.encoder = Inner()
            del self.backbone

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.model.encoder(x))

    callback = BackboneFinetuning(unfreeze_at_epoch=1, backbone_attr="model.encoder")
    torch.manual_seed(0)
    module = Outer()
    seen: list[tuple[bool, bool]] = []

    class Watch(ember.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            encoder = module.model.encoder
            seen.append((encoder.layers[0].weight.requires_grad, encoder.training))

    trainer = ember.Trainer(max_epochs=2, callbacks=[callback, Watch()], num_sanity_val_steps=0, **QUIET)
    trainer.fit(module, loaders()[0])
    assert seen == [(False, False)] * STEPS_PER_EPOCH + [(True, True)] * STEPS_PER_EPOCH
    assert callback.state_key == "BackboneFinetuning[backbone=model.encoder]"


def test_parameters_already_in_the_optimizer_are_not_added_twice() -> None:
    callback = BackboneFinetuning(unfreeze_at_epoch=1)
    with pytest.warns(RuntimeWarning, match="already holds every parameter of 'backbone'"):
        _, rec, _ = fit(callback, epochs=2, all_params=True)
    assert [e["groups"] for e in rec.epochs] == [[6], [6]]
    assert rec.epochs[1]["requires_grad"] == [True] * 4


def test_a_missing_backbone_is_an_error_naming_the_submodules() -> None:
    with pytest.raises(AttributeError, match=r"has no such attribute; its submodules are \['backbone', 'head'\]"):
        fit(BackboneFinetuning(backbone_attr="encoder"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"unfreeze_at_epoch": -1}, "use 0 or more"),
        ({"lr_ratio": 0.0}, "positive ratio"),
        ({"backbone_lr": -1.0}, "a learning rate is >= 0"),
    ],
)
def test_bad_options_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BackboneFinetuning(**kwargs)


def test_state_round_trip() -> None:
    callback = BackboneFinetuning(unfreeze_at_epoch=1)
    assert callback.state_key == "BackboneFinetuning[backbone=backbone]"
    assert callback.state_dict() == {"unfrozen_at_epoch": None, "backbone_lr": None}
    fit(callback, epochs=2)
    state = callback.state_dict()
    assert state == {"unfrozen_at_epoch": 1, "backbone_lr": pytest.approx(LR / 10)}
    fresh = BackboneFinetuning(unfreeze_at_epoch=1)
    fresh.load_state_dict(state)
    assert (fresh.unfrozen_at_epoch, fresh.backbone_lr, fresh.is_unfrozen) == (1, state["backbone_lr"], True)


# --- exact resume ----------------------------------------------------------------------------------------


class StopAfter(ember.Callback):
    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.seen += 1
        if self.seen >= self.n:
            trainer.should_stop = True


def _resume_fit(
    root: Path, stop_after: int | None = None, ckpt_path: str | Path | None = None
) -> tuple[Net, ember.Trainer, BackboneFinetuning, Recorder]:
    torch.manual_seed(1234)
    module = Net(scheduler="lambda")
    if ckpt_path is not None:  # nothing of the first half's process state may matter
        torch.manual_seed(999)
        random.seed(5)
    callback, recorder = BackboneFinetuning(unfreeze_at_epoch=2, lr_ratio=0.1), Recorder()
    callbacks: list[ember.Callback] = [callback, recorder, ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)]
    if stop_after is not None:
        callbacks.append(StopAfter(stop_after))
    trainer = ember.Trainer(
        max_epochs=4,
        callbacks=callbacks,
        default_root_dir=root,
        run_name="finetune",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, *loaders(), ckpt_path=ckpt_path)
    return module, trainer, callback, recorder


def _optimizer_state(trainer: ember.Trainer) -> dict[str, Any]:
    return trainer.strategy.optimizer_state(trainer.module, trainer.optimizers[0])


@pytest.mark.parametrize(
    ("stop_after", "checkpoint_step"),
    [
        (10, 10),  # epoch 2, batch 1: the backbone has been training for two steps
        (6, 6),  # epoch 1, batch 1: still frozen; the resumed run unfreezes at epoch 2
        (8, 8),  # the end of epoch 1, just before the unfreeze
    ],
    ids=["mid_finetuning", "mid_frozen", "just_before_unfreeze"],
)
def test_resume_is_bitwise_exact(tmp_path: Path, stop_after: int, checkpoint_step: int) -> None:
    full, full_trainer, full_cb, full_rec = _resume_fit(tmp_path / "full")

    _resume_fit(tmp_path / "split", stop_after=stop_after)
    checkpoints = tmp_path / "split" / "finetune" / "version_0" / "checkpoints"
    last = ckpt.newest_valid(checkpoints)
    assert last is not None
    assert ckpt.read_meta(last)["state"]["progress"]["global_step"] == checkpoint_step
    resumed, trainer, callback, rec = _resume_fit(tmp_path / "split", ckpt_path=last)

    assert trainer.global_step == full_trainer.global_step == 16
    for name, value in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    assert (callback.unfrozen_at_epoch, callback.backbone_lr) == (full_cb.unfrozen_at_epoch, full_cb.backbone_lr)
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [
        g["lr"] for g in full_trainer.optimizers[0].param_groups
    ]
    full_state, state = _optimizer_state(full_trainer), _optimizer_state(trainer)
    assert state["param_groups"] == full_state["param_groups"]
    assert state["state"].keys() == full_state["state"].keys()
    for name, entry in full_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(state["state"][name][key], value), (name, key)
    # The epochs the resumed run trained from their start look as in the uninterrupted run.
    assert rec.epochs == full_rec.epochs[-len(rec.epochs) :]


def test_a_checkpoint_saved_after_the_unfreeze_holds_both_groups(tmp_path: Path) -> None:
    _resume_fit(tmp_path, stop_after=9)
    path = ckpt.newest_valid(tmp_path / "finetune" / "version_0" / "checkpoints")
    assert path is not None
    meta = ckpt.read_meta(path)
    assert meta["state"]["callbacks"]["BackboneFinetuning[backbone=backbone]"] == {
        "unfrozen_at_epoch": 2,
        "backbone_lr": pytest.approx(LR / 40),
    }
    assert meta["state"]["lr_schedulers"][0]["base_lrs"] == pytest.approx([LR, LR / 10])

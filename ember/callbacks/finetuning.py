"""`BackboneFinetuning`: train a new head on a frozen backbone, then unfreeze the backbone at a lower rate.

The usual transfer-learning schedule:

1. when fit starts, the backbone (``module.<backbone_attr>``) is frozen: ``requires_grad=False`` and
   eval mode, so BatchNorm keeps the running statistics it was pretrained with and Dropout is off;
2. the module's ``configure_optimizers`` trains what is left (the head), e.g. over
   ``[p for p in self.parameters() if p.requires_grad]`` or over ``self.head.parameters()``;
3. at the start of epoch ``unfreeze_at_epoch`` the backbone is unfrozen and its parameters join the
   running optimizer as a new parameter group, with ``backbone_lr`` or ``lr_ratio`` times the
   optimizer's current learning rate. Schedulers of that optimizer take the group in, scaled the
   same way.

Resuming is exact: the callback's state (the epoch it unfroze at and the backbone rate) is
checkpointed, and on resume the parameter group is added back in ``on_load_checkpoint``, before
ember loads the optimizer state (the rebuilt optimizer holds the head only).

`freeze` and `unfreeze` (from `ember.modules.freezing`) work on any ``nn.Module``
(``TrainingModule.freeze()``/``unfreeze()`` do the same for a whole TrainingModule).
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from ember.callbacks.callback import Callback
from ember.modules.freezing import freeze, set_frozen_mode, unfreeze

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


class BackboneFinetuning(Callback):
    """Freeze ``module.<backbone_attr>`` when fit starts; unfreeze it at epoch `unfreeze_at_epoch`.

    - ``unfreeze_at_epoch``: 0-based epoch at whose start the backbone joins training
      (0: it trains from the first step, at the lower rate).
    - ``backbone_lr``: the backbone group's learning rate; when None it is ``lr_ratio`` times the
      optimizer's current learning rate (of its first parameter group) at the unfreeze.
    - ``backbone_attr``: attribute path of the backbone on the module (``"backbone"``,
      ``"model.encoder"``); a plain ``nn.Module`` or a TrainingModule.
    - ``train_bn``: keep the frozen backbone's BatchNorm layers training (default False: the whole
      backbone is in eval mode while frozen, so its running statistics stay as pretrained).
    - ``optimizer_idx``: which optimizer of ``configure_optimizers`` receives the backbone.

    Parameters of the backbone already held by the optimizer are not added twice. After fit,
    `unfrozen_at_epoch` and `backbone_lr` say what happened (None while the backbone is frozen).
    A scheduler of that optimizer is extended with the new group: its per-group lists
    (``base_lrs``, LambdaLR's ``lr_lambdas``, ReduceLROnPlateau's ``min_lrs``) and the group's
    per-group keys (``initial_lr``, OneCycleLR's ``max_lr``...) are those of the first group, with
    learning rates scaled by the backbone's ratio.
    """

    def __init__(
        self,
        unfreeze_at_epoch: int = 10,
        backbone_lr: float | None = None,
        lr_ratio: float = 0.1,
        backbone_attr: str = "backbone",
        train_bn: bool = False,
        optimizer_idx: int = 0,
    ) -> None:
        if unfreeze_at_epoch < 0:
            raise ValueError(f"BackboneFinetuning(unfreeze_at_epoch={unfreeze_at_epoch}): use 0 or more")
        if backbone_lr is not None and backbone_lr < 0:
            raise ValueError(f"BackboneFinetuning(backbone_lr={backbone_lr}): a learning rate is >= 0")
        if lr_ratio <= 0:
            raise ValueError(f"BackboneFinetuning(lr_ratio={lr_ratio}): use a positive ratio")
        self.unfreeze_at_epoch = unfreeze_at_epoch
        self.initial_backbone_lr = backbone_lr
        self.lr_ratio = lr_ratio
        self.backbone_attr = backbone_attr
        self.train_bn = train_bn
        self.optimizer_idx = optimizer_idx
        #: Epoch at whose start the backbone was unfrozen; None while it is frozen.
        self.unfrozen_at_epoch: int | None = None
        #: Learning rate the backbone's parameter group started with; None while it is frozen.
        self.backbone_lr: float | None = None

    # --- state ----------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        """Includes the backbone attribute, so two instances for two backbones keep separate state."""
        return f"BackboneFinetuning[backbone={self.backbone_attr}]"

    def state_dict(self) -> dict[str, Any]:
        """The epoch the backbone was unfrozen at and its learning rate (None, None while frozen)."""
        return {"unfrozen_at_epoch": self.unfrozen_at_epoch, "backbone_lr": self.backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `unfrozen_at_epoch` and `backbone_lr`."""
        self.unfrozen_at_epoch = state_dict.get("unfrozen_at_epoch")
        self.backbone_lr = state_dict.get("backbone_lr")

    @property
    def is_unfrozen(self) -> bool:
        """Whether the backbone has been unfrozen."""
        return self.unfrozen_at_epoch is not None

    # --- hooks ------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Freeze the backbone before ``configure_optimizers`` runs (fit only)."""
        if stage != "fit":
            return
        backbone = self.backbone(module)
        if self.is_unfrozen:  # a second fit with this callback: the backbone trains already
            unfreeze(backbone)
        else:
            freeze(backbone, self.train_bn)

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """On resume, before the optimizer state loads: give the optimizer the backbone group it was saved with.

        ``configure_optimizers`` rebuilt the optimizer with the head only; the checkpointed optimizer
        state holds the backbone group too if it was saved after the unfreeze.
        """
        saved = checkpoint.get("state", {}).get("callbacks", {}).get(self.state_key)
        if saved is None:
            return
        self.load_state_dict(saved)
        if self.is_unfrozen:
            assert self.backbone_lr is not None
            unfreeze(self.backbone(module))
            self._add_backbone_group(trainer, module, self.backbone_lr)
        else:
            freeze(self.backbone(module), self.train_bn)

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """A callback reused by a second fit: the fresh optimizer gets the unfrozen backbone again."""
        if self.is_unfrozen and self.backbone_lr is not None and self._params_to_add(trainer, module):
            self._add_backbone_group(trainer, module, self.backbone_lr)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Unfreeze at `unfreeze_at_epoch`; before it, keep the backbone in eval mode (fit set train mode)."""
        backbone = self.backbone(module)
        if self.is_unfrozen:
            return
        if trainer.current_epoch < self.unfreeze_at_epoch:
            set_frozen_mode(backbone, self.train_bn)
            return
        optimizer = self._optimizer(trainer)
        lr = self.initial_backbone_lr
        if lr is None:
            lr = float(optimizer.param_groups[0]["lr"]) * self.lr_ratio
        unfreeze(backbone)
        self.unfrozen_at_epoch = trainer.current_epoch
        self.backbone_lr = lr
        self._add_backbone_group(trainer, module, lr)

    # --- helpers ----------------------------------------------------------------------
    def backbone(self, module: TrainingModule) -> nn.Module:
        """``module.<backbone_attr>``, followed through dots."""
        try:
            found = functools.reduce(getattr, self.backbone_attr.split("."), module)
        except AttributeError:
            names = sorted(name for name, _ in module.named_children())
            raise AttributeError(
                f"BackboneFinetuning(backbone_attr={self.backbone_attr!r}): {type(module).__qualname__} has no "
                f"such attribute; its submodules are {names}. Pass backbone_attr='<the backbone's attribute>'"
            ) from None
        if not isinstance(found, nn.Module):
            raise TypeError(
                f"BackboneFinetuning(backbone_attr={self.backbone_attr!r}) is a {type(found).__qualname__}, "
                "not an nn.Module"
            )
        return found

    def _optimizer(self, trainer: Trainer) -> Optimizer:
        if not 0 <= self.optimizer_idx < len(trainer.optimizers):
            raise IndexError(
                f"BackboneFinetuning(optimizer_idx={self.optimizer_idx}): configure_optimizers returned "
                f"{len(trainer.optimizers)} optimizer(s)"
            )
        return trainer.optimizers[self.optimizer_idx]

    def _params_to_add(self, trainer: Trainer, module: TrainingModule) -> list[nn.Parameter]:
        """The backbone's parameters that the optimizer does not hold yet."""
        held = {id(p) for group in self._optimizer(trainer).param_groups for p in group["params"]}
        return [p for p in self.backbone(module).parameters() if id(p) not in held]

    def _add_backbone_group(self, trainer: Trainer, module: TrainingModule, lr: float) -> None:
        """Add the backbone's parameters the optimizer lacks as a group with `lr`; extend its schedulers."""
        optimizer = self._optimizer(trainer)
        params = self._params_to_add(trainer, module)
        if not params:
            warnings.warn(
                f"BackboneFinetuning: the optimizer already holds every parameter of {self.backbone_attr!r}; "
                "no group added (its learning rate stays the optimizer's). Give configure_optimizers the "
                "head only, or the parameters with requires_grad, to train the backbone at its own rate",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        first = optimizer.param_groups[0]
        ratio = lr / float(first["lr"]) if float(first["lr"]) else 0.0
        group: dict[str, Any] = {"params": params, "lr": lr}
        for key, value in first.items():  # per-group keys of schedulers (initial_lr, max_lr, ...)
            if key not in ("params", "lr") and key not in optimizer.defaults:
                group[key] = value * ratio if key.endswith("lr") and isinstance(value, float) else value
        optimizer.add_param_group(group)
        for config in trainer.lr_scheduler_configs:
            if getattr(config.scheduler, "optimizer", None) is optimizer:
                _extend_scheduler(config.scheduler, ratio, lr)


def _extend_scheduler(scheduler: Any, ratio: float, lr: float) -> None:
    """Give a scheduler's per-group lists an entry for the group just added (the first group's, scaled)."""
    base_lrs = getattr(scheduler, "base_lrs", None)
    if isinstance(base_lrs, list) and base_lrs:
        base_lrs.append(base_lrs[0] * ratio)
    last_lr = getattr(scheduler, "_last_lr", None)
    if isinstance(last_lr, list) and last_lr:
        last_lr.append(lr)
    for name in ("lr_lambdas", "min_lrs"):
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and values:
            values.append(values[0])

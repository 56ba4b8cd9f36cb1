"""`BaseFinetuning`: Lightning's base class for writing a finetuning callback, with its API and semantics.

A subclass written for ``lightning.pytorch.callbacks.BaseFinetuning`` runs under ember with its import
changed. It overrides two methods:

- ``freeze_before_training(pl_module)``: called from the callback's ``setup`` (every stage, as in
  Lightning), so before ``configure_optimizers``; freeze what should not train yet;
- ``finetune_function(pl_module, epoch, optimizer)``: called at each ``on_train_epoch_start``, once per
  optimizer of ``configure_optimizers`` (``trainer.optimizers``); unfreeze there, and give the optimizer
  the unfrozen parameters as a new group (`unfreeze_and_add_param_group`).

The static helpers are Lightning's: `flatten_modules`, `filter_params`, `make_trainable`, `freeze_module`,
`freeze`, `filter_on_optimizer`, `unfreeze_and_add_param_group`. `freeze` is not
``ember.modules.freezing.freeze``: Lightning's sets ``requires_grad=False`` and, for BatchNorm with
``train_bn=False``, ``track_running_stats=False``, and leaves every train/eval mode alone (a frozen
BatchNorm in train mode then normalizes with batch statistics and updates no running statistics);
ember's puts the frozen module in eval mode.

Resuming is exact. The callback's state holds the parameter groups that ``finetune_function`` added, by
parameter name (Lightning's ``internal_optimizer_metadata``), which parameters were frozen and which
BatchNorm layers tracked no statistics after the last ``finetune_function``, and the epoch it ran at. On
resume ember calls ``on_load_checkpoint`` before it loads the optimizer state: the callback gives the
rebuilt optimizers their saved groups and puts back the saved trainability there. The resumed epoch's
``finetune_function`` is not called again when the checkpoint was taken inside that epoch: its effects
are in the checkpoint already (Lightning would call it a second time).

Differences from Lightning: `filter_on_optimizer` skips the parameters the optimizer holds (by identity;
Lightning compares values with ``torch.equal``, which also skips a different parameter that happens to
hold equal values); Lightning's resume restores the groups but not ``requires_grad``, so a backbone
unfrozen before the checkpoint stays frozen after it unless ``finetune_function`` unfreezes it again.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from ember.callbacks.callback import Callback
from ember.utilities import rank_zero_warn

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer

#: A module, or an iterable (list, ``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``) of modules, nested.
Modules = nn.Module | Iterable[nn.Module | Iterable[Any]]


class BaseFinetuning(Callback):
    """Lightning's finetuning base class: override `freeze_before_training` and `finetune_function`.

    Example (Lightning's, unchanged but for the import)::

        from ember.callbacks import BaseFinetuning

        class FeatureExtractorFreezeUnfreeze(BaseFinetuning):
            def __init__(self, unfreeze_at_epoch=10):
                super().__init__()
                self._unfreeze_at_epoch = unfreeze_at_epoch

            def freeze_before_training(self, pl_module):
                self.freeze(pl_module.feature_extractor)

            def finetune_function(self, pl_module, current_epoch, optimizer):
                if current_epoch == self._unfreeze_at_epoch:
                    self.unfreeze_and_add_param_group(
                        modules=pl_module.feature_extractor, optimizer=optimizer, train_bn=True
                    )

    The module's ``configure_optimizers`` should take the parameters that require grad
    (``filter(lambda p: p.requires_grad, self.parameters())``), so that the frozen ones can join later.
    """

    def __init__(self) -> None:
        #: Per optimizer index, its param groups (parameters by name) as ``finetune_function`` left them.
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._optimizers: list[Optimizer] = []
        self._trainability: dict[str, list[str]] | None = None
        self._finetuned_epoch: int | None = None
        self._resumed_epoch: int | None = None

    # --- subclass hooks ----------------------------------------------------------------------
    def freeze_before_training(self, pl_module: TrainingModule) -> None:
        """Override: freeze what should not train at first. Called before ``configure_optimizers``."""
        raise NotImplementedError

    def finetune_function(self, pl_module: TrainingModule, epoch: int, optimizer: Optimizer) -> None:
        """Override: unfreeze and add param groups. Called at the start of every training epoch, per optimizer."""
        raise NotImplementedError

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Lightning's ``internal_optimizer_metadata`` (its hyperparameters as they are now), plus what
        exact resume needs: the frozen parameters and untracked BatchNorm layers, and the epoch
        ``finetune_function`` last ran at."""
        return {
            "internal_optimizer_metadata": self._current_metadata(),
            "trainability": self._trainability,
            "finetuned_epoch": self._finetuned_epoch,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; a state without ember's keys (Lightning's) loads too."""
        self._internal_optimizer_metadata = state_dict.get("internal_optimizer_metadata", {})
        self._trainability = state_dict.get("trainability")
        self._finetuned_epoch = state_dict.get("finetuned_epoch")

    # --- hooks -------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Call `freeze_before_training` (every stage, as Lightning does); a new fit starts with empty state."""
        if stage == "fit":
            self._internal_optimizer_metadata, self._trainability = {}, None
            self._finetuned_epoch = self._resumed_epoch = None
        self.freeze_before_training(module)

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """On resume, before the optimizer state loads: the saved groups and trainability come back."""
        saved = checkpoint.get("state", {}).get("callbacks", {}).get(self.state_key)
        if saved is None:
            return
        self.load_state_dict(saved)
        if self._trainability is not None:
            _apply_trainability(module, self._trainability)
        if self._internal_optimizer_metadata:
            named = dict(module.named_parameters())
            for opt_idx, optimizer in enumerate(trainer.optimizers):
                if opt_idx in self._internal_optimizer_metadata:
                    groups = self._apply_mapping_to_param_groups(self._internal_optimizer_metadata[opt_idx], named)
                    optimizer.param_groups.clear()
                    for group in groups:
                        optimizer.add_param_group(group)
        self._optimizers = list(trainer.optimizers)
        self._resumed_epoch = self._finetuned_epoch

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Call `finetune_function` for each optimizer and record the groups it added."""
        resumed_epoch, self._resumed_epoch = self._resumed_epoch, None
        self._optimizers = list(trainer.optimizers)
        if resumed_epoch == trainer.current_epoch:  # resumed inside this epoch: its finetuning is restored
            return
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            num_param_groups = len(optimizer.param_groups)
            self.finetune_function(module, trainer.current_epoch, optimizer)
            self._store(module, opt_idx, num_param_groups, optimizer.param_groups)
        self._trainability = _trainability(module)
        self._finetuned_epoch = trainer.current_epoch

    # --- static helpers (Lightning's) --------------------------------------------------------
    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The leaf modules of `modules` (a module or a nested iterable of them), and those of their parents
        that hold parameters directly."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        found: Iterable[nn.Module]
        if isinstance(modules, Iterable):
            found = [leaf for item in modules for leaf in BaseFinetuning.flatten_modules(item)]
        else:
            found = modules.modules()
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(
        modules: Modules, train_bn: bool = True, requires_grad: bool = True
    ) -> Generator[nn.Parameter, None, None]:
        """Yield the parameters of `modules` whose ``requires_grad`` equals `requires_grad`; BatchNorm
        layers' only when `train_bn`."""
        for layer in BaseFinetuning.flatten_modules(modules):
            if isinstance(layer, _BatchNorm) and not train_bn:
                continue
            for param in layer.parameters(recurse=False):  # recursing would repeat a parent's children
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze `modules`: ``requires_grad=True``, and BatchNorm layers track running statistics."""
        for layer in BaseFinetuning.flatten_modules(modules):
            _set_tracking(layer, True)
            for param in layer.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze `module`'s own parameters (``requires_grad=False``); a BatchNorm stops tracking running
        statistics. Its train/eval mode is left as it is."""
        _set_tracking(module, False)
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze `modules` (`freeze_module` on each leaf); with `train_bn`, BatchNorm layers stay trainable.

        Train/eval modes are not changed, unlike ``ember.modules.freezing.freeze`` (eval mode).
        """
        for layer in BaseFinetuning.flatten_modules(modules):
            if isinstance(layer, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(layer)
            else:
                BaseFinetuning.freeze_module(layer)

    @staticmethod
    def filter_on_optimizer(optimizer: Optimizer, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters of `params` that `optimizer` does not hold yet; warns when some were held."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        kept: list[nn.Parameter] = []
        skipped: list[nn.Parameter] = []
        for param in params:
            (skipped if id(param) in held else kept).append(param)
        if skipped:
            rank_zero_warn(
                f"BaseFinetuning: {len(skipped)} of the parameters to add are in a param group of this optimizer "
                f"already; they are skipped. To add them later, build the optimizer in configure_optimizers "
                f"from the trainable ones: {type(optimizer).__name__}(filter(lambda p: p.requires_grad, "
                "self.parameters()), ...)",
            )
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: Optimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze `modules` and add their parameters to `optimizer` as one new param group.

        The group's learning rate is `lr`, or, when None, the first group's divided by `initial_denom_lr`.
        BatchNorm parameters join only with `train_bn`; parameters the optimizer holds already are skipped.
        """
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        )
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    # --- the groups, by parameter name -------------------------------------------------------
    @staticmethod
    def _apply_mapping_to_param_groups(
        param_groups: list[dict[str, Any]], mapping: dict[Any, Any]
    ) -> list[dict[str, Any]]:
        """Copies of `param_groups` with each parameter replaced by ``mapping[parameter]`` (names to
        parameters, or parameters to names)."""
        return [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [mapping[p] for p in g["params"]]}
            for g in param_groups
        ]

    def _store(
        self, pl_module: TrainingModule, opt_idx: int, num_param_groups: int, current_param_groups: list[dict[str, Any]]
    ) -> None:
        """Record optimizer `opt_idx`'s groups by name: all of them the first time, then the ones added since."""
        names = {p: n for n, p in pl_module.named_parameters()}
        if opt_idx not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[opt_idx] = self._apply_mapping_to_param_groups(
                current_param_groups, names
            )
        elif num_param_groups != len(current_param_groups):
            self._internal_optimizer_metadata[opt_idx].extend(
                self._apply_mapping_to_param_groups(current_param_groups[num_param_groups:], names)
            )

    def _current_metadata(self) -> dict[int, list[dict[str, Any]]]:
        """The recorded groups with the optimizers' current hyperparameters (learning rates move with
        schedulers), so a resume rebuilds each group as it was saved."""
        current: dict[int, list[dict[str, Any]]] = {}
        for opt_idx, groups in self._internal_optimizer_metadata.items():
            live = self._optimizers[opt_idx].param_groups if opt_idx < len(self._optimizers) else []
            current[opt_idx] = []
            for i, group in enumerate(groups):
                now = live[i] if i < len(live) and len(live[i]["params"]) == len(group["params"]) else group
                current[opt_idx].append({**{k: v for k, v in now.items() if k != "params"}, "params": group["params"]})
        return current


def _trainability(module: nn.Module) -> dict[str, list[str]]:
    """The names of `module`'s frozen parameters and of its BatchNorm layers that track no statistics."""
    return {
        "frozen_parameters": [name for name, p in module.named_parameters() if not p.requires_grad],
        "untracked_batch_norms": [
            name for name, m in module.named_modules() if isinstance(m, _BatchNorm) and not m.track_running_stats
        ],
    }


def _apply_trainability(module: nn.Module, trainability: dict[str, list[str]]) -> None:
    """Make `module` as `_trainability` found it: the parameters named there frozen, every other trainable."""
    frozen, untracked = set(trainability["frozen_parameters"]), set(trainability["untracked_batch_norms"])
    for name, param in module.named_parameters():
        param.requires_grad = name not in frozen
    for name, layer in module.named_modules():
        _set_tracking(layer, name not in untracked)


def _set_tracking(layer: nn.Module, track_running_stats: bool) -> None:
    """Set a BatchNorm layer's ``track_running_stats``; other layers are left alone."""
    if isinstance(layer, _BatchNorm):
        layer.track_running_stats = track_running_stats

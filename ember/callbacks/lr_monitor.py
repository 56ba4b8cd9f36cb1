"""`LearningRateMonitor`: log the learning rate (and optionally momentum, weight decay) of every param group."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def exact(value: Any) -> Tensor:
    """A Python number as a float64 tensor, so the loggers receive exactly the optimizer's float."""
    return value if isinstance(value, Tensor) else torch.tensor(float(value), dtype=torch.float64)


class LearningRateMonitor(Callback):
    """Logs the learning rate each optimizer step actually used, per param group.

    Names follow Lightning: ``lr-<Optimizer>`` (or the scheduler config's
    ``name``), ``/pg<k>`` per param group (1-based; a group's ``"name"`` entry
    wins) when there are several, ``-<k>`` for repeated optimizer classes, and
    ``-momentum`` / ``-weight_decay`` suffixes. Momentum is the group's
    ``momentum`` or the first of its ``betas`` (Adam), else 0.

    - ``logging_interval="step"``: the value used by optimizer step ``s`` is
      logged at step ``s``, on the trainer's ``log_every_n_steps`` cadence,
      alongside ``train/loss``. It is read just before the step (after
      schedulers moved it), so it is exactly what the optimizer applied.
    - ``logging_interval="epoch"``: the value at the start of each epoch,
      logged with the epoch's metrics.
    - ``None`` (default): "step" when a scheduler steps per step, else "epoch".

    Values go through ``module.log``, so they land in the same logger rows as
    the step's other metrics and in ``trainer.callback_metrics``; nothing is
    computed on steps that are not logged.
    """

    def __init__(
        self, logging_interval: str | None = None, *, log_momentum: bool = False, log_weight_decay: bool = False
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"LearningRateMonitor(logging_interval={logging_interval!r}): use 'step', 'epoch' or None")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self._interval = "epoch"
        self._names: dict[int, list[str]] = {}  # id(optimizer) -> one base name per param group

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Name every optimizer's param groups and pick the interval."""
        if not trainer.optimizers:
            raise RuntimeError("LearningRateMonitor needs optimizers; configure_optimizers returned none")
        configs = trainer.lr_scheduler_configs
        self._interval = self.logging_interval or ("step" if any(c.interval == "step" for c in configs) else "epoch")
        named = {id(c.scheduler.optimizer): c.name for c in configs if c.name}
        bases = [named.get(id(opt)) or f"lr-{type(opt).__name__}" for opt in trainer.optimizers]
        totals, seen = Counter(bases), Counter[str]()
        self._names = {}
        for opt, base in zip(trainer.optimizers, bases, strict=True):
            index = seen[base]
            seen[base] += 1
            if totals[base] > 1 and index:
                base = f"{base}-{index}"
            groups = opt.param_groups
            self._names[id(opt)] = [
                base if len(groups) == 1 else f"{base}/{g.get('name') or f'pg{i + 1}'}" for i, g in enumerate(groups)
            ]

    def values(self, optimizer: Optimizer) -> dict[str, Any]:
        """``{name: value}`` for every param group of `optimizer` (lr, and momentum / weight decay if asked)."""
        names = self._names.get(id(optimizer)) or [f"lr-{type(optimizer).__name__}"] * len(optimizer.param_groups)
        out: dict[str, Any] = {}
        for name, group in zip(names, optimizer.param_groups, strict=True):
            out[name] = group["lr"]
            if self.log_momentum:
                betas = group.get("betas")
                out[f"{name}-momentum"] = group.get("momentum", betas[0] if betas else 0.0)
            if self.log_weight_decay:
                out[f"{name}-weight_decay"] = group.get("weight_decay", 0.0)
        return out

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Optimizer) -> None:
        """On logged steps, record the values this step is about to use (of every optimizer)."""
        if self._interval == "step" and trainer.logs_this_batch:
            for opt in trainer.optimizers:
                for name, value in self.values(opt).items():
                    module.log(name, exact(value), on_step=True, on_epoch=False)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """With the epoch interval, record the values the epoch starts with."""
        if self._interval == "epoch":
            for optimizer in trainer.optimizers:
                for name, value in self.values(optimizer).items():
                    module.log(name, exact(value), on_step=False, on_epoch=True, batch_size=1)

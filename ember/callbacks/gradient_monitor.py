"""`GradientMonitor` (the gradient norm as ``train/grad_norm``) and `ParameterHistograms`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.optim import Optimizer

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP), the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class GradientMonitor(Callback):
    """Logs the total gradient norm of each optimizer step as ``train/grad_norm``.

    The norm is taken in ``on_before_optimizer_step``: after mixed-precision
    unscaling and before gradient clipping, over every gradient the optimizer
    is about to apply, exactly as ``torch.nn.utils.clip_grad_norm_`` would
    measure it. It is computed only on the trainer's logging steps (every
    ``log_every_n_steps``) and stays a tensor until the loggers write it.
    ``per_parameter=True`` also logs ``grad_norm/<parameter name>``. With
    several optimizers (manual optimization) the names get ``/optimizer_<i>``.
    """

    def __init__(
        self,
        norm_type: float = 2.0,
        *,
        per_parameter: bool = False,
        name: str = "train/grad_norm",
    ) -> None:
        self.norm_type = float(norm_type)
        self.per_parameter = per_parameter
        self.name = name

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Optimizer) -> None:
        """On logged steps, log the norm of the gradients `optimizer` is about to apply."""
        if not trainer.logs_this_batch:
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return
        suffix = ""
        if len(trainer.optimizers) > 1:
            suffix = f"/optimizer_{next(i for i, o in enumerate(trainer.optimizers) if o is optimizer)}"
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], self.norm_type)
        full_tensor = getattr(norm, "full_tensor", None)  # FSDP: the norm of sharded grads is a DTensor
        module.log(self.name + suffix, full_tensor() if callable(full_tensor) else norm, on_step=True, on_epoch=False)
        if self.per_parameter:
            names = {id(p): n for n, p in module.named_parameters()}
            for p in params:
                grad_norm = torch.linalg.vector_norm(_local(p.grad), self.norm_type)
                module.log(f"grad_norm/{names.get(id(p), '?')}{suffix}", grad_norm, on_step=True, on_epoch=False)


class ParameterHistograms(Callback):
    """Sends histograms of every weight (``weights/<name>``) and gradient (``grads/<name>``) to the loggers.

    Taken in ``on_before_optimizer_step`` (gradients unscaled, not yet
    clipped) every ``every_n_steps`` optimizer steps, or, when that is None,
    at each logger's own ``log_histograms_every_n_steps``. ember adds this
    callback by itself when a logger asks for histograms
    (``TensorBoardLogger(log_histograms_every_n_steps=N)``). Under FSDP each
    histogram covers rank zero's shard.
    """

    def __init__(self, every_n_steps: int | None = None, *, weights: bool = True, grads: bool = True) -> None:
        self.every_n_steps = every_n_steps
        self.weights = weights
        self.grads = grads

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Optimizer) -> None:
        """Collect the histograms when any logger is due at the coming step."""
        if not trainer.is_global_zero:
            return
        step = trainer.global_step + 1
        due = [
            logger
            for logger in trainer.loggers
            if (n := self.every_n_steps or logger.log_histograms_every_n_steps) and step % n == 0
        ]
        if not due:
            return
        values: dict[str, Tensor] = {}
        for name, p in module.named_parameters():
            if self.weights:
                values[f"weights/{name}"] = _local(p.detach())
            if self.grads and p.grad is not None:
                values[f"grads/{name}"] = _local(p.grad.detach())
        trainer.run_state.logger_guard.log_histograms(due, values, trainer.global_step)  # the step's row

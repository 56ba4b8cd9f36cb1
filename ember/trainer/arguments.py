"""What the Trainer's entry points accept, checked before anything runs: Lightning's argument order (a
DataModule where the dataloaders go, ``ckpt_path`` third) and options that do not apply to the module."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ember.modules.datamodule import DataModule
from ember.modules.module import TrainingModule

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


def split_datamodule(call: str, loaders: Any, datamodule: DataModule | None) -> tuple[Any, DataModule | None]:
    """A DataModule passed where the dataloaders go (``trainer.fit(module, dm)``, as Lightning allows) is the
    datamodule."""
    if isinstance(loaders, DataModule):
        if datamodule is not None:
            raise ValueError(f"{call}: a DataModule was passed both as the dataloaders and as datamodule=; pass one")
        return None, loaders
    if loaders is not None and datamodule is not None:
        raise ValueError(f"{call}: pass dataloaders or a datamodule, not both")
    return loaders, datamodule


def the_module(call: str, module: TrainingModule | None, model: TrainingModule | None) -> TrainingModule | None:
    """The module an entry point was given: ``module`` (ember's name) or ``model=`` (Lightning's name, so
    ``trainer.fit(model=...)`` ports unchanged); both at once is a mistake."""
    if module is not None and model is not None:
        raise TypeError(f"{call}: got both module and model= (Lightning's name for it); pass the module once")
    return module if module is not None else model


def check_weights_only(call: str, weights_only: Any) -> None:
    """``weights_only`` is Lightning 2's ``torch.load`` switch: None, True or False (see `Trainer.fit`)."""
    if weights_only is not None and not isinstance(weights_only, bool):
        raise TypeError(f"{call}: weights_only={weights_only!r} must be None, True or False")


def check_not_datamodule(call: str, name: str, value: Any) -> None:
    if isinstance(value, DataModule):
        raise TypeError(f"{call}: {name} got a DataModule; pass it as datamodule=... (or second, in its place)")


def check_ckpt_path(call: str, ckpt_path: Any) -> None:
    if ckpt_path is not None and not isinstance(ckpt_path, (str, os.PathLike)):
        raise TypeError(
            f"{call}: ckpt_path must be a path, 'last' or 'best'; got a {type(ckpt_path).__qualname__}. "
            "The parameters follow Lightning's order: (module, dataloaders, ckpt_path, *, datamodule)"
        )


def check_fit(trainer: Trainer, module: TrainingModule) -> None:
    """What `fit` refuses before anything runs: options that do not apply to this module."""
    if not isinstance(module, TrainingModule):
        raise TypeError(f"expected an ember.TrainingModule, got {type(module).__qualname__}")
    if not module.automatic_optimization:
        if trainer.gradient_clip_val is not None:
            raise ValueError(
                f"gradient_clip_val={trainer.gradient_clip_val} does nothing under manual optimization "
                "(automatic_optimization = False); drop it and clip in training_step, e.g. "
                "self.clip_gradients(opt, gradient_clip_val=0.5) before opt.step()"
            )
        if trainer.accumulate_grad_batches > 1:
            raise ValueError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} does nothing under manual optimization "
                "(automatic_optimization = False); drop it and step the optimizer every N batches in training_step"
            )

"""Freezing a module: no gradients and eval mode (BatchNorm statistics and dropout held), and undoing it.

Used by `TrainingModule.freeze` / `unfreeze` and by the `BackboneFinetuning` callback; any
``nn.Module`` can be frozen with `freeze(module, train_bn=False)`.
"""

from __future__ import annotations

from torch import nn

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _is_batch_norm(module: nn.Module) -> bool:
    return isinstance(module, _BATCH_NORMS)


def freeze(module: nn.Module, train_bn: bool = False) -> nn.Module:
    """Stop training `module`: ``requires_grad=False`` on its parameters and eval mode.

    With ``train_bn=True`` its BatchNorm layers stay trainable and in train mode (their affine
    parameters learn and their running statistics follow the new data). Returns `module`.
    """
    for param in module.parameters():
        param.requires_grad_(False)
    if train_bn:
        for sub in module.modules():
            if _is_batch_norm(sub):
                for param in sub.parameters():
                    param.requires_grad_(True)
    set_frozen_mode(module, train_bn)
    return module


def set_frozen_mode(module: nn.Module, train_bn: bool = False) -> None:
    """Eval mode for a frozen `module`; with ``train_bn``, its BatchNorm layers in train mode."""
    module.eval()
    if train_bn:
        for sub in module.modules():
            if _is_batch_norm(sub):
                sub.train()


def unfreeze(module: nn.Module) -> nn.Module:
    """Undo `freeze`: every parameter of `module` trains again and it is in train mode. Returns `module`."""
    for param in module.parameters():
        param.requires_grad_(True)
    return module.train()

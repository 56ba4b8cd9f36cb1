"""`ModelSummary`: parameter counts of the module's top-level children, printed at fit start."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from torch import nn

    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """(all parameters, trainable parameters)."""
    total = trainable = 0
    for p in module.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def summarize(module: nn.Module) -> str:
    """A small text table: one row per top-level child, then totals."""
    rows = [("name", "type", "params", "trainable")]
    for name, child in module.named_children():
        total, trainable = count_parameters(child)
        rows.append((name, type(child).__name__, f"{total:,}", f"{trainable:,}"))
    total, trainable = count_parameters(module)
    rows.append(("total", type(module).__name__, f"{total:,}", f"{trainable:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    # Name and type columns align left, the counts right.
    lines = [
        "  ".join(
            [
                r[0].ljust(widths[0]),
                r[1].ljust(widths[1]),
                *(c.rjust(w) for c, w in zip(r[2:], widths[2:], strict=True)),
            ]
        )
        for r in rows
    ]
    size_mb = total * 4 / 1e6
    return "\n".join([*lines, f"{size_mb:.2f} MB of fp32 parameters"])


class ModelSummary(Callback):
    """Prints `summarize(module)` when fit starts (global zero only).

    Enabled by ``Trainer(enable_model_summary=True)`` (the default).
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.is_global_zero:
            print(summarize(module), file=self.stream or sys.stdout, flush=True)

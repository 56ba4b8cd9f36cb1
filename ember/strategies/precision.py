"""Precision plugins: how the forward runs (autocast) and how the loss and step are scaled.

Only full fp32 exists so far; the seam is here so mixed precision plugs in
without touching the loop.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

_NULL_CONTEXT = contextlib.nullcontext()  # stateless and reusable: no allocation per step

#: Every precision name ember knows, and the ones this version can run.
KNOWN_PRECISIONS = ("32-true", "32", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
SUPPORTED_PRECISIONS = ("32-true", "32")


class Precision:
    """Full fp32: no autocast, no loss scaling."""

    name = "32-true"

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        """Context the training/eval steps run in (autocast for mixed precision)."""
        return _NULL_CONTEXT

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Undo loss scaling on the gradients before clipping (no-op here)."""

    def optimizer_step(self, optimizer: Optimizer, closure: Any = None) -> Any:
        return optimizer.step(closure) if closure is not None else optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def resolve_precision(value: str | int) -> Precision:
    """Map a ``Trainer(precision=...)`` value to a plugin, with an error listing the valid ones."""
    name = str(value)
    if name not in KNOWN_PRECISIONS:
        raise ValueError(f"precision={value!r} is not valid; choose one of: {', '.join(KNOWN_PRECISIONS)}")
    if name not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"precision={value!r} is not available in this version of ember; "
            f"use one of: {', '.join(SUPPORTED_PRECISIONS)}"
        )
    return Precision()

"""Guarding against a non-finite loss without waiting for the device every step.

``Trainer(nonfinite_loss="error")`` records, on the device, the first optimizer
step whose loss was inf or NaN, and checks that record only when the trainer
syncs anyway (every ``log_every_n_steps`` steps and at epoch ends): the error
then names the step. ``"skip"`` inspects every loss on the host (one sync per
batch, which you asked for) and skips that batch's backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

NONFINITE_MODES = ("error", "skip")


class NonFiniteLoss(FloatingPointError):
    """The training loss became inf or NaN."""


class FiniteGuard:
    """Watches training losses; `mode` is "error", "skip" or None (off)."""

    def __init__(self, mode: str | None) -> None:
        if mode is not None and mode not in NONFINITE_MODES:
            raise ValueError(f"nonfinite_loss={mode!r}: use 'error', 'skip' or None")
        self.mode = mode
        self._first_bad: Tensor | None = None
        self.skipped_batches = 0

    def admits(self, loss: Tensor, step: int) -> bool:
        """Whether to backward `loss` (the optimizer step it feeds is `step`, 1-based)."""
        if self.mode == "skip":
            if bool(torch.isfinite(loss.detach())):  # the host sync "skip" asks for
                return True
            self.skipped_batches += 1
            return False
        if self.mode == "error":
            bad = ~torch.isfinite(loss.detach())
            if self._first_bad is None:
                self._first_bad = torch.full((), -1, dtype=torch.int64, device=loss.device)
            self._first_bad = torch.where(bad & (self._first_bad < 0), step, self._first_bad)
        return True

    def check(self) -> None:
        """Raise if a non-finite loss was recorded (one host sync; called where the trainer syncs anyway)."""
        if self._first_bad is not None and (step := int(self._first_bad)) >= 0:
            raise NonFiniteLoss(
                f"the training loss was inf or NaN at optimizer step {step}; lower the learning rate, clip "
                "gradients (gradient_clip_val), check the data, or pass nonfinite_loss='skip' to skip such batches"
            )

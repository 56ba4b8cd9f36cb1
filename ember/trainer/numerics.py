"""Guarding against a non-finite loss without waiting for the device every step.

``Trainer(nonfinite_loss="error")`` records, on the device, the first optimizer
step whose loss was inf or NaN, and checks that record only when the trainer
syncs anyway (every ``log_every_n_steps`` steps and at epoch ends): the error
then names the step. ``"skip"`` inspects every loss on the host (one sync per
batch, which you asked for) and skips that batch's backward.

With several processes every rank decides from the same flag: whether the loss
was finite on *every* rank, one all-reduce of a scalar per batch (issued on the
loss's device, so it adds no host sync of its own). Under "skip" all ranks skip
the same batch, so their gradient collectives stay paired; under "error" all
ranks record the same step and raise at the same check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ember.strategies.collectives import keep

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
        """Whether to backward `loss` (the optimizer step it feeds is `step`, 1-based); the same answer on
        every rank."""
        bad = _on_any_rank(~torch.isfinite(loss.detach()))
        if self.mode == "skip":
            if not bool(bad):  # the host sync "skip" asks for
                return True
            self.skipped_batches += 1
            return False
        if self.mode == "error":
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


def _on_any_rank(bad: Tensor) -> Tensor:
    """`bad` (a bool scalar) OR-ed over every process of the job: one all-reduce, no host sync; `bad` itself
    with one process."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return bad
    flag = bad.to(torch.int32)
    keep(flag)  # gloo's worker must never be the one to drop the tensor's last holder (collectives.py)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.bool()

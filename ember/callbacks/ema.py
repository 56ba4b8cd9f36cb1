"""`EMA`: an exponential moving average of the weights, used for evaluation and export."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _average_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


class EMA(Callback):
    """Keeps ``ema = decay * ema + (1 - decay) * weights`` after every ``every_n_steps`` optimizer steps.

    The first update (at step ``start_step`` or later) copies the weights; each
    later one blends them in, as ``torch.optim.swa_utils`` does. Floating-point
    buffers (BatchNorm statistics) are averaged too unless
    ``include_buffers=False``. Half-precision weights (``"bf16-true"``) are
    averaged in float32. With ``warmup=True`` the decay ramps up as
    ``min(decay, (1 + n) / (10 + n))`` for the n-th update.

    - **Evaluation**: validation (inside fit and ``trainer.validate``), test and
      predict run on the averaged weights; the training weights are put back
      afterwards (also after an exception). ``evaluate_with_ema=False`` turns
      this off.
    - **Export**: ``averaged_state_dict(module)`` is the module's state dict
      with the averaged weights; ``with ema.averaged_weights(module): ...``
      swaps them in for a block (e.g. ``trainer.save_checkpoint(path,
      weights_only=True)`` or ``torch.onnx.export``).
    - **Checkpoints**: the averaged tensors and the update count are in
      `state_dict`, so a resumed run continues the same average.
    """

    def __init__(
        self,
        decay: float = 0.999,
        *,
        every_n_steps: int = 1,
        start_step: int = 0,
        warmup: bool = False,
        include_buffers: bool = True,
        evaluate_with_ema: bool = True,
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA(decay={decay!r}): use a value in [0, 1], typically 0.99 to 0.9999")
        if every_n_steps < 1:
            raise ValueError(f"EMA(every_n_steps={every_n_steps!r}): use a positive int")
        self.decay = decay
        self.every_n_steps = every_n_steps
        self.start_step = start_step
        self.warmup = warmup
        self.include_buffers = include_buffers
        self.evaluate_with_ema = evaluate_with_ema
        #: Updates applied so far.
        self.num_updates = 0
        self._names: list[str] = []
        self._live: list[Tensor] = []
        self._averaged: list[Tensor] | None = None
        self._loaded: dict[str, Tensor] | None = None
        self._backup: list[Tensor] | None = None
        self._last_step = -1

    # --- the average ------------------------------------------------------------
    def _tracked(self, module: nn.Module) -> list[tuple[str, Tensor]]:
        tensors = [(name, p.detach()) for name, p in module.named_parameters()]
        if self.include_buffers:
            tensors += [(name, b.detach()) for name, b in module.named_buffers() if b.is_floating_point()]
        return [(name, t) for name, t in tensors if t.is_floating_point()]

    def _bind(self, module: nn.Module) -> None:
        tracked = self._tracked(module)
        self._names = [name for name, _ in tracked]
        self._live = [t for _, t in tracked]
        if self._loaded is not None:
            missing = [n for n in self._names if n not in self._loaded]
            if missing:
                raise KeyError(
                    f"EMA state from the checkpoint lacks {missing[:3]}{'...' if len(missing) > 3 else ''}; "
                    "it was saved for a different module (or with another include_buffers)"
                )
            self._averaged = [
                self._loaded[n].to(t.device, _average_dtype(t.dtype), copy=True)
                for n, t in zip(self._names, self._live, strict=True)
            ]
            self._loaded = None

    def current_decay(self) -> float:
        """The decay the next update uses (ramped with ``warmup=True``)."""
        if self.warmup:
            return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        return self.decay

    @torch.no_grad()
    def update(self) -> None:
        """Blend the current weights into the average (the first update copies them)."""
        if self._averaged is None:  # low-precision weights are averaged in float32
            self._averaged = [t.float() if t.dtype in _LOW_PRECISION else t.clone() for t in self._live]
        elif self._same_dtypes:
            torch._foreach_lerp_(self._averaged, self._live, 1.0 - self.current_decay())
        else:
            weight = 1.0 - self.current_decay()
            for avg, live in zip(self._averaged, self._live, strict=True):
                avg.lerp_(live.to(avg.dtype), weight)
        self.num_updates += 1

    @property
    def _same_dtypes(self) -> bool:
        assert self._averaged is not None
        return all(a.dtype == t.dtype for a, t in zip(self._averaged, self._live, strict=True))

    @property
    def averaged(self) -> dict[str, Tensor]:
        """The averaged tensors by name (empty before the first update)."""
        if self._averaged is None:
            return {}
        return dict(zip(self._names, self._averaged, strict=True))

    # --- swapping -------------------------------------------------------------------
    @torch.no_grad()
    def _swap_in(self) -> None:
        if self._averaged is None or self._backup is not None:
            return
        self._backup = [t.clone() for t in self._live]
        for live, avg in zip(self._live, self._averaged, strict=True):
            live.copy_(avg)

    @torch.no_grad()
    def _swap_out(self) -> None:
        if self._backup is None:
            return
        for live, saved in zip(self._live, self._backup, strict=True):
            live.copy_(saved)
        self._backup = None

    @contextlib.contextmanager
    def averaged_weights(self, module: nn.Module) -> Iterator[nn.Module]:
        """Inside the block `module` holds the averaged weights; the training weights come back after it."""
        if not self._live:
            self._bind(module)
        self._swap_in()
        try:
            yield module
        finally:
            self._swap_out()

    def averaged_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """``module.state_dict()`` with the averaged weights (copies; the module is left as it is)."""
        with self.averaged_weights(module):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    # --- hooks -------------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Track the module's weights (continuing a checkpointed average when there is one)."""
        self._bind(module)
        self._last_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After an optimizer step, update the average when this step is due."""
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        if step >= self.start_step and step % self.every_n_steps == 0:
            self.update()

    def _eval_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.evaluate_with_ema:
            if not self._live and self._loaded is not None:
                self._bind(module)  # trainer.validate/test right after a resume
            self._swap_in()

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Put the averaged weights in for validation."""
        self._eval_start(trainer, module)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Put the training weights back."""
        self._swap_out()

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Put the averaged weights in for testing."""
        self._eval_start(trainer, module)

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Put the training weights back."""
        self._swap_out()

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Put the averaged weights in for prediction."""
        self._eval_start(trainer, module)

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Put the training weights back."""
        self._swap_out()

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        """Never leave the averaged weights in the module after a failure."""
        self._swap_out()

    # --- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Update count and the averaged tensors by name (copies, safe to write in the background)."""
        state: dict[str, Any] = {"num_updates": self.num_updates, "decay": self.decay}
        source = self.averaged or self._loaded or {}
        state["averaged"] = {name: t.detach().clone() for name, t in source.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved average; it is moved onto the module's devices when fit starts."""
        self.num_updates = int(state_dict["num_updates"])
        averaged = state_dict.get("averaged") or {}
        self._averaged, self._live, self._names = None, [], []
        self._loaded = dict(averaged) if averaged else None

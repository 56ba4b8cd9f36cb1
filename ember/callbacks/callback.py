"""The `Callback` base: every hook ember calls, as a typed, documented no-op.

Subclass `Callback` and override the hooks you need. Every hook receives the
`Trainer` and the `TrainingModule` first. A `TrainingModule` may define the same
hooks without those two arguments (`def on_train_epoch_end(self): ...`); it is
called before the callbacks. The order of every hook is written in
`docs/hooks.md`.

A method whose name starts with ``on_`` but is not a hook is rejected when the
trainer starts (a misspelt hook would otherwise never run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor
    from torch.optim import Optimizer

    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


class Callback:
    """Base class for callbacks. Every hook is a no-op; override what you need."""

    @property
    def state_key(self) -> str:
        """Key under which this callback's `state_dict` is stored in checkpoints.

        Defaults to the class name; override it when a run uses two instances of
        the same callback class with different settings.
        """
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        """State to carry across a resume (empty by default)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by `state_dict`."""

    # --- setup / teardown -------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Called at the start of fit/validate/test/predict; `stage` is one of those four names."""

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Called at the very end of fit/validate/test/predict, also after an exception."""

    # --- fit ----------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called once at the start of `fit`, after setup and before the sanity check."""

    def on_fit_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called once when `fit` finishes normally."""

    def on_sanity_check_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called before the validation sanity check that precedes training."""

    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called after the validation sanity check."""

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called once before the first training epoch."""

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called once after the last training epoch."""

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the start of every training epoch."""

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the end of every training epoch, after the epoch's validation (if any)."""

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        """Called before `training_step` for every batch."""

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Called after every training batch (and after the optimizer step, when one happened).

        `outputs` is what `training_step` returned, with the loss detached.
        """

    def on_train_stop(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called when the fit stops at a step boundary inside an epoch or at its last batch (``max_steps``,
        ``max_time``, ``trainer.should_stop``): after that batch's `on_train_batch_end` and its validation, before
        the stop's checkpoint is saved. Also when data of unknown length runs out where the fit stops (its last
        epoch; ``max_steps`` reached by the step of a last, partial accumulation window): a step boundary known
        only then (before that epoch's last validation). A rewind asked for here
        (``trainer.rewind``) is applied instead, and the fit then stops at the next step boundary where the stop
        still holds."""

    # --- optimization -------------------------------------------------------
    def on_before_backward(self, trainer: Trainer, module: TrainingModule, loss: Tensor) -> None:
        """Called before `loss.backward()` (the loss is already divided for accumulation)."""

    def on_after_backward(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called after `loss.backward()`; gradients are populated (still scaled under 16-mixed)."""

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainingModule, optimizer: Optimizer) -> None:
        """Called before `optimizer.step()`, after gradients are unscaled and before clipping."""

    def on_before_zero_grad(self, trainer: Trainer, module: TrainingModule, optimizer: Optimizer) -> None:
        """Called after `optimizer.step()` and before gradients are cleared."""

    # --- validation ---------------------------------------------------------
    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the start of a validation run (also in the sanity check and inside fit)."""

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the end of a validation run; epoch metrics are in `trainer.callback_metrics`."""

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called before the first validation batch."""

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called after the last validation batch, before epoch metrics are computed."""

    def on_validation_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before `validation_step`."""

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after `validation_step`."""

    # --- test ---------------------------------------------------------------
    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the start of `trainer.test`."""

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the end of `trainer.test`."""

    def on_test_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called before the first test batch."""

    def on_test_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called after the last test batch, before epoch metrics are computed."""

    def on_test_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before `test_step`."""

    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after `test_step`."""

    # --- predict ------------------------------------------------------------
    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the start of `trainer.predict`."""

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called at the end of `trainer.predict`."""

    def on_predict_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called before the first predict batch."""

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """Called after the last predict batch."""

    def on_predict_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Called before `predict_step`."""

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Called after `predict_step` with its output."""

    # --- checkpoints and errors --------------------------------------------
    def on_save_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """Called while a checkpoint is assembled; add entries to `checkpoint` if needed."""

    def on_load_checkpoint(self, trainer: Trainer, module: TrainingModule, checkpoint: dict[str, Any]) -> None:
        """Called when ``fit(ckpt_path=...)`` resumes: after the checkpoint is read, before any of its state is
        restored; `checkpoint` is its ``ember.pt`` content (``state``, ``hparams``, ``config``, what
        `on_save_checkpoint` added). Not called when validate/test/predict load only the weights, nor by
        `TrainingModule.load_from_checkpoint`."""

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        """Called when fit/validate/test/predict raises, before `teardown`; the exception is re-raised."""


#: Every hook name, in the order they are declared above. The single source for
#: hook validation and the per-hook dispatch tables in `CallbackList`.
HOOK_NAMES: tuple[str, ...] = tuple(
    name for name in vars(Callback) if name.startswith("on_") or name in ("setup", "teardown")
)

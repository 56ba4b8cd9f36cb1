"""Manual optimization: what a `TrainingModule` with ``automatic_optimization = False`` calls in its
``training_step`` (Lightning's names): its optimizers and schedulers, ``manual_backward``, optimizer toggling
for GANs, and gradient clipping."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    from ember.modules.optimizers import ManualOptimizer
    from ember.trainer.optimization import ManualSteps
    from ember.trainer.trainer import Trainer


class ManualOptimization(nn.Module):
    """The manual-optimization calls of `TrainingModule` (its base class): they go through the running fit's
    steps (``trainer.fit_loop.manual``), so hooks, precision and step counting are the trainer's."""

    _trainer: Trainer | None

    if TYPE_CHECKING:

        @property
        def trainer(self) -> Trainer: ...

    def _manual_steps(self) -> ManualSteps | None:
        loop = self._trainer.fit_loop if self._trainer is not None else None
        return loop.manual if loop is not None else None

    def optimizers(self) -> ManualOptimizer | list[ManualOptimizer]:
        """The optimizers from `configure_optimizers` (one, or a list), for manual optimization."""
        steps = self._manual_steps()
        if steps is None or not steps.optimizers:
            raise RuntimeError("optimizers() is available inside fit, after configure_optimizers ran")
        opts = steps.optimizers
        return opts[0] if len(opts) == 1 else list(opts)

    def lr_schedulers(self) -> LRScheduler | ReduceLROnPlateau | list[LRScheduler | ReduceLROnPlateau] | None:
        """The schedulers from `configure_optimizers` (None, one or a list); step them yourself."""
        steps = self._manual_steps()
        scheds = steps.schedulers if steps is not None else []
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else list(scheds)

    def manual_backward(self, loss: Tensor) -> None:
        """Backward through the trainer (hooks, precision scaling); use instead of ``loss.backward()``."""
        steps = self._manual_steps()
        if steps is None:
            raise RuntimeError("manual_backward() is available inside fit only")
        steps.backward(loss)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Train only `optimizer`'s parameters until `untoggle_optimizer` (Lightning's call, for GANs).

        Every other parameter of the module gets ``requires_grad=False``, so a backward through, e.g., the
        discriminator while training the generator leaves the discriminator's gradients alone.
        """
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a ManualOptimizer wraps the torch one
        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        toggled: dict[nn.Parameter, bool] = self.__dict__.setdefault("_toggled", {})
        for param in self.parameters():
            toggled.setdefault(param, param.requires_grad)
            if id(param) not in own:
                param.requires_grad = False

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Undo `toggle_optimizer`: every parameter's ``requires_grad`` is what it was before."""
        toggled: dict[nn.Parameter, bool] = self.__dict__.get("_toggled", {})
        for param, requires_grad in toggled.items():
            param.requires_grad = requires_grad
        toggled.clear()

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """`toggle_optimizer` for the block, `untoggle_optimizer` after it."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the gradients of `optimizer`'s parameters, for manual optimization (Lightning's call).

        Call it between ``manual_backward`` and ``opt.step()``. Gradients are unscaled first under
        "16-mixed". ``gradient_clip_algorithm`` is "norm" (default) or "value"; None or 0 clips nothing.
        """
        trainer = self.trainer
        if not gradient_clip_val:
            return
        algorithm = gradient_clip_algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={algorithm!r}; choose 'norm' or 'value'")
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a ManualOptimizer wraps the torch one
        trainer.strategy.precision.unscale_gradients(optimizer)
        trainer.strategy.clip_gradients(trainer.model, optimizer, gradient_clip_val, algorithm)

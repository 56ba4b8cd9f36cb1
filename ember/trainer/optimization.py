"""One training batch and one optimizer step.

`run_training_batch` is the whole story of a micro-batch: forward under the
precision context, backward (divided by the accumulation window, without
gradient sync until the window ends), and at the window's end `optimizer_step`:
unscale, hooks, clip, step, zero_grad, step-interval schedulers.

`build_optimizers` builds the optimizers and schedulers a fit uses; `ManualSteps` wires manual
optimization to the same step. An optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``)
trains through `closure_training_batch`: the closure ember builds runs the forward, the backward and the
hooks around them, as often as the optimizer asks. `plain_step` is the step when all of that reduces to
``training_step``, ``backward()`` and ``optimizer.step()``: the loop then skips the no-op indirections.
Every step body ends in `finish_step` (hooks, ``zero_grad``, the step counted, schedulers). The functions
take the fit's `FitLoop`: its optimizers, plan and `FitState` (counted through ``FitState.count_step``).
The hooks around backward and the optimizer step are called here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer

from ember.modules.optimizers import ManualOptimizer, parse_optimizers

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.modules.optimizers import SchedulerConfig
    from ember.trainer.data import EpochPlan
    from ember.trainer.loop import FitLoop


def build_optimizers(module: TrainingModule, plan: EpochPlan) -> tuple[list[Optimizer], list[SchedulerConfig], bool]:
    """Run ``configure_optimizers``: (the optimizers, the scheduler configs, whether the optimizer steps with a
    closure), with the gradients zeroed. Several optimizers need manual optimization; a closure optimizer
    cannot accumulate."""
    setup = parse_optimizers(module.configure_optimizers(), list(module.parameters()))
    if module.automatic_optimization and len(setup.optimizers) > 1:
        raise ValueError(
            f"configure_optimizers returned {len(setup.optimizers)} optimizers; several optimizers need "
            "manual optimization: set self.automatic_optimization = False and step them in training_step"
        )
    with_closure = module.automatic_optimization and needs_closure(setup.optimizers[0])
    if with_closure and plan.accumulate > 1:
        raise ValueError(
            f"{type(setup.optimizers[0]).__name__} evaluates the loss several times per step (a closure); it "
            "cannot accumulate gradients over batches: drop accumulate_grad_batches, or use a larger batch"
        )
    for optimizer in setup.optimizers:
        optimizer.zero_grad(set_to_none=True)
    return setup.optimizers, setup.schedulers, with_closure


class ManualSteps:
    """What manual optimization calls (``self.optimizers()``, ``self.lr_schedulers()``, ``manual_backward``):
    the fit's optimizers wrapped so that ``opt.step()`` goes through `optimizer_step` and ``manual_backward``
    through `backward`, so hooks, precision and step counting stay those of automatic optimization."""

    def __init__(self, loop: FitLoop) -> None:
        self.loop = loop
        self.optimizers = [ManualOptimizer(opt, self._step) for opt in loop.optimizers]
        self.schedulers = [config.scheduler for config in loop.lr_scheduler_configs]

    def _step(self, optimizer: Optimizer, closure: Any) -> Any:
        return optimizer_step(self.loop, optimizer, closure)

    def backward(self, loss: Tensor) -> None:
        backward(self.loop, loss)


#: Hooks that sit between backward and the optimizer step.
_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


def needs_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` takes a closure it cannot do without (``torch.optim.LBFGS``: ``step(closure)``)."""
    parameter = inspect.signature(type(optimizer).step).parameters.get("closure")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def steps_are_plain(loop: FitLoop) -> bool:
    """Whether `run_training_batch` would only run ``training_step``, ``backward()`` and ``step()`` here.

    True with one process, fp32 or a true precision, automatic optimization, no accumulation, clipping,
    loss guard or profiler, and nobody implementing the hooks around backward and the optimizer step:
    every other part of a step is then a no-op.
    """
    trainer = loop.trainer
    return (
        loop.module.automatic_optimization
        and not loop.steps_with_closure
        and trainer.strategy.runs_plain_steps()
        and trainer.finite_guard.mode is None
        and trainer.gradient_clip_val is None
        and loop.plan.accumulate == 1
        and trainer.profiler is None
        and not any(trainer.hooks.implemented(name) for name in _STEP_HOOKS)
    )


def plain_step(loop: FitLoop) -> Callable[[Any, int], Any] | None:
    """When `steps_are_plain`, the step of one batch without the calls that would all be no-ops:
    ``training_step``, ``backward()``, ``step()``, ``zero_grad()`` and step-interval schedulers; else None."""
    if not steps_are_plain(loop):
        return None
    training_step, optimizer = loop.module.training_step, loop.optimizers[0]

    def step(batch: Any, batch_idx: int) -> Any:
        output = training_step(batch, batch_idx)
        # a 0-d tensor as it is; anything else through `loss_of`, whose errors are the general step's (backward
        # alone would train on a one-element loss that the general step refuses)
        loss = output if type(output) is Tensor and not output.ndim else loss_of(output)
        if loss is not None:
            try:
                loss.backward()
            except RuntimeError:
                loss_of(output)  # a loss that is not a scalar or has no graph: ember's clearer error
                raise
            optimizer.step()
            finish_step(loop, optimizer)
        return output

    return step


def run_training_batch(loop: FitLoop, batch: Any, batch_idx: int, window_size: int, ends_window: bool) -> Any:
    """Forward and backward one micro-batch; step the optimizer if it ends a window.

    Returns the step's output as it is (None if the step returned None).
    """
    trainer, module = loop.trainer, loop.module
    strategy, guard = trainer.strategy, trainer.finite_guard
    if not module.automatic_optimization:
        with strategy.forward_context():
            return strategy.training_step(module, batch, batch_idx)
    with strategy.no_sync(trainer.model, enabled=not ends_window):
        with strategy.forward_context():
            output = strategy.training_step(module, batch, batch_idx)
        loss = loss_of(output)
        if loss is not None and guard.mode is not None:
            loss = loss if guard.admits(loss, loop.state.global_step + 1) else None
        if loss is not None:
            backward(loop, loss / window_size if window_size > 1 else loss)
            loop.state.add_gradients()
    if ends_window and loop.state.window_has_grads:
        optimizer_step(loop, loop.optimizers[0])
    return output


def closure_training_batch(loop: FitLoop, batch: Any, batch_idx: int) -> Any:
    """One batch for an optimizer that evaluates the loss itself (``optimizer.step(closure)``, e.g. LBFGS).

    The closure is what a hand-written loop passes: ``training_step``, ``zero_grad``, backward (with its hooks),
    then ``on_before_optimizer_step`` and clipping; the optimizer calls it as often as it needs. Returns the
    output of the last evaluation. Accumulation is refused for these optimizers (`build_optimizers`).
    """
    trainer, module = loop.trainer, loop.module
    strategy, hooks, optimizer = trainer.strategy, trainer.hooks, loop.optimizers[0]
    last: list[Any] = [None]

    def closure() -> Tensor:
        with strategy.forward_context():
            output = last[0] = strategy.training_step(module, batch, batch_idx)
        loss = loss_of(output)
        if loss is None:
            raise ValueError(
                f"training_step returned None for batch {batch_idx}, but {type(optimizer).__name__} needs a loss "
                "each time it evaluates the closure; return the loss"
            )
        optimizer.zero_grad(set_to_none=True)
        backward(loop, loss)
        hooks.on_before_optimizer_step(optimizer)
        clip = trainer.options.gradient_clip_val
        if clip is not None:
            strategy.clip_gradients(trainer.model, optimizer, clip, trainer.options.gradient_clip_algorithm)
        return loss

    strategy.optimizer_step(optimizer, closure)
    finish_step(loop, optimizer)
    return last[0]


def backward(loop: FitLoop, loss: Tensor) -> None:
    """Backward through the strategy (precision scaling, DDP's gradient sync), between its hooks."""
    hooks = loop.trainer.hooks
    hooks.on_before_backward(loss)
    loop.trainer.strategy.backward(loss)
    hooks.on_after_backward()


def optimizer_step(loop: FitLoop, optimizer: Optimizer, closure: Any = None) -> Any:
    """Unscale, clip, step, zero the gradients, count the step, step schedulers.

    Returns what ``optimizer.step`` returned (the closure's loss, when a manual step passed one).
    """
    trainer = loop.trainer
    strategy, hooks = trainer.strategy, trainer.hooks
    automatic = loop.module.automatic_optimization
    strategy.precision.unscale_gradients(optimizer)
    hooks.on_before_optimizer_step(optimizer)
    clip = trainer.options.gradient_clip_val if automatic else None  # manual: the module clips (clip_gradients)
    if clip is not None:
        strategy.clip_gradients(trainer.model, optimizer, clip, trainer.options.gradient_clip_algorithm)
    result = strategy.optimizer_step(optimizer, closure)
    finish_step(loop, optimizer, automatic)
    return result


def finish_step(loop: FitLoop, optimizer: Optimizer, automatic: bool = True) -> None:
    """After ``optimizer.step()``, in every step body: ``on_before_zero_grad`` and ``zero_grad`` (automatic
    optimization; under manual optimization the module zeroes and steps its schedulers), the step counted,
    step-interval schedulers stepped."""
    if automatic:
        loop.trainer.hooks.on_before_zero_grad(optimizer)
        optimizer.zero_grad(set_to_none=True)
    loop.state.count_step()
    if automatic and loop.lr_scheduler_configs:
        step_schedulers(loop, "step")


def step_schedulers(loop: FitLoop, interval: str, plateau: bool | None = None) -> None:
    """Step every scheduler with this interval whose frequency divides the step/epoch count; with `plateau`
    True or False, only those that do (or do not) read a monitored metric (``ReduceLROnPlateau``)."""
    trainer, state = loop.trainer, loop.state
    count = state.global_step if interval == "step" else state.epoch + 1
    for config in loop.lr_scheduler_configs:
        if config.interval != interval or count % config.frequency:
            continue
        if plateau is not None and config.needs_metric != plateau:
            continue
        if config.needs_metric:
            assert config.monitor is not None
            value = trainer.callback_metrics.get(config.monitor)
            if value is None:
                if config.strict:
                    raise KeyError(
                        f"ReduceLROnPlateau monitors {config.monitor!r}, which was not logged; "
                        f"logged metrics: {sorted(trainer.callback_metrics)}"
                    )
                continue
            config.scheduler.step(value)  # type: ignore[arg-type]
        else:
            config.scheduler.step()  # type: ignore[call-arg]


def loss_of(output: Any) -> Tensor | None:
    """The loss in a training step's output (None to skip the step); a clear error for anything else."""
    loss: Any
    if type(output) is Tensor:  # the common case first: an ABC isinstance check costs a microsecond
        loss = output
    elif output is None:
        return None
    else:
        loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise TypeError(
            "training_step must return a scalar loss tensor, a dict with a 'loss' tensor, or None; "
            f"got {type(output).__qualname__}" + (" without a 'loss' tensor" if isinstance(output, Mapping) else "")
        )
    if loss.ndim != 0:
        raise ValueError(
            f"training_step returned a loss of shape {tuple(loss.shape)}; it must be a scalar. "
            "Reduce it (e.g. loss.mean()) or use a loss with reduction='mean'."
        )
    if not loss.requires_grad:
        raise RuntimeError(
            "the loss returned by training_step does not require grad: it was detached or computed "
            "under torch.no_grad(); return the loss straight from the loss function"
        )
    return loss


def detached(output: Any) -> Any:
    """A training step's output for ``on_train_batch_end``: the loss as ``{"loss": ...}``, tensors detached."""
    if isinstance(output, Tensor):
        return {"loss": output.detach()}
    if isinstance(output, Mapping):
        return {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in output.items()}
    return output

"""The loops: fit (epochs of batches with validation) and evaluation (validate/test/predict).

Every hook call site is in this file or in `optimization.py`; the order is
documented in docs/hooks.md and pinned by tests/unit/trainer/test_hook_order.py.
"""

from __future__ import annotations

import math
import random
import sys
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ember.trainer.checkpointing import at_boundary, save_stop_point
from ember.trainer.data import EpochPlan, limited
from ember.trainer.data_position import open_rest_of_epoch, same_layout
from ember.trainer.optimization import (
    detached,
    loss_of,
    optimizer_step,
    run_training_batch,
    step_schedulers,
    steps_are_plain,
)
from ember.trainer.resume import (
    capture_epoch_start,
    islice_from,
    open_positioned,
    open_resumed_epoch,
    restore_loader_generators,
    restore_rng,
    reuses_workers,
    warn_if_workers_miss_set_epoch,
)

if TYPE_CHECKING:
    from ember.modules.module import TrainingModule
    from ember.trainer.trainer import Trainer


def run_fit(trainer: Trainer, module: TrainingModule, train_loader: Any, val_loaders: list[Any]) -> None:
    hooks = trainer.hooks
    hooks.on_fit_start()
    steps = math.inf if trainer.num_sanity_val_steps == -1 else trainer.num_sanity_val_steps
    sanity_limits = [min(steps, n) for n in trainer.num_val_batches]  # limit_val_batches caps it
    if any(sanity_limits):
        trainer.sanity_checking = True
        try:
            hooks.on_sanity_check_start()
            validate_in_fit(trainer, module, val_loaders, sanity_limits)
            hooks.on_sanity_check_end()
        finally:
            trainer.sanity_checking = False
    warn_if_workers_miss_set_epoch(train_loader)
    module.train()
    hooks.on_train_start()
    trainer._in_train_loop = True
    try:
        while not trainer._fit_is_done():
            run_train_epoch(trainer, module, train_loader, val_loaders)
    finally:
        trainer._in_train_loop = False
    hooks.on_train_end()
    hooks.on_fit_end()


def run_train_epoch(trainer: Trainer, module: TrainingModule, loader: Any, val_loaders: list[Any]) -> None:
    hooks, progress, collector = trainer.hooks, trainer.progress, trainer.train_collector
    plan: EpochPlan = trainer.epoch_plan
    validates = any(trainer.num_val_batches) and (progress.epoch + 1) % trainer.check_val_every_n_epoch == 0
    start = progress.batch_idx  # > 0 only when resuming inside this epoch
    if start == 0:
        collector.start_epoch("train")
        progress.validated_after = -1
    hooks.on_train_epoch_start()
    iterator = open_epoch(trainer, loader, start)
    start = progress.batch_idx  # renumbered when the rest of an epoch is split across another world size
    batches = islice_from(iterator, start, plan.num_batches)
    if trainer.profiler is not None:  # once per epoch: the batches' fetch times (ember/tuning/profiler.py)
        batches = trainer.profiler.time_batches(batches)
    plain = steps_are_plain(trainer, module)  # decided after the epoch-start hooks, which may change the options
    (run_plain_batches if plain else run_batches)(trainer, module, batches, val_loaders if validates else None)
    if progress.batch_idx == plan.num_batches == loader_length(loader):  # the whole epoch, not cut by a limit
        finish_epoch(iterator, loader)
    if trainer._window_has_grads:  # a loader without a length ended inside an accumulation window
        optimizer_step(trainer, trainer.optimizers[0])
    last = progress.batch_idx - 1
    if validates and last >= 0 and progress.validated_after != last:  # stopped early: evaluate the final weights
        validate_after(trainer, module, val_loaders, last)
    epoch_values = collector.epoch_values()
    trainer._epoch_metrics.update(epoch_values)  # visible in on_train_epoch_end and to epoch schedulers
    hooks.on_train_epoch_end()
    trainer._log_epoch_metrics({**epoch_values, **collector.epoch_values()})  # + values logged in the hook
    if trainer._automatic:
        step_schedulers(trainer, "epoch")
    progress.epoch += 1
    progress.batch_idx = 0
    at_boundary(trainer, module)


def run_batches(trainer: Trainer, module: TrainingModule, batches: Any, val_loaders: list[Any] | None) -> None:
    """An epoch's training batches, with every hook and option. `val_loaders` is None when it does not validate."""
    hooks, progress, collector, plan = trainer.hooks, trainer.progress, trainer.train_collector, trainer.epoch_plan
    to_device, log_every = trainer.strategy.batch_to_device, trainer.log_every_n_steps
    wants_outputs = hooks.implemented("on_train_batch_end")
    for batch_idx, batch in batches:
        batch = to_device(batch)
        collector.current_batch = batch
        hooks.on_train_batch_start(batch, batch_idx)
        steps_before = progress.global_step
        ends_window = plan.ends_window(batch_idx)
        output = run_training_batch(trainer, module, batch, batch_idx, plan.window_size(batch_idx), ends_window)
        progress.batch_idx = batch_idx + 1
        if progress.global_step != steps_before and progress.global_step % log_every == 0:
            trainer._log_metrics(trainer._step_metrics())
        hooks.on_train_batch_end(detached(output) if wants_outputs else None, batch, batch_idx)
        if val_loaders is not None and plan.validates_after(batch_idx):
            validate_after(trainer, module, val_loaders, batch_idx)
        if ends_window and window_ended(trainer, module, batch_idx):
            break


def run_plain_batches(trainer: Trainer, module: TrainingModule, batches: Any, val_loaders: list[Any] | None) -> None:
    """`run_batches` when `steps_are_plain`.

    The same work in the same order, without the calls that would all be
    no-ops: each batch is its hooks, one ``training_step``, ``backward()``,
    ``step()`` and ``zero_grad()``. Equivalence with `run_batches` is pinned by
    tests/unit/trainer/test_plain_loop.py.
    """
    hooks, progress, collector, plan = trainer.hooks, trainer.progress, trainer.train_collector, trainer.epoch_plan
    starts, ends = hooks.implemented("on_train_batch_start"), hooks.implemented("on_train_batch_end")
    strategy = trainer.strategy
    to_device = None if strategy.batches_stay_put else strategy.batch_to_device
    training_step, optimizer, log_every = module.training_step, trainer.optimizers[0], trainer.log_every_n_steps
    step_schedulers_due = any(config.interval == "step" for config in trainer.lr_scheduler_configs)
    for batch_idx, batch in batches:
        if to_device is not None:
            batch = to_device(batch)
        collector.current_batch = batch
        if starts:
            hooks.on_train_batch_start(batch, batch_idx)
        output = training_step(batch, batch_idx)
        loss = output if type(output) is Tensor else loss_of(output)
        if loss is not None:
            try:
                loss.backward()
            except RuntimeError:
                loss_of(output)  # a loss that is not a scalar or has no graph: ember's clearer error
                raise
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            progress.global_step += 1
            if step_schedulers_due:
                step_schedulers(trainer, "step")
        progress.batch_idx = batch_idx + 1
        if loss is not None and progress.global_step % log_every == 0:
            trainer._log_metrics(trainer._step_metrics())
        if ends:
            hooks.on_train_batch_end(detached(output), batch, batch_idx)
        if val_loaders is not None and plan.validates_after(batch_idx):
            validate_after(trainer, module, val_loaders, batch_idx)
        if window_ended(trainer, module, batch_idx):
            break


def window_ended(trainer: Trainer, module: TrainingModule, batch_idx: int) -> bool:
    """A step boundary after `batch_idx`: write pending checkpoints, act on preemption; whether to stop the epoch."""
    at_boundary(trainer, module)
    if not trainer._should_stop_in_epoch():
        return False
    if not trainer.epoch_plan.is_last(batch_idx):  # cut short: `last` must name this step, not the epoch end
        save_stop_point(trainer, module)
    return True


def open_epoch(trainer: Trainer, loader: Any, start: int) -> Iterator[Any]:
    """The epoch's batch iterator; on resume, positioned after `start` batches with the step's RNG restored."""
    resumed, trainer._resume_state = trainer._resume_state, None
    epoch = trainer.progress.epoch
    same_world = same_layout(resumed, trainer.strategy)
    if start == 0 and resumed is not None:  # at an epoch boundary: the state the last epoch left, then set_epoch
        restore_rng(resumed["rng"])
        if "loader_generators" in resumed:
            restore_loader_generators(loader, resumed["loader_generators"], strict=same_world)
        if "dataset" in resumed and same_world:  # an iterable dataset's own position (an epoch cut by
            loader.dataset.load_state_dict(resumed["dataset"])  # limit_train_batches leaves it mid-stream)
    set_epoch(loader, epoch)
    if start == 0:
        trainer.epoch_start_state = capture_epoch_start(loader)
        if resumed is not None and reuses_workers(loader, epoch):
            return open_positioned(loader, 0, trainer.epoch_start_state, epoch)
        return iter(loader)
    assert resumed is not None, "a run inside an epoch always comes from a checkpoint"
    if not same_world:  # the rest of the epoch, split across this run's processes
        return open_rest_of_epoch(trainer, loader, resumed, start)
    return open_resumed_epoch(loader, start, trainer.epoch_start_state, resumed, epoch)


def finish_epoch(iterator: Iterator[Any], loader: Any) -> None:
    """Ask the epoch's iterator once more after its last batch, as a ``for`` loop over the loader does.

    That call ends the sampler's iteration, which may still draw: when the dataset size is a multiple
    of the batch size, the last batch is complete before ``RandomSampler.__iter__`` has run to its end,
    and its final ``torch.randperm(n, generator=...)`` advances the loader's generator. Without it every
    later epoch is shuffled differently from a plain loop's. Runs only for an epoch that reached its
    last batch and was not cut short by ``limit_train_batches`` (one call per epoch, outside the step loop).
    """
    extra = next(iterator, _END)
    if extra is not _END:
        warnings.warn(
            f"the training DataLoader yielded more batches than its len() ({loader_length(loader)}); ember used "
            "the first len() of them in this epoch. Make the dataset's __len__ match what it yields.",
            RuntimeWarning,
            stacklevel=2,
        )


_END = object()


def loader_length(loader: Any) -> float:
    """``len(loader)``, or inf for a loader without a length."""
    try:
        return len(loader)
    except TypeError:
        return math.inf


def set_epoch(loader: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the dataset and samplers that have it (seeded augmentation, distributed)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    targets = {id(obj): obj for obj in (getattr(loader, "dataset", None), *owners[1:]) if obj is not None}
    for obj in targets.values():
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)


def validate_after(trainer: Trainer, module: TrainingModule, loaders: list[Any], batch_idx: int) -> None:
    """The validation due after training batch `batch_idx` (recorded first, so a checkpoint inside counts it)."""
    trainer.progress.validated_after = batch_idx
    validate_in_fit(trainer, module, loaders, trainer.num_val_batches)


def validate_in_fit(trainer: Trainer, module: TrainingModule, loaders: list[Any], limits: list[float]) -> None:
    """Validation inside fit, leaving every random stream as it found it.

    Iterating a DataLoader without its own ``generator`` draws a seed from the
    global torch RNG, and a validation step may draw too; restoring the state
    keeps training (dropout, augmentation, shuffling) identical to a run that
    never validates.
    """
    py_state, np_state = random.getstate(), _numpy_state()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            run_evaluation(trainer, module, "validation", loaders, limits)
    finally:
        random.setstate(py_state)
        if np_state is not None:
            sys.modules["numpy"].random.set_state(np_state)


def _numpy_state() -> Any:
    np = sys.modules.get("numpy")  # only if the program uses numpy at all
    return np.random.get_state() if np is not None else None


_STEP_METHOD = {"validation": "validation_step", "test": "test_step", "predict": "predict_step"}


def run_evaluation(
    trainer: Trainer, module: TrainingModule, stage: str, loaders: list[Any], limits: list[float]
) -> list[Any]:
    """Run `stage` ("validation", "test" or "predict") over `loaders`.

    Returns the predictions per dataloader for "predict", else one dict of
    epoch metrics (floats) per dataloader. Train/eval mode of every submodule
    is restored afterwards, so a backbone frozen in eval mode stays that way.
    """
    hooks, collector = trainer.hooks, trainer.eval_collector
    step_fn = getattr(module, _STEP_METHOD[stage])
    trainer.num_eval_batches = list(limits)  # progress bars show n/total
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    trainer.collector = collector
    try:  # an exception (a KeyboardInterrupt included) leaves the collector and the modes as they were
        collector.start_epoch(stage)
        predictions: list[list[Any]] = [[] for _ in loaders]
        hooks.on_eval_start(stage)
        hooks.on_eval_epoch_start(stage)
        with torch.no_grad(), trainer.strategy.eval_context():
            for dl_idx, loader in enumerate(loaders):
                extra = (dl_idx,) if len(loaders) > 1 else ()
                collector.suffix = f"/dataloader_idx_{dl_idx}" if extra else ""
                for batch_idx, batch in enumerate(limited(loader, limits[dl_idx])):
                    batch = trainer.strategy.batch_to_device(batch)
                    collector.current_batch = batch
                    hooks.on_eval_batch_start(stage, batch, batch_idx, dl_idx)
                    with trainer.strategy.forward_context():
                        output = step_fn(batch, batch_idx, *extra)
                    if stage == "predict":
                        predictions[dl_idx].append(output)
                    hooks.on_eval_batch_end(stage, output, batch, batch_idx, dl_idx)
        hooks.on_eval_epoch_end(stage)
        results = trainer._finish_eval(collector.epoch_values(), len(loaders))
        hooks.on_eval_end(stage)
    finally:
        collector.suffix = ""
        collector.current_batch = None
        trainer.collector = trainer.train_collector
        for submodule, training in modes:
            submodule.training = training
    return predictions if stage == "predict" else results


class Clock:
    """Wall-clock budget for ``max_time`` (monotonic; checked at step boundaries)."""

    def __init__(self, max_time_s: float | None) -> None:
        self.max_time_s = max_time_s
        self.start = time.monotonic()

    def expired(self) -> bool:
        return self.max_time_s is not None and time.monotonic() - self.start >= self.max_time_s

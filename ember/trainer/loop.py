"""The fit loop: epochs of batches, validation cadence, stop conditions, and the fit's state.

`FitState` is where a fit stands (epoch, step, batch position, stop reason, what was last validated); only
this module writes it, and the trainer shows it read-only (``trainer.global_step``, ``trainer.progress``).
`FitLoop` is one ``Trainer.fit``: its loaders, epoch plan, optimizers and the resumed data position. The
epoch, batch, validation and checkpoint-boundary hook call sites are here; the hooks around backward and
the optimizer step are in `optimization` (one batch, one step), evaluation's in `evaluation`. The order of
every hook is documented in docs/hooks.md and pinned by tests/unit/trainer/test_hook_order.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.checkpoint.data_position import open_rest_of_epoch, same_layout
from ember.checkpoint.registry import restore_snapshot
from ember.checkpoint.resume import (
    capture_epoch_start,
    dropping,
    drops_at_sampler,
    islice_from,
    open_positioned,
    open_resumed_epoch,
    restore_loader_generators,
    restore_rng,
    reuses_workers,
    warn_if_workers_miss_set_epoch,
)
from ember.trainer.boundary import at_boundary, save_last, save_stop_point
from ember.trainer.data import (
    EpochPlan,
    batch_transfer,
    check_not_empty,
    finish_epoch,
    loader_length,
    num_batches,
    release_workers,
    resolve_loaders,
    set_epoch,
    unshuffled,
)
from ember.trainer.evaluation import isolated_rng, validate_in_fit
from ember.trainer.optimization import (
    ManualSteps,
    build_optimizers,
    closure_training_batch,
    detached,
    optimizer_step,
    plain_step,
    run_training_batch,
    step_schedulers,
)
from ember.trainer.rewind import (
    Rewind,
    TooManyRewinds,
    epoch_start_of,
    kept_batches,
    positions_to_skip,
    samples_of,
    snapshot_position,
)

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from ember.modules.module import TrainingModule
    from ember.modules.optimizers import SchedulerConfig
    from ember.trainer.trainer import Trainer

#: A training step for one batch: ``step(batch, batch_idx) -> training_step's output``.
StepFn = Callable[[Any, int], Any]


#: Why a fit stopped (`FitState.stop_reason`).
STOP_REASONS = ("max_epochs", "max_steps", "max_time", "should_stop")


@dataclass
class FitState:
    """Where a trainer's fits stand. Written by this module alone; checkpointed (the first five fields).

    - ``epoch``: index of the current training epoch (0-based).
    - ``global_step``: optimizer steps taken since the run began.
    - ``batches_that_stepped``: the loggers' step axis, Lightning's: accumulation windows that ended with an
      optimizer step (automatic optimization) or that ended at all (manual optimization, whether the module
      stepped 0, 1 or several optimizers in it). Under automatic optimization it equals ``global_step``; under
      manual optimization with two ``step()`` calls per batch (a GAN) it counts batches, ``global_step`` steps.
    - ``batch_idx``: micro-batches finished in the current epoch.
    - ``validated_after``: index of the batch after which validation last ran in this epoch (-1: not yet),
      so a resumed run neither repeats nor skips it.
    - ``stop_reason``: why the most recent fit stopped (one of `STOP_REASONS`; None while it runs).
    - ``should_stop``: a stop asked for by a hook (``trainer.should_stop = True``), honoured at the next
      step boundary once ``min_epochs`` / ``min_steps`` are done.
    - ``sanity_checking``: whether the sanity-check validation runs.
    - ``window_has_grads``: whether the open accumulation window has gradients no optimizer step used yet.
    - ``resumed_finished``: whether the most recent fit resumed a run that had already finished (nothing to do).
    - ``skipped``: the batch positions left out of training, by epoch (rewinds, ``trainer.rewind``): each epoch's
      iterator leaves them out, also after a resume.
    """

    epoch: int = 0
    global_step: int = 0
    batches_that_stepped: int = 0
    batch_idx: int = 0
    validated_after: int = -1
    stop_reason: str | None = None
    should_stop: bool = False
    sanity_checking: bool = False
    window_has_grads: bool = False
    resumed_finished: bool = False
    skipped: dict[int, frozenset[int]] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "batches_that_stepped": self.batches_that_stepped,
            "batch_idx": self.batch_idx,
            "validated_after": self.validated_after,
            "skipped_batches": self.skipped_positions(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        # absent from checkpoints of older versions: their loggers' axis was the optimizer steps
        self.batches_that_stepped = int(state.get("batches_that_stepped", self.global_step))
        self.batch_idx, self.validated_after = int(state["batch_idx"]), int(state["validated_after"])
        self.skipped = {}
        self.skip_batches(state.get("skipped_batches", []))  # absent from checkpoints of older versions

    def skipped_positions(self) -> list[list[int]]:
        """The left-out batch positions as ``[[epoch, batch_idx], ...]``, in order."""
        return [[epoch, b] for epoch in sorted(self.skipped) for b in sorted(self.skipped[epoch])]

    def skip_batches(self, positions: Any) -> None:
        """Leave the batches at these ``(epoch, batch_idx)`` positions out of training from now on."""
        for epoch, batch_idx in positions:
            self.skipped[int(epoch)] = self.skipped.get(int(epoch), frozenset()) | {int(batch_idx)}

    def skipped_in(self, epoch: int) -> frozenset[int]:
        return self.skipped.get(epoch, frozenset())

    def request_stop(self, value: bool) -> None:
        """``trainer.should_stop = value`` (the one field hooks set, through the trainer)."""
        self.should_stop = bool(value)

    def begin_run(self) -> None:
        """A new fit/validate/test/predict: no stop asked for yet."""
        self.should_stop, self.stop_reason, self.resumed_finished = False, None, False

    def add_gradients(self) -> None:
        """A backward ran inside the open accumulation window."""
        self.window_has_grads = True

    def count_step(self) -> None:
        """An optimizer step was taken: its gradients are used."""
        self.global_step += 1
        self.window_has_grads = False

    def count_batch_that_stepped(self) -> int:
        """A batch ended a window that counts on the loggers' axis (see ``batches_that_stepped``); the new count."""
        self.batches_that_stepped += 1
        return self.batches_that_stepped


def stop_point(state: FitState, max_epochs: int | None, max_steps: int) -> str:
    """Where a fit stands against its stop conditions: ``"20/20 epochs done"`` or ``"step 500/500"`` (counts),
    else the current epoch, numbered from 0 as in checkpoint names: ``"epoch 3, step 69"``."""
    if max_epochs is not None and state.epoch >= max_epochs:
        return f"{state.epoch}/{max_epochs} epochs done"
    if 0 <= max_steps <= state.global_step:
        return f"step {state.global_step}/{max_steps}"
    return f"epoch {state.epoch}, step {state.global_step}"


class Clock:
    """Wall-clock budget for ``max_time`` (monotonic; checked at step boundaries)."""

    def __init__(self, max_time_s: float | None) -> None:
        self.max_time_s = max_time_s
        self.start = time.monotonic()

    def expired(self) -> bool:
        return self.max_time_s is not None and time.monotonic() - self.start >= self.max_time_s


def fit_loaders(
    trainer: Trainer, module: TrainingModule, train: Any, val: Any, datamodule: Any
) -> tuple[Any, list[Any]]:
    """A fit's training loader and validation loaders: given, the datamodule's, or the module's.

    ``val_dataloader()`` is asked first, with every random stream put back afterwards, then
    ``train_dataloader()``: the order and the isolation of Lightning, which asks for the validation loaders inside
    its sanity check's isolated random state. A ``*_dataloader()`` that draws from the global generator (building a
    random dataset, say) so leaves training's streams where Lightning leaves them.
    """
    with isolated_rng():
        val_loaders = resolve_loaders("validation", val, datamodule, module)
    train_loaders = resolve_loaders("train", train, datamodule, module)
    if not train_loaders:
        raise ValueError(
            "fit needs training data: pass train_dataloaders, a datamodule with train_dataloader(), or define "
            "train_dataloader() on the module"
        )
    if len(train_loaders) > 1:
        raise ValueError("fit takes one training dataloader; combine datasets into one loader")
    return (unshuffled(train_loaders[0]) if trainer.options.overfit_batches else train_loaders[0]), val_loaders


class FitLoop:
    """One ``Trainer.fit``: its loaders, its epoch plan and the state the loop keeps while it runs."""

    def __init__(
        self,
        trainer: Trainer,
        module: TrainingModule,
        train_loader: Any,
        val_loaders: list[Any],
        plan: EpochPlan,
        num_val_batches: list[float],
    ) -> None:
        self.trainer, self.module = trainer, module
        self.train_loader, self.val_loaders = train_loader, val_loaders
        self.plan, self.num_val_batches = plan, num_val_batches
        #: The trainer's `FitState`: this loop writes it.
        self.state = trainer.progress
        #: What ``configure_optimizers`` returned (`setup_optimizers`), and what manual optimization calls.
        self.optimizers: list[Optimizer] = []
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.manual: ManualSteps | None = None
        #: Whether the optimizer evaluates the loss itself (``step(closure)``, e.g. LBFGS).
        self.steps_with_closure = False
        #: True while epochs run (between ``on_train_start`` and ``on_train_end``): saves wait for a boundary.
        self.running = False
        self.clock = Clock(trainer.options.max_time_s)
        self.max_steps = trainer.options.max_steps  # read at every step boundary: options are frozen
        #: The checkpoint fit resumed from, and this process's state from it (until the first epoch opens).
        self.resumed_from: Path | None = None
        self.resume_state: dict[str, Any] | None = None
        #: Generator states the current epoch's DataLoader iterator drew from (for exact resume).
        self.epoch_start_state: dict[str, Any] | None = None
        #: Where the loaders came from (given loaders, the datamodule): what `reload_loaders` asks again.
        self.sources: tuple[Any, Any, Any] = (train_loader, val_loaders, None)
        options = trainer.options
        self.min_epochs, self.min_steps = options.min_epochs or 0, options.min_steps or 0
        #: A rewind asked for (``trainer.rewind``), applied at the next step boundary; whether one just was.
        self.rewinding: Rewind | None = None
        self.rewound = False
        #: The batches (positions) of each epoch of unknown length that ended, once its data ran out: where a rewind
        #: to a snapshot taken in it crosses into the next epoch.
        self.ended_lengths: dict[int, int] = {}

    @classmethod
    def build(cls, trainer: Trainer, module: TrainingModule, train: Any, val: Any, datamodule: Any) -> FitLoop:
        """The loop of a fit: its loaders (given, the datamodule's, or the module's; distributed by the strategy),
        its epoch plan and its validation sizes. Every process must train on the same number of batches."""
        train_loader, val_loaders = fit_loaders(trainer, module, train, val, datamodule)
        loop = cls(trainer, module, train_loader, [], EpochPlan(0, 1, math.inf), [])
        loop.sources = (train, val, datamodule)
        loop.distribute(train_loader, val_loaders)
        return loop

    def setup_optimizers(self) -> None:
        """Run ``configure_optimizers`` (`optimization.build_optimizers`); manual optimization's calls go
        through this loop's `optimization.ManualSteps`."""
        self.optimizers, self.lr_scheduler_configs, self.steps_with_closure = build_optimizers(self.module, self.plan)
        self.manual = ManualSteps(self)

    def resume_from(self, path: Path, rank_state: dict[str, Any]) -> None:
        """Keep this process's state from checkpoint `path` (random streams, data position) for when the first
        epoch opens (`open_epoch`)."""
        self.resumed_from, self.resume_state = path, rank_state
        self.epoch_start_state = rank_state.get("epoch_start")
        self.state.resumed_finished = self.is_done()

    def distribute(self, train_loader: Any, val_loaders: list[Any]) -> None:
        """Take these loaders (distributed by the strategy) and plan the epoch over them."""
        options, strategy = self.trainer.options, self.trainer.strategy
        check_not_empty("train", [train_loader])
        check_not_empty("validation", val_loaders)
        self.train_loader = strategy.distribute_loader(train_loader, training=True)
        self.val_loaders = [strategy.distribute_loader(v, training=False) for v in val_loaders]
        count = num_batches(self.train_loader, options.limit_train_batches, "limit_train_batches")
        self.plan = EpochPlan.build(count, options.accumulate_grad_batches, options.val_check_interval)
        strategy.check_same_batch_count(self.plan.num_batches)
        self.num_val_batches = [
            num_batches(v, options.limit_val_batches, "limit_val_batches") for v in self.val_loaders
        ]

    def reload_loaders(self) -> None:
        """``reload_dataloaders_every_n_epochs``: ask the datamodule (or the module) for fresh loaders."""
        train, val, datamodule = self.sources
        release_workers([self.train_loader, *self.val_loaders])
        self.distribute(*fit_loaders(self.trainer, self.module, train, val, datamodule))

    # --- stop conditions ---------------------------------------------------------------------
    def stops_where_data_ran_out(self) -> bool:
        """Whether the fit stops at the step boundary where data of unknown length just ran out (the batch loop
        ended without a stop of its own, which would have called ``on_train_stop``): in its last epoch
        (``max_epochs``), or because a stop holds now (``max_steps`` reached by the step of a last, partial
        accumulation window, a ``should_stop`` asked for in a batch that ended no window)."""
        max_epochs = self.trainer.max_epochs
        return not math.isfinite(self.plan.num_batches) and (
            (max_epochs is not None and self.state.epoch + 1 >= max_epochs) or self.should_stop_in_epoch()
        )

    def epoch_length(self, epoch: int) -> float:
        """The number of batches (positions) of `epoch`: the plan's, or for data of unknown length, where the epoch
        ended (inf while it has not)."""
        num_batches = self.plan.num_batches
        return num_batches if math.isfinite(num_batches) else self.ended_lengths.get(epoch, math.inf)

    def should_stop_in_epoch(self) -> bool:
        state = self.state
        return (
            (state.should_stop and self.can_stop_early())
            or 0 <= self.max_steps <= state.global_step
            or (self.clock.max_time_s is not None and self.clock.expired())
        )

    def stop_reason(self) -> str | None:
        """Which stop condition holds now (one of `STOP_REASONS`), or None."""
        state, max_epochs = self.state, self.trainer.max_epochs
        if max_epochs is not None and state.epoch >= max_epochs:
            return "max_epochs"
        if 0 <= self.max_steps <= state.global_step:
            return "max_steps"
        if self.clock.max_time_s is not None and self.clock.expired():
            return "max_time"
        return "should_stop" if state.should_stop and self.can_stop_early() else None

    def can_stop_early(self) -> bool:
        """Whether ``should_stop`` may end the fit: ``min_epochs`` and ``min_steps`` are done."""
        return self.state.epoch >= self.min_epochs and self.state.global_step >= self.min_steps

    def is_done(self) -> bool:
        max_epochs = self.trainer.max_epochs
        return (max_epochs is not None and self.state.epoch >= max_epochs) or self.should_stop_in_epoch()

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        trainer, module, hooks = self.trainer, self.module, self.trainer.hooks
        hooks.on_fit_start()
        steps = math.inf if trainer.num_sanity_val_steps == -1 else trainer.num_sanity_val_steps
        sanity_limits = [min(steps, n) for n in self.num_val_batches]  # limit_val_batches caps it
        if any(sanity_limits):
            self.state.sanity_checking = True
            try:
                hooks.on_sanity_check_start()
                validate_in_fit(trainer, module, self.val_loaders, sanity_limits, sanity_check=True)
                hooks.on_sanity_check_end()
            finally:
                self.state.sanity_checking = False
        warn_if_workers_miss_set_epoch(self.train_loader)
        module.train()
        hooks.on_train_start()
        self.running = True
        try:
            while self.rewound or not self.is_done():  # a rewound epoch reopens, also when a stop holds
                self.rewound = False
                self.run_epoch()
        finally:
            self.running = False
        self.state.stop_reason = self.stop_reason()
        trainer.strategy.settle()  # nothing in flight while on_train_end runs (a profiler may stop there)
        hooks.on_train_end()
        hooks.on_fit_end()

    def run_epoch(self) -> None:
        trainer, module, progress, plan = self.trainer, self.module, self.state, self.plan
        hooks, collector = trainer.hooks, trainer.reporter.train_collector
        start = progress.batch_idx  # > 0 only when resuming inside this epoch
        reload_every = trainer.reload_dataloaders_every_n_epochs
        if reload_every and start == 0 and progress.epoch > 0 and progress.epoch % reload_every == 0:
            self.reload_loaders()
        validates = any(self.num_val_batches) and (progress.epoch + 1) % trainer.check_val_every_n_epoch == 0
        if start == 0:
            collector.start_epoch("train")
            progress.validated_after = -1
        hooks.on_train_epoch_start()
        drop = progress.skipped_in(progress.epoch)  # batches a rewind left out (ember/trainer/rewind.py)
        iterator = self.open_epoch(start, drop)
        start = progress.batch_idx  # renumbered when the rest of an epoch is split across another world size
        if drop:
            batches = kept_batches(iterator, start, plan.num_batches, drop, drops_at_sampler(self.train_loader))
        else:
            batches = islice_from(iterator, start, plan.num_batches)
        if trainer.profiler is not None:  # once per epoch: the batches' fetch times (ember/tuning/profiler.py)
            batches = trainer.profiler.time_batches(batches)
        ran_out = self.run_batches(batches, validates)
        if self.rewound:  # the fit went back to a snapshot: this epoch reopens there (`run`, `apply_rewind`)
            return
        if ran_out and not math.isfinite(plan.num_batches):
            self.ended_lengths[progress.epoch] = progress.batch_idx
        if (
            drop
            and progress.batch_idx < plan.num_batches < math.inf  # an iterable of unknown length just ended
            and drop.issuperset(range(progress.batch_idx, int(plan.num_batches)))
        ):
            progress.batch_idx = int(plan.num_batches)  # the epoch's last batches were left out: it is done
            if self.steps_epoch_schedulers_in_batches():
                step_schedulers(self, "epoch", plateau=False)
        if progress.batch_idx == plan.num_batches == loader_length(self.train_loader):  # not cut by a limit
            finish_epoch(iterator, self.train_loader)
        if progress.window_has_grads:  # a loader without a length ended inside an accumulation window
            optimizer_step(self, self.optimizers[0])
        if ran_out and self.stops_where_data_ran_out():  # a last step boundary known only now: before validation
            trainer.hooks.on_train_stop()
            if self.rewinding is not None:  # back to a snapshot: the epoch reopens there (`run`)
                self.apply_rewind()
                return
        last = progress.batch_idx - 1
        if validates and last >= 0 and progress.validated_after != last:  # stopped early: evaluate the final weights
            self.validate_after(last)
        reporter = trainer.reporter
        epoch_values = collector.epoch_values()
        reporter.epoch_metrics.update(epoch_values)  # visible in on_train_epoch_end and to epoch schedulers
        hooks.on_train_epoch_end()
        reporter.log_epoch_metrics({**epoch_values, **collector.epoch_values()})  # + values logged in the hook
        if module.automatic_optimization:  # those that read no metric stepped after the last batch, if it ran
            stepped = self.steps_epoch_schedulers_in_batches() and progress.batch_idx == plan.num_batches
            step_schedulers(self, "epoch", plateau=True if stepped else None)
        progress.epoch += 1
        progress.batch_idx = 0
        at_boundary(trainer, module)

    def run_batches(self, batches: Any, validates: bool) -> bool:
        """An epoch's training batches: the one batch loop. Returns whether it ran to the batches' end (False: it
        stopped or rewound at a step boundary).

        What each batch calls is decided here, once per epoch, after the epoch-start hooks: a hook nobody
        implements is None, the step is `optimization.plain_step` when everything but ``training_step``,
        ``backward()`` and ``step()`` would be a no-op (tests/unit/trainer/test_plain_loop.py pins that
        both give the same run), else `optimization.run_training_batch`.
        """
        trainer, progress, plan, hooks = self.trainer, self.state, self.plan, self.trainer.hooks
        collector, reporter = trainer.reporter.train_collector, trainer.reporter
        to_device = batch_transfer(trainer, self.module)
        batch_start = hooks.bound("on_train_batch_start")
        batch_end = hooks.bound("on_train_batch_end")
        step = self.resolve_step()
        log_every, log, step_metrics = trainer.log_every_n_steps, reporter.log_metrics, reporter.step_metrics
        see = collector.see
        epoch_schedulers = self.steps_epoch_schedulers_in_batches()  # as in Lightning: before on_train_batch_end
        validate_after = self.validate_after if validates else None
        accumulate, last = plan.accumulate, plan.num_batches - 1  # plan.ends_window, inlined
        manual = not self.module.automatic_optimization  # every window counts for the loggers, stepped or not
        counts = progress.count_batch_that_stepped
        for batch_idx, batch in batches:
            if to_device is not None:
                batch = to_device(batch)
            see(batch)
            if batch_start is not None:
                batch_start(batch, batch_idx)
            steps_before = progress.global_step
            output = step(batch, batch_idx)
            progress.batch_idx = batch_idx + 1
            if epoch_schedulers and batch_idx == last:
                step_schedulers(self, "epoch", plateau=False)
            ends_window = (batch_idx + 1) % accumulate == 0 or batch_idx == last
            if (progress.global_step != steps_before or (manual and ends_window)) and counts() % log_every == 0:
                log(step_metrics())
            if batch_end is not None:
                batch_end(detached(output), batch, batch_idx)
            if validate_after is not None and plan.validates_after(batch_idx):
                validate_after(batch_idx)
            if ends_window and self.window_ended(batch_idx):
                return False
        return True

    def steps_epoch_schedulers_in_batches(self) -> bool:
        """Whether the epoch-interval schedulers that read no metric step right after the epoch's last batch,
        before its ``on_train_batch_end``, as Lightning steps them: under automatic optimization, when the epoch's
        length is known. Otherwise, and for ``ReduceLROnPlateau`` (which reads a metric of the epoch), or when
        the epoch was cut short before its last batch, they step at the epoch's end, after
        ``on_train_epoch_end``."""
        return self.module.automatic_optimization and math.isfinite(self.plan.num_batches)

    def resolve_step(self) -> StepFn:
        """The function that trains one batch this epoch (see `run_batches`)."""
        plain = plain_step(self)
        if plain is not None:
            return plain
        if self.steps_with_closure:
            return lambda batch, batch_idx: closure_training_batch(self, batch, batch_idx)
        plan = self.plan
        return lambda batch, batch_idx: run_training_batch(
            self, batch, batch_idx, plan.window_size(batch_idx), plan.ends_window(batch_idx)
        )

    def window_ended(self, batch_idx: int) -> bool:
        """A step boundary after `batch_idx`: apply a rewind asked for, write pending checkpoints, act on preemption;
        whether to leave the epoch's batch loop."""
        if self.rewinding is not None:
            self.apply_rewind()
            return True
        at_boundary(self.trainer, self.module)
        if not self.should_stop_in_epoch():
            return False
        self.trainer.hooks.on_train_stop()
        if self.rewinding is not None:  # asked for by the stop's hook (SpikeGuard's last check): back, then on
            self.apply_rewind()
            return True
        if not self.plan.is_last(batch_idx):  # cut short: `last` must name this step, not the epoch end
            save_stop_point(self.trainer, self.module)
        return True

    def validate_after(self, batch_idx: int) -> None:
        """The validation due after training batch `batch_idx` (recorded first, so a checkpoint inside counts it)."""
        self.state.validated_after = batch_idx
        validate_in_fit(self.trainer, self.module, self.val_loaders, self.num_val_batches)

    def request_rewind(self, rewind: Rewind) -> None:
        """``trainer.rewind``: go back to `rewind`'s snapshot at the next step boundary (`apply_rewind`)."""
        if not self.running:
            raise RuntimeError("trainer.rewind() works while a fit trains: call it from a training hook")
        self.rewinding = rewind

    def apply_rewind(self) -> None:
        """Go back to the snapshot of the rewind asked for: its training state restored, the batches it leaves out
        added to the skip list, the epoch reopened at its data position as a resume reopens it
        (ember/trainer/rewind.py).
        A rewind that stops saves a resumable ``last`` of the snapshot's state and raises `TooManyRewinds`."""
        rewind, self.rewinding = self.rewinding, None
        assert rewind is not None
        state, trainer, snapshot = self.state, self.trainer, rewind.snapshot
        kept = state.skipped_positions()
        restore_snapshot(trainer, self.module, snapshot)
        state.skip_batches(kept)  # the snapshot's progress predates them
        epoch, batch_idx, _ = snapshot_position(snapshot)
        epoch_start = snapshot.rank_state.get("epoch_start")
        if rewind.stop is None:
            rewind.skipped = positions_to_skip(
                self.plan.accumulate, self.epoch_length, epoch, batch_idx, rewind.steps, state.skipped_in
            )
            state.skip_batches(rewind.skipped)
            rewind.samples = samples_of(self.train_loader, epoch_start_of(snapshot), epoch, rewind.skipped)
        state.window_has_grads = False
        self.resume_state = {**snapshot.rank_state, "saved_world_size": trainer.strategy.world_size}
        self.epoch_start_state = epoch_start
        self.rewound = True
        if rewind.on_applied is not None:
            rewind.on_applied(rewind)
        if rewind.stop is not None:
            save_last(trainer, self.module, f"rewind-stop-step={state.global_step}")
            raise TooManyRewinds(rewind.stop)

    # --- the data of an epoch -------------------------------------------------------------------
    def open_epoch(self, start: int, drop: frozenset[int] = frozenset()) -> Iterator[Any]:
        """The epoch's batch iterator, without the batches at positions `drop` where the loader allows
        (`resume.dropping`); on resume, positioned after `start` batches with the step's RNG restored."""
        if not drop or not drops_at_sampler(self.train_loader):
            return self._open_epoch(start, 0)
        with dropping(self.train_loader, drop):
            return self._open_epoch(start, sum(1 for b in drop if b < start))

    def _open_epoch(self, start: int, dropped_before: int) -> Iterator[Any]:
        loader, trainer = self.train_loader, self.trainer
        resumed, self.resume_state = self.resume_state, None
        epoch = self.state.epoch
        same_world = same_layout(resumed, trainer.strategy)
        if start == 0 and resumed is not None:  # at an epoch boundary: the state the last epoch left, then set_epoch
            restore_rng(resumed["rng"])
            if "loader_generators" in resumed:
                restore_loader_generators(loader, resumed["loader_generators"], strict=same_world)
            if "dataset" in resumed and same_world:  # an iterable dataset's own position (an epoch cut by
                loader.dataset.load_state_dict(resumed["dataset"])  # limit_train_batches leaves it mid-stream)
        set_epoch(loader, epoch)
        if start == 0:
            self.epoch_start_state = capture_epoch_start(loader)
            if resumed is not None and reuses_workers(loader, epoch):
                return open_positioned(loader, 0, self.epoch_start_state, epoch)
            return iter(loader)
        assert resumed is not None, "a run inside an epoch always comes from a checkpoint"
        if not same_world:  # the rest of the epoch, split across this run's processes
            iterator, first, validated = open_rest_of_epoch(self, resumed, start)
            self.state.batch_idx, self.state.validated_after = first, validated
            return iterator
        return open_resumed_epoch(loader, start - dropped_before, self.epoch_start_state, resumed, epoch)

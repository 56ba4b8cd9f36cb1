"""`Trainer`: stores its options, then runs fit / validate / test / predict.

`__init__` checks and stores the options (`options.TrainerOptions`, readable as ``trainer.<name>``) and builds
what they name (the strategy, the profiler); the work happens in `fit` and friends. A run is `run.running`
(its setup kept in `run.RunState`); the fit loop is `loop.FitLoop` and where a fit stands is `loop.FitState`,
which only the loop writes; evaluation is `evaluation.run_evaluation`; the metrics path is
`reporting.Reporter`; checkpoints are `ember.checkpoint.manager.CheckpointManager`. The trainer's state is
read through properties; the one a hook sets is ``should_stop``."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.optim import Optimizer

from ember import stages
from ember.callbacks.callback import Callback
from ember.callbacks.callback_list import CallbackList
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint.manager import CheckpointManager, info
from ember.checkpoint.registry import TRAINING_ENTRIES, Snapshot, gather
from ember.checkpoint.snapshot_plan import SnapshotPlan
from ember.checkpoint.store import is_url, redact
from ember.loggers.logger import Logger
from ember.modules.datamodule import DataModule
from ember.modules.logging import MetricCollector
from ember.modules.module import TrainingModule
from ember.modules.optimizers import SchedulerConfig
from ember.strategies.strategy import Strategy
from ember.trainer import options, signals
from ember.trainer.arguments import (
    check_ckpt_path,
    check_fit,
    check_not_datamodule,
    check_weights_only,
    split_datamodule,
    the_module,
)
from ember.trainer.data import EpochPlan, as_list
from ember.trainer.evaluation import EvalProgress, evaluate
from ember.trainer.loop import FitLoop, FitState, stop_point
from ember.trainer.numerics import FiniteGuard
from ember.trainer.reporting import Reporter
from ember.trainer.rewind import Rewind
from ember.trainer.run import RunState, running
from ember.trainer.setup import record_hyperparameters, resolve_loggers

if TYPE_CHECKING:
    from ember.tuning.profiler import Profiler, ProfilerConfig

_NO_PLAN = EpochPlan(0, 1, float("inf"))
#: Lightning's names for trainer attributes that ember calls otherwise (the error names ember's).
_LIGHTNING_NAMES = {"lightning_module": "module", "lightning_optimizers": "optimizers"}


class Trainer:
    """Runs a `TrainingModule`: ``fit``, ``validate``, ``test``, ``predict``.

    Keywords follow Lightning's names where the idea is the same; see
    docs/trainer.md for each. Stopping: ``max_epochs`` (default 1000 when
    neither it nor ``max_steps`` is set), ``max_steps`` (optimizer steps),
    ``max_time`` (seconds, ``timedelta``, ``"DD:HH:MM:SS"`` or a dict of
    ``timedelta`` fields), or ``trainer.should_stop = True`` from any hook
    (honoured once ``min_epochs`` epochs and ``min_steps`` steps are done).
    Every option is readable as an attribute (``trainer.max_epochs``) and, all
    together, as ``trainer.options``.

    ``lightning_rng=True`` lets validation inside fit (not the sanity check) draw from the global
    random streams as Lightning's does (each new DataLoader iterator draws a seed), for bit-for-bit checks of
    a port against Lightning; by default ember's validation leaves every stream as it found it, so how often
    a run validates never changes how it trains.
    """

    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: float | str | timedelta | dict[str, int] | None = None,
        accelerator: str = "auto",
        devices: int | str = "auto",
        strategy: str | Strategy = "auto",
        num_nodes: int = 1,
        precision: str | int = "32-true",
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: float | int = 1.0,
        check_val_every_n_epoch: int = 1,
        num_sanity_val_steps: int = 2,
        limit_train_batches: float | int = 1.0,
        limit_val_batches: float | int = 1.0,
        limit_test_batches: float | int = 1.0,
        limit_predict_batches: float | int = 1.0,
        overfit_batches: float | int = 0.0,
        reload_dataloaders_every_n_epochs: int = 0,
        log_every_n_steps: int = 50,
        callbacks: Sequence[Callback] | Callback | None = None,
        logger: bool | Logger | Sequence[Logger] | None = True,
        enable_progress_bar: bool = True,
        enable_model_summary: bool = True,
        enable_checkpointing: bool = True,
        default_root_dir: str | os.PathLike[str] = "runs",
        run_name: str | None = None,
        requeue_signal: str | int | None = "SIGUSR1",
        deterministic: bool = False,
        benchmark: bool | None = None,
        inference_mode: bool = False,
        sync_batchnorm: bool = False,
        fast_dev_run: bool | int = False,
        detect_anomaly: bool = False,
        use_distributed_sampler: bool = True,
        nonfinite_loss: str | None = None,
        compile: bool | dict[str, Any] = False,
        profiler: str | ProfilerConfig | Profiler | dict[str, Any] | None = None,
        tune_cpu_allocator: bool = True,
        lightning_rng: bool = False,
        logger_timeout_s: float = 5.0,
    ) -> None:
        #: The options as checked and normalised (fast_dev_run applied, defaults resolved); frozen.
        self.options = options.build({name: value for name, value in locals().items() if name != "self"})
        self.strategy = options.resolve_strategy(self.options)
        #: ``Trainer(profiler=...)``: times the run's actions and hooks (ember/tuning/profiler.py); None: off.
        self.profiler = None if profiler is None else _resolve_profiler(profiler)
        #: The resolved config of a run launched from YAML; saved as config.yaml, in checkpoints, and as hparams.
        self.run_config: dict[str, Any] | None = None
        self.reporter = Reporter(self)
        self._finite_guard = FiniteGuard(nonfinite_loss)
        #: Finds, writes (at step boundaries, in the background when asked) and restores checkpoints.
        self.checkpoints = CheckpointManager()
        #: What the runs set up: the run directory, loggers, hooks, the module as prepared (`run.RunState`).
        self.run_state = RunState(loggers=resolve_loggers(self.options.logger))
        self._fit_state = FitState()
        self._eval_progress = EvalProgress()
        self._fit_loop: FitLoop | None = None

    def __getattr__(self, name: str) -> Any:
        """Only for names the Trainer lacks (options are read through `options.expose`, below the class)."""
        if name in _LIGHTNING_NAMES:
            raise AttributeError(f"Trainer has no {name!r}; in ember it is trainer.{_LIGHTNING_NAMES[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # --- public state (read-only views; ``should_stop`` is the one a hook sets) ---
    @property
    def progress(self) -> FitState:
        """Where the fits stand: epoch, step, batch position, stop reason (`loop.FitState`; the loop writes it)."""
        return self._fit_state

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self._fit_state.global_step

    @property
    def logs_this_batch(self) -> bool:
        """Whether the loggers write the step values of the training batch now running: every
        ``log_every_n_steps`` on the loggers' axis (``progress.batches_that_stepped``: optimizer steps, or batches
        under manual optimization), as Lightning's loggers do. Callbacks that log on the loggers' cadence read it."""
        return (self._fit_state.batches_that_stepped + 1) % self.options.log_every_n_steps == 0

    @property
    def current_epoch(self) -> int:
        """Index of the current training epoch (0-based)."""
        return self._fit_state.epoch

    @property
    def should_stop(self) -> bool:
        """Set it to True from any hook to stop fit at the next step boundary (once ``min_epochs`` and
        ``min_steps`` are done); reset when a run starts."""
        return self._fit_state.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._fit_state.request_stop(value)

    @property
    def stop_reason(self) -> str | None:
        """Why the most recent fit stopped: ``"max_epochs"``, ``"max_steps"``, ``"max_time"``, ``"should_stop"``;
        None while it runs, or when it ended by an error or a signal."""
        return self._fit_state.stop_reason

    @property
    def sanity_checking(self) -> bool:
        """Whether the sanity-check validation (before the first training epoch) runs now."""
        return self._fit_state.sanity_checking

    @property
    def stage(self) -> str | None:
        """The running entry point: ``"fit"``, ``"validate"``, ``"test"``, ``"predict"``; None between runs."""
        return self.run_state.stage

    @property
    def hooks(self) -> CallbackList:
        """The current run's callbacks (the module first) as one dispatcher."""
        if self.run_state.hooks is None:
            raise RuntimeError("trainer.hooks exists once fit/validate/test/predict has been called")
        return self.run_state.hooks

    @property
    def loggers(self) -> list[Logger]:
        """The loggers ``Trainer(logger=...)`` asked for (TensorBoard and CSV by default); empty on every process
        but 0 once a run started there."""
        return self.run_state.loggers

    @property
    def datamodule(self) -> DataModule | None:
        """The DataModule of the current (or most recent) run, if one was given."""
        return self.run_state.datamodule

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers of the current (or most recent) fit, as ``configure_optimizers`` returned them."""
        return self._fit_loop.optimizers if self._fit_loop is not None else []

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        """The schedulers of the current (or most recent) fit with their interval, frequency and monitor."""
        return self._fit_loop.lr_scheduler_configs if self._fit_loop is not None else []

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps the running fit will take (Lightning's name, e.g. for ``OneCycleLR(total_steps=...)`` in
        ``configure_optimizers``): ``max_steps`` when set, else the epoch's batches over
        ``accumulate_grad_batches`` (rounded up) times ``max_epochs``; inf when neither bounds the fit."""
        if self._fit_loop is None:
            raise RuntimeError(
                "trainer.estimated_stepping_batches exists once fit has its data (configure_optimizers on)"
            )
        per_epoch = math.ceil(self._fit_loop.plan.num_batches / self.accumulate_grad_batches)
        epochs = self.max_epochs if self.max_epochs is not None and self.max_epochs >= 0 else math.inf
        estimate = per_epoch * epochs if per_epoch else 0
        return float(self.max_steps) if self.max_steps >= 0 else float(estimate)

    @property
    def num_eval_batches(self) -> list[float]:
        """Batches per dataloader of the running validation/test/predict (inf: unknown length)."""
        return self._eval_progress.num_batches

    @property
    def eval_progress(self) -> EvalProgress:
        """The running validation/test/predict's sizes (`evaluation.EvalProgress`; evaluation writes it)."""
        return self._eval_progress

    @property
    def user_callbacks(self) -> list[Callback]:
        """The callbacks given to the Trainer (`callbacks` adds ember's defaults)."""
        callbacks: list[Callback] = self.options.callbacks
        return callbacks

    @property
    def callback_metrics(self) -> dict[str, float]:
        """Latest value of everything logged (step values and epoch aggregates), as floats."""
        return self.reporter.callback_metrics()

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The values most recently sent to the loggers, and the latest ones meant for them not sent yet (as in
        Lightning: a metric logged between two ``log_every_n_steps`` is here before a logger writes it)."""
        return self.reporter.logged_metrics()

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """Latest values of the metrics logged with ``prog_bar=True``."""
        return self.reporter.progress_bar_metrics()

    @property
    def last_eval_metrics(self) -> dict[str, float]:
        """Every epoch metric of the most recent validation/test run, as floats."""
        return self.reporter.last_eval_metrics

    @property
    def collector(self) -> MetricCollector:
        """Where ``self.log`` writes now (the evaluation's collector while one runs)."""
        return self.reporter.collector

    @property
    def fit_loop(self) -> FitLoop | None:
        """The running (or most recent) fit's loop: its epoch plan, loaders and data position."""
        return self._fit_loop

    @property
    def epoch_plan(self) -> EpochPlan:
        """Which batches of a training epoch end an accumulation window or validate."""
        return self._fit_loop.plan if self._fit_loop is not None else _NO_PLAN

    @property
    def num_val_batches(self) -> list[float]:
        """Batches per validation dataloader inside fit (inf: unknown length)."""
        return self._fit_loop.num_val_batches if self._fit_loop is not None else []

    @property
    def train_dataloader(self) -> Any:
        """The training DataLoader of the running (or most recent) fit, as the strategy distributed it."""
        return self._fit_loop.train_loader if self._fit_loop is not None else None

    @property
    def ckpt_path(self) -> Path | None:
        """The checkpoint the current run loaded (``ckpt_path`` resolved), or None."""
        return self.run_state.ckpt

    @property
    def finite_guard(self) -> FiniteGuard:
        """The non-finite loss guard (``nonfinite_loss``)."""
        return self._finite_guard

    @property
    def preemption(self) -> signals.PreemptionFlag:
        """The preemption signal handlers of the running fit (the flag the loop reads at boundaries)."""
        return self.run_state.preemption

    @property
    def module(self) -> TrainingModule:
        """The TrainingModule of the current (or most recent) fit/validate/test/predict."""
        if self.run_state.module is None:
            raise RuntimeError("trainer.module exists once fit/validate/test/predict has been called")
        return self.run_state.module

    @property
    def model(self) -> nn.Module:
        """The module as the strategy prepared it (moved, and wrapped under DDP/FSDP)."""
        if self.run_state.model is None:
            raise RuntimeError("trainer.model exists only inside fit/validate/test/predict")
        return self.run_state.model

    @property
    def logger(self) -> Logger | None:
        """The first logger, or None."""
        return self.loggers[0] if self.loggers else None

    @property
    def run_dir(self) -> Path:
        """``<default_root_dir>/<run name>/version_N``: config, checkpoints and logs of this run.

        Fixed (claimed) when the first fit/validate/test/predict starts; the run name is ``run_name`` or
        the module class in snake_case.
        """
        if self.run_state.run_dir is None:
            raise RuntimeError("trainer.run_dir is set when fit/validate/test/predict starts")
        return self.run_state.run_dir

    @property
    def run_url(self) -> str | None:
        """The run directory's URL when ``default_root_dir`` is one (``s3://bucket/runs/net/version_3``), else None.

        `run_dir` is then the run's local staging copy; its checkpoints and logs are copied to this URL
        (`ember.checkpoint.run_store`).
        """
        return self.run_state.run_url

    @property
    def log_dir(self) -> Path:
        """Alias of `run_dir`."""
        return self.run_dir

    @property
    def is_global_zero(self) -> bool:
        """Whether this is process 0 of the job (the one that logs, prints and writes shared files)."""
        return self.strategy.is_global_zero

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def callbacks(self) -> list[Callback]:
        """All callbacks of the current run: the user's plus the defaults ember added (before the first run:
        the user's)."""
        hooks = self.run_state.hooks
        return hooks.callbacks if hooks is not None else list(self.user_callbacks)

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first `ModelCheckpoint` of the current run, or None."""
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        """The `ModelCheckpoint` callbacks of the current run, in order."""
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    # --- entry points ---------------------------------------------------------
    def fit(
        self,
        module: TrainingModule | None = None,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        weights_only: bool | None = None,
        *,
        model: TrainingModule | None = None,
    ) -> None:
        """Train `module` until a stop condition holds (see the class docstring).

        The arguments are Lightning's, in its order. Data comes from ``train_dataloaders`` /
        ``val_dataloaders`` (a DataLoader, any iterable of batches, or a list of batches), else from
        ``datamodule`` (which may also be passed second, as in ``trainer.fit(module, datamodule)``), else from
        the module's own ``train_dataloader()`` / ``val_dataloader()``.

        ``ckpt_path`` resumes exactly from a checkpoint directory, from ``"last"``
        (the newest complete checkpoint of the newest run with this run name;
        training starts fresh, with an info line, when there is none) or from
        ``"best"`` (the best checkpoint of `ModelCheckpoint`).

        ``model=`` is Lightning's name for `module` (``trainer.fit(model=m)`` runs as written); pass one of
        the two. ``weights_only`` is accepted as in Lightning 2, where it is ``torch.load``'s switch between
        plain tensors and arbitrary pickled objects. An ember checkpoint is plain data, read without running
        code from the file whatever the value (docs/checkpoints.md), so it changes nothing here; the same
        holds for `validate`, `test` and `predict`.
        """
        module = the_module("fit", module, model)
        if module is None:
            raise TypeError("fit: no module given; pass the module to train: trainer.fit(module, ...)")
        check_weights_only("fit", weights_only)
        train_dataloaders, datamodule = split_datamodule("fit", train_dataloaders, datamodule)
        check_not_datamodule("fit", "val_dataloaders", val_dataloaders)
        if val_dataloaders is not None and datamodule is not None:
            raise ValueError("fit: pass val_dataloaders or a datamodule, not both (the datamodule brings its own)")
        as_list(train_dataloaders), as_list(val_dataloaders)  # a wrong kind of data fails here, before any hook
        check_ckpt_path("fit", ckpt_path)
        check_fit(self, module)
        with running(self, stages.FIT, module, datamodule, ckpt_path):
            loop = self._fit_loop = FitLoop.build(self, module, train_dataloaders, val_dataloaders, datamodule)
            loop.setup_optimizers()
            if self.ckpt_path is not None:
                loop.resume_from(self.ckpt_path, self.checkpoints.restore(self, module, self.ckpt_path))
                if loop.is_done():
                    where = stop_point(self._fit_state, self.max_epochs, self.max_steps)
                    info(self, f"this run already finished ({where}); nothing to do")
            record_hyperparameters(self, module, resumed=self.ckpt_path is not None)
            if loop.plan.num_batches == 0:
                return  # limit_train_batches=0 disables training
            loop.run()

    def validate(
        self,
        module: TrainingModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        datamodule: DataModule | None = None,
        weights_only: bool | None = None,
        model: TrainingModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one validation epoch; returns one dict of epoch metrics per dataloader.

        ``ckpt_path`` (a path, ``"last"`` or ``"best"``) loads those weights first. The parameters follow
        Lightning's order (``trainer.validate(module, loader, "best")``); a DataModule may be passed in place of
        the dataloaders. Without a module (after fit), the fitted module is used, with the best checkpoint of
        its `ModelCheckpoint` unless ``ckpt_path`` says otherwise, and its datamodule unless data is given.
        ``model=`` (Lightning's name for `module`) and ``weights_only`` are taken as in `fit`.
        """
        check_weights_only("validate", weights_only)
        return evaluate(
            self, stages.VALIDATE, the_module("validate", module, model), dataloaders, datamodule, ckpt_path
        )

    def test(
        self,
        module: TrainingModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        datamodule: DataModule | None = None,
        weights_only: bool | None = None,
        model: TrainingModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one test epoch; returns one dict of epoch metrics per dataloader (arguments as in `validate`)."""
        check_weights_only("test", weights_only)
        return evaluate(self, stages.TEST, the_module("test", module, model), dataloaders, datamodule, ckpt_path)

    def predict(
        self,
        module: TrainingModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        *,
        datamodule: DataModule | None = None,
        weights_only: bool | None = None,
        model: TrainingModule | None = None,
    ) -> list[Any]:
        """Run `predict_step` on every batch; returns the outputs (a list per dataloader if several)."""
        check_weights_only("predict", weights_only)
        outputs = evaluate(
            self, stages.PREDICT, the_module("predict", module, model), dataloaders, datamodule, ckpt_path
        )
        return outputs[0] if len(outputs) == 1 else outputs

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        weights_only: bool = False,
        *,
        async_save: bool = False,
        set_last: bool = False,
        on_done: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write a checkpoint directory at `path` with everything an exact resume needs.

        ``weights_only=True`` keeps the module weights (and hparams/config) only.
        The write is atomic: `path` appears complete or not at all, and an
        existing `path` is never overwritten. Called from a hook while training
        runs, the write happens at the next step boundary (the end of the
        current accumulation window, or of the epoch), so the checkpoint
        resumes exactly. ``async_save`` writes in a background thread;
        ``set_last`` points the ``last`` file beside `path` at it once it is
        complete; ``on_done(path)`` runs on this thread after that.
        """
        if is_url(path):
            raise ValueError(
                f"save_checkpoint({redact(str(path))!r}): a single checkpoint is written to a local path; to keep "
                "checkpoints on object storage use ModelCheckpoint(dirpath=URL)"
            )
        module = self.run_state.module
        if module is None:
            raise RuntimeError("save_checkpoint needs a module: call it during or after fit/validate/test/predict")
        self.checkpoints.request(Path(path), weights_only, async_save, set_last, on_done)
        if not self.training:
            self.checkpoints.flush(self, module)
        return Path(path)

    def snapshot(self, staging: dict[str, Tensor] | SnapshotPlan | None = None) -> Snapshot:
        """An in-memory copy, in host memory, of the training state an exact resume restores (model, optimizers,
        schedulers, precision, progress, metrics, datamodule, random streams, data position), taken now: call it at
        a step boundary (``on_train_batch_end`` of the batch that ended a step). `staging`: tensors of an earlier
        snapshot to copy into (and to keep the new ones in), so a rolling snapshot allocates once; or a
        `ember.checkpoint.snapshot_plan.SnapshotPlan`, which keeps its buffers and what it found of the model's
        state from one snapshot to the next (the same snapshot, for less host work). A `rewind` goes back to it.
        """
        loop, module = self._fit_loop, self.run_state.module
        if loop is None or not loop.running or module is None:
            raise RuntimeError("trainer.snapshot() works while a fit trains: call it from a training hook")
        plan = staging if isinstance(staging, SnapshotPlan) else None
        buffers = staging.staging if isinstance(staging, SnapshotPlan) else staging
        return gather(
            self, module, weights_only=False, copy=True, staging=buffers, on_cpu=True, only=TRAINING_ENTRIES, plan=plan
        )

    def rewind(
        self,
        snapshot: Snapshot,
        steps: int,
        *,
        stop: str | None = None,
        on_applied: Callable[[Rewind], None] | None = None,
    ) -> None:
        """Go back to `snapshot` (from `snapshot()`) at the next step boundary, leaving out the batches of `steps`
        optimizer steps from its position on (ember/trainer/rewind.py, docs/rewind.md). `on_applied(rewind)` runs
        once it is done (``rewind.skipped``: the positions left out). With `stop`, the fit saves a resumable
        ``last`` there instead and raises `ember.trainer.rewind.TooManyRewinds` with that message."""
        if self._fit_loop is None:
            raise RuntimeError("trainer.rewind() works while a fit trains: call it from a training hook")
        self._fit_loop.request_rewind(Rewind(snapshot, steps, stop=stop, on_applied=on_applied))

    def release_run(self) -> None:
        """Drop what the most recent run holds on to: the module and its prepared (wrapped) model, the fit's
        loop with its optimizers. The finders' scratch runs call it so the next fit wraps the module afresh."""
        self.strategy.release_model()
        self.run_state.release_module()
        self._fit_loop = None

    @property
    def training(self) -> bool:
        """Whether training epochs are running (a save asked for now waits for the next step boundary)."""
        return self._fit_loop is not None and self._fit_loop.running


options.expose(Trainer)  # trainer.max_epochs is trainer.options.max_epochs


def _resolve_profiler(value: Any) -> Profiler | None:
    from ember.tuning.profiler import resolve_profiler  # only a run with a profiler loads it

    return resolve_profiler(value)

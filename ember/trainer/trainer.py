"""`Trainer`: stores its options, then runs fit / validate / test / predict.

`__init__` checks and stores the options (`options.TrainerOptions`) and builds what they name (the
strategy, the profiler); the work happens in `fit` and friends. A run is a short sequence of named
steps (`_run`); the fit loop and its state are `loop.FitLoop`, evaluation is `evaluation.run_evaluation`,
the metrics path is `reporting.Reporter`. Other modules read the trainer through public names only.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from ember import checkpoint as ckpt
from ember import stages
from ember.callbacks.callback import Callback
from ember.callbacks.callback_list import CallbackList
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.loggers.logger import Logger
from ember.modules.datamodule import DataModule
from ember.modules.logging import MetricCollector
from ember.modules.module import TrainingModule
from ember.modules.optimizers import SchedulerConfig
from ember.strategies import launcher
from ember.strategies.strategy import Strategy
from ember.trainer import checkpointing, options, signals
from ember.trainer.data import EpochPlan, check_not_empty, num_batches, resolve_loaders
from ember.trainer.evaluation import run_evaluation
from ember.trainer.loop import FitLoop
from ember.trainer.numerics import FiniteGuard
from ember.trainer.optimization import setup_optimizers
from ember.trainer.progress import Progress
from ember.trainer.reporting import Reporter

if TYPE_CHECKING:
    from ember.tuning.profiler import Profiler, ProfilerConfig

_NO_PLAN = EpochPlan(0, 1, float("inf"))


class Trainer:
    """Runs a `TrainingModule`: ``fit``, ``validate``, ``test``, ``predict``.

    Keywords follow Lightning's names where the idea is the same; see
    docs/trainer.md for each. Stopping: ``max_epochs`` (default 1000 when
    neither it nor ``max_steps`` is set), ``max_steps`` (optimizer steps),
    ``max_time`` (seconds, ``timedelta``, ``"DD:HH:MM:SS"`` or a dict of
    ``timedelta`` fields), or ``trainer.should_stop = True`` from any hook.
    Every option is readable as an attribute (``trainer.max_epochs``) and, all
    together, as ``trainer.options``.
    """

    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        max_steps: int = -1,
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
        fast_dev_run: bool | int = False,
        detect_anomaly: bool = False,
        use_distributed_sampler: bool = True,
        nonfinite_loss: str | None = None,
        compile: bool | dict[str, Any] = False,
        profiler: str | ProfilerConfig | Profiler | dict[str, Any] | None = None,
    ) -> None:
        #: The options as checked and normalised (fast_dev_run applied, defaults resolved); frozen.
        self.options = options.build({name: value for name, value in locals().items() if name != "self"})
        self.strategy = options.resolve_strategy(self.options)
        #: ``Trainer(profiler=...)``: times the run's actions and hooks (ember/tuning/profiler.py); None: off.
        self.profiler = None if profiler is None else _resolve_profiler(profiler)
        #: The resolved config of a run launched from YAML; saved as config.yaml, in checkpoints, and as hparams.
        self.run_config: dict[str, Any] | None = None
        self.progress = Progress()
        self.should_stop = False
        self.sanity_checking = False
        self.stage: str | None = None
        self.loggers: list[Logger] = []
        self.optimizers: list[Optimizer] = []
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        #: Batches per dataloader of the running validation/test/predict (inf: unknown length).
        self.num_eval_batches: list[float] = []
        self.datamodule: DataModule | None = None
        self.hooks: CallbackList
        self.reporter = Reporter(self)
        self._finite_guard = FiniteGuard(nonfinite_loss)
        self._writer = checkpointing.CheckpointWriter()
        self._preemption = signals.PreemptionFlag([])
        self._loggers_resolved = False
        self._run_dir: Path | None = None
        self._module: TrainingModule | None = None
        self._model: nn.Module | None = None
        self._ckpt: Path | None = None
        self._fit_loop: FitLoop | None = None

    def __getattr__(self, name: str) -> Any:
        """Options read as attributes: ``trainer.max_epochs`` is ``trainer.options.max_epochs``."""
        if name in options.NAMES and "options" in self.__dict__:
            return getattr(self.options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # --- public state ---------------------------------------------------------
    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.progress.global_step

    @property
    def current_epoch(self) -> int:
        """Index of the current training epoch (0-based)."""
        return self.progress.epoch

    @property
    def user_callbacks(self) -> list[Callback]:
        """The callbacks given to the Trainer (`callbacks` adds ember's defaults)."""
        callbacks: list[Callback] = self.options.callbacks
        return callbacks

    @property
    def max_time_s(self) -> float | None:
        """``max_time`` in seconds (None: no budget)."""
        return self.options.max_time_s

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """``compile`` as torch.compile keywords; None when compiling is off."""
        return self.options.compile_options

    @property
    def callback_metrics(self) -> dict[str, float]:
        """Latest value of everything logged (step values and epoch aggregates), as floats."""
        return self.reporter.callback_metrics()

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The values most recently sent to the loggers."""
        return dict(self.reporter.logged)

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
    def train_collector(self) -> MetricCollector:
        return self.reporter.train_collector

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
    def epoch_start_state(self) -> dict[str, Any] | None:
        """Generator states the current training epoch's DataLoader iterator drew from (for exact resume)."""
        return self._fit_loop.epoch_start_state if self._fit_loop is not None else None

    @property
    def ckpt_path(self) -> Path | None:
        """The checkpoint the current run loaded (``ckpt_path`` resolved), or None."""
        return self._ckpt

    @property
    def finite_guard(self) -> FiniteGuard:
        """The non-finite loss guard (``nonfinite_loss``)."""
        return self._finite_guard

    @property
    def checkpoint_writer(self) -> checkpointing.CheckpointWriter:
        """Writes checkpoints at step boundaries (in the background when asked)."""
        return self._writer

    @property
    def preemption(self) -> signals.PreemptionFlag:
        """The preemption signal handlers of the running fit (the flag the loop reads at boundaries)."""
        return self._preemption

    @property
    def model(self) -> nn.Module:
        """The module as the strategy prepared it (moved, and wrapped under DDP/FSDP)."""
        if self._model is None:
            raise RuntimeError("trainer.model exists only inside fit/validate/test/predict")
        return self._model

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
        if self._run_dir is None:
            raise RuntimeError("trainer.run_dir is set when fit/validate/test/predict starts")
        return self._run_dir

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
        """All callbacks of the current run: the user's plus the defaults ember added."""
        return self.hooks.callbacks

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        """The `ModelCheckpoint` callbacks of the current run, in order."""
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    # --- entry points ---------------------------------------------------------
    def fit(
        self,
        module: TrainingModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Train `module` until a stop condition holds (see the class docstring).

        ``ckpt_path`` resumes exactly from a checkpoint directory, from ``"last"``
        (the newest complete checkpoint of the newest run with this run name;
        training starts fresh, with an info line, when there is none) or from
        ``"best"`` (the best checkpoint of `ModelCheckpoint`).
        """
        with self._run(stages.FIT, module, datamodule, ckpt_path):
            loop = self._fit_loop = self._build_fit_loop(module, train_dataloaders, val_dataloaders, datamodule)
            setup_optimizers(loop)
            if self._ckpt is not None:
                checkpointing.resume(loop, self._ckpt)
            from ember.trainer.setup import record_hyperparameters  # loaded with the run, as in _run

            record_hyperparameters(self, module, resumed=self._ckpt is not None)
            if loop.plan.num_batches == 0:
                return  # limit_train_batches=0 disables training
            loop.run()

    def _build_fit_loop(self, module: TrainingModule, train: Any, val: Any, datamodule: DataModule | None) -> FitLoop:
        """The fit's loop: its loaders (distributed by the strategy), epoch plan and validation sizes."""
        train_loaders = resolve_loaders("train", train, datamodule)
        if not train_loaders:
            raise ValueError("fit needs training data: pass train_dataloaders or a datamodule with train_dataloader()")
        if len(train_loaders) > 1:
            raise ValueError("fit takes one training dataloader; combine datasets into one loader")
        val_loaders = resolve_loaders("validation", val, datamodule)
        check_not_empty("train", train_loaders)
        check_not_empty("validation", val_loaders)
        train_loader = self.strategy.distribute_loader(train_loaders[0], training=True)
        val_loaders = [self.strategy.distribute_loader(v, training=False) for v in val_loaders]
        plan = EpochPlan.build(
            num_batches(train_loader, self.options.limit_train_batches, "limit_train_batches"),
            self.options.accumulate_grad_batches,
            self.options.val_check_interval,
        )
        self.strategy.check_same_batch_count(plan.num_batches)
        num_val = [num_batches(v, self.options.limit_val_batches, "limit_val_batches") for v in val_loaders]
        return FitLoop(self, module, train_loader, val_loaders, plan, num_val)

    def validate(
        self,
        module: TrainingModule,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[dict[str, float]]:
        """Run one validation epoch; returns one dict of epoch metrics per dataloader.

        ``ckpt_path`` (a path, ``"last"`` or ``"best"``) loads those weights first.
        """
        return self._evaluate(stages.VALIDATE, module, dataloaders, datamodule, ckpt_path)

    def test(
        self,
        module: TrainingModule,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[dict[str, float]]:
        """Run one test epoch; returns one dict of epoch metrics per dataloader (``ckpt_path`` as in validate)."""
        return self._evaluate(stages.TEST, module, dataloaders, datamodule, ckpt_path)

    def predict(
        self,
        module: TrainingModule,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[Any]:
        """Run `predict_step` on every batch; returns the outputs (a list per dataloader if several)."""
        outputs = self._evaluate(stages.PREDICT, module, dataloaders, datamodule, ckpt_path)
        return outputs[0] if len(outputs) == 1 else outputs

    def _evaluate(
        self,
        stage: stages.Stage,
        module: TrainingModule,
        loaders: Any,
        datamodule: DataModule | None,
        ckpt_path: str | os.PathLike[str] | None,
    ) -> list[Any]:
        with self._run(stage, module, datamodule, ckpt_path):
            if self._ckpt is not None:
                checkpointing.load_weights(self, module, self._ckpt)
            given = resolve_loaders(stage.loop, loaders, datamodule)
            resolved = [self.strategy.distribute_loader(d, False) for d in given]
            if not resolved:
                raise ValueError(f"{stage.loop} needs data: pass dataloaders or a datamodule with a {stage.loop} "
                                 "dataloader")  # fmt: skip
            check_not_empty(stage.loop, resolved)
            limit = getattr(self.options, stage.limit_option)
            limits = [num_batches(d, limit, stage.limit_option) for d in resolved]
            return run_evaluation(self, module, stage.loop, resolved, limits)
        raise AssertionError("unreachable")  # pragma: no cover  (mypy: _run re-raises)

    # --- a run: prepare, start, yield to the entry point, finish ------------------
    @contextlib.contextmanager
    def _run(
        self,
        stage: stages.Stage,
        module: TrainingModule,
        datamodule: DataModule | None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> Iterator[None]:
        if not isinstance(module, TrainingModule):
            raise TypeError(f"expected an ember.TrainingModule, got {type(module).__qualname__}")
        if self.profiler is not None:
            self.profiler.begin(self, stage.name)
        hooks, claimed = self._prepare(stage, module, ckpt_path)
        self.stage, self.should_stop, self.hooks = stage.name, False, hooks
        self._module, self.datamodule, module._trainer = module, datamodule, self
        status = "failed"
        try:
            self._start(stage, module, datamodule)
            with torch.autograd.detect_anomaly() if self.options.detect_anomaly else contextlib.nullcontext():
                yield
            self._writer.release()  # the last background write is complete (or its error raised) when fit returns
            status = "success"
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
            self.hooks.on_exception(exc)
            checkpointing.finish_writes_quietly(self)
            raise
        finally:
            self._finish(stage, datamodule, status, claimed)

    def _prepare(
        self, stage: stages.Stage, module: TrainingModule, ckpt_path: str | os.PathLike[str] | None
    ) -> tuple[CallbackList, tuple[Path, Path] | None]:
        """What can reject the run, before anything changes: callbacks, processes, loggers, the checkpoint to
        load and the run directory (process 0 claims a new version; every process uses it)."""
        from ember.trainer.setup import default_callbacks, resolve_loggers, run_name

        hooks = CallbackList(self, module, [*self.user_callbacks, *default_callbacks(self)])
        if self.strategy.needs_launch():
            launcher.relaunch(self.strategy.world_size_requested, signals.resolve_signal(self.options.requeue_signal))
        self.strategy.setup_environment()
        if not self._loggers_resolved:  # only process 0 logs; the others keep no loggers at all
            self.loggers = resolve_loggers(self.options.logger) if self.is_global_zero else []
            self._loggers_resolved = True
        root = Path(self.options.default_root_dir) / (self.options.run_name or run_name(module))
        self._ckpt, continued = checkpointing.resolve_ckpt_path(self, ckpt_path, root, stage.name)
        claimed: tuple[Path, Path] | None = None
        if continued is not None:
            self._run_dir = continued
        elif self._run_dir is None:
            claimed = ckpt.claim_version(root) if self.is_global_zero else None
            self._run_dir = self.strategy.broadcast(claimed[0] if claimed is not None else None)
        for logger in self.loggers:
            logger.attach(self.run_dir)
        return hooks, claimed

    def _start(self, stage: stages.Stage, module: TrainingModule, datamodule: DataModule | None) -> None:
        """Set the module up on its device(s), compile it if asked, catch preemption signals, call ``setup``."""
        self._model = self.strategy.setup_module(module)
        if self.compile_options is not None and not getattr(module, "_ember_compiled", False):
            self.strategy.compile_module(module, self.compile_options)  # in place: state_dict keys stay clean
            module._ember_compiled = True
        if self.options.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        if stage is stages.FIT:
            requeue = signals.resolve_signal(self.options.requeue_signal)
            self._preemption = signals.PreemptionFlag([signal.SIGTERM] + ([requeue] if requeue is not None else []))
            self._preemption.install()
        if datamodule is not None:
            datamodule.setup(stage.name)
        self.hooks.setup(stage.name)

    def _finish(
        self, stage: stages.Stage, datamodule: DataModule | None, status: str, claimed: tuple[Path, Path] | None
    ) -> None:
        """Undo what `_start` did, close the loggers, run ``teardown``; release an unused run directory."""
        self._preemption.restore()
        for logger in self.loggers:
            logger.finalize(status)
        self.hooks.teardown(stage.name)
        if datamodule is not None:
            datamodule.teardown(stage.name)
        self.strategy.teardown()
        self.stage = None
        if claimed is not None:
            ckpt.release_if_empty(*claimed)
        if self.profiler is not None:
            self.profiler.end(self)

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
        if self._module is None:
            raise RuntimeError("save_checkpoint needs a module: call it during or after fit/validate/test/predict")
        self._writer.request(Path(path), weights_only, async_save, set_last, on_done)
        if not self.training:
            self._writer.flush(self, self._module)
        return Path(path)

    @property
    def training(self) -> bool:
        """Whether training epochs are running (a save asked for now waits for the next step boundary)."""
        return self._fit_loop is not None and self._fit_loop.running


def _resolve_profiler(value: Any) -> Profiler | None:
    from ember.tuning.profiler import resolve_profiler  # only a run with a profiler loads it

    return resolve_profiler(value)

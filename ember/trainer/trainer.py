"""`Trainer`: stores options, then runs fit / validate / test / predict.

`__init__` validates and stores; the work happens in `fit` and friends, whose
loops live in `ember/trainer/loop.py`.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ember import checkpoint as ckpt
from ember.callbacks.callback import Callback
from ember.callbacks.callback_list import CallbackList
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.loggers.logger import Logger
from ember.modules.datamodule import DataModule
from ember.modules.logging import MetricCollector, to_floats
from ember.modules.module import TrainingModule
from ember.modules.optimizers import SchedulerConfig
from ember.strategies import allocator, launcher
from ember.strategies.strategy import Strategy
from ember.trainer import checkpointing, loop, options, signals
from ember.trainer.data import EpochPlan, check_not_empty, num_batches, resolve_loaders
from ember.trainer.numerics import FiniteGuard
from ember.trainer.optimization import setup_optimizers
from ember.trainer.progress import Progress

_LIMIT_NAME = {"validation": "val", "test": "test", "predict": "predict"}


class Trainer:
    """Runs a `TrainingModule`: ``fit``, ``validate``, ``test``, ``predict``.

    Keywords follow Lightning's names where the idea is the same; see
    docs/trainer.md for each. Stopping: ``max_epochs`` (default 1000 when
    neither it nor ``max_steps`` is set), ``max_steps`` (optimizer steps),
    ``max_time`` (seconds, ``timedelta``, ``"DD:HH:MM:SS"`` or a dict of
    ``timedelta`` fields), or ``trainer.should_stop = True`` from any hook.
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
        tune_cpu_allocator: bool = True,
    ) -> None:
        options.check(
            accumulate_grad_batches=accumulate_grad_batches,
            log_every_n_steps=log_every_n_steps,
            check_val_every_n_epoch=check_val_every_n_epoch,
            limits={
                "limit_train_batches": limit_train_batches,
                "limit_val_batches": limit_val_batches,
                "limit_test_batches": limit_test_batches,
                "limit_predict_batches": limit_predict_batches,
            },
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            val_check_interval=val_check_interval,
            num_sanity_val_steps=num_sanity_val_steps,
        )
        if fast_dev_run:
            n = 1 if fast_dev_run is True else int(fast_dev_run)
            options.check_positive_int("fast_dev_run", n)
            max_epochs, max_steps, num_sanity_val_steps, val_check_interval = 1, n, 0, 1.0
            limit_train_batches = limit_val_batches = limit_test_batches = limit_predict_batches = n
            logger, enable_checkpointing = False, False
        self.max_epochs = 1000 if max_epochs is None and max_steps == -1 else max_epochs
        self.max_steps = max_steps
        self.max_time_s = options.parse_max_time(max_time)
        self.strategy = options.resolve_strategy(
            strategy, accelerator, devices, num_nodes, precision, use_distributed_sampler
        )
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val or None  # 0: no clipping, as in Lightning
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.num_sanity_val_steps = num_sanity_val_steps
        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        self.limit_test_batches = limit_test_batches
        self.limit_predict_batches = limit_predict_batches
        self.log_every_n_steps = log_every_n_steps
        self.user_callbacks = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        self._logger_option = logger
        self.enable_progress_bar = enable_progress_bar
        self.enable_model_summary = enable_model_summary
        self.enable_checkpointing = enable_checkpointing
        self.default_root_dir = os.fspath(default_root_dir)
        self.run_name = run_name
        self.requeue_signal = signals.resolve_signal(requeue_signal)
        #: The resolved config of a run launched from YAML; saved as config.yaml, in checkpoints, and as hparams.
        self.run_config: dict[str, Any] | None = None
        self._run_dir: Path | None = None
        self.deterministic = deterministic
        self.fast_dev_run = fast_dev_run
        self.detect_anomaly = detect_anomaly
        self._finite_guard = FiniteGuard(nonfinite_loss)
        self.compile_options = options.compile_options(compile)
        self.tune_cpu_allocator = tune_cpu_allocator

        self.progress = Progress()
        self.should_stop = False
        self.sanity_checking = False
        self.stage: str | None = None
        self.loggers: list[Logger] = []
        self._loggers_resolved = False
        self.optimizers: list[Optimizer] = []
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.train_collector = MetricCollector(reduce=self.strategy.reduce)
        self.eval_collector = MetricCollector(reduce=self.strategy.reduce)
        self.collector = self.train_collector
        self.epoch_plan = EpochPlan(0, 1, math.inf)
        self.num_val_batches: list[float] = []
        #: Batches per dataloader of the running validation/test/predict (inf: unknown length).
        self.num_eval_batches: list[float] = []
        self._epoch_metrics: dict[str, Any] = {}
        #: Every epoch metric of the most recent validation/test run, as floats.
        self.last_eval_metrics: dict[str, float] = {}
        self._logged: dict[str, float] = {}
        self._window_has_grads = False
        self._automatic = True
        self._clock = loop.Clock(None)
        self._module: TrainingModule | None = None
        self.datamodule: DataModule | None = None
        self._ckpt: Path | None = None
        #: Generator states the current training epoch's DataLoader iterator drew from (for exact resume).
        self.epoch_start_state: dict[str, Any] | None = None
        self._resume_state: dict[str, Any] | None = None
        self.train_dataloader: Any = None
        self._writer = checkpointing.CheckpointWriter()
        self._in_train_loop = False
        self._preemption = signals.PreemptionFlag([])
        self._model: nn.Module | None = None
        self.hooks: CallbackList

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
    def callback_metrics(self) -> dict[str, float]:
        """Latest value of everything logged (step values and epoch aggregates), as floats."""
        return to_floats({**self._epoch_metrics, **self._step_metrics()})

    def _step_metrics(self) -> dict[str, Any]:
        """The latest step values: what the module logged plus the precision plugin's (skipped steps)."""
        return {**self.train_collector.step_values, **self.strategy.precision.step_metrics()}

    @property
    def logged_metrics(self) -> dict[str, float]:
        """The values most recently sent to the loggers."""
        return dict(self._logged)

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """Latest values of the metrics logged with ``prog_bar=True``."""
        names = self.train_collector.prog_bar_names | self.eval_collector.prog_bar_names
        merged = {**self._epoch_metrics, **self.train_collector.step_values}
        return to_floats({k: v for k, v in merged.items() if k in names})

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

        Fixed when the first fit/validate/test/predict starts (created on the
        first write); the run name is ``run_name`` or the module class in
        snake_case.
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
        with self._run("fit", module, datamodule, ckpt_path):
            train = resolve_loaders("train", train_dataloaders, datamodule)
            if not train:
                raise ValueError(
                    "fit needs training data: pass train_dataloaders or a datamodule with train_dataloader()"
                )
            if len(train) > 1:
                raise ValueError("fit takes one training dataloader; combine datasets into one loader")
            val = resolve_loaders("validation", val_dataloaders, datamodule)
            check_not_empty("train", train)
            check_not_empty("validation", val)
            train = [self.strategy.distribute_loader(train[0], training=True)]
            val = [self.strategy.distribute_loader(v, training=False) for v in val]
            self.train_dataloader = train[0]
            self.epoch_plan = EpochPlan.build(
                num_batches(train[0], self.limit_train_batches, "limit_train_batches"),
                self.accumulate_grad_batches,
                self.val_check_interval,
            )
            self.strategy.check_same_batch_count(self.epoch_plan.num_batches)
            self.num_val_batches = [num_batches(v, self.limit_val_batches, "limit_val_batches") for v in val]
            setup_optimizers(self, module)
            if self._ckpt is not None:
                self._resume_state = checkpointing.resume(self, module, self._ckpt)
            from ember.trainer.setup import record_hyperparameters  # loaded with the run, as in _run

            record_hyperparameters(self, module, resumed=self._ckpt is not None)
            self._clock = loop.Clock(self.max_time_s)
            if self.epoch_plan.num_batches == 0:
                return  # limit_train_batches=0 disables training
            loop.run_fit(self, module, train[0], val)

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
        return self._evaluate("validation", module, dataloaders, datamodule, self.limit_val_batches, ckpt_path)

    def test(
        self,
        module: TrainingModule,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[dict[str, float]]:
        """Run one test epoch; returns one dict of epoch metrics per dataloader (``ckpt_path`` as in validate)."""
        return self._evaluate("test", module, dataloaders, datamodule, self.limit_test_batches, ckpt_path)

    def predict(
        self,
        module: TrainingModule,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> list[Any]:
        """Run `predict_step` on every batch; returns the outputs (a list per dataloader if several)."""
        outputs = self._evaluate("predict", module, dataloaders, datamodule, self.limit_predict_batches, ckpt_path)
        return outputs[0] if len(outputs) == 1 else outputs

    def _evaluate(
        self,
        stage: str,
        module: TrainingModule,
        loaders: Any,
        datamodule: DataModule | None,
        limit: float | int,
        ckpt_path: str | os.PathLike[str] | None,
    ) -> list[Any]:
        with self._run({"validation": "validate"}.get(stage, stage), module, datamodule, ckpt_path):
            if self._ckpt is not None:
                checkpointing.load_weights(self, module, self._ckpt)
            resolved = [self.strategy.distribute_loader(d, False) for d in resolve_loaders(stage, loaders, datamodule)]
            if not resolved:
                raise ValueError(f"{stage} needs data: pass dataloaders or a datamodule with a {stage} dataloader")
            check_not_empty(stage, resolved)
            name = f"limit_{_LIMIT_NAME[stage]}_batches"
            return loop.run_evaluation(self, module, stage, resolved, [num_batches(d, limit, name) for d in resolved])
        raise AssertionError("unreachable")  # pragma: no cover  (mypy: _run re-raises)

    # --- run setup and teardown -------------------------------------------------
    @contextlib.contextmanager
    def _run(
        self,
        stage: str,
        module: TrainingModule,
        datamodule: DataModule | None,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> Iterator[None]:
        if not isinstance(module, TrainingModule):
            raise TypeError(f"expected an ember.TrainingModule, got {type(module).__qualname__}")
        from ember.trainer.setup import default_callbacks, resolve_loggers, run_name

        # What can reject the run comes first, so a rejected run leaves the trainer idle.
        hooks = CallbackList(self, module, [*self.user_callbacks, *default_callbacks(self)])
        if self.strategy.needs_launch():
            launcher.relaunch(self.strategy.world_size_requested, self.requeue_signal)  # N processes; exits
        self.strategy.setup_environment()
        allocator.tune_cpu_allocator(self.tune_cpu_allocator)  # once per process, before the run allocates
        if not self._loggers_resolved:
            # Only process 0 logs; the others keep no loggers at all.
            self.loggers = resolve_loggers(self._logger_option) if self.is_global_zero else []
            self._loggers_resolved = True
        root = Path(self.default_root_dir) / (self.run_name or run_name(module))
        self._ckpt, continued = checkpointing.resolve_ckpt_path(self, ckpt_path, root, stage)
        claimed: tuple[Path, Path] | None = None
        if continued is not None:
            self._run_dir = continued
        elif self._run_dir is None:
            # Process 0 claims a new version directory (an exclusive mkdir); every process uses it.
            claimed = ckpt.claim_version(root) if self.is_global_zero else None
            self._run_dir = self.strategy.broadcast(claimed[0] if claimed is not None else None)
        for logger in self.loggers:
            logger.attach(self.run_dir)
        self.stage = stage
        self.should_stop = False
        self._module = module
        self.datamodule = datamodule
        self.hooks = hooks
        module._trainer = self
        status = "failed"
        try:
            self._model = self.strategy.setup_module(module)
            if self.compile_options is not None and not getattr(module, "_ember_compiled", False):
                self.strategy.compile_module(module, self.compile_options)  # in place: state_dict keys stay clean
                module._ember_compiled = True
            if self.deterministic:
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
                torch.use_deterministic_algorithms(True)
            if stage == "fit":
                self._preemption = signals.PreemptionFlag(
                    [signal.SIGTERM] + ([self.requeue_signal] if self.requeue_signal is not None else [])
                )
                self._preemption.install()
            if datamodule is not None:
                datamodule.setup(stage)
            self.hooks.setup(stage)
            with torch.autograd.detect_anomaly() if self.detect_anomaly else contextlib.nullcontext():
                yield
            self._writer.release()  # the last background write is complete (or its error raised) when fit returns
            status = "success"
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
            self.hooks.on_exception(exc)
            checkpointing.finish_writes_quietly(self)
            raise
        finally:
            self._preemption.restore()
            for logger in self.loggers:
                logger.finalize(status)
            self.hooks.teardown(stage)
            if datamodule is not None:
                datamodule.teardown(stage)
            self.strategy.teardown()
            self.stage = None
            if claimed is not None:
                ckpt.release_if_empty(*claimed)

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
        if not self._in_train_loop:
            self._writer.flush(self, self._module)
        return Path(path)

    # --- used by the loops ---------------------------------------------------------
    def _should_stop_in_epoch(self) -> bool:
        return (
            self.should_stop
            or 0 <= self.max_steps <= self.progress.global_step
            or (self.max_time_s is not None and self._clock.expired())
        )

    def _fit_is_done(self) -> bool:
        epochs_done = self.max_epochs is not None and self.progress.epoch >= self.max_epochs
        return epochs_done or self._should_stop_in_epoch()

    def _log_metrics(self, metrics: dict[str, Any]) -> None:
        self._finite_guard.check()  # the loggers are about to sync anyway
        if not metrics or not self.loggers or not self.is_global_zero:
            return
        floats = to_floats(metrics)
        self._logged.update(floats)
        floats["epoch"] = self.progress.epoch
        for logger in self.loggers:
            logger.log_metrics(floats, self.progress.global_step)

    def _log_epoch_metrics(self, metrics: dict[str, Any]) -> None:
        self._epoch_metrics.update(metrics)
        self._log_metrics(metrics)
        for logger in self.loggers:
            logger.save()

    def _finish_eval(self, metrics: dict[str, Any], num_loaders: int) -> list[dict[str, float]]:
        """Store an evaluation's epoch metrics; split them per dataloader."""
        if self.sanity_checking:
            return []
        self._log_epoch_metrics(metrics)
        floats = self.last_eval_metrics = to_floats(metrics)
        if num_loaders == 1:
            return [floats]
        return [{k: v for k, v in floats.items() if k.endswith(f"/dataloader_idx_{i}")} for i in range(num_loaders)]

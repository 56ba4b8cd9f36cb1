"""A run: one fit / validate / test / predict call, from what can reject it to its teardown.

`running` is the frame every entry point runs in, as a short sequence of named steps: `prepare` (what
can reject the run, before anything changes: callbacks, processes, loggers, the checkpoint to load,
the run directory), `start` (the module set up on its devices, compiled, signals caught, ``setup``),
the entry point's own work, then `finish` (everything undone, loggers closed, ``teardown``), with
``on_exception`` for a failure at any point after `prepare`. What a run sets up is kept in the
trainer's `RunState`, which only this module writes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ember import checkpoint as ckpt
from ember import stages
from ember.callbacks.callback_list import CallbackList
from ember.callbacks.model_checkpoint import ModelCheckpoint
from ember.checkpoint import run_status, run_store
from ember.checkpoint.run_lock import RunLockedError
from ember.checkpoint.store import is_url, join, redact
from ember.loggers.guard import LoggerGuard
from ember.loggers.logger import Logger
from ember.modules.datamodule import DataModule
from ember.modules.module import TrainingModule
from ember.strategies import allocator, launcher
from ember.trainer import signals
from ember.trainer.data import release_workers
from ember.trainer.setup import default_callbacks, run_name

if TYPE_CHECKING:
    from ember.trainer.trainer import Trainer


@dataclass
class RunState:
    """What the trainer's runs set up. The run directory and the loggers are kept from the first run on;
    the rest describes the current (or most recent) run. Written by this module alone."""

    run_dir: Path | None = None
    #: The run directory's URL when ``default_root_dir`` is one (`run_dir` is then its local staging copy).
    run_url: str | None = None
    #: Copies the run directory's logs to `run_url` (process 0 of a run on a store; `ember.checkpoint.run_store`).
    log_sync: run_store.LogSync | None = None
    #: Built from ``Trainer(logger=...)`` when the trainer is (so ``trainer.logger`` exists before fit, as in
    #: Lightning); processes other than 0 drop them when their first run starts.
    loggers: list[Logger] = field(default_factory=list)
    loggers_resolved: bool = False
    #: Every call into the loggers goes through it: a failing or hanging logger never blocks the run.
    logger_guard: LoggerGuard = field(default_factory=LoggerGuard)
    #: The running entry point's name (`ember.stages`); None between runs.
    stage: str | None = None
    #: The run's callbacks, the module first (`CallbackList`).
    hooks: CallbackList | None = None
    datamodule: DataModule | None = None
    module: TrainingModule | None = None
    #: The module as the strategy prepared it (moved, wrapped).
    model: nn.Module | None = None
    #: The checkpoint this run loaded (``ckpt_path`` resolved).
    ckpt: Path | None = None
    #: What ``status.json`` calls the runs of this trainer (`label_command`); None: the entry point's name.
    command: str | None = None
    preemption: signals.PreemptionFlag = field(default_factory=lambda: signals.PreemptionFlag([]))

    def release_module(self) -> None:
        """Forget the module and its prepared model (`Trainer.release_run`)."""
        self.module = self.model = None


#: Modules whose BatchNorm layers a run converted to SyncBatchNorm (once per module: a later run keeps them).
_SYNC_BATCHNORM: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@contextlib.contextmanager
def running(
    trainer: Trainer,
    stage: stages.Stage,
    module: TrainingModule,
    datamodule: DataModule | None,
    ckpt_path: str | os.PathLike[str] | None = None,
) -> Iterator[None]:
    """Run the block as `stage` of `module` (see the module docstring)."""
    if not isinstance(module, TrainingModule):
        raise TypeError(f"expected an ember.TrainingModule, got {type(module).__qualname__}")
    if trainer.profiler is not None:
        trainer.profiler.begin(trainer, stage.name)
    hooks, claimed = prepare(trainer, stage, module, ckpt_path)
    state = trainer.run_state
    state.stage, state.hooks, state.datamodule, state.module = stage.name, hooks, datamodule, module
    trainer.progress.begin_run()
    trainer.reporter.start_run()
    module.trainer = trainer
    if datamodule is not None:
        datamodule.attach(trainer)
    status, error, owned = "failed", None, False
    try:
        owned = begin_status(trainer, stage, claimed)
        start(trainer, stage, module, datamodule)
        with torch.autograd.detect_anomaly() if trainer.options.detect_anomaly else contextlib.nullcontext():
            yield
        trainer.checkpoints.release()  # the last background write is complete (or raised) when fit returns
        status = "success"
    except BaseException as exc:
        status = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
        error = exc
        hooks.on_exception(exc)
        trainer.checkpoints.finish_quietly()
        raise
    finally:
        if owned:
            end_status(trainer, stage, error)
        finish(trainer, stage, datamodule, status, claimed)


def prepare(
    trainer: Trainer, stage: stages.Stage, module: TrainingModule, ckpt_path: str | os.PathLike[str] | None
) -> tuple[CallbackList, tuple[Path, Path] | None]:
    """What can reject the run, before anything changes: callbacks, processes, loggers, the checkpoint to load
    and the run directory (process 0 claims a new version; every process uses it). Returns the hooks and the
    claimed directory (with the deepest folder above it that existed before), if one was claimed."""
    state, options = trainer.run_state, trainer.options
    hooks = CallbackList(trainer, module, [*trainer.user_callbacks, *default_callbacks(trainer)])
    if trainer.strategy.needs_launch():
        launcher.relaunch(trainer.strategy.world_size_requested, signals.resolve_signal(options.requeue_signal))
    trainer.strategy.setup_environment()
    device_type = trainer.strategy.root_device.type
    allocator.tune_cpu_allocator(options.tune_cpu_allocator, device_type)  # once per process, before allocating
    if not state.loggers_resolved:  # only process 0 logs; the others keep no loggers at all
        if not trainer.is_global_zero:
            state.loggers = []
        state.loggers_resolved = True
    name = options.run_name or run_name(module)
    url_root = join(str(options.default_root_dir), name) if is_url(options.default_root_dir) else None
    root = _local_root(str(options.default_root_dir)) / name
    savers = [cb for cb in trainer.user_callbacks if isinstance(cb, ModelCheckpoint)]
    folders = [Path(cb.dirpath) for cb in savers if cb.dirpath]
    known_best = next((cb.best_model_path for cb in savers if cb.best_model_path), None)
    stores = [cb.store_url for cb in savers if cb.store_url]
    state.ckpt, continued = trainer.checkpoints.resolve(
        trainer, ckpt_path, root, stage.name, folders, known_best, stores, url_root
    )
    claimed: tuple[Path, Path] | None = None
    if continued is not None:
        state.run_dir = continued
    elif state.run_dir is None:
        claimed = _claim(trainer, root, url_root) if trainer.is_global_zero else None
        state.run_dir = trainer.strategy.broadcast(claimed[0] if claimed is not None else None)
        if url_root is not None:  # each process stages the run in its own folder: machines need share nothing
            state.run_dir = root / state.run_dir.name
            state.run_dir.mkdir(parents=True, exist_ok=True)
    if url_root is not None and state.run_dir is not None:
        state.run_url = join(url_root, state.run_dir.name)
    if stage is stages.FIT:
        hold_run(trainer, claimed)
    try:
        for logger in trainer.loggers:
            logger.attach(trainer.run_dir)
        state.logger_guard.attach(trainer.loggers, state.run_dir, options.logger_timeout_s)
        if state.run_url is not None and trainer.is_global_zero:
            state.log_sync = run_store.LogSync(trainer.run_dir, state.run_url, run_store.sync_every_s())
    except BaseException:
        trainer.checkpoints.release_run()  # `finish` will not run: nothing of this run started
        raise
    return hooks, claimed


def _local_root(default_root_dir: str) -> Path:
    """Where the run directories live on this machine: `default_root_dir`, or for a URL its staging folder."""
    if not is_url(default_root_dir):
        return Path(default_root_dir)
    return run_store.staging_dir(default_root_dir)


def _claim(trainer: Trainer, root: Path, url_root: str | None) -> tuple[Path, Path]:
    """A new ``version_N`` (process 0): in `root`, numbered by the store when the run lives on one (`url_root`).
    Returns it and the folder `release_if_empty` keeps."""
    if url_root is None:
        return ckpt.claim_version(root, Path(trainer.options.default_root_dir).parent)
    return run_store.claim_version(url_root, root)[0], root


def hold_run(trainer: Trainer, claimed: tuple[Path, Path] | None) -> None:
    """Fit writes into its run directory: process 0 holds the run's writer lock until `finish` (one writer per
    run), and every process learns whether it could, so a refused job stops everywhere before it writes."""
    error: ckpt.CheckpointError | None = None
    if trainer.is_global_zero:
        try:
            trainer.checkpoints.claim_run(trainer.run_dir, trainer.run_state.run_url)
        except ckpt.CheckpointError as exc:
            error = exc
    refusal = trainer.strategy.broadcast(None if error is None else str(error))
    if refusal is None:
        return
    if claimed is not None and trainer.world_size == 1:
        ckpt.release_if_empty(*claimed)
    raise error if error is not None else RunLockedError(refusal)


def start(trainer: Trainer, stage: stages.Stage, module: TrainingModule, datamodule: DataModule | None) -> None:
    """Prepare the data (``prepare_data``, once per node), set the module up on its device(s) (SyncBatchNorm
    if asked), compile it if asked, catch preemption signals, call ``setup``."""
    state, options = trainer.run_state, trainer.options
    prepare_data(trainer, module, datamodule)
    if options.sync_batchnorm and trainer.world_size > 1 and module not in _SYNC_BATCHNORM:
        if trainer.strategy.root_device.type == "cpu":
            raise ValueError("sync_batchnorm=True: torch's SyncBatchNorm runs on GPUs only; drop it for CPU processes")
        nn.SyncBatchNorm.convert_sync_batchnorm(module)  # in place: the module's children are replaced
        _SYNC_BATCHNORM.add(module)  # once: a later run keeps the converted layers
    if options.benchmark is not None:
        torch.backends.cudnn.benchmark = options.benchmark
    state.model = trainer.strategy.setup_module(module)
    compile_options = trainer.options.compile_options
    if compile_options is not None:
        trainer.strategy.compile_module(module, compile_options)  # in place, once: state_dict keys stay clean
    if trainer.options.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if stage is stages.FIT:
        requeue = signals.resolve_signal(trainer.options.requeue_signal)
        state.preemption = signals.PreemptionFlag([signal.SIGTERM] + ([requeue] if requeue is not None else []))
        state.preemption.install()
    if datamodule is not None:
        datamodule.setup(stage.name)
    trainer.hooks.setup(stage.name)


def prepare_data(trainer: Trainer, module: TrainingModule, datamodule: DataModule | None) -> None:
    """``prepare_data`` of the datamodule and the module, as in Lightning: on local rank 0 of each node (global rank
    0 when the datamodule sets ``prepare_data_per_node = False``), while the other processes wait."""
    strategy = trainer.strategy
    per_node = datamodule.prepare_data_per_node if datamodule is not None else True
    rank = getattr(strategy, "local_rank", 0) if per_node else strategy.global_rank
    if rank == 0:
        if datamodule is not None:
            datamodule.prepare_data()
        module.prepare_data()
    if trainer.world_size > 1:
        strategy.barrier()


def finish(
    trainer: Trainer, stage: stages.Stage, datamodule: DataModule | None, status: str, claimed: tuple[Path, Path] | None
) -> None:
    """Undo what `start` did, close the loggers, run ``teardown``; release an unused run directory (one
    process only: in a job, another process may still write into it, e.g. ``ember predict``'s outputs). The
    run's writer lock is let go last, whatever failed before."""
    try:
        trainer.run_state.preemption.restore()
        trainer.run_state.logger_guard.finalize(status)  # waits at most logger_timeout_s; says what was not sent
        trainer.hooks.teardown(stage.name)
        if datamodule is not None:
            datamodule.teardown(stage.name)
        trainer.strategy.teardown()
        if stage is stages.FIT and trainer.fit_loop is not None:  # (an evaluation's loaders are its own locals)
            release_workers([trainer.fit_loop.train_loader, *trainer.fit_loop.val_loaders])
        trainer.run_state.stage = None
    finally:
        trainer.checkpoints.release_run()
        sync, trainer.run_state.log_sync = trainer.run_state.log_sync, None
        if sync is not None:  # the last copy of the logs, status.json's end included (also on preemption)
            sync.close()
    if claimed is not None and trainer.world_size == 1:
        run_status.discard_if_alone(claimed[0])
        ckpt.release_if_empty(*claimed)
        if trainer.run_state.run_url is not None and not claimed[0].exists():  # released: so is its store version
            run_store.release_if_unused(trainer.run_state.run_url)
    if trainer.profiler is not None:
        trainer.profiler.end(trainer)


def label_command(trainer: Trainer, command: str) -> None:
    """Name what `trainer`'s runs are in their ``status.json`` (``"tune lr"``, ``"sweep trial"``): a trainer
    built for one purpose by ember's own tools."""
    trainer.run_state.command = command


def begin_status(trainer: Trainer, stage: stages.Stage, claimed: tuple[Path, Path] | None) -> bool:
    """Record the run's start in ``<run dir>/status.json`` when it owns the directory (a fit, or a run that claimed
    a new version; an evaluation writing into a fit's run leaves that run's record alone). Process 0 only;
    returns whether it recorded."""
    if not trainer.is_global_zero or (stage is not stages.FIT and claimed is None):
        return False
    url = trainer.run_state.run_url
    run_status.begin(trainer.run_dir, trainer.run_state.command or stage.name, redact(url) if url else None)
    return True


def end_status(trainer: Trainer, stage: stages.Stage, error: BaseException | None) -> None:
    """Record how the run ended (`ember.checkpoint.run_status`): ``preempted`` (a preemption signal), ``stopped``
    (Ctrl-C, ``max_time``, a callback's ``should_stop``), ``failed`` (an exception), else ``finished``. A failure
    to write it is a warning: the run's own outcome stands."""
    details: dict[str, object] = {}
    if isinstance(error, signals.Preempted):
        status, details["reason"] = "preempted", signals.signal_name(error.signum)
    elif isinstance(error, (KeyboardInterrupt, SystemExit)):
        status, details["reason"] = "stopped", "interrupted"
    elif error is not None:
        status, details["error"] = "failed", (f"{type(error).__name__}: {error}".splitlines() or [""])[0][:300]
    elif stage is stages.FIT and trainer.stop_reason in ("max_time", "should_stop"):
        status, details["reason"] = "stopped", _stopped_by(trainer)
    else:
        status = "finished"
        if stage is stages.FIT and trainer.stop_reason is not None:
            details["reason"] = trainer.stop_reason
    if stage is stages.FIT:
        details.update(epoch=trainer.current_epoch, global_step=trainer.global_step)
    try:
        run_status.end(trainer.run_dir, status, **details)
    except OSError as exc:
        warnings.warn(f"could not record the run's status in {trainer.run_dir}: {exc}", RuntimeWarning, stacklevel=2)


def _stopped_by(trainer: Trainer) -> str:
    """``max_time``, or the callback that asked to stop (one with a ``stopping_reason``), else ``should_stop``."""
    if trainer.stop_reason == "max_time":
        return "max_time"
    asked = [type(cb).__name__ for cb in trainer.callbacks if isinstance(getattr(cb, "stopping_reason", None), str)]
    return asked[0] if asked else "should_stop"


def record_evaluation(trainer: Trainer, stage: stages.Stage, results: list[dict[str, float]]) -> Path | None:
    """Write the metrics of validating or testing a loaded checkpoint to ``<run dir>/eval/<stage>-<checkpoint
    name>.json`` (process 0; replaced atomically when the same checkpoint is evaluated again); returns the path.

    The record names the checkpoint, what it holds (`ember.checkpoint.summarize`: epochs, step, monitored
    values) and the metrics per dataloader. Nothing is written without a loaded checkpoint.
    """
    import json
    import time

    from ember.checkpoint.files import atomic_write

    loaded = trainer.run_state.ckpt
    if loaded is None or not trainer.is_global_zero or stage is stages.PREDICT:
        return None
    record = {
        "stage": stage.name,
        "checkpoint": str(loaded),
        **ckpt.summarize(loaded),
        "metrics": results[0] if len(results) == 1 else results,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = eval_dir(trainer) / f"{stage.name}-{loaded.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(record, indent=2) + "\n")
    return path


def eval_dir(trainer: Trainer) -> Path:
    """``<run dir>/eval``: where the results of evaluating a checkpoint are kept."""
    return trainer.run_dir / "eval"
